#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstring>

#include "common/fd_passing.h"
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
