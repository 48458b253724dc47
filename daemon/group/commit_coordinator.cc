#include "daemon/group/commit_coordinator.h"

#include <cassert>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <pthread.h>

#include <algorithm>
#include <iterator>
#include <numeric>
#include <set>

#include "common/log.h"
#include "common/names.h"
#include "common/status.h"
#include "format/indexed_manifest.h"
#include "format/tiling.h"

namespace ckpt::group {
namespace {

// Whether a recorded manifest is an index (format version 4) rather than a whole manifest.
bool IsIndex(const std::string& text) {
  absl::StatusOr<format::Manifest> parsed = format::ParseManifest(text, "the decision log's manifest");
  return parsed.ok() && parsed->index.has_value();
}

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

constexpr size_t kRecentDecisions = 4096;
// How far apart the registrations of one run's ranks on different nodes may be, as far as an
// abort of a newer run's save of a committed step is concerned (Abort).
constexpr std::chrono::seconds kSameRunWindow{60};
// Node shares of the decisions kept, in all: at 10,000 nodes about 640 KB a decision.
constexpr size_t kRecentShareBytes = size_t{256} << 20;
// Steps undecided at once, over all jobs: far beyond what jobs keep in flight (one or two
// each), small enough that a peer opening rounds for made-up steps cannot exhaust memory.
constexpr size_t kMaxRounds = 4096;
// Ranks of the undecided steps, in all (each costs 4 bytes): 1M-rank jobs keep a few steps
// in flight, and a peer cannot make the coordinator hold gigabytes.
constexpr uint64_t kMaxRoundRanks = uint64_t{64} << 20;
// Structure checks remembered (CheckStructures), in all: a few per job.
constexpr size_t kStructureChecks = 64;

std::string Prefix(const std::string& job, uint64_t step) { return fmt::format("[{} s{}]", job, step); }

uint64_t UnixNanos() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

const char* OutcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::kUnknown: return "unknown";
    case Outcome::kPending: return "pending";
    case Outcome::kCommitted: return "committed";
    case Outcome::kAborted: return "aborted";
  }
  return "?";
}

CommitCoordinator::CommitCoordinator(DecisionLog& log, Options options)
    : log_(log), options_(options), assembler_([this] { AssembleLoop(); }) {}

CommitCoordinator::~CommitCoordinator() {
  ReleaseWaiters();
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  assemble_cv_.notify_all();
  assembler_.join();
}

namespace {

// What a committed step waiting for its whole manifest holds: its parts (none when the
// manifest is to be read back from the log).
size_t AssemblyBytes(const Decision& d) { return d.committed->parts ? WholeManifestEstimate(*d.committed->parts) : 0; }

}  // namespace

void CommitCoordinator::AssembleLoop() {
  pthread_setname_np(pthread_self(), kAssemblerThreadName);
  std::unique_lock lock(mu_);
  while (true) {
    assemble_cv_.wait(lock, [&] { return stopping_ || !to_assemble_.empty(); });
    if (stopping_) return;
    auto [key, decided] = std::move(to_assemble_.front());
    to_assemble_.pop_front();
    queued_assembly_bytes_ -= AssemblyBytes(decided);
    lock.unlock();
    Decision whole;
    try {
      whole = WithWholeManifest(key, decided);
    } catch (const std::exception& e) {  // bad_alloc: node 0 asks again; the commit stands
      Log().error("{} assembling the whole manifest failed: {}", Prefix(key.first, key.second), e.what());
      whole = {Outcome::kPending, fmt::format("assembling the whole manifest failed: {}", e.what()), nullptr};
    }
    Notifications notify;
    lock.lock();
    if (auto waiting = awaiting_whole_.find(key); waiting != awaiting_whole_.end()) {
      for (PendingWaiter& w : waiting->second) notify.emplace_back(std::move(w.waiter), whole);
      awaiting_whole_.erase(waiting);
    }
    lock.unlock();
    Deliver(notify);
    lock.lock();
  }
}

Decision CommitCoordinator::Prepare(uint32_t node, uint64_t attempt, const format::Manifest& whole_part) {
  format::SplitResult split = format::SplitPart(whole_part);
  return Prepare(node, attempt, PreparedPart{std::move(split.structure), std::move(split.values)});
}

Decision CommitCoordinator::Prepare(uint32_t node, uint64_t attempt, PreparedPart prepared) {
  const format::Manifest& part = prepared.shape();
  const uint64_t run = prepared.values.run;
  const Key key{part.job, prepared.values.step};
  auto refuse = [&](std::string why) { return Decision{Outcome::kAborted, std::move(why), {}}; };
  if (absl::Status valid = ValidateJobName(part.job); !valid.ok()) return refuse(Message(valid));
  if (part.world_size == 0 || part.world_size > options_.max_world_size) {
    return refuse(fmt::format("world size {} is not in 1..{}", part.world_size,
                              options_.max_world_size));
  }
  const std::vector<uint32_t>& ranks = prepared.structure->ranks;
  if (ranks.empty()) return refuse("a prepare must name at least one rank");
  if (absl::Status fits = format::CheckValuesFit(*prepared.structure, prepared.values); !fits.ok()) {
    return refuse(Message(fits));
  }
  for (uint32_t rank : ranks) {
    if (rank >= part.world_size) {
      return refuse(fmt::format("rank {} is outside world size {}", rank, part.world_size));
    }
  }
  Notifications notify;
  Decision result;
  std::optional<CompleteRound> complete;
  {
    std::lock_guard lock(mu_);
    if (auto deciding = rounds_.find(key); deciding != rounds_.end() && deciding->second.deciding) {
      return Decision{Outcome::kPending, {}, nullptr};  // a retry while the decision is recorded
    }
    if (auto decided = recent_.find(key); decided != recent_.end() || !rounds_.count(key)) {
      Decision before = decided != recent_.end() ? decided->second.decision : Decision{};
      if (before.outcome == Outcome::kUnknown) {
        // Not in memory: a coordinator restart forgets rounds but not commits.
        before = FromLog(key, /*whole=*/false);
        // A log that cannot answer is no proof that the step was never committed: no
        // round is opened over it (the node asks again).
        if (before.outcome == Outcome::kPending) return before;
      }
      if (before.outcome == Outcome::kCommitted) {
        // A commit is bound to the attempt and run that made it. A prepare of that attempt
        // whose reply was lost hears the same answer again; a newer attempt or run at the
        // same step number (a new run saving it again once retention removed it, or after
        // `ckptctl delete`) is a new round, which replaces the commit if it commits; an
        // older one is refused. Never does a prepare hear a commit of other bytes.
        switch (CompareToCommit(*before.committed, node, attempt, run, ranks)) {
          case CommitMatch::kRetry:
            return before;
          case CommitMatch::kOlder:
            return refuse(fmt::format(
                "step {} of job {} is already committed by a newer attempt (run {}); this prepare is of attempt {} "
                "(run {})",
                key.second, key.first, before.committed->header.run, attempt, run));
          case CommitMatch::kNewer:
            Log().info("{} prepared again by node {} (attempt {}, run {}) after a commit of run {}: a new round, "
                       "whose commit replaces the earlier one",
                       Prefix(key.first, key.second), node, attempt, run, before.committed->header.run);
            // The earlier commit's whole manifest must never be sent for the new one.
            if (absl::Status forgot = log_.ForgetManifest(key.first, key.second); !forgot.ok()) {
              return refuse(fmt::format("step {} of job {} was committed by an earlier run, whose recorded manifest "
                                        "the coordinator could not remove: {}",
                                        key.second, key.first, Message(forgot)));
            }
            if (decided != recent_.end()) ForgetLocked(decided);
            decided = recent_.end();
            break;
        }
      }
      if (before.outcome == Outcome::kAborted) {
        // A prepare of the attempt that was aborted, late: the same answer again, and no
        // new round that would hold files the node has already removed.
        auto seen = decided->second.attempts.find(node);
        if (seen != decided->second.attempts.end() && attempt <= seen->second) return before;
        // A node that had not prepared before the abort (it was stopped, or cut off) and
        // prepares now for trainers registered before it: the same attempt, late.
        if (run != 0 && run < decided->second.aborted_unix_ns) return before;
      }
      // An abort is forgotten here: this is a new attempt at the step (trainers that
      // restarted and saved it again).
      if (decided != recent_.end()) ForgetLocked(decided);
    }
    // (After the retry of a committed step above, which is answered whatever it carries.)
    if (prepared.values.withheld && options_.publish.commit) {
      return refuse("the coordinator publishes every step's whole manifest on the shared root and needs every "
                    "checksum, but this part's stayed on its node");
    }
    if (!rounds_.count(key) && (rounds_.size() >= kMaxRounds || round_ranks_ + part.world_size > kMaxRoundRanks)) {
      return refuse(fmt::format("the coordinator already has {} steps of {} ranks in all in flight",
                                rounds_.size(), round_ranks_));
    }
    auto [it, inserted] = rounds_.try_emplace(key);
    Round& round = it->second;
    if (inserted) {
      round.world_size = part.world_size;
      round.node_of_rank.assign(part.world_size, kNoNode);
      round_ranks_ += part.world_size;
      round.started = Clock::now();
      // As many nodes as the job's last commit had: no rehash while 10,000 arrive.
      if (auto last = jobs_.find(key.first); last != jobs_.end()) {
        round.nodes.reserve(last->second.nodes.size());
        round.parts.reserve(last->second.nodes.size());
      }
      Log().debug("{} first prepare (node {}, world size {})", Prefix(key.first, key.second), node,
                  part.world_size);
    }
    NodeWord& said = round.nodes.try_emplace(node, NodeWord{attempt, 0}).first->second;
    if (attempt < said.attempt) {
      return refuse(fmt::format("node {} has since started a newer attempt at step {}", node,
                                key.second));
    }
    if (attempt > said.attempt) {
      // The node abandoned its older attempt (its files are gone or being rewritten).
      ForgetNodeLocked(round, node);
      said.attempt = attempt;
    }
    if (std::optional<std::string> lost = inserted ? LostHolderLocked(part.job, run, part.world_size) : std::nullopt) {
      for (uint32_t rank : ranks) ClaimLocked(round, rank, node);
      AbortLocked(key, fmt::format("{}; missing ranks {}", *lost, MissingRanks(round)), notify);
      result = recent_[key].decision;
    } else if (round.world_size != part.world_size) {
      AbortLocked(key, fmt::format("node {} prepared world size {}, earlier nodes {}", node,
                                   part.world_size, round.world_size),
                  notify);
      result = recent_[key].decision;
    } else {
      std::string conflict;
      for (uint32_t rank : ranks) {
        if (std::optional<uint32_t> other = ClaimLocked(round, rank, node)) {
          conflict = fmt::format("rank {} was prepared by node {} and by node {}", rank, *other, node);
        }
      }
      if (conflict.empty()) {
        // The node's newest word on a rank wins: a retried prepare, or the rank written
        // again (a new attempt after an abort this node had not heard of yet), replaces
        // what it said before, so the manifest describes the file now on disk.
        prepared.attempt = attempt;
        prepared.TakeBrief();
        ReplaceRanksLocked(round, node, std::move(prepared));
      }
      if (!conflict.empty()) {
        AbortLocked(key, conflict, notify);
        result = recent_[key].decision;
      } else if (round.prepared == round.world_size) {
        complete = TakePartsLocked(round);
      } else {
        result.outcome = Outcome::kPending;
      }
    }
  }
  // The round is complete: merged, checked and recorded without the lock that every other
  // prepare, heartbeat and outcome poll needs.
  if (complete) result = Decide(key, std::move(*complete), notify);
  Deliver(notify);
  return result;
}

void CommitCoordinator::DropReplacedParts(Round& round) {
  std::erase_if(round.parts, [](const auto& part) { return !part.second.structure; });
}

CommitCoordinator::CompleteRound CommitCoordinator::TakePartsLocked(Round& round) {
  // By node, a node's parts in the order it sent them: what the structure check's key, the
  // decision record and the whole manifest are made of, the same every step. An order of
  // indices is sorted, so that each part moves once.
  std::vector<uint32_t> order(round.parts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return round.parts[a].first < round.parts[b].first; });
  CompleteRound complete;
  complete.parts.reserve(order.size());
  for (uint32_t i : order) complete.parts.push_back(std::move(round.parts[i]));
  complete.nodes = std::move(round.nodes);  // given back if the decision fails (Decide)
  round.parts.clear();
  round.deciding = true;  // nothing else ends or changes it now
  return complete;
}

void CommitCoordinator::ReplaceRanksLocked(Round& round, uint32_t node, PreparedPart part) {
  uint32_t& count = round.nodes.at(node).parts;
  if (count > 0) {
    // The node's newer word on some ranks (rare: a retry, or a retry that found more ranks
    // durable): a walk of the round's parts, once per such prepare.
    const std::set<uint32_t> ranks(part.structure->ranks.begin(), part.structure->ranks.end());
    std::vector<PreparedPart> split_off;
    for (auto& [holder, old] : round.parts) {
      if (holder != node || !old.structure) continue;
      size_t overlap = 0;
      for (uint32_t rank : old.structure->ranks) overlap += ranks.count(rank);
      if (overlap == 0) continue;
      if (overlap < old.structure->ranks.size()) {
        // Some of an older part's ranks said again: the older part keeps the others, as a
        // structure of its own. A part held as a summary, or whose checksums stayed on its
        // node, cannot be split: its other ranks are dropped, and the step aborts for them
        // at its decision.
        if (absl::StatusOr<format::Manifest> rest = format::JoinPart(*old.structure, old.values); rest.ok()) {
          format::RemoveRanks(*rest, [&](uint32_t rank) { return ranks.count(rank) > 0; });
          format::SplitResult split = format::SplitPart(*rest);
          split_off.push_back({std::move(split.structure), std::move(split.values), old.attempt});
        }
      }
      old = PreparedPart{};
      --count;
    }
    DropReplacedParts(round);
    for (PreparedPart& kept : split_off) {
      kept.TakeBrief();
      round.parts.emplace_back(node, std::move(kept));
      ++count;
    }
  }
  round.parts.emplace_back(node, std::move(part));
  ++count;
}

std::optional<uint32_t> CommitCoordinator::ClaimLocked(Round& round, uint32_t rank, uint32_t node) {
  uint32_t& holder = round.node_of_rank.at(rank);  // ranks were checked against the world size
  if (holder == kNoNode) {
    holder = node;
    ++round.prepared;
  }
  if (holder != node) return holder;
  return std::nullopt;
}

void CommitCoordinator::ForgetNodeLocked(Round& round, uint32_t node) {
  for (uint32_t& holder : round.node_of_rank) {
    if (holder == node) {
      holder = kNoNode;
      --round.prepared;
    }
  }
  if (auto word = round.nodes.find(node); word != round.nodes.end() && word->second.parts > 0) {
    for (auto& [holder, part] : round.parts) {
      if (holder == node) part = PreparedPart{};
    }
    DropReplacedParts(round);
    word->second.parts = 0;
  }
}

CommitCoordinator::StructureCheck CommitCoordinator::CheckStructures(const PreparedParts& parts) {
  std::string key;  // the same structures on the same nodes: each node's 4 bytes, then its digest and ';'
  key.reserve(parts.size() * (parts.empty() ? 0 : parts.front().second.brief.digest.size() + 5));
  std::vector<uint32_t> summarized;  // nodes whose structure is held as a summary only
  for (const auto& [node, part] : parts) {
    // A part without its brief would key the check by nodes alone, and reuse another
    // combination's verdict: every part is briefed when the coordinator takes it.
    assert(!part.brief.digest.empty());
    key.append(reinterpret_cast<const char*>(&node), sizeof node);
    key += part.brief.digest;
    key += ';';
    if (part.brief.summary) summarized.push_back(node);
  }
  {
    std::lock_guard lock(checks_mu_);
    if (auto made = checks_.find(key); made != checks_.end()) {
      // Least recently used goes first: a large job's check, made every step, stays.
      checks_order_.splice(checks_order_.end(), checks_order_, made->second.second);
      return made->second.first;
    }
  }
  // A combination not checked before needs every structure whole. When some are held as
  // summaries only (the cache was full), every structure of the combination is dropped,
  // so that every node of it sends its whole part with the next step and the round holds
  // them all at once: dropping only the summaries would let the cache summarize others
  // before their nodes prepare, step after step. Not remembered: checked afresh next time.
  if (!summarized.empty()) {
    if (options_.forget_structure) {
      for (const auto& [node, part] : parts) options_.forget_structure(part.brief.digest);
    }
    return {absl::FailedPreconditionError(fmt::format(
                "the coordinator holds only a summary of the structures of {} node(s) (nodes {}{}) and must see every "
                "structure whole to check this combination: the nodes send them again with the next step",
                summarized.size(),
                fmt::join(summarized.begin(), summarized.begin() + std::min<size_t>(summarized.size(), 8), ", "),
                summarized.size() > 8 ? ", ..." : "")),
            0};
  }
  // Checked in place, tensor by tensor: a merged copy of every structure would double the
  // coordinator's memory for a large job's first step.
  std::vector<std::pair<uint32_t, const format::PartStructure*>> structures;
  structures.reserve(parts.size());
  for (const auto& [node, part] : parts) structures.emplace_back(node, part.structure.get());
  StructureCheck check;
  absl::StatusOr<uint32_t> tensors = format::CheckStructuresTile(structures);
  if (tensors.ok()) {
    check.tensors = *tensors;
  } else {
    check.status = tensors.status();
  }
  std::lock_guard lock(checks_mu_);
  if (!checks_.count(key)) {
    checks_order_.push_back(key);
    checks_.emplace(key, std::make_pair(check, std::prev(checks_order_.end())));
  }
  while (checks_order_.size() > kStructureChecks) {
    checks_.erase(checks_order_.front());
    checks_order_.pop_front();
  }
  return check;
}

namespace {

// The header and shares of a complete round whose structures passed their check: O(ranks).
CommittedStep DescribeParts(const PreparedParts& parts, uint32_t tensors) {
  CommittedStep c;
  StepHeader& h = c.header;
  h.world_size = parts.front().second.shape().world_size;
  h.step_tensors = tensors;
  c.node_of_rank.assign(h.world_size, ~uint32_t{0});
  auto last = c.shares.end();
  for (const auto& [node, part] : parts) {
    if (last == c.shares.end() || last->first != node) {
      // Parts come by node: each share goes at the map's end, without a search.
      last = c.shares.emplace_hint(c.shares.end(), node, NodeShare{});
      last->second.attempt = part.attempt;  // a node's parts are all of its newest attempt
    }
    NodeShare& share = last->second;
    const format::PartValues& v = part.values;
    // The latest clock among the nodes: the moment the last part became durable.
    h.run = std::max(h.run, v.run);
    share.run = std::max(share.run, v.run);
    if (v.unix_time > h.unix_time) {
      h.unix_time = v.unix_time;
      h.wall_time = v.wall_time;
    }
    const std::vector<uint32_t>& ranks = part.brief.ranks;
    for (size_t i = 0; i < ranks.size(); ++i) {
      c.node_of_rank[ranks[i]] = node;
      if (ranks[i] == 0) h.metadata = v.ranks[i].metadata;  // the values' ranks: only here
    }
    share.ranks += static_cast<uint32_t>(ranks.size());
    share.bytes += part.brief.bytes;
    h.step_bytes += part.brief.bytes;
    if (v.increment) {
      // Summed into the header, which node-scoped manifests and an index record.
      h.incremental = true;
      h.own_bytes += v.increment->own_bytes;
      h.referenced_bytes += v.increment->referenced_bytes;
    }
  }
  h.nodes = static_cast<uint32_t>(c.shares.size());
  return c;
}

}  // namespace

Decision CommitCoordinator::Decide(const Key& key, CompleteRound complete, Notifications& out) {
  auto parts = std::make_shared<const PreparedParts>(std::move(complete.parts));
  // Merging and checking the tiling costs O(tensor pieces): done once per combination of
  // structures, then each step costs O(ranks).
  StructureCheck check = CheckStructures(*parts);
  absl::Status recorded = check.status;
  std::shared_ptr<CommittedStep> committed;
  // On a shared root the coordinator publishes the step's manifest itself, and a step is
  // only readable once it has: built before the decision, so that a manifest no reader
  // accepts aborts the step, naming why, instead of a "committed" step left unreadable in
  // its .tmp directory (and published again, in vain, at every restart). A step whose whole
  // manifest would be larger than a manifest may be is published as an index and one part
  // per node (format/indexed_manifest.h), each part written before the decision is recorded.
  std::optional<format::Manifest> published_manifest;  // whole, or the index
  std::string published_json;
  bool indexed = false;
  absl::Status unpublishable;  // why the step cannot be published, before any decision
  if (recorded.ok() && options_.publish.commit) {
    // Far over the limit, the whole manifest is not even built (gigabytes at 10,000 nodes).
    indexed = WholeManifestEstimate(*parts) > 2 * options_.max_whole_manifest_bytes;
    if (!indexed) {
      absl::StatusOr<format::Manifest> assembled = AssembleWhole(*parts);
      if (!assembled.ok()) {
        unpublishable = assembled.status();
      } else {
        published_json = format::ManifestToJson(*assembled);
        indexed = published_json.size() > options_.max_whole_manifest_bytes;
        if (indexed) {
          published_json.clear();
        } else {
          published_manifest = std::move(*assembled);
        }
      }
    }
    recorded = unpublishable;
  }
  std::string record;
  if (recorded.ok()) {
    committed = std::make_shared<CommittedStep>(DescribeParts(*parts, check.tensors));
    record = DecisionRecordJson(key.first, key.second, *committed, *parts);
    committed->header.digest = format::ManifestDigest(record);
    if (indexed) {
      // The parts name the decision's digest, known now, before it is recorded.
      absl::StatusOr<format::Manifest> index = WriteIndexedParts(*parts, committed->header);
      if (index.ok()) {
        published_json = format::ManifestToJson(*index);
        Log().info("{} its whole manifest is larger than a manifest may be ({} bytes): published as an index and "
                   "{} node parts",
                   Prefix(key.first, key.second), options_.max_whole_manifest_bytes, index->index->parts.size());
        published_manifest = std::move(*index);
      } else {
        unpublishable = index.status();
      }
      recorded = unpublishable;
    }
  }
  std::shared_ptr<void> origins_held;  // until the step is published, below
  if (recorded.ok() && options_.publish.hold_origins && published_manifest && published_manifest->increment &&
      !published_manifest->increment->origin_steps.empty()) {
    absl::StatusOr<std::shared_ptr<void>> held = options_.publish.hold_origins(*published_manifest);
    if (held.ok()) {
      origins_held = std::move(*held);
    } else {
      unpublishable = held.status();
      recorded = unpublishable;
    }
  }
  if (recorded.ok() && options_.publish.commit) {
    // What a coordinator that restarts after the decision publishes the step from: recorded
    // first (a manifest with no decision beside it is a step presumed aborted).
    if (absl::Status kept = log_.RecordManifest(key.first, key.second, published_json); !kept.ok()) {
      unpublishable = Annotate(kept, "recording its manifest beside the decision");
      recorded = unpublishable;
    }
  }
  if (recorded.ok()) {
    // Durable before anyone hears "committed": a node that renames on this answer must
    // find the same answer after a coordinator crash.
    recorded = log_.RecordCommit(key.first, key.second, record);
  }
  if (recorded.ok() && options_.publish.commit) {
    // One shared filesystem: the coordinator writes the one manifest (or the index) before
    // announcing. The decision stands either way; a coordinator restart publishes it again
    // (the step stays in .tmp, with its parts, and is resolved from the log).
    committed->manifest_json = std::move(published_json);
    absl::Status published = options_.publish.commit(*published_manifest);
    if (!published.ok()) {
      Log().error("{} committed but not published on the shared root: {}", Prefix(key.first, key.second),
                  Message(published));
    }
  } else if (recorded.ok()) {
    if (std::optional<NotAssembled> not_assembled = WhyNotAssembled(*parts)) {
      // Decided here, in O(parts): such a step never waits in the assembler's queue.
      Log().warn("{} the whole manifest is not assembled: {}; node 0 publishes its own ranks only",
                 Prefix(key.first, key.second), not_assembled->why);
      committed->whole_unavailable = true;
      committed->checksums_unused = not_assembled->checksums_unused;
    } else {
      committed->parts = parts;  // the whole manifest is assembled when node 0 asks
    }
  }
  std::lock_guard lock(mu_);
  auto round = rounds_.find(key);  // a deciding round is never ended by anyone else
  if (!recorded.ok()) {
    round->second.nodes = std::move(complete.nodes);  // the aborted attempts are remembered
    AbortLocked(key,
                !check.status.ok()   ? Message(check.status)
                : !unpublishable.ok() ? fmt::format("it cannot be published on the shared root: {}",
                                                    Message(unpublishable))
                                      : fmt::format("the coordinator could not record the decision: {}", Message(recorded)),
                out);
    return recent_[key].decision;
  }
  Decision decision{Outcome::kCommitted, {}, std::move(committed)};
  const bool assemble = decision.committed->manifest_json.empty() && !decision.committed->whole_unavailable;
  for (PendingWaiter& w : round->second.waiters) {
    if (w.whole && assemble) {
      awaiting_whole_[key].push_back(std::move(w));
    } else {
      out.emplace_back(std::move(w.waiter), decision);
    }
  }
  if (assemble) {
    awaiting_whole_.try_emplace(key);  // marks it as being assembled (Await)
    // Off the commit path: every node has its answer before node 0's manifest is built.
    to_assemble_.emplace_back(key, decision);
    queued_assembly_bytes_ += AssemblyBytes(decision);
    // Steps committing faster than their manifests are built (many jobs at once, or a
    // slow disk under the log): the oldest waiting ones are given up, so that what waits
    // (every node's values) stays bounded. Their node 0 publishes its own ranks.
    while (queued_assembly_bytes_ > options_.assembly_queue_bytes && to_assemble_.size() > 1) {
      auto [old_key, old] = std::move(to_assemble_.front());
      to_assemble_.pop_front();
      queued_assembly_bytes_ -= AssemblyBytes(old);
      Log().warn("{} the whole manifest is not assembled: {} bytes of newer steps' manifests wait to be; node 0 "
                 "publishes its own ranks only",
                 Prefix(old_key.first, old_key.second), queued_assembly_bytes_);
      Decision given_up = WithoutWholeManifest(old);
      if (auto waiting = awaiting_whole_.find(old_key); waiting != awaiting_whole_.end()) {
        for (PendingWaiter& w : waiting->second) out.emplace_back(std::move(w.waiter), given_up);
        awaiting_whole_.erase(waiting);
      }
      ReplaceRememberedLocked(old_key, given_up);
    }
    assemble_cv_.notify_one();
  }
  JobCommits& job = jobs_[key.first];
  job.latest_step = std::max(job.latest_step, key.second);
  job.latest_run = std::max(job.latest_run, decision.committed->header.run);
  job.world_size = decision.committed->header.world_size;
  job.nodes.clear();
  for (const auto& [node, share] : decision.committed->shares) job.nodes.push_back(node);
  Log().info("{} committed globally: {} ranks on {} node(s)", Prefix(key.first, key.second),
             round->second.world_size, job.nodes.size());
  round_ranks_ -= round->second.world_size;
  rounds_.erase(round);
  RememberLocked(key, decision);
  return decision;
}

void CommitCoordinator::AbortLocked(const Key& key, const std::string& reason, Notifications& out) {
  Decision decision{Outcome::kAborted, reason, {}};
  std::map<uint32_t, uint64_t> attempts;
  if (auto it = rounds_.find(key); it != rounds_.end()) {
    for (PendingWaiter& w : it->second.waiters) out.emplace_back(std::move(w.waiter), decision);
    for (const auto& [node, word] : it->second.nodes) attempts.emplace(node, word.attempt);
    round_ranks_ -= it->second.world_size;
    rounds_.erase(it);
  }
  Log().warn("{} aborted: {}", Prefix(key.first, key.second), reason);
  if (options_.publish.discard) options_.publish.discard(key.first, key.second);
  RememberLocked(key, std::move(decision), std::move(attempts));
}

namespace {

// What a committed step holds in memory beside its header and shares: its manifest's text
// or the parts it is assembled from, and its rank table.
size_t ManifestBytes(const Decision& d) {
  if (!d.committed) return 0;
  size_t bytes = d.committed->manifest_json.size() + 4 * d.committed->node_of_rank.size();
  if (d.committed->parts) {
    for (const auto& [node, part] : *d.committed->parts) {
      // The part, its values, and its brief (the digest and ranks copied).
      bytes += 64 + 8 * part.values.xxh3.size() + 48 * part.values.checksums.size() + 64 * part.values.ranks.size() +
               32 + part.brief.digest.capacity() + 4 * part.brief.ranks.capacity();
    }
  }
  return bytes;
}

// What its node shares hold (a map node: about 64 bytes each).
size_t ShareBytes(const Decision& d) { return d.committed ? 64 * d.committed->shares.size() : 0; }

}  // namespace

void CommitCoordinator::ForgetLocked(std::map<Key, Remembered>::iterator it) {
  recent_manifest_bytes_ -= ManifestBytes(it->second.decision);
  recent_share_bytes_ -= ShareBytes(it->second.decision);
  if (auto in_order = std::find(recent_order_.begin(), recent_order_.end(), it->first);
      in_order != recent_order_.end()) {
    recent_order_.erase(in_order);
  }
  recent_.erase(it);
}

CommitCoordinator::CommitMatch CommitCoordinator::CompareToCommit(const CommittedStep& c, uint32_t node,
                                                                  uint64_t attempt, uint64_t run,
                                                                  const std::vector<uint32_t>& ranks) {
  auto share = c.shares.find(node);
  // The commit gives this node these ranks. (Once memory is short only their count is known.)
  bool holds;
  if (!c.node_of_rank.empty()) {
    holds = std::all_of(ranks.begin(), ranks.end(), [&](uint32_t rank) {
      return rank < c.node_of_rank.size() && c.node_of_rank[rank] == node;
    });
  } else {
    holds = share != c.shares.end() && share->second.ranks >= ranks.size();
  }
  if (share == c.shares.end()) {
    // The node had no ranks in the commit: only a later run may save the step again.
    return run > c.header.run ? CommitMatch::kNewer : CommitMatch::kOlder;
  }
  const uint64_t committed_attempt = share->second.attempt;  // 0: a record of an older ckptd
  const uint64_t committed_run = share->second.run != 0 ? share->second.run : c.header.run;
  if (committed_attempt != 0) {
    if (attempt == committed_attempt) return holds ? CommitMatch::kRetry : CommitMatch::kOlder;
    if (run > committed_run) return CommitMatch::kNewer;
    if (run < committed_run) return CommitMatch::kOlder;
    return attempt > committed_attempt ? CommitMatch::kNewer : CommitMatch::kOlder;
  }
  // Attempts not recorded: runs tell a later run's save apart, and nothing finer can.
  if (run > committed_run) return CommitMatch::kNewer;
  return holds ? CommitMatch::kRetry : CommitMatch::kOlder;
}

void CommitCoordinator::RememberLocked(const Key& key, Decision decision,
                                       std::map<uint32_t, uint64_t> attempts) {
  const uint64_t aborted_unix_ns =
      decision.outcome == Outcome::kAborted ? UnixNanos() : 0;
  recent_manifest_bytes_ += ManifestBytes(decision);
  recent_share_bytes_ += ShareBytes(decision);
  auto [it, fresh] = recent_.try_emplace(key);
  if (fresh) {
    recent_order_.push_back(key);
  } else {
    recent_manifest_bytes_ -= ManifestBytes(it->second.decision);
    recent_share_bytes_ -= ShareBytes(it->second.decision);
  }
  it->second = Remembered{std::move(decision), std::move(attempts), aborted_unix_ns};
  // Forgotten decisions are read back from the log when asked for (commits), or presumed
  // aborted (aborts, as after a restart).
  while (recent_order_.size() > kRecentDecisions ||
         (recent_share_bytes_ > kRecentShareBytes && recent_order_.size() > 1)) {
    const Decision& oldest = recent_[recent_order_.front()].decision;
    recent_manifest_bytes_ -= ManifestBytes(oldest);
    recent_share_bytes_ -= ShareBytes(oldest);
    recent_.erase(recent_order_.front());
    recent_order_.pop_front();
  }
  // Manifests beyond the budget are dropped from memory, oldest first, and read back from
  // the decision log when node 0 or a node in doubt asks for one; the header and node
  // shares that the other nodes ask for stay. Answers in flight keep their own copy.
  for (auto old = recent_order_.begin();
       recent_manifest_bytes_ > options_.recent_manifest_bytes && std::next(old) != recent_order_.end(); ++old) {
    Decision& d = recent_[*old].decision;
    if (ManifestBytes(d) == 0) continue;
    recent_manifest_bytes_ -= ManifestBytes(d);
    auto slim = std::make_shared<CommittedStep>();
    slim->header = d.committed->header;
    slim->shares = d.committed->shares;
    slim->whole_unavailable = d.committed->whole_unavailable;
    d.committed = std::move(slim);
  }
}

void CommitCoordinator::Abort(const std::string& job, uint64_t step, uint32_t node,
                              uint64_t attempt, const std::string& reason, uint64_t run) {
  Notifications notify;
  {
    std::lock_guard lock(mu_);
    Key key{job, step};
    // Only an undecided step can be aborted: a commit already announced stands.
    auto round = rounds_.find(key);
    if (round == rounds_.end()) {
      // No node has prepared yet (a node refused a rank's snapshot before any arrived):
      // remembered as aborted, so that prepares of this attempt hear it at once (by their
      // run, as after any abort) instead of opening a round that could only time out.
      // Not for a step at or below the job's newest commit (an old step's abort, late),
      // unless the abort is of a newer run than that commit: a new run saving the step
      // number again, which a node refused (it still holds the earlier run's step).
      auto newer_run = [&](const Decision& d) {
        return run != 0 && d.outcome == Outcome::kCommitted && run > d.committed->header.run;
      };
      if (auto known = recent_.find(key); known != recent_.end() && !newer_run(known->second.decision)) return;
      if (auto job_commits = jobs_.find(job); job_commits != jobs_.end() && step <= job_commits->second.latest_step &&
                                              (run == 0 || run <= job_commits->second.latest_run)) {
        return;
      }
      Decision logged = FromLog(key, /*whole=*/false);
      if (logged.outcome == Outcome::kPending) return;
      if (logged.outcome == Outcome::kCommitted && !newer_run(logged)) return;
      AbortLocked(key, reason, notify);
      Remembered& aborted = recent_[key];
      aborted.attempts[node] = attempt;
      if (run != 0) {
        // A node refused a run's save of the step (it holds an earlier run's commit of it):
        // the other nodes' ranks of that run may have registered a little after this one and
        // after the abort arrived, and must hear it too rather than open a round that can
        // only time out. Ranks of one run register within kSameRunWindow of each other.
        aborted.aborted_unix_ns =
            std::max(aborted.aborted_unix_ns,
                     run + static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(kSameRunWindow).count()));
      }
    } else if (round->second.deciding) {
      return;
    } else {
      auto said = round->second.nodes.find(node);
      if (said != round->second.nodes.end() && attempt < said->second.attempt) {
        Log().info("{} ignored a late abort from node {}'s earlier attempt", Prefix(job, step), node);
        return;
      }
      AbortLocked(key, reason, notify);
    }
  }
  Deliver(notify);
}

void CommitCoordinator::Await(const std::string& job, uint64_t step, Clock::time_point deadline,
                              Waiter waiter, bool whole_manifest) {
  {
    std::lock_guard lock(mu_);
    if (auto it = rounds_.find({job, step}); it != rounds_.end()) {
      it->second.waiters.push_back({deadline, std::move(waiter), whole_manifest});
      return;
    }
    if (auto assembling = awaiting_whole_.find({job, step}); whole_manifest && assembling != awaiting_whole_.end()) {
      assembling->second.push_back({deadline, std::move(waiter), true});
      return;
    }
  }
  waiter(Lookup(job, step, whole_manifest));
}

Decision CommitCoordinator::Lookup(const std::string& job, uint64_t step, bool whole_manifest) {
  const Key key{job, step};
  Decision known;
  {
    std::lock_guard lock(mu_);
    if (rounds_.count(key)) return {Outcome::kPending, {}, nullptr};
    if (auto it = recent_.find(key); it != recent_.end()) {
      known = it->second.decision;
      if (!whole_manifest || known.outcome != Outcome::kCommitted) return known;
    }
  }
  if (known.outcome == Outcome::kCommitted) return WithWholeManifest(key, known);
  Decision recorded = FromLog(key, whole_manifest);
  if (recorded.outcome == Outcome::kCommitted) {
    std::lock_guard lock(mu_);
    RememberLocked(key, recorded);  // every node in doubt asks after a coordinator restart
  }
  return recorded;
}

std::optional<CommitCoordinator::NotAssembled> CommitCoordinator::WhyNotAssembled(const PreparedParts& parts) const {
  if (const size_t estimate = WholeManifestEstimate(parts); estimate > 2 * options_.max_whole_manifest_bytes) {
    // No reader could load it, and building it would cost node 0 seconds and gigabytes a
    // step (1,000 nodes x 8 ranks x 200 tensors: 362 MiB of text, 24 s, 7.6 GiB).
    return NotAssembled{fmt::format("it would be about {} bytes, more than a step's manifest may be ({})", estimate,
                                    options_.max_whole_manifest_bytes),
                        true};
  }
  if (std::any_of(parts.begin(), parts.end(), [](const auto& p) { return p.second.brief.summary; })) {
    // Not said to the nodes: a full cache passes, and each time it did the step after
    // would lose its whole manifest to withheld checksums.
    return NotAssembled{"the coordinator holds only summaries of some nodes' structures (its cache is full)", false};
  }
  if (std::any_of(parts.begin(), parts.end(), [](const auto& p) { return p.second.values.withheld > 0; })) {
    // They were told to, while the manifest was too large; it no longer is: the answer
    // tells them to send checksums again.
    return NotAssembled{"some nodes kept their checksums (the manifest was too large before)", false};
  }
  return std::nullopt;
}

absl::StatusOr<format::Manifest> CommitCoordinator::WriteIndexedParts(const PreparedParts& parts,
                                                                     const StepHeader& header) {
  if (!options_.publish.write_part) {
    return absl::UnimplementedError("this coordinator cannot publish a manifest in parts");
  }
  // One manifest per node, in the order of the nodes as the index lists them: parts are in
  // arrival order, and a node whose ranks became durable at different times prepared them in
  // several parts. Each node's is written as soon as it is joined: one node's in memory at a
  // time, never the whole step's.
  std::vector<const std::pair<uint32_t, PreparedPart>*> by_node;
  by_node.reserve(parts.size());
  for (const auto& p : parts) by_node.push_back(&p);
  std::stable_sort(by_node.begin(), by_node.end(), [](const auto* a, const auto* b) { return a->first < b->first; });
  std::optional<format::Manifest> index;
  for (size_t i = 0; i < by_node.size();) {
    const uint32_t node = by_node[i]->first;
    CKPT_ASSIGN_OR_RETURN(format::Manifest joined,
                          format::JoinPart(*by_node[i]->second.structure, by_node[i]->second.values));
    for (++i; i < by_node.size() && by_node[i]->first == node; ++i) {
      CKPT_ASSIGN_OR_RETURN(format::Manifest more,
                            format::JoinPart(*by_node[i]->second.structure, by_node[i]->second.values));
      format::AppendRanks(joined, std::move(more));
    }
    format::Manifest mine = NodeManifest(std::move(joined), header, node);
    if (!index) index = format::IndexHeader(mine);
    CKPT_RETURN_IF_ERROR(options_.publish.write_part(mine, *index));
  }
  if (!index) return absl::InvalidArgumentError("a step without parts");
  return std::move(*index);
}

Decision CommitCoordinator::WithoutWholeManifest(const Decision& decision) {
  auto header_only = std::make_shared<CommittedStep>(*decision.committed);
  header_only->parts.reset();
  header_only->whole_unavailable = true;
  return {Outcome::kCommitted, {}, std::move(header_only)};
}

Decision CommitCoordinator::WithWholeManifest(const Key& key, const Decision& decision) {
  const CommittedStep& c = *decision.committed;
  if (!c.manifest_json.empty() || c.whole_unavailable) return decision;
  if (!c.parts) {
    Decision recorded = FromLog(key, /*whole=*/true);
    if (recorded.outcome == Outcome::kCommitted) {
      // With the whole manifest, or marked as having none: never asked of the log again.
      std::lock_guard lock(mu_);
      RememberLocked(key, recorded);
      return recorded;
    }
    // Memory knows it committed; the log cannot give its manifest (pruned, unreadable,
    // never written): never "unknown", which a node would take for an abort.
    return {Outcome::kPending,
            fmt::format("the decision log cannot give the whole manifest: {}",
                        recorded.reason.empty() ? "it was not recorded" : recorded.reason),
            nullptr};
  }
  // (Parts are kept only for a step whose manifest will be built: Decide asked WhyNotAssembled.)
  absl::StatusOr<format::Manifest> whole = AssembleWhole(*c.parts);
  if (!whole.ok()) {  // cannot happen: every part's values were checked against its structure
    return {Outcome::kPending, fmt::format("the whole manifest cannot be assembled: {}", Message(whole.status())),
            nullptr};
  }
  auto full = std::make_shared<CommittedStep>(c);
  full->parts.reset();
  full->manifest_json = format::ManifestToJson(*whole);
  if (absl::Status written = log_.RecordManifest(key.first, key.second, full->manifest_json); !written.ok()) {
    Log().warn("{} the whole manifest was not recorded beside the decision: {}", Prefix(key.first, key.second),
               Message(written));
  }
  if (full->manifest_json.size() > options_.max_whole_manifest_bytes) {
    // No reader would load it from a step directory: node 0 keeps its own ranks' manifest,
    // and the whole one stays in the decision log for tools.
    Log().warn("{} the whole manifest is {} bytes, more than a step's manifest may be ({}): node 0 publishes "
               "its own ranks only",
               Prefix(key.first, key.second), full->manifest_json.size(), options_.max_whole_manifest_bytes);
    full->manifest_json.clear();
    full->whole_unavailable = true;
  }
  Decision assembled{Outcome::kCommitted, {}, std::move(full)};
  std::lock_guard lock(mu_);
  ReplaceRememberedLocked(key, assembled);
  return assembled;
}

void CommitCoordinator::ReplaceRememberedLocked(const Key& key, const Decision& decision) {
  // Not brought back once forgotten, nor over a decision that is not a commit.
  if (auto it = recent_.find(key); it != recent_.end() && it->second.decision.committed) RememberLocked(key, decision);
}

Decision CommitCoordinator::FromLog(const Key& key, bool whole) {
  auto recorded = log_.FindCommit(key.first, key.second);
  if (!recorded.ok()) {
    // Cannot tell: the asker keeps its step in doubt and asks again.
    return {Outcome::kPending, Message(recorded.status()), nullptr};
  }
  if (!recorded->has_value()) {
    return {Outcome::kUnknown, "the coordinator holds no record of this step (presumed aborted)", nullptr};
  }
  absl::StatusOr<CommittedStep> decided = ParseDecisionRecord(**recorded);
  if (absl::IsNotFound(decided.status())) {
    // Recorded by an older ckptd: the whole manifest itself.
    auto old = format::ParseManifest(**recorded, "decision record");
    if (!old.ok()) return {Outcome::kPending, Message(old.status()), nullptr};
    return {Outcome::kCommitted, {}, std::make_shared<const CommittedStep>(DescribeCommit(std::move(**recorded), *old))};
  }
  if (!decided.ok()) return {Outcome::kPending, Message(decided.status()), nullptr};
  if (whole) {
    // Read up to what any reader accepts: an index (a shared root's step too large for one
    // manifest) may be larger than the limit for whole manifests, where a test lowered it.
    auto manifest = log_.FindManifest(key.first, key.second,
                                      std::max(options_.max_whole_manifest_bytes, format::kMaxManifestBytes));
    if (manifest.ok() && manifest->has_value() && (*manifest)->size() > options_.max_whole_manifest_bytes &&
        !IsIndex(**manifest)) {
      manifest = absl::ResourceExhaustedError("larger than a step's manifest may be");
    }
    if (absl::IsResourceExhausted(manifest.status())) {
      decided->whole_unavailable = true;  // larger than a step's manifest may be
    } else if (!manifest.ok()) {
      return {Outcome::kPending, Message(manifest.status()), nullptr};
    } else if (manifest->has_value()) {
      decided->manifest_json = std::move(**manifest);
    } else {
      decided->whole_unavailable = true;  // the coordinator stopped before recording it
    }
  }
  return {Outcome::kCommitted, {}, std::make_shared<const CommittedStep>(std::move(*decided))};
}

std::vector<uint32_t> CommitCoordinator::MissingRankList(const Round& round, size_t most) {
  std::vector<uint32_t> missing;
  for (uint32_t r = 0; r < round.world_size && missing.size() < most; ++r) {
    if (round.node_of_rank[r] == kNoNode) missing.push_back(r);
  }
  return missing;
}

std::string CommitCoordinator::MissingRanks(const Round& round, size_t limit) {
  const std::vector<uint32_t> missing = MissingRankList(round, limit + 1);  // one more: "..."
  size_t shown = std::min(missing.size(), limit);
  return fmt::format("{}{}", fmt::join(missing.begin(), missing.begin() + shown, ", "),
                     missing.size() > limit ? ", ..." : "");
}

void CommitCoordinator::AbortIncomplete(const std::string& why) {
  Notifications notify;
  {
    std::lock_guard lock(mu_);
    std::vector<std::pair<Key, std::string>> doomed;
    for (const auto& [key, round] : rounds_) {
      if (round.deciding) continue;  // complete: its decision is being recorded
      doomed.emplace_back(key, fmt::format("{}; missing ranks {}", why, MissingRanks(round)));
    }
    for (const auto& [key, reason] : doomed) AbortLocked(key, reason, notify);
  }
  Deliver(notify);
}

void CommitCoordinator::MemberLost(uint32_t node, const std::string& why, uint64_t version,
                                   uint64_t silent_since_unix_ns) {
  {
    std::lock_guard lock(mu_);
    MemberNews& news = members_[node];
    if (version <= news.version) return;  // it joined again since
    news = {version, true, why, silent_since_unix_ns};
  }
  AbortIncomplete(why);
}

void CommitCoordinator::MemberBack(uint32_t node, uint64_t version) {
  std::lock_guard lock(mu_);
  MemberNews& news = members_[node];
  if (version <= news.version) return;
  news = {version, false, {}, 0};
}

std::optional<std::string> CommitCoordinator::LostHolderLocked(const std::string& job, uint64_t run,
                                                               uint32_t world_size) const {
  if (run == 0) return std::nullopt;
  auto last = jobs_.find(job);
  // A job whose world changed since (restarted smaller, without the lost node) is not held.
  if (last == jobs_.end() || last->second.world_size != world_size) return std::nullopt;
  for (uint32_t node : last->second.nodes) {
    auto news = members_.find(node);
    if (news != members_.end() && news->second.lost && run < news->second.since_unix_ns) {
      return fmt::format("{}, and held ranks of this job's last commit: a step of this run cannot commit "
                         "until it joins again",
                         news->second.why);
    }
  }
  return std::nullopt;
}

void CommitCoordinator::Tick(Clock::time_point now) {
  Notifications notify;
  {
    std::lock_guard lock(mu_);
    std::vector<std::pair<Key, std::string>> timed_out;
    for (auto& [key, round] : rounds_) {
      if (!round.deciding && now - round.started >= options_.step_timeout) {
        std::vector<uint32_t> nodes;
        for (const auto& [node, word] : round.nodes) {
          if (word.parts > 0) nodes.push_back(node);
        }
        std::sort(nodes.begin(), nodes.end());
        timed_out.emplace_back(
            key, fmt::format("step {} timed out after {:.1f} s (--step-timeout): missing ranks {} "
                             "of {} (prepared by nodes {})",
                             key.second, std::chrono::duration<double>(now - round.started).count(),
                             MissingRanks(round), round.world_size, fmt::join(nodes, ", ")));
        continue;
      }
      for (auto w = round.waiters.begin(); w != round.waiters.end();) {
        if (w->deadline <= now) {
          notify.emplace_back(std::move(w->waiter), Decision{Outcome::kPending, {}, {}});
          w = round.waiters.erase(w);
        } else {
          ++w;
        }
      }
    }
    for (const auto& [key, reason] : timed_out) AbortLocked(key, reason, notify);
    // Waiters for a whole manifest still being assembled hear "pending" at their deadline
    // and ask again, as waiters for an undecided step do.
    for (auto& [key, waiters] : awaiting_whole_) {
      std::erase_if(waiters, [&](PendingWaiter& w) {
        if (w.deadline > now) return false;
        notify.emplace_back(std::move(w.waiter), Decision{Outcome::kPending, {}, {}});
        return true;
      });
    }
  }
  Deliver(notify);
}

std::vector<StepProgress> CommitCoordinator::InFlight() const {
  std::vector<StepProgress> out;
  auto now = Clock::now();
  std::lock_guard lock(mu_);
  for (const auto& [key, round] : rounds_) {
    StepProgress p{key.first, key.second, round.world_size, {},
                   std::chrono::duration<double>(now - round.started).count()};
    p.missing_ranks = MissingRankList(round, 64);
    out.push_back(std::move(p));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.age_s > b.age_s; });
  return out;
}

std::map<std::string, uint64_t> CommitCoordinator::LatestCommitted() const {
  std::lock_guard lock(mu_);
  std::map<std::string, uint64_t> latest;
  for (const auto& [job, commits] : jobs_) latest[job] = commits.latest_step;
  return latest;
}

void CommitCoordinator::ReleaseWaiters() {
  Notifications notify;
  {
    std::lock_guard lock(mu_);
    for (auto& [key, waiters] : awaiting_whole_) {
      for (PendingWaiter& w : waiters) notify.emplace_back(std::move(w.waiter), Decision{Outcome::kPending, {}, {}});
    }
    awaiting_whole_.clear();
    for (auto& [key, round] : rounds_) {
      for (PendingWaiter& w : round.waiters) {
        notify.emplace_back(std::move(w.waiter), Decision{Outcome::kPending, {}, {}});
      }
      round.waiters.clear();
    }
  }
  Deliver(notify);
}

void CommitCoordinator::Deliver(Notifications& notifications) {
  for (auto& [waiter, decision] : notifications) waiter(decision);
}

}  // namespace ckpt::group
