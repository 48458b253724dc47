// Restoring ranks agree on one step: the newest every rank has.
#include <catch2/catch.hpp>

#include <future>
#include <thread>

#include "common/status.h"
#include "daemon/restore/step_agreement.h"

using namespace ckpt::daemon;
using namespace std::chrono_literals;

namespace {

// Every rank's list, by rank, as the choice takes distinct lists: each named by its rank.
absl::StatusOr<std::optional<uint64_t>> ChooseByRank(const std::string& job,
                                                      const std::vector<std::vector<uint64_t>>& lists) {
  std::vector<std::pair<uint32_t, std::vector<uint64_t>>> named;
  for (uint32_t r = 0; r < lists.size(); ++r) named.emplace_back(r, lists[r]);
  return ChooseCommonStep(job, named);
}

}  // namespace

TEST_CASE("the newest step every rank has is chosen") {
  CHECK(**ChooseByRank("j", {{10, 20, 30}, {10, 20}, {20, 30}}) == 20);
  CHECK(**ChooseByRank("j", {{10}}) == 10);
  // Lists are in run order: a job that went back to step 100 and committed 110 resumes
  // from 110, not from the abandoned 500.
  CHECK(**ChooseByRank("j", {{100, 500, 110}, {100, 500, 110}}) == 110);
  CHECK(**ChooseByRank("j", {{100, 500, 110}, {100, 500}}) == 500);
  CHECK_FALSE(ChooseByRank("j", {{}, {}})->has_value());  // a fresh start
  auto none = ChooseByRank("j", {{10}, {20}, {}});
  REQUIRE_FALSE(none.ok());
  CHECK(ckpt::Message(none.status()).find("no committed step is present for every rank") !=
        std::string::npos);
  CHECK(ckpt::Message(none.status()).find("rank 2: none") != std::string::npos);
}

TEST_CASE("the choice from distinct lists, each named by the first rank that brought it") {
  using Lists = std::vector<std::pair<uint32_t, std::vector<uint64_t>>>;
  // 80,000 ranks with two different lists between them: two entries, not 80,000.
  CHECK(**ChooseCommonStep("j", Lists{{0, {10, 20, 30}}, {17, {10, 20}}}) == 20);
  auto none = ChooseCommonStep("j", Lists{{0, {10}}, {5, {20}}});
  REQUIRE_FALSE(none.ok());
  CHECK_THAT(ckpt::Message(none.status()), Catch::Contains("rank 5: newest 20"));
}

TEST_CASE("step lists travel as text and bad text is refused") {
  CHECK(EncodeSteps({1, 20, 300}) == "1,20,300");
  CHECK(*DecodeSteps("1,20,300") == std::vector<uint64_t>{1, 20, 300});
  CHECK(DecodeSteps("")->empty());
  CHECK_FALSE(DecodeSteps("1,x").ok());
  CHECK_FALSE(DecodeSteps("1;2").ok());
  std::vector<uint64_t> many(1000);
  for (size_t i = 0; i < many.size(); ++i) many[i] = i;
  CHECK(DecodeSteps(EncodeSteps(many))->size() == kMaxAdvertised);
}

TEST_CASE("local ranks meet at the barrier; a rank alone times out naming the missing") {
  auto agreement = MakeLocalStepAgreement();
  auto other = std::async(std::launch::async, [&] {
    return agreement->Agree("j", 1, 2, {10, 20}, 5s);
  });
  auto mine = agreement->Agree("j", 0, 2, {10, 20, 30}, 5s);
  REQUIRE(mine.ok());
  CHECK(**mine == 20);
  CHECK(**other.get() == 20);
  auto alone = agreement->Agree("j", 0, 3, {10}, 200ms);
  REQUIRE_FALSE(alone.ok());
  std::string message = ckpt::Message(alone.status());
  CHECK(message.find("restore barrier of job j") != std::string::npos);
  CHECK(message.find("missing: 1, 2") != std::string::npos);
  CHECK(message.find("--restore-timeout") != std::string::npos);
}

TEST_CASE("shutdown ends a restore waiting at the barrier, and every later one at once") {
  auto agreement = MakeLocalStepAgreement();
  auto start = std::chrono::steady_clock::now();
  auto waiting = std::async(std::launch::async, [&] {
    return agreement->Agree("j", 0, 2, {10}, 30s);  // rank 1 never comes
  });
  std::this_thread::sleep_for(50ms);
  agreement->Cancel("ckptd is shutting down");
  auto ended = waiting.get();
  REQUIRE_FALSE(ended.ok());
  CHECK(ckpt::Message(ended.status()).find("shutting down") != std::string::npos);
  auto later = agreement->Agree("j", 1, 2, {10}, 30s);
  REQUIRE_FALSE(later.ok());
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}
