#include "daemon/persist/disk_quota.h"

#include <fmt/format.h>
#include <pthread.h>

#include <set>
#include <vector>

#include "common/names.h"

namespace ckpt::persist {
namespace {

std::string Size(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30));
  if (bytes >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  return fmt::format("{} bytes", bytes);
}

}  // namespace

DiskQuota::DiskQuota(Filesystem& fs, std::string root, Limits limits, OwnerOf owner_of, bool walk_root,
                     std::function<Clock::time_point()> now)
    : fs_(fs), root_(std::move(root)), limits_(limits), owner_of_(std::move(owner_of)), now_(std::move(now)) {
  if (walk_root && enabled()) walker_ = std::thread([this] { WalkLoop(); });
}

DiskQuota::~DiskQuota() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (walker_.joinable()) walker_.join();
}

void DiskQuota::WalkLoop() {
  pthread_setname_np(pthread_self(), "ckptd-quota");
  std::unique_lock lock(mu_);
  while (!stopping_) {
    lock.unlock();
    try {
      MeasureRoot();
    } catch (const std::exception&) {
      // A root that cannot be walked now (bad_alloc, a filesystem error): the next walk.
    }
    lock.lock();
    stop_cv_.wait_for(lock, kRescan, [this] { return stopping_; });
  }
}

uint64_t DiskQuota::BytesUnder(const std::string& dir, int depth) {
  absl::StatusOr<std::vector<std::string>> names = fs_.ListDir(dir);
  if (!names.ok()) return 0;  // gone meanwhile (retention, an aborted step)
  uint64_t bytes = 0;
  for (const std::string& name : *names) {
    const std::string path = dir + "/" + name;
    if (fs_.IsDirectory(path)) {
      if (depth > 0) bytes += BytesUnder(path, depth - 1);
    } else if (absl::StatusOr<uint64_t> size = fs_.FileSize(path); size.ok()) {
      bytes += *size;
    }
  }
  return bytes;
}

void DiskQuota::MeasureJob(const std::string& job) {
  const std::optional<uint32_t> owner = owner_of_(job);
  {
    std::lock_guard lock(mu_);
    Job& j = jobs_[job];
    if (j.walks++ == 0) j.written_during_walk = 0;
    j.changed = false;  // a removal from now on is seen by the next measurement
  }
  // <root>/<job>/<step>/<file>
  const uint64_t bytes = BytesUnder(root_ + "/" + job, 1);
  std::lock_guard lock(mu_);
  Job& j = jobs_[job];
  --j.walks;
  j.on_root = bytes + j.written_during_walk;
  if (owner) j.owner = owner;
  j.measured = now_();
}

void DiskQuota::MeasureRoot() {
  absl::StatusOr<std::vector<std::string>> names = fs_.ListDir(root_);
  if (!names.ok()) return;
  // Jobs are the root's directories with a job's name (the group's decision log and other
  // daemon files start with a dot).
  std::set<std::string> present;
  for (const std::string& job : *names) {
    if (!ValidateJobName(job).ok() || !fs_.IsDirectory(root_ + "/" + job)) continue;
    present.insert(job);
    MeasureJob(job);
  }
  std::lock_guard lock(mu_);
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    const bool idle = it->second.reserved == 0 && it->second.walks == 0;
    it = !present.count(it->first) && idle ? jobs_.erase(it) : std::next(it);
  }
}

void DiskQuota::Changed(const std::string& job) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  if (auto it = jobs_.find(job); it != jobs_.end()) it->second.changed = true;
}

void DiskQuota::Refresh(const std::string& job) {
  bool measure = false;
  std::vector<std::string> changed;  // the owner's other jobs ckptd removed files of
  {
    std::lock_guard lock(mu_);
    const Job& j = jobs_[job];
    measure = !j.measured || j.changed || now_() - *j.measured >= kRescan;
    if (limits_.per_user != 0 && j.owner) {
      for (const auto& [name, other] : jobs_) {
        if (name != job && other.owner == j.owner && other.changed) changed.push_back(name);
      }
    }
  }
  if (measure) MeasureJob(job);
  for (const std::string& name : changed) MeasureJob(name);
}

DiskQuota::Usage DiskQuota::UsageLocked(const std::string& job) const {
  Usage usage;
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return usage;
  usage.job = it->second.on_root + it->second.reserved;
  usage.owner = it->second.owner;
  if (usage.owner) {
    for (const auto& [name, j] : jobs_) {
      if (j.owner == usage.owner) usage.user += j.on_root + j.reserved;
    }
  }
  return usage;
}

DiskQuota::Usage DiskQuota::UsageOf(const std::string& job) {
  Refresh(job);
  std::lock_guard lock(mu_);
  return UsageLocked(job);
}

std::map<uint32_t, uint64_t> DiskQuota::UsageByUser() const {
  std::lock_guard lock(mu_);
  std::map<uint32_t, uint64_t> out;
  for (const auto& [name, j] : jobs_) {
    if (j.owner) out[*j.owner] += j.on_root + j.reserved;
  }
  return out;
}

std::string DiskQuota::OverLocked(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes) const {
  const Usage usage = UsageLocked(job);
  auto what = [&] { return fmt::format("writing rank {} of step {} ({})", rank, step, Size(bytes)); };
  if (limits_.per_job != 0 && usage.job + bytes > limits_.per_job) {
    return fmt::format(
        "{} would take job {} to {} on {}, over its quota of {} (--job-quota-bytes): delete older steps "
        "(ckptctl delete) or keep fewer (--keep-last)",
        what(), job, Size(usage.job + bytes), root_, Size(limits_.per_job));
  }
  if (limits_.per_user != 0 && usage.owner && usage.user + bytes > limits_.per_user) {
    return fmt::format(
        "{} would take the checkpoints of uid {} on {} to {} (job {}: {}), over the user's quota of {} "
        "(--user-quota-bytes): delete older steps of the user's jobs (ckptctl list, ckptctl delete) or keep "
        "fewer (--keep-last)",
        what(), *usage.owner, root_, Size(usage.user + bytes), job, Size(usage.job + bytes), Size(limits_.per_user));
  }
  return {};
}

absl::Status DiskQuota::Reserve(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes) {
  if (!enabled()) return absl::OkStatus();
  if (const std::optional<uint32_t> owner = owner_of_(job)) {
    std::lock_guard lock(mu_);
    jobs_[job].owner = owner;
  }
  Refresh(job);
  std::lock_guard lock(mu_);
  if (std::string over = OverLocked(job, step, rank, bytes); !over.empty()) {
    return absl::ResourceExhaustedError(over);
  }
  jobs_[job].reserved += bytes;
  return absl::OkStatus();
}

void DiskQuota::Finished(const std::string& job, uint64_t reserved, uint64_t written) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  Job& j = jobs_[job];
  j.reserved -= std::min(j.reserved, reserved);
  j.on_root += written;
  if (j.walks > 0) j.written_during_walk += written;
}

}  // namespace ckpt::persist
