// Shortcuts shared by the integration tests.
#pragma once

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "tests/integration/harness.h"

namespace ckpt::testing {

// A port that was free a moment ago (a group's coordinator port must survive its restarts),
// picked outside the kernel's ephemeral range: a port from a bind of port 0, once closed,
// can be handed out again at once to another bind of port 0 (a daemon's own group
// listener), and the daemon it was picked for then finds it taken ("cannot listen on
// 127.0.0.1:45313: Address already in use", in CI under TSan). The Python twin:
// tools/free_port.py (the Python tests and tools/ceph.sh).
inline int PickFreePort() {
  static std::mt19937 random{std::random_device{}()};
  int lo = 32768, hi = 60999;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> lo >> hi;
  const int first = lo > 11000 ? 10000 : hi + 1;
  const int last = lo > 11000 ? lo - 1 : 65535;
  REQUIRE(first < last);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = std::uniform_int_distribution<int>(first, last)(random);
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);  // free on every address a daemon may bind
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (free) return port;
  }
  FAIL("no free port in " << first << "-" << last);
  return 0;
}

// GET http://127.0.0.1:port/path (HTTP/1.0: the server closes after the answer); the whole
// answer, headers included, or "" when nothing answers.
inline std::string HttpGet(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET " + path + " HTTP/1.0\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
      char buf[65536];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) answer.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  return answer;
}

// The steps of `job` that `ckptctl list --json` shows.
inline std::set<uint64_t> ListedSteps(const Daemon& d, const std::string& job) {
  std::set<uint64_t> steps;
  auto listed = nlohmann::json::parse(d.Ctl({"--job", job, "--json", "list"}).out, nullptr, false);
  if (listed.is_discarded() || !listed.contains("checkpoints")) return steps;
  for (const auto& c : listed["checkpoints"]) steps.insert(c["step"].get<uint64_t>());
  return steps;
}

// ckptctl status --json of one daemon; an empty object when it does not answer.
inline nlohmann::json Status(const Daemon& d) {
  RunResult r = d.Ctl({"status", "--json"});
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  if (r.exit_code != 0 || j.is_discarded() || !j.is_object()) return nlohmann::json::object();
  return j;
}

// Proto JSON prints 64-bit integers as strings.
inline uint64_t U64(const nlohmann::json& v) {
  if (v.is_null()) return 0;
  if (v.is_number_unsigned() || v.is_number_integer()) return v.get<uint64_t>();
  if (v.is_string() && !v.get<std::string>().empty()) return std::stoull(v.get<std::string>());
  return 0;
}

inline std::vector<std::string> Helper(const Daemon& d, std::vector<std::string> args) {
  std::vector<std::string> argv = {Runfile("tests/integration/trainer_helper"), "--socket", d.socket()};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

inline std::vector<std::string> Trainer(const Daemon& d, std::vector<std::string> args) {
  std::vector<std::string> argv = {Runfile("client/example_trainer"), "--socket", d.socket()};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// The value after "key=" on the line of `text` that contains it.
inline std::string Field(const std::string& text, const std::string& key) {
  size_t at = text.find(key + "=");
  if (at == std::string::npos) return "";
  size_t start = at + key.size() + 1;
  size_t end = text.find_first_of(" \n", start);
  return text.substr(start, end - start);
}

// Rank `rank`'s shard file in a committed step directory, as the step's manifest names it:
// rank-00003.safetensors when written whole (--increments off), rank-00003.<run>.safetensors
// with increments (the default). Fails the test when the manifest lists no such rank.
inline std::string ShardPath(const std::string& step_dir, uint32_t rank) {
  std::ifstream in(step_dir + "/manifest.json");
  REQUIRE(in.good());
  const nlohmann::json manifest = nlohmann::json::parse(in);
  for (const nlohmann::json& shard : manifest.at("shards")) {
    if (shard.at("rank").get<uint32_t>() == rank) return step_dir + "/" + shard.at("file").get<std::string>();
  }
  FAIL("the manifest of " << step_dir << " lists no rank " << rank);
  return {};
}

inline bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Runs `world` ranks of tests/integration/reshard_helper at once (restores meet at a
// barrier); their outputs, by rank.
inline std::vector<RunResult> ReshardRanks(const Daemon& d, const TempDir& dir, uint32_t world,
                                           std::vector<std::string> args) {
  std::vector<std::unique_ptr<Process>> ranks;
  for (uint32_t r = 0; r < world; ++r) {
    std::vector<std::string> argv = {Runfile("tests/integration/reshard_helper"), "--socket", d.socket(),
                                     "--rank", std::to_string(r), "--world-size", std::to_string(world)};
    argv.insert(argv.end(), args.begin(), args.end());
    ranks.push_back(std::make_unique<Process>(argv, dir.path(), "w" + std::to_string(world) + "r" +
                                                                    std::to_string(r) + "." + args.back()));
  }
  // Every rank meets the others in Restore(): one that hangs is reported with what the
  // others printed and the daemon's log, which say where the barrier stands.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::any_of(ranks.begin(), ranks.end(), [](auto& p) { return p->Running(); }) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string stuck;
  for (uint32_t r = 0; r < world; ++r) {
    if (ranks[r]->Running()) stuck += " " + std::to_string(r);
  }
  if (!stuck.empty()) {
    std::string outputs;
    for (uint32_t r = 0; r < world; ++r) outputs += "rank " + std::to_string(r) + ": " + ranks[r]->Stdout() + "\n";
    const std::string log = d.Log();
    FAIL("ranks" << stuck << " of " << world << " did not finish in 60 s\n" << outputs << "daemon log (end):\n"
                 << log.substr(log.size() > 20000 ? log.size() - 20000 : 0));
  }
  std::vector<RunResult> out;
  for (auto& p : ranks) {
    int rc = p->Wait();
    out.push_back({rc, p->Stdout(), p->Stderr()});
  }
  return out;
}

}  // namespace ckpt::testing
