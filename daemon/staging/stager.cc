#include "daemon/staging/stager.h"

#include <fmt/format.h>

#include <cstring>

#include "common/log.h"
#include "common/names.h"
#include "common/status.h"
#include "daemon/persist/manifest.h"

namespace ckpt::daemon {

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

absl::StatusOr<cuda::StagingBlockPtr> Stager::Reserve(size_t bytes, const std::string& context) {
  auto deadline = std::chrono::steady_clock::now() + busy_wait_;
  while (true) {
    auto block = pool_.Allocate(bytes);
    if (block.ok()) return block;
    if (checkpointer_.EvictOneHot()) continue;
    if (when_busy_ == WhenBusy::kSkip || std::chrono::steady_clock::now() >= deadline) {
      return absl::ResourceExhaustedError(fmt::format(
          "{} skipped: staging memory busy ({}; earlier snapshots are still being written; "
          "--when-busy={})",
          context, Message(block.status()), when_busy_ == WhenBusy::kSkip ? "skip" : "wait"));
    }
    checkpointer_.WaitForProgress(std::chrono::milliseconds(50));
  }
}

absl::StatusOr<StagedSnapshotPtr> Stager::Stage(const SessionView& session, uint64_t step,
                                                shm::SnapshotPayload payload) {
  const std::vector<RegisteredTensor>& tensors = *session.tensors;
  uint64_t total = 0;
  for (const RegisteredTensor& t : tensors) total += t.nbytes;
  for (const shm::NamedBlob& blob : payload.train_state) {
    CKPT_RETURN_IF_ERROR(Annotate(ValidateTensorName(blob.name), "train state"));
    total += blob.data.size();
  }
  std::string context = fmt::format("[{}/r{} s{}] snapshot", session.job, session.rank, step);
  CKPT_ASSIGN_OR_RETURN(cuda::StagingBlockPtr block, Reserve(total, context));

  auto snap = std::make_shared<StagedSnapshot>();
  snap->job = session.job;
  snap->step = step;
  snap->rank = session.rank;
  snap->world_size = session.world_size;
  snap->tensor_count = tensors.size();
  SplitCopy job;
  uint64_t offset = 0;
  for (const RegisteredTensor& t : tensors) {
    job.Add(t, {block->data() + offset, t.data, t.nbytes});
    snap->shard.entries.push_back({t.name, t.dtype, t.shape, offset, offset + t.nbytes});
    snap->placements.push_back(t.placement);
    offset += t.nbytes;
  }
  auto copy_started = std::chrono::steady_clock::now();
  {
    cuda::CopyPriority::Copying copying(priority_);
    CKPT_RETURN_IF_ERROR(
        Annotate(CopySplit(engine_, device_engines_, job, session.cuda_after), context));
  }
  snap->copy_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_started).count();
  for (const shm::NamedBlob& blob : payload.train_state) {
    std::memcpy(block->data() + offset, blob.data.data(), blob.data.size());
    snap->shard.entries.push_back({persist::TrainStateKey(blob.name), "U8",
                                   {static_cast<int64_t>(blob.data.size())}, offset,
                                   offset + blob.data.size()});
    snap->train_state_names.push_back(blob.name);
    offset += blob.data.size();
  }
  snap->shard.rank = session.rank;
  snap->shard.data = block->data();
  snap->shard.data_bytes = offset;
  snap->shard.metadata = std::move(payload.metadata);
  snap->block = std::move(block);
  return snap;
}

}  // namespace ckpt::daemon
