#include "daemon/checkpointer.h"

#include <fmt/chrono.h>
#include <fmt/format.h>

#include <chrono>
#include <ctime>
#include <optional>

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/log.h"
#include "common/status.h"
#include "daemon/config.h"

namespace ckpt::daemon {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kPersist); }

constexpr int kIoThreadNice = 10;

std::string Prefix(const std::string& job, uint64_t step) {
  return fmt::format("[{} s{}]", job, step);
}

}  // namespace

Checkpointer::Pin::Pin(Checkpointer* owner, std::string job, uint64_t step)
    : owner_(owner), job_(std::move(job)), step_(step) {
  std::lock_guard lock(owner_->mu_);
  owner_->pins_.insert({job_, step_});
}

Checkpointer::Pin::~Pin() {
  std::lock_guard lock(owner_->mu_);
  owner_->pins_.erase(owner_->pins_.find({job_, step_}));
}

Checkpointer::Checkpointer(persist::CheckpointStore& store, persist::ShardWriter& writer,
                           StatusBoard& board, Options options)
    : store_(store), writer_(writer), board_(board), options_(options) {
  for (int i = 0; i < options_.io_threads; ++i) threads_.emplace_back([this] { IoLoop(); });
  janitor_ = std::thread([this] { JanitorLoop(); });
}

Checkpointer::~Checkpointer() { Shutdown(std::chrono::milliseconds(0)); }

void Checkpointer::Submit(StagedSnapshotPtr snapshot) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      queue_.push_back(std::move(snapshot));
      work_cv_.notify_one();
      return;
    }
  }
  Notify({snapshot}, shm::kTicketFailed, "ckptd is shutting down; snapshot not written");
}

void Checkpointer::IoLoop() {
  // Trainers wait for staging, never for persisting: when both want the CPU (a rank's
  // shard is written while the next rank is still being copied), the copy goes first.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kIoThreadNice);
  while (true) {
    StagedSnapshotPtr snapshot;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [this] { return aborting_ || !queue_.empty() || stopping_; });
      if (aborting_ || queue_.empty()) return;
      snapshot = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
    }
    Process(snapshot);
    std::lock_guard lock(mu_);
    --busy_;
    progress_cv_.notify_all();
  }
}

void Checkpointer::Process(const StagedSnapshotPtr& snapshot) {
  const StepKey key{snapshot->job, snapshot->step};
  std::shared_future<absl::Status> begun;
  std::promise<absl::Status> begin_promise;
  bool first = false;
  std::string reject;  // fails this snapshot only; the step itself may still complete
  {
    std::lock_guard lock(mu_);
    auto [it, inserted] = pending_.try_emplace(key);
    PendingStep& step = it->second;
    first = inserted;
    if (first) {
      step.world_size = snapshot->world_size;
      step.begun = begin_promise.get_future().share();
    }
    if (step.failed) {
      reject = step.error;
    } else if (snapshot->world_size != step.world_size) {
      reject = fmt::format("rank {} says world size {}, rank(s) before it said {}", snapshot->rank,
                           snapshot->world_size, step.world_size);
    } else if (!step.arrived.insert(snapshot->rank).second) {
      reject = fmt::format("rank {} submitted step {} twice", snapshot->rank, snapshot->step);
    } else {
      step.waiting.push_back(snapshot);
      begun = step.begun;
    }
  }
  if (!reject.empty()) {
    Notify({snapshot}, shm::kTicketFailed, reject);
    return;
  }
  if (first) {
    absl::Status s = store_.fs().Exists(store_.StepDir(key.first, key.second))
                         ? absl::AlreadyExistsError(fmt::format(
                               "step {} of job {} is already committed", key.second, key.first))
                         : store_.BeginStep(key.first, key.second);
    begin_promise.set_value(s);
  }
  absl::Status ready = begun.get();
  if (!ready.ok()) {
    FailStep(key, Message(ready));
    return;
  }
  auto written = writer_.Write(snapshot->shard, store_.TempStepDir(key.first, key.second));
  if (!written.ok()) {
    FailStep(key, fmt::format("writing rank {}: {}", snapshot->rank, Message(written.status())));
    return;
  }
  board_.bytes_persisted += written->bytes;
  Log().debug("{} r{} shard written ({} bytes)", Prefix(key.first, key.second), snapshot->rank,
              written->bytes);
  std::optional<PendingStep> complete;
  {
    std::lock_guard lock(mu_);
    auto it = pending_.find(key);
    if (it == pending_.end() || it->second.failed) return;  // already failed and notified
    PendingStep& step = it->second;
    step.written[snapshot->rank] = snapshot;
    step.shards[snapshot->rank] = std::move(*written);
    if (step.written.size() == step.world_size) {
      complete = std::move(step);
      pending_.erase(it);
    }
  }
  if (complete) Commit(key, std::move(*complete));
}

void Checkpointer::Commit(const StepKey& key, PendingStep step) {
  const auto& [job, number] = key;
  persist::Manifest m;
  m.job = job;
  m.step = number;
  auto now = std::chrono::system_clock::now();
  m.unix_time = std::chrono::duration<double>(now.time_since_epoch()).count();
  m.wall_time = fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(std::chrono::system_clock::to_time_t(now)));
  m.world_size = step.world_size;
  m.ckptd_version = kVersion;
  std::string error;
  for (const auto& [rank, snap] : step.written) {
    const persist::WrittenShard& written = step.shards[rank];
    persist::ManifestShard shard;
    shard.rank = rank;
    shard.file = written.file;
    shard.bytes = written.bytes;
    shard.metadata = snap->shard.metadata;
    if (rank == 0) m.metadata = snap->shard.metadata;
    for (size_t i = 0; i < snap->shard.entries.size(); ++i) {
      const persist::TensorEntry& e = snap->shard.entries[i];
      const std::string& checksum = written.checksums.at(e.name);
      if (i >= snap->tensor_count) {
        shard.train_state[snap->train_state_names[i - snap->tensor_count]] = {e.begin, e.end, checksum};
        continue;
      }
      const TensorPlacement& p = snap->placements[i];
      std::vector<int64_t> global = p.global_shape.empty() ? e.shape : p.global_shape;
      std::vector<int64_t> offset = p.offset.empty() ? std::vector<int64_t>(e.shape.size(), 0) : p.offset;
      auto [it, inserted] = m.tensors.try_emplace(e.name);
      persist::ManifestTensor& t = it->second;
      if (inserted) {
        t.dtype = e.dtype;
        t.global_shape = global;
      } else if (t.dtype != e.dtype || t.global_shape != global) {
        error = fmt::format("tensor {}: rank {} has {} [{}], another rank has {} [{}]", e.name, rank,
                            e.dtype, fmt::join(global, ","), t.dtype, fmt::join(t.global_shape, ","));
      }
      t.shards.push_back({rank, written.file, e.begin, e.end, offset, e.shape, checksum});
    }
    m.shards.push_back(std::move(shard));
  }
  absl::Status committed = error.empty() ? store_.Commit(m) : absl::InvalidArgumentError(error);
  std::vector<StagedSnapshotPtr> waiting = std::move(step.waiting);
  if (!committed.ok()) {
    ReportFailure(key, fmt::format("commit of step {} failed: {}", number, Message(committed)),
                  waiting, spdlog::level::err);
    std::lock_guard lock(mu_);
    progress_cv_.notify_all();
    return;
  }
  board_.checkpoints_committed++;
  Log().info("{} committed: {} ranks, {} bytes", Prefix(job, number), m.world_size, m.total_bytes());
  std::vector<std::pair<StepKey, PendingStep>> superseded;
  {
    std::lock_guard lock(mu_);
    for (const auto& [rank, snap] : step.written) {
      StagedSnapshotPtr& slot = hot_[{job, rank}];
      if (!slot || slot->step < number) slot = snap;
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      // Older steps whose ranks are all accounted for (none queued or being written) can
      // never complete now. One still in flight on another I/O thread may: leave it.
      if (it->first.first == job && it->first.second < number && !it->second.failed &&
          !InFlightLocked(it->first, it->second)) {
        superseded.emplace_back(it->first, std::move(it->second));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    progress_cv_.notify_all();
  }
  step.written.clear();
  Notify(waiting, shm::kTicketCommitted, "");
  {
    std::lock_guard lock(mu_);
    retention_jobs_.push_back(job);
    janitor_cv_.notify_one();
  }
  for (auto& [old_key, old] : superseded) {
    ReportFailure(old_key,
                  fmt::format("step {} abandoned: step {} committed before all {} ranks of step {} "
                              "arrived",
                              old_key.second, number, old.world_size, old_key.second),
                  old.waiting, spdlog::level::warn);
  }
}

void Checkpointer::JanitorLoop() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
  constexpr int kIoprioClassIdle = 3, kIoprioClassShift = 13;
  ::syscall(SYS_ioprio_set, 1 /* IOPRIO_WHO_PROCESS */, ::gettid(),
            kIoprioClassIdle << kIoprioClassShift);
  while (true) {
    std::string job;
    {
      std::unique_lock lock(mu_);
      janitor_cv_.wait(lock, [this] { return aborting_ || !retention_jobs_.empty(); });
      if (retention_jobs_.empty()) return;  // aborting, nothing left
      job = std::move(retention_jobs_.front());
      retention_jobs_.pop_front();
    }
    ApplyRetention(job);
  }
}

bool Checkpointer::InFlightLocked(const StepKey& key, const PendingStep& step) const {
  if (step.arrived.size() != step.written.size()) return true;
  for (const StagedSnapshotPtr& queued : queue_) {
    if (queued->job == key.first && queued->step == key.second) return true;
  }
  return false;
}

void Checkpointer::FailStep(const StepKey& key, const std::string& error) {
  std::vector<StagedSnapshotPtr> waiting;
  {
    std::lock_guard lock(mu_);
    auto it = pending_.find(key);
    if (it == pending_.end()) return;
    if (it->second.failed) return;
    it->second.failed = true;
    it->second.error = error;
    waiting = std::move(it->second.waiting);
    it->second.written.clear();
    progress_cv_.notify_all();
  }
  ReportFailure(key, error, waiting, spdlog::level::err);
}

void Checkpointer::ReportFailure(const StepKey& key, const std::string& message,
                                 const std::vector<StagedSnapshotPtr>& waiting,
                                 spdlog::level::level_enum level) {
  Log().log(level, "{} checkpoint failed: {}", Prefix(key.first, key.second), message);
  board_.checkpoints_failed++;
  board_.RecordError(fmt::format("{} {}", Prefix(key.first, key.second), message));
  // Only the unfinished step-N.tmp goes; a committed step-N is never touched.
  (void)store_.AbortStep(key.first, key.second);
  Notify(waiting, shm::kTicketFailed, message);
}

void Checkpointer::ApplyRetention(const std::string& job) {
  auto steps = store_.ListSteps(job);
  if (!steps.ok()) return;
  std::vector<uint64_t> pinned;
  persist::RetentionPolicy policy = options_.retention;
  {
    std::lock_guard lock(mu_);
    if (auto it = keep_last_.find(job); it != keep_last_.end()) policy.keep_last = it->second;
    for (const auto& [pjob, pstep] : pins_) {
      if (pjob == job) pinned.push_back(pstep);
    }
  }
  for (uint64_t step : persist::StepsToDelete(*steps, policy, pinned)) {
    absl::Status s = store_.Delete(job, step);
    if (s.ok()) {
      Log().info("{} deleted by retention", Prefix(job, step));
    } else {
      Log().warn("{} retention could not delete: {}", Prefix(job, step), Message(s));
      board_.RecordError(fmt::format("{} retention: {}", Prefix(job, step), Message(s)));
    }
  }
}

void Checkpointer::SetKeepLast(const std::string& job, uint32_t keep_last) {
  std::lock_guard lock(mu_);
  if (keep_last == 0) {
    keep_last_.erase(job);
  } else {
    keep_last_[job] = keep_last;
  }
}

void Checkpointer::Notify(const std::vector<StagedSnapshotPtr>& snapshots,
                          shm::TicketStateValue state, const std::string& error) {
  for (const StagedSnapshotPtr& s : snapshots) {
    if (auto sink = s->sink.lock()) sink->SetTicketState(s->ticket, state, error);
  }
}

StagedSnapshotPtr Checkpointer::FindHot(const std::string& job, uint32_t rank,
                                        uint64_t step) const {
  std::lock_guard lock(mu_);
  auto it = hot_.find({job, rank});
  if (it == hot_.end() || it->second->step != step) return nullptr;
  return it->second;
}

bool Checkpointer::EvictOneHot() {
  StagedSnapshotPtr victim;
  {
    std::lock_guard lock(mu_);
    auto oldest = hot_.end();
    for (auto it = hot_.begin(); it != hot_.end(); ++it) {
      if (oldest == hot_.end() || it->second->step < oldest->second->step) oldest = it;
    }
    if (oldest == hot_.end()) return false;
    victim = std::move(oldest->second);
    hot_.erase(oldest);
  }
  Log().debug("{} r{} evicted from memory", Prefix(victim->job, victim->step), victim->rank);
  return true;  // the block returns to the pool when the last reader lets go
}

void Checkpointer::WaitForProgress(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  progress_cv_.wait_for(lock, timeout);
}

std::map<std::string, Checkpointer::JobView> Checkpointer::View() const {
  std::map<std::string, JobView> view;
  std::lock_guard lock(mu_);
  for (const auto& [key, step] : pending_) {
    if (!step.failed) view[key.first].pending_steps.push_back(key.second);
  }
  for (const auto& snap : queue_) view[snap->job].pending_steps.push_back(snap->step);
  for (const auto& [key, snap] : hot_) view[key.first].hot_steps.push_back(snap->step);
  for (auto& [job, v] : view) {
    for (auto* list : {&v.pending_steps, &v.hot_steps}) {
      std::sort(list->begin(), list->end());
      list->erase(std::unique(list->begin(), list->end()), list->end());
    }
  }
  return view;
}

void Checkpointer::Shutdown(std::chrono::milliseconds timeout) {
  std::vector<StagedSnapshotPtr> dropped;
  std::vector<std::pair<StepKey, PendingStep>> unfinished;
  {
    std::unique_lock lock(mu_);
    if (threads_.empty()) return;
    stopping_ = true;
    work_cv_.notify_all();
    progress_cv_.wait_for(lock, timeout, [this] { return queue_.empty() && busy_ == 0; });
    aborting_ = true;
    work_cv_.notify_all();
    dropped.assign(queue_.begin(), queue_.end());
    queue_.clear();
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  {
    std::lock_guard lock(mu_);
    janitor_cv_.notify_all();
  }
  janitor_.join();
  {
    std::lock_guard lock(mu_);
    for (auto& entry : pending_) unfinished.emplace_back(entry.first, std::move(entry.second));
    pending_.clear();
    hot_.clear();
  }
  Notify(dropped, shm::kTicketFailed, "ckptd shut down before writing this snapshot");
  for (auto& [key, step] : unfinished) {
    if (!step.failed) (void)store_.AbortStep(key.first, key.second);
    Notify(step.waiting, shm::kTicketFailed,
           fmt::format("ckptd shut down before all ranks of step {} were written", key.second));
  }
}

}  // namespace ckpt::daemon
