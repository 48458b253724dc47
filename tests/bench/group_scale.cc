// group_bench scale: the daemons' group at thousands of nodes, simulated with the real
// coordinator and the real wire messages (issue 23).
//
//   bazel build -c opt //tests/bench:group_bench
//   bazel-bin/tests/bench/group_bench scale [--nodes 64,1000] [--ranks-per-node 8]
//       [--tensors 2,200] [--steps 3] [--fanout 32] [--channels 16] [--threads 32]
//       [--dir /tmp] [--json]
//
// The coordinator is a real group server (node 0's role, `StartGroupServer`) with a file
// decision log under --dir, in a child process (this binary again), so that its CPU time
// (every thread's, from /proc/PID/task/*/schedstat) and its peak memory (VmHWM) are its own.
// This process plays the N nodes: each joins under its own node rank and incarnation over
// one of --channels gRPC channels (to the coordinator a node is who its requests say it
// is, not a connection), and then, every step, each node
//   1. heartbeats once, saying which membership version it knows;
//   2. sends the one prepare a node sends: its ranks' manifest part, T tensors per rank,
//      each rank's row of a [world x 16] F32 tensor with its checksum;
//   3. long-polls the outcome, unless its prepare's reply already said "committed" (node 0
//      hears the whole step's manifest, every other node the step's header and its share).
// Per step it reports the coordinator's CPU time, the time from the first prepare sent to
// the last node knowing "committed", and the bytes each node sends and receives (the
// serialized messages; HTTP/2 framing adds a few percent).
//
// With a relay tree (--fanout F > 0, as ckptd's --group-relay-fanout, and more than F + 1
// nodes) the first level's relays, nodes 1..F, are real: a group server and a group client
// each, in this process, relaying for the nodes below them. Deeper levels are simulated by
// what their relays would send up at best: each second-level node sends its own heartbeat
// and prepare (batches of one) and one batch of all its subtree's heartbeats and one of
// its prepares to its first-level relay, and one outcome poll asking for its subtree's
// shares. A node below the second level is
// counted as sending its prepare and receiving its outcome with its own share only, as its
// relay answers it; a relay's own traffic (its subtree's, up and down) is reported apart.
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "common/log.h"
#include "common/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/group/commit_coordinator.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/group_client.h"
#include "daemon/group/group_server.h"
#include "daemon/group/part_values_proto.h"
#include "format/checkpoint_store.h"
#include "format/manifest.h"
#include "format/part_structure.h"
#include "proto/group.grpc.pb.h"
#include "storage/filesystem.h"
#include "tests/bench/group_scale.h"

extern char** environ;

namespace ckpt::bench {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace pb = ckptd::group::v1;

constexpr char kToken[] = "group-scale-bench-token-0123456789";

[[noreturn]] void Die(const std::string& why) {
  std::cerr << "group_bench scale: " << why << "\n";
  std::exit(1);
}

std::vector<uint32_t> ParseCounts(const std::string& text, const char* what) {
  std::vector<uint32_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    long v = std::stol(item);
    if (v < 1) Die(fmt::format("{}: every count must be at least 1", what));
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

group::GroupOptions CoordinatorOptions(uint32_t nodes, uint32_t fanout) {
  group::GroupOptions o;
  o.node_rank = 0;
  o.num_nodes = nodes;
  o.listen_addr = "127.0.0.1:0";
  o.token = kToken;
  // Every node heartbeats once a step; a step of the largest configuration takes minutes
  // on two cores, and no member may be marked lost mid-measurement.
  o.group_timeout = 3600s;
  o.step_timeout = 3600s;
  o.rpc_timeout = 600s;
  o.relay_fanout = fanout;
  return o;
}

// --- the coordinator, in its own process -------------------------------------------------

// The coordinator knows the tree's fan-out as every node does: it checks that a relay asks
// for the shares of its own subtree only.
// With `shared_root`, it publishes each step on a shared root under `dir`/root, as ckptd's
// --shared-root coordinator does: the whole manifest, or an index and a part per node (a step
// too large for one manifest), before announcing it. The previous step is deleted then, so
// that the disk holds one step.
group::CommitCoordinator::Publisher SharedRootPublisher(format::CheckpointStore& store) {
  group::CommitCoordinator::Publisher publish;
  publish.commit = [&store](const format::Manifest& m) {
    CKPT_RETURN_IF_ERROR(store.BeginStep(m.job, m.step));  // the nodes' shards would have made it
    CKPT_RETURN_IF_ERROR(store.Commit(m));
    if (m.step > 0) (void)store.Delete(m.job, m.step - 1);
    return absl::OkStatus();
  };
  publish.write_part = [&store](const format::Manifest& part, format::Manifest& index) {
    CKPT_RETURN_IF_ERROR(store.BeginStep(part.job, part.step));
    return store.WriteManifestPart(part, index);
  };
  publish.discard = [&store](const std::string& job, uint64_t step) { (void)store.AbortStep(job, step); };
  return publish;
}

int ServeCoordinator(uint32_t nodes, uint32_t fanout, const std::string& dir, const std::string& address_file,
                     bool shared_root) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  // A benchmark that dies (a failed call exits at once) takes its coordinator with it.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as ckptd's main does
  group::DecisionLogPtr log = group::MakeFileDecisionLog(MakePosixFilesystem(), dir + "/decisions");
  format::CheckpointStore store(MakePosixFilesystem(), dir + "/root");
  store.set_shared(true);
  auto server = group::StartGroupServer(CoordinatorOptions(nodes, fanout), 1, log.get(),
                                        shared_root ? SharedRootPublisher(store) : group::CommitCoordinator::Publisher{});
  if (!server.ok()) Die(Message(server.status()));
  {
    std::ofstream(address_file + ".tmp") << (*server)->address();
  }
  std::filesystem::rename(address_file + ".tmp", address_file);
  int sig = 0;
  sigwait(&stop, &sig);
  (*server)->Shutdown();
  return 0;
}

class Coordinator {
 public:
  Coordinator(const std::string& self, uint32_t nodes, uint32_t fanout, const std::string& dir, bool shared_root) {
    const std::string address_file = dir + "/coordinator.address";
    std::filesystem::remove(address_file);
    std::vector<std::string> args = {self,    "scale",  "--serve", "--num-nodes", std::to_string(nodes),
                                     "--fanout", std::to_string(fanout), "--dir", dir, "--address-file", address_file};
    if (shared_root) args.push_back("--shared-root");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) Die("spawn");
    for (int i = 0; i < 3000 && !std::filesystem::exists(address_file); ++i) std::this_thread::sleep_for(10ms);
    std::ifstream in(address_file);
    if (!std::getline(in, address_)) Die("the coordinator did not start");
  }
  ~Coordinator() {
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

  // CPU time of every thread of the coordinator so far, in ns, but the assembler's (node
  // 0's whole manifest, built after the decision: AssemblerCpuNs).
  uint64_t CpuNs() const {
    uint64_t total = 0, assembler = 0;
    ThreadsCpuNs(&total, &assembler);
    // Threads that ended are not listed; their time is in the process's own counters.
    return std::max(total, TicksNs()) - assembler;
  }
  uint64_t AssemblerCpuNs() const {
    uint64_t total = 0, assembler = 0;
    ThreadsCpuNs(&total, &assembler);
    return assembler;
  }
  // Peak resident memory, in bytes.
  uint64_t PeakRss() const {
    std::ifstream in(fmt::format("/proc/{}/status", pid_));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0;
  }

 private:
  uint64_t TicksNs() const {
    std::ifstream in(fmt::format("/proc/{}/stat", pid_));
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::istringstream fields(text.substr(text.rfind(')') + 2));
    std::vector<std::string> f((std::istream_iterator<std::string>(fields)), std::istream_iterator<std::string>());
    if (f.size() < 13) return 0;
    const uint64_t ticks = std::stoull(f[11]) + std::stoull(f[12]);  // utime, stime
    return ticks * 1'000'000'000 / static_cast<uint64_t>(::sysconf(_SC_CLK_TCK));
  }

  void ThreadsCpuNs(uint64_t* total, uint64_t* assembler) const {
    for (const auto& task : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid_))) {
      std::ifstream in(task.path() / "schedstat");
      uint64_t on_cpu = 0;
      if (!(in >> on_cpu)) continue;
      *total += on_cpu;
      std::string name;
      if (std::getline(std::ifstream(task.path() / "comm"), name) && name == group::kAssemblerThreadName) {
        *assembler += on_cpu;
      }
    }
  }

  pid_t pid_ = 0;
  std::string address_;
};

// --- the simulated nodes ----------------------------------------------------------------

struct Config {
  uint32_t nodes, ranks_per_node, tensors, steps, fanout, channels, threads;
  bool json = false;
  bool gather_per_rank = false;  // also measure the restore gather with a call per rank
  bool shared_root = false;      // the coordinator publishes each step (--shared-root)
  // Whether the tree has relays at all, and node n's level (1: a child of node 0).
  bool tree() const { return fanout > 0 && nodes > fanout + 1; }
  uint32_t Level(uint32_t n) const {
    uint32_t level = 0;
    for (; n > 0; n = (n - 1) / fanout) ++level;
    return level;
  }
};

// The tree's first level, nodes 1..F, each a real group server relaying through its own
// group client (as ckptd runs them), joined as members.
class FirstLevelRelays {
 public:
  FirstLevelRelays(const Config& c, const std::string& coordinator) {
    if (!c.tree()) return;
    for (uint32_t n = 1; n <= c.fanout; ++n) {
      group::GroupOptions o = CoordinatorOptions(c.nodes, c.fanout);
      o.node_rank = n;
      o.coordinator = coordinator;
      auto server = group::StartGroupServer(o, 1000 + n, nullptr);
      if (!server.ok()) Die(Message(server.status()));
      auto client = group::MakeGrpcGroupClient(o, 1000 + n, (*server)->address());
      if (!client.ok()) Die(Message(client.status()));
      (*server)->StartRelay(*(*client)->relay_upstream());
      if (auto joined = (*client)->Join(Clock::now() + 60s); !joined.ok()) Die(Message(joined.status()));
      addresses_.push_back((*server)->address());
      clients_.push_back(std::move(*client));
      servers_.push_back(std::move(*server));
    }
  }
  ~FirstLevelRelays() {
    for (auto& s : servers_) s->Shutdown();  // before the clients they relay through
  }
  // Relay n's address (n in 1..F).
  const std::string& address(uint32_t n) const { return addresses_.at(n - 1); }
  // The merged gather calls the relays sent up, in all.
  uint64_t GatherMerges() const {
    uint64_t merges = 0;
    for (const auto& s : servers_) merges += s->relayed().gather_merges;
    return merges;
  }

 private:
  std::vector<std::string> addresses_;
  std::vector<group::GroupClientPtr> clients_;
  std::vector<group::GroupServerPtr> servers_;
};

// What one node sent and received in one step.
struct NodeBytes {
  uint64_t sent = 0, received = 0;
  uint64_t relay_sent = 0, relay_received = 0;  // for the nodes below it
};

// The part a node prepares: its ranks' shards, each holding a 16-element row of every tensor.
format::Manifest NodePart(const Config& c, uint32_t node, uint64_t step) {
  const uint32_t world = c.nodes * c.ranks_per_node;
  format::Manifest m;
  m.job = "scale";
  m.step = step;
  m.world_size = world;
  m.ckptd_version = "group_bench";
  m.wall_time = "2026-01-01T00:00:00Z";
  for (uint32_t r = node * c.ranks_per_node; r < (node + 1) * c.ranks_per_node; ++r) {
    format::ManifestShard shard;
    shard.rank = r;
    shard.file = format::ShardFileName(r);
    shard.bytes = 4096 + uint64_t{64} * c.tensors;
    for (uint32_t t = 0; t < c.tensors; ++t) {
      format::ManifestTensor& tensor = m.tensors[fmt::format("model.layers.{}.weight", t)];
      tensor.dtype = "F32";
      tensor.global_shape = {int64_t{16} * world};
      tensor.shards.push_back({r, shard.file, uint64_t{64} * t, uint64_t{64} * (t + 1), {int64_t{16} * r}, {16},
                               fmt::format("xxh3:{:016x}", (step << 40) ^ (uint64_t{r} << 12) ^ t), {}, {}});
    }
    m.shards.push_back(std::move(shard));
  }
  return m;
}

// Runs fn(node) for every node on `threads` threads.
template <typename Fn>
void ForEachNode(uint32_t nodes, uint32_t threads, Fn fn) {
  std::vector<std::thread> pool;
  std::atomic<uint32_t> next{0};
  for (uint32_t t = 0; t < std::min(threads, nodes); ++t) {
    pool.emplace_back([&] {
      for (uint32_t n = next++; n < nodes; n = next++) fn(n);
    });
  }
  for (auto& t : pool) t.join();
}

struct StepFigures {
  double heartbeat_cpu_ms = 0; // the coordinator's, for one heartbeat of every node
  double prepare_cpu_ms = 0;   // the coordinator's, for the prepares and the decision
  double outcome_cpu_ms = 0;   // the coordinator's, for the outcome replies
  double commit_ms = 0;        // first prepare sent to every node but node 0 knowing
  double assemble_cpu_ms = 0;  // the coordinator's, for node 0's whole manifest
  double node0_ms = 0;         // first prepare sent to node 0 holding the whole manifest
  uint64_t manifest_bytes = 0;
  // Nodes other than node 0, which alone receives the whole manifest.
  uint64_t node_sent_p50 = 0, node_sent_max = 0, node_received_p50 = 0, node_received_max = 0;
  uint64_t node0_received = 0;
  uint64_t relay_sent_max = 0, relay_received_max = 0;  // a relay's, for its subtree
};

// A restore's gather of every rank: the coordinator's CPU, first call to the last answer,
// and the calls node 0 received for it.
struct GatherFigures {
  double cpu_ms = 0;
  double ms = 0;
  uint64_t calls_to_node0 = 0;
};

struct ScaleResult {
  Config config;
  GatherFigures gather, gather_per_rank;
  uint64_t join_received_per_node = 0;
  double join_cpu_ms = 0;              // the coordinator's, for every node's join
  double first_heartbeats_cpu_ms = 0;  // and for the first heartbeats, which bring the members
  double settle_cpu_ms = 0;  // after the first step, until idle (memory returned)
  std::vector<StepFigures> steps;
  uint64_t coordinator_peak_rss = 0;
  double seconds = 0;
};

class Simulation {
 public:
  Simulation(const Config& c, const std::string& address, const FirstLevelRelays& relays) : c_(c), address_(address) {
    for (uint32_t i = 0; i < c.channels; ++i) {
      stubs_.push_back(pb::Group::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), Args(i))));
    }
    known_version_.assign(c.nodes, 0);
    structure_known_.assign(c.nodes, 0);
    if (c.tree()) {
      for (uint32_t n = 1; n <= c.fanout; ++n) {
        relay_stubs_.push_back(
            pb::Group::NewStub(grpc::CreateCustomChannel(relays.address(n), grpc::InsecureChannelCredentials(), Args(n))));
      }
    }
  }

  // Every node joins; returns the bytes a join reply brings a node (its relay with the tree,
  // the whole membership without).
  uint64_t Join() {
    std::atomic<uint64_t> received{0};
    ForEachNode(c_.nodes, c_.threads, [&](uint32_t n) {
      if (c_.tree() && n >= 1 && n <= c_.fanout) return;  // the real relays joined themselves
      pb::JoinRequest request;
      request.set_node_rank(n);
      request.set_num_nodes(c_.nodes);
      request.set_address(fmt::format("10.{}.{}.{}:7000", n >> 16, (n >> 8) & 255, n & 255));
      request.set_incarnation(1000 + n);
      pb::JoinReply reply;
      // A channel's first connection failed now and then at start (about one run in ten,
      // "failed to connect to all addresses ... No such file or directory", never after):
      // a join waits for its channel to be ready, as ckptd's client retries its join.
      Call(n, [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.Join(ctx, request, &reply); },
           /*wait_for_ready=*/true);
      known_version_[n] = reply.view().members_version();
      received += reply.ByteSizeLong();
    });
    return received / c_.nodes;
  }

  StepFigures Step(uint64_t step, const Coordinator& coordinator) {
    std::vector<NodeBytes> bytes(c_.nodes);
    const uint64_t cpu_heartbeats = coordinator.CpuNs();
    // 1. Heartbeats: straight to node 0, or (below the first level) through the tree as
    // prepares go.
    auto heartbeat = [&](uint32_t n) {
      pb::HeartbeatRequest request = HeartbeatOf(n);
      pb::HeartbeatReply reply;
      Call(n, [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.Heartbeat(ctx, request, &reply); });
      known_version_[n] = reply.view().members_version();
      bytes[n].sent += request.ByteSizeLong();
      bytes[n].received += reply.ByteSizeLong();
    };
    if (!c_.tree()) {
      ForEachNode(c_.nodes, c_.threads, heartbeat);
    } else {
      ForEachNode(c_.fanout + 1, c_.threads, heartbeat);
      const std::vector<uint32_t> second = Level2();
      ForEachNode(static_cast<uint32_t>(second.size() * 2), c_.threads, [&](uint32_t i) {
        const uint32_t q = second[i / 2];
        if (i % 2 == 0) {
          HeartbeatThroughRelay(q, {q}, bytes, 0);
        } else if (!Below(q).empty()) {
          HeartbeatThroughRelay(q, Below(q), bytes, q);
        }
      });
    }
    // The parts, built before the clock starts: a node has its part ready when it prepares.
    // As ckptd's client does, a node sends its whole part until the coordinator holds its
    // structure, and then only each step's values under the structure's digest.
    std::vector<pb::PrepareRequest> prepares(c_.nodes), whole_parts(c_.nodes);
    ForEachNode(c_.nodes, c_.threads, [&](uint32_t n) {
      format::Manifest part = NodePart(c_, n, step);
      format::SplitResult split = format::SplitPart(part);
      pb::PrepareRequest& request = prepares[n];
      request.set_node_rank(n);
      request.set_incarnation(1000 + n);
      request.set_job(part.job);
      request.set_step(step);
      request.set_world_size(part.world_size);
      for (const auto& s : part.shards) request.add_ranks(s.rank);
      request.set_attempt(1);
      whole_parts[n] = request;
      whole_parts[n].set_manifest_part_json(format::ManifestToJson(part));
      request.set_structure_digest(split.structure->digest);
      // As ckptd's client does, once the coordinator said it keeps none of the job's checksums.
      group::ToProto(checksums_unused_ ? split.values.WithChecksumsWithheld() : split.values,
                     request.mutable_values());
    });

    const uint64_t cpu_before = coordinator.CpuNs();
    const uint64_t assembler_before = coordinator.AssemblerCpuNs();
    const auto start = Clock::now();
    // 2. Prepares: node 0's first, so that another node's completes the step (node 0 hears
    // the commit once its whole manifest is assembled: timed on its own below).
    std::vector<char> decided(c_.nodes, 0);
    auto prepare = [&](uint32_t n) {
      pb::PrepareReply reply;
      for (bool compact = structure_known_[n] != 0;; compact = false) {
        const pb::PrepareRequest& request = compact ? prepares[n] : whole_parts[n];
        reply.Clear();
        Call(n, [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.Prepare(ctx, request, &reply); });
        bytes[n].sent += request.ByteSizeLong();
        bytes[n].received += reply.ByteSizeLong();
        if (!reply.need_structure()) break;
        if (!compact) Die("the coordinator asked for a structure it was sent");
      }
      structure_known_[n] = 1;
      if (reply.outcome() == pb::OUTCOME_COMMITTED) checksums_unused_ = reply.committed().checksums_unused();
      if (reply.outcome() == pb::OUTCOME_ABORTED) Die(fmt::format("step {} aborted: {}", step, reply.reason()));
      decided[n] = reply.outcome() == pb::OUTCOME_COMMITTED;
    };
    prepare(0);
    if (!c_.tree()) {
      ForEachNode(c_.nodes - 1, c_.threads, [&](uint32_t i) { prepare(i + 1); });
    } else {
      // Level 1 calls node 0; each level-2 node sends its own prepare and its subtree's
      // batch to its level-1 relay.
      ForEachNode(c_.fanout, c_.threads, [&](uint32_t i) { prepare(i + 1); });
      const std::vector<uint32_t> second = Level2();
      ForEachNode(static_cast<uint32_t>(second.size() * 2), c_.threads, [&](uint32_t i) {
        const uint32_t q = second[i / 2];
        if (i % 2 == 0) {
          PrepareThroughRelay(q, {q}, prepares, whole_parts, bytes, decided, /*relaying=*/0);
        } else if (!Below(q).empty()) {
          PrepareThroughRelay(q, Below(q), prepares, whole_parts, bytes, decided, q);
        }
      });
    }
    const uint64_t cpu_prepared = coordinator.CpuNs();
    // 3. Outcome polls: node 0's (the whole manifest) beside every other node's.
    auto poll = [&](uint32_t n, uint64_t* manifest_bytes) {
      pb::OutcomeRequest request;
      request.set_job("scale");
      request.set_step(step);
      request.set_wait_ms(30'000);
      request.set_node_rank(n);
      pb::OutcomeReply reply;
      // As a node's watcher does: a poll that ends before the answer (a long decision, or
      // node 0's manifest still being assembled) is sent again.
      do {
        reply.Clear();
        Call(n, [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.GetOutcome(ctx, request, &reply); });
        bytes[n].sent += request.ByteSizeLong();
        bytes[n].received += reply.ByteSizeLong();
      } while (reply.outcome() == pb::OUTCOME_PENDING);
      if (reply.outcome() != pb::OUTCOME_COMMITTED) Die(fmt::format("step {} not committed: {}", step, reply.reason()));
      checksums_unused_ = reply.committed().checksums_unused();
      if (manifest_bytes) *manifest_bytes = reply.manifest_json().size();
    };
    uint64_t manifest_bytes = 0;
    Clock::time_point node0_end = start;
    std::thread node0([&] {
      if (!decided[0]) poll(0, &manifest_bytes);
      node0_end = Clock::now();
    });
    std::vector<uint32_t> pollers;
    const uint32_t direct = c_.tree() ? c_.fanout + 1 : c_.nodes;
    for (uint32_t n = 1; n < direct; ++n) {
      if (!decided[n]) pollers.push_back(n);
    }
    ForEachNode(static_cast<uint32_t>(pollers.size()), c_.threads, [&](uint32_t i) { poll(pollers[i], nullptr); });
    if (c_.tree()) {
      const std::vector<uint32_t> second = Level2();
      ForEachNode(static_cast<uint32_t>(second.size()), c_.threads,
                  [&](uint32_t i) { PollThroughRelay(second[i], step, bytes); });
    }
    const auto end = Clock::now();
    const uint64_t cpu_after = coordinator.CpuNs();
    node0.join();

    StepFigures f;
    f.heartbeat_cpu_ms = static_cast<double>(cpu_before - cpu_heartbeats) / 1e6;
    f.prepare_cpu_ms = static_cast<double>(cpu_prepared - cpu_before) / 1e6;
    f.outcome_cpu_ms = static_cast<double>(cpu_after - cpu_prepared) / 1e6;
    f.commit_ms = std::chrono::duration<double, std::milli>(end - start).count();
    f.assemble_cpu_ms = static_cast<double>(coordinator.AssemblerCpuNs() - assembler_before) / 1e6;
    f.node0_ms = std::chrono::duration<double, std::milli>(node0_end - start).count();
    f.manifest_bytes = manifest_bytes;
    std::vector<uint64_t> sent, received;
    for (const NodeBytes& b : bytes) {
      sent.push_back(b.sent);
      received.push_back(b.received);
    }
    f.node0_received = received[0];  // the whole manifest
    for (const NodeBytes& b : bytes) {
      f.relay_sent_max = std::max(f.relay_sent_max, b.relay_sent);
      f.relay_received_max = std::max(f.relay_received_max, b.relay_received);
    }
    sent.erase(sent.begin());
    received.erase(received.begin());
    if (sent.empty()) return f;
    std::sort(sent.begin(), sent.end());
    std::sort(received.begin(), received.end());
    f.node_sent_p50 = sent[sent.size() / 2];
    f.node_sent_max = sent.back();
    f.node_received_p50 = received[received.size() / 2];
    f.node_received_max = received.back();
    return f;
  }

  // A restore's gather of every rank's step list (the same list on every rank, as after a
  // clean stop): each node's ranks merged into one arrival, as ckptd's group client merges
  // them; with the tree, a level-1 node calls node 0 itself, and each level-2 node sends
  // its own arrival and one merged for its subtree (as its relay would at best) to its
  // level-1 relay, which merges what it is sent. `per_rank`: every rank calls node 0 on its
  // own (ckptd before merged gathers). All calls are in flight at once (a gather completes
  // only when every participant arrived).
  GatherFigures RestoreGather(const Coordinator& coordinator, bool per_rank) {
    const uint32_t world = c_.nodes * c_.ranks_per_node;
    const std::string key = per_rank ? "restore/per-rank" : "restore/merged";
    const std::string steps = "2 3 4";
    struct Pending {
      pb::GatherRequest request;
      pb::GatherReply reply;
      grpc::ClientContext ctx;
      pb::Group::Stub* stub = nullptr;
    };
    std::vector<std::unique_ptr<Pending>> calls;
    auto add = [&](pb::Group::Stub* stub, std::vector<uint32_t> participants) {
      auto p = std::make_unique<Pending>();
      p->stub = stub;
      p->request.set_key(key);
      p->request.set_participants(world);
      p->request.set_distinct(true);
      p->request.set_timeout_ms(600'000);
      if (participants.size() == 1) {
        p->request.set_participant(participants[0]);
        p->request.set_payload(steps);
      } else {
        p->request.set_participant(world);  // the merged form
        pb::GatherArrivals* a = p->request.add_merged();
        a->set_payload(steps);
        a->mutable_participants()->Add(participants.begin(), participants.end());
      }
      calls.push_back(std::move(p));
    };
    auto ranks_of = [&](const std::vector<uint32_t>& nodes) {
      std::vector<uint32_t> ranks;
      for (uint32_t n : nodes) {
        for (uint32_t r = n * c_.ranks_per_node; r < (n + 1) * c_.ranks_per_node; ++r) ranks.push_back(r);
      }
      return ranks;
    };
    // Every call waits until the last arrives, and a connection carries at most 256 calls
    // at once (the group server's limit): at most 128 per connection, as nodes have
    // connections of their own.
    const uint32_t direct = per_rank ? world : c_.tree() ? c_.fanout + 1 : c_.nodes;
    std::vector<std::unique_ptr<pb::Group::Stub>> to_node0;
    for (uint32_t i = 0; i < (direct + 127) / 128; ++i) {
      to_node0.push_back(pb::Group::NewStub(
          grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), Args(1000 + i))));
    }
    auto stub_for = [&](uint32_t i) { return to_node0[i / 128].get(); };
    GatherFigures f;
    if (per_rank) {
      for (uint32_t r = 0; r < world; ++r) add(stub_for(r), {r});
      f.calls_to_node0 = world;
    } else if (!c_.tree()) {
      for (uint32_t n = 0; n < c_.nodes; ++n) add(stub_for(n), ranks_of({n}));
      f.calls_to_node0 = c_.nodes;
    } else {
      for (uint32_t n = 0; n <= c_.fanout; ++n) add(stub_for(n), ranks_of({n}));
      for (uint32_t q : Level2()) {
        pb::Group::Stub* relay = relay_stubs_[(q - 1) / c_.fanout - 1].get();
        add(relay, ranks_of({q}));
        if (std::vector<uint32_t> below = Below(q); !below.empty()) add(relay, ranks_of(below));
      }
    }
    std::mutex mu;
    std::condition_variable cv;
    size_t left = calls.size();
    std::string failed;
    const uint64_t cpu_before = coordinator.CpuNs();
    const auto start = Clock::now();
    for (auto& p : calls) {
      p->ctx.AddMetadata("x-ckptd-group-token", kToken);
      p->ctx.set_deadline(std::chrono::system_clock::now() + 600s);
      Pending* call = p.get();
      call->stub->async()->Gather(&call->ctx, &call->request, &call->reply, [&, call](grpc::Status status) {
        std::lock_guard lock(mu);
        if (!status.ok() && failed.empty()) failed = status.error_message();
        if (status.ok() && (call->reply.counts_size() != 1 || call->reply.counts(0) != world) && failed.empty()) {
          failed = "a gather answered without every participant";
        }
        if (--left == 0) cv.notify_all();
      });
    }
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return left == 0; });
    }
    f.ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    f.cpu_ms = static_cast<double>(coordinator.CpuNs() - cpu_before) / 1e6;
    if (!failed.empty()) Die("restore gather: " + failed);
    if (c_.tree() && !per_rank) f.calls_to_node0 = 0;  // counted by the relays: see Measure
    return f;
  }

 private:
  static grpc::ChannelArguments Args(uint32_t channel) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    args.SetInt("grpc.channel_id", static_cast<int>(channel));  // distinct connections
    return args;
  }

  std::vector<uint32_t> Level2() const {
    std::vector<uint32_t> out;
    for (uint32_t n = c_.fanout + 1; n < c_.nodes && c_.Level(n) == 2; ++n) out.push_back(n);
    return out;
  }

  // Every node below q (its subtree, q excluded).
  std::vector<uint32_t> Below(uint32_t q) const {
    std::vector<uint32_t> out, frontier{q};
    while (!frontier.empty()) {
      std::vector<uint32_t> next;
      for (uint32_t from : frontier) {
        for (uint64_t child = uint64_t{from} * c_.fanout + 1;
             child <= uint64_t{from} * c_.fanout + c_.fanout && child < c_.nodes; ++child) {
          next.push_back(static_cast<uint32_t>(child));
        }
      }
      out.insert(out.end(), next.begin(), next.end());
      frontier = std::move(next);
    }
    return out;
  }

  pb::HeartbeatRequest HeartbeatOf(uint32_t n) const {
    pb::HeartbeatRequest request;
    request.set_node_rank(n);
    request.set_incarnation(1000 + n);
    request.set_known_members_version(known_version_[n]);
    return request;
  }

  // `nodes`' heartbeats in one batch to level-2 node q's relay, as q's own (a batch of
  // one) or as q relaying its subtree's.
  void HeartbeatThroughRelay(uint32_t q, const std::vector<uint32_t>& nodes, std::vector<NodeBytes>& bytes,
                             uint32_t relaying) {
    const uint32_t relay = (q - 1) / c_.fanout;
    pb::HeartbeatBatchRequest batch;
    for (uint32_t n : nodes) *batch.add_heartbeats() = HeartbeatOf(n);
    pb::HeartbeatBatchReply reply;
    CallOn(*relay_stubs_[relay - 1], q,
           [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.HeartbeatBatch(ctx, batch, &reply); });
    if (reply.results_size() != batch.heartbeats_size()) Die("a relay answered heartbeats with the wrong count");
    bytes[relay].relay_sent += batch.ByteSizeLong();
    bytes[relay].relay_received += reply.ByteSizeLong();
    if (relaying != 0) {
      bytes[relaying].relay_sent += batch.ByteSizeLong();
      bytes[relaying].relay_received += reply.ByteSizeLong();
    }
    for (int i = 0; i < reply.results_size(); ++i) {
      const uint32_t n = nodes[static_cast<size_t>(i)];
      const pb::HeartbeatResult& r = reply.results(i);
      if (r.code() != 0) Die(fmt::format("node {}: {}", n, r.message()));
      if (r.view() >= static_cast<uint32_t>(reply.views_size())) Die("a heartbeat's view is missing");
      const pb::GroupView& view = reply.views(static_cast<int>(r.view()));
      known_version_[n] = view.members_version();
      bytes[n].sent += batch.heartbeats(i).ByteSizeLong() + 3;  // a batch of one around it
      bytes[n].received += view.ByteSizeLong() + 6;
    }
  }

  // `nodes`' prepares in one batch to level-2 node q's relay (its level-1 parent): as q's
  // own (a batch of one) or as q relaying its subtree. Resends the whole parts of those
  // the coordinator asks structures for.
  void PrepareThroughRelay(uint32_t q, const std::vector<uint32_t>& nodes, const std::vector<pb::PrepareRequest>& compact,
                           const std::vector<pb::PrepareRequest>& whole, std::vector<NodeBytes>& bytes,
                           std::vector<char>& decided, uint32_t relaying) {
    const uint32_t relay = (q - 1) / c_.fanout;
    std::vector<uint32_t> left = nodes;
    for (int attempt = 0; !left.empty(); ++attempt) {
      if (attempt == 2) Die("the coordinator asked twice for a structure it was sent");
      pb::PrepareBatchRequest batch;
      for (uint32_t n : left) *batch.add_prepares() = structure_known_[n] ? compact[n] : whole[n];
      pb::PrepareBatchReply reply;
      CallOn(*relay_stubs_[relay - 1], q,
             [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.PrepareBatch(ctx, batch, &reply); });
      if (reply.results_size() != batch.prepares_size()) Die("a relay answered a batch with the wrong count");
      const uint64_t sent = batch.ByteSizeLong(), received = reply.ByteSizeLong();
      bytes[relay].relay_sent += sent;  // it forwards what it is sent, and the answers back
      bytes[relay].relay_received += received;
      if (relaying != 0) {
        bytes[relaying].relay_sent += sent;
        bytes[relaying].relay_received += received;
      }
      std::vector<uint32_t> again;
      for (int i = 0; i < reply.results_size(); ++i) {
        const uint32_t n = left[static_cast<size_t>(i)];
        const pb::PrepareResult& r = reply.results(i);
        if (r.code() != 0) Die(fmt::format("node {}: {}", n, r.message()));
        bytes[n].sent += batch.prepares(i).ByteSizeLong() + 3;  // a batch of one around it
        bytes[n].received += r.ByteSizeLong() + 3;
        if (r.reply().need_structure()) {
          if (!structure_known_[n]) Die("the coordinator asked for a structure it was sent");
          structure_known_[n] = 0;
          again.push_back(n);
          continue;
        }
        structure_known_[n] = 1;
        if (r.reply().outcome() == pb::OUTCOME_ABORTED) Die(fmt::format("aborted: {}", r.reply().reason()));
        decided[n] = r.reply().outcome() == pb::OUTCOME_COMMITTED;
      }
      left = std::move(again);
    }
  }

  // Level-2 node q polls its relay for its own outcome and its subtree's shares; each node
  // below hears the header and its own share (what q would answer it).
  void PollThroughRelay(uint32_t q, uint64_t step, std::vector<NodeBytes>& bytes) {
    const uint32_t relay = (q - 1) / c_.fanout;
    const std::vector<uint32_t> below = Below(q);
    pb::OutcomeRequest request;
    request.set_job("scale");
    request.set_step(step);
    request.set_wait_ms(30'000);
    request.set_node_rank(q);
    request.mutable_shares_for()->Add(below.begin(), below.end());
    pb::OutcomeReply reply;
    do {
      reply.Clear();
      CallOn(*relay_stubs_[relay - 1], q,
             [&](pb::Group::Stub& stub, grpc::ClientContext* ctx) { return stub.GetOutcome(ctx, request, &reply); });
      bytes[relay].relay_sent += request.ByteSizeLong();
      bytes[relay].relay_received += reply.ByteSizeLong();
    } while (reply.outcome() == pb::OUTCOME_PENDING);
    if (reply.outcome() != pb::OUTCOME_COMMITTED) Die(fmt::format("step {} not committed: {}", step, reply.reason()));
    if (static_cast<size_t>(reply.shares_size()) != below.size()) Die("a relay left out shares");
    pb::OutcomeReply own = reply;
    own.clear_shares();
    bytes[q].sent += request.ByteSizeLong() - request.shares_for_size() * 3;
    bytes[q].received += own.ByteSizeLong();
    bytes[q].relay_received += reply.ByteSizeLong() - own.ByteSizeLong();
    pb::OutcomeRequest leaf_request = request;
    leaf_request.clear_shares_for();
    for (const pb::NodeShare& share : reply.shares()) {
      pb::OutcomeReply leaf = own;
      leaf.mutable_committed()->set_node_ranks(share.ranks());
      leaf.mutable_committed()->set_node_bytes(share.bytes());
      leaf.mutable_committed()->set_node_attempt(share.attempt());
      bytes[share.node_rank()].sent += leaf_request.ByteSizeLong();
      bytes[share.node_rank()].received += leaf.ByteSizeLong();
      bytes[q].relay_sent += leaf.ByteSizeLong();
    }
  }

  template <typename Rpc>
  void CallOn(pb::Group::Stub& stub, uint32_t node, Rpc rpc) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-ckptd-group-token", kToken);
    ctx.set_deadline(std::chrono::system_clock::now() + 600s);
    grpc::Status s = rpc(stub, &ctx);
    if (!s.ok()) Die(fmt::format("node {}: {}", node, s.error_message()));
  }

  template <typename Rpc>
  void Call(uint32_t node, Rpc rpc, bool wait_for_ready = false) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-ckptd-group-token", kToken);
    ctx.set_deadline(std::chrono::system_clock::now() + 600s);
    ctx.set_wait_for_ready(wait_for_ready);
    grpc::Status s = rpc(*stubs_[node % stubs_.size()], &ctx);
    if (!s.ok()) Die(fmt::format("node {}: {}", node, s.error_message()));
  }

  const Config c_;
  const std::string address_;  // the coordinator's
  std::vector<std::unique_ptr<pb::Group::Stub>> stubs_;
  std::vector<std::unique_ptr<pb::Group::Stub>> relay_stubs_;  // the first level's, by node - 1
  std::vector<uint64_t> known_version_;
  std::vector<char> structure_known_;  // by node: the coordinator holds its part's structure
  // The coordinator said, in its last commit, that it keeps none of the job's checksums.
  std::atomic<bool> checksums_unused_{false};
};

ScaleResult Measure(const Config& c, const std::string& self, const std::string& dir) {
  const auto start = Clock::now();
  const std::string run_dir = fmt::format("{}/n{}-t{}", dir, c.nodes, c.tensors);
  std::filesystem::create_directories(run_dir);
  Coordinator coordinator(self, c.nodes, c.fanout, run_dir, c.shared_root);
  FirstLevelRelays relays(c, coordinator.address());
  Simulation sim(c, coordinator.address(), relays);
  ScaleResult result{c};
  const uint64_t cpu_before_joins = coordinator.CpuNs();
  result.join_received_per_node = sim.Join();
  result.join_cpu_ms = static_cast<double>(coordinator.CpuNs() - cpu_before_joins) / 1e6;
  // Progress on stderr (the coordinator's pid, to attach a profiler to its steps).
  auto progress = [&](const std::string& what) {
    if (!c.json) {
      std::cerr << fmt::format("\n  [{:6.1f} s] coordinator pid {}: {}",
                               std::chrono::duration<double>(Clock::now() - start).count(), coordinator.pid(), what)
                << std::flush;
    }
  };
  progress("joined");
  // One step first, not counted: its heartbeats bring each node the members (through its
  // relay, with the tree), and first uses warm the coordinator up.
  result.first_heartbeats_cpu_ms = sim.Step(1, coordinator).heartbeat_cpu_ms;
  const uint64_t cpu_after_first = coordinator.CpuNs();
  progress("first step done");
  // The first step parses and checks every node's whole structure, then keeps summaries:
  // gigabytes freed at once at 10,000 x 8 x 200, which the allocator returns to the system
  // over the next seconds (jemalloc's decay). Steps are seconds to minutes apart in a job:
  // the measured ones start once the coordinator is idle again, as a job's next step would.
  const auto settle_until = Clock::now() + 60s;
  for (uint64_t cpu = coordinator.CpuNs(); Clock::now() < settle_until;) {
    std::this_thread::sleep_for(500ms);
    const uint64_t now = coordinator.CpuNs();
    const bool idle = now - cpu < 25'000'000;  // under 5% of a core
    cpu = now;
    if (idle) break;
  }
  result.settle_cpu_ms = static_cast<double>(coordinator.CpuNs() - cpu_after_first) / 1e6;
  progress(fmt::format("settled: {:.0f} ms of CPU after the first step", result.settle_cpu_ms));
  for (uint64_t step = 2; step <= c.steps + 1; ++step) {
    result.steps.push_back(sim.Step(step, coordinator));
    progress(fmt::format("step {} done", step));
  }
  if (c.shared_root) {
    // The last step was published on the shared root, readable whole (a benchmark whose
    // publisher failed would time nothing worth reporting).
    format::CheckpointStore root(MakePosixFilesystem(), run_dir + "/root");
    absl::StatusOr<std::vector<std::string>> jobs = root.ListJobs();
    if (!jobs.ok() || jobs->size() != 1) Die("the shared root holds no job");
    absl::StatusOr<format::Manifest> last = root.LoadManifest(jobs->front(), c.steps + 1);
    if (!last.ok()) Die("the last step is not published on the shared root: " + Message(last.status()));
  }
  // A restore: every rank's step list gathered, merged as ckptd merges it, and (with
  // --gather-per-rank) once more with a call per rank, as before merged gathers.
  const uint64_t merges_before = relays.GatherMerges();
  result.gather = sim.RestoreGather(coordinator, /*per_rank=*/false);
  if (c.tree()) result.gather.calls_to_node0 = c.fanout + 1 + (relays.GatherMerges() - merges_before);
  progress(fmt::format("restore gather: {:.0f} ms of CPU", result.gather.cpu_ms));
  if (c.gather_per_rank) {
    result.gather_per_rank = sim.RestoreGather(coordinator, /*per_rank=*/true);
    progress(fmt::format("restore gather, a call per rank: {:.0f} ms of CPU", result.gather_per_rank.cpu_ms));
  }
  if (!c.json) std::cerr << "\n";
  result.coordinator_peak_rss = coordinator.PeakRss();
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::filesystem::remove_all(run_dir);
  return result;
}

std::string Size(double bytes) {
  if (bytes >= 1 << 30) return fmt::format("{:.1f} GiB", bytes / (1 << 30));
  if (bytes >= 1 << 20) return fmt::format("{:.1f} MiB", bytes / (1 << 20));
  if (bytes >= 1 << 10) return fmt::format("{:.1f} KiB", bytes / (1 << 10));
  return fmt::format("{:.0f} B", bytes);
}

}  // namespace

int ScaleMain(int argc, char** argv) {
  std::string nodes_text = "64,1000", tensors_text = "2,200", dir, address_file;
  Config c{0, 8, 0, 3, 32, 16, 32};
  bool& json = c.json;
  bool serve = false;
  uint32_t serve_nodes = 0;
  CLI::App app{"group_bench scale: the coordinator at thousands of nodes, simulated"};
  app.add_option("--nodes", nodes_text, "group sizes, comma-separated")->capture_default_str();
  app.add_option("--ranks-per-node", c.ranks_per_node)->capture_default_str();
  app.add_option("--tensors", tensors_text, "tensors per rank, comma-separated")->capture_default_str();
  app.add_option("--steps", c.steps, "steps measured per configuration (after one not counted)")
      ->capture_default_str();
  app.add_option("--fanout", c.fanout, "the relay tree's fan-out, as --group-relay-fanout (0: none)")
      ->capture_default_str();
  app.add_option("--channels", c.channels, "gRPC channels the simulated nodes share")->capture_default_str();
  app.add_option("--threads", c.threads, "threads sending the simulated nodes' calls")->capture_default_str();
  app.add_option("--dir", dir, "where the decision log lives (default: a new dir in /tmp)");
  app.add_flag("--json", json, "print one JSON object");
  app.add_flag("--gather-per-rank", c.gather_per_rank,
               "also measure the restore gather with a call per rank to node 0 (as before merged gathers)");
  app.add_flag("--shared-root", c.shared_root,
               "the coordinator publishes each step's manifest (or index and parts) on a shared root under --dir");
  app.add_flag("--serve", serve)->group("");  // internal: the coordinator's process
  app.add_option("--num-nodes", serve_nodes)->group("");
  app.add_option("--address-file", address_file)->group("");
  CLI11_PARSE(app, argc, argv);
  log::SetLevel("warn");
  if (serve) return ServeCoordinator(serve_nodes, c.fanout, dir, address_file, c.shared_root);

  bool own_dir = dir.empty();
  if (own_dir) {
    std::string tmpl = "/tmp/group-scale.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) Die("mkdtemp");
    dir = tmpl;
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  std::vector<ScaleResult> results;
  for (uint32_t tensors : ParseCounts(tensors_text, "--tensors")) {
    for (uint32_t nodes : ParseCounts(nodes_text, "--nodes")) {
      Config run = c;
      run.nodes = nodes;
      run.tensors = tensors;
      if (!json) std::cerr << fmt::format("{} nodes x {} ranks x {} tensors... ", nodes, c.ranks_per_node, tensors) << std::flush;
      results.push_back(Measure(run, self, dir));
      if (!json) std::cerr << fmt::format("{:.1f} s\n", results.back().seconds);
    }
  }
  if (own_dir) std::filesystem::remove_all(dir);

  if (json) {
    nlohmann::ordered_json out;
    out["cpus"] = std::thread::hardware_concurrency();
    for (const ScaleResult& r : results) {
      nlohmann::ordered_json j = {{"nodes", r.config.nodes},
                                  {"ranks_per_node", r.config.ranks_per_node},
                                  {"tensors_per_rank", r.config.tensors},
                                  {"relay_fanout", r.config.tree() ? r.config.fanout : 0},
                                  {"join_bytes_per_node", r.join_received_per_node},
                                  {"join_cpu_ms", r.join_cpu_ms},
                                  {"first_heartbeats_cpu_ms", r.first_heartbeats_cpu_ms},
                                  {"settle_after_first_step_cpu_ms", r.settle_cpu_ms},
                                  {"coordinator_peak_rss_bytes", r.coordinator_peak_rss},
                                  {"restore_gather", {{"coordinator_cpu_ms", r.gather.cpu_ms},
                                                      {"ms", r.gather.ms},
                                                      {"calls_to_node0", r.gather.calls_to_node0}}}};
      if (r.config.gather_per_rank) {
        j["restore_gather_per_rank"] = {{"coordinator_cpu_ms", r.gather_per_rank.cpu_ms},
                                        {"ms", r.gather_per_rank.ms},
                                        {"calls_to_node0", r.gather_per_rank.calls_to_node0}};
      }
      for (const StepFigures& f : r.steps) {
        j["steps"].push_back({{"coordinator_heartbeat_cpu_ms", f.heartbeat_cpu_ms},
                              {"coordinator_prepare_cpu_ms", f.prepare_cpu_ms},
                              {"coordinator_outcome_cpu_ms", f.outcome_cpu_ms},
                              {"commit_ms", f.commit_ms},
                              {"manifest_bytes", f.manifest_bytes},
                              {"node_sent_p50", f.node_sent_p50},
                              {"node_sent_max", f.node_sent_max},
                              {"node_received_p50", f.node_received_p50},
                              {"node_received_max", f.node_received_max},
                              {"node0_received", f.node0_received},
                              {"relay_sent_max", f.relay_sent_max},
                              {"relay_received_max", f.relay_received_max},
                              {"coordinator_assemble_cpu_ms", f.assemble_cpu_ms},
                              {"node0_whole_manifest_ms", f.node0_ms}});
      }
      out["runs"].push_back(j);
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  fmt::print("group_bench scale: the real coordinator in its own process, N simulated nodes over {} gRPC "
             "channels, relay fan-out {}, {} CPUs, loopback; decision log on {}\n",
             c.channels, c.fanout, std::thread::hardware_concurrency(), dir);
  fmt::print("per step (median of {}): the coordinator's CPU for the prepares and the decision, for the\n"
             "outcome replies, and for one heartbeat from every node; first prepare to every node but node 0 knowing the outcome; bytes per node other\n"
             "than node 0 (median, max), and the most a relay moves for its subtree (sent, received); node 0's\n"
             "whole manifest: the coordinator's CPU assembling it after the decision, first prepare to node 0\n"
             "holding it, and what node 0 receives\n\n",
             c.steps);
  fmt::print("{:>6} {:>6} {:>7} {:>6} | {:>10} | {:>11} {:>11} {:>10} | {:>10} | {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} | "
             "{:>12} {:>10} {:>9} | {:>9}\n",
             "nodes", "ranks", "tensors", "fanout", "manifest", "CPU decide", "CPU replies", "CPU hbeats", "commit", "sent/node",
             "max", "recv/node", "max", "relay tx", "relay rx", "CPU assemble", "node 0", "node 0 rx", "coord RSS");
  for (const ScaleResult& r : results) {
    std::vector<StepFigures> steps = r.steps;
    std::sort(steps.begin(), steps.end(), [](const auto& a, const auto& b) { return a.commit_ms < b.commit_ms; });
    const StepFigures& f = steps[steps.size() / 2];
    fmt::print("{:>6} {:>6} {:>7} {:>6} | {:>10} | {:>8.0f} ms {:>8.0f} ms {:>7.0f} ms | {:>7.0f} ms | {:>9} {:>9} | {:>9} {:>9} | "
               "{:>9} {:>9} | {:>9.0f} ms {:>7.0f} ms {:>9} | {:>9}\n",
               r.config.nodes, r.config.nodes * r.config.ranks_per_node, r.config.tensors,
               r.config.tree() ? std::to_string(r.config.fanout) : "-", Size(f.manifest_bytes), f.prepare_cpu_ms,
               f.outcome_cpu_ms, f.heartbeat_cpu_ms, f.commit_ms, Size(f.node_sent_p50), Size(f.node_sent_max), Size(f.node_received_p50),
               Size(f.node_received_max), Size(f.relay_sent_max), Size(f.relay_received_max), f.assemble_cpu_ms,
               f.node0_ms, Size(f.node0_received), Size(r.coordinator_peak_rss));
  }
  for (const ScaleResult& r : results) {
    fmt::print("join: {} nodes: {} per node; the coordinator's CPU for the joins {:.0f} ms, for the first "
               "heartbeats (the membership) {:.0f} ms; after the first step, until idle again, {:.0f} ms\n",
               r.config.nodes, Size(r.join_received_per_node), r.join_cpu_ms, r.first_heartbeats_cpu_ms,
               r.settle_cpu_ms);
  }
  for (const ScaleResult& r : results) {
    fmt::print("restore gather: {} ranks: the coordinator's CPU {:.0f} ms, {:.0f} ms to every answer, {} calls to node 0",
               r.config.nodes * r.config.ranks_per_node, r.gather.cpu_ms, r.gather.ms, r.gather.calls_to_node0);
    if (r.config.gather_per_rank) {
      fmt::print("; a call per rank: {:.0f} ms of CPU, {:.0f} ms, {} calls", r.gather_per_rank.cpu_ms,
                 r.gather_per_rank.ms, r.gather_per_rank.calls_to_node0);
    }
    fmt::print("\n");
  }
  return 0;
}

}  // namespace ckpt::bench
