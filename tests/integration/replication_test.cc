// Peer replicas (issue 25): real ckptd daemons on loopback, each with its own root and its
// own trainer processes, with --replication. A node lost for good (SIGKILL, its root
// deleted) restarts empty and its ranks restore bit-exactly from the fragments its coding
// group holds in memory, with no disk and no remote tier to read: "source=peer". With 4+2,
// the same after losing two nodes at once; a peer that serves damaged fragments is caught
// and another fragment used; a peer that stops answering leaves a step "incomplete" (the
// local commit never waits), the older replicas stay usable and the next step replicates
// once it answers again. Every wait is bounded.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <chrono>
#include <mutex>
#include <optional>
#include <regex>
#include <thread>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/integration/cluster.h"
#include "tests/integration/log_text.h"

using namespace ckpt::testing;
using namespace ckpt::testing::cluster;
using namespace std::chrono_literals;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string Joined(const std::vector<uint64_t>& steps) {
  std::string out;
  for (uint64_t s : steps) out += (out.empty() ? "" : ", ") + std::to_string(s);
  return out.empty() ? "none" : out;
}

// How node n's own step of job "g" stands with its coding group: "sending", "replicated",
// "incomplete", or "" when it is not listed.
std::string Replication(Daemon& d, uint64_t step, std::string* why = nullptr) {
  json s = Status(d);
  if (!s.contains("jobs")) return "";
  for (const json& j : s["jobs"]) {
    if (j.value("job", "") != "g" || !j.contains("replication")) continue;
    for (const json& r : j["replication"]) {
      if (U64(r["step"]) != step) continue;
      if (why != nullptr) *why = r.value("why", "");
      return r.value("state", "");
    }
  }
  return "";
}

bool AllReplicated(Cluster& c, uint64_t step) {
  for (int n = 0; n < c.num_nodes(); ++n) {
    if (Replication(c.node(n), step) != "replicated") return false;
  }
  return true;
}

// Every node's state of the step, and why where it is not replicated: for failures.
std::string Replications(Cluster& c, uint64_t step) {
  std::string out;
  for (int n = 0; n < c.num_nodes(); ++n) {
    std::string why;
    const std::string state = Replication(c.node(n), step, &why);
    out += "node " + std::to_string(n) + ": " + (state.empty() ? "(not listed)" : state) + (why.empty() ? "" : " (" + why + ")") + "\n";
    std::istringstream log(c.node(n).Log());
    for (std::string line; std::getline(log, line);) {
      if (Contains(line, "replicat") || Contains(line, "fragment")) out += "  " + line + "\n";
    }
  }
  return out;
}

// The steps of node `owner` that daemon d holds sealed fragments of.
std::vector<uint64_t> SealedHeld(Daemon& d, uint32_t owner) {
  std::vector<uint64_t> steps;
  json s = Status(d);
  if (!s.contains("group") || !s["group"].contains("held_replicas")) return steps;
  for (const json& h : s["group"]["held_replicas"]) {
    if (h.value("owner", 0u) == owner && h.value("sealed", false)) steps.push_back(U64(h["step"]));
  }
  return steps;
}

// Whether every node's view has `node` at the address the coordinator has: a restarted node
// listens on a new port, which the others hear with their next heartbeat.
bool EveryNodeHeard(Cluster& c, int node) {
  const std::string address = MemberAddress(Status(c.node(0)), node);
  for (int n = 1; n < c.num_nodes(); ++n) {
    if (MemberAddress(Status(c.node(n)), node) != address) return false;
  }
  return !address.empty();
}

// Loses `nodes` (SIGKILL, roots deleted), starts each again empty and waits for the group.
void LoseAndReplace(Cluster& c, std::initializer_list<int> nodes) {
  for (int n : nodes) c.Lose(n);
  for (int n : nodes) {
    CHECK_FALSE(fs::exists(c.dir(n).path() + "/root"));
    c.Start(n);
  }
  REQUIRE_WITHIN(c, kJoinBound, "the replacements joined and every member is alive", c.AllAlive());
  for (int n : nodes) REQUIRE_WITHIN(c, kJoinBound, "every node heard node " << n << "'s new address", EveryNodeHeard(c, n));
}

// Clients of a daemon's fragment fetch port that never show a ticket: each connects and
// sends a byte every `every`, on a thread of the test's, and notes when the daemon closed it.
class SlowClients {
 public:
  SlowClients(int port, int count, std::chrono::milliseconds every) : every_(every) {
    for (int i = 0; i < count; ++i) {
      Client c;
      c.fd = ConnectTcp(port);
      sockaddr_in local{};
      socklen_t local_bytes = sizeof local;
      if (::getsockname(c.fd, reinterpret_cast<sockaddr*>(&local), &local_bytes) == 0) c.port = ntohs(local.sin_port);
      clients_.push_back(c);
    }
    started_ = std::chrono::steady_clock::now();
    thread_ = std::thread([this] { Run(); });
  }
  ~SlowClients() {
    stop_ = true;
    thread_.join();
    for (Client& c : clients_) ::close(c.fd);
  }
  // How many could not even connect (counted as closed too).
  int Unconnected() const {
    return static_cast<int>(std::count_if(clients_.begin(), clients_.end(), [](const Client& c) { return c.fd < 0; }));
  }
  // Each closed one by its local port (the daemon's debug log names the same port: accepted,
  // refused, dropped), how it was found closed ("eof" or the errno's name) and when.
  std::string Why() {
    std::lock_guard lock(mu_);
    std::string out;
    for (const Client& c : clients_) {
      if (!c.closed) continue;
      const auto after = std::chrono::duration_cast<std::chrono::milliseconds>(*c.closed - started_).count();
      out += fmt::format("port {} {} at {} ms; ", c.port, c.error == 0 ? "eof" : strerrorname_np(c.error), after);
    }
    return out;
  }
  // How many the daemon has closed so far.
  int Closed() {
    std::lock_guard lock(mu_);
    return static_cast<int>(std::count_if(clients_.begin(), clients_.end(), [](const Client& c) { return c.closed.has_value(); }));
  }
  // The longest any was kept open (from when they connected), of those closed.
  std::chrono::milliseconds LongestOpen() {
    std::lock_guard lock(mu_);
    std::chrono::milliseconds longest{0};
    for (const Client& c : clients_) {
      if (c.closed) longest = std::max(longest, std::chrono::duration_cast<std::chrono::milliseconds>(*c.closed - started_));
    }
    return longest;
  }
  int size() const { return static_cast<int>(clients_.size()); }

 private:
  struct Client {
    int fd = -1;
    int port = 0;  // its local port
    std::optional<std::chrono::steady_clock::time_point> closed;
    int error = 0;  // errno of the call that found it closed (0: end of stream)
  };
  void Run() {
    auto next_byte = std::chrono::steady_clock::now();
    while (!stop_) {
      const bool send_now = std::chrono::steady_clock::now() >= next_byte;
      if (send_now) next_byte += every_;
      Poll(send_now);
      std::this_thread::sleep_for(20ms);
    }
  }
  // Reads what the daemon sent (nothing but an end), and sends a byte each `every_`.
  void Poll(bool send_now) {
    std::lock_guard lock(mu_);
    for (Client& c : clients_) {
      if (c.closed) continue;
      char buf[64];
      const ssize_t got = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      bool gone = got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      if (got < 0 && gone) c.error = errno;
      if (!gone && send_now) {
        const char byte = 'x';
        gone = ::send(c.fd, &byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EAGAIN && errno != EWOULDBLOCK;
        if (gone) c.error = errno;
      }
      if (gone) c.closed = std::chrono::steady_clock::now();
    }
  }

  const std::chrono::milliseconds every_;
  std::mutex mu_;
  std::vector<Client> clients_;  // guarded by mu_ (the descriptors themselves are fixed)
  std::chrono::steady_clock::time_point started_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

TEST_CASE("slow clients of the fetch port: bounded, dropped by the request's deadline, closed by a stop") {
  const int fetch_port = PickFreePort();
  Cluster c({{0}, {1}});
  c.extra_flags = {"--replication", "1+1"};
  c.node_flags[0] = {"--replica-fetch-port", std::to_string(fetch_port)};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  {
    // 16 connections, each sending a byte every 2 s: a request (48 bytes) would take 94 s,
    // and a timeout per read never fires. Half of them are over the bound on connections
    // without a ticket and closed at once; the rest when the request's 10 s are up.
    SlowClients slow(fetch_port, 16, 2s);
    REQUIRE_WITHIN(c, 5s, "the connections over the bound closed at once (" << slow.Closed() << " of 16 closed)",
                   slow.Closed() >= 8);
    REQUIRE_WITHIN(c, 30s, "every slow connection dropped (" << slow.Closed() << " of 16 closed)",
                   slow.Closed() == slow.size());
    CHECK(slow.LongestOpen() < 20s);
    CHECK(slow.LongestOpen() >= 9s);  // the others were kept to the deadline, not cut early
    // The daemon's debug log names each connection by its port, as Why() does.
    const std::string log = c.node(0).Log();
    CHECK(Occurrences(log, "fragment fetch channel: accepted a connection from port") == 8);
    CHECK(Occurrences(log, "fragment fetch channel: refused a connection from port") == 8);
    // and dropped the 8 it accepted at their deadline, not before.
    const std::regex dropped(R"(dropped before its whole request, (\d+) ms after its accept)");
    std::vector<long> after_ms;
    for (auto m = std::sregex_iterator(log.begin(), log.end(), dropped); m != std::sregex_iterator(); ++m) {
      after_ms.push_back(std::stol((*m)[1]));
    }
    INFO("dropped after (ms): " << json(after_ms).dump());
    CHECK(after_ms.size() == 8);
    CHECK(std::all_of(after_ms.begin(), after_ms.end(), [](long ms) { return ms >= 9'900; }));
  }
  // The channel still serves: replication and a restore from peers need nothing else, but
  // the port accepts again.
  {
    // Open finding (docs/design/incremental.md): right after the first batch went, a new
    // batch was now and then (1 run in 3 beside other tests, 2026-11-29) found closed within
    // its first second, while the daemon logged no refusal of it and dropped 8 connections
    // only at their deadline; 143 runs since, under loads up to 8 on 2 cores with packet
    // captures, never did. Until that is understood the port must take a batch again within
    // 30 s; each try names its clients by port, as the daemon's debug log does.
    std::unique_ptr<SlowClients> again;
    std::string tries;
    REQUIRE_WITHIN(c, 30s, "a batch of 8 held open for a second: " << tries, [&] {
      // The last try's clients go first: left open they would hold every slot without a
      // ticket, and this try would be refused whole.
      if (again) {
        again.reset();
        std::this_thread::sleep_for(300ms);  // their workers see the end of stream
      }
      again = std::make_unique<SlowClients>(fetch_port, 8, 2s);
      std::this_thread::sleep_for(1s);  // accepted, their workers reading
      tries += std::to_string(again->Unconnected()) + " could not connect, " + std::to_string(again->Closed()) +
               " found closed (" + again->Why() + "); ";
      return again->Closed() == 0;
    }());
    // A stop closes them at once: it waits neither for their deadline nor their bytes.
    const auto stop_began = std::chrono::steady_clock::now();
    CHECK(c.node(0).Stop() == 0);
    const auto stop_took = std::chrono::steady_clock::now() - stop_began;
    INFO("the stop took " << std::chrono::duration_cast<std::chrono::milliseconds>(stop_took).count() << " ms\n"
                          << c.node(0).Log());
    CHECK(stop_took < 5s);
    CHECK(Contains(c.node(0).Log(), "stopping, 8 open connection(s) closed"));
    REQUIRE_WITHIN(c, 5s, "every slow connection closed by the stop", again->Closed() == again->size());
  }
}

TEST_CASE("2+1 on four daemons: a node lost for good restores its ranks bit-exactly from its peers' memory") {
  Cluster c({{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  c.extra_flags = {"--replication", "2+1"};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  {
    json g = Status(c.node(2))["group"];
    CHECK(g.value("replication", "") == "2+1");
    CHECK(g["replica_holders"].size() == 2);  // k + m - 1 peers hold a fragment each
    CHECK(g.value("placement_warning", "x").empty());
  }
  c.SaveAllCommitted(10);
  REQUIRE_WITHIN(c, 20s, "step 10 replicated by every node\n" << Replications(c, 10), AllReplicated(c, 10));
  c.SaveAllCommitted(20);
  REQUIRE_WITHIN(c, 20s, "step 20 replicated by every node\n" << Replications(c, 20), AllReplicated(c, 20));
  // The newer step replaced the older in the peers' memory once every holder sealed it (the
  // owner's release follows "replicated"); `list` names the tier.
  REQUIRE_WITHIN(c, 10s, "every holder keeps step 20 alone", [&] {
    for (int n = 0; n < c.num_nodes(); ++n) {
      for (int owner = 0; owner < c.num_nodes(); ++owner) {
        std::vector<uint64_t> held = SealedHeld(c.node(n), owner);
        if (!held.empty() && held != std::vector<uint64_t>{20}) return false;
      }
    }
    return true;
  }());
  {
    json l = json::parse(c.node(2).Ctl({"--json", "list"}).out, nullptr, false);
    REQUIRE_FALSE(l.is_discarded());
    std::map<uint64_t, std::vector<std::string>> tiers;
    for (const json& e : l["checkpoints"]) tiers[U64(e["step"])] = e["tiers"].get<std::vector<std::string>>();
    CHECK(tiers[20] == std::vector<std::string>{"memory", "replicated", "local"});
    CHECK(tiers[10] == std::vector<std::string>{"local"});
  }

  LoseAndReplace(c, {2});
  CHECK(SealedHeld(c.node(2), 0).empty());  // what it held for its peers went with it
  c.RestoreAll(20, {"memory", "memory", "peer", "memory"});
  // Served from the peers' memory: nothing on node 2's disk could have.
  CHECK_FALSE(fs::exists(c.StepDir(2, 20)));
  CHECK(Contains(c.node(2).Log(), "rebuilt"));
  CHECK(Contains(c.Metrics(2), "ckptd_restore_seconds_count{tier=\"peer\"} 2\n"));

  // The group healed: the next step commits and replicates everywhere, the replacement's
  // fragments included.
  c.SaveAllCommitted(30);
  REQUIRE_WITHIN(c, 20s, "step 30 replicated by every node after the replacement", AllReplicated(c, 30));
}

// Node n's replication of step `step` of job "g": the fragments' bytes it sent (every
// holder's), as `ckptctl status` gives them.
uint64_t BytesSent(Daemon& d, uint64_t step) {
  json s = Status(d);
  for (const json& j : s.value("jobs", json::array())) {
    if (j.value("job", "") != "g" || !j.contains("replication")) continue;
    for (const json& r : j["replication"]) {
      if (U64(r["step"]) == step && r.contains("bytes_sent")) return U64(r["bytes_sent"]);
    }
  }
  return 0;
}

// A counter's value on node n's metrics endpoint (0 when it is not there).
double Counter(Cluster& c, int n, const std::string& name) {
  std::istringstream text(c.Metrics(n));
  for (std::string line; std::getline(text, line);) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return 0;
}

TEST_CASE("2+1: a trainer that changes a small part of its state sends the next step as a patch, and a node lost for "
          "good restores that step bit-exactly from its peers") {
  Cluster c({{0}, {1}, {2}});
  c.extra_flags = {"--replication", "2+1"};
  // Fragments of about 4 MiB: 16 column chunks of 256 KiB, two gRPC messages each.
  constexpr uint64_t kRankBytes = 8 << 20;
  c.bytes = kRankBytes;
  // Each send of a fragment has --step-timeout, stretched under the sanitizers.
  c.step_timeout = std::to_string(30 * kSanitizerSlowdown) + "s";
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  // One session per rank saves step 10, then, once the test says so, step 20 (a new session
  // is a new run, whose first step goes whole). Their tensors hold the seed's pattern but for
  // model.a's first 4 KiB, which hold the step number (trainer_helper --changed-bytes): a
  // fine-tune that changes a small part of its state.
  const std::string go_on = c.shared().path() + "/go-on";
  std::vector<std::unique_ptr<Process>> savers;
  for (uint32_t r = 0; r < 3; ++r) {
    std::vector<std::string> args = c.RankArgs(r, 10);
    args.insert(args.end(), {"save-steps", "--steps-list", "10,20", "--changed-bytes", "4096", "--then-wait-for", go_on});
    savers.push_back(std::make_unique<Process>(Helper(c.node(static_cast<int>(r)), args),
                                               c.dir(static_cast<int>(r)).path(), "save" + std::to_string(r)));
  }
  REQUIRE_WITHIN(c, 60s, "step 10 committed by every rank", [&] {
    for (auto& p : savers) {
      if (!Contains(p->Stdout(), "committed 10")) return false;
    }
    return true;
  }());
  REQUIRE_WITHIN(c, 30s, "step 10 replicated by every node\n" << Replications(c, 10), AllReplicated(c, 10));
  // The holders hold step 10 alone (released) before step 20 goes: it is sent as a patch of it.
  std::string held;  // what each holder held sealed at the last look
  REQUIRE_WITHIN(c, 30s, "every holder keeps step 10 alone: " << held, [&] {
    held.clear();
    bool alone = true;
    for (int n = 0; n < 3; ++n) {
      for (int owner = 0; owner < 3; ++owner) {
        if (owner == n) continue;
        const std::vector<uint64_t> steps = SealedHeld(c.node(n), owner);
        held += "node " + std::to_string(n) + " of node " + std::to_string(owner) + ": [" + Joined(steps) + "]; ";
        alone = alone && steps == std::vector<uint64_t>{10};
      }
    }
    return alone;
  }());
  std::vector<double> unchanged_before;
  for (int n = 0; n < 3; ++n) unchanged_before.push_back(Counter(c, n, "ckptd_replication_unchanged_bytes_total"));
  std::ofstream(go_on).put('x');
  for (auto& p : savers) {
    int rc = p->Wait(kProcessBound);
    INFO(p->Stdout() << p->Stderr() << c.Logs());
    REQUIRE(rc == 0);
    REQUIRE(Contains(p->Stdout(), "committed 20"));
  }
  REQUIRE_WITHIN(c, 30s, "step 20 replicated by every node\n" << Replications(c, 20), AllReplicated(c, 20));
  for (int n = 0; n < 3; ++n) {
    const uint64_t first = BytesSent(c.node(n), 10), second = BytesSent(c.node(n), 20);
    INFO("node " << n << ": step 10 sent " << first << " bytes, step 20 " << second << "\n" << Replications(c, 20));
    CHECK(first >= kRankBytes);  // two holders, a fragment of half the shard each
    CHECK(second > 0);
    CHECK(second * 8 < first);
    const double unchanged = Counter(c, n, "ckptd_replication_unchanged_bytes_total") - unchanged_before[n];
    CHECK(unchanged + static_cast<double>(second) == static_cast<double>(first));
    CHECK(Counter(c, n, "ckptd_replication_sent_bytes_total") == static_cast<double>(first + second));
  }
  REQUIRE_WITHIN(c, 10s, "every holder keeps step 20 alone", [&] {
    for (int n = 0; n < 3; ++n) {
      for (int owner = 0; owner < 3; ++owner) {
        if (owner != n && SealedHeld(c.node(n), owner) != std::vector<uint64_t>{20}) return false;
      }
    }
    return true;
  }());

  LoseAndReplace(c, {1});
  std::vector<std::unique_ptr<Process>> procs;
  for (uint32_t r = 0; r < 3; ++r) {
    std::vector<std::string> args = c.RankArgs(r, 10);
    args.insert(args.end(), {"check", "--changed-bytes", "4096"});
    procs.push_back(std::make_unique<Process>(Helper(c.node(static_cast<int>(r)), args),
                                              c.dir(static_cast<int>(r)).path(), "check" + std::to_string(r)));
  }
  for (uint32_t r = 0; r < 3; ++r) {
    int rc = procs[r]->Wait(kProcessBound);
    INFO("rank " << r << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(procs[r]->Stdout(), std::string("restored step=20 source=") + (r == 1 ? "peer" : "memory")));
    CHECK(Contains(procs[r]->Stdout(), "match"));
  }
  CHECK_FALSE(fs::exists(c.StepDir(1, 20)));
}

TEST_CASE("4+2 on six daemons: two nodes lost at once restore from the four left; a damaged fragment is passed over") {
  Cluster c({{0}, {1}, {2}, {3}, {4}, {5}});
  c.extra_flags = {"--replication", "4+2"};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);
  REQUIRE_WITHIN(c, 20s, "step 10 replicated by every node\n" << Replications(c, 10), AllReplicated(c, 10));
  // Each lost node's 5 holders lost one with the other node: exactly k = 4 are left.
  LoseAndReplace(c, {1, 3});
  c.RestoreAll(10, {"memory", "peer", "memory", "peer", "memory", "memory"});

  // Node 5 comes back serving every fragment with a byte flipped (what it held went with
  // the restart: step 20 replicates to it afresh).
  REQUIRE(c.node(5).Stop() == 0);
  ::setenv("CKPTD_FAULT", "corrupt-served-fragments", 1);
  c.Start(5);
  ::unsetenv("CKPTD_FAULT");
  REQUIRE_WITHIN(c, kJoinBound, "node 5 rejoined", c.AllAlive());
  // A send to its old address would leave step 20 incomplete, rightly (the next replicates).
  REQUIRE_WITHIN(c, kJoinBound, "every node heard node 5's new address", EveryNodeHeard(c, 5));
  c.SaveAllCommitted(20);
  REQUIRE_WITHIN(c, 20s, "step 20 replicated by every node\n" << Replications(c, 20), AllReplicated(c, 20));
  // Node 2's holders are 3, 4, 5, 0 and 1, asked k at a time in that order: node 5's
  // fragment fails its checksum, and node 1's is fetched instead.
  LoseAndReplace(c, {2});
  c.RestoreAll(20, {"memory", "memory", "peer", "memory", "memory", "memory"});
  CHECK(Contains(c.node(2).Log(), "fragment from node 5 not usable"));
}

TEST_CASE("a peer that stops answering: the step commits anyway, is reported incomplete, the older replicas serve") {
  Cluster c({{0}, {1}, {2}, {3}});
  c.extra_flags = {"--replication", "2+1"};
  const std::string stall = c.shared().path() + "/stall";
  ::setenv("CKPTD_FAULT", ("stall-replicas-while:" + stall).c_str(), 1);
  c.Start(3);
  ::unsetenv("CKPTD_FAULT");
  for (int n = 0; n < 3; ++n) c.Start(n);
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);
  REQUIRE_WITHIN(c, 20s, "step 10 replicated by every node\n" << Replications(c, 10), AllReplicated(c, 10));

  // Node 3's Replicas service goes silent (its group service still answers). Nodes 1 and 2
  // send a fragment each to it (holders are the next two nodes of the group of four).
  WriteFile(stall, "");
  const auto started = std::chrono::steady_clock::now();
  c.SaveAllCommitted(20);  // every rank hears "committed": the commit does not wait
  CHECK(std::chrono::steady_clock::now() - started < kStepTimeout);
  for (int n = 0; n < c.num_nodes(); ++n) {
    REQUIRE_WITHIN(c, 30s, "node " << n << " settles step 20",
                   Replication(c.node(n), 20) == "replicated" || Replication(c.node(n), 20) == "incomplete");
    std::string why;
    const std::string state = Replication(c.node(n), 20, &why);
    INFO("node " << n << ": " << state << " " << why);
    CHECK(state == (n == 1 || n == 2 ? "incomplete" : "replicated"));
    if (state == "incomplete") CHECK(Contains(why, "node 3"));
  }
  // Node 1's holders kept its step 10 and dropped what they got of 20.
  CHECK(SealedHeld(c.node(2), 1) == std::vector<uint64_t>{10});
  CHECK(SealedHeld(c.node(3), 1) == std::vector<uint64_t>{10});

  // Node 1 lost now: every rank agrees on step 10, the newest that node 1's ranks can reach.
  LoseAndReplace(c, {1});
  c.RestoreAll(10, {"disk", "peer", "disk", "disk"});

  // Node 3 answers again: the next step replicates everywhere.
  fs::remove(stall);
  c.SaveAllCommitted(30);
  REQUIRE_WITHIN(c, 30s, "step 30 replicated by every node once node 3 answers", AllReplicated(c, 30));
}

TEST_CASE("failure domains: coding groups span racks, so a whole rack lost restores from peers; status warns when they cannot") {
  SECTION("three racks of two nodes, 2+1: every group has one node per rack") {
    Cluster c({{0}, {1}, {2}, {3}, {4}, {5}});
    c.extra_flags = {"--replication", "2+1"};
    const std::vector<std::string> rack = {"rack-a", "rack-a", "rack-b", "rack-b", "rack-c", "rack-c"};
    for (int n = 0; n < 6; ++n) c.node_flags[n] = {"--failure-domain", rack[n]};
    c.StartAll();
    REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
    for (int n = 0; n < 6; ++n) {
      json g = Status(c.node(n))["group"];
      INFO("node " << n << ": " << g.dump());
      CHECK(g.value("placement_warning", "x").empty());
      CHECK(g.value("failure_domain", "") == rack[n]);
      REQUIRE(g["replica_holders"].size() == 2);
      std::set<std::string> racks = {rack[n]};
      for (const json& h : g["replica_holders"]) racks.insert(rack[h.get<int>()]);
      CHECK(racks.size() == 3);  // the owner and its two holders: three racks
    }
    c.SaveAllCommitted(10);
    REQUIRE_WITHIN(c, 20s, "step 10 replicated by every node\n" << Replications(c, 10), AllReplicated(c, 10));
    // Rack b goes: nodes 2 and 3, one member of each coding group.
    LoseAndReplace(c, {2, 3});
    c.RestoreAll(10, {"memory", "memory", "peer", "peer", "memory", "memory"});
  }
  SECTION("two racks for a group of four: status names the rack that holds two members") {
    Cluster c({{0}, {1}, {2}, {3}});
    c.extra_flags = {"--replication", "2+1"};
    for (int n = 0; n < 4; ++n) c.node_flags[n] = {"--failure-domain", n < 2 ? "rack-a" : "rack-b"};
    c.StartAll();
    REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
    REQUIRE_WITHIN(c, 10s, "node 3 heard every member's domain",
                   !Status(c.node(3))["group"].value("placement_warning", "").empty());
    const std::string warning = Status(c.node(3))["group"].value("placement_warning", "");
    CHECK(Contains(warning, "failure domain"));
    CHECK(Contains(warning, "rack-"));
    CHECK(Contains(c.node(3).Ctl({"status"}).out, "WARNING: " + warning));
  }
}

TEST_CASE("a user who takes a lost node's job name first is refused: the owner's ranks restore from their peers") {
  REQUIRE(::geteuid() == 0);  // the suite runs as root so that it can be other users
  Cluster c({{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  c.extra_flags = {"--replication", "2+1", "--allow-uid", "1001", "--allow-uid", "1002"};
  c.trainer_uid = 1001;  // job "g" is uid 1001's
  c.StartAll();
  for (int n = 0; n < c.num_nodes(); ++n) c.OpenToUsers(n);
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  c.SaveAllCommitted(10);
  REQUIRE_WITHIN(c, 20s, "step 10 replicated by every node\n" << Replications(c, 10), AllReplicated(c, 10));
  LoseAndReplace(c, {2});
  c.OpenToUsers(2);
  // On the empty replacement another user registers "g" first: the node asks its peers whose
  // the job is before it lets anyone claim the name, and refuses, naming the owner and why.
  auto squat = [&](std::vector<std::string> command) {
    std::vector<std::string> args = c.RankArgs(4, 10);
    args[1] = "1002";  // --as-uid
    args.insert(args.end(), command.begin(), command.end());
    Process p(Helper(c.node(2), args), c.dir(2).path(), "squat");
    const int rc = p.Wait(kProcessBound);
    return std::pair{rc, p.Stdout() + p.Stderr()};
  };
  for (const auto& command : {std::vector<std::string>{"save", "--step", "11", "--wait-committed"},
                              std::vector<std::string>{"check", "--step", "10"}}) {
    auto [rc, out] = squat(command);
    INFO(out << c.Logs());
    CHECK(rc != 0);
    CHECK(Contains(out, "job g belongs to uid 1001"));
    CHECK(Contains(out, "uid 1002"));
    CHECK(Contains(out, "owner record of the job says so"));
    CHECK_FALSE(Contains(out, "source=peer"));
  }
  CHECK_FALSE(fs::exists(c.dir(2).path() + "/root/g/.owner"));  // the squatter claimed nothing
  CHECK_FALSE(Contains(c.node(2).Log(), "rebuilt"));
  // The owner's ranks all restore step 10, node 2's from its peers' memory, and the job's
  // record on the replacement names its owner.
  c.RestoreAll(10, {"memory", "memory", "peer", "memory"});
  CHECK(Contains(ReadFile(c.dir(2).path() + "/root/g/.owner"), "\"uid\":1001"));
  c.SaveAllCommitted(20);
}

TEST_CASE("2+1 on three one-rank nodes: a node lost just after its trainers finished restores their newest step from "
          "its peers, every time") {
  // The scenario of a review that failed 2 runs in 7: trainers that save every 5 steps to
  // step 40 and exit, node 2 lost with its disk at once and replaced empty, the trainers
  // resumed. Repeated (CKPTD_REPLICA_LOSS_RUNS, default 8, 4 under sanitizers) to catch a
  // 1-in-4 failure.
  // Half as many under a sanitizer, where each run costs four times as long (the plain build
  // still runs all 8).
  const char* runs_env = std::getenv("CKPTD_REPLICA_LOSS_RUNS");
  const int runs = runs_env != nullptr ? std::atoi(runs_env) : (kSanitizerSlowdown > 1 ? 4 : 8);
  for (int run = 0; run < runs; ++run) {
    INFO("run " << run + 1 << " of " << runs);
    Cluster c({{0}, {1}, {2}});
    c.extra_flags = {"--replication", "2+1"};
    c.StartAll();
    REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
    auto trainers = [&](bool resume) {
      std::vector<std::unique_ptr<Process>> procs;
      for (uint32_t r = 0; r < 3; ++r) {
        std::vector<std::string> args = {"--job", "g", "--rank", std::to_string(r), "--world-size", "3",
                                         "--steps", "40", "--save-every", "5", "--state-bytes", "400000",
                                         "--step-sleep-ms", "5"};
        if (resume) args.push_back("--resume");
        procs.push_back(std::make_unique<Process>(Trainer(c.node(static_cast<int>(r)), args),
                                                  c.dir(static_cast<int>(r)).path(),
                                                  (resume ? "resume" : "train") + std::to_string(r)));
      }
      std::vector<std::string> outputs;
      for (auto& p : procs) {
        int rc = p->Wait(kProcessBound);
        INFO(p->Stdout() << p->Stderr() << c.Logs());
        REQUIRE(rc == 0);
        outputs.push_back(p->Stdout());
      }
      return outputs;
    };
    std::vector<std::string> first = trainers(false);
    // Its machine is lost as soon as its peers hold its newest step: the seal follows the
    // step's commit, which ends the trainers, by milliseconds, but by seconds under TSan on a
    // loaded machine (a node lost before then restores the newest step its peers hold).
    REQUIRE_WITHIN(c, 60s, "node 2's step 40 sealed at both its holders",
                   SealedHeld(c.node(0), 2) == std::vector<uint64_t>{40} &&
                       SealedHeld(c.node(1), 2) == std::vector<uint64_t>{40});
    // What node 2's peers hold sealed of it when its machine is lost.
    INFO("when node 2 was lost: node 0 held its sealed steps " << Joined(SealedHeld(c.node(0), 2)) << "; node 1 "
                                                             << Joined(SealedHeld(c.node(1), 2)) << "\n"
                                                             << Replications(c, 40));
    c.Lose(2);
    c.Start(2);  // empty; the trainers resume at once, without waiting for the group to settle
    std::vector<std::string> resumed = trainers(true);
    INFO(c.Logs());
    for (uint32_t r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << resumed[r]);
      CHECK(Contains(resumed[r], r == 2 ? "resumed step=40 source=peer" : "resumed step=40 source=memory"));
      CHECK(Field(resumed[r], "checksum") == Field(first[r], "checksum"));
    }
  }
}

// --increments on with peer replicas (issue 48, step 7). Each rank's trainer saves a run of
// steps in one session, so that steps after the first write only model.a's changed first
// bytes and reference the rest (and, with `frozen`, fill optim.c from the previous snapshot
// instead of copying it from the trainer). Peers hold each step's staged snapshot whole,
// sealed with a manifest of the snapshot, so a node lost for good restores its newest step,
// an increment, bit-exactly from them; its replacement has none of the files that step
// references, so its next step is written whole, and the steps after reference that one.
namespace {

const std::string kChangedBytes = "4096";

void WithIncrementsAndReplicas(Cluster& c, const std::string& code) {
  c.bytes = 4'000'000;  // model.a half of it, in chunks of 64 KiB
  c.extra_flags = {"--replication", code, "--increments", "on", "--increment-chunk-bytes", "64K",
                   "--full-every", "100", "--keep-last", "3"};
}

std::vector<std::string> TrainerArgs(Cluster& c, uint32_t rank, bool frozen) {
  std::vector<std::string> args = c.RankArgs(rank, 1);
  if (frozen) args.insert(args.end(), {"--frozen", "optim.c"});
  return args;
}

// Every rank's trainer, one session each, saving `steps` ("10,20,30") and waiting for each to
// commit, after restoring the newest step when `restore_first`; all must succeed.
void SaveSteps(Cluster& c, const std::string& steps, bool frozen, bool restore_first = false) {
  std::vector<std::unique_ptr<Process>> procs;
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int n = c.NodeOf(r);
    std::vector<std::string> args = TrainerArgs(c, r, frozen);
    args.insert(args.end(), {"save-steps", "--steps-list", steps, "--changed-bytes", kChangedBytes});
    if (restore_first) args.push_back("--restore-first");
    procs.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(),
                                              "steps-" + steps + "-r" + std::to_string(r)));
  }
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int rc = procs[r]->Wait(kProcessBound);
    INFO("rank " << r << " saving " << steps << ": " << procs[r]->Stdout() << procs[r]->Stderr() << c.Logs());
    REQUIRE(rc == 0);
  }
}

// Every rank restores at once and checks every byte (model.a's first bytes hold the step's
// number); `source[n]` is what node n's ranks must report.
void RestoreChecked(Cluster& c, uint64_t step, const std::vector<std::string>& source, bool frozen) {
  std::vector<std::unique_ptr<Process>> procs;
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int n = c.NodeOf(r);
    std::vector<std::string> args = TrainerArgs(c, r, frozen);
    args.insert(args.end(), {"check", "--changed-bytes", kChangedBytes});
    procs.push_back(std::make_unique<Process>(Helper(c.node(n), args), c.dir(n).path(), "check-r" + std::to_string(r)));
  }
  for (uint32_t r = 0; r < c.world_size(); ++r) {
    const int rc = procs[r]->Wait(kProcessBound);
    INFO("rank " << r << " restoring step " << step << " from " << source[c.NodeOf(r)] << ": " << procs[r]->Stdout()
                 << procs[r]->Stderr() << c.Logs());
    CHECK(rc == 0);
    CHECK(Contains(procs[r]->Stdout(), "restored step=" + std::to_string(step) + " source=" + source[c.NodeOf(r)]));
    CHECK(Contains(procs[r]->Stdout(), "match"));
  }
}

json NodeManifest(Cluster& c, int n, uint64_t step) {
  json m = json::parse(ReadFile(c.StepDir(n, step) + "/manifest.json"), nullptr, false);
  REQUIRE_FALSE(m.is_discarded());
  return m;
}

// The steps whose files node n's manifest of `step` references for `rank`.
std::set<uint64_t> ReferencedSteps(Cluster& c, int n, uint64_t step, uint32_t rank) {
  std::set<uint64_t> steps;
  json m = NodeManifest(c, n, step);
  if (!m.contains("increment")) return steps;
  for (const json& o : m["increment"]["origins"]) {
    if (o.value("rank", 0u) == rank) steps.insert(U64(o["step"]));
  }
  return steps;
}

// Node n's ckptd_frozen_skipped_bytes_total.
double FrozenSkippedBytes(Cluster& c, int n) {
  std::istringstream metrics(c.Metrics(n));
  for (std::string line; std::getline(metrics, line);) {
    const std::string name = "ckptd_frozen_skipped_bytes_total ";
    if (line.rfind(name, 0) == 0) return std::stod(line.substr(name.size()));
  }
  return -1;
}

void CheckVerifies(Cluster& c, int n, uint64_t step) {
  RunResult v = c.node(n).Ctl({"--job", "g", "verify", std::to_string(step)});
  INFO("ckptctl verify " << step << " on node " << n << ": " << v.out << v.err);
  CHECK(v.exit_code == 0);
}

}  // namespace

TEST_CASE("2+1 with --increments on: a node lost for good restores its newest increment, frozen tensor and all, "
          "bit-exactly from its peers; its replacement's next step is whole, later ones reference it") {
  Cluster c({{0, 1}, {2}, {3}});
  WithIncrementsAndReplicas(c, "2+1");
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  SaveSteps(c, "10,20,30", /*frozen=*/true);
  // Step 30 of node 1 (rank 2) is an increment: it references step 10, which wrote what
  // never changed (model.b, the frozen optim.c, most of model.a).
  {
    json m = NodeManifest(c, 1, 30);
    CHECK(m["format_version"] == 5);
    CHECK(U64(m["increment"]["referenced_bytes"]) > 0);
    CHECK(ReferencedSteps(c, 1, 30, 2) == std::set<uint64_t>{10});
  }
  REQUIRE_WITHIN(c, 20s, "step 30 replicated by every node\n" << Replications(c, 30), AllReplicated(c, 30));
  // Steps 20 and 30 took optim.c from the previous snapshot, not from the trainer: what the
  // peers hold of them was filled before they were told of it.
  CHECK(FrozenSkippedBytes(c, 1) > 0);

  LoseAndReplace(c, {1});
  RestoreChecked(c, 30, {"memory", "peer", "memory"}, /*frozen=*/true);
  CHECK_FALSE(fs::exists(c.StepDir(1, 30)));
  CHECK(Contains(c.node(1).Log(), "rebuilt"));

  // The replacement holds none of step 30's files, nor step 10's: its first step references
  // nothing, the next references that one; every node's steps verify and replicate.
  SaveSteps(c, "40,50", /*frozen=*/true, /*restore_first=*/true);
  CHECK(ReferencedSteps(c, 1, 40, 2).empty());
  CHECK(ReferencedSteps(c, 1, 50, 2) == std::set<uint64_t>{40});
  CHECK(ReferencedSteps(c, 2, 40, 3) == std::set<uint64_t>{10});  // restored from memory: a base
  for (int n = 0; n < c.num_nodes(); ++n) {
    CheckVerifies(c, n, 40);
    CheckVerifies(c, n, 50);
  }
  REQUIRE_WITHIN(c, 20s, "step 50 replicated by every node\n" << Replications(c, 50), AllReplicated(c, 50));
  // Restored from its own disk after a restart (no hot copy left), bit-exactly.
  REQUIRE(c.node(1).Stop() == 0);
  c.Start(1);
  REQUIRE_WITHIN(c, kJoinBound, "node 1 rejoined", c.AllAlive());
  REQUIRE_WITHIN(c, kJoinBound, "every node heard node 1's new address", EveryNodeHeard(c, 1));
  RestoreChecked(c, 50, {"memory", "disk", "memory"}, /*frozen=*/true);
}

TEST_CASE("2+1 with --increments on: a node whose shard files were lost but not its manifests restores from its "
          "peers and bases nothing on the files it lacks") {
  Cluster c({{0}, {1}, {2}});
  WithIncrementsAndReplicas(c, "2+1");
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  SaveSteps(c, "10,20,30", /*frozen=*/false);
  REQUIRE_WITHIN(c, 20s, "step 30 replicated by every node\n" << Replications(c, 30), AllReplicated(c, 30));
  // Node 1 restarts with every shard file of its root gone, the manifests left.
  c.node(1).Kill();
  int removed = 0;
  for (const auto& e : fs::recursive_directory_iterator(c.dir(1).path() + "/root/g")) {
    if (e.path().extension() == ".safetensors") removed += fs::remove(e.path()) ? 1 : 0;
  }
  REQUIRE(removed >= 3);
  REQUIRE(fs::exists(c.StepDir(1, 30) + "/manifest.json"));
  c.Start(1);
  REQUIRE_WITHIN(c, kJoinBound, "node 1 rejoined", c.AllAlive());
  REQUIRE_WITHIN(c, kJoinBound, "every node heard node 1's new address", EveryNodeHeard(c, 1));
  RestoreChecked(c, 30, {"memory", "peer", "memory"}, /*frozen=*/false);
  // Its manifest of step 30 says where rank 1's bytes were; none of those files is there. The
  // step it saves next references nothing, and verifies.
  SaveSteps(c, "40", /*frozen=*/false, /*restore_first=*/true);
  CHECK(ReferencedSteps(c, 1, 40, 1).empty());
  CheckVerifies(c, 1, 40);
  RestoreChecked(c, 40, {"memory", "memory", "memory"}, /*frozen=*/false);
}

TEST_CASE("4+2 with --increments on: two nodes lost at once restore their newest increment from the four left") {
  Cluster c({{0}, {1}, {2}, {3}, {4}, {5}});
  WithIncrementsAndReplicas(c, "4+2");
  c.bytes = 1'000'000;
  c.metrics_everywhere = false;
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every node joined and alive", c.AllAlive());
  SaveSteps(c, "10,20", /*frozen=*/false);
  CHECK(ReferencedSteps(c, 3, 20, 3) == std::set<uint64_t>{10});
  REQUIRE_WITHIN(c, 20s, "step 20 replicated by every node\n" << Replications(c, 20), AllReplicated(c, 20));
  LoseAndReplace(c, {1, 3});
  RestoreChecked(c, 20, {"memory", "peer", "memory", "peer", "memory", "memory"}, /*frozen=*/false);
  SaveSteps(c, "30", /*frozen=*/false, /*restore_first=*/true);
  CHECK(ReferencedSteps(c, 3, 30, 3).empty());
  CheckVerifies(c, 3, 30);
}
