// Held steps on an object store (format version 5, docs/format.md "Retention of referenced
// steps"; format/held_records.h): nothing moves in a bucket, so a step that kept steps
// reference is retired by a record beside its files, and an uploader's carried files are kept
// by its own record; everything that removes a step's objects (delete, sweep, orphans,
// start-up) spares what a record keeps. Against a real Ceph RADOS Gateway (tools/ceph.sh).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/persist/retention_keeper.h"
#include "format/checkpoint_store.h"
#include "format/held_records.h"
#include "format/manifest.h"
#include "storage/filesystem.h"
#include "storage/s3_store.h"
#include "tests/fakes/ceph_cluster.h"
#include "tests/fakes/increment_chain.h"
#include "tests/fakes/read_saved.h"
#include "tests/fakes/temp_dir.h"

using namespace ckpt;
using namespace ckpt::format;
using ckpt::testing::IncrementChain;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kRun = 0x1000, kNewRun = 0x2000;
const std::string kJob = "lora";
constexpr int64_t kRows = 32, kCols = 8;  // one rank, "emb" [32, 8] F32 in chunks of 4 rows

// A chain written by hand on a local disk, each step then copied to a bucket as the uploader
// puts it there (its files, the manifest last).
struct Job {
  testing::TempDir dir;
  std::unique_ptr<IncrementChain> writer = Chain(dir.path());
  CheckpointStore bucket{Bucket(), "s3://test"};
  std::vector<float> emb = std::vector<float>(kRows * kCols, 1.0f);
  std::map<uint64_t, std::string> saved;  // emb's bytes, by step
  std::map<uint64_t, Manifest> manifests;

  static std::unique_ptr<IncrementChain> Chain(const std::string& root) {
    return std::make_unique<IncrementChain>(root, kJob, 1, std::map<std::string, IncrementChain::Tensor>{
                                                               {"emb", {"F32", {kRows, kCols}}}},
                                            4 * kCols * 4);
  }
  static storage::StorePtr Bucket() {
    storage::S3Options options = testing::CephCluster::Get().Options();
    options.prefix = testing::CephCluster::Get().FreshPrefix();
    auto made = storage::MakeS3Store(options);
    REQUIRE(made.ok());
    return *made;
  }

  // Step `step` of `run` with row `row` changed, published in the bucket when `publish`.
  Manifest Save(uint64_t step, int row, bool full = false, uint64_t run = kRun, bool publish = true) {
    emb[row * kCols] += 1;
    IncrementChain::Step s;
    s.full = full;
    s.pieces["emb"] = {std::string(reinterpret_cast<const char*>(emb.data()), emb.size() * 4)};
    s.train_state = {{}};
    saved[step] = s.pieces["emb"][0];
    Manifest m = writer->Write(step, run, s);
    manifests[step] = m;
    if (publish) {
      Upload(m.shards[0].file, step);
      REQUIRE(bucket.Commit(m).ok());
    }
    return m;
  }
  void Upload(const std::string& file, uint64_t step, std::string to = {}) {
    std::ifstream in(writer->StepDir(step) + "/" + file, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(bucket.objects().Put(to.empty() ? CheckpointStore::StepKey(kJob, step) + "/" + file : to, bytes).ok());
  }
  std::map<std::string, uint64_t> Objects(uint64_t step) {
    auto listed = bucket.objects().List(CheckpointStore::StepKey(kJob, step));
    REQUIRE(listed.ok());
    std::map<std::string, uint64_t> out;
    for (const auto& e : *listed) out[e.name] = e.bytes;
    return out;
  }
  void Retain(uint32_t keep_last) {
    std::vector<std::string> errors;
    persist::RetentionKeeper keeper(bucket, {keep_last, 0}, [](const std::string&, uint64_t) {},
                                    [&](const std::string& error) { errors.push_back(error); });
    keeper.Schedule(kJob);
    keeper.Stop();
    CHECK(errors.empty());
  }
  // Step `step` read back from the bucket through its references, bit-exact.
  void ReadsBack(uint64_t step) {
    auto m = bucket.LoadManifest(kJob, step);
    REQUIRE(m.ok());
    auto pieces = testing::ReadSavedPieces(bucket.objects(), CheckpointStore::StepKey(kJob, step), *m);
    INFO(Message(pieces.status()));
    REQUIRE(pieces.ok());
    CHECK((*pieces)["emb"][0] == saved.at(step));
  }
};

}  // namespace

TEST_CASE("held record names parse only as written; a record from the bucket is checked, never thrown") {
  uint64_t run = 0;
  CHECK(ParseHeldRecordName(RetiredRecordName(0x18f3a9c2d4e5b6a7), &run));
  CHECK(run == 0x18f3a9c2d4e5b6a7);
  CHECK(ParseHeldRecordName(CarriedRecordName(5, 3), &run));
  CHECK(run == 5);
  for (const char* bad : {"held-5.json", "held-00000000000000AB.json", "held-0000000000000005.node-.json",
                          "held-0000000000000005.node-03.json", "held-0000000000000005.jsonx", "manifest.json"}) {
    INFO(bad);
    CHECK_FALSE(ParseHeldRecordName(bad, &run));
  }
  HeldRecord r{"j", 10, 7, {{"rank-00000.0000000000000007.safetensors", 4096}}, 30};
  auto back = ParseHeldRecord(HeldRecordJson(r), "r");
  REQUIRE(back.ok());
  CHECK(back->files == r.files);
  CHECK(back->carried_for == 30);
  for (const char* bad : {"", "[]", "{\"format\":\"ckptd-held\"}",
                          "{\"format\":\"ckptd-held\",\"job\":\"j\",\"step\":1,\"run\":2,\"files\":[{\"file\":\"../x\",\"bytes\":1}]}",
                          "{\"format\":\"ckptd-held\",\"job\":\"j\",\"step\":1,\"run\":2,\"files\":[],\"carried_for\":-1}"}) {
    INFO(bad);
    auto parsed = ParseHeldRecord(bad, "r");
    CHECK(absl::IsDataLoss(parsed.status()));
  }
}

TEST_CASE("in a bucket retention retires a referenced step by a record, keeps its file, and removes both once unreferenced") {
  Job job;
  job.Save(10, 0, /*full=*/true);
  job.Save(20, 4);
  job.Save(30, 0);  // references 10 (rows 8 to 31) and 20 (rows 4 to 7)
  job.Retain(1);
  auto steps = job.bucket.ListSteps(kJob);
  REQUIRE(steps.ok());
  CHECK(*steps == std::vector<uint64_t>{30});
  for (uint64_t held : {10, 20}) {
    const auto objects = job.Objects(held);
    INFO(held);
    CHECK(objects.count(RetiredRecordName(kRun)) == 1);
    CHECK(objects.count(job.manifests[held].shards[0].file) == 1);
    CHECK(objects.count("manifest.json") == 0);
  }
  auto listed = job.bucket.ListHeld(kJob);
  REQUIRE(listed.ok());
  CHECK(*listed == std::vector<StepRun>{{10, kRun}, {20, kRun}});
  job.ReadsBack(30);

  // A new run saves step 10 again beside the held one; deleting it spares the held file.
  job.writer = Job::Chain(job.dir.path() + "/new");
  job.Save(10, 3, /*full=*/true, kNewRun);
  job.ReadsBack(10);
  job.ReadsBack(30);
  REQUIRE(job.bucket.Delete(kJob, 10).ok());
  CHECK(job.Objects(10).size() == 2);  // the held file and its record
  job.ReadsBack(30);
  // Start-up's sweep of unfinished steps leaves a held step alone.
  REQUIRE(job.bucket.RemoveStaleTemp().ok());
  job.ReadsBack(30);

  // Once a step that references nothing is the one kept, every held object goes.
  job.Save(40, 4, /*full=*/true);
  job.Retain(1);
  for (uint64_t gone : {10, 20, 30}) {
    INFO(gone);
    CHECK(job.Objects(gone).empty());
  }
  job.ReadsBack(40);
}

TEST_CASE("in a bucket an uploader's carried files stay while the step they were carried for may still be published") {
  Job job;
  // Step 10 never went up as a step: an upload of 20 carried its file after a record.
  const Manifest ten = job.Save(10, 0, /*full=*/true, kRun, /*publish=*/false);
  const Manifest twenty = job.Save(20, 1, false, kRun, /*publish=*/false);
  const std::string file = ten.shards[0].file;
  REQUIRE(job.bucket.RecordCarried(kJob, {10, kRun}, 0, 20, {{file, ten.shards[0].bytes}}).ok());
  job.Upload(file, 10, job.bucket.CarriedFileKey(kJob, {10, kRun}, file));
  auto listed = job.bucket.ListHeld(kJob);
  REQUIRE(listed.ok());
  CHECK(*listed == std::vector<StepRun>{{10, kRun}});
  // Nothing references it yet (20 is not published): a pass keeps it, and so do the removal
  // of unfinished steps (orphans, start-up).
  job.Retain(1);
  REQUIRE(job.bucket.AbortStep(kJob, 10).ok());
  REQUIRE(job.bucket.RemoveStaleTemp().ok());
  CHECK(job.Objects(10).count(file) == 1);
  CHECK(absl::IsFailedPrecondition(job.bucket.RemoveHeld(kJob, {10, kRun})));
  // 20 published: it references 10.
  job.Upload(twenty.shards[0].file, 20);
  REQUIRE(job.bucket.Commit(twenty).ok());
  job.Retain(1);
  job.ReadsBack(20);
  // A later full step supersedes 20: the carried record no longer keeps 10, nor 20 it.
  job.Save(30, 2, /*full=*/true);
  job.Retain(1);
  CHECK(job.Objects(10).empty());
  CHECK(job.Objects(20).empty());
  job.ReadsBack(30);
}
