#include "daemon/persist/disk_quota.h"

#include <fmt/format.h>

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

DiskQuota::DiskQuota(Filesystem& fs, std::string root, Limits limits, OwnerOf owner_of,
                     std::function<Clock::time_point()> now)
    : fs_(fs), root_(std::move(root)), limits_(limits), owner_of_(std::move(owner_of)), now_(std::move(now)) {}

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

void DiskQuota::Measure(Clock::duration max_age) {
  std::lock_guard measuring(measure_mu_);
  {
    std::lock_guard lock(mu_);
    if (measured_ && now_() - *measured_ < max_age) return;
  }
  // <root>/<job>/<step>/<file>: jobs are the root's directories with a job's name (the
  // group's decision log and other daemon files start with a dot).
  std::map<std::string, std::pair<uint64_t, std::optional<uint32_t>>> found;
  if (absl::StatusOr<std::vector<std::string>> names = fs_.ListDir(root_); names.ok()) {
    for (const std::string& job : *names) {
      if (!ValidateJobName(job).ok() || !fs_.IsDirectory(root_ + "/" + job)) continue;
      found[job] = {BytesUnder(root_ + "/" + job, 1), owner_of_(job)};
    }
  }
  std::lock_guard lock(mu_);
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (auto on_root = found.find(it->first); on_root != found.end()) {
      it->second.on_root = on_root->second.first;
      if (on_root->second.second) it->second.owner = on_root->second.second;
      found.erase(on_root);
      ++it;
    } else if (it->second.reserved != 0) {
      it->second.on_root = 0;  // its directory is about to be made
      ++it;
    } else {
      it = jobs_.erase(it);
    }
  }
  for (auto& [job, measured] : found) jobs_[job] = Job{measured.first, 0, measured.second};
  measured_ = now_();
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
  Measure(kRescan);
  std::lock_guard lock(mu_);
  return UsageLocked(job);
}

std::string DiskQuota::OverLocked(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes) const {
  const Usage usage = UsageLocked(job);
  const std::string what = fmt::format("writing rank {} of step {} ({})", rank, step, Size(bytes));
  if (limits_.per_job != 0 && usage.job + bytes > limits_.per_job) {
    return fmt::format(
        "{} would take job {} to {} on {}, over its quota of {} (--job-quota-bytes): delete older steps "
        "(ckptctl delete) or keep fewer (--keep-last)",
        what, job, Size(usage.job + bytes), root_, Size(limits_.per_job));
  }
  if (limits_.per_user != 0 && usage.owner && usage.user + bytes > limits_.per_user) {
    return fmt::format(
        "{} would take the checkpoints of uid {} on {} to {} (job {}: {}), over the user's quota of {} "
        "(--user-quota-bytes): delete older steps of the user's jobs (ckptctl list, ckptctl delete) or keep "
        "fewer (--keep-last)",
        what, *usage.owner, root_, Size(usage.user + bytes), job, Size(usage.job + bytes), Size(limits_.per_user));
  }
  return {};
}

absl::Status DiskQuota::Reserve(const std::string& job, uint64_t step, uint32_t rank, uint64_t bytes) {
  if (!enabled()) return absl::OkStatus();
  const std::optional<uint32_t> owner = owner_of_(job);
  auto admit = [&]() -> std::optional<std::string> {
    std::lock_guard lock(mu_);
    Job& j = jobs_[job];
    if (owner) j.owner = owner;
    std::string over = OverLocked(job, step, rank, bytes);
    if (!over.empty()) return over;
    j.reserved += bytes;
    return std::nullopt;
  };
  Measure(kRescan);
  if (!admit()) return absl::OkStatus();
  // Refused only on a fresh measurement: steps deleted since the last one are not held
  // against the job.
  Measure(kRecheck);
  if (std::optional<std::string> over = admit()) return absl::ResourceExhaustedError(*over);
  return absl::OkStatus();
}

void DiskQuota::Finished(const std::string& job, uint64_t reserved, uint64_t written) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  Job& j = jobs_[job];
  j.reserved -= std::min(j.reserved, reserved);
  j.on_root += written;
}

}  // namespace ckpt::persist
