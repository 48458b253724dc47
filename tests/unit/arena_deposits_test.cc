// Arenas handed over ahead of a registration: only their depositor may take them, a thief's
// try leaves them for their owner, and what is held is bounded in count and in time.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>

#include <thread>

#include "common/status.h"
#include "daemon/session/arena_deposits.h"
#include "shm/arena.h"

using namespace ckpt;
using namespace ckpt::daemon;

namespace {

const PeerIdentity kTrainer{.pid = 100, .uid = 1000, .gid = 1000};

std::vector<UniqueFd> Arenas(size_t n) {
  std::vector<UniqueFd> fds;
  for (size_t i = 0; i < n; ++i) {
    auto arena = shm::Arena::Create(4096);
    REQUIRE(arena.ok());
    fds.emplace_back(::fcntl((*arena)->fd(), F_DUPFD_CLOEXEC, 0));
  }
  return fds;
}

}  // namespace

TEST_CASE("a deposit is taken once, and only by the process that made it") {
  ArenaDeposits deposits;
  auto token = deposits.Put(kTrainer, Arenas(3));
  REQUIRE(token.ok());
  CHECK(token->size() == 32);
  for (PeerIdentity thief : {PeerIdentity{.pid = 101, .uid = 1000}, PeerIdentity{.pid = 100, .uid = 1001},
                             PeerIdentity{.pid = 7, .uid = 0}}) {
    auto stolen = deposits.Take(*token, thief);
    REQUIRE_FALSE(stolen.ok());
    CHECK(absl::IsPermissionDenied(stolen.status()));
    CHECK(Message(stolen.status()).find("handed over by another process (pid 100 uid 1000)") !=
          std::string::npos);
  }
  auto mine = deposits.Take(*token, kTrainer);  // the thieves' tries left it in place
  REQUIRE(mine.ok());
  CHECK(mine->size() == 3);
  CHECK(deposits.held_fds() == 0);
  CHECK(absl::IsNotFound(deposits.Take(*token, kTrainer).status()));  // once
}

TEST_CASE("only sealed shared memory is taken") {
  ArenaDeposits deposits;
  std::vector<UniqueFd> fds = Arenas(1);
  fds.emplace_back(::memfd_create("unsealed", MFD_CLOEXEC));
  auto refused = deposits.Put(kTrainer, std::move(fds));
  REQUIRE_FALSE(refused.ok());
  CHECK(Message(refused.status()).find("arena 1 of 2") != std::string::npos);
  CHECK(deposits.held_fds() == 0);
  CHECK_FALSE(deposits.Put(kTrainer, {}).ok());
}

TEST_CASE("a token redeems only the kind it was handed over as") {
  ArenaDeposits deposits;
  auto two = deposits.Put(kTrainer, Arenas(2), ArenaDeposits::Kind::kPayload);
  REQUIRE_FALSE(two.ok());
  CHECK(Message(two.status()).find("a snapshot payload is one sealed memfd, not 2 descriptors") != std::string::npos);
  auto payload = deposits.Put(kTrainer, Arenas(1), ArenaDeposits::Kind::kPayload);
  REQUIRE(payload.ok());
  // A payload's token given where arenas are registered is refused, and stays a payload.
  auto as_arenas = deposits.Take(*payload, kTrainer, ArenaDeposits::Kind::kArenas);
  REQUIRE_FALSE(as_arenas.ok());
  CHECK(Message(as_arenas.status()).find("was handed over with a snapshot payload, not arenas") != std::string::npos);
  CHECK(deposits.Take(*payload, PeerIdentity{.pid = 101, .uid = 1000}, ArenaDeposits::Kind::kPayload)
            .status().code() == absl::StatusCode::kPermissionDenied);
  auto mine = deposits.Take(*payload, kTrainer, ArenaDeposits::Kind::kPayload);
  REQUIRE(mine.ok());
  CHECK(mine->size() == 1);
}

TEST_CASE("deposits are bounded per user and in all, and expire") {
  ArenaDeposits deposits({.expire_after = std::chrono::milliseconds(200), .max_fds_per_uid = 4,
                          .max_fds = 6});
  REQUIRE(deposits.Put(kTrainer, Arenas(3)).ok());
  auto over = deposits.Put(kTrainer, Arenas(2));
  REQUIRE_FALSE(over.ok());
  CHECK(absl::IsResourceExhausted(over.status()));
  CHECK(Message(over.status()).find("3 of uid 1000") != std::string::npos);
  REQUIRE(deposits.Put({.pid = 5, .uid = 1001}, Arenas(3)).ok());  // another user has room
  CHECK_FALSE(deposits.Put({.pid = 6, .uid = 1002}, Arenas(1)).ok());  // but not the node
  CHECK(deposits.held_fds() == 6);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto token = deposits.Put(kTrainer, Arenas(4));  // the old ones expired and were closed
  REQUIRE(token.ok());
  CHECK(deposits.held_fds() == 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto late = deposits.Take(*token, kTrainer);
  REQUIRE_FALSE(late.ok());
  CHECK(Message(late.status()).find("unknown or expired") != std::string::npos);
}
