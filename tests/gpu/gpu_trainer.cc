// A GPU trainer for the GPU integration test. `save`: many small buffers and one large
// buffer inside one cudaMalloc allocation; their final pre-snapshot value is written by
// device work still queued when Snapshot() is called (the daemon must wait for it), and
// device work queued after StreamWaitStaged overwrites them (the checkpoint must not see
// it). `check`: fresh allocations, Restore(), every byte compared. `run-ahead`: a snapshot
// every step with StreamWaitStaged and no host wait, the CPU many steps ahead of its GPU (as
// PyTorch runs): the stream must drain (it hung with one snapshot event; see TrainerSync).
#include <cuda_runtime_api.h>
#include <signal.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <iostream>
#include <thread>
#include <vector>

#include "client/ckpt_client.h"
#include "common/status.h"

namespace {

constexpr size_t kSmall = 1000, kSmallBytes = 64 << 10, kLargeBytes = 128u << 20;
constexpr unsigned char kFinal = 0x5A, kNoise = 0x11, kOverwrite = 0xFF;

int Fail(const std::string& what) {
  std::cout << "error: " << what << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket, mode = "save", job = "gpu", transport = "ipc";
  bool die = false;
  CLI::App app{"gpu_trainer"};
  app.add_option("--socket", socket)->required();
  app.add_option("--mode", mode)->check(CLI::IsMember({"save", "check", "run-ahead"}));
  app.add_option("--job", job);
  app.add_flag("--die-after-staged", die);
  app.add_option("--transport", transport)->check(CLI::IsMember({"ipc", "host-copy"}));
  CLI11_PARSE(app, argc, argv);

  const size_t total = kSmall * kSmallBytes + kLargeBytes;
  char* base = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&base), total) != cudaSuccess) return Fail("cudaMalloc");
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  auto client = ckpt::Client::Connect(
      {.socket = socket, .job = job,
       .cuda_transport = transport == "ipc" ? ckpt::CudaTransport::kIpc : ckpt::CudaTransport::kHostCopy});
  if (!client.ok()) return Fail(ckpt::Message(client.status()));
  for (size_t i = 0; i < kSmall; ++i) {
    auto t = (*client)->AddCudaTensor("small." + std::to_string(i), "U8",
                                      {static_cast<int64_t>(kSmallBytes)}, base + i * kSmallBytes);
    if (!t.ok()) return Fail(ckpt::Message(t.status()));
  }
  auto large = (*client)->AddCudaTensor("large", "U8", {static_cast<int64_t>(kLargeBytes)},
                                        base + kSmall * kSmallBytes);
  if (!large.ok()) return Fail(ckpt::Message(large.status()));
  if (auto s = (*client)->Register(); !s.ok()) return Fail(ckpt::Message(s));
  (*client)->SetCudaStream(stream);

  if (mode == "save") {
    for (int i = 0; i < 50; ++i) cudaMemsetAsync(base, kNoise, total, stream);  // keeps the GPU busy
    cudaMemsetAsync(base, kFinal, total, stream);  // the state at the snapshot point
    auto ticket = (*client)->Snapshot(1);          // the CPU does not wait for the GPU
    if (!ticket.ok()) return Fail(ckpt::Message(ticket.status()));
    if (auto s = (*client)->StreamWaitStaged(*ticket, stream); !s.ok()) return Fail(ckpt::Message(s));
    for (int i = 0; i < 50; ++i) cudaMemsetAsync(base, kOverwrite, total, stream);  // after staged
    auto staged = (*client)->WaitStaged(*ticket);
    if (!staged.ok() || staged->state != ckpt::TicketState::kStaged) return Fail("not staged");
    std::cout << "staged" << std::endl;
    if (die) ::raise(SIGKILL);  // ckptd holds our IPC handles: it must cope
    auto committed = (*client)->WaitCommitted(*ticket);
    if (!committed.ok() || committed->state != ckpt::TicketState::kCommitted) return Fail("not committed");
    cudaStreamSynchronize(stream);
    std::cout << "committed" << std::endl;
    return 0;
  }
  if (mode == "run-ahead") {
    constexpr int kSteps = 30;
    std::vector<uint64_t> tickets;
    for (int step = 1; step <= kSteps; ++step) {
      for (int i = 0; i < 20; ++i) cudaMemsetAsync(base, kNoise + i, total, stream);  // "forward, backward"
      auto ticket = (*client)->Snapshot(step);
      if (!ticket.ok()) return Fail(ckpt::Message(ticket.status()));
      if (auto s = (*client)->StreamWaitStaged(*ticket, stream); !s.ok()) return Fail(ckpt::Message(s));
      cudaMemsetAsync(base, kFinal, total, stream);  // "optimizer"
      tickets.push_back(*ticket);
    }
    // The CPU is done; the GPU must finish too, within a bound.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > deadline) return Fail("the stream hung: a snapshot's copy never ran");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    int staged = 0;
    for (uint64_t t : tickets) {
      auto r = (*client)->WaitStaged(t, std::chrono::seconds(30));
      staged += r.ok() && (r->state == ckpt::TicketState::kStaged || r->state == ckpt::TicketState::kCommitted);
    }
    std::cout << "run-ahead drained, " << staged << " of " << kSteps << " staged" << std::endl;
    return staged > 0 ? 0 : Fail("no snapshot was staged");
  }
  cudaMemset(base, 0, total);
  auto restored = (*client)->Restore();
  if (!restored.ok() || !restored->found) return Fail("restore failed");
  std::vector<unsigned char> host(total);
  cudaMemcpy(host.data(), base, total, cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < total; ++i) {
    if (host[i] != kFinal) {
      std::cout << "mismatch at byte " << i << ": " << int(host[i]) << std::endl;
      return 1;
    }
  }
  std::cout << "match source=" << ckpt::RestoreSourceName(restored->source)
            << std::endl;
  return 0;
}
