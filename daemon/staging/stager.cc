#include "daemon/staging/stager.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <string_view>
#include <cstring>

#include "common/log.h"
#include "common/names.h"
#include "common/status.h"
#include "format/manifest.h"
#include "format/user_files.h"
#include "daemon/staging/cow_copy.h"
#include "daemon/staging/snapshot_layout.h"
#include "shm/sealed_segment.h"

namespace ckpt::daemon {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kSession); }

}  // namespace

absl::Status CopySplit(cuda::CopyEngine& host, const std::vector<cuda::CopyEngine*>& device_engines,
                       const SplitCopy& job, void* device_after) {
  for (const auto& [device, regions] : job.device) {
    if (device < 0 || static_cast<size_t>(device) >= device_engines.size() ||
        device_engines[device] == nullptr) {
      return absl::FailedPreconditionError(fmt::format("GPU {} tensors but no CUDA engine for it", device));
    }
    CKPT_RETURN_IF_ERROR(device_engines[device]->Copy(regions, device_after));
  }
  return job.host.empty() ? absl::OkStatus() : host.Copy(job.host);
}

absl::StatusOr<Stager::Reserved> Stager::Reserve(const SessionView& session, const std::vector<size_t>& sizes,
                                                 const std::string& context, bool make_room) {
  auto deadline = std::chrono::steady_clock::now() + options_.busy_wait;
  size_t bytes = 0;
  for (size_t n : sizes) bytes += n;
  while (true) {
    absl::Status why;
    absl::StatusOr<StagingLedger::HoldPtr> hold = StagingLedger::HoldPtr();
    if (options_.ledger != nullptr) hold = options_.ledger->Admit(session.uid, session.job, bytes);
    if (hold.ok()) {
      Reserved out;
      absl::Status block = absl::OkStatus();
      for (size_t n : sizes) {
        absl::StatusOr<cuda::StagingBlockPtr> allocated = pool_.Allocate(n);
        if (!allocated.ok()) {
          block = allocated.status();
          break;
        }
        out.blocks.push_back(std::move(*allocated));
      }
      if (block.ok()) {
        out.hold = std::move(*hold);
        return out;
      }
      out.blocks.clear();
      hold->reset();
      // A frozen block this snapshot shares is held by its plan: evicting the hot copy that
      // also holds it frees that copy's own block only, and the frozen one stays shared.
      if (make_room && hot_.EvictOne()) continue;
      why = absl::ResourceExhaustedError(fmt::format(
          "staging memory busy ({}; earlier snapshots are still being written)",
          Message(block)));
    } else {
      why = hold.status();
    }
    if (!make_room || options_.when_busy == WhenBusy::kSkip || std::chrono::steady_clock::now() >= deadline) {
      return absl::ResourceExhaustedError(
          fmt::format("{} skipped: {}; --when-busy={}", context, Message(why),
                      options_.when_busy == WhenBusy::kSkip ? "skip" : "wait"));
    }
    progress_.WaitFor(std::chrono::milliseconds(50));
  }
}

namespace {

// How far the watermark may move while the copy runs: never to the shard's last byte, which
// lands only once the trainer has been released (Stage). A writer that has all but the last
// byte cannot finish the shard, so a snapshot the trainer abandoned during the copy fails
// there instead of being written, and committed, with torn tensors.
uint64_t HeldBack(const StagedSnapshot& snap, uint64_t landed) {
  return snap.shard.data_bytes == 0 ? 0 : std::min(landed, snap.shard.data_bytes - 1);
}

void FailSnapshot(StagedSnapshot& snap, const absl::Status& why) { snap.landed.Fail(Message(why)); }

// Whether a snapshot is a check that could share instead: every frozen tensor it would copy
// is known and still staged.
bool CanPutOffCheck(const FrozenPlan& plan, const std::vector<EntryPlace>& places) {
  if (!plan.check) return false;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (places[i] == EntryPlace::kFrozen && plan.tensors[i].block == nullptr) return false;
  }
  return true;
}

// Makes a check (CanPutOffCheck) a plain snapshot that shares its frozen tensors.
void PutOffCheck(FrozenPlan& plan, std::vector<EntryPlace>& places) {
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    if (places[i] != EntryPlace::kFrozen) continue;
    plan.tensors[i].share = true;
    places[i] = EntryPlace::kShared;
  }
  plan.check = false;
}

absl::Status Abandoned(std::string_view context) {
  return absl::AbortedError(fmt::format(
      "{}{}the trainer stopped waiting for it (ckptd did not answer in time) and may have "
      "changed its tensors during the copy: not committed",
      context, context.empty() ? "" : ": "));
}

}  // namespace

absl::StatusOr<StagedSnapshotPtr> Stager::Stage(const SessionView& session, uint64_t step,
                                                shm::SnapshotPayload payload,
                                                const OnLaidOut& on_laid_out,
                                                const OnReleased& on_released) {
  const std::vector<RegisteredTensor>& tensors = *session.tensors;
  uint64_t total = 0;
  for (const RegisteredTensor& t : tensors) total += t.nbytes;
  if (step > format::kMaxStep) {
    return absl::InvalidArgumentError(fmt::format(
        "step {} is beyond the largest step a checkpoint directory can name ({})", step,
        format::kMaxStep));
  }
  // Everything the trainer sent is checked before any of it is used: it ends up in JSON
  // headers and manifests, where a byte that is not text would fail the write later.
  CKPT_RETURN_IF_ERROR(ValidateMetadata(payload.metadata));
  std::set<std::string_view> names;
  for (const shm::NamedBlob& blob : payload.train_state) {
    CKPT_RETURN_IF_ERROR(Annotate(ValidateTensorName(blob.name), "train state"));
    if (!names.insert(blob.name).second) {
      return absl::InvalidArgumentError(
          fmt::format("train state \"{}\" is given twice", blob.name));
    }
    total += blob.data.size();
  }
  // Files the trainer stores with the step ("file/<name>"): names an export can write, and
  // small (format/user_files.h).
  std::vector<std::pair<std::string_view, uint64_t>> blobs;
  for (const shm::NamedBlob& blob : payload.train_state) blobs.emplace_back(blob.name, blob.data.size());
  CKPT_RETURN_IF_ERROR(format::CheckUserFiles(blobs));
  std::string context = fmt::format("[{}/r{} s{}] snapshot", session.job, session.rank, step);

  auto snap = std::make_shared<StagedSnapshot>();
  snap->job = session.job;
  snap->step = step;
  snap->rank = session.rank;
  snap->world_size = session.world_size;
  snap->tensor_count = tensors.size();
  uint64_t offset = 0;
  for (const RegisteredTensor& t : tensors) {
    snap->shard.entries.push_back({t.name, t.dtype, t.shape, offset, offset + t.nbytes});
    snap->placements.push_back(t.placement);
    offset += t.nbytes;
  }
  if (std::any_of(tensors.begin(), tensors.end(), [](const RegisteredTensor& t) { return t.sparse; })) {
    for (const RegisteredTensor& t : tensors) snap->sparse.push_back(t.sparse);
  }
  for (const shm::NamedBlob& blob : payload.train_state) {
    snap->shard.entries.push_back({format::TrainStateKey(blob.name), "U8",
                                   {static_cast<int64_t>(blob.data.size())}, offset,
                                   offset + blob.data.size()});
    snap->train_state_names.push_back(blob.name);
    offset += blob.data.size();
  }

  // Where each entry goes (snapshot_layout.h). The plan holds the frozen blocks it shares,
  // so making room below cannot free them.
  FrozenPlan frozen = session.frozen != nullptr ? session.frozen->Plan(tensors) : FrozenPlan{};
  std::vector<EntryPlace> places(snap->shard.entries.size(), EntryPlace::kOwn);
  for (size_t i = 0; i < frozen.tensors.size(); ++i) {
    if (!frozen.tensors[i].frozen) continue;
    places[i] = frozen.tensors[i].share ? EntryPlace::kShared : EntryPlace::kFrozen;
  }
  // The own block and, for frozen tensors copied from the trainer, a new frozen block, both
  // admitted to the job's share at once; the frozen block's part then counts for as long as
  // the block lives (the snapshots that share it later count only their own).
  SnapshotLayout layout = LayOut(snap->shard.entries, places);
  const bool copies_frozen = std::find(places.begin(), places.end(), EntryPlace::kFrozen) != places.end();
  std::vector<size_t> sizes{layout.own_bytes};
  if (copies_frozen) sizes.push_back(layout.frozen_bytes);
  // A check that finds no room for a second copy of the frozen tensors shares the last one
  // instead, and the next snapshot checks: it neither evicts hot copies nor waits for room
  // to make one, until it has been put off FrozenTensors::kChecksPutOffAtMost times.
  const bool can_put_off = copies_frozen && CanPutOffCheck(frozen, places);
  absl::StatusOr<Reserved> reserved = Reserve(session, sizes, can_put_off ? context + "'s check of frozen tensors" : context,
                                              !can_put_off || frozen.force_check);
  if (!reserved.ok() && can_put_off) {
    PutOffCheck(frozen, places);
    const uint32_t times = session.frozen->CheckPutOff();
    const std::string line =
        fmt::format("{} ({} in a row): put off to the next snapshot", Message(reserved.status()), times);
    if (frozen.force_check) {
      Log().warn("{}; a frozen tensor changed in place goes unseen until one runs (raise --staging-bytes)", line);
    } else {
      Log().info("{}", line);
    }
    layout = LayOut(snap->shard.entries, places);
    reserved = Reserve(session, {layout.own_bytes}, context);
  } else if (reserved.ok() && frozen.check) {
    session.frozen->CheckRan();
  }
  CKPT_RETURN_IF_ERROR(reserved.status());
  std::shared_ptr<FrozenBlock> new_frozen;
  if (reserved->blocks.size() > 1) {
    StagingLedger::HoldPtr hold = reserved->hold ? reserved->hold->Split(layout.frozen_bytes) : nullptr;
    new_frozen = std::make_shared<FrozenBlock>(FrozenBlock{std::move(reserved->blocks[1]), std::move(hold)});
  }
  cuda::StagingBlockPtr own = std::move(reserved->blocks[0]);

  // The region, and where the copy writes each entry (null: shared, in place already).
  std::vector<char*> to(snap->shard.entries.size(), nullptr);
  std::map<const FrozenBlock*, int> block_index;
  auto index_of = [&](const std::shared_ptr<const FrozenBlock>& block) {
    auto [it, added] = block_index.emplace(block.get(), static_cast<int>(snap->frozen_blocks.size()));
    if (added) snap->frozen_blocks.push_back(block);
    return it->second;
  };
  if (!frozen.tensors.empty()) {
    snap->frozen.resize(tensors.size());
    snap->frozen_sums = session.frozen->sums();
  }
  for (size_t i = 0; i < snap->shard.entries.size(); ++i) {
    const format::TensorEntry& e = snap->shard.entries[i];
    const char* at = nullptr;
    switch (places[i]) {
      case EntryPlace::kOwn:
        to[i] = own->data() + layout.offset[i];
        at = to[i];
        break;
      case EntryPlace::kFrozen:
        to[i] = new_frozen->block->data() + layout.offset[i];
        at = to[i];
        snap->frozen[i].block = index_of(new_frozen);
        break;
      case EntryPlace::kShared:
        at = frozen.tensors[i].at;
        snap->frozen[i].block = index_of(frozen.tensors[i].block);
        snap->frozen[i].shared = true;
        snap->frozen[i].generation = frozen.tensors[i].generation;
        snap->shared_bytes += e.end - e.begin;
        break;
    }
    if (i < snap->frozen.size()) snap->frozen[i].frozen = frozen.tensors[i].frozen;
    snap->shard.region.Append(at, e.end - e.begin);
  }
  snap->shard.rank = session.rank;
  snap->shard.data_bytes = total;
  snap->shard.metadata = std::move(payload.metadata);
  snap->shard.landed = &snap->landed;
  snap->block = std::move(own);
  snap->in_flight = std::move(reserved->hold);
  if (on_laid_out) on_laid_out(snap);

  auto copy_started = std::chrono::steady_clock::now();
  bool released = false;
  absl::Status copied = Annotate(CopyTensors(session, *snap, to, on_released, released), context);
  if (!copied.ok()) {
    FailSnapshot(*snap, copied);
    return copied;
  }
  if (!released && on_released && !on_released()) {
    absl::Status abandoned = Abandoned(context);
    FailSnapshot(*snap, abandoned);
    return abandoned;
  }
  snap->copy_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_started).count();
  for (size_t i = 0; i < payload.train_state.size(); ++i) {
    const size_t entry = snap->tensor_count + i;
    const format::TensorEntry& e = snap->shard.entries[entry];
    std::memcpy(to[entry], payload.train_state[i].data.data(), e.end - e.begin);
  }
  // Before the last byte lands: a writer that waited for it reads the generations.
  if (!frozen.tensors.empty()) SetGenerations(*session.frozen, frozen, to, *snap);
  snap->landed.Advance(total);
  return snap;
}

void Stager::SetGenerations(FrozenTensors& state, const FrozenPlan& plan, const std::vector<char*>& to,
                            StagedSnapshot& snap) {
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const FrozenPlan::Tensor& p = plan.tensors[i];
    StagedSnapshot::FrozenEntry& f = snap.frozen[i];
    if (!p.frozen || f.shared) continue;
    const format::TensorEntry& e = snap.shard.entries[i];
    if (p.block != nullptr) {
      // A check: the trainer's bytes against those last seen.
      if (std::memcmp(to[i], p.at, e.end - e.begin) == 0) {
        f.generation = p.generation;
        continue;
      }
      snap.frozen_changed.push_back(e.name);
      state.ChangedInPlace(e.name);
    }
    f.generation = state.NewGeneration();
  }
}

absl::Status Stager::CopyHostTensors(const SessionView& session, StagedSnapshot& snap, const std::vector<char*>& to,
                                     const std::vector<bool>& only) {
  SplitCopy job;
  for (size_t i = 0; i < snap.tensor_count; ++i) {
    if (!only[i]) continue;
    const format::TensorEntry& e = snap.shard.entries[i];
    job.Add((*session.tensors)[i], {to[i], (*session.tensors)[i].data, e.end - e.begin});
  }
  return CopySplit(engine_, device_engines_, job, session.cuda_after);
}

absl::Status Stager::CopyTensors(const SessionView& session, StagedSnapshot& snap, const std::vector<char*>& to,
                                 const OnReleased& on_released, bool& released) {
  const std::vector<RegisteredTensor>& tensors = *session.tensors;
  const uint64_t tensor_bytes = snap.tensor_count == 0 ? 0 : snap.shard.entries[snap.tensor_count - 1].end;
  // Frozen tensors shared from an earlier snapshot are not the trainer's to copy.
  auto shared = [&](size_t i) { return to[i] == nullptr; };
  std::vector<bool> cow(tensors.size(), false);
  if (session.write_protect != nullptr) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      cow[i] = !tensors[i].on_device && tensors[i].trainer_address != 0 && tensors[i].nbytes > 0 && !shared(i);
    }
  }
  if (std::find(cow.begin(), cow.end(), true) != cow.end()) {
    cuda::CopyPriority::Copying copying(priority_);
    std::vector<bool> rest(cow.size());
    std::vector<CowCopy::Region> regions;
    for (size_t i = 0; i < cow.size(); ++i) {
      rest[i] = !cow[i] && !shared(i);
      if (!cow[i]) continue;
      regions.push_back({tensors[i].trainer_address, tensors[i].nbytes, tensors[i].data, to[i]});
    }
    // What cannot be write-protected (GPU tensors, small arenas) is copied first.
    CKPT_RETURN_IF_ERROR(CopyHostTensors(session, snap, to, rest));
    const uint64_t page = std::max<uint64_t>(shm::HugePageSize(), 4096);
    CowCopy copy(*session.write_protect, std::move(regions),
                 (options_.cow_chunk_bytes + page - 1) / page * page);
    if (absl::Status protected_ = copy.Protect(); !protected_.ok()) {
      Log().warn("[{}/r{} s{}] copy-on-write unavailable for this snapshot, copying instead: {}",
                 session.job, session.rank, snap.step, Message(protected_));
      CKPT_RETURN_IF_ERROR(CopyHostTensors(session, snap, to, cow));
    } else {
      const bool kept = !on_released || on_released();
      released = true;
      CKPT_RETURN_IF_ERROR(copy.Run());  // also what lifts the protection
      if (!kept) return Abandoned("");
      Log().debug("[{}/r{} s{}] copy-on-write: {} chunks, {} copied first because the trainer "
                  "wrote to them",
                  session.job, session.rank, snap.step, copy.chunks(), copy.faulted());
    }
    snap.landed.Advance(HeldBack(snap, tensor_bytes));
    return absl::OkStatus();
  }
  // memcpy competes with persisting for the CPU, and the trainer is waiting for it: while
  // host tensors are copied, writers hold back (they yield between their writes), and the
  // copy runs as one job (per-chunk barriers cost more than overlap gains on the host).
  // DMA copies do not need the CPU: snapshots of GPU tensors alone overlap with writing.
  bool any_host = false;
  for (size_t i = 0; i < tensors.size(); ++i) any_host = any_host || (!tensors[i].on_device && !shared(i));
  cuda::CopyPriority::Copying copying(any_host ? priority_ : nullptr);
  const uint64_t chunk_bytes = any_host ? std::max<uint64_t>(tensor_bytes, 1) : options_.chunk_bytes;
  size_t first = 0;  // the first tensor not wholly copied yet
  for (uint64_t lo = 0; lo < tensor_bytes; lo += chunk_bytes) {
    const uint64_t hi = std::min(tensor_bytes, lo + chunk_bytes);
    SplitCopy chunk;
    for (size_t i = first; i < snap.tensor_count; ++i) {
      const format::TensorEntry& e = snap.shard.entries[i];
      if (e.begin >= hi) break;
      const uint64_t a = std::max(lo, e.begin), b = std::min(hi, e.end);
      if (b > a && !shared(i)) chunk.Add(tensors[i], {to[i] + (a - e.begin), tensors[i].data + (a - e.begin), b - a});
      if (e.end <= hi) first = i + 1;
    }
    CKPT_RETURN_IF_ERROR(CopySplit(engine_, device_engines_, chunk, session.cuda_after));
    snap.landed.Advance(HeldBack(snap, hi));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
