// Fair shares of staging memory between jobs.
#include <catch2/catch.hpp>

#include <atomic>

#include "common/status.h"
#include "daemon/staging/staging_ledger.h"

using ckpt::daemon::StagingLedger;

TEST_CASE("a job alone may use all the staging memory") {
  StagingLedger ledger(1000, [] { return size_t{1}; });
  auto a = ledger.Admit("a", 600);
  auto b = ledger.Admit("a", 300);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(ledger.in_flight("a") == 900);
}

TEST_CASE("with others registered a job is held to its share, but always gets one snapshot") {
  std::atomic<size_t> jobs{2};
  StagingLedger ledger(1000, [&] { return jobs.load(); });
  auto big = ledger.Admit("flood", 700);  // larger than its share: the first one still goes
  REQUIRE(big.ok());
  auto more = ledger.Admit("flood", 100);
  REQUIRE_FALSE(more.ok());
  CHECK(absl::IsResourceExhausted(more.status()));
  CHECK(ckpt::Message(more.status()).find("fair share of the staging memory is 500 bytes") !=
        std::string::npos);
  CHECK(ledger.Admit("quiet", 300).ok());  // the other job is not starved
  big->reset();                            // written and committed
  CHECK(ledger.in_flight("flood") == 0);
  CHECK(ledger.Admit("flood", 400).ok());
  jobs = 1;  // the other job left: the flood may use everything again
  CHECK(ledger.Admit("flood", 500).ok());
}
