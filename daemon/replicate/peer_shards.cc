#include "daemon/replicate/peer_shards.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>
#include <exception>
#include <functional>
#include <memory>
#include <set>
#include <thread>

#include "common/log.h"
#include "common/status.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fetch_channel.h"
#include "daemon/replicate/fragment_checksum.h"
#include "daemon/replicate/run_each.h"
#include "daemon/replicate/shard_fragments.h"
#include "format/checksum.h"

namespace ckpt::replicate {
namespace {

// Peers asked at once when every live member is (a thread each).
constexpr size_t kAskedAtOnce = 32;
// A peer that did not answer is asked this many times in all, the waits growing from this.
constexpr int kListAttempts = 4;
constexpr auto kListRetryDelay = std::chrono::milliseconds(200);
// A survey asks the holders that have not answered again this often, within its wait.
constexpr auto kSurveyRetry = std::chrono::milliseconds(250);

spdlog::logger& Log() { return log::Get(log::Component::kControl); }

}  // namespace

std::vector<bool> PeerShards::Ask(const std::vector<Holder>& peers, const std::string& job, uid_t uid,
                                  Survey& survey, std::vector<std::string>& problems) {
  std::vector<absl::StatusOr<std::vector<HeldStep>>> lists(peers.size(), absl::UnknownError("not asked"));
  std::vector<FetchGrant> grants(peers.size());
  const std::vector<absl::Status> asked = RunEach(peers.size(), kAskedAtOnce, [&](size_t i) {
    // A channel's first connection may fail once (a handshake cut short on a busy machine):
    // a peer is asked again before it counts as not answering.
    for (int attempt = 0;; ++attempt) {
      lists[i] = peers_.Client(peers[i].address).List(job, peers_.options().self, &grants[i]);
      if (lists[i].ok() || attempt + 1 >= kListAttempts ||
          !(absl::IsUnavailable(lists[i].status()) || absl::IsUnknown(lists[i].status()))) {
        return lists[i].status();
      }
      std::this_thread::sleep_for(kListRetryDelay * (attempt + 1));
    }
  });
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!asked[i].ok()) lists[i] = asked[i];  // threw before its list came
  }
  std::vector<bool> answered(peers.size(), false);
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!lists[i].ok()) {
      problems.push_back(fmt::format("node {}: {}", peers[i].node, Message(lists[i].status())));
      continue;
    }
    answered[i] = true;
    for (const HeldStep& s : *lists[i]) {
      // Only what this node sealed, with its code, for the very user who asks.
      if (!s.sealed || s.k != static_cast<uint32_t>(k_) || s.uid != uid) continue;
      auto& ranks = survey.steps[{s.run, s.step}];
      survey.m[{s.run, s.step}] = s.m;
      for (const auto& [rank, index] : s.pieces) ranks[rank].push_back({peers[i], index, grants[i]});
    }
  }
  return answered;
}

PeerShards::Survey PeerShards::Take(const std::string& job, uid_t uid) {
  const auto deadline = std::chrono::steady_clock::now() + survey_wait_;
  Survey survey;
  std::vector<Holder> holders;   // that answered
  std::set<uint32_t> answered;
  std::vector<std::string> problems;  // of the last round
  // Until every holder of this node's coding group answered, or the wait is over: a holder
  // this node's view does not know yet (a replacement that has just joined) or whose call
  // failed (a busy machine) is asked again; one the view knows to be lost is not waited for.
  for (bool first = true;; first = false) {
    if (!first) std::this_thread::sleep_for(kSurveyRetry);
    problems.clear();
    std::vector<Holder> ask;
    size_t waited_for = 0;
    if (absl::StatusOr<std::vector<Holder>> found = peers_.Holders(peers_.options().self); found.ok()) {
      for (const Holder& h : *found) {
        if (answered.count(h.node)) continue;
        if (h.alive) {
          ask.push_back(h);
        } else if (h.address.empty()) {
          ++waited_for;  // not known to this node yet
          problems.push_back(fmt::format("node {}: not yet known to this node's view of the group", h.node));
        }
      }
    } else {
      problems.push_back(Message(found.status()));
      ++waited_for;
    }
    const std::vector<bool> ok = Ask(ask, job, uid, survey, problems);
    for (size_t i = 0; i < ask.size(); ++i) {
      if (!ok[i]) continue;
      answered.insert(ask[i].node);
      holders.push_back(ask[i]);
    }
    const bool silent = waited_for > 0 || std::count(ok.begin(), ok.end(), false) > 0;
    if (!silent || std::chrono::steady_clock::now() + kSurveyRetry >= deadline) break;
  }
  survey.problems = std::move(problems);
  if (survey.steps.empty()) {
    // The groups as this node computes them now may not be the ones its fragments went to.
    std::vector<Holder> others;
    for (const Holder& h : peers_.LiveMembers()) {
      if (std::none_of(holders.begin(), holders.end(), [&](const Holder& a) { return a.node == h.node; })) {
        others.push_back(h);
      }
    }
    Ask(others, job, uid, survey, survey.problems);
  }
  for (const std::string& p : survey.problems) Log().warn("[{}] peer replicas: {}", job, p);
  return survey;
}

const std::map<uint32_t, std::vector<PeerShards::Source>>* PeerShards::Newest(const Survey& survey, uint64_t step,
                                                                             uint32_t* m) {
  const std::map<uint32_t, std::vector<Source>>* newest = nullptr;
  for (const auto& [key, ranks] : survey.steps) {
    if (key.second != step) continue;
    newest = &ranks;  // ascending by run: the last is the newest
    if (m != nullptr) *m = survey.m.at(key);
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

absl::StatusOr<daemon::ShardBytes> PeerShards::Shard(const std::string& job, uint64_t step, uint32_t rank, uid_t uid,
                                                     uint64_t max_bytes, const Allocate& allocate) {
  const auto started = std::chrono::steady_clock::now();
  const Survey survey = Take(job, uid);
  std::vector<Source> sources;
  uint32_t m = 0;
  if (const auto* ranks = Newest(survey, step, &m)) {
    if (auto it = ranks->find(rank); it != ranks->end()) sources = it->second;
  }
  // Data fragments first: k of them are the shard itself, received in place, no decoding.
  std::stable_sort(sources.begin(), sources.end(), [](const Source& a, const Source& b) { return a.index < b.index; });
  absl::StatusOr<ErasureCode> code = ErasureCode::Make(k_, static_cast<int>(std::max<uint32_t>(m, 1)));
  if (!code.ok()) return code.status();
  const uint32_t self = peers_.options().self;

  // Where fragments land: data fragment i at i * FragmentBytes in the shard (k of them make
  // it, padding included), parity in buffers of their own. Sized by the first header.
  std::mutex mu;
  std::shared_ptr<char> out;
  uint64_t data_bytes = 0;
  size_t fragment_bytes = 0;
  std::vector<std::unique_ptr<char[]>> parity;
  auto into = [&](const FragmentMeta& meta, uint32_t index) -> char* {
    std::lock_guard lock(mu);
    if (!out) {
      data_bytes = meta.data_bytes;
      fragment_bytes = ErasureCode::FragmentBytes(data_bytes, k_);
      const size_t bytes = std::max<size_t>(fragment_bytes * static_cast<size_t>(k_), 1);
      if (allocate) out = allocate(bytes);
      if (!out) out = std::shared_ptr<char>(new (std::nothrow) char[bytes], std::default_delete<char[]>());
      if (!out) return nullptr;
    }
    if (meta.data_bytes != data_bytes) return nullptr;  // not a fragment of the same shard
    if (index < static_cast<uint32_t>(k_)) return out.get() + static_cast<size_t>(index) * fragment_bytes;
    parity.emplace_back(new (std::nothrow) char[std::max<size_t>(fragment_bytes, 1)]);
    return parity.back().get();
  };

  struct Got {
    uint32_t index = 0;
    const char* bytes = nullptr;
    uint32_t node = 0;
  };
  std::vector<Got> good;
  std::set<uint32_t> have;  // indices
  std::vector<std::string> why;
  size_t next = 0;
  std::atomic<uint64_t> tcp{0};  // fragments that came over the fetch channel
  // k at a time from the sources not yet asked (one per index), until k are good or none is left.
  while (good.size() < static_cast<size_t>(k_) && next < sources.size()) {
    std::vector<Source> wave;
    for (; next < sources.size() && wave.size() + good.size() < static_cast<size_t>(k_); ++next) {
      const bool twice = have.count(sources[next].index) ||
                         std::any_of(wave.begin(), wave.end(), [&](const Source& w) { return w.index == sources[next].index; });
      if (!twice) wave.push_back(sources[next]);
    }
    std::vector<const char*> landed(wave.size(), nullptr);
    std::vector<std::string> checksum(wave.size());
    std::vector<absl::Status> status = RunEach(wave.size(), wave.size(), [&](size_t i) -> absl::Status {
      const Source& s = wave[i];
      const FragmentId id{job, step, self, rank, s.index};
      auto land = [&](const FragmentMeta& meta) {
        landed[i] = into(meta, s.index);
        checksum[i] = meta.checksum;
        return const_cast<char*>(landed[i]);
      };
      if (s.grant.port != 0) {
        // The fetch channel: straight from the peer's store into the shard.
        const std::string host = s.peer.address.substr(0, s.peer.address.rfind(':'));
        absl::StatusOr<FragmentMeta> meta = FetchFragment(host, s.grant.port, s.grant.ticket, id,
                                                          static_cast<uint32_t>(k_), max_bytes, land,
                                                          peers_.options().timeout);
        if (meta.ok()) ++tcp;
        if (meta.ok() || !absl::IsUnavailable(meta.status())) return meta.status();
      }
      // gRPC, where the channel is off (TLS) or did not answer.
      CKPT_ASSIGN_OR_RETURN(HeldFragment f, peers_.Client(s.peer.address).Get(id, static_cast<uint32_t>(k_), max_bytes));
      char* dst = land(f.meta);
      if (dst == nullptr || f.bytes.size() != ErasureCode::FragmentBytes(f.meta.data_bytes, k_)) {
        return absl::DataLossError("the fragment does not fit the shard");
      }
      std::memcpy(dst, f.bytes.data(), f.bytes.size());
      return absl::OkStatus();
    });
    for (size_t i = 0; i < wave.size(); ++i) {
      // Every fragment checked where it landed: a damaged one is passed over for the next.
      if (status[i].ok() && !ChecksumMatches(landed[i], fragment_bytes, checksum[i])) {
        status[i] = absl::DataLossError("its bytes do not match its checksum");
      }
      if (status[i].ok()) {
        have.insert(wave[i].index);
        good.push_back({wave[i].index, landed[i], wave[i].peer.node});
      } else {
        why.push_back(fmt::format("node {}: {}", wave[i].peer.node, Message(status[i])));
        Log().warn("[{}/r{} s{}] fragment from node {} not usable: {}", job, rank, step, wave[i].peer.node,
                   Message(status[i]));
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
  std::vector<FragmentView> views;
  std::vector<uint32_t> from;
  for (const Got& g : good) {
    views.push_back({static_cast<int>(g.index), {reinterpret_cast<const uint8_t*>(g.bytes), fragment_bytes}});
    from.push_back(g.node);
  }
  // Only parity among them needs arithmetic: data fragments already lie in place.
  CKPT_RETURN_IF_ERROR(code->Decode(views, {reinterpret_cast<uint8_t*>(out.get()), data_bytes}, threads_));
  const auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  Log().info("[{}/r{} s{}] rebuilt {} bytes from fragments of nodes {} ({} over the fetch channel) in {:.1f} ms "
             "({:.1f} ms fetching, {:.1f} ms decoding)",
             job, rank, step, data_bytes, fmt::join(from, ","), tcp.load(), ms(std::chrono::steady_clock::now() - started),
             ms(fetched - started), ms(std::chrono::steady_clock::now() - fetched));
  return daemon::ShardBytes{std::move(out), data_bytes};
}

}  // namespace ckpt::replicate
