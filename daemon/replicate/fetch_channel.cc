#include "daemon/replicate/fetch_channel.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/log_limiter.h"
#include "common/status.h"
#include "daemon/replicate/erasure_code.h"
#include "proto/replicas.pb.h"
#include "storage/secret.h"

namespace ckpt::replicate {
namespace {

namespace pb = ckptd::replicas::v1;

constexpr size_t kRequestBytes = kFetchTicketBytes + 4 + 4 + 8;
constexpr uint32_t kMaxHeaderBytes = 4096;
// A reader this slow (no byte of the fragment taken for this long) is dropped.
constexpr auto kServerIoTimeout = std::chrono::seconds(10);

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

void SetTimeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly `n` bytes by `deadline`, however the sender spaces them: false on EOF, an
// error, or the deadline passing.
bool ReadAllBy(int fd, char* data, size_t n, std::chrono::steady_clock::time_point deadline) {
  while (n > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return false;
    if (ready == 0) continue;
    ssize_t r = ::recv(fd, data, n, MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) return false;
    data += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool ReadAll(int fd, char* data, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, data, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    data += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

template <typename T>
void PutLe(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

template <typename T>
T GetLe(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// The port of an accepted connection's peer: names it in the log beside what the client saw.
int PeerPort(const sockaddr_storage& peer) {
  if (peer.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_port);
  if (peer.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&peer)->sin_port);
  return 0;
}

// "host" of "host:port", brackets of an IPv6 literal taken off.
std::string HostPart(std::string host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FetchServer>> FetchServer::Start(FragmentStore& store, const std::string& host,
                                                                ReplicaFaults faults, int listen_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string bind_host = HostPart(host);
  if (int rc = ::getaddrinfo(bind_host.empty() ? nullptr : bind_host.c_str(), std::to_string(listen_port).c_str(),
                             &hints, &found);
      rc != 0) {
    return absl::InvalidArgumentError(fmt::format("fragment fetch channel: {}: {}", host, ::gai_strerror(rc)));
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, kMaxConnections) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(fmt::format("fragment fetch channel: cannot listen on {} port {} (--replica-fetch-port)",
                                              host, listen_port));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                               : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::unique_ptr<FetchServer>(new FetchServer(store, fd, port, std::move(faults)));
}

FetchServer::FetchServer(FragmentStore& store, int listener, int port, ReplicaFaults faults)
    : store_(store), listener_(listener), port_(port), faults_(std::move(faults)), acceptor_([this] { AcceptLoop(); }) {}

FetchServer::~FetchServer() { Stop(); }

void FetchServer::Stop() {
  if (stopping_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  ::close(listener_);
  std::vector<Worker> workers;
  size_t closed = 0;
  {
    std::lock_guard lock(mu_);
    workers.swap(workers_);
    // Every connection still open ends now: its worker's read or write returns at once, so
    // no client, however slowly it sends or reads, holds the stop. (A worker takes its
    // descriptor out of open_ under mu_ before closing it: none here is another file's.)
    for (int fd : open_) ::shutdown(fd, SHUT_RDWR);
    closed = open_.size();
  }
  if (closed > 0 || refused_ > 0) {
    // Refusals are not logged one by one (a flood of connections would flood the log too).
    Log().info("fragment fetch channel: stopping, {} open connection(s) closed; {} refused at accept since the "
               "start (over {} connections, or {} without a ticket)",
               closed, refused_.load(), kMaxConnections, kMaxUnauthenticated);
  }
  for (Worker& w : workers) w.thread.join();
}

std::string FetchServer::Issue(const std::string& job, uint32_t owner) {
  std::random_device random;  // /dev/urandom: a ticket must not be guessable
  std::string ticket;
  while (ticket.size() < kFetchTicketBytes) PutLe<uint32_t>(ticket, random());
  ticket.resize(kFetchTicketBytes);
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mu_);
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    it = it->second.expires < now ? tickets_.erase(it) : std::next(it);
  }
  if (tickets_.size() >= kMaxTickets) tickets_.erase(tickets_.begin());  // a random one: keys are random
  tickets_[ticket] = Grant{job, owner, now + kTicketLifetime};
  return ticket;
}

bool FetchServer::Redeem(const std::string& ticket, std::string& job, uint32_t& owner) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mu_);
  bool found = false;
  // Every ticket compared in constant time: no timing tells how much of a guess was right.
  for (const auto& [key, grant] : tickets_) {
    if (SecretEquals(ticket, key) && grant.expires >= now) {
      job = grant.job;
      owner = grant.owner;
      found = true;
    }
  }
  return found;
}

void FetchServer::AcceptLoop() {
  // Out of descriptors, accept fails until some close: said at most every 10 s.
  LogLimiter accept_errors(std::chrono::seconds(10));
  while (!stopping_) {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    sockaddr_storage peer{};
    socklen_t peer_bytes = sizeof peer;
    int fd = ::accept4(listener_, reinterpret_cast<sockaddr*>(&peer), &peer_bytes, SOCK_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == EINTR || error == EAGAIN || error == ECONNABORTED) continue;  // the client left first
      if (std::optional<uint64_t> held = accept_errors.Allow()) {
        Log().warn("fragment fetch channel: accept: {}{}", std::strerror(error), HeldBack(*held));
      }
      // The connection stays queued: polling again at once would spin until a descriptor frees.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    const int peer_port = PeerPort(peer);
    // Connections that have not yet shown a ticket take at most half the channel: clients
    // that connect and send slowly (or nothing) never lock restores out of it.
    if (connections_.load() >= kMaxConnections || unauthenticated_.load() >= kMaxUnauthenticated) {
      // One debug line each (a flood stays out of the info log; the stop line counts them).
      Log().debug("fragment fetch channel: refused a connection from port {} ({} open, {} without a ticket)",
                  peer_port, connections_.load(), unauthenticated_.load());
      ::close(fd);  // the client falls back to gRPC
      ++refused_;
      continue;
    }
    Log().debug("fragment fetch channel: accepted a connection from port {} ({} open, {} without a ticket)", peer_port,
                connections_.load(), unauthenticated_.load());
    ++connections_;
    ++unauthenticated_;
    std::lock_guard lock(mu_);
    open_.insert(fd);
    // Finished workers are joined as new ones start: the list is as long as the connections.
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = workers_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    const auto accepted = std::chrono::steady_clock::now();
    workers_.push_back({std::thread([this, fd, peer_port, done, accepted] {
                          bool authenticated = false;
                          Serve(fd, peer_port, accepted, authenticated);
                          // Both counts go down before the close: a client that sees its
                          // connection end and connects again finds the slot free.
                          if (!authenticated) --unauthenticated_;
                          --connections_;
                          {
                            std::lock_guard lock(mu_);
                            open_.erase(fd);
                          }
                          ::close(fd);
                          *done = true;
                        }),
                        done});
  }
}

void FetchServer::Serve(int fd, int peer_port, std::chrono::steady_clock::time_point accepted, bool& authenticated) {
  SetTimeouts(fd, kServerIoTimeout);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  char request[kRequestBytes];
  // The whole request by kRequestDeadline from the accept, not a timeout per read: a client
  // sending a byte every few seconds is dropped as surely as a silent one.
  if (!ReadAllBy(fd, request, sizeof request, accepted + kRequestDeadline)) {
    Log().debug("fragment fetch channel: the connection from port {} dropped before its whole request, {} ms after "
                "its accept (errno {})",
                peer_port,
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - accepted).count(),
                errno);
    return;
  }
  std::string job;
  uint32_t owner = 0;
  const std::string ticket(request, kFetchTicketBytes);
  const uint32_t rank = GetLe<uint32_t>(request + kFetchTicketBytes);
  const uint32_t index = GetLe<uint32_t>(request + kFetchTicketBytes + 4);
  const uint64_t step = GetLe<uint64_t>(request + kFetchTicketBytes + 8);
  std::shared_ptr<const HeldFragment> fragment;
  if (Redeem(ticket, job, owner)) {
    authenticated = true;
    --unauthenticated_;
    fragment = store_.Find({job, step, owner, rank, index});
  }
  if (!fragment) {
    std::string refused;
    PutLe<uint32_t>(refused, 0);
    (void)WriteAll(fd, refused.data(), refused.size());
    return;
  }
  pb::FragmentHeader header;
  ToHeader(fragment->id, fragment->meta, &header);
  std::string out;
  PutLe<uint32_t>(out, static_cast<uint32_t>(header.ByteSizeLong()));
  header.AppendToString(&out);
  if (!WriteAll(fd, out.data(), out.size())) return;
  if (faults_.corrupt_served) {
    std::string damaged = fragment->bytes;
    if (!damaged.empty()) damaged[damaged.size() / 2] ^= 0x5a;
    (void)WriteAll(fd, damaged.data(), damaged.size());
    return;
  }
  // Straight from the store: `fragment` keeps the bytes alive while they go.
  (void)WriteAll(fd, fragment->bytes.data(), fragment->bytes.size());
}

absl::StatusOr<FragmentMeta> FetchFragment(const std::string& host, int port, const std::string& ticket,
                                           const FragmentId& id, uint32_t k, uint64_t max_data_bytes,
                                           const std::function<char*(const FragmentMeta&)>& into,
                                           std::chrono::milliseconds timeout) {
  const std::string where = fmt::format("{}:{}", host, port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string h = HostPart(host);
  if (int rc = ::getaddrinfo(h.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(fmt::format("{}: {}", where, ::gai_strerror(rc)));
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    SetTimeouts(fd, timeout);  // connect honours the send timeout
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(fmt::format("cannot connect to {}: {}", where, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::string request = ticket;
  request.resize(kFetchTicketBytes);
  PutLe<uint32_t>(request, id.rank);
  PutLe<uint32_t>(request, id.index);
  PutLe<uint64_t>(request, id.step);
  if (!WriteAll(fd, request.data(), request.size())) {
    return absl::UnavailableError(fmt::format("{}: sending the request: {}", where, std::strerror(errno)));
  }
  char length[4];
  if (!ReadAll(fd, length, sizeof length)) {
    return absl::UnavailableError(fmt::format("{}: no answer: {}", where, std::strerror(errno)));
  }
  const uint32_t header_bytes = GetLe<uint32_t>(length);
  if (header_bytes == 0) {
    return absl::NotFoundError(fmt::format("{} refused the fragment (not held there, or the ticket expired)", where));
  }
  if (header_bytes > kMaxHeaderBytes) return absl::DataLossError(fmt::format("{}: a header of {} bytes", where, header_bytes));
  std::string text(header_bytes, '\0');
  pb::FragmentHeader h2;
  if (!ReadAll(fd, text.data(), text.size()) || !h2.ParseFromString(text)) {
    return absl::DataLossError(fmt::format("{}: the fragment's header did not arrive whole", where));
  }
  const auto [got, meta] = FromHeader(h2);
  if (absl::Status served = CheckServed(id, got, meta, k, max_data_bytes); !served.ok()) {
    return Annotate(served, where);
  }
  char* dst = into(meta);
  if (dst == nullptr) return absl::DataLossError(fmt::format("{}: the fragment does not fit the shard", where));
  const size_t bytes = ErasureCode::FragmentBytes(meta.data_bytes, static_cast<int>(meta.k));
  if (!ReadAll(fd, dst, bytes)) {
    return absl::UnavailableError(fmt::format("{}: the fragment's bytes stopped: {}", where, std::strerror(errno)));
  }
  return meta;
}

}  // namespace ckpt::replicate
