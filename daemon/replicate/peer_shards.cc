#include "daemon/replicate/peer_shards.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/status.h"
#include "daemon/replicate/shard_fragments.h"

namespace ckpt::replicate {
namespace {

// Peers asked at once when every live member is (a thread each).
constexpr size_t kAskedAtOnce = 32;

spdlog::logger& Log() { return log::Get(log::Component::kControl); }

// Runs `calls[i]()` for every i on threads of their own, at most `at_once` at a time. A call
// that throws (out of memory) fails alone, as a status, never the daemon.
void RunEach(size_t count, size_t at_once, const std::function<void(size_t)>& call,
             const std::function<void(size_t, const std::string&)>& failed) {
  for (size_t first = 0; first < count; first += at_once) {
    std::vector<std::thread> threads;
    for (size_t i = first; i < std::min(count, first + at_once); ++i) {
      threads.emplace_back([&, i] {
        try {
          call(i);
        } catch (const std::exception& e) {
          failed(i, e.what());
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
}

}  // namespace

void PeerShards::Ask(const std::vector<Holder>& peers, const std::string& job, uid_t uid, Survey& survey) {
  std::vector<absl::StatusOr<std::vector<HeldStep>>> lists(peers.size(), absl::UnknownError("not asked"));
  RunEach(
      peers.size(), kAskedAtOnce,
      [&](size_t i) { lists[i] = peers_.Client(peers[i].address).List(job, peers_.options().self); },
      [&](size_t i, const std::string& what) { lists[i] = absl::InternalError(what); });
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!lists[i].ok()) {
      survey.problems.push_back(fmt::format("node {}: {}", peers[i].node, Message(lists[i].status())));
      continue;
    }
    for (const HeldStep& s : *lists[i]) {
      // Only what this node sealed, with its code, for the very user who asks.
      if (!s.sealed || s.k != static_cast<uint32_t>(k_) || s.uid != uid) continue;
      auto& ranks = survey.steps[{s.run, s.step}];
      for (const auto& [rank, index] : s.pieces) ranks[rank].push_back({peers[i], index});
    }
  }
}

PeerShards::Survey PeerShards::Take(const std::string& job, uid_t uid) {
  Survey survey;
  std::vector<Holder> holders;
  if (absl::StatusOr<std::vector<Holder>> found = peers_.Holders(peers_.options().self); found.ok()) {
    for (const Holder& h : *found) {
      if (h.alive) holders.push_back(h);
    }
  }
  Ask(holders, job, uid, survey);
  if (survey.steps.empty()) {
    // The groups as this node computes them now may not be the ones its fragments went to.
    std::vector<Holder> others;
    for (const Holder& h : peers_.LiveMembers()) {
      if (std::none_of(holders.begin(), holders.end(), [&](const Holder& a) { return a.node == h.node; })) {
        others.push_back(h);
      }
    }
    Ask(others, job, uid, survey);
  }
  for (const std::string& p : survey.problems) Log().warn("[{}] peer replicas: {}", job, p);
  return survey;
}

const std::map<uint32_t, std::vector<PeerShards::Source>>* PeerShards::Newest(const Survey& survey, uint64_t step) {
  const std::map<uint32_t, std::vector<Source>>* newest = nullptr;
  for (const auto& [key, ranks] : survey.steps) {
    if (key.second == step) newest = &ranks;  // ascending by run: the last is the newest
  }
  return newest;
}

std::vector<std::pair<uint64_t, uint64_t>> PeerShards::Steps(const std::string& job, uint32_t rank, uid_t uid) {
  const Survey survey = Take(job, uid);
  std::vector<std::pair<uint64_t, uint64_t>> steps;
  for (const auto& [key, ranks] : survey.steps) {
    auto it = ranks.find(rank);
    if (it == ranks.end()) continue;
    std::set<uint32_t> indices;
    for (const Source& s : it->second) indices.insert(s.index);
    if (indices.size() >= static_cast<size_t>(k_)) steps.push_back(key);
  }
  return steps;
}

absl::StatusOr<std::string> PeerShards::Manifest(const std::string& job, uint64_t step, uid_t uid) {
  const Survey survey = Take(job, uid);
  const auto* ranks = Newest(survey, step);
  std::vector<std::string> why;
  std::set<uint32_t> asked;
  for (const auto& [rank, sources] : ranks ? *ranks : std::map<uint32_t, std::vector<Source>>{}) {
    for (const Source& s : sources) {
      if (!asked.insert(s.peer.node).second) continue;
      absl::StatusOr<std::string> text =
          peers_.Client(s.peer.address).GetManifest(job, step, peers_.options().self);
      if (text.ok()) return text;
      why.push_back(fmt::format("node {}: {}", s.peer.node, Message(text.status())));
    }
  }
  return absl::NotFoundError(fmt::format("no peer holds this node's manifest of job {} step {} ({})", job, step,
                                         why.empty() ? "no live peer holds the step sealed for this user"
                                                     : fmt::format("{}", fmt::join(why, "; "))));
}

absl::StatusOr<std::string> PeerShards::Shard(const std::string& job, uint64_t step, uint32_t rank, uid_t uid,
                                              uint64_t max_bytes) {
  const auto started = std::chrono::steady_clock::now();
  const Survey survey = Take(job, uid);
  std::vector<Source> sources;
  if (const auto* ranks = Newest(survey, step)) {
    if (auto it = ranks->find(rank); it != ranks->end()) sources = it->second;
  }
  std::vector<std::shared_ptr<const HeldFragment>> good;
  std::set<uint32_t> have;  // indices
  std::vector<std::string> why;
  std::vector<uint32_t> from;
  // k at a time from the sources not yet asked (one per index), until k are good or none is left.
  size_t next = 0;
  while (good.size() < static_cast<size_t>(k_) && next < sources.size()) {
    std::vector<Source> wave;
    for (; next < sources.size() && wave.size() + good.size() < static_cast<size_t>(k_); ++next) {
      const bool twice = have.count(sources[next].index) ||
                         std::any_of(wave.begin(), wave.end(), [&](const Source& w) { return w.index == sources[next].index; });
      if (!twice) wave.push_back(sources[next]);
    }
    std::vector<absl::StatusOr<HeldFragment>> got(wave.size(), absl::UnknownError("not asked"));
    RunEach(
        wave.size(), wave.size(),
        [&](size_t i) {
          got[i] = peers_.Client(wave[i].peer.address)
                       .Get({job, step, peers_.options().self, rank, wave[i].index}, static_cast<uint32_t>(k_),
                            max_bytes);
        },
        [&](size_t i, const std::string& what) { got[i] = absl::ResourceExhaustedError(what); });
    for (size_t i = 0; i < wave.size(); ++i) {
      if (got[i].ok()) {
        have.insert(wave[i].index);
        good.push_back(std::make_shared<const HeldFragment>(*std::move(got[i])));
        from.push_back(wave[i].peer.node);
      } else {
        why.push_back(fmt::format("node {}: {}", wave[i].peer.node, Message(got[i].status())));
        Log().warn("[{}/r{} s{}] fragment from node {} not usable: {}", job, rank, step, wave[i].peer.node,
                   Message(got[i].status()));
      }
    }
  }
  if (good.size() < static_cast<size_t>(k_)) {
    return absl::DataLossError(fmt::format(
        "rank {}'s shard of step {} cannot be rebuilt from peers: {} of the {} fragments needed could be had ({})",
        rank, step, good.size(), k_,
        why.empty() ? "no live peer holds them" : fmt::format("{}", fmt::join(why, "; "))));
  }
  const auto fetched = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> shard = RebuildShard(good, threads_);
  if (shard.ok()) {
    const auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
    Log().info("[{}/r{} s{}] rebuilt {} bytes from fragments of nodes {} in {:.1f} ms ({:.1f} ms fetching, {:.1f} ms "
               "decoding)",
               job, rank, step, shard->size(), fmt::join(from, ","), ms(std::chrono::steady_clock::now() - started),
               ms(fetched - started), ms(std::chrono::steady_clock::now() - fetched));
  }
  return shard;
}

}  // namespace ckpt::replicate
