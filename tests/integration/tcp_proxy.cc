#include "tests/integration/tcp_proxy.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace ckpt::testing {
namespace {

constexpr int kCut = 1;
constexpr int kHeal = 2;
constexpr int kStop = 3;
constexpr size_t kMaxBuffered = 1 << 20;  // per direction; reading pauses above this
constexpr int kPollMs = 100;

void Die(const char* what) {
  std::perror(what);
  std::abort();
}

void SetNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

// Close with RST rather than FIN: the peer sees the connection fail at once.
void Reset(int fd) {
  if (fd < 0) return;
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  ::close(fd);
}

struct Conn {
  int client = -1;
  int upstream = -1;  // -1 when blackholed
  std::string to_upstream, to_client;
  bool dead = false;
  bool blackholed() const { return upstream < 0; }
};

// Reads what is available into `buffer` (or drops it); false on EOF or error.
bool ReadInto(int fd, std::string* buffer) {
  char chunk[64 * 1024];
  ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
  if (n > 0) {
    if (buffer != nullptr) buffer->append(chunk, static_cast<size_t>(n));
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
  return false;
}

// Writes what the socket takes; false on error.
bool Flush(int fd, std::string* buffer, std::atomic<uint64_t>* counter) {
  while (!buffer->empty()) {
    ssize_t n = ::send(fd, buffer->data(), buffer->size(), MSG_NOSIGNAL);
    if (n > 0) {
      buffer->erase(0, static_cast<size_t>(n));
      *counter += static_cast<uint64_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    return false;
  }
  return true;
}

}  // namespace

TcpProxy::TcpProxy(std::string target_host, int target_port)
    : target_host_(std::move(target_host)), target_port_(target_port) {
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) Die("pipe2");
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) Die("socket");
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) Die("bind");
  if (::listen(listen_fd_, 64) != 0) Die("listen");
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] { Loop(); });
}

TcpProxy::~TcpProxy() {
  Submit(kStop);
  thread_.join();
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void TcpProxy::Cut(CutMode mode) {
  Submit(kHeal);  // whatever answer an earlier Answer() gave goes with its connections
  answer_.clear();
  blackhole_ = mode == CutMode::kBlackhole;
  cut_ = true;
  Submit(kCut);
}

void TcpProxy::Answer(std::string response) {
  Submit(kHeal);
  answer_ = std::move(response);  // the loop reads it only after the next command
  blackhole_ = true;
  cut_ = true;
  Submit(kCut);
}

void TcpProxy::Heal() {
  cut_ = false;
  Submit(kHeal);
}

void TcpProxy::Submit(int command) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return pending_command_ == 0; });
  pending_command_ = command;
  uint64_t ticket = ++commands_submitted_;
  char byte = 1;
  (void)!::write(wake_[1], &byte, 1);
  // Bounded: the loop wakes at least every kPollMs.
  cv_.wait(lock, [&] { return commands_done_ >= ticket; });
}

void TcpProxy::Loop() {
  std::vector<std::unique_ptr<Conn>> conns;
  auto close_all = [&](bool only_blackholed) {
    for (auto& c : conns) {
      if (only_blackholed && !c->blackholed()) continue;
      Reset(c->client);
      Reset(c->upstream);
      c->client = c->upstream = -1;
      c->dead = true;
    }
  };
  bool stop = false;
  while (!stop) {
    std::vector<pollfd> fds;
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    // fds[2 + 2*i] is conns[i]'s client, fds[3 + 2*i] its upstream (or -1: ignored by poll).
    for (auto& c : conns) {
      short client_events = 0, upstream_events = 0;
      if (c->to_upstream.size() < kMaxBuffered) client_events |= POLLIN;
      if (!c->to_client.empty()) client_events |= POLLOUT;
      if (!c->blackholed()) {
        if (c->to_client.size() < kMaxBuffered) upstream_events |= POLLIN;
        if (!c->to_upstream.empty()) upstream_events |= POLLOUT;
      }
      fds.push_back({c->client, client_events, 0});
      fds.push_back({c->upstream, upstream_events, 0});
    }
    int ready = ::poll(fds.data(), fds.size(), kPollMs);
    if (ready < 0 && errno != EINTR) Die("poll");

    // Commands first, so that a Cut takes effect before any more bytes pass.
    if (fds[0].revents & POLLIN) {
      char drain[64];
      while (::read(wake_[0], drain, sizeof drain) > 0) {
      }
    }
    {
      std::lock_guard lock(mu_);
      if (pending_command_ != 0) {
        if (pending_command_ == kCut) close_all(false);
        if (pending_command_ == kHeal) close_all(true);
        if (pending_command_ == kStop) {
          close_all(false);
          stop = true;
        }
        pending_command_ = 0;
        commands_done_ = commands_submitted_;
        cv_.notify_all();
      }
    }
    if (stop) break;

    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = *conns[i];
      if (c.dead) continue;
      const pollfd& cf = fds[2 + 2 * i];
      const pollfd& uf = fds[3 + 2 * i];
      bool ok = true;
      if (cf.revents & (POLLIN | POLLHUP | POLLERR)) {
        ok = ReadInto(c.client, c.blackholed() ? nullptr : &c.to_upstream);
      }
      if (ok && !c.blackholed() && (uf.revents & (POLLIN | POLLHUP | POLLERR))) {
        ok = ReadInto(c.upstream, &c.to_client);
      }
      if (ok && !c.blackholed()) {
        ok = Flush(c.upstream, &c.to_upstream, &bytes_) && Flush(c.client, &c.to_client, &bytes_);
      } else if (ok && !c.to_client.empty()) {
        ok = Flush(c.client, &c.to_client, &bytes_);  // Answer()'s response
      }
      if (!ok) {
        // One side closed or failed: best effort for what is buffered, then both go.
        if (!c.blackholed()) {
          (void)Flush(c.upstream, &c.to_upstream, &bytes_);
          (void)Flush(c.client, &c.to_client, &bytes_);
        }
        ::close(c.client);
        if (c.upstream >= 0) ::close(c.upstream);
        c.client = c.upstream = -1;
        c.dead = true;
      }
    }
    std::erase_if(conns, [](const std::unique_ptr<Conn>& c) { return c->dead; });

    if (fds[1].revents & POLLIN) {
      while (true) {
        int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (client < 0) break;
        if (cut_) {
          ++refused_;
          if (blackhole_) {
            auto c = std::make_unique<Conn>();
            c->client = client;
            c->to_client = answer_;
            conns.push_back(std::move(c));
          } else {
            Reset(client);
          }
          continue;
        }
        int upstream = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(static_cast<uint16_t>(target_port_));
        ::inet_pton(AF_INET, target_host_.c_str(), &addr.sin_addr);
        // A blocking connect: the target is on this host, so it answers or refuses at once.
        if (upstream < 0 || ::connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
          if (upstream >= 0) ::close(upstream);
          Reset(client);
          continue;
        }
        SetNonBlocking(upstream);
        int one = 1;
        ::setsockopt(upstream, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        auto c = std::make_unique<Conn>();
        c->client = client;
        c->upstream = upstream;
        conns.push_back(std::move(c));
        ++forwarded_;
      }
    }
  }
}

}  // namespace ckpt::testing
