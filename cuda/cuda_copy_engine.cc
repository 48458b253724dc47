#include "cuda/cuda_copy_engine.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <mutex>
#include <vector>

#include "cuda/chunk_plan.h"
#include "cuda/cuda_check.h"
#include "cuda/device_guard.h"

namespace ckpt::cuda {
namespace {

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine(const CudaCopyEngineOptions& options, std::vector<cudaStream_t> streams)
      : options_(options), streams_(std::move(streams)) {}

  ~CudaCopyEngine() override {
    DeviceGuard guard(options_.device);
    for (cudaStream_t s : streams_) (void)cudaStreamDestroy(s);
  }

  std::string_view name() const override { return "cuda"; }

  absl::Status Copy(std::span<const CopyRegion> regions, void* after) override {
    std::lock_guard lock(mu_);  // one job at a time; its chunks run on every stream
    DeviceGuard guard(options_.device);
    if (!guard.ok()) return absl::FailedPreconditionError("cannot select the CUDA device");
    if (after != nullptr) {
      // Copy exactly the state at the trainer's snapshot point: every stream waits for the
      // event the trainer recorded before publishing the command (the most recent record
      // when this call is made is that one or a later one).
      for (size_t s = 0; s < streams_.size(); ++s) {
        CKPT_CUDA_RETURN_IF_ERROR(
            cudaStreamWaitEvent(streams_[s], static_cast<cudaEvent_t>(after), 0),
            fmt::format("trainer snapshot event on stream {}", s));
      }
    }
    auto plan = PlanChunks(regions, static_cast<int>(streams_.size()), options_.chunk_bytes);
    for (size_t s = 0; s < plan.size(); ++s) {
      for (const CopyRegion& c : plan[s]) {
        CKPT_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, streams_[s]),
            fmt::format("chunk of {} bytes on stream {}", c.bytes, s));
      }
    }
    for (size_t s = 0; s < streams_.size(); ++s) {
      CKPT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(streams_[s]), fmt::format("stream {}", s));
    }
    return absl::OkStatus();
  }

 private:
  const CudaCopyEngineOptions options_;
  std::vector<cudaStream_t> streams_;
  std::mutex mu_;
};

}  // namespace

absl::StatusOr<CopyEnginePtr> MakeCudaCopyEngine(const CudaCopyEngineOptions& options) {
  DeviceGuard guard(options.device);
  if (!guard.ok()) {
    return absl::FailedPreconditionError(
        fmt::format("CUDA device {} is not usable on this machine", options.device));
  }
  std::vector<cudaStream_t> streams(std::max(1, options.streams));
  for (cudaStream_t& s : streams) {
    CKPT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                              "copy engine stream");
  }
  return CopyEnginePtr(new CudaCopyEngine(options, std::move(streams)));
}

}  // namespace ckpt::cuda
