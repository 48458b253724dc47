// Fair shares of staging memory: between users first, then between each user's jobs.
#include <catch2/catch.hpp>

#include <mutex>

#include "common/status.h"
#include "daemon/staging/staging_ledger.h"

using ckpt::daemon::StagingLedger;

namespace {

// Who the ledger sees as registered; tests change it as sessions would come and go.
struct Registered {
  std::mutex mu;
  StagingLedger::ActiveUsers users;
  std::function<StagingLedger::ActiveUsers()> Fn() {
    return [this] {
      std::lock_guard lock(mu);
      return users;
    };
  }
};

bool Mentions(const absl::Status& s, const std::string& text) {
  return ckpt::Message(s).find(text) != std::string::npos;
}

}  // namespace

TEST_CASE("a job alone may use all the staging memory") {
  Registered r;
  r.users = {{1000, {"a"}}};
  StagingLedger ledger(1000, r.Fn());
  auto a = ledger.Admit(1000, "a", 600);
  auto b = ledger.Admit(1000, "a", 300);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(ledger.in_flight("a") == 900);
  CHECK(ledger.in_flight_of_user(1000) == 900);
}

TEST_CASE("with others registered a job is held to its share, but always gets one snapshot") {
  Registered r;
  r.users = {{1000, {"flood", "quiet"}}};
  StagingLedger ledger(1000, r.Fn());
  auto big = ledger.Admit(1000, "flood", 700);  // larger than its share: the first one still goes
  REQUIRE(big.ok());
  auto more = ledger.Admit(1000, "flood", 100);
  REQUIRE_FALSE(more.ok());
  CHECK(absl::IsResourceExhausted(more.status()));
  CHECK(Mentions(more.status(), "its fair share of the staging memory is 500 bytes"));
  CHECK(ledger.Admit(1000, "quiet", 300).ok());  // the other job is not starved
  big->reset();                                  // written and committed
  CHECK(ledger.in_flight("flood") == 0);
  CHECK(ledger.Admit(1000, "flood", 400).ok());
  r.users = {{1000, {"flood"}}};  // the other job left: the flood may use everything again
  CHECK(ledger.Admit(1000, "flood", 500).ok());
}

TEST_CASE("a user with many jobs gets one user's share, not one per job") {
  Registered r;
  // uid 1000 runs nine jobs, uid 1001 one: halves for the users, ninths of a half per job.
  for (int j = 0; j < 9; ++j) r.users[1000].insert("many" + std::to_string(j));
  r.users[1001] = {"single"};
  StagingLedger ledger(1800, r.Fn());
  std::vector<StagingLedger::HoldPtr> held;
  for (int j = 0; j < 9; ++j) {
    auto h = ledger.Admit(1000, "many" + std::to_string(j), 100);  // 9 x 100 = its half
    REQUIRE(h.ok());
    held.push_back(std::move(*h));
  }
  CHECK(ledger.in_flight_of_user(1000) == 900);
  // Each job is within its ninth, but the user has had its half.
  auto tenth = ledger.Admit(1000, "many0", 1);
  REQUIRE_FALSE(tenth.ok());
  CHECK(Mentions(tenth.status(), "a user's fair share of the staging memory is 900 bytes (2 users"));
  // The other user's single job still has its whole half.
  auto other = ledger.Admit(1001, "single", 500);
  REQUIRE(other.ok());
  auto rest = ledger.Admit(1001, "single", 400);
  CHECK(rest.ok());
  CHECK_FALSE(ledger.Admit(1001, "single", 1).ok());
  // Under its user's share, a job is held to its part of it.
  held.clear();
  auto one = ledger.Admit(1000, "many1", 100);
  REQUIRE(one.ok());
  auto over = ledger.Admit(1000, "many1", 1);
  REQUIRE_FALSE(over.ok());
  CHECK(Mentions(over.status(), "9 jobs of uid 1000 share 900 bytes"));
}

TEST_CASE("a user's first snapshot always goes, however large") {
  Registered r;
  r.users = {{1000, {"a"}}, {1001, {"b"}}, {1002, {"c"}}};
  StagingLedger ledger(900, r.Fn());
  auto huge = ledger.Admit(1002, "c", 800);
  REQUIRE(huge.ok());
  CHECK_FALSE(ledger.Admit(1002, "c", 1).ok());
  huge->reset();
  CHECK(ledger.in_flight_of_user(1002) == 0);
}

TEST_CASE("part of a hold split off (a snapshot's frozen block) is released on its own") {
  Registered r;
  r.users = {{1000, {"lora"}}};
  StagingLedger ledger(1000, r.Fn());
  auto snapshot = ledger.Admit(1000, "lora", 600);
  REQUIRE(snapshot.ok());
  StagingLedger::HoldPtr frozen = (*snapshot)->Split(400);
  CHECK(ledger.in_flight("lora") == 600);
  snapshot->reset();  // the snapshot is committed; its frozen block lives on
  CHECK(ledger.in_flight("lora") == 400);
  CHECK(ledger.in_flight_of_user(1000) == 400);
  frozen.reset();
  CHECK(ledger.in_flight("lora") == 0);
  // No more than the hold has.
  auto small = ledger.Admit(1000, "lora", 10);
  REQUIRE(small.ok());
  StagingLedger::HoldPtr all = (*small)->Split(50);
  small->reset();
  CHECK(ledger.in_flight("lora") == 10);
  all.reset();
  CHECK(ledger.in_flight("lora") == 0);
}
