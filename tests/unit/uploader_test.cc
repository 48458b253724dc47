// The upload stage over two real local stores (the remote one stands in for a bucket: the
// uploader uses only the Store interface): which steps go, the pins that keep local
// retention off steps not yet uploaded, the publisher waiting for another node's files and
// writing the manifest only once they are all there.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <tuple>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "daemon/group/committed_step.h"
#include "daemon/group/upload_targets.h"
#include "daemon/persist/retention_keeper.h"
#include "daemon/upload/memory_first_reader.h"
#include "daemon/upload/upload_policy.h"
#include "daemon/upload/uploader.h"
#include "format/checkpoint_store.h"
#include "format/increment.h"
#include "format/indexed_manifest.h"
#include "format/safetensors.h"
#include "storage/filesystem.h"
#include "tests/fakes/faulty_filesystem.h"
#include "tests/fakes/split_region.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

using ckpt::daemon::upload::InMemoryShard;
using ckpt::daemon::upload::MemoryFirst;
using ckpt::daemon::upload::ShouldUpload;
using ckpt::daemon::upload::Uploader;
using ckpt::daemon::upload::UploadPolicy;
using ckpt::testing::TempDir;
using ckpt::testing::WaitUntil;
using namespace std::chrono_literals;

namespace {


// Commits `step` of job "j" on `store` as two ranks on two nodes; `with_ranks` are written.
// `indexed`: published as a shared root publishes a step too large for one manifest, an
// index and a part per node (returned: the index).
// `scoped_to`: committed as that node of a group with node-local disks commits it, a
// node-scoped manifest of its ranks (returned: that manifest).
constexpr char kDigest[] = "xxh3:00000000000000aa";  // the commit's, in scoped manifests

ckpt::format::Manifest CommitStep(ckpt::format::CheckpointStore& store, uint64_t step,
                                  std::vector<uint32_t> with_ranks, bool indexed = false,
                                  std::optional<uint32_t> scoped_to = std::nullopt) {
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
  if (indexed) {
    std::optional<ckpt::format::Manifest> index;
    for (uint32_t node : {0u, 1u}) {
      ckpt::format::Manifest part = m;
      ckpt::format::RemoveRanks(part, [&](uint32_t r) { return r != node; });
      part.nodes = {m.nodes[node]};
      part.scope = ckpt::format::StepScope{node, 2, m.total_bytes(), 0, "xxh3:00000000000000aa"};
      if (!index) index = ckpt::format::IndexHeader(part);
      REQUIRE(store.WriteManifestPart(part, *index).ok());
    }
    REQUIRE(store.Commit(*index).ok());
    return *index;
  }
  if (scoped_to) {
    ckpt::format::Manifest mine = ckpt::group::NodeManifestFromWhole(m, kDigest, *scoped_to);
    REQUIRE(store.Commit(mine).ok());
    return mine;
  }
  REQUIRE(store.Commit(m).ok());
  return m;
}

// What node 1 of a two-node group does once its part of `whole`'s step is uploaded: its
// node-scoped manifest as the step's part, then its report for `run`.
void ReportNodeOne(ckpt::format::CheckpointStore& remote, const ckpt::format::Manifest& whole, uint64_t run) {
  const std::string text = ckpt::format::ManifestToJson(ckpt::group::NodeManifestFromWhole(whole, kDigest, 1));
  REQUIRE(remote.objects().Put(remote.TempStepKey(whole.job, whole.step) + "/manifest-node-00001.json", text).ok());
  ckpt::daemon::upload::PartReport r{run, 1, kDigest, {1}, {5001}, text.size(), ckpt::format::ManifestDigest(text)};
  REQUIRE(remote.objects().Put(fmt::format("{}/.uploads/step-{:08d}/node-1", whole.job, whole.step),
                               ckpt::daemon::upload::PartReportJson(r)).ok());
}

// Bytes that never repeat at a small period (a misplaced offset shows).
std::shared_ptr<std::string> DataRegion(size_t bytes, uint32_t seed) {
  auto data = std::make_shared<std::string>(bytes, '\0');
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (char& c : *data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<char>(x);
  }
  return data;
}

// Commits `step` of job "j" as one rank whose shard is a real safetensors file: a 4 KiB
// aligned header (as persist writes it), then `data`.
ckpt::format::Manifest CommitShard(ckpt::format::CheckpointStore& store, uint64_t step,
                                   const std::string& data) {
  ckpt::format::Manifest m;
  m.job = "j";
  m.step = step;
  m.world_size = 1;
  m.unix_time = 1000.0 + static_cast<double>(step);
  m.run = 777;
  const std::string file = ckpt::format::EncodeHeader(
                               {{"w", "U8", {static_cast<int64_t>(data.size())}, 0, data.size()}}, {}, 4096) +
                           data;
  REQUIRE(store.BeginStep("j", step).ok());
  ckpt::format::ManifestShard s;
  s.rank = 0;
  s.file = ckpt::format::ShardFileName(0);
  s.bytes = file.size();
  m.shards.push_back(s);
  auto out = store.objects().Create(store.TempStepKey("j", step) + "/" + s.file);
  REQUIRE(out.ok());
  REQUIRE((*out)->Append(file.data(), file.size()).ok());
  REQUIRE((*out)->Finish().ok());
  REQUIRE(store.Commit(m).ok());
  return m;
}

std::string ReadAll(ckpt::format::CheckpointStore& store, const std::string& key) {
  auto object = store.objects().Open(key);
  REQUIRE(object.ok());
  std::string bytes((*object)->size(), '\0');
  REQUIRE((*object)->ReadAt(bytes.data(), bytes.size(), 0).ok());
  return bytes;
}

// `data` as a staged snapshot with frozen tensors holds it: in two places.
std::shared_ptr<const ckpt::ScatteredBytes> InStaging(const std::string& data) {
  return ckpt::testing::SplitRegion(data);
}

InMemoryShard Held(const std::shared_ptr<const ckpt::ScatteredBytes>& region) { return {region, region->size()}; }

}  // namespace

TEST_CASE("a shard's data region is read from staging memory while it lasts, then from the file") {
  TempDir dir;
  auto disk = std::make_shared<ckpt::testing::FaultyFilesystem>(ckpt::MakePosixFilesystem());
  ckpt::format::CheckpointStore local(disk, dir.path() + "/local");
  auto data = DataRegion(3 << 20, 1);
  CommitShard(local, 1, *data);
  const std::string key = "j/step-00000001/" + ckpt::format::ShardFileName(0);
  const std::string file = ReadAll(local, key);
  const uint64_t header = file.size() - data->size();

  std::atomic<uint64_t> from_memory{0};
  auto open = local.objects().Open(key);
  REQUIRE(open.ok());
  auto staged = InStaging(*data);
  std::unique_ptr<ckpt::storage::ObjectReader> reader = MemoryFirst(std::move(*open), Held(staged), &from_memory);
  std::string got(1 << 20, '\0');
  const uint64_t before = disk->bytes_read();
  // A read across the header's end: the header from the file, the rest from memory.
  REQUIRE(reader->ReadAt(got.data(), got.size(), header - 100).ok());
  CHECK(got == file.substr(header - 100, got.size()));
  CHECK(disk->bytes_read() - before == 100);
  CHECK(from_memory == got.size() - 100);
  // A read across the two places the region lies in, from memory too.
  REQUIRE(reader->ReadAt(got.data(), got.size(), header + data->size() / 2 - 1000).ok());
  CHECK(got == file.substr(header + data->size() / 2 - 1000, got.size()));
  CHECK(disk->bytes_read() - before == 100);
  CHECK(from_memory == 2 * got.size() - 100);
  // The stager took the memory back: the rest comes from the file, and is the same.
  staged.reset();
  REQUIRE(reader->ReadAt(got.data(), got.size(), header + (1 << 20)).ok());
  CHECK(got == file.substr(header + (1 << 20), got.size()));
  CHECK(disk->bytes_read() - before == 100 + got.size());
  CHECK(from_memory == 2 * got.size() - 100);

  // Memory that is not this file's data region (another size) is never used.
  auto other = DataRegion((3 << 20) - 4096, 1);
  open = local.objects().Open(key);
  REQUIRE(open.ok());
  reader = MemoryFirst(std::move(*open), Held(InStaging(*other)), &from_memory);
  REQUIRE(reader->ReadAt(got.data(), got.size(), header).ok());
  CHECK(got == file.substr(header, got.size()));
  CHECK(from_memory == 2 * (1 << 20) - 100);
}

// One daemon's uploader over two local stores, the local one on a disk that counts reads.
struct OneNode {
  TempDir dir;
  std::shared_ptr<ckpt::testing::FaultyFilesystem> disk =
      std::make_shared<ckpt::testing::FaultyFilesystem>(ckpt::MakePosixFilesystem());
  ckpt::format::CheckpointStore local{disk, dir.path() + "/local"};
  ckpt::format::CheckpointStore remote{ckpt::MakePosixFilesystem(), dir.path() + "/remote"};
  ckpt::persist::RetentionKeeper retention{local, {2, 0}, [](const std::string&, uint64_t) {},
                                           [](const std::string&) {}};
  Uploader uploader{local, remote, retention, Options(), [](const std::string&) {}, [](const std::string&) {}};

  static Uploader::Options Options() {
    Uploader::Options o;
    o.poll = 10ms;
    return o;
  }
};

TEST_CASE("an upload sends the data regions from staging memory, and from disk once they are gone") {
  OneNode node;
  auto& [dir, disk, local, remote, retention, uploader] = node;
  const std::string shard = "/" + ckpt::format::ShardFileName(0);

  auto hot = DataRegion(5 << 20, 2);
  ckpt::format::Manifest first = CommitShard(local, 1, *hot);
  uint64_t before = disk->bytes_read();
  auto hot_staged = InStaging(*hot);
  uploader.Committed(first, {{0, Held(hot_staged)}});
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 1); }, 10s, 10ms));
  CHECK(disk->bytes_read() - before < 64 * 1024);  // the header and the manifest
  CHECK(ReadAll(remote, "j/step-00000001" + shard) == ReadAll(local, "j/step-00000001" + shard));

  // Evicted before its upload began: every byte comes from the file.
  auto evicted = DataRegion(5 << 20, 3);
  ckpt::format::Manifest second = CommitShard(local, 2, *evicted);
  auto evicted_staged = InStaging(*evicted);
  InMemoryShard gone = Held(evicted_staged);
  evicted_staged.reset();
  before = disk->bytes_read();
  uploader.Committed(second, {{0, gone}});
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 2); }, 10s, 10ms));
  CHECK(disk->bytes_read() - before >= (5u << 20));
  CHECK(ReadAll(remote, "j/step-00000002" + shard) == ReadAll(local, "j/step-00000002" + shard));
  uploader.Stop();
}

TEST_CASE("an upload whose owner record has no answer yet shows as waiting, says on what, and goes once answered") {
  TempDir dir;
  ckpt::format::CheckpointStore local{ckpt::MakePosixFilesystem(), dir.path() + "/local"};
  ckpt::format::CheckpointStore remote{ckpt::MakePosixFilesystem(), dir.path() + "/remote"};
  ckpt::persist::RetentionKeeper retention{local, {2, 0}, [](const std::string&, uint64_t) {},
                                           [](const std::string&) {}};
  std::atomic<bool> answered{false};
  std::atomic<int> asked{0};
  std::atomic<int> errors{0};
  Uploader::Options o;
  o.poll = 10ms;
  o.waiting_retry = 20ms;
  o.before_upload = [&](const std::string& job) -> absl::Status {
    ++asked;
    if (answered) return absl::OkStatus();
    return absl::DeadlineExceededError("waiting for the remote tier to say who owns job " + job);
  };
  Uploader uploader{local, remote, retention, o, [](const std::string&) {}, [&](const std::string&) { ++errors; }};
  auto data = DataRegion(1 << 20, 4);
  uploader.Committed(CommitShard(local, 1, *data));
  REQUIRE(WaitUntil([&] { return asked >= 5; }, 10s, 5ms));
  std::vector<ckpt::daemon::upload::UploadProgress> shown = uploader.InProgress();
  REQUIRE(shown.size() == 1);
  CHECK((shown[0].state == "waiting" || shown[0].state == "uploading"));
  CHECK(shown[0].last_error == "waiting for the remote tier to say who owns job j");
  CHECK(errors == 1);  // said once, however often it is asked again
  CHECK_FALSE(remote.Committed("j", 1));
  answered = true;
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 1); }, 10s, 10ms));
  uploader.Stop();
}

TEST_CASE("an indexed step (a shared root's, too large for one manifest) goes up as its files, parts and index") {
  OneNode node;
  auto& [dir, disk, local, remote, retention, uploader] = node;
  // What the committer announces of such a step is its index. This uploader has no node of
  // its own, as a shared root's coordinator: it uploads every file and waits for no report.
  const ckpt::format::Manifest index = CommitStep(local, 3, {0, 1}, /*indexed=*/true);
  REQUIRE(index.index.has_value());
  uploader.Committed(index, {});
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 3); }, 10s, 10ms));
  for (const std::string file : {"rank-00000.safetensors", "rank-00001.safetensors", "manifest-node-00000.json",
                                 "manifest-node-00001.json", "manifest.json"}) {
    INFO(file);
    CHECK(ReadAll(remote, "j/step-00000003/" + file) == ReadAll(local, "j/step-00000003/" + file));
  }
  auto there = remote.LoadManifest("j", 3);
  REQUIRE(there.ok());
  CHECK(there->shards.size() == 2);
  CHECK(ckpt::format::ManifestToJson(*there) == ckpt::format::ManifestToJson(*local.LoadManifest("j", 3)));
  uploader.Stop();
}

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
  ReportNodeOne(remote, first, 12345);
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(remote.Committed("j", 1));
  // Node 1 reports its part for this run: the index is written, step 3 is next.
  ReportNodeOne(remote, first, first.run);
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 1); }, 5s, 10ms));
  // The step went up as an index of each node's manifest: node 0's cut from its whole one,
  // scoped to the commit node 1's part names.
  auto index = remote.LoadManifest("j", 1, ckpt::format::CheckpointStore::Depth::kIndexOnly);
  REQUIRE(index.ok());
  REQUIRE(index->index.has_value());
  CHECK(index->index->digest == kDigest);
  CHECK(index->nodes == std::vector<ckpt::format::ManifestNode>{{0, {0}}, {1, {1}}});
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

TEST_CASE("in a group every node uploads its part of the step node 0 uploads, whatever it committed last") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  ckpt::format::CheckpointStore node0(fs, dir.path() + "/node0");
  ckpt::format::CheckpointStore node1(fs, dir.path() + "/node1");
  ckpt::format::CheckpointStore remote(fs, dir.path() + "/remote");
  ckpt::persist::RetentionKeeper keep0(node0, {0, 0}, [](const std::string&, uint64_t) {}, [](const std::string&) {});
  ckpt::persist::RetentionKeeper keep1(node1, {0, 0}, [](const std::string&, uint64_t) {}, [](const std::string&) {});
  ckpt::group::UploadTargets targets;  // what node 0 announces, and node 1 hears
  Uploader::Options follower;
  follower.node = 1;
  follower.publishes = false;
  follower.poll = 10ms;
  follower.follow = [&](const std::string& job) { return targets.Get(job); };
  Uploader node1_uploader(node1, remote, keep1, follower, [](const std::string&) {}, [](const std::string&) {});

  // Node 1 commits steps 1-3 (uploads slower than commits: its newest is 3), and hears of no
  // upload: it sends nothing of its own accord.
  std::vector<ckpt::format::Manifest> steps;
  for (uint64_t step = 1; step <= 3; ++step) {
    steps.push_back(CommitStep(node1, step, {1}, false, 1));
    node1_uploader.Committed(steps.back());
  }
  std::this_thread::sleep_for(300ms);
  CHECK_FALSE(remote.objects().Exists("j/.uploads/step-00000003/node-1").value_or(true));

  // Node 0 uploads step 2 (its uploader was free when step 2 committed there): node 1 sends
  // its part of step 2, not its newest, and step 2 is published.
  Uploader::Options publisher;
  publisher.node = 0;
  publisher.poll = 10ms;
  publisher.announce = [&](const std::string& job, uint64_t step) { targets.Set(job, step); };
  Uploader node0_uploader(node0, remote, keep0, publisher, [](const std::string&) {}, [](const std::string&) {});
  std::vector<ckpt::format::Manifest> on_node0;
  for (uint64_t step = 1; step <= 3; ++step) on_node0.push_back(CommitStep(node0, step, {0}));
  node0_uploader.Committed(on_node0[1]);
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 2); }, 10s, 10ms));
  CHECK_FALSE(remote.Committed("j", 3));
  CHECK(ReadAll(remote, "j/step-00000002/" + ckpt::format::ShardFileName(1)) == std::string(5001, 'c'));

  // Node 0 moves on to a step node 1 has not committed yet: node 1 waits for its commit,
  // then sends its part.
  node0_uploader.Committed(CommitStep(node0, 4, {0}));
  REQUIRE(WaitUntil([&] { return targets.Get("j") == 4u; }, 5s, 10ms));
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(remote.Committed("j", 4));
  node1_uploader.Committed(CommitStep(node1, 4, {1}, false, 1));
  REQUIRE(WaitUntil([&] { return remote.Committed("j", 4); }, 10s, 10ms));
  CHECK_FALSE(remote.Committed("j", 3));
  node0_uploader.Stop();
  node1_uploader.Stop();
}

TEST_CASE("an upload report is data from the bucket: a crafted one is refused, naming why, never thrown") {
  using ckpt::daemon::upload::ParsePartReport;
  using ckpt::daemon::upload::PartReport;
  using ckpt::daemon::upload::PartReportJson;
  const PartReport good{7, 3, kDigest, {6, 7}, {100, 200}, 900, "xxh3:0123456789abcdef"};
  auto parsed = ParsePartReport(PartReportJson(good), "node-3");
  REQUIRE(parsed.ok());
  CHECK(parsed->node == 3);
  CHECK(parsed->ranks == std::vector<uint32_t>{6, 7});
  CHECK(parsed->shard_bytes == std::vector<uint64_t>{100, 200});
  auto doc = nlohmann::json::parse(PartReportJson(good));
  for (auto [field, value, why] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"format", 1, "\"format\" is not"},
           {"run", 1e300, "\"run\" is not an integer"},
           {"run", -1, "\"run\" is not an integer"},
           {"node", 4294967299ull, "\"node\" is not an integer"},
           {"digest", "md5:0", "\"digest\" is not"},
           {"part_checksum", 5, "\"part_checksum\" is not"},
           {"ranks", nlohmann::json::array({7, 6}), "not strictly ascending"},
           {"shard_bytes", nlohmann::json::array({1}), "one entry per rank"},
           {"ranks", "6", "one entry per rank"}}) {
    auto crafted = doc;
    crafted[field] = value;
    auto refused = ParsePartReport(crafted.dump(), "node-3");
    INFO(field << " = " << value.dump());
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(ckpt::Message(refused.status()), Catch::Contains(why) && Catch::Contains("node-3"));
  }
  auto missing = doc;
  missing.erase("part_bytes");
  CHECK_THAT(ckpt::Message(ParsePartReport(missing.dump(), "r").status()), Catch::Contains("no \"part_bytes\""));
  CHECK_FALSE(ParsePartReport("[1, 2]", "r").ok());
  CHECK_FALSE(ParsePartReport("{\"format\": ", "r").ok());
}

TEST_CASE("an upload report names each rank's file and a version 5 part's origins; an older report means untagged files") {
  using ckpt::daemon::upload::ParsePartReport;
  using ckpt::daemon::upload::PartReport;
  using ckpt::daemon::upload::PartReportJson;
  using ckpt::format::TaggedShardFileName;
  PartReport r{7, 3, kDigest, {6, 7}, {100, 200}, 900, "xxh3:0123456789abcdef"};
  r.files = {TaggedShardFileName(6, 0x18f3a9c2d4e5b6a8), TaggedShardFileName(7, 0x18f3a9c2d4e5b6a8)};
  r.step = 30;
  r.increment = ckpt::format::Increment{
      4096, 1 << 20, {{10, 7}, {20, 7}},
      {{10, 7, 6, TaggedShardFileName(6, 0x18f3a9c2d4e5b6a7), 5000}, {10, 7, 7, TaggedShardFileName(7, 0x18f3a9c2d4e5b6a7), 6000},
       {20, 7, 7, TaggedShardFileName(7, 0x18f3a9c2d4e5b6a8), 7000}}};
  auto parsed = ParsePartReport(PartReportJson(r), "node-3");
  INFO(PartReportJson(r));
  REQUIRE(parsed.ok());
  CHECK(parsed->files == r.files);
  CHECK(parsed->step == std::optional<uint64_t>(30));
  REQUIRE(parsed->increment.has_value());
  CHECK(parsed->increment->own_bytes == 4096);
  CHECK(parsed->increment->referenced_bytes == (1 << 20));
  CHECK(parsed->increment->origin_steps == r.increment->origin_steps);
  CHECK(parsed->increment->origins == r.increment->origins);

  // A report of a ckptd that reported no files (every step's files were untagged then) still
  // parses, meaning those names; it has no increment.
  auto doc = nlohmann::json::parse(PartReportJson(r));
  auto old = doc;
  old.erase("files");
  old.erase("increment");
  old.erase("step");
  auto parsed_old = ParsePartReport(old.dump(), "node-3");
  REQUIRE(parsed_old.ok());
  CHECK(parsed_old->files == std::vector<std::string>{"rank-00006.safetensors", "rank-00007.safetensors"});
  CHECK_FALSE(parsed_old->increment.has_value());

  // What a crafted report may not say.
  auto origin_of_other_rank = doc;
  origin_of_other_rank["increment"]["origins"][0]["rank"] = 5;
  origin_of_other_rank["increment"]["origins"][0]["file"] = TaggedShardFileName(5, 1);
  auto increment_of_itself = doc;
  increment_of_itself["step"] = 20;
  auto no_step = doc;
  no_step.erase("step");
  auto unlisted_step = doc;
  unlisted_step["increment"]["origin_steps"] = nlohmann::json::array({{{"step", 10}, {"run", 7}}});
  for (auto [crafted, why] : std::vector<std::pair<nlohmann::json, std::string>>{
           {[&] { auto d = doc; d["files"] = nlohmann::json::array({"rank-00006.safetensors"}); return d; }(),
            "one entry per rank"},
           {[&] { auto d = doc; d["files"][1] = TaggedShardFileName(6, 1); return d; }(),
            "\"files\"[1] is not a shard file name of rank 7"},
           {[&] { auto d = doc; d["files"][0] = "../rank-00006.safetensors"; return d; }(), "of rank 6"},
           {origin_of_other_rank, "names an origin of rank 5"},
           {increment_of_itself, "step 20 itself"},
           {no_step, "without its \"step\""},
           {unlisted_step, "origin_steps are not the steps its origins name"},
           {[&] { auto d = doc; d["increment"] = 5; return d; }(), "\"increment\" is not an object"},
           {[&] { auto d = doc; d["increment"].erase("own_bytes"); return d; }(), "own_bytes"}}) {
    auto refused = ParsePartReport(crafted.dump(), "node-3");
    INFO(crafted.dump());
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(ckpt::Message(refused.status()), Catch::Contains(why) && Catch::Contains("node-3"));
  }
}
