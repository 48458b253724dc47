#include "daemon/persist/write_queue.h"

#include <fmt/format.h>

#include <algorithm>

#include <sys/resource.h>
#include <unistd.h>

#include "common/log.h"
#include "common/status.h"
#include "daemon/metrics/daemon_metrics.h"

namespace ckpt::persist {
namespace {

spdlog::logger& Log() { return log::Get(log::Component::kPersist); }

constexpr int kIoThreadNice = 10;

}  // namespace

void NotifyTickets(const std::vector<daemon::StagedSnapshotPtr>& snapshots,
                   shm::TicketStateValue state, const std::string& error) {
  for (const daemon::StagedSnapshotPtr& s : snapshots) {
    if (auto sink = s->sink.lock()) sink->SetTicketState(s->ticket, state, error);
  }
}

WriteQueue::WriteQueue(ShardWriter& writer, WriteListener& listener,
                       daemon::ProgressSignal& progress, Options options,
                       std::function<void(uint64_t)> on_written)
    : writer_(writer), listener_(listener), progress_(progress), options_(options),
      on_written_(std::move(on_written)) {
  for (int i = 0; i < options_.io_threads; ++i) threads_.emplace_back([this] { Loop(); });
}

WriteQueue::~WriteQueue() { Shutdown(std::chrono::milliseconds(0)); }

void WriteQueue::Submit(daemon::StagedSnapshotPtr snapshot) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      NotifyTickets({snapshot}, shm::kTicketFailed, "ckptd is shutting down; snapshot not written");
      return;
    }
  }
  if (absl::Status admitted = listener_.Arrived(snapshot); !admitted.ok()) {
    NotifyTickets({snapshot}, shm::kTicketFailed, Message(admitted));
    return;
  }
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(snapshot));
  work_cv_.notify_one();
}

void WriteQueue::Loop() {
  // Trainers wait for staging, never for persisting: when both want the CPU (a rank's
  // shard is written while the next rank is still being copied), the copy goes first.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kIoThreadNice);
  while (true) {
    daemon::StagedSnapshotPtr snapshot;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [this] { return aborting_ || !queue_.empty() || stopping_; });
      if (aborting_ || queue_.empty()) return;
      snapshot = std::move(queue_.front());
      queue_.pop_front();
      writing_.push_back(snapshot);
    }
    try {
      Write(snapshot);
    } catch (const std::exception& e) {
      // Nothing a trainer sent may end the thread (and with it the daemon): the snapshot
      // fails, named, and the thread goes on.
      Log().error("[{} s{}] r{}: {}", snapshot->job, snapshot->step, snapshot->rank, e.what());
      listener_.Failed(snapshot, fmt::format("internal error while writing rank {}: {}",
                                             snapshot->rank, e.what()));
    }
    {
      std::lock_guard lock(mu_);
      writing_.erase(std::find(writing_.begin(), writing_.end(), snapshot));
      idle_cv_.notify_all();
    }
    snapshot.reset();
    progress_.Notify();
  }
}

void WriteQueue::Write(const daemon::StagedSnapshotPtr& snapshot) {
  auto dir = listener_.StepDirectory(snapshot);
  if (!dir.ok()) {
    if (!absl::IsAborted(dir.status())) metrics::Metrics().Fail(metrics::Cause::kStorage);  // else: the step ended
    listener_.Failed(snapshot, Message(dir.status()));
    return;
  }
  metrics::DaemonMetrics& metrics = metrics::Metrics();
  // Counted in full while it is written (two I/O threads cannot both pass a bound), and
  // given back however the write ends, an exception included.
  struct QuotaHold {
    DiskQuota* quota = nullptr;
    const std::string& job;
    uint64_t reserved = 0;
    uint64_t written = 0;
    ~QuotaHold() {
      if (quota) quota->Finished(job, reserved, written);
    }
  } hold{nullptr, snapshot->job, snapshot->shard.data_bytes};
  if (options_.quota) {
    if (absl::Status admitted = options_.quota->Reserve(snapshot->job, snapshot->step, snapshot->rank, hold.reserved);
        !admitted.ok()) {
      metrics.Fail(metrics::Cause::kQuota);
      Log().warn("[{} s{}] r{}: {}", snapshot->job, snapshot->step, snapshot->rank, Message(admitted));
      listener_.Failed(snapshot, Message(admitted));
      return;
    }
    hold.quota = options_.quota;
  }
  const auto started = std::chrono::steady_clock::now();
  auto written = options_.increments != nullptr ? options_.increments->Write(*snapshot, *dir)
                                                : writer_.Write(snapshot->shard, *dir);
  if (!written.ok()) {
    // Aborted: the trainer abandoned the snapshot during its copy (torn tensors, never
    // written); anything else is the store's.
    metrics.Fail(absl::IsAborted(written.status()) ? metrics::Cause::kTrainer : metrics::Cause::kStorage);
    listener_.Failed(snapshot,
                     fmt::format("writing rank {}: {}", snapshot->rank, Message(written.status())));
    return;
  }
  hold.written = written->bytes;
  metrics.write_seconds.With({options_.tier}).Observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  metrics.written_bytes.With({options_.tier}).Add(static_cast<double>(written->bytes));
  if (on_written_) on_written_(written->bytes);
  Log().debug("[{} s{}] r{} shard written ({} bytes)", snapshot->job, snapshot->step,
              snapshot->rank, written->bytes);
  listener_.Durable(snapshot, std::move(*written));
}

std::map<std::string, std::vector<uint64_t>> WriteQueue::Pending() const {
  std::map<std::string, std::vector<uint64_t>> pending;
  {
    std::lock_guard lock(mu_);
    for (const auto& s : queue_) pending[s->job].push_back(s->step);
    for (const auto& s : writing_) pending[s->job].push_back(s->step);
  }
  for (auto& [job, steps] : pending) {
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  }
  return pending;
}

void WriteQueue::Shutdown(std::chrono::milliseconds timeout) {
  std::vector<daemon::StagedSnapshotPtr> dropped;
  {
    std::unique_lock lock(mu_);
    if (threads_.empty()) return;
    stopping_ = true;
    work_cv_.notify_all();
    idle_cv_.wait_for(lock, timeout, [this] { return queue_.empty() && writing_.empty(); });
    aborting_ = true;
    work_cv_.notify_all();
    dropped.assign(queue_.begin(), queue_.end());
    queue_.clear();
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  for (const auto& snapshot : dropped) {
    listener_.Failed(snapshot, "ckptd shut down before writing this snapshot");
  }
}

}  // namespace ckpt::persist
