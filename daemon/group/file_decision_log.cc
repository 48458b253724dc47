#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "common/names.h"
#include "common/status.h"
#include "daemon/group/decision_log.h"
#include "format/checkpoint_store.h"

namespace ckpt::group {
namespace {

class FileDecisionLog : public DecisionLog {
 public:
  FileDecisionLog(FilesystemPtr fs, std::string dir, size_t keep)
      : fs_(std::move(fs)), dir_(std::move(dir)), keep_(keep) {}

  absl::Status RecordCommit(const std::string& job, uint64_t step,
                            const std::string& manifest_json) override {
    CKPT_RETURN_IF_ERROR(ValidateJobName(job));
    std::lock_guard lock(mu_);
    std::string job_dir;
    CKPT_ASSIGN_OR_RETURN(job_dir, JobDirLocked(job));
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(*fs_, Path(job, step), manifest_json));
    Prune(job, job_dir, step);
    return absl::OkStatus();
  }

  absl::StatusOr<std::optional<std::string>> FindCommit(const std::string& job,
                                                        uint64_t step) override {
    CKPT_RETURN_IF_ERROR(ValidateJobName(job));
    return Read(Path(job, step));
  }

  absl::Status RecordManifest(const std::string& job, uint64_t step,
                              const std::string& manifest_json) override {
    CKPT_RETURN_IF_ERROR(ValidateJobName(job));
    // After the record, or before it (a shared root's, which must be there to publish from
    // after a restart): the job's directory may not be there yet.
    {
      std::lock_guard lock(mu_);
      CKPT_RETURN_IF_ERROR(JobDirLocked(job).status());
    }
    return WriteFileAtomically(*fs_, ManifestPath(job, step), manifest_json);
  }

  absl::StatusOr<std::optional<std::string>> FindManifest(const std::string& job, uint64_t step,
                                                          size_t max_bytes) override {
    CKPT_RETURN_IF_ERROR(ValidateJobName(job));
    const std::string path = ManifestPath(job, step);
    if (fs_->Exists(path)) {
      CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(path));
      if (size > max_bytes) {
        return absl::ResourceExhaustedError(fmt::format("{} is {} bytes, more than {}", path, size, max_bytes));
      }
    }
    return Read(path);
  }

  absl::Status ForgetManifest(const std::string& job, uint64_t step) override {
    CKPT_RETURN_IF_ERROR(ValidateJobName(job));
    const std::string path = ManifestPath(job, step);
    if (!fs_->Exists(path)) return absl::OkStatus();
    CKPT_RETURN_IF_ERROR(fs_->RemoveTree(path));
    return fs_->SyncDir(dir_ + "/" + job);
  }

 private:
  std::string Path(const std::string& job, uint64_t step) const {
    return fmt::format("{}/{}/step-{:08d}.json", dir_, job, step);
  }
  std::string ManifestPath(const std::string& job, uint64_t step) const {
    return fmt::format("{}/{}/step-{:08d}.manifest.json", dir_, job, step);
  }

  // The job's directory of the log, made on first use.
  absl::StatusOr<std::string> JobDirLocked(const std::string& job) {
    std::string job_dir = dir_ + "/" + job;
    if (!fs_->Exists(job_dir)) {
      // Decisions and manifests of every job: the log is ckptd's alone (0700), as a job's
      // own files are its owner's (docs/security.md).
      CKPT_RETURN_IF_ERROR(fs_->MakePrivateDir(dir_));
      CKPT_RETURN_IF_ERROR(fs_->MakePrivateDir(job_dir));
      CKPT_RETURN_IF_ERROR(fs_->SyncDir(dir_));  // the new job directory itself is durable
    }
    return job_dir;
  }

  absl::StatusOr<std::optional<std::string>> Read(const std::string& path) {
    if (!fs_->Exists(path)) return std::optional<std::string>();
    CKPT_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(*fs_, path));
    return std::optional<std::string>(std::move(text));
  }

  // Old records are dropped best effort: a failure here never fails a commit. Oldest
  // recorded first, never the one just written: a job that went back to an older step
  // records lower step numbers than those it abandoned, and those new records are the ones
  // to keep. The job's directory is listed once per daemon life (what was there comes
  // first, by step); after that a record costs one removal at most.
  void Prune(const std::string& job, const std::string& job_dir, uint64_t recorded) {
    auto [it, first] = order_.try_emplace(job);
    std::deque<uint64_t>& order = it->second;
    if (first) {
      auto names = fs_->ListDir(job_dir);
      if (!names.ok()) {
        order_.erase(it);
        return;
      }
      std::vector<uint64_t> found;
      for (const std::string& name : *names) {
        // Records, and manifests without one (recorded before a decision that never was).
        for (std::string_view suffix : {std::string_view(".manifest.json"), std::string_view(".json")}) {
          uint64_t step;
          if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
              format::ParseStepDirName(name.substr(0, name.size() - suffix.size()), &step)) {
            if (step != recorded) found.push_back(step);
            break;
          }
        }
      }
      std::sort(found.begin(), found.end());
      found.erase(std::unique(found.begin(), found.end()), found.end());
      order.assign(found.begin(), found.end());
    }
    std::erase(order, recorded);  // recorded again (a retried commit): now the newest
    order.push_back(recorded);
    while (order.size() > keep_) {
      (void)fs_->RemoveTree(Path(job, order.front()));
      (void)fs_->RemoveTree(ManifestPath(job, order.front()));
      order.pop_front();
    }
  }

  FilesystemPtr fs_;
  const std::string dir_;
  const size_t keep_;
  std::mutex mu_;
  std::map<std::string, std::deque<uint64_t>> order_;  // recorded steps per job, oldest first; guarded by mu_
};

}  // namespace

DecisionLogPtr MakeFileDecisionLog(FilesystemPtr fs, std::string dir, size_t keep_per_job) {
  return std::make_unique<FileDecisionLog>(std::move(fs), std::move(dir), keep_per_job);
}

}  // namespace ckpt::group
