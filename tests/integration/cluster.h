// K real ckptd daemons on loopback, each with its own root (or one shared root) and its
// own trainer processes (trainer_helper), one job spanning them: what the group's tests
// (group_test.cc) and the peer replicas' tests (replication_test.cc) start. Every wait is
// bounded.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

namespace ckpt::testing::cluster {

using namespace std::chrono_literals;
using json = nlohmann::json;
namespace fs = std::filesystem;


// Short timeouts keep every case bounded (and the whole file well under a few minutes).
inline constexpr auto kGroupTimeout = 1s * kSanitizerSlowdown;   // --group-timeout
inline constexpr auto kStepTimeout = 3s * kSanitizerSlowdown;    // --step-timeout
// Bounds (WaitUntil and Process::Wait stretch them under TSan themselves); the timeouts
// above are the daemons' own, stretched here.
inline constexpr auto kJoinBound = 20s;     // daemons start, join and report every member alive
inline constexpr auto kProcessBound = 40s;  // any trainer process
inline const std::string kRestoreTimeout = std::to_string(10 * kSanitizerSlowdown) + "s";  // --restore-timeout
inline constexpr uint64_t kBytes = 1'000'000;  // per rank

inline const std::string kToken = "integration-test-group-token-0123456789abcdef";

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}


inline int ConnectTcp(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

// Whether the peer closes (EOF or reset) `fd` within `timeout`; whatever it sends first
// (an HTTP/2 GOAWAY, say) is read and ignored.
inline bool PeerClosesWithin(int fd, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    char buf[4096];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return true;
  }
}

inline std::string MemberState(const json& status, uint32_t node) {
  if (!status.contains("group") || !status["group"].contains("members")) return "";
  for (const json& m : status["group"]["members"]) {
    if (m.value("node_rank", 0u) == node) return m.value("state", "");
  }
  return "";
}

inline std::string MemberAddress(const json& status, uint32_t node) {
  if (!status.contains("group") || !status["group"].contains("members")) return "";
  for (const json& m : status["group"]["members"]) {
    if (m.value("node_rank", 0u) == node) return m.value("address", "");
  }
  return "";
}

// The in-flight entries of `job` at `step` in one daemon's status.
inline std::vector<json> InFlight(const json& status, const std::string& job, uint64_t step) {
  std::vector<json> out;
  if (!status.contains("jobs")) return out;
  for (const json& j : status["jobs"]) {
    if (j.value("job", "") != job || !j.contains("in_flight")) continue;
    for (const json& s : j["in_flight"]) {
      if (s.contains("step") && U64(s["step"]) == step) out.push_back(s);
    }
  }
  return out;
}

inline std::vector<uint32_t> MissingRanks(const json& in_flight) {
  std::vector<uint32_t> out;
  if (in_flight.contains("missing_ranks")) {
    for (const json& r : in_flight["missing_ranks"]) out.push_back(r.get<uint32_t>());
  }
  return out;
}

inline size_t TotalInFlight(const json& status) {
  size_t n = 0;
  if (!status.contains("jobs")) return 0;
  for (const json& j : status["jobs"]) {
    if (j.contains("in_flight")) n += j["in_flight"].size();
  }
  return n;
}

inline std::string StepName(uint64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08llu", static_cast<unsigned long long>(step));
  return name;
}

inline std::string ShardName(uint32_t rank) {
  char name[48];
  std::snprintf(name, sizeof name, "rank-%05u.safetensors", rank);
  return name;
}

inline uint64_t Seed(uint64_t step, uint32_t rank) { return step * 100 + rank + 1; }

// K daemons on loopback, node 0 the coordinator; `layout[n]` are node n's ranks of job
// "g", whose world size is the total number of ranks.
class Cluster {
 public:
  explicit Cluster(std::vector<std::vector<uint32_t>> layout)
      : layout_(std::move(layout)), port_(PickFreePort()) {
    for (size_t n = 0; n < layout_.size(); ++n) {
      dirs_.push_back(std::make_unique<TempDir>());
      daemons_.emplace_back();
      metrics_ports_.push_back(0);  // picked when the node is first started
      world_size_ += static_cast<uint32_t>(layout_[n].size());
    }
    token_file_ = shared_ / "token";
    WriteFile(token_file_, kToken + "\n");
  }

  // --step-timeout and --group-timeout of daemons not started yet.
  std::string step_timeout = std::to_string(std::chrono::seconds(kStepTimeout).count()) + "s";
  std::string group_timeout = std::to_string(std::chrono::seconds(kGroupTimeout).count()) + "s";
  std::string restore_timeout = kRestoreTimeout;  // --restore-timeout
  bool metrics_everywhere = true;    // else only node 0 serves /metrics (fewer ports to pick)
  std::string relay_fanout = "32";   // --group-relay-fanout
  // One root for every node (--shared-root) of daemons not started yet; empty: each its own.
  std::string shared_root;
  std::string job = "g";             // the trainers' job
  std::vector<std::string> extra_flags;               // every daemon's, when first started
  std::map<int, std::vector<std::string>> node_flags;  // node n's own, when first started
  uint64_t bytes = kBytes;           // each rank's tensors, in all
  int trainer_uid = -1;              // the trainers run as this uid (-1: the test's own)

  int num_nodes() const { return static_cast<int>(layout_.size()); }
  uint32_t world_size() const { return world_size_; }
  const std::vector<uint32_t>& ranks(int node) const { return layout_[node]; }
  int coordinator_port() const { return port_; }
  std::string coordinator() const { return "127.0.0.1:" + std::to_string(port_); }
  const TempDir& shared() const { return shared_; }
  const std::string& token_file() const { return token_file_; }
  Daemon& node(int n) { return *daemons_[n]; }
  const TempDir& dir(int n) const { return *dirs_[n]; }
  // Node n's /metrics, as Prometheus would scrape it.
  std::string Metrics(int n) const { return HttpGet(metrics_ports_[n], "/metrics"); }
  std::string StepDir(int n, uint64_t step) const {
    return (shared_root.empty() ? dirs_[n]->path() + "/root" : shared_root) + "/" + job + "/" + StepName(step);
  }

  std::vector<std::string> GroupFlags(int n, const std::string& coordinator) const {
    std::vector<std::string> f = {"--node-rank", std::to_string(n), "--num-nodes", std::to_string(num_nodes()),
                                  "--coordinator", coordinator, "--group-token-file", token_file_,
                                  "--group-timeout", group_timeout, "--step-timeout", step_timeout, "--restore-timeout", restore_timeout,
                                  "--group-relay-fanout", relay_fanout};
    if (metrics_everywhere || n == 0) f.insert(f.end(), {"--metrics-addr", std::to_string(metrics_ports_[n])});
    if (n == 0) f.insert(f.end(), {"--group-addr", coordinator});
    return f;
  }

  // Creates node n on its first start (dialing `coordinator`, default node 0's address)
  // and starts it: until its socket answers.
  void Start(int n, const std::string& coordinator = "") {
    if (!daemons_[n]) {
      // Picked now, not when the cluster was made: with many daemons up, their group servers'
      // and connections' ephemeral ports would by then have taken some of the ports picked.
      metrics_ports_[n] = PickFreePort();
      std::vector<std::string> flags = GroupFlags(n, coordinator.empty() ? this->coordinator() : coordinator);
      if (!shared_root.empty()) flags.push_back("--shared-root");
      flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
      if (auto own = node_flags.find(n); own != node_flags.end()) flags.insert(flags.end(), own->second.begin(), own->second.end());
      daemons_[n] = std::make_unique<Daemon>(*dirs_[n], flags);
      if (!shared_root.empty()) daemons_[n]->set_root(shared_root);
    }
    daemons_[n]->Start();
  }
  void StartAll() {
    for (int n = 0; n < num_nodes(); ++n) Start(n);
  }
  // The machine of node n is gone: its daemon SIGKILLed, its root deleted. Start(n) then
  // brings up a replacement with the same node rank and nothing of the job.
  void Lose(int n) {
    node(n).Kill();
    fs::remove_all(dirs_[n]->path() + "/root");
  }

  // Every node reports itself joined and the coordinator reports every member alive.
  bool AllAlive() {
    json coordinator = Status(node(0));
    for (int n = 0; n < num_nodes(); ++n) {
      if (MemberState(coordinator, n) != "alive") return false;
      json mine = Status(node(n));
      if (!mine.contains("group") || !mine["group"].value("joined", false)) return false;
    }
    return true;
  }

  std::string Logs() const {
    std::string out;
    for (int n = 0; n < num_nodes(); ++n) {
      if (daemons_[n]) out += "---- node " + std::to_string(n) + " log (tail) ----\n" + Tail(daemons_[n]->Log()) + "\n";
    }
    return out;
  }

  int NodeOf(uint32_t rank) const {
    for (int n = 0; n < num_nodes(); ++n) {
      if (std::count(layout_[n].begin(), layout_[n].end(), rank)) return n;
    }
    FAIL("rank " << rank << " is on no node");
    return -1;
  }

  std::vector<std::string> RankArgs(uint32_t rank, uint64_t seed_step) {
    std::vector<std::string> args = {"--job", job, "--rank", std::to_string(rank), "--world-size",
                                     std::to_string(world_size_), "--seed", std::to_string(Seed(seed_step, rank)),
                                     "--bytes", std::to_string(bytes)};
    if (trainer_uid >= 0) args.insert(args.begin(), {"--as-uid", std::to_string(trainer_uid)});
    return args;
  }

  // Lets every local user reach node n's socket and write its trainers' files (mode 0660 and
  // a group in production; here simply all): only ckptd's own checks stand in the way.
  void OpenToUsers(int n) {
    fs::permissions(fs::path(node(n).socket()).parent_path(), fs::perms(0755));
    fs::permissions(node(n).socket(), fs::perms(0666));
    fs::permissions(node(n).socket() + ".ctl", fs::perms(0666));
    fs::permissions(dir(n).path(), fs::perms(0755));
  }

  // A trainer process of `rank` on its node, saving `step` (and waiting for the global
  // decision unless told otherwise) with the bytes of `seed_step` (0: the step's own; another
  // run's data is another seed).
  std::unique_ptr<Process> Save(uint32_t rank, uint64_t step, bool wait_committed = true, uint64_t seed_step = 0) {
    int n = NodeOf(rank);
    auto args = RankArgs(rank, seed_step != 0 ? seed_step : step);
    args.insert(args.end(), {"save", "--step", std::to_string(step)});
    if (wait_committed) args.push_back("--wait-committed");
    return std::make_unique<Process>(Helper(node(n), args), dir(n).path(),
                                     "save" + std::to_string(step) + "r" + std::to_string(rank));
  }
  std::vector<std::unique_ptr<Process>> SaveRanks(const std::vector<uint32_t>& ranks, uint64_t step,
                                                  bool wait_committed = true, uint64_t seed_step = 0) {
    std::vector<std::unique_ptr<Process>> out;
    for (uint32_t r : ranks) out.push_back(Save(r, step, wait_committed, seed_step));
    return out;
  }
  std::vector<uint32_t> AllRanks() const {
    std::vector<uint32_t> out;
    for (uint32_t r = 0; r < world_size_; ++r) out.push_back(r);
    return out;
  }
  std::vector<uint32_t> RanksOfNodes(std::initializer_list<int> nodes) const {
    std::vector<uint32_t> out;
    for (int n : nodes) out.insert(out.end(), layout_[n].begin(), layout_[n].end());
    return out;
  }

  // Saves `step` on every rank at once and requires every one to report "committed".
  void SaveAllCommitted(uint64_t step, uint64_t seed_step = 0) {
    auto procs = SaveRanks(AllRanks(), step, true, seed_step);
    for (size_t i = 0; i < procs.size(); ++i) {
      int rc = procs[i]->Wait(kProcessBound);
      INFO("rank " << i << " saving step " << step << ": " << procs[i]->Stdout() << procs[i]->Stderr() << Logs());
      REQUIRE(rc == 0);
      REQUIRE(Contains(procs[i]->Stdout(), "committed"));
    }
    for (int n = 0; n < num_nodes(); ++n) {
      INFO("node " << n);
      CHECK(fs::exists(StepDir(n, step) + "/manifest.json"));
      CHECK_FALSE(fs::exists(StepDir(n, step) + ".tmp"));
    }
  }

  // Every rank restores at once (they meet at the restore barrier) and checks its bytes
  // against the seed of `seed_step` (0: `step`); `source[n]` is what node n's ranks must report.
  void RestoreAll(uint64_t step, const std::vector<std::string>& source, uint64_t seed_step = 0) {
    std::vector<std::unique_ptr<Process>> procs;
    for (uint32_t r = 0; r < world_size_; ++r) {
      int n = NodeOf(r);
      auto args = RankArgs(r, seed_step != 0 ? seed_step : step);
      args.push_back("check");
      procs.push_back(std::make_unique<Process>(Helper(node(n), args), dir(n).path(), "check" + std::to_string(r)));
    }
    for (uint32_t r = 0; r < world_size_; ++r) {
      int rc = procs[r]->Wait(kProcessBound);
      INFO("rank " << r << " restoring (expect step " << step << " from " << source[NodeOf(r)] << "): "
                   << procs[r]->Stdout() << procs[r]->Stderr() << Logs());
      CHECK(rc == 0);
      CHECK(Contains(procs[r]->Stdout(), "restored step=" + std::to_string(step) + " source=" + source[NodeOf(r)]));
      CHECK(Contains(procs[r]->Stdout(), "match"));
    }
  }

 private:
  std::vector<std::vector<uint32_t>> layout_;
  int port_;
  uint32_t world_size_ = 0;
  TempDir shared_;
  std::string token_file_;
  std::vector<std::unique_ptr<TempDir>> dirs_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<int> metrics_ports_;
};

// Fails the test (with every daemon's log) unless `condition` holds within `timeout`.
#define REQUIRE_WITHIN(cluster, timeout, what, ...)                                                \
  do {                                                                                             \
    if (!WaitUntil([&] { return static_cast<bool>(__VA_ARGS__); }, timeout, 25ms)) {               \
      FAIL(what << " (not within " << std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count() \
                << " ms)\n" << (cluster).Logs());                                                  \
    }                                                                                              \
  } while (0)

}  // namespace ckpt::testing::cluster
