#include "daemon/restorer.h"

#include <fmt/format.h>

#include <algorithm>
#include <new>
#include <chrono>
#include <set>
#include <string_view>
#include <unordered_map>

#include "common/dtype.h"
#include "common/dtype_convert.h"
#include "common/log.h"
#include "daemon/metrics/daemon_metrics.h"
#include "common/parallel.h"
#include "common/status.h"
#include "daemon/restore/rebuilt_snapshot.h"
#include "format/tiling.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "storage/open_store.h"

namespace ckpt::daemon {
namespace {

// Whether every registered tensor this rank saved sits where it sat when saved: then its
// own snapshot in memory is its restore as it is.
bool SamePlacement(const SessionView& session, const format::Manifest& manifest) {
  for (const RegisteredTensor& t : *session.tensors) {
    auto it = manifest.tensors.find(t.name);
    if (it == manifest.tensors.end()) continue;
    const auto& global = t.placement.global_shape.empty() ? t.shape : t.placement.global_shape;
    const format::Placement mine = format::PlacementOf(t.placement.offset, t.shape, t.placement.flat, global);
    for (const format::TensorShard& s : it->second.shards) {
      if (s.rank == session.rank && (it->second.global_shape != global ||
                                     format::ShardPlacement(s, global) != mine)) {
        return false;
      }
    }
  }
  return true;
}

// Whether the part of an indexed step that holds the session's rank (its node's manifest)
// is all a restore needs: the saved world and placement, every registered tensor with a
// piece of this rank in it, and no tensor allowed to be missing (which only the whole step
// can tell from one held by another node).
bool PartServes(const SessionView& session, const RestoreSpec& spec, const format::Manifest& part) {
  if (spec.allow_missing || part.world_size != session.world_size || !SamePlacement(session, part)) return false;
  for (const RegisteredTensor& t : *session.tensors) {
    auto it = part.tensors.find(t.name);
    if (it == part.tensors.end() ||
        std::none_of(it->second.shards.begin(), it->second.shards.end(),
                     [&](const format::TensorShard& s) { return s.rank == session.rank; })) {
      return false;
    }
  }
  return true;
}

// Whether some registered tensor was saved in another dtype (a restore that casts reads it
// through the planner, which reads memory as well, and casts on the way).
bool DtypesDiffer(const SessionView& session, const format::Manifest& manifest) {
  for (const RegisteredTensor& t : *session.tensors) {
    auto it = manifest.tensors.find(t.name);
    if (it != manifest.tensors.end() && it->second.dtype != t.dtype) return true;
  }
  return false;
}

// Whether `snap` (this rank's own snapshot) restores into the session as it is: the same
// world size, and every selected registered tensor in it, saved with the very same shape
// and placement (and dtype, when the restore would cast). Then the manifest need not be read:
// parsing one of 10,000 tensors took 121 ms, three times the copy of 4 GiB on an H200.
// Anything else, even a placement written another way, takes the manifest's path.
bool FitsAsSaved(const SessionView& session, const StagedSnapshot& snap,
                 const std::unordered_map<std::string_view, size_t>& index, const RestoreSpec& spec) {
  if (snap.world_size != session.world_size) return false;
  const bool cast = spec.cast;
  for (const RegisteredTensor& t : *session.tensors) {
    if (!spec.selection.Selects(t.name)) continue;
    auto it = index.find(t.name);
    // Not in this rank's own snapshot: other ranks may hold it (another layout, the same
    // world size), which only the manifest's path reads.
    if (it == index.end()) return false;
    const format::TensorEntry& e = snap.shard.entries[it->second];
    const TensorPlacement& p = snap.placements[it->second];
    if (e.shape != t.shape || p.global_shape != t.placement.global_shape || p.offset != t.placement.offset ||
        p.flat != t.placement.flat || (cast && e.dtype != t.dtype)) {
      return false;
    }
  }
  return true;
}

// A restore's source as the metrics' tier label names it, and as the log says it.
std::pair<const char*, const char*> SourceNames(RestoreResult::Source source) {
  switch (source) {
    case RestoreResult::Source::kMemory: return {"memory", "memory"};
    case RestoreResult::Source::kRemote: return {"remote", "the remote tier"};
    case RestoreResult::Source::kPeer: return {"peer", "peers' memory"};
    case RestoreResult::Source::kDisk: break;
  }
  return {"disk", "disk"};
}

// The snapshot's tensor entries by name (views into the snapshot's own names).
std::unordered_map<std::string_view, size_t> IndexTensorEntries(const StagedSnapshot& snap) {
  std::unordered_map<std::string_view, size_t> index;
  index.reserve(snap.tensor_count);
  for (size_t i = 0; i < snap.tensor_count; ++i) index.emplace(snap.shard.entries[i].name, i);
  return index;
}

}  // namespace

absl::StatusOr<std::vector<const RegisteredTensor*>> MatchTensors(
    const std::vector<RegisteredTensor>& registered, const std::vector<std::string>& stored,
    const RestoreSpec& spec, uint64_t step, RestoreResult& result, bool report_unregistered) {
  const format::TensorSelection& selection = spec.selection;
  if (selection.train_state_only()) {  // exclude "*": asked for on purpose, never an error
    result.skipped = report_unregistered ? stored.size() : 0;
    return std::vector<const RegisteredTensor*>{};
  }
  std::set<std::string> have;
  for (const std::string& name : stored) {
    if (selection.Selects(name)) have.insert(name);
  }
  std::set<std::string> want;
  std::vector<const RegisteredTensor*> matched;
  std::vector<std::string> missing, unexpected;
  for (const RegisteredTensor& t : registered) {
    if (!selection.Selects(t.name)) continue;
    want.insert(t.name);
    if (have.count(t.name)) {
      matched.push_back(&t);
    } else {
      missing.push_back(t.name);
    }
  }
  for (const std::string& name : have) {
    if (report_unregistered && !want.count(name)) unexpected.push_back(name);
  }
  if (!spec.allow_missing && (!missing.empty() || !unexpected.empty())) {
    std::string message = fmt::format("checkpoint step {} does not match the registered tensors{}:",
                                      step, selection.everything()
                                                ? ""
                                                : fmt::format(" ({})", selection.Describe()));
    if (!missing.empty()) {
      message += fmt::format(" {} registered but not in the checkpoint ({});", missing.size(),
                             JoinSome(missing, 5));
    }
    if (!unexpected.empty()) {
      message += fmt::format(" {} in the checkpoint but not registered ({});", unexpected.size(),
                             JoinSome(unexpected, 5));
    }
    message.pop_back();
    // No hint here: each client names its own way out (Python's strict=False and exclude=,
    // C++'s RestoreOptions).
    return absl::FailedPreconditionError(message);
  }
  if (matched.empty() && !selection.everything()) {
    return absl::InvalidArgumentError(fmt::format(
        "{} selects none of the {} tensors that checkpoint step {} holds for this rank",
        selection.Describe(), stored.size(), step));
  }
  if (matched.empty() && !stored.empty()) {
    // allow_missing with nothing in common (every name gained a prefix, say) would restore
    // the train state onto freshly initialised weights: never report that as a resume.
    return absl::FailedPreconditionError(fmt::format(
        "none of the {} tensors that checkpoint step {} holds for this rank is registered "
        "(e.g. {}); nothing would be restored",
        stored.size(), step, JoinSome(stored, 5)));
  }
  missing.resize(std::min(missing.size(), kMaxListed));
  unexpected.resize(std::min(unexpected.size(), kMaxListed));
  result.not_in_checkpoint = std::move(missing);
  result.not_registered = std::move(unexpected);
  result.tensors = matched.size();
  result.skipped = report_unregistered ? stored.size() - matched.size() : 0;
  return matched;
}

absl::StatusOr<RestoreResult> Restorer::Restore(const SessionView& session,
                                                const RestoreSpec& spec) {
  CKPT_ASSIGN_OR_RETURN(std::vector<uint64_t> steps, Available(session));
  if (spec.step) {
    // The step asked for, by this rank alone: no barrier, and no fallback either.
    if (!std::binary_search(steps.begin(), steps.end(), *spec.step)) {
      return absl::NotFoundError(fmt::format(
          "job {} has no committed checkpoint at step {} for rank {} on this node", session.job,
          *spec.step, session.rank));
    }
    return RestoreStep(session, spec, *spec.step);
  }
  return RestoreLatest(session, spec, std::move(steps));
}

// Every rank restores the agreed step, then all share how it went. A step some rank finds
// damaged (its shard fails its checksums, say) is given up by every rank, with a warning
// naming it, and the ranks agree on the newest step left; ranks that had restored it just
// restore the older one over it. Any other failure fails every rank, naming the rank, so
// that no rank trains on while another could not resume.
absl::StatusOr<RestoreResult> Restorer::RestoreLatest(const SessionView& session,
                                                      const RestoreSpec& spec,
                                                      std::vector<uint64_t> steps) {
  auto& log = log::Get(log::Component::kControl);
  std::vector<std::string> damaged;  // "step N: rank R: why", in the order they were found
  for (int tries = 0;; ++tries) {
    CKPT_ASSIGN_OR_RETURN(std::optional<uint64_t> agreed,
                          agreement_.Agree(session.job, session.rank, session.world_size, steps,
                                           agree_timeout_));
    if (!agreed) {
      if (damaged.empty()) return RestoreResult{};  // nothing to restore: a fresh start
      // Never a silent fresh start while checkpoints exist.
      return absl::DataLossError(fmt::format("job {}: every committed step is damaged ({})",
                                             session.job, fmt::join(damaged, "; ")));
    }
    absl::StatusOr<RestoreResult> mine = RestoreStep(session, spec, *agreed);
    std::string outcome = mine.ok()               ? ""
                          : absl::IsDataLoss(mine.status()) ? "damaged "
                                                            : "failed ";
    if (!mine.ok()) outcome += Message(mine.status()).substr(0, 2000);
    CKPT_ASSIGN_OR_RETURN(std::vector<SharedOutcome> outcomes,
                          agreement_.ShareOutcomes(session.job, session.rank, session.world_size,
                                                   *agreed, outcome, agree_timeout_));
    if (outcome.rfind("failed ", 0) == 0) return mine.status();
    std::vector<std::string> damage;
    for (const SharedOutcome& shared : outcomes) {
      const std::string& o = shared.outcome;
      const std::string others = shared.ranks > 1 ? fmt::format(" and {} other ranks", shared.ranks - 1) : "";
      if (o.rfind("failed ", 0) == 0) {
        return absl::AbortedError(fmt::format(
            "job {}: rank {}{} could not restore step {} ({}), so no rank resumes from it",
            session.job, shared.rank, others, *agreed, o.substr(7)));
      }
      if (o.rfind("damaged ", 0) == 0) damage.push_back(fmt::format("rank {}{}: {}", shared.rank, others, o.substr(8)));
    }
    if (damage.empty()) {
      for (const std::string& d : damaged) {
        mine->warnings.push_back(fmt::format("{}; restored step {} instead", d, *agreed));
      }
      return mine;
    }
    std::string why = fmt::format("step {} is damaged ({}{})", *agreed,
                                  fmt::join(damage.begin(), damage.begin() + std::min<size_t>(damage.size(), 3), "; "),
                                  damage.size() > 3 ? "; ..." : "");
    log.warn("[{}/r{}] {}: falling back to an older step", session.job, session.rank, why);
    damaged.push_back(std::move(why));
    steps.erase(std::remove(steps.begin(), steps.end(), *agreed), steps.end());
    if (tries + 1 >= kMaxFallbacks) {
      return absl::DataLossError(fmt::format("job {}: the {} newest common steps are damaged ({})",
                                             session.job, kMaxFallbacks, fmt::join(damaged, "; ")));
    }
  }
}

absl::StatusOr<RestoreResult> Restorer::RestoreStep(const SessionView& session,
                                                    const RestoreSpec& spec, uint64_t step) {
  RestoreResult result;
  persist::RetentionKeeper::Pin pin(retention_, session.job, step);
  auto started = std::chrono::steady_clock::now();
  result.found = true;
  result.step = step;
  StagedSnapshotPtr hot = hot_.Find(session.job, session.rank, step);
  std::optional<format::Manifest> peer_manifest;
  if (!hot && peers_ != nullptr && !store_.HasRankFile(session.job, step, session.rank)) {
    // This node lost its copy (a replacement machine, a root deleted): its coding group's
    // memory before the remote tier.
    absl::StatusOr<std::pair<StagedSnapshotPtr, format::Manifest>> rebuilt = FromPeers(session, spec, step);
    if (rebuilt.ok()) {
      hot = std::move(rebuilt->first);
      peer_manifest = std::move(rebuilt->second);
    } else {
      log::Get(log::Component::kControl)
          .warn("[{}/r{} s{}] not from peers: {}{}", session.job, session.rank, step, Message(rebuilt.status()),
                remote_ != nullptr ? "; trying the remote tier" : "");
    }
  }
  const EntryIndex entries = hot ? IndexTensorEntries(*hot) : EntryIndex{};
  if (peer_manifest) {
    result.source = RestoreResult::Source::kPeer;
    result.saved_world_size = peer_manifest->world_size;
    CKPT_RETURN_IF_ERROR(FromMemory(session, spec, *hot, entries, result));
  } else if (hot && FitsAsSaved(session, *hot, entries, spec) && store_.Committed(session.job, step)) {
    // Still committed: retention drops a hot copy only after deleting its step, and the pin
    // above came too late for a deletion already under way.
    // The fast path of a crashed trainer: its own snapshot, straight into its buffers.
    result.source = RestoreResult::Source::kMemory;
    result.saved_world_size = hot->world_size;
    CKPT_RETURN_IF_ERROR(FromMemory(session, spec, *hot, entries, result));
  } else {
    // This node's copy of the manifest when it has the step; the remote tier's otherwise. Of
    // an indexed step, the part holding this rank: a restore in the saved layout needs no
    // other node's (at 1,000 nodes x 8 ranks x 200 tensors the parts are 370 MB together).
    format::CheckpointStore* tier = &store_;
    bool from_index = false;
    absl::StatusOr<format::Manifest> manifest = store_.LoadManifestForRank(session.job, step, session.rank, &from_index);
    if (!manifest.ok() && absl::IsNotFound(manifest.status()) && remote_ != nullptr) {
      tier = remote_;
      manifest = remote_->LoadManifestForRank(session.job, step, session.rank, &from_index);
    }
    CKPT_RETURN_IF_ERROR(manifest.status());
    if (from_index && !PartServes(session, spec, *manifest)) {
      // Another layout, or tensors this node's ranks did not save: the whole step, its parts
      // joined (never a guess from one node's part at what the step lacks).
      manifest = tier->LoadManifest(session.job, step);
      CKPT_RETURN_IF_ERROR(manifest.status());
    }
    result.saved_world_size = manifest->world_size;
    if (hot && manifest->world_size == session.world_size && SamePlacement(session, *manifest) &&
        !(spec.cast && DtypesDiffer(session, *manifest))) {
      result.source = RestoreResult::Source::kMemory;
      CKPT_RETURN_IF_ERROR(FromMemory(session, spec, *hot, entries, result));
    } else {
      CKPT_RETURN_IF_ERROR(FromPlan(session, spec, *manifest, result));
    }
  }
  const auto [tier, source] = SourceNames(result.source);
  metrics::Metrics().restore_seconds.With({tier}).Observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  metrics::Metrics().restored_bytes.With({tier}).Add(static_cast<double>(result.bytes));
  log::Get(log::Component::kControl)
      .info("[{}/r{} s{}] restored {} tensors ({} bytes, {} read from storage; {} skipped) from {} in {:.1f} ms",
            session.job, session.rank, step, result.tensors, result.bytes, result.bytes_read,
            result.skipped, source,
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
  return result;
}

absl::StatusOr<std::vector<uint64_t>> Restorer::Available(const SessionView& session) {
  CKPT_ASSIGN_OR_RETURN(auto committed, store_.ListRunsAndSteps(session.job));
  std::vector<std::pair<uint64_t, uint64_t>> available;  // (run, step)
  for (const auto& [run, step] : committed) {
    // In a group each node holds only its own ranks' shards of a step.
    if (hot_.Find(session.job, session.rank, step) ||
        store_.HasRankFile(session.job, step, session.rank)) {
      available.emplace_back(run, step);
      continue;
    }
    // A rank the step was not saved with (the job grew): it can restore from the step
    // where this node holds every shard, in memory or on disk.
    // (Of an indexed step its index alone: the world and which ranks there are.)
    auto manifest = store_.LoadManifest(session.job, step, format::CheckpointStore::Depth::kIndexOnly);
    // A node's part of a step saved across nodes never holds every shard.
    if (!manifest.ok() || session.rank < manifest->world_size || manifest->scope) continue;
    std::set<uint32_t> all;
    for (const format::ManifestShard& s : manifest->shards) all.insert(s.rank);
    for (const format::ManifestNode& n : manifest->nodes) all.insert(n.ranks.begin(), n.ranks.end());
    if (LocalHasAll(session.job, step, all, *manifest)) available.emplace_back(run, step);
  }
  if (peers_ != nullptr && available.empty()) {
    // Nothing here for this rank (a node restarted empty): what its coding group holds.
    std::vector<std::pair<uint64_t, uint64_t>> held = peers_->Steps(session.job, session.rank, session.uid);
    available.insert(available.end(), held.begin(), held.end());
  }
  if (remote_ != nullptr) {
    // Every step of the remote tier is whole: any rank of any node can read it (a node
    // that lost its disk, or a job restarted on other nodes or another world size).
    absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> uploaded =
        remote_->ListRunsAndSteps(session.job);
    if (uploaded.ok()) {
      available.insert(available.end(), uploaded->begin(), uploaded->end());
    } else {
      // The local tiers still serve; a remote tier that cannot be listed is no reason to
      // fail a restore, but is no reason to be silent either.
      log::Get(log::Component::kControl)
          .warn("[{}/r{}] the remote tier cannot be listed: {}", session.job, session.rank,
                Message(uploaded.status()));
    }
  }
  // In the job's order; a step both tiers hold (the same run, so side by side) once.
  std::sort(available.begin(), available.end());
  std::vector<uint64_t> steps;
  for (const auto& [run, step] : available) {
    if (steps.empty() || steps.back() != step) steps.push_back(step);
  }
  return steps;
}

absl::StatusOr<std::pair<StagedSnapshotPtr, format::Manifest>> Restorer::FromPeers(const SessionView& session,
                                                                                    const RestoreSpec& spec,
                                                                                    uint64_t step) {
  CKPT_ASSIGN_OR_RETURN(std::string text, peers_->Manifest(session.job, step, session.uid));
  CKPT_ASSIGN_OR_RETURN(format::Manifest manifest, format::ParseManifest(text, "a peer's copy of this node's manifest"));
  if (manifest.job != session.job || manifest.step != step || manifest.index) {
    return absl::DataLossError(fmt::format("a peer's manifest of step {} is of job {} step {}{}", step, manifest.job,
                                           manifest.step, manifest.index ? ", an index" : ""));
  }
  if (!PartServes(session, spec, manifest) || (spec.cast && DtypesDiffer(session, manifest))) {
    return absl::FailedPreconditionError(
        "the restore asks for another world size, placement or dtype than saved, which needs the whole step");
  }
  const format::ManifestShard* saved = manifest.Shard(session.rank);
  if (saved == nullptr) {
    return absl::DataLossError(fmt::format("a peer's manifest of step {} has no shard of rank {}", step, session.rank));
  }
  // Its file (header and data) bounds its data region: no peer makes this node hold more.
  // Into staging memory where it has room (pinned, and touched already when prefaulted: no
  // page faults as the fragments land), else the heap.
  auto allocate = [this](size_t bytes) -> std::shared_ptr<char> {
    if (pool_ == nullptr) return nullptr;
    absl::StatusOr<cuda::StagingBlockPtr> block = pool_->Allocate(bytes);
    if (!block.ok()) return nullptr;
    char* data = (*block)->data();
    return std::shared_ptr<char>(std::shared_ptr<cuda::StagingBlock>(std::move(*block)), data);
  };
  CKPT_ASSIGN_OR_RETURN(ShardBytes shard,
                        peers_->Shard(session.job, step, session.rank, session.uid, saved->bytes, allocate));
  CKPT_ASSIGN_OR_RETURN(StagedSnapshotPtr snap, RebuiltSnapshot(manifest, session.rank, std::move(shard)));
  return std::pair{std::move(snap), std::move(manifest)};
}

bool Restorer::LocalHasAll(const std::string& job, uint64_t step, const std::set<uint32_t>& ranks,
                           const format::Manifest& manifest) {
  for (uint32_t rank : ranks) {
    if (hot_.Find(job, rank, step)) continue;
    // Not listed: outside the world, or another node's in a node-scoped manifest. An index
    // lists no shards: each rank's file has its one name.
    const format::ManifestShard* shard = manifest.Shard(rank);
    if (manifest.index && rank < manifest.world_size) {
      if (!store_.HasRankFile(job, step, rank)) return false;
      continue;
    }
    if (shard == nullptr || !store_.HasFile(job, step, shard->file)) return false;
  }
  return true;
}

absl::Status Restorer::FromMemory(const SessionView& session, const RestoreSpec& spec, const StagedSnapshot& snap,
                                  const EntryIndex& entries, RestoreResult& result) {
  std::vector<std::string> stored;
  for (size_t i = 0; i < snap.tensor_count; ++i) stored.push_back(snap.shard.entries[i].name);
  CKPT_ASSIGN_OR_RETURN(std::vector<const RegisteredTensor*> matched,
                        MatchTensors(*session.tensors, stored, spec, snap.step, result));
  SplitCopy job;
  std::vector<std::string> problems;
  for (const RegisteredTensor* tensor : matched) {
    const RegisteredTensor& t = *tensor;
    const format::TensorEntry& e = snap.shard.entries[entries.at(t.name)];
    if (std::optional<std::string> problem =
            format::LayoutProblem(t.name, e.dtype, e.shape, t.dtype, t.shape, "shape")) {
      problems.push_back(std::move(*problem));
      continue;
    }
    job.Add(t, {t.data, snap.shard.Data(e), t.nbytes});
    result.bytes += t.nbytes;
  }
  if (!problems.empty()) return format::CannotRead(problems, snap.step);  // nothing copied yet
  {
    cuda::CopyPriority::Copying copying(priority_);
    CKPT_RETURN_IF_ERROR(CopySplit(engine_, device_engines_, job));
  }
  for (size_t i = snap.tensor_count; i < snap.shard.entries.size(); ++i) {
    const format::TensorEntry& e = snap.shard.entries[i];
    result.train_state.push_back({snap.train_state_names[i - snap.tensor_count],
                                  std::string(snap.shard.Data(e), e.end - e.begin)});
  }
  result.metadata = snap.shard.metadata;
  return absl::OkStatus();
}

absl::Status Restorer::FromPlan(const SessionView& session, const RestoreSpec& spec,
                                const format::Manifest& manifest, RestoreResult& result) {
  // With the saved world size each rank compares its registration with its own saved
  // pieces, so a tensor it does not register is named (pipeline stages hold different
  // tensors, so only this rank's count). A tensor it registers that only other ranks saved
  // is read from theirs: the same world size in another layout (FSDP1's flat shards hold
  // no piece of some tensors on some ranks; FSDP2 then wants a piece of each on every rank).
  // With another world size, or the same in another layout (FSDP2 saved a piece of every
  // tensor on every rank; FSDP1's flat shards leave some out), no rank knows which tensors
  // the others will take: what it registers must be in the checkpoint, nothing more.
  const bool same_world = manifest.world_size == session.world_size;
  const bool same_layout = same_world && SamePlacement(session, manifest);
  std::set<std::string_view> registered;
  for (const RegisteredTensor& t : *session.tensors) registered.insert(t.name);
  std::vector<std::string> stored;
  for (const auto& [name, tensor] : manifest.tensors) {
    bool mine = std::any_of(tensor.shards.begin(), tensor.shards.end(),
                            [&](const format::TensorShard& s) { return s.rank == session.rank; });
    if (mine || !same_world || registered.count(name) != 0) stored.push_back(name);
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<const RegisteredTensor*> matched,
                        MatchTensors(*session.tensors, stored, spec, manifest.step, result,
                                     /*report_unregistered=*/same_layout));
  std::vector<format::WantedTensor> wanted;
  std::vector<bool> cast;  // per matched tensor: read in its saved dtype, then cast
  uint64_t total = 0;
  for (const RegisteredTensor* t : matched) {
    std::string dtype = t->dtype;
    if (auto saved = manifest.tensors.find(t->name); spec.cast && saved != manifest.tensors.end() &&
                                                      IsFloatDType(saved->second.dtype) &&
                                                      IsFloatDType(t->dtype)) {
      dtype = saved->second.dtype;
    }
    cast.push_back(dtype != t->dtype);
    wanted.push_back({t->name, dtype, t->shape, t->placement.global_shape, t->placement.offset,
                      t->placement.flat, std::nullopt});
    total += t->nbytes;
  }
  format::ReadPlanOptions options;
  options.prefer_rank = session.rank;  // of replicas, its own (in memory here, or local)
  absl::StatusOr<format::ReadPlan> plan = format::PlanRead(manifest, wanted, options);
  if (!plan.ok()) {
    if (absl::IsDataLoss(plan.status())) return plan.status();
    return absl::FailedPreconditionError(fmt::format(
        "rank {} cannot restore step {} in its registered placement: {}", session.rank,
        manifest.step, Message(plan.status())));
  }

  // 1. Everything is read into ckptd's memory and checked first, so a corrupt or crafted
  //    file is refused without having touched the trainer's buffers. A tensor to be cast
  //    gets room for the wider of its two dtypes, and is cast there.
  std::vector<uint64_t> room(matched.size());
  uint64_t bounce_bytes = 0;
  for (size_t i = 0; i < matched.size(); ++i) {
    room[i] = std::max(matched[i]->nbytes, plan->tensors[i].bytes);
    bounce_bytes += room[i];
  }
  cuda::StagingBlockPtr block;
  std::unique_ptr<char[]> heap;
  char* bounce = nullptr;
  if (pool_ != nullptr) {
    if (auto allocated = pool_->Allocate(std::max<uint64_t>(bounce_bytes, 1)); allocated.ok()) {
      block = std::move(*allocated);
      bounce = block->data();
    }
  }
  if (bounce == nullptr) {
    // Staging memory is busy with snapshots: borrow ordinary memory for the restore.
    heap.reset(new (std::nothrow) char[std::max<uint64_t>(bounce_bytes, 1)]);
    if (heap == nullptr) {
      return absl::ResourceExhaustedError(fmt::format(
          "restoring rank {} needs {} bytes of memory to check the checkpoint before it reaches "
          "the trainer, and none is free",
          session.rank, bounce_bytes));
    }
    bounce = heap.get();
  }
  // This node's disk when it holds every shard the plan reads (or memory does); the
  // remote tier otherwise, which holds them all.
  const uint32_t state_rank = session.rank < manifest.world_size ? session.rank : 0;
  std::set<uint32_t> ranks_read{state_rank};
  for (const format::TensorReadPlan& t : plan->tensors) {
    for (const format::ShardRead& r : t.reads) ranks_read.insert(r.rank);
  }
  const bool from_remote = remote_ != nullptr &&
                           !LocalHasAll(manifest.job, manifest.step, ranks_read, manifest) &&
                           remote_->Committed(manifest.job, manifest.step);
  // --remote-mode direct: this node's store is the remote tier itself.
  const bool remote_source = from_remote || storage::IsS3Url(store_.root());
  format::PlanReader reader(
      from_remote ? remote_->objects() : store_.objects(),
      format::CheckpointStore::StepKey(manifest.job, manifest.step), manifest,
      [&](uint32_t rank) -> std::optional<format::MemoryShard> {
        StagedSnapshotPtr snap = hot_.Find(manifest.job, rank, manifest.step);
        if (!snap) return std::nullopt;
        return format::MemoryShard{snap, &snap->shard.region, &snap->shard.entries, snap->tensor_count,
                                   &snap->train_state_names};
      });
  CKPT_RETURN_IF_ERROR(reader.Open(plan->tensors));
  // The remote tier answers each request after a round trip, and many at once: several
  // tensors are fetched at a time there (each in parallel ranged GETs of its own). A local
  // disk is kept busy by a few reads at once, each hashed on its own thread.
  Parallel reads(remote_source ? kRemoteTensorsAtOnce : kLocalTensorsAtOnce);
  uint64_t offset = 0;
  SplitCopy copy;
  for (size_t i = 0; i < matched.size(); ++i) {
    const RegisteredTensor& t = *matched[i];
    char* into = bounce + offset;
    const std::string saved_dtype = wanted[i].dtype;
    const bool convert = cast[i];  // a copy: vector<bool>'s element is a proxy into the vector
    auto read = [&reader, &tensor = plan->tensors[i], into, &t, saved_dtype, convert]() -> absl::Status {
      CKPT_RETURN_IF_ERROR(reader.Read(tensor, into));
      if (!convert) return absl::OkStatus();
      CKPT_ASSIGN_OR_RETURN(size_t itemsize, DTypeSize(saved_dtype));
      ConvertElements(saved_dtype, t.dtype, into, into, tensor.bytes / itemsize);
      return absl::OkStatus();
    };
    if (remote_source || plan->tensors[i].bytes >= kLocalReadAsideBytes) {
      CKPT_RETURN_IF_ERROR(reads.Run(read));
    } else {
      CKPT_RETURN_IF_ERROR(read());
    }
    copy.Add(t, {t.data, into, t.nbytes});
    offset += room[i];
  }
  CKPT_RETURN_IF_ERROR(reads.Wait());
  // Train state and metadata: the same rank's where the checkpoint has it, else rank 0's
  // (a job that grew: its new ranks start from rank 0's schedule and counters).
  CKPT_ASSIGN_OR_RETURN(std::vector<format::NamedBytes> train_state, reader.TrainState(state_rank));
  for (format::NamedBytes& blob : train_state) {
    result.train_state.push_back({std::move(blob.name), std::move(blob.data)});
  }

  // 2. Only now into the trainer's buffers (GPU tensors through their device's engine).
  {
    cuda::CopyPriority::Copying copying(priority_);
    CKPT_RETURN_IF_ERROR(CopySplit(engine_, device_engines_, copy));
  }
  result.bytes += total;
  if (const format::ManifestShard* shard = manifest.Shard(state_rank)) result.metadata = shard->metadata;
  result.bytes_read += reader.bytes_from_disk();
  result.source = reader.bytes_from_disk() == 0 ? RestoreResult::Source::kMemory
                  : remote_source               ? RestoreResult::Source::kRemote
                                                : RestoreResult::Source::kDisk;
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
