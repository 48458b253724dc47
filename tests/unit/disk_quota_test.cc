// DiskQuota over a real directory: what a root holds is what its files say, bytes written
// since a measurement count at once, and what ckptd removes is measured again before the
// job's next write.
#include "daemon/persist/disk_quota.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>

#include "storage/filesystem.h"
#include "tests/fakes/temp_dir.h"

namespace ckpt::persist {
namespace {

using Clock = DiskQuota::Clock;

struct Root {
  testing::TempDir dir;
  FilesystemPtr fs = MakePosixFilesystem();
  std::map<std::string, uint32_t> owners;
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);

  void Write(const std::string& path, size_t bytes) {
    std::filesystem::create_directories(std::filesystem::path(dir / path).parent_path());
    std::ofstream(dir / path) << std::string(bytes, 'x');
  }
  // No walking thread: the tests walk the root when ckptd's thread would.
  std::unique_ptr<DiskQuota> Quota(DiskQuota::Limits limits) {
    return std::make_unique<DiskQuota>(
        *fs, dir.path(), limits,
        [this](const std::string& job) -> std::optional<uint32_t> {
          auto it = owners.find(job);
          if (it == owners.end()) return std::nullopt;
          return it->second;
        },
        /*walk_root=*/false, [this] { return now; });
  }
};

TEST_CASE("a job's bytes on the root count against its quota, and a write that would pass it is refused") {
  Root root;
  root.owners["llama"] = 1000;
  root.Write("llama/step-1/rank-00000.safetensors", 600);
  root.Write("llama/step-1/manifest.json", 40);
  root.Write("llama/.owner", 10);
  auto quota = root.Quota({.per_user = 0, .per_job = 1000});
  CHECK(quota->UsageOf("llama").job == 650);
  CHECK(quota->Reserve("llama", 2, 0, 350).ok());  // 1000: at the bound, not over
  absl::Status over = quota->Reserve("llama", 2, 1, 1);
  CHECK(absl::IsResourceExhausted(over));
  CHECK_THAT(std::string(over.message()), Catch::Contains("rank 1 of step 2"));
  CHECK_THAT(std::string(over.message()), Catch::Contains("--job-quota-bytes"));
  CHECK_THAT(std::string(over.message()), Catch::Contains("job llama"));
  // The write that was admitted failed: its bytes no longer count.
  quota->Finished("llama", 350, 0);
  CHECK(quota->Reserve("llama", 2, 1, 300).ok());
}

TEST_CASE("a user's jobs count together; another user's never do") {
  Root root;
  root.owners = {{"a1", 1000}, {"a2", 1000}, {"b1", 1001}};
  root.Write("a1/step-1/rank-00000.safetensors", 400);
  root.Write("a2/step-1/rank-00000.safetensors", 400);
  root.Write("b1/step-1/rank-00000.safetensors", 5000);
  auto quota = root.Quota({.per_user = 1000, .per_job = 0});
  quota->MeasureRoot();  // ckptd's thread walks the root at start
  CHECK(quota->UsageOf("a1").user == 800);
  CHECK(quota->UsageOf("b1").user == 5000);
  absl::Status over = quota->Reserve("a2", 2, 0, 300);
  CHECK(absl::IsResourceExhausted(over));
  CHECK_THAT(std::string(over.message()), Catch::Contains("uid 1000"));
  CHECK_THAT(std::string(over.message()), Catch::Contains("--user-quota-bytes"));
  CHECK(quota->Reserve("a2", 2, 0, 200).ok());
  // uid 1001 is over on its own, and only its own writes are refused.
  CHECK(absl::IsResourceExhausted(quota->Reserve("b1", 2, 0, 1)));
  // A job nobody owns on record yet counts for no user.
  CHECK(quota->Reserve("new", 1, 0, 900).ok());
  // What a scrape reads (ckptd_user_disk_bytes): each owner's bytes, being written included,
  // without a walk; the job with no owner left out.
  CHECK(quota->UsageByUser() == std::map<uint32_t, uint64_t>{{1000, 1000}, {1001, 5000}});
}

TEST_CASE("written bytes count at once; what ckptd removes is measured again before the job's next write") {
  Root root;
  root.owners["j"] = 7;
  root.Write("j/step-1/rank-00000.safetensors", 500);
  auto quota = root.Quota({.per_user = 0, .per_job = 1000});
  REQUIRE(quota->Reserve("j", 2, 0, 400).ok());
  root.Write("j/step-2.tmp/rank-00000.safetensors", 400);
  quota->Finished("j", 400, 400);
  CHECK(quota->UsageOf("j").job == 900);
  CHECK(absl::IsResourceExhausted(quota->Reserve("j", 3, 0, 500)));
  // Retention removes step 1 (through the store, which says so).
  std::filesystem::remove_all(root.dir / "j/step-1");
  quota->Changed("j");
  CHECK(quota->Reserve("j", 3, 0, 500).ok());
  CHECK(quota->UsageOf("j").job == 900);  // step 2's 400 and step 3's 500, being written
}

TEST_CASE("a user's other jobs that ckptd removed files of are measured again before a refusal") {
  Root root;
  root.owners = {{"a1", 1000}, {"a2", 1000}};
  root.Write("a1/step-1/rank-00000.safetensors", 600);
  root.Write("a2/step-1/rank-00000.safetensors", 300);
  auto quota = root.Quota({.per_user = 1000, .per_job = 0});
  quota->MeasureRoot();
  CHECK(absl::IsResourceExhausted(quota->Reserve("a2", 2, 0, 300)));
  std::filesystem::remove_all(root.dir / "a1/step-1");
  quota->Changed("a1");
  CHECK(quota->Reserve("a2", 2, 0, 300).ok());
}

TEST_CASE("files written or removed behind ckptd's back count once the job's figure is 30 s old") {
  Root root;
  root.owners["j"] = 7;
  auto quota = root.Quota({.per_user = 0, .per_job = 1000});
  CHECK(quota->UsageOf("j").job == 0);
  root.Write("j/step-1/rank-00000.safetensors", 900);  // another daemon on a shared root
  CHECK(quota->Reserve("j", 2, 0, 200).ok());           // measured 0 s ago: not yet seen
  quota->Finished("j", 200, 0);
  root.now += DiskQuota::kRescan;
  CHECK(absl::IsResourceExhausted(quota->Reserve("j", 2, 0, 200)));
  std::filesystem::remove_all(root.dir / "j/step-1");    // an operator's rm
  root.now += DiskQuota::kRescan;
  CHECK(quota->Reserve("j", 2, 0, 200).ok());
}

TEST_CASE("a measurement replaces what was counted; a job gone from the root is forgotten") {
  Root root;
  root.owners["j"] = 7;
  root.Write("j/step-1/rank-00000.safetensors", 100);
  auto quota = root.Quota({.per_user = 0, .per_job = 1000});
  REQUIRE(quota->Reserve("j", 2, 0, 300).ok());
  quota->Finished("j", 300, 300);  // before any walk saw it
  quota->MeasureRoot();            // the file never reached the disk: 100
  CHECK(quota->UsageOf("j").job == 100);
  std::filesystem::remove_all(root.dir / "j");
  quota->MeasureRoot();
  CHECK(quota->UsageOf("j").job == 0);
}

TEST_CASE("no bounds: nothing is measured") {
  Root root;
  auto quota = root.Quota({});
  CHECK_FALSE(quota->enabled());
  CHECK(quota->Reserve("j", 1, 0, ~uint64_t{0}).ok());
}

}  // namespace
}  // namespace ckpt::persist
