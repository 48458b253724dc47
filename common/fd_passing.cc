#include "common/fd_passing.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <fmt/format.h>

#include "common/status.h"

namespace ckpt {

absl::Status SendFds(int socket, std::span<const int> fds, std::string_view payload) {
  if (payload.empty()) return absl::InvalidArgumentError("SendFds needs a non-empty payload");
  if (fds.size() > kMaxPassedFds) {
    return absl::InvalidArgumentError(fmt::format("{} descriptors; at most {}", fds.size(), kMaxPassedFds));
  }
  iovec iov{const_cast<char*>(payload.data()), payload.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)), 0);
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoStatus(errno, "sendmsg");
  if (static_cast<size_t>(n) != payload.size()) return absl::InternalError("sendmsg: short write");
  return absl::OkStatus();
}

absl::StatusOr<ReceivedFds> RecvFds(int socket, size_t max_fds, size_t max_payload,
                                    std::vector<UniqueFd>* on_error) {
  ReceivedFds out;
  out.payload.resize(std::max<size_t>(max_payload, 1));
  iovec iov{out.payload.data(), out.payload.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(max_fds, 1)), 0);
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    return absl::DeadlineExceededError("no answer within the socket's receive timeout");
  }
  if (n < 0) return ErrnoStatus(errno, "recvmsg");
  // Take ownership of whatever arrived before judging the message, so nothing leaks.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      out.fds.emplace_back(fd);
    }
  }
  auto refuse = [&](absl::Status why) {
    if (on_error != nullptr) {
      for (UniqueFd& fd : out.fds) on_error->push_back(std::move(fd));
    }
    return why;
  };
  if (n == 0) return refuse(absl::UnavailableError("peer closed the socket"));
  if (msg.msg_flags & MSG_CTRUNC) {
    return refuse(absl::InvalidArgumentError(fmt::format("more than {} descriptors were sent", max_fds)));
  }
  if (msg.msg_flags & MSG_TRUNC) {
    return refuse(absl::InvalidArgumentError(fmt::format("message longer than {} bytes", max_payload)));
  }
  out.payload.resize(static_cast<size_t>(n));
  return out;
}

namespace {

absl::StatusOr<ReceivedFds> RequestOnce(const std::string& path, std::string_view request,
                                        size_t max_fds, std::span<const int> send,
                                        std::chrono::milliseconds timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("socket path \"{}\" is not usable", path));
  }
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid() ||
      ::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return absl::UnavailableError(fmt::format("cannot reach {}: {}", path, std::strerror(errno)));
  }
  // A ckptd that stalled (stopped, swapping) never answers: the caller, maybe a training
  // step, waits no longer than `timeout`.
  timeval limit{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
  if (absl::Status sent = SendFds(sock.get(), send, request); !sent.ok()) {
    // ckptd turns a connection away (kBusy: too many at once) by answering before it reads
    // anything, then closing: the send can fail with EPIPE while the answer waits unread.
    // Whatever ckptd answered ("busy: ", "refused: ...") says more than the failed send;
    // a short wait, since a send that failed for any other reason brings no answer.
    timeval wait{0, 500 * 1000};
    ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
    if (absl::StatusOr<ReceivedFds> answer = RecvFds(sock.get(), 0, 4096);
        answer.ok() && !answer->payload.empty()) {
      return answer;
    }
    return absl::UnavailableError(fmt::format("send to {}: {}", path, Message(sent)));
  }
  absl::StatusOr<ReceivedFds> answer = RecvFds(sock.get(), max_fds, 4096);
  if (absl::IsDeadlineExceeded(answer.status())) {
    return absl::UnavailableError(fmt::format("{} did not answer within {} ms", path, timeout.count()));
  }
  return answer;
}

}  // namespace

absl::StatusOr<ReceivedFds> RequestFds(const std::string& path, std::string_view request,
                                       size_t max_fds, std::span<const int> send,
                                       std::chrono::milliseconds timeout) {
  using std::chrono::milliseconds;
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  std::minstd_rand jitter(std::random_device{}());
  milliseconds backoff(2);
  while (true) {
    absl::StatusOr<ReceivedFds> answer = RequestOnce(path, request, max_fds, send, timeout);
    bool busy = answer.ok() && answer->payload.starts_with(kBusy);
    if (!busy || std::chrono::steady_clock::now() + backoff > give_up) return answer;
    // Jittered, so that ranks turned away together do not all come back together.
    std::this_thread::sleep_for(backoff + milliseconds(jitter() % (backoff.count() + 1)));
    backoff = std::min(backoff * 2, milliseconds(200));
  }
}

}  // namespace ckpt
