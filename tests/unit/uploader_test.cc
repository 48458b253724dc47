// The upload stage over two real local stores (the remote one stands in for a bucket: the
// uploader uses only the Store interface): which steps go, the pins that keep local
// retention off steps not yet uploaded, the publisher waiting for another node's files and
// writing the manifest only once they are all there.
#include <catch2/catch.hpp>

#include <chrono>
#include <thread>

#include "daemon/persist/retention_keeper.h"
#include "daemon/upload/upload_policy.h"
#include "daemon/upload/uploader.h"
#include "format/checkpoint_store.h"
#include "storage/filesystem.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using ckpt::daemon::upload::ShouldUpload;
using ckpt::daemon::upload::Uploader;
using ckpt::daemon::upload::UploadPolicy;
using ckpt::testing::TempDir;
using ckpt::testing::WaitUntil;
using namespace std::chrono_literals;

namespace {


// Commits `step` of job "j" on `store` as two ranks on two nodes; `with_ranks` are written.
ckpt::format::Manifest CommitStep(ckpt::format::CheckpointStore& store, uint64_t step,
                                  std::vector<uint32_t> with_ranks) {
  ckpt::format::Manifest m;
  m.job = "j";
  m.step = step;
  m.world_size = 2;
  m.unix_time = 1000.0 + static_cast<double>(step);
  m.run = 777;
  m.nodes = {{0, {0}}, {1, {1}}};
  REQUIRE(store.BeginStep("j", step).ok());
  for (uint32_t r = 0; r < 2; ++r) {
    ckpt::format::ManifestShard s;
    s.rank = r;
    s.file = ckpt::format::ShardFileName(r);
    s.bytes = 5000 + r;
    m.shards.push_back(s);
    if (std::find(with_ranks.begin(), with_ranks.end(), r) == with_ranks.end()) continue;
    auto out = store.objects().Create(store.TempStepKey("j", step) + "/" + s.file);
    REQUIRE(out.ok());
    std::string bytes(s.bytes, static_cast<char>('a' + step % 26));
    REQUIRE((*out)->Append(bytes.data(), bytes.size()).ok());
    REQUIRE((*out)->Finish().ok());
  }
  REQUIRE(store.Commit(m).ok());
  return m;
}

}  // namespace

TEST_CASE("the policy: multiples of N, then the first of each window, the same on every node") {
  UploadPolicy every{1, 0ms};
  CHECK(ShouldUpload(every, 7, 100.0, 99.0));
  UploadPolicy tenth{10, 0ms};
  CHECK_FALSE(ShouldUpload(tenth, 7, 100.0, std::nullopt));
  CHECK(ShouldUpload(tenth, 20, 100.0, std::nullopt));
  UploadPolicy minute{1, 60s};
  CHECK(ShouldUpload(minute, 1, 125.0, std::nullopt));  // nothing seen yet
  CHECK_FALSE(ShouldUpload(minute, 2, 170.0, 125.0));   // the same window [120, 180)
  CHECK(ShouldUpload(minute, 3, 181.0, 170.0));         // a new one
}

TEST_CASE("the publisher waits for every node's files; retention never deletes a step not yet uploaded") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  ckpt::format::CheckpointStore local(fs, dir.path() + "/local");
  ckpt::format::CheckpointStore remote(fs, dir.path() + "/remote");
  ckpt::persist::RetentionKeeper retention(local, {1, 0}, [](const std::string&, uint64_t) {},
                                           [](const std::string&) {});
  Uploader::Options o;
  o.node = 0;  // this node holds rank 0; node 1 uploads rank 1's file
  o.poll = 10ms;
  std::vector<std::string> published;
  std::mutex mu;
  Uploader uploader(local, remote, retention, o,
                    [&](const std::string& job) {
                      std::lock_guard lock(mu);
                      published.push_back(job);
                    },
                    [](const std::string&) {});
  ckpt::format::Manifest first = CommitStep(local, 1, {0});

  uploader.Committed(first);
  retention.Schedule("j");
  REQUIRE(WaitUntil([&] {
    auto p = uploader.InProgress();
    return !p.empty() && p[0].step == 1 && p[0].state == "waiting for nodes" && p[0].bytes_done == 5000;
  }, 5s, 10ms));
  // Steps 2 and 3 commit meanwhile, and retention keeps one: step 1 is being uploaded and
  // step 3 is queued (the newest), so both stay; step 2 goes.
  for (uint64_t step : {2, 3}) {
    uploader.Committed(CommitStep(local, step, {0}));
    retention.Schedule("j");
  }
  REQUIRE(WaitUntil([&] { return !local.Committed("j", 2); }, 5s, 10ms));
  CHECK(local.Committed("j", 1));
  CHECK(local.Committed("j", 3));
  CHECK_FALSE(remote.Committed("j", 1));  // never before every file is there

  // Node 1's file of step 1 arrives, with a report from another run (the same names and
  // sizes, left by a run that once reached step 1 too): not this step's part.
  auto out = remote.objects().Create(remote.TempStepKey("j", 1) + "/" + ckpt::format::ShardFileName(1));
  REQUIRE(out.ok());
  std::string bytes(5001, 'z');
  REQUIRE((*out)->Append(bytes.data(), bytes.size()).ok());
  REQUIRE((*out)->Finish().ok());
  REQUIRE(remote.objects().Put("j/.uploads/step-00000001/node-1", "12345").ok());
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(remote.Committed("j", 1));
  // Node 1 reports its part for this run: the manifest is written, step 3 is next.
  REQUIRE(remote.objects().Put("j/.uploads/step-00000001/node-1", std::to_string(first.run)).ok());
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 1); }, 5s, 10ms));
  // What was uploaded is what was committed here.
  auto uploaded = remote.objects().Open("j/step-00000001/" + ckpt::format::ShardFileName(0));
  REQUIRE(uploaded.ok());
  std::string got(5000, '\0');
  REQUIRE((*uploaded)->ReadAt(got.data(), got.size(), 0).ok());
  CHECK(got == std::string(5000, 'b'));
  // The nodes' reports go once the manifest is written (just after it).
  CHECK(WaitUntil([&] { return !remote.objects().Exists("j/.uploads/step-00000001/node-1").value_or(true); }, 5s, 10ms));
  auto manifest = remote.LoadManifest("j", 1);
  REQUIRE(manifest.ok());
  CHECK(manifest->shards.size() == 2);
  CHECK(WaitUntil([&] { return uploader.LastUploaded().count("j") && uploader.LastUploaded().at("j") == 1; }, 5s, 10ms));
  REQUIRE(WaitUntil([&] {
    auto p = uploader.InProgress();
    return !p.empty() && p[0].step == 3;
  }, 5s, 10ms));
  CHECK_FALSE(remote.Committed("j", 2));  // replaced by a newer step before its turn
  // Step 1 no longer pinned: the next retention pass may delete it locally.
  retention.Schedule("j");
  REQUIRE(WaitUntil([&] { return !local.Committed("j", 1); }, 5s, 10ms));
  CHECK(local.Committed("j", 3));
  uploader.Stop();
  std::lock_guard lock(mu);
  CHECK(published == std::vector<std::string>{"j"});
}
