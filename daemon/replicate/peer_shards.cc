#include "daemon/replicate/peer_shards.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/status.h"
#include "daemon/replicate/shard_fragments.h"

namespace ckpt::replicate {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kControl); }

}  // namespace

std::vector<std::pair<Holder, uint32_t>> PeerShards::LiveHolders() const {
  std::vector<std::pair<Holder, uint32_t>> live;
  absl::StatusOr<std::vector<Holder>> holders = peers_.Holders(peers_.options().self);
  if (!holders.ok()) return live;
  for (uint32_t i = 0; i < holders->size(); ++i) {
    if ((*holders)[i].alive) live.emplace_back((*holders)[i], i);
  }
  return live;
}

std::vector<std::pair<uint64_t, uint64_t>> PeerShards::Steps(const std::string& job, uint32_t rank) {
  const std::vector<std::pair<Holder, uint32_t>> live = LiveHolders();
  std::vector<absl::StatusOr<std::vector<HeldStep>>> lists(live.size(), absl::UnknownError("not asked"));
  std::vector<std::thread> calls;
  for (size_t i = 0; i < live.size(); ++i) {
    calls.emplace_back([&, i] { lists[i] = peers_.Client(live[i].first.address).List(job, peers_.options().self); });
  }
  for (std::thread& t : calls) t.join();
  // Per step: its run, and the distinct fragments of `rank` that sealed holders have.
  std::map<uint64_t, std::pair<uint64_t, std::set<uint32_t>>> held;
  for (size_t i = 0; i < live.size(); ++i) {
    if (!lists[i].ok()) {
      Log().warn("[{}/r{}] node {} cannot list the fragments it holds: {}", job, rank, live[i].first.node,
                 Message(lists[i].status()));
      continue;
    }
    for (const HeldStep& s : *lists[i]) {
      if (!s.sealed || s.k != static_cast<uint32_t>(k_)) continue;
      auto& [run, indices] = held[s.step];
      run = s.run;
      for (const auto& [r, index] : s.pieces) {
        if (r == rank) indices.insert(index);
      }
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> steps;
  for (const auto& [step, entry] : held) {
    if (entry.second.size() >= static_cast<size_t>(k_)) steps.emplace_back(entry.first, step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<std::string> PeerShards::Manifest(const std::string& job, uint64_t step) {
  std::vector<std::string> why;
  for (const auto& [holder, index] : LiveHolders()) {
    absl::StatusOr<std::string> text = peers_.Client(holder.address).GetManifest(job, step, peers_.options().self);
    if (text.ok()) return text;
    why.push_back(fmt::format("node {}: {}", holder.node, Message(text.status())));
  }
  return absl::NotFoundError(fmt::format("no peer holds this node's manifest of job {} step {} ({})", job, step,
                                         why.empty() ? "no peer of its coding group is alive" : fmt::format("{}", fmt::join(why, "; "))));
}

absl::StatusOr<std::string> PeerShards::Shard(const std::string& job, uint64_t step, uint32_t rank) {
  const auto started = std::chrono::steady_clock::now();
  const std::vector<std::pair<Holder, uint32_t>> live = LiveHolders();
  std::vector<std::shared_ptr<const HeldFragment>> good;
  std::vector<std::string> why;
  std::vector<uint32_t> from;
  // k at a time from the holders not yet asked, until k are good or none is left.
  size_t next = 0;
  while (good.size() < static_cast<size_t>(k_) && next < live.size()) {
    const size_t wave = std::min(live.size() - next, static_cast<size_t>(k_) - good.size());
    std::vector<absl::StatusOr<HeldFragment>> got(wave, absl::UnknownError("not asked"));
    std::vector<std::thread> calls;
    for (size_t i = 0; i < wave; ++i) {
      const auto& [holder, index] = live[next + i];
      calls.emplace_back([&, i, address = holder.address, index = index] {
        got[i] = peers_.Client(address).Get({job, step, peers_.options().self, rank, index});
      });
    }
    for (std::thread& t : calls) t.join();
    for (size_t i = 0; i < wave; ++i) {
      const Holder& holder = live[next + i].first;
      if (got[i].ok()) {
        good.push_back(std::make_shared<const HeldFragment>(*std::move(got[i])));
        from.push_back(holder.node);
      } else {
        why.push_back(fmt::format("node {}: {}", holder.node, Message(got[i].status())));
        Log().warn("[{}/r{} s{}] fragment from node {} not usable: {}", job, rank, step, holder.node,
                   Message(got[i].status()));
      }
    }
    next += wave;
  }
  if (good.size() < static_cast<size_t>(k_)) {
    return absl::DataLossError(fmt::format(
        "rank {}'s shard of step {} cannot be rebuilt from peers: {} of the {} fragments needed could be had ({})",
        rank, step, good.size(), k_, why.empty() ? "no peer of the coding group is alive" : fmt::format("{}", fmt::join(why, "; "))));
  }
  absl::StatusOr<std::string> shard = RebuildShard(good, threads_);
  if (shard.ok()) {
    Log().info("[{}/r{} s{}] rebuilt {} bytes from fragments of nodes {} in {:.1f} ms", job, rank, step, shard->size(),
               fmt::join(from, ","),
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
  }
  return shard;
}

}  // namespace ckpt::replicate
