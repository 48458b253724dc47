// The peer table maps gRPC's "fd:N" back to who connected, and only while descriptor N is
// still the socket that was accepted.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "common/status.h"
#include "daemon/session/peer_identity.h"

using namespace ckpt;
using namespace ckpt::daemon;

TEST_CASE("an identity is the socket's, and goes when the descriptor is reused") {
  int pair[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  auto me = ReadPeerIdentity(pair[0]);
  REQUIRE(me.ok());
  CHECK(me->pid == ::getpid());
  CHECK(me->uid == ::geteuid());
  PeerTable table;
  table.Remember(pair[0], *me);
  std::string name = "fd:" + std::to_string(pair[0]);
  auto found = table.Of(name);
  REQUIRE(found.ok());
  CHECK(found->pid == ::getpid());

  // The connection ends and its number is handed to something else: not that peer any more.
  ::close(pair[0]);
  ::close(pair[1]);
  int reused = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(reused == pair[0]);
  auto stale = table.Of(name);
  REQUIRE_FALSE(stale.ok());
  CHECK(absl::IsUnauthenticated(stale.status()));
  CHECK(Message(stale.status()).find("no longer the one ckptd accepted") != std::string::npos);
  ::close(reused);

  // Nor another socket that the table never accepted at that number.
  int other[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, other) == 0);
  // The lowest free number: most likely the old one already; if not, put it there.
  if (other[0] != pair[0]) REQUIRE(::dup3(other[0], pair[0], O_CLOEXEC) == pair[0]);
  CHECK(absl::IsUnauthenticated(table.Of(name).status()));
  if (other[0] != pair[0]) ::close(pair[0]);
  ::close(other[0]);
  ::close(other[1]);

  CHECK(absl::IsUnauthenticated(table.Of("ipv4:127.0.0.1:5000").status()));
  CHECK(absl::IsUnauthenticated(table.Of("fd:99x").status()));
}
