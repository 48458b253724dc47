#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "common/fd_passing.h"
#include "common/fd_reaper.h"
#include "common/status.h"

using namespace ckpt;

namespace {

struct SocketPair {
  UniqueFd a, b;
  SocketPair() {
    int fds[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
    a.reset(fds[0]);
    b.reset(fds[1]);
  }
};

UniqueFd MemfdWith(const char* text) {
  UniqueFd fd(::memfd_create("ckpt-test", MFD_CLOEXEC));
  REQUIRE(::write(fd.get(), text, std::strlen(text)) == static_cast<ssize_t>(std::strlen(text)));
  return fd;
}

std::string ReadAll(int fd) {
  char buf[64] = {0};
  ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  return n > 0 ? std::string(buf, n) : "";
}

}  // namespace

TEST_CASE("descriptors travel with their payload to another process") {
  SocketPair sp;
  pid_t child = ::fork();
  if (child == 0) {
    UniqueFd one = MemfdWith("first"), two = MemfdWith("second");
    int fds[] = {one.get(), two.get()};
    _exit(SendFds(sp.a.get(), fds, "handles").ok() ? 0 : 1);
  }
  auto got = RecvFds(sp.b.get(), 4, 64);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(WEXITSTATUS(status) == 0);
  REQUIRE(got.ok());
  CHECK(got->payload == "handles");
  REQUIRE(got->fds.size() == 2);
  CHECK(ReadAll(got->fds[0].get()) == "first");
  CHECK(ReadAll(got->fds[1].get()) == "second");
}

TEST_CASE("too many descriptors are refused and none leak") {
  SocketPair sp;
  UniqueFd one = MemfdWith("x"), two = MemfdWith("y"), three = MemfdWith("z");
  int fds[] = {one.get(), two.get(), three.get()};
  REQUIRE(SendFds(sp.a.get(), fds, "p").ok());
  auto got = RecvFds(sp.b.get(), 1, 16);
  REQUIRE_FALSE(got.ok());
  CHECK(Message(got.status()).find("more than 1 descriptors") != std::string::npos);
}

TEST_CASE("a closed peer and bad arguments are clear errors") {
  SocketPair sp;
  sp.a.reset();
  auto got = RecvFds(sp.b.get(), 1, 16);
  CHECK(absl::IsUnavailable(got.status()));
  CHECK(absl::IsInvalidArgument(SendFds(sp.b.get(), {}, "")));
}

namespace {

// A Unix stream socket listening at `path` (replacing a leftover one).
UniqueFd Listen(const std::string& path) {
  std::filesystem::remove(path);
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  REQUIRE(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(listener.get(), 8) == 0);
  return listener;
}

}  // namespace

TEST_CASE("a busy answer is retried until the server takes the request") {
  std::string path = fmt::format("/tmp/ckpt-fd-test-{}.sock", ::getpid());
  UniqueFd listener = Listen(path);
  // Busy twice, then served: the caller sees only the answer it was served.
  std::thread server([&] {
    for (int i = 0; i < 3; ++i) {
      UniqueFd conn(::accept(listener.get(), nullptr, nullptr));
      auto request = RecvFds(conn.get(), 0, 64);
      std::string answer = i < 2 ? std::string(kBusy) + "later" : "served " + request->payload;
      (void)::send(conn.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
    }
  });
  auto got = RequestFds(path, "hello", 0);
  server.join();
  std::filesystem::remove(path);
  REQUIRE(got.ok());
  CHECK(got->payload == "served hello");
}

TEST_CASE("a server that accepts and never answers costs the caller its timeout, no more") {
  std::string path = fmt::format("/tmp/ckpt-fd-test-stall-{}.sock", ::getpid());
  UniqueFd listener = Listen(path);  // the backlog accepts; nobody reads or answers (a stopped ckptd)
  auto start = std::chrono::steady_clock::now();
  auto got = RequestFds(path, "payload", 0, {}, std::chrono::milliseconds(300));
  auto took = std::chrono::steady_clock::now() - start;
  std::filesystem::remove(path);
  REQUIRE_FALSE(got.ok());
  CHECK(absl::IsUnavailable(got.status()));
  CHECK(Message(got.status()).find("did not answer within 300 ms") != std::string::npos);
  CHECK(took < std::chrono::seconds(2));
}

TEST_CASE("a busy answer sent before the request is read is retried too (the send fails with EPIPE)") {
  // ckptd turns a connection away by answering and closing at once. A request larger than
  // the socket buffer is still being sent then: the send fails, the answer is waiting.
  std::string path = fmt::format("/tmp/ckpt-fd-test-epipe-{}.sock", ::getpid());
  UniqueFd listener = Listen(path);
  const std::string request(4 << 20, 'x');
  std::thread server([&] {
    for (int i = 0; i < 3; ++i) {
      UniqueFd conn(::accept(listener.get(), nullptr, nullptr));
      if (i < 2) {
        std::string busy = std::string(kBusy) + "later";
        (void)::send(conn.get(), busy.data(), busy.size(), MSG_NOSIGNAL);
        continue;  // closed unread
      }
      std::string got;
      std::vector<char> buffer(1 << 16);
      while (got.size() < request.size()) {
        ssize_t n = ::recv(conn.get(), buffer.data(), buffer.size(), 0);
        if (n <= 0) break;
        got.append(buffer.data(), static_cast<size_t>(n));
      }
      std::string answer = "served " + std::to_string(got.size());
      (void)::send(conn.get(), answer.data(), answer.size(), MSG_NOSIGNAL);
    }
  });
  auto got = RequestFds(path, request, 0);
  server.join();
  std::filesystem::remove(path);
  INFO((got.ok() ? got->payload : std::string(got.status().message())));
  REQUIRE(got.ok());
  CHECK(got->payload == "served " + std::to_string(request.size()));
}

TEST_CASE("the reaper closes what it is given, a socket set to linger at once") {
  FdReaper reaper(/*max_queued=*/4);
  // A TCP connection whose peer never reads, its send buffer full, set to linger 60 s: a
  // plain close() of it would block for those 60 s.
  UniqueFd server(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  REQUIRE(::bind(server.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(server.get(), 1) == 0);
  REQUIRE(::getsockname(server.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  UniqueFd lingering(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  (void)::connect(lingering.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  UniqueFd accepted(::accept(server.get(), nullptr, nullptr));
  REQUIRE(accepted.valid());
  std::vector<char> junk(1 << 16, 'x');
  while (::send(lingering.get(), junk.data(), junk.size(), MSG_NOSIGNAL) > 0) {
  }
  linger slow{1, 60};
  REQUIRE(::setsockopt(lingering.get(), SOL_SOCKET, SO_LINGER, &slow, sizeof slow) == 0);
  int flags = ::fcntl(lingering.get(), F_GETFL);
  REQUIRE(::fcntl(lingering.get(), F_SETFL, flags & ~O_NONBLOCK) == 0);
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  UniqueFd read_end(pipe_fds[0]);

  std::vector<UniqueFd> given;
  given.emplace_back(std::move(lingering));
  given.emplace_back(pipe_fds[1]);
  auto start = std::chrono::steady_clock::now();
  REQUIRE(reaper.Dispose(std::move(given)));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(500));
  // The pipe's write end, queued behind the socket, is closed within a second: EOF.
  pollfd p{read_end.get(), POLLIN, 0};
  REQUIRE(::poll(&p, 1, 2000) == 1);
  char c;
  CHECK(::read(read_end.get(), &c, 1) == 0);
  CHECK(reaper.queued() == 0);

  // More at once than it may queue: refused, and closed by the caller's side all the same.
  std::vector<UniqueFd> many;
  for (int i = 0; i < 5; ++i) many.emplace_back(::dup(read_end.get()));
  CHECK_FALSE(reaper.Dispose(std::move(many)));
}
