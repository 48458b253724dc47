#include "cuda/cuda_copy_engine.h"

#include <cuda.h>
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
  CudaCopyEngine(const CudaCopyEngineOptions& options, const DriverApi& driver, std::vector<CUstream> streams)
      : options_(options), driver_(driver), streams_(std::move(streams)) {}

  ~CudaCopyEngine() override {
    DeviceGuard guard(options_.device);
    for (CUstream s : streams_) (void)driver_.cuStreamDestroy(s);
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
        CKPT_CUDA_RETURN_IF_ERROR(driver_.cuStreamWaitEvent(streams_[s], static_cast<CUevent>(after), 0),
                                  fmt::format("trainer snapshot event on stream {}", s));
      }
    }
    auto plan = PlanChunks(regions, static_cast<int>(streams_.size()), options_.chunk_bytes);
    for (size_t s = 0; s < plan.size(); ++s) {
      for (const CopyRegion& c : plan[s]) {
        // Unified addressing: device (IPC-mapped) and pinned host pointers alike.
        CKPT_CUDA_RETURN_IF_ERROR(
            driver_.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(c.dst), reinterpret_cast<CUdeviceptr>(c.src),
                                  c.bytes, streams_[s]),
            fmt::format("chunk of {} bytes on stream {}", c.bytes, s));
      }
    }
    for (size_t s = 0; s < streams_.size(); ++s) {
      CKPT_CUDA_RETURN_IF_ERROR(driver_.cuStreamSynchronize(streams_[s]), fmt::format("stream {}", s));
    }
    return absl::OkStatus();
  }

 private:
  const CudaCopyEngineOptions options_;
  const DriverApi& driver_;
  std::vector<CUstream> streams_;
  std::mutex mu_;
};

}  // namespace

absl::StatusOr<CopyEnginePtr> MakeCudaCopyEngine(const CudaCopyEngineOptions& options) {
  CKPT_CUDA_DRIVER_OR_RETURN(driver, "the CUDA copy engine");
  DeviceGuard guard(options.device);
  if (!guard.ok()) {
    return absl::FailedPreconditionError(fmt::format("CUDA device {} is not usable on this machine ({})",
                                                     options.device, CudaErrorText(guard.status())));
  }
  std::vector<CUstream> streams(std::max(1, options.streams));
  for (CUstream& s : streams) {
    CKPT_CUDA_RETURN_IF_ERROR(driver->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "copy engine stream");
  }
  return CopyEnginePtr(new CudaCopyEngine(options, *driver, std::move(streams)));
}

}  // namespace ckpt::cuda
