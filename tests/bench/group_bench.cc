// group_bench: what the daemons' group costs a checkpoint (issue 8), on loopback.
//
//   bazel build //tests/bench:group_bench
//   bazel-bin/tests/bench/group_bench [--nodes 2,4,16,64] [--rounds 200] [--dir /tmp]
//                                     [--processes] [--json]
//   bazel-bin/tests/bench/group_bench scale ...   (thousands of nodes, simulated:
//                                                  tests/bench/group_scale.cc)
//
// For each N: one coordinator group server (node 0's role) whose decision log is a real
// directory under --dir, so every commit includes its fsyncs (file, then directory), and N
// group clients, each with its own gRPC channel as N daemons would have. By default the
// clients are threads of this process; with --processes each is a child process (this
// binary again), which adds the scheduler's cost of N processes. Either way it is one
// machine and loopback TCP, not N machines.
//   barrier   all N call Gather("bench/<round>", i, N, empty payload); time from the
//             release of the start gate to the return of the last call;
//   commit    each node prepares one rank of world size N (a one-shard, one-tensor
//             manifest part), then long-polls GetOutcome unless its Prepare reply already
//             says committed; time from the last (and the first) Prepare sent to the moment
//             every node knows "committed". "Deciding call": the round trip of the one
//             Prepare that completed the step (the coordinator merges the parts and
//             records the decision inside it), to tell that cost from the long polls'.
// Floors, measured in the same run: one gRPC Ping round trip on one channel, and an fsync
// of a small file (and the decision log's own atomic write) in --dir.
//
// The start gate is a process-shared pthread barrier in a memfd, and every timestamp is
// CLOCK_MONOTONIC (steady_clock), so threads and child processes run the same code and
// their times compare directly.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "storage/filesystem.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/group/decision_log.h"
#include "daemon/group/group_client.h"
#include "daemon/group/group_server.h"
#include "format/manifest.h"
#include "proto/group.grpc.pb.h"
#include "tests/bench/group_scale.h"

extern char** environ;

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ckpt::Message;
namespace group = ckpt::group;
namespace pb = ckptd::group::v1;

constexpr char kToken[] = "group-bench-token-0123456789";
constexpr int kWarmup = 5;  // rounds run first and not counted (first-use costs)

[[noreturn]] void Die(const std::string& why) {
  std::cerr << "group_bench: " << why << "\n";
  std::exit(1);
}

int64_t NowNs() { return Clock::now().time_since_epoch() / 1ns; }

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

group::GroupOptions Options(uint32_t node, uint32_t nodes, std::string coordinator) {
  group::GroupOptions o;
  o.node_rank = node;
  o.num_nodes = nodes;
  o.coordinator = std::move(coordinator);
  o.listen_addr = "127.0.0.1:0";
  o.token = kToken;
  // Gathers do not count as heartbeats and the bench sends none: a long timeout keeps
  // every member alive for the whole run instead of aborting steps mid-measurement.
  o.group_timeout = 3600s;
  o.step_timeout = 60s;
  o.rpc_timeout = 30s;
  return o;
}

// --- shared board: the start gate and every timestamp, in memory threads and child
// processes share ---------------------------------------------------------------------

enum Phase { kBarrier = 0, kCommit = 1 };

class Board {
 public:
  // A new board in a memfd that children inherit (no CLOEXEC).
  Board(uint32_t nodes, uint32_t rounds) : fd_(::memfd_create("group_bench", 0)) {
    if (fd_ < 0 || ::ftruncate(fd_, Bytes(nodes, rounds)) != 0) Die("memfd");
    Map(nodes, rounds);
    pthread_barrierattr_t attr;
    pthread_barrierattr_init(&attr);
    pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_barrier_init(&header_->gate, &attr, nodes);
    header_->nodes = nodes;
    header_->rounds = rounds;
  }
  // A child's view of its parent's board.
  explicit Board(int fd) : fd_(fd) {
    Map(1, 0);
    uint32_t nodes = header_->nodes, rounds = header_->rounds;
    ::munmap(header_, Bytes(1, 0));
    Map(nodes, rounds);
  }
  ~Board() {
    ::munmap(header_, bytes_);
    ::close(fd_);
  }
  Board(const Board&) = delete;
  Board& operator=(const Board&) = delete;

  int fd() const { return fd_; }
  uint32_t nodes() const { return header_->nodes; }
  uint32_t rounds() const { return header_->rounds; }

  // Every node waits here; the last to arrive records when all were released.
  void Gate(Phase phase, uint32_t round) {
    if (pthread_barrier_wait(&header_->gate) == PTHREAD_BARRIER_SERIAL_THREAD) {
      Slot(phase, round, 0, 0) = NowNs();
    }
  }
  // what: 0 the gate's release (node 0 only), 1 request sent, 2 answer known, 3 the
  // Prepare that decided the commit returned (0 for the other nodes).
  int64_t& Slot(Phase phase, uint32_t round, uint32_t node, int what) {
    size_t per_round = 1 + 3 * size_t{header_->nodes};
    size_t index = (size_t{phase} * header_->rounds + round) * per_round +
                   (what == 0 ? 0 : 1 + 3 * size_t{node} + (what - 1));
    return slots_[index];
  }

 private:
  struct Header {
    pthread_barrier_t gate;
    uint32_t nodes, rounds;
  };
  static size_t Bytes(uint32_t nodes, uint32_t rounds) {
    return sizeof(Header) + sizeof(int64_t) * 2 * rounds * (1 + 3 * size_t{nodes});
  }
  void Map(uint32_t nodes, uint32_t rounds) {
    bytes_ = Bytes(nodes, rounds);
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) Die("mmap");
    header_ = static_cast<Header*>(p);
    slots_ = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(p) + sizeof(Header));
  }

  int fd_;
  size_t bytes_ = 0;
  Header* header_ = nullptr;
  int64_t* slots_ = nullptr;
};

// One rank's manifest part, as a node's commit stage would prepare it after the shard is
// durable.
ckpt::format::Manifest Part(uint32_t rank, uint32_t world_size, uint64_t step) {
  ckpt::format::Manifest m;
  m.job = "bench";
  m.step = step;
  m.world_size = world_size;
  m.ckptd_version = "group_bench";
  m.wall_time = "2026-01-01T00:00:00Z";
  std::string file = ckpt::format::ShardFileName(rank);
  ckpt::format::ManifestShard shard;
  shard.rank = rank;
  shard.file = file;
  shard.bytes = 4096;
  m.shards.push_back(shard);
  ckpt::format::ManifestTensor& t = m.tensors["w"];
  t.dtype = "F32";
  t.global_shape = {16 * int64_t{world_size}};
  t.shards.push_back({rank, file, 0, 64, {16 * int64_t{rank}}, {16}, "xxh64:0", {}, {}});
  return m;
}

// One node's whole run: join, the barrier rounds, the commit rounds. The same code runs in
// a thread or in a child process.
absl::Status RunNode(Board& board, const std::string& coordinator, uint32_t node) {
  const uint32_t n = board.nodes();
  CKPT_ASSIGN_OR_RETURN(group::GroupClientPtr client,
                        group::MakeGrpcGroupClient(Options(node, n, coordinator), 1000 + node,
                                                   fmt::format("127.0.0.1:{}", 20000 + node)));
  CKPT_RETURN_IF_ERROR(client->Join(Clock::now() + 30s).status());
  for (uint32_t r = 0; r < board.rounds(); ++r) {
    board.Gate(kBarrier, r);
    board.Slot(kBarrier, r, node, 1) = NowNs();
    CKPT_RETURN_IF_ERROR(client->Gather(fmt::format("bench/{}", r), node, n, "", 30s).status());
    board.Slot(kBarrier, r, node, 2) = NowNs();
  }
  for (uint32_t r = 0; r < board.rounds(); ++r) {
    ckpt::format::Manifest part = Part(node, n, r + 1);
    board.Gate(kCommit, r);
    board.Slot(kCommit, r, node, 1) = NowNs();
    CKPT_ASSIGN_OR_RETURN(group::Decision d, client->Prepare(part, 1));
    // Splits the commit's time between the deciding call and the long polls' answers.
    board.Slot(kCommit, r, node, 3) = d.outcome == group::Outcome::kCommitted ? NowNs() : 0;
    while (d.outcome == group::Outcome::kPending) {
      CKPT_ASSIGN_OR_RETURN(d, client->GetOutcome("bench", r + 1, 10s));
    }
    if (d.outcome != group::Outcome::kCommitted) {
      return absl::InternalError(fmt::format("step {}: {} {}", r + 1,
                                             group::OutcomeName(d.outcome), d.reason));
    }
    board.Slot(kCommit, r, node, 2) = NowNs();
  }
  return absl::OkStatus();
}

// --- the N nodes as threads or as child processes ----------------------------------------

void RunThreads(Board& board, const std::string& coordinator) {
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < board.nodes(); ++i) {
    threads.emplace_back([&, i] {
      absl::Status s = RunNode(board, coordinator, i);
      if (!s.ok()) Die(fmt::format("node {}: {}", i, Message(s)));  // peers would wait forever
    });
  }
  for (auto& t : threads) t.join();
}

void RunProcesses(Board& board, const std::string& coordinator, const std::string& self) {
  std::vector<pid_t> children;
  for (uint32_t i = 0; i < board.nodes(); ++i) {
    std::vector<std::string> args = {self, "--child-node", std::to_string(i),
                                     "--child-board-fd", std::to_string(board.fd()),
                                     "--child-coordinator", coordinator};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    // posix_spawn, not fork: this process already runs gRPC's threads.
    if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), environ) != 0) Die("spawn");
    children.push_back(pid);
  }
  // A child that fails leaves the others waiting at the gate: stop them all.
  size_t left = children.size();
  while (left > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) Die("waitpid");
    --left;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      for (pid_t c : children) ::kill(c, SIGKILL);
      Die("a client process failed");
    }
  }
}

// --- figures ----------------------------------------------------------------------------

struct Stats {
  double p50 = 0, p99 = 0, max = 0;
};

Stats Summarize(const std::vector<double>& us) {
  if (us.empty()) return {};
  return {Percentile(us, 0.50), Percentile(us, 0.99), *std::max_element(us.begin(), us.end())};
}

nlohmann::ordered_json ToJson(const Stats& s) {
  return {{"p50_us", s.p50}, {"p99_us", s.p99}, {"max_us", s.max}};
}

struct NodesResult {
  uint32_t nodes = 0;
  uint32_t rounds = 0;
  Stats barrier, commit_from_last, commit_from_first, deciding_prepare;
  double seconds = 0;
};

NodesResult Measure(uint32_t n, uint32_t rounds, const std::string& dir, bool processes,
                    const std::string& self) {
  auto t0 = Clock::now();
  std::string log_dir = fmt::format("{}/decisions-{}", dir, n);
  group::DecisionLogPtr log = group::MakeFileDecisionLog(ckpt::MakePosixFilesystem(), log_dir);
  auto server = group::StartGroupServer(Options(0, n, ""), 1, log.get());
  if (!server.ok()) Die(Message(server.status()));
  Board board(n, kWarmup + rounds);
  if (processes) {
    RunProcesses(board, (*server)->address(), self);
  } else {
    RunThreads(board, (*server)->address());
  }
  (*server)->Shutdown();
  std::filesystem::remove_all(log_dir);

  NodesResult out;
  out.nodes = n;
  out.rounds = rounds;
  std::vector<double> barrier, from_last, from_first, deciding;
  for (uint32_t r = kWarmup; r < board.rounds(); ++r) {
    int64_t barrier_done = 0, first_sent = INT64_MAX, last_sent = 0, commit_known = 0;
    for (uint32_t i = 0; i < n; ++i) {
      barrier_done = std::max(barrier_done, board.Slot(kBarrier, r, i, 2));
      first_sent = std::min(first_sent, board.Slot(kCommit, r, i, 1));
      last_sent = std::max(last_sent, board.Slot(kCommit, r, i, 1));
      commit_known = std::max(commit_known, board.Slot(kCommit, r, i, 2));
      if (int64_t decided = board.Slot(kCommit, r, i, 3); decided != 0) {
        deciding.push_back((decided - board.Slot(kCommit, r, i, 1)) / 1e3);
      }
    }
    barrier.push_back((barrier_done - board.Slot(kBarrier, r, 0, 0)) / 1e3);
    from_last.push_back((commit_known - last_sent) / 1e3);
    from_first.push_back((commit_known - first_sent) / 1e3);
  }
  out.barrier = Summarize(barrier);
  out.commit_from_last = Summarize(from_last);
  out.commit_from_first = Summarize(from_first);
  out.deciding_prepare = Summarize(deciding);
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

// The floor of a group call: one Ping on one idle channel, one at a time.
Stats PingFloor(const std::string& dir, int samples) {
  std::string log_dir = dir + "/decisions-ping";
  group::DecisionLogPtr log = group::MakeFileDecisionLog(ckpt::MakePosixFilesystem(), log_dir);
  auto server = group::StartGroupServer(Options(0, 2, ""), 1, log.get());
  if (!server.ok()) Die(Message(server.status()));
  auto stub = pb::Group::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  std::vector<double> us;
  for (int i = 0; i < kWarmup * 10 + samples; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    ctx.AddMetadata("x-ckptd-group-token", kToken);
    pb::PingReply reply;
    auto t0 = Clock::now();
    grpc::Status s = stub->Ping(&ctx, pb::PingRequest(), &reply);
    double elapsed = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    if (!s.ok()) Die("ping: " + s.error_message());
    if (i >= kWarmup * 10) us.push_back(elapsed);
  }
  (*server)->Shutdown();
  std::filesystem::remove_all(log_dir);
  return Summarize(us);
}

// The floor of a commit decision: fsync of a small file in --dir, and the decision log's
// own pattern (write a temp file, fsync, rename, fsync the directory).
std::pair<Stats, Stats> FsyncFloor(const std::string& dir, int samples) {
  auto fs = ckpt::MakePosixFilesystem();
  std::string json(600, 'x');  // about one small step's manifest
  std::vector<double> fsync_us, atomic_us;
  for (int i = 0; i < samples; ++i) {
    std::string path = fmt::format("{}/fsync-{}.json", dir, i);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ::write(fd, json.data(), json.size()) != static_cast<ssize_t>(json.size())) {
      Die("cannot write " + path);
    }
    auto t0 = Clock::now();
    ::fsync(fd);
    fsync_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    ::close(fd);
    ::unlink(path.c_str());
    t0 = Clock::now();
    if (!ckpt::WriteFileAtomically(*fs, path, json).ok()) Die("cannot write " + path);
    atomic_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    ::unlink(path.c_str());
  }
  return {Summarize(fsync_us), Summarize(atomic_us)};
}

std::vector<uint32_t> ParseList(const std::string& text) {
  std::vector<uint32_t> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    int v = std::stoi(item);
    if (v < 2) Die("--nodes: every count must be at least 2");
    out.push_back(static_cast<uint32_t>(v));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "scale") return ckpt::bench::ScaleMain(argc - 1, argv + 1);
  std::string nodes_text = "2,4,16,64", dir;
  uint32_t rounds = 200;
  int ping_samples = 2000, fsync_samples = 200;
  bool json = false, processes = false;
  int child_node = -1, child_fd = -1;
  std::string child_coordinator;
  CLI::App app{"group_bench: barrier and commit overhead of the daemons' group, on loopback"};
  app.add_option("--nodes", nodes_text, "group sizes, comma-separated")->capture_default_str();
  app.add_option("--rounds", rounds, "timed rounds of each phase")->capture_default_str();
  app.add_option("--dir", dir, "where the decision log lives (default: a new dir in /tmp)");
  app.add_flag("--processes", processes, "one child process per client instead of a thread");
  app.add_option("--ping-samples", ping_samples)->capture_default_str();
  app.add_option("--fsync-samples", fsync_samples)->capture_default_str();
  app.add_flag("--json", json, "print one JSON object");
  // Internal: how --processes starts each client.
  app.add_option("--child-node", child_node)->group("");
  app.add_option("--child-board-fd", child_fd)->group("");
  app.add_option("--child-coordinator", child_coordinator)->group("");
  CLI11_PARSE(app, argc, argv);
  ckpt::log::SetLevel("warn");  // 64 joins would otherwise log 64 lines per group

  if (child_node >= 0) {
    Board board(child_fd);
    absl::Status s = RunNode(board, child_coordinator, static_cast<uint32_t>(child_node));
    if (!s.ok()) Die(fmt::format("node {}: {}", child_node, Message(s)));
    return 0;
  }

  std::vector<uint32_t> counts = ParseList(nodes_text);
  bool own_dir = dir.empty();
  if (own_dir) {
    std::string tmpl = "/tmp/group-bench.XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) Die("mkdtemp");
    dir = tmpl;
  } else {
    std::filesystem::create_directories(dir);
  }
  std::string self = std::filesystem::read_symlink("/proc/self/exe");
  auto note = [&](const std::string& s) { if (!json) std::cerr << s << std::flush; };

  nlohmann::ordered_json out;
  out["cpus"] = std::thread::hardware_concurrency();
  out["clients"] = processes ? "processes" : "threads";
  out["dir"] = dir;
  note("floors: gRPC ping, fsync... ");
  Stats ping = PingFloor(dir, ping_samples);
  auto [fsync, atomic] = FsyncFloor(dir, fsync_samples);
  out["ping"] = ToJson(ping);
  out["fsync"] = ToJson(fsync);
  out["atomic_write"] = ToJson(atomic);
  note("done\n");

  std::vector<NodesResult> results;
  for (uint32_t n : counts) {
    note(fmt::format("{} clients ({})... ", n, processes ? "processes" : "threads"));
    results.push_back(Measure(n, rounds, dir, processes, self));
    note(fmt::format("{:.1f} s\n", results.back().seconds));
  }
  if (own_dir) std::filesystem::remove_all(dir);

  if (json) {
    for (const NodesResult& r : results) {
      out["groups"].push_back({{"nodes", r.nodes},
                               {"rounds", r.rounds},
                               {"barrier", ToJson(r.barrier)},
                               {"commit_from_last_prepare", ToJson(r.commit_from_last)},
                               {"commit_from_first_prepare", ToJson(r.commit_from_first)},
                               {"deciding_prepare_call", ToJson(r.deciding_prepare)}});
    }
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  fmt::print("group_bench: N group clients ({}) in one machine on loopback, {} CPUs; decision log "
             "in {} (fsync included)\n",
             processes ? "one process each" : "threads of one process",
             std::thread::hardware_concurrency(), dir);
  fmt::print("floors: gRPC ping p50 {:.0f} us, p99 {:.0f} us; fsync of a small file p50 {:.0f} us; "
             "atomic write (fsync file + dir) p50 {:.0f} us\n\n",
             ping.p50, ping.p99, fsync.p50, atomic.p50);
  fmt::print("{:>5} {:>6} | {:>27} | {:>19} | {:>19} | {:>15}\n", "", "", "barrier (us)",
             "commit from last", "commit from first", "deciding call");
  fmt::print("{:>5} {:>6} | {:>8} {:>8} {:>9} | {:>9} {:>9} | {:>9} {:>9} | {:>15}\n", "nodes",
             "rounds", "p50", "p99", "max", "p50", "p99", "p50", "p99", "p50");
  for (const NodesResult& r : results) {
    fmt::print("{:>5} {:>6} | {:>8.0f} {:>8.0f} {:>9.0f} | {:>9.0f} {:>9.0f} | {:>9.0f} {:>9.0f} | "
               "{:>15.0f}\n",
               r.nodes, r.rounds, r.barrier.p50, r.barrier.p99, r.barrier.max,
               r.commit_from_last.p50, r.commit_from_last.p99, r.commit_from_first.p50,
               r.commit_from_first.p99, r.deciding_prepare.p50);
  }
  return 0;
}
