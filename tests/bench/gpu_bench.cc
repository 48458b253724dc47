#include "tests/bench/gpu_bench.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <vector>

#include "client/ckpt_client.h"
#include "common/status.h"
#include "cuda/device.h"

namespace ckpt::bench {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Peak bandwidth of plain cudaMemcpyAsync between pinned host memory and the device.
void PinnedLimits(uint64_t bytes, nlohmann::ordered_json& out) {
  void *host = nullptr, *dev = nullptr;
  cudaHostAlloc(&host, bytes, cudaHostAllocDefault);
  cudaMalloc(&dev, bytes);
  cudaStream_t s;
  cudaStreamCreate(&s);
  double d2h = 0, h2d = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    d2h = std::max(d2h, bytes / Seconds(Clock::now() - t0) / 1e9);
    t0 = Clock::now();
    cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
    h2d = std::max(h2d, bytes / Seconds(Clock::now() - t0) / 1e9);
  }
  out["gpu_pinned_d2h_gbps"] = d2h;
  out["gpu_pinned_h2d_gbps"] = h2d;
  cudaStreamDestroy(s);
  cudaFree(dev);
  cudaFreeHost(host);
}

struct GpuState {
  char* base = nullptr;
  std::unique_ptr<Client> client;
};

// `count` buffers splitting `bytes` of one allocation, registered with ckptd as job `job`.
absl::StatusOr<GpuState> Register(const GpuBenchOptions& o, const std::string& job, int count) {
  GpuState g;
  if (cudaMalloc(reinterpret_cast<void**>(&g.base), o.bytes) != cudaSuccess) {
    return absl::ResourceExhaustedError("cudaMalloc of the benchmark state failed");
  }
  cudaMemset(g.base, 1, o.bytes);
  CKPT_ASSIGN_OR_RETURN(g.client, Client::Connect({.socket = o.socket, .job = job}));
  uint64_t each = o.bytes / count / 256 * 256;
  for (int i = 0; i < count; ++i) {
    auto t = g.client->AddCudaTensor(fmt::format("b{}", i), "U8", {static_cast<int64_t>(each)},
                                     g.base + i * each);
    if (!t.ok()) return t.status();
  }
  CKPT_RETURN_IF_ERROR(g.client->Register());
  return g;
}

}  // namespace

bool RunGpuBench(const GpuBenchOptions& o, nlohmann::ordered_json& out) {
  const cuda::DeviceInfo& device = cuda::DetectDevices();
  if (!device.available()) {
    out["gpu_error"] = "no usable CUDA device: " + device.reason;
    return false;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  out["gpu"] = prop.name;
  out["gpu_bytes"] = o.bytes;
  const auto begin = Clock::now();
  auto note = [&](const std::string& what) {
    o.note(fmt::format("  [{:6.1f} s] {}\n", Seconds(Clock::now() - begin), what));
  };
  PinnedLimits(std::min<uint64_t>(o.bytes, 2ull << 30), out);
  note(fmt::format("pinned limits: D2H {:.1f} GB/s, H2D {:.1f} GB/s", out["gpu_pinned_d2h_gbps"].get<double>(),
                   out["gpu_pinned_h2d_gbps"].get<double>()));

  for (int count : {1, 100, 10000}) {
    auto g = Register(o, fmt::format("gpu{}", count), count);
    if (!g.ok()) {
      out["gpu_error"] = Message(g.status());
      return false;
    }
    note(fmt::format("{} buffers registered", count));
    auto t0 = Clock::now();
    auto ticket = g->client->Snapshot(1);
    auto staged = ticket.ok() ? g->client->WaitStaged(*ticket) : ticket.status();
    double stage = Seconds(Clock::now() - t0);
    if (!staged.ok() || staged->state != TicketState::kStaged) {
      out["gpu_error"] = "GPU snapshot not staged";
      return false;
    }
    note(fmt::format("{} buffers staged at {:.1f} GB/s", count, o.bytes / stage / 1e9));
    (void)g->client->WaitCommitted(*ticket);
    note(fmt::format("{} buffers committed", count));
    t0 = Clock::now();
    auto restored = g->client->Restore();
    double restore = Seconds(Clock::now() - t0);
    out[fmt::format("gpu_staging_gbps_{}_buffers", count)] = o.bytes / stage / 1e9;
    out[fmt::format("gpu_staging_vs_d2h_{}_buffers", count)] =
        o.bytes / stage / 1e9 / out["gpu_pinned_d2h_gbps"].get<double>();
    if (restored.ok() && restored->source == RestoreInfo::Source::kMemory) {
      out[fmt::format("gpu_restore_memory_gbps_{}_buffers", count)] = o.bytes / restore / 1e9;
      out[fmt::format("gpu_restore_vs_h2d_{}_buffers", count)] =
          o.bytes / restore / 1e9 / out["gpu_pinned_h2d_gbps"].get<double>();
    }
    note(fmt::format("{} buffers restored from {} at {:.1f} GB/s", count,
                     restored.ok() ? RestoreSourceName(restored->source) : Message(restored.status()),
                     o.bytes / restore / 1e9));
    cudaFree(g->base);
  }

  // Synthetic training: each step keeps the GPU busy for ~step_ms (memsets of a scratch
  // buffer, "forward and backward"), then an "optimizer" memset of the checkpointed state.
  // A snapshot every `snapshot_every` steps, two ways:
  //  - overlapped (as docs/gpu.md recommends): the snapshot point right after the optimizer,
  //    the wait for "staged" just before the next one, so the copy runs beside the next
  //    forward and backward;
  //  - blocking: the snapshot point right before the optimizer and the wait at once, so
  //    the optimizer waits for the whole copy every step.
  const uint64_t state_bytes = 1ull << 30;
  GpuBenchOptions small = o;
  small.bytes = state_bytes;
  auto g = Register(small, "gpu_loop", 16);
  if (!g.ok()) {
    out["gpu_error"] = Message(g.status());
    return false;
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  g->client->SetCudaStream(stream);
  char* scratch = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&scratch), 1ull << 30);
  // Calibrate: memsets of 1 GiB per step_ms.
  auto t0 = Clock::now();
  for (int i = 0; i < 10; ++i) cudaMemsetAsync(scratch, i, 1ull << 30, stream);
  cudaStreamSynchronize(stream);
  int per_step = std::max(1, static_cast<int>(o.step_ms / 1000.0 / (Seconds(Clock::now() - t0) / 10)));
  // kPlainCopy is the limit for kOverlapped: the same copy, done in this process with a
  // plain cudaMemcpyAsync on a side stream into pinned memory, the same event order.
  enum class Mode { kNone, kOverlapped, kBlocking, kPlainCopy };
  char* pinned = nullptr;
  cudaStream_t side;
  cudaEvent_t point, copied;
  // Unchecked, a failed allocation would time copies that fail at once: a limit too fast.
  if (cudaMallocHost(reinterpret_cast<void**>(&pinned), state_bytes) != cudaSuccess ||
      cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&point, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&copied, cudaEventDisableTiming) != cudaSuccess) {
    out["gpu_error"] = "the training loop's pinned buffer, side stream or events could not be made";
    return false;
  }
  uint64_t next_step = 1;
  struct Loop {
    double step_s;
    int staged;  // snapshots copied (the others refused: staging memory still being written)
  };
  auto run = [&](Mode mode) {
    std::vector<uint64_t> tickets;
    std::optional<uint64_t> pending;  // the overlapped snapshot the next optimizer waits for
    bool plain_pending = false;       // kPlainCopy's copy the next optimizer waits for
    int plain_copies = 0;
    auto start = Clock::now();
    for (int step = 1; step <= o.steps; ++step, ++next_step) {
      for (int i = 0; i < per_step; ++i) cudaMemsetAsync(scratch, step + i, 1ull << 30, stream);
      const bool snapshot = mode != Mode::kNone && step % std::max(1, o.snapshot_every) == 0;
      if (snapshot && mode == Mode::kBlocking) {
        if (auto ticket = g->client->Snapshot(next_step); ticket.ok()) pending = *ticket;
      }
      if (plain_pending) {
        cudaStreamWaitEvent(stream, copied, 0);
        plain_pending = false;
      }
      if (pending) {
        (void)g->client->StreamWaitStaged(*pending, stream);
        tickets.push_back(*pending);
        pending.reset();
      }
      cudaMemsetAsync(g->base, step, state_bytes, stream);  // the optimizer step
      if (snapshot && mode == Mode::kOverlapped) {
        if (auto ticket = g->client->Snapshot(next_step); ticket.ok()) pending = *ticket;
      }
      if (snapshot && mode == Mode::kPlainCopy) {
        cudaEventRecord(point, stream);
        cudaStreamWaitEvent(side, point, 0);
        cudaMemcpyAsync(pinned, g->base, state_bytes, cudaMemcpyDeviceToHost, side);
        cudaEventRecord(copied, side);
        plain_pending = true;
        ++plain_copies;
      }
    }
    if (pending) (void)g->client->StreamWaitStaged(*pending, stream), tickets.push_back(*pending);
    if (plain_pending) cudaStreamWaitEvent(stream, copied, 0);
    cudaStreamSynchronize(stream);
    Loop loop{Seconds(Clock::now() - start) / o.steps, plain_copies};
    for (uint64_t t : tickets) {
      auto r = g->client->WaitStaged(t, std::chrono::seconds(30));
      loop.staged += r.ok() && (r->state == TicketState::kStaged || r->state == TicketState::kCommitted);
    }
    return loop;
  };
  note(fmt::format("training loop: {} memsets of 1 GiB a step, 1 GiB of state", per_step));
  const double plain = run(Mode::kNone).step_s;
  note(fmt::format("{} steps without checkpoints: {:.1f} ms a step", o.steps, plain * 1e3));
  out["gpu_step_ms"] = plain * 1e3;
  for (auto [mode, key] : {std::pair{Mode::kPlainCopy, "_plain_copy"}, std::pair{Mode::kOverlapped, ""},
                           std::pair{Mode::kBlocking, "_blocking"}}) {
    Loop loop = run(mode);
    const char* how = mode == Mode::kPlainCopy ? "the limit: cudaMemcpyAsync beside the loop"
                      : mode == Mode::kBlocking ? "blocking" : "overlapped";
    note(fmt::format("{} steps with a snapshot every {}, {}: {:.1f} ms a step ({:+.1f}%), {} of {} copied",
                     o.steps, o.snapshot_every, how, loop.step_s * 1e3,
                     (loop.step_s - plain) / plain * 100, loop.staged, o.steps / std::max(1, o.snapshot_every)));
    out[fmt::format("gpu_step_with_snapshot{}_ms", key)] = loop.step_s * 1e3;
    out[fmt::format("gpu_step_overhead{}", key)] = (loop.step_s - plain) / plain;
    out[fmt::format("gpu_snapshots_copied{}", key)] = loop.staged;
  }
  cudaEventDestroy(point);
  cudaEventDestroy(copied);
  cudaStreamDestroy(side);
  cudaFreeHost(pinned);
  cudaFree(scratch);
  cudaFree(g->base);
  cudaStreamDestroy(stream);
  return true;
}

}  // namespace ckpt::bench
