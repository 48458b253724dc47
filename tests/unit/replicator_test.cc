// The replicator and the restore's side of peer replicas over real gRPC on loopback (issue
// 25): this node (node 0) codes its staged shards, sends the fragments to the holders of its
// coding group (each a real ReplicaService over a FragmentStore), seals a committed step
// with its manifest, gives up a failed one, and PeerShards rebuilds a shard from what the
// holders serve back. No transport is mocked: only the group's view (who is alive) is the
// test's to set.
#include <catch2/catch.hpp>

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fragment_store.h"
#include "daemon/replicate/peer_directory.h"
#include "daemon/replicate/peer_shards.h"
#include "daemon/replicate/replica_service.h"
#include "daemon/replicate/replicator.h"
#include "tests/fakes/sanitizer_slowdown.h"
#include "tests/fakes/split_region.h"
#include "tests/fakes/wait_until.h"

using namespace ckpt::replicate;
using namespace std::chrono_literals;
using ckpt::testing::WaitUntil;
using State = StepReplication::State;

namespace {

// A rebuilt shard's bytes, to compare.
std::string Bytes(const ckpt::daemon::ShardBytes& s) { return std::string(s.data.get(), s.size); }

constexpr char kToken[] = "replicator-test-token-0123456789abcdef";
constexpr char kJob[] = "llm";
constexpr uid_t kUid = 1000;
constexpr uint64_t kRun = 77;
// What a restore allows a rebuilt shard (its file's size in the manifest): more than any here.
constexpr uint64_t kMaxShard = 1 << 20;
// Bounds every wait: a step is replicated in well under a second on loopback; a step whose
// holder is not alive settles after the replicator's 5 s kViewSettle.
constexpr auto kWait = 60s;  // stretched under sanitizers; settles as soon as it can

// A peer node: its store of other nodes' fragments and its Replicas service on a loopback port.
struct Peer {
  Peer(size_t budget, ReplicaFaults faults) : store(budget, {}), service(store, kToken, std::move(faults)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~Peer() {
    if (server) server->Shutdown(std::chrono::system_clock::now() + 5s);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }

  FragmentStore store;
  ReplicaService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

struct GroupOptions {
  uint32_t nodes = 4;
  int k = 2;
  int m = 1;
  std::map<uint32_t, ReplicaFaults> faults;  // by node
  std::map<uint32_t, size_t> budgets;        // by node; 64 MiB otherwise
  // Each call's deadline (stretched under sanitizers): what a stalled peer costs.
  std::chrono::milliseconds call_timeout = 10s;
};

// Nodes 0..nodes-1 of a job: node 0 is this node (the one replicating, no service of its
// own here), every other node a real peer. The directory sees them all alive unless the
// test says otherwise.
class Group {
 public:
  explicit Group(GroupOptions o) : options_(o) {
    peers_.resize(o.nodes);
    for (uint32_t n = 1; n < o.nodes; ++n) {
      const size_t budget = o.budgets.count(n) ? o.budgets.at(n) : size_t{64} << 20;
      peers_[n] = std::make_unique<Peer>(budget, o.faults.count(n) ? o.faults.at(n) : ReplicaFaults{});
      REQUIRE(peers_[n]->server != nullptr);
    }
    PeerDirectory::Options d;
    d.self = 0;
    d.num_nodes = o.nodes;
    d.k = o.k;
    d.m = o.m;
    d.token = kToken;
    d.timeout = o.call_timeout * ckpt::testing::kSanitizerSlowdown;
    // Fragments of a few hundred KB in 64 KiB chunks: several chunks each, and few bytes for
    // the sanitizers' builds to watch cross gRPC's own threads.
    d.chunk_bytes = 64 << 10;
    directory_ = std::make_unique<PeerDirectory>(
        d, [this] { return Members(); },
        [](const std::string& address) { return grpc::CreateChannel(address, grpc::InsecureChannelCredentials()); });
  }

  PeerDirectory& directory() { return *directory_; }
  // Node `node` restarted: a new service on a new port, holding nothing.
  void Restart(uint32_t node) {
    auto fresh = std::make_unique<Peer>(size_t{64} << 20, ReplicaFaults{});
    REQUIRE(fresh->server != nullptr);
    std::unique_ptr<Peer> old;
    {
      std::lock_guard lock(mu_);
      old = std::move(peers_.at(node));
      peers_.at(node) = std::move(fresh);
    }
  }
  FragmentStore& store(uint32_t node) { return peers_.at(node)->store; }
  // Whether this node's view knows `node` at all (a replacement that has just joined may
  // not know its peers yet).
  void SetKnown(uint32_t node, bool known) {
    std::lock_guard lock(mu_);
    if (known) {
      unknown_.erase(node);
    } else {
      unknown_.insert(node);
    }
  }
  void SetAlive(uint32_t node, bool alive) {
    std::lock_guard lock(mu_);
    if (alive) {
      down_.erase(node);
    } else {
      down_.insert(node);
    }
  }
  ErasureCode Code() const {
    auto code = ErasureCode::Make(options_.k, options_.m);
    REQUIRE(code.ok());
    return *std::move(code);
  }

 private:
  std::vector<PeerNode> Members() {
    std::lock_guard lock(mu_);
    std::vector<PeerNode> nodes;
    nodes.push_back({0, "", "", true});  // this node: it holds none of its own fragments
    for (uint32_t n = 1; n < options_.nodes; ++n) {
      if (unknown_.count(n)) continue;
      nodes.push_back({n, peers_[n]->address(), "", down_.count(n) == 0});
    }
    return nodes;
  }

  const GroupOptions options_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by node; [0] is this node: none
  std::mutex mu_;
  std::set<uint32_t> down_;  // guarded by mu_
  std::set<uint32_t> unknown_;  // guarded by mu_
  std::unique_ptr<PeerDirectory> directory_;
};

// A rank's staged shard: the bytes the replicator is handed (kept alive through the aliasing
// shared_ptr, as the daemon hands it a snapshot's data region; in two places, as a snapshot
// with frozen tensors holds it) and a copy to compare with.
struct StagedBytes {
  std::shared_ptr<const ckpt::ScatteredBytes> data;
  std::string copy;
  uint64_t size() const { return copy.size(); }
};

StagedBytes MakeShard(size_t bytes, uint32_t seed) {
  auto text = std::make_shared<std::string>(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) (*text)[i] = static_cast<char>(i * (131 + seed) + (i >> 11) + seed * 7);
  return {ckpt::testing::SplitRegion(*text, bytes / 3), *text};
}

std::string ManifestText(uint64_t step) {
  return R"({"format_version":3,"job":"llm","step":)" + std::to_string(step) +
         R"(,"world_size":2,"ranks":"0,1","note":"node 0's manifest of the step"})";
}

std::optional<StepReplication> StepOf(const Replicator& r, const std::string& job, uint64_t step) {
  for (const StepReplication& s : r.Steps()) {
    if (s.job == job && s.step == step) return s;
  }
  return std::nullopt;
}

State StateOf(const Replicator& r, uint64_t step) {
  std::optional<StepReplication> s = StepOf(r, kJob, step);
  return s ? s->state : State::kSending;
}

// Waits (bounded) until the step is no longer being sent; returns it as it then stands.
StepReplication Settled(const Replicator& r, uint64_t step) {
  const bool settled = WaitUntil([&] { return StateOf(r, step) != State::kSending; }, kWait, 10ms);
  std::optional<StepReplication> s = StepOf(r, kJob, step);
  INFO("step " << step << " settled: " << settled);
  REQUIRE(s.has_value());
  return *s;
}

// Both ranks of `step` staged, then committed (or committed first, then staged).
void Replicate(Replicator& r, uint64_t step, const StagedBytes& rank0, const StagedBytes& rank1,
               bool commit_first = false, uint64_t run = kRun) {
  if (commit_first) r.Committed(kJob, step, {0, 1}, ManifestText(step));
  r.Staged(kJob, step, 0, run, kUid, rank0.data, rank0.size());
  r.Staged(kJob, step, 1, run, kUid, rank1.data, rank1.size());
  if (!commit_first) r.Committed(kJob, step, {0, 1}, ManifestText(step));
}

// The fragment bytes one holder gets of both ranks.
uint64_t PerHolder(const StagedBytes& rank0, const StagedBytes& rank1, int k) {
  return ErasureCode::FragmentBytes(rank0.size(), k) + ErasureCode::FragmentBytes(rank1.size(), k);
}

using Pieces = std::vector<std::pair<uint32_t, uint32_t>>;

// What holder `index` (node index + 1) must show of a replicated step.
void CheckSealedAt(FragmentStore& store, uint32_t index, uint64_t step, uint64_t bytes, int k, int m) {
  std::vector<HeldStep> held = store.Held(kJob, 0u);
  std::string listed;
  for (const HeldStep& h : held) listed += " s" + std::to_string(h.step) + (h.sealed ? "(sealed)" : "(unsealed)");
  INFO("holder of fragment " << index << " holds of node 0:" << listed);
  REQUIRE(held.size() == 1);
  CHECK(held[0].step == step);
  CHECK(held[0].owner == 0);
  CHECK(held[0].sealed);
  CHECK(held[0].fragments == 2);
  CHECK(held[0].bytes == bytes);
  CHECK(held[0].run == kRun);
  CHECK(held[0].uid == kUid);
  CHECK(held[0].k == static_cast<uint32_t>(k));
  CHECK(held[0].m == static_cast<uint32_t>(m));
  CHECK(held[0].pieces == Pieces{{0, index}, {1, index}});
  std::shared_ptr<const std::string> manifest = store.Manifest(kJob, 0, step);
  REQUIRE(manifest != nullptr);
  CHECK(*manifest == ManifestText(step));
}

}  // namespace

TEST_CASE("a committed step's shards reach both holders of a 2+1 code and are sealed with the manifest") {
  Group group({});
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes rank0 = MakeShard(300'000, 1), rank1 = MakeShard(250'001, 2);
  const uint64_t per_holder = PerHolder(rank0, rank1, 2);

  SECTION("staged, then committed") { Replicate(replicator, 5, rank0, rank1); }
  SECTION("committed before its shards were staged") { Replicate(replicator, 5, rank0, rank1, /*commit_first=*/true); }

  const StepReplication s = Settled(replicator, 5);
  INFO("why: " << s.why);
  REQUIRE(s.state == State::kReplicated);
  CHECK(s.why.empty());
  CHECK(s.bytes_sent == 2 * per_holder);
  CHECK(s.seconds > 0);
  CHECK(replicator.Replicated(kJob, 5));
  CHECK_FALSE(replicator.Replicated(kJob, 4));
  CHECK_FALSE(replicator.Replicated("other", 5));
  CHECK(std::string(StateName(s.state)) == "replicated");
  // Node 0's holders in a group of four under 2+1 are the next two nodes: 1 and 2.
  CheckSealedAt(group.store(1), 0, 5, per_holder, 2, 1);
  CheckSealedAt(group.store(2), 1, 5, per_holder, 2, 1);
  CHECK(group.store(3).Held().empty());
  CHECK(group.store(3).used() == 0);
}

TEST_CASE("a newer step replicated replaces the older one in the holders") {
  Group group({});
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes a0 = MakeShard(300'000, 1), a1 = MakeShard(250'001, 2);
  const StagedBytes b0 = MakeShard(310'000, 3), b1 = MakeShard(200'000, 4);
  Replicate(replicator, 5, a0, a1);
  REQUIRE(Settled(replicator, 5).state == State::kReplicated);
  REQUIRE(replicator.Replicated(kJob, 5));

  Replicate(replicator, 6, b0, b1);
  const StepReplication s = Settled(replicator, 6);
  INFO("why: " << s.why);
  REQUIRE(s.state == State::kReplicated);
  CHECK(replicator.Replicated(kJob, 6));
  CHECK_FALSE(replicator.Replicated(kJob, 5));
  const uint64_t per_holder = PerHolder(b0, b1, 2);
  // Every holder sealed step 6 before it counts as replicated; each then drops step 5 when
  // the replicator releases it (the second phase of the seal), which may come just after.
  for (uint32_t node : {1u, 2u}) {
    INFO("node " << node);
    CHECK(WaitUntil([&] { return group.store(node).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
  }
  CheckSealedAt(group.store(1), 0, 6, per_holder, 2, 1);
  CheckSealedAt(group.store(2), 1, 6, per_holder, 2, 1);
  CHECK(group.store(1).Manifest(kJob, 0, 5) == nullptr);
  CHECK(group.store(1).Find({kJob, 5, 0, 0, 0}) == nullptr);
  // What the holders keep is the new step's fragments and manifest, nothing of the old one.
  CHECK(group.store(1).used() == per_holder + ManifestText(6).size());
  CHECK(group.store(2).used() == per_holder + ManifestText(6).size());
}

TEST_CASE("a step that failed after its shards were sent is incomplete and the holders drop it") {
  Group group({});
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes a0 = MakeShard(300'000, 1), a1 = MakeShard(250'001, 2);
  const StagedBytes b0 = MakeShard(280'000, 5), b1 = MakeShard(260'000, 6);
  // Step 5 replicated: a failed step 6 must leave it whole in the holders.
  Replicate(replicator, 5, a0, a1);
  REQUIRE(Settled(replicator, 5).state == State::kReplicated);

  replicator.Staged(kJob, 6, 0, kRun, kUid, b0.data, b0.size());
  replicator.Staged(kJob, 6, 1, kRun, kUid, b1.data, b1.size());
  const uint64_t per_holder = PerHolder(b0, b1, 2);
  // Every fragment acknowledged (the replicator counts a shard's bytes once all its holders
  // answered), none sealed.
  REQUIRE(WaitUntil(
      [&] {
        std::optional<StepReplication> s = StepOf(replicator, kJob, 6);
        return s && s->bytes_sent == 2 * per_holder;
      },
      kWait, 10ms));
  for (uint32_t node : {1u, 2u}) {
    std::vector<HeldStep> held = group.store(node).Held(kJob, 0u);
    REQUIRE(held.size() == 2);
    CHECK(held[1].step == 6);
    CHECK(held[1].fragments == 2);
    CHECK_FALSE(held[1].sealed);
  }
  CHECK(StateOf(replicator, 6) == State::kSending);
  // A step not sealed is no step a restore may use.
  PeerShards shards(group.directory(), 2);
  CHECK(shards.Steps(kJob, 0, kUid) == std::vector<std::pair<uint64_t, uint64_t>>{{kRun, 5}});

  replicator.Failed(kJob, 6);
  const StepReplication s = Settled(replicator, 6);
  CHECK(s.state == State::kIncomplete);
  CHECK_THAT(s.why, Catch::Contains("did not commit"));
  CHECK_FALSE(replicator.Replicated(kJob, 6));
  CHECK(replicator.Replicated(kJob, 5));
  for (uint32_t node : {1u, 2u}) {
    INFO("node " << node);
    const bool dropped = WaitUntil(
        [&] {
          std::vector<HeldStep> held = group.store(node).Held(kJob, 0u);
          return held.size() == 1 && held[0].step == 5;
        },
        kWait, 10ms);
    CHECK(dropped);
    std::vector<HeldStep> held = group.store(node).Held(kJob, 0u);
    REQUIRE(held.size() == 1);
    CHECK(held[0].sealed);
    CHECK(group.store(node).Find({kJob, 6, 0, 0, node - 1}) == nullptr);
    CHECK(group.store(node).used() == PerHolder(a0, a1, 2) + ManifestText(5).size());
  }
  // Committed late (a caller's mistake): still nothing sealed.
  replicator.Committed(kJob, 6, {0, 1}, ManifestText(6));
  CHECK(StateOf(replicator, 6) == State::kIncomplete);
  CHECK(group.store(1).Manifest(kJob, 0, 6) == nullptr);
}

TEST_CASE("a step whose holder is not alive in the group's view ends incomplete naming the holder") {
  Group group({});
  group.SetAlive(2, false);
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes rank0 = MakeShard(300'000, 1), rank1 = MakeShard(250'001, 2);
  Replicate(replicator, 5, rank0, rank1);
  // The replicator waits kViewSettle (5 s) for the view to show node 2 alive first.
  const StepReplication s = Settled(replicator, 5);
  INFO("why: " << s.why);
  CHECK(s.state == State::kIncomplete);
  CHECK_THAT(s.why, Catch::Contains("node 2"));
  CHECK(s.bytes_sent == 0);
  CHECK_FALSE(replicator.Replicated(kJob, 5));
  // Nothing was sent to the live holder either (and nothing is left there).
  CHECK(WaitUntil([&] { return group.store(1).Held().empty(); }, 2s, 10ms));
  CHECK(group.store(1).used() == 0);
  CHECK(group.store(2).Held().empty());

  SECTION("the holder back in the view: the next step is replicated") {
    group.SetAlive(2, true);
    Replicate(replicator, 6, MakeShard(100'000, 3), MakeShard(90'000, 4));
    const StepReplication next = Settled(replicator, 6);
    INFO("why: " << next.why);
    CHECK(next.state == State::kReplicated);
    CHECK(replicator.Replicated(kJob, 6));
    CHECK(StateOf(replicator, 5) == State::kIncomplete);
  }
}

TEST_CASE("PeerShards lists, gives back the manifest of, and rebuilds a replicated step") {
  Group group({});
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes rank0 = MakeShard(300'000, 1), rank1 = MakeShard(250'001, 2);
  Replicate(replicator, 5, rank0, rank1);
  REQUIRE(Settled(replicator, 5).state == State::kReplicated);
  PeerShards shards(group.directory(), 2);

  using Steps = std::vector<std::pair<uint64_t, uint64_t>>;
  CHECK(shards.Steps(kJob, 0, kUid) == Steps{{kRun, 5}});
  CHECK(shards.Steps(kJob, 1, kUid) == Steps{{kRun, 5}});
  CHECK(shards.Steps(kJob, 2, kUid).empty());   // a rank node 0 did not stage
  CHECK(shards.Steps("other", 0, kUid).empty());

  auto manifest = shards.Manifest(kJob, 5, kUid);
  REQUIRE(manifest.ok());
  CHECK(*manifest == ManifestText(5));
  CHECK(absl::IsNotFound(shards.Manifest(kJob, 4, kUid).status()));

  auto shard0 = shards.Shard(kJob, 5, 0, kUid, kMaxShard);
  INFO(shard0.status());
  REQUIRE(shard0.ok());
  CHECK(Bytes(*shard0) == rank0.copy);
  auto shard1 = shards.Shard(kJob, 5, 1, kUid, kMaxShard);
  REQUIRE(shard1.ok());
  CHECK(Bytes(*shard1) == rank1.copy);
  CHECK(absl::IsDataLoss(shards.Shard(kJob, 4, 0, kUid, kMaxShard).status()));
  // Only the user the fragments were sent for is offered them.
  CHECK(shards.Steps(kJob, 0, kUid + 1).empty());
  CHECK(absl::IsNotFound(shards.Manifest(kJob, 5, kUid + 1).status()));
  CHECK(absl::IsDataLoss(shards.Shard(kJob, 5, 0, kUid + 1, kMaxShard).status()));
  // A shard larger than the restore allows it (its file in the manifest) is refused.
  auto too_large = shards.Shard(kJob, 5, 0, kUid, rank0.size() - 1);
  CHECK(absl::IsDataLoss(too_large.status()));
  CHECK_THAT(ckpt::Message(too_large.status()), Catch::Contains("more than the 299999"));
  auto exact = shards.Shard(kJob, 5, 0, kUid, rank0.size());
  REQUIRE(exact.ok());
  CHECK(Bytes(*exact) == rank0.copy);

  SECTION("one holder lost: its manifest is still had, the shard not (2 fragments needed)") {
    group.SetAlive(2, false);
    CHECK(shards.Steps(kJob, 0, kUid).empty());
    auto still = shards.Manifest(kJob, 5, kUid);
    REQUIRE(still.ok());
    CHECK(*still == ManifestText(5));
    auto lost = shards.Shard(kJob, 5, 0, kUid, kMaxShard);
    CHECK(absl::IsDataLoss(lost.status()));
    CHECK_THAT(ckpt::Message(lost.status()), Catch::Contains("1 of the 2 fragments"));
  }
  SECTION("every holder lost") {
    group.SetAlive(1, false);
    group.SetAlive(2, false);
    CHECK(shards.Steps(kJob, 0, kUid).empty());
    CHECK(absl::IsNotFound(shards.Manifest(kJob, 5, kUid).status()));
    auto lost = shards.Shard(kJob, 5, 1, kUid, kMaxShard);
    CHECK(absl::IsDataLoss(lost.status()));
    CHECK_THAT(ckpt::Message(lost.status()), Catch::Contains("0 of the 2 fragments"));
  }
}

TEST_CASE("PeerShards waits, within its bound, for a holder its view does not know yet rather than taking silence "
          "for none") {
  Group group({});
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes rank0 = MakeShard(300'000, 1), rank1 = MakeShard(250'001, 2);
  Replicate(replicator, 5, rank0, rank1);
  REQUIRE(Settled(replicator, 5).state == State::kReplicated);
  using Steps = std::vector<std::pair<uint64_t, uint64_t>>;

  // This node has just joined: its view does not name node 2 yet, and learns it 1 s later.
  group.SetKnown(2, false);
  PeerShards waiting(group.directory(), 2, 30s);
  std::thread heard([&] {
    std::this_thread::sleep_for(1s);
    group.SetKnown(2, true);
  });
  const auto started = std::chrono::steady_clock::now();
  CHECK(waiting.Steps(kJob, 0, kUid) == Steps{{kRun, 5}});
  heard.join();
  CHECK(std::chrono::steady_clock::now() - started >= 1s);

  // Never known within the bound: the survey ends at its bound with what it has.
  group.SetKnown(2, false);
  PeerShards bounded(group.directory(), 2, 1s);
  const auto again = std::chrono::steady_clock::now();
  CHECK(bounded.Steps(kJob, 0, kUid).empty());
  CHECK(std::chrono::steady_clock::now() - again < 20s);
  // A holder the view knows to be lost is not waited for.
  group.SetKnown(2, true);
  group.SetAlive(2, false);
  PeerShards lost(group.directory(), 2, 60s);
  const auto at_once = std::chrono::steady_clock::now();
  CHECK(lost.Steps(kJob, 0, kUid).empty());
  CHECK(std::chrono::steady_clock::now() - at_once < 30s);
}

TEST_CASE("PeerShards rebuilds a shard exactly past a holder that serves damaged fragments (2+2 over 5 nodes)") {
  GroupOptions o;
  o.nodes = 5;
  o.k = 2;
  o.m = 2;
  o.faults[1].corrupt_served = true;  // the holder of fragment 0, asked first
  Group group(o);
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes rank0 = MakeShard(300'000, 1), rank1 = MakeShard(250'001, 2);
  Replicate(replicator, 9, rank0, rank1);
  const StepReplication s = Settled(replicator, 9);
  INFO("why: " << s.why);
  REQUIRE(s.state == State::kReplicated);
  // Three holders (nodes 1, 2, 3) of fragments 0, 1, 2; node 4 holds none of node 0's.
  const uint64_t per_holder = PerHolder(rank0, rank1, 2);
  CHECK(s.bytes_sent == 3 * per_holder);
  for (uint32_t node : {1u, 2u, 3u}) CheckSealedAt(group.store(node), node - 1, 9, per_holder, 2, 2);
  CHECK(group.store(4).Held().empty());

  PeerShards shards(group.directory(), 2);
  CHECK(shards.Steps(kJob, 0, kUid) == std::vector<std::pair<uint64_t, uint64_t>>{{kRun, 9}});
  auto shard0 = shards.Shard(kJob, 9, 0, kUid, kMaxShard);
  INFO(shard0.status());
  REQUIRE(shard0.ok());
  CHECK(Bytes(*shard0) == rank0.copy);
  auto shard1 = shards.Shard(kJob, 9, 1, kUid, kMaxShard);
  REQUIRE(shard1.ok());
  CHECK(Bytes(*shard1) == rank1.copy);

  SECTION("with one good holder alive beside the damaging one: too few") {
    group.SetAlive(3, false);
    auto lost = shards.Shard(kJob, 9, 0, kUid, kMaxShard);
    CHECK(absl::IsDataLoss(lost.status()));
    CHECK_THAT(ckpt::Message(lost.status()), Catch::Contains("1 of the 2 fragments") && Catch::Contains("node 1"));
  }
  SECTION("with only the damaging holder alive") {
    group.SetAlive(2, false);
    group.SetAlive(3, false);
    auto lost = shards.Shard(kJob, 9, 1, kUid, kMaxShard);
    CHECK(absl::IsDataLoss(lost.status()));
    CHECK_THAT(ckpt::Message(lost.status()), Catch::Contains("0 of the 2 fragments"));
  }
  SECTION("the damaging holder lost: the other two suffice") {
    group.SetAlive(1, false);
    auto again = shards.Shard(kJob, 9, 0, kUid, kMaxShard);
    REQUIRE(again.ok());
    CHECK(Bytes(*again) == rank0.copy);
  }
}

// The header's promise (replicator.h): only a replicated step replaces the step before in
// the peers' memory, so that while Replicated(job, step) holds the peers can rebuild it.
// Here one holder cannot take step 6's manifest (its --replica-bytes is full), the other
// seals step 6 and drops step 5 for it: step 6 is reported incomplete, and step 5 must then
// either be rebuildable or no longer be claimed replicated.
TEST_CASE("a step that only some holders sealed leaves no step claimed replicated that cannot be rebuilt") {
  const StagedBytes a0 = MakeShard(300'000, 1), a1 = MakeShard(250'001, 2);
  const StagedBytes b0 = MakeShard(300'000, 3), b1 = MakeShard(250'001, 4);
  const uint64_t per_holder = PerHolder(a0, a1, 2);
  REQUIRE(per_holder == PerHolder(b0, b1, 2));
  const std::string big_manifest = ManifestText(6) + std::string(8192, ' ');
  GroupOptions o;
  // Node 2 fits two steps' fragments and step 5's manifest, not step 6's manifest too.
  o.budgets[2] = 2 * per_holder + ManifestText(5).size() + 1024;
  Group group(o);
  Replicator replicator(group.directory(), group.Code());
  Replicate(replicator, 5, a0, a1);
  REQUIRE(Settled(replicator, 5).state == State::kReplicated);
  REQUIRE(replicator.Replicated(kJob, 5));

  replicator.Staged(kJob, 6, 0, kRun, kUid, b0.data, b0.size());
  replicator.Staged(kJob, 6, 1, kRun, kUid, b1.data, b1.size());
  replicator.Committed(kJob, 6, {0, 1}, big_manifest);
  const StepReplication s = Settled(replicator, 6);
  INFO("step 6: " << StateName(s.state) << ": " << s.why);
  REQUIRE(s.state == State::kIncomplete);
  CHECK_THAT(s.why, Catch::Contains("sealing with node 2") && Catch::Contains("--replica-bytes"));
  CHECK_FALSE(replicator.Replicated(kJob, 6));

  PeerShards shards(group.directory(), 2);
  const bool claimed = replicator.Replicated(kJob, 5);
  auto rebuilt = shards.Shard(kJob, 5, 0, kUid, kMaxShard);
  INFO("Replicated(step 5): " << claimed << "; step 5 from the peers: " << rebuilt.status()
                              << "; node 1 holds step 5: " << (group.store(1).Manifest(kJob, 0, 5) != nullptr)
                              << "; peers can rebuild steps: " << shards.Steps(kJob, 0, kUid).size());
  CHECK((!claimed || rebuilt.ok()));
  // As it stands (a two-phase seal): no holder released step 5, so it is still replicated,
  // rebuilt exactly, and the newest step the peers offer.
  CHECK(claimed);
  REQUIRE(rebuilt.ok());
  CHECK(Bytes(*rebuilt) == a0.copy);
  CHECK(shards.Steps(kJob, 0, kUid) == std::vector<std::pair<uint64_t, uint64_t>>{{kRun, 5}});
  CHECK(group.store(1).Manifest(kJob, 0, 5) != nullptr);
  CHECK(group.store(2).Manifest(kJob, 0, 5) != nullptr);
  // Node 2 drops what it got of step 6 (given up with a count of 0).
  CHECK(WaitUntil([&] { return group.store(2).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
}

// A job that goes back to an older step and trains on saves its new steps under a later
// run (format::Manifest::run): (run, step) orders them, and the restore (PeerShards::Steps)
// takes step 8 of the later run as the newest. The replicator must then report the step it
// replicated last as replicated.
TEST_CASE("a step replicated under a later run after the job went back is reported replicated") {
  Group group({});
  Replicator replicator(group.directory(), group.Code());
  const StagedBytes a0 = MakeShard(120'000, 1), a1 = MakeShard(110'000, 2);
  const StagedBytes b0 = MakeShard(130'000, 3), b1 = MakeShard(100'000, 4);
  Replicate(replicator, 10, a0, a1, false, /*run=*/100);
  REQUIRE(Settled(replicator, 10).state == State::kReplicated);
  Replicate(replicator, 8, b0, b1, false, /*run=*/200);
  const StepReplication s = Settled(replicator, 8);
  INFO("why: " << s.why);
  REQUIRE(s.state == State::kReplicated);

  PeerShards shards(group.directory(), 2);
  const auto steps = shards.Steps(kJob, 0, kUid);
  REQUIRE_FALSE(steps.empty());
  CHECK(steps.back() == std::pair<uint64_t, uint64_t>{200, 8});  // the restore's newest
  auto shard = shards.Shard(kJob, 8, 0, kUid, kMaxShard);
  REQUIRE(shard.ok());
  CHECK(Bytes(*shard) == b0.copy);
  CHECK(replicator.Replicated(kJob, 8));
}

// Incremental replicas: a step whose shards are the same size, run and holders as the step
// its holders hold is sent as a patch of it, only the column chunks that changed.
namespace {

// A rank's shard with a byte flipped at each of `at`.
StagedBytes Changed(const StagedBytes& from, std::initializer_list<size_t> at) {
  auto text = std::make_shared<std::string>(from.copy);
  for (size_t i : at) (*text)[i] ^= 0x5a;
  return {ckpt::testing::SplitRegion(*text, text->size() / 3), *text};
}

// What a holder must hold of rank `rank`'s fragment `index` of `step`: the fragment a whole
// coding of `data` makes, bit for bit.
void CheckFragment(FragmentStore& store, const ErasureCode& code, uint64_t step, uint32_t rank, uint32_t index,
                   const StagedBytes& data) {
  auto full = CodeShard(code, kJob, step, 0, rank, kRun,
                        {reinterpret_cast<const uint8_t*>(data.copy.data()), data.copy.size()});
  REQUIRE(full.ok());
  std::shared_ptr<const HeldFragment> held = store.Find({kJob, step, 0, rank, index});
  INFO("rank " << rank << " fragment " << index << " of step " << step);
  REQUIRE(held != nullptr);
  CHECK(held->bytes == (*full)[index].bytes);
}

// 2 MiB fragments under k = 2: 8 chunks of 256 KiB, one gRPC message each (kFragmentChunkBytes
// is 2 MiB); step 9's shard, 64 bytes longer, makes fragments of two messages.
constexpr size_t kShardBytes = 4 << 20;

}  // namespace

// `step` settled replicated (why not, named otherwise); as it stands.
StepReplication ReplicatedStep(const Replicator& r, uint64_t step) {
  const StepReplication s = Settled(r, step);
  INFO("step " << step << ": " << s.why);
  REQUIRE(s.state == State::kReplicated);
  return s;
}

// The fragment bytes every holder gets of both ranks, sent whole.
uint64_t WholeBytes(const StagedBytes& rank0, const StagedBytes& rank1) { return 3 * PerHolder(rank0, rank1, 2); }

// One sequence of steps rather than sections: each section would send the first two steps
// again, and each case below starts from where the one before left the
// holders, which is what a trainer's run does too.
TEST_CASE("a second step with a few changed bytes is sent as a patch: a small fraction, rebuilt bit for bit") {
  GroupOptions o;
  o.nodes = 5;
  o.k = 2;
  o.m = 2;  // nodes 1, 2, 3 hold fragments 0, 1 (data) and 2 (parity)
  Group group(o);
  Replicator replicator(group.directory(), group.Code());
  const ErasureCode code = group.Code();
  const StagedBytes a0 = MakeShard(kShardBytes, 1), a1 = MakeShard(kShardBytes - 1001, 2);
  Replicate(replicator, 5, a0, a1);
  const StepReplication first = ReplicatedStep(replicator, 5);
  const uint64_t each = ErasureCode::FragmentBytes(kShardBytes, 2);
  CHECK(first.bytes_sent == WholeBytes(a0, a1));
  CHECK(first.bytes_unchanged == 0);

  // Rank 0: a byte in its first column chunk and one in data fragment 1's chunk 4; rank 1:
  // nothing changed at all.
  const StagedBytes b0 = Changed(a0, {100, each + 4 * kPatchChunkBytes + 7});
  Replicate(replicator, 6, b0, a1);
  const StepReplication second = ReplicatedStep(replicator, 6);
  // Two chunks of each of rank 0's three fragments: 1.5 MiB of the 12 MiB the step's
  // fragments are.
  CHECK(second.bytes_sent == 3 * 2 * kPatchChunkBytes);
  CHECK(second.bytes_sent + second.bytes_unchanged == first.bytes_sent);
  for (uint32_t node : {1u, 2u, 3u}) {
    INFO("node " << node);
    CHECK(WaitUntil([&] { return group.store(node).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
    CheckFragment(group.store(node), code, 6, 0, node - 1, b0);
    CheckFragment(group.store(node), code, 6, 1, node - 1, a1);
    CHECK(group.store(node).used() == each + ErasureCode::FragmentBytes(kShardBytes - 1001, 2) + ManifestText(6).size());
  }
  // Rebuilt from the patched fragments, a parity one among them (fragment 0's holder lost).
  group.SetAlive(1, false);
  PeerShards shards(group.directory(), 2);
  auto rebuilt = shards.Shard(kJob, 6, 0, kUid, kShardBytes);
  INFO(rebuilt.status());
  REQUIRE(rebuilt.ok());
  CHECK(Bytes(*rebuilt) == b0.copy);
  group.SetAlive(1, true);

  // A step that did not commit is never the base: the next is a patch of the last sealed one.
  const StagedBytes c0 = MakeShard(kShardBytes, 9);  // all changed
  replicator.Staged(kJob, 7, 0, kRun, kUid, c0.data, c0.size());
  replicator.Staged(kJob, 7, 1, kRun, kUid, a1.data, a1.size());
  replicator.Failed(kJob, 7);
  REQUIRE(Settled(replicator, 7).state == State::kIncomplete);
  const StagedBytes d0 = Changed(b0, {200});
  Replicate(replicator, 8, d0, a1);
  const StepReplication patched = ReplicatedStep(replicator, 8);
  CHECK(patched.bytes_sent == 3 * kPatchChunkBytes);
  CHECK(WaitUntil([&] { return group.store(3).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
  CheckFragment(group.store(3), code, 8, 0, 2, d0);

  // A shard of another size goes whole, the other rank's still as a patch.
  const StagedBytes e0 = MakeShard(kShardBytes + 64, 1), e1 = Changed(a1, {5});
  Replicate(replicator, 9, e0, e1);
  const StepReplication resized = ReplicatedStep(replicator, 9);
  CHECK(resized.bytes_sent == 3 * (ErasureCode::FragmentBytes(kShardBytes + 64, 2) + kPatchChunkBytes));
  CHECK(WaitUntil([&] { return group.store(2).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
  CheckFragment(group.store(2), code, 9, 0, 1, e0);

  // A holder that lost the base refuses the patch and gets its fragments whole; the others
  // patch.
  group.store(3).DropJob(kJob);
  const StagedBytes f0 = Changed(e0, {1});
  Replicate(replicator, 10, f0, e1);
  const StepReplication dropped = ReplicatedStep(replicator, 10);
  // Nodes 1 and 2: one chunk of rank 0, nothing of rank 1; node 3: both fragments whole.
  CHECK(dropped.bytes_sent == 2 * kPatchChunkBytes + PerHolder(f0, e1, 2));
  for (uint32_t node : {1u, 2u, 3u}) {
    INFO("node " << node);
    CHECK(WaitUntil([&] { return group.store(node).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
    CheckFragment(group.store(node), code, 10, 0, node - 1, f0);
    CheckFragment(group.store(node), code, 10, 1, node - 1, e1);
  }
  // And the step after is a patch everywhere again.
  const StagedBytes g0 = Changed(f0, {2});
  Replicate(replicator, 11, g0, e1);
  const StepReplication again = ReplicatedStep(replicator, 11);
  CHECK(again.bytes_sent == 3 * kPatchChunkBytes);

  // A holder restarted (the holder set changed): every fragment goes whole.
  group.Restart(2);
  const StagedBytes h0 = Changed(g0, {1});
  Replicate(replicator, 12, h0, e1);
  const StepReplication restarted = ReplicatedStep(replicator, 12);
  CHECK(restarted.bytes_sent == WholeBytes(h0, e1));
  CHECK(WaitUntil([&] { return group.store(2).Held(kJob, 0u).size() == 1; }, kWait, 10ms));
  CheckFragment(group.store(2), code, 12, 1, 1, e1);

  // A step of another run goes whole, even where nothing changed.
  Replicate(replicator, 13, h0, e1, false, kRun + 1);
  const StepReplication rerun = ReplicatedStep(replicator, 13);
  CHECK(rerun.bytes_sent == WholeBytes(h0, e1));
  CHECK(rerun.bytes_unchanged == 0);
}
