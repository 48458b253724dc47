#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/copy_engine.h"

namespace ckpt::cuda {
namespace {

// A fixed pool of workers that share one job at a time; the caller works too, so one
// thread means a plain memcpy on the caller.
class HostCopyEngine final : public CopyEngine {
 public:
  HostCopyEngine(int threads, size_t chunk_bytes) : chunk_bytes_(chunk_bytes) {
    for (int i = 1; i < std::max(1, threads); ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  ~HostCopyEngine() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  std::string_view name() const override { return "host"; }

  absl::Status Copy(std::span<const CopyRegion> regions) override {
    std::lock_guard serial(copy_mu_);  // one job at a time
    std::vector<CopyRegion> chunks;
    for (const CopyRegion& r : regions) {
      for (size_t off = 0; off < r.bytes; off += chunk_bytes_) {
        size_t n = std::min(chunk_bytes_, r.bytes - off);
        chunks.push_back({static_cast<char*>(r.dst) + off, static_cast<const char*>(r.src) + off, n});
      }
    }
    {
      std::lock_guard lock(mu_);
      chunks_ = &chunks;
      next_ = 0;
      busy_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    Drain(chunks);
    std::unique_lock lock(mu_);
    done_.wait(lock, [this] { return busy_ == 0; });
    chunks_ = nullptr;
    return absl::OkStatus();
  }

 private:
  void Drain(const std::vector<CopyRegion>& chunks) {
    while (true) {
      size_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= chunks.size()) return;
      std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].bytes);
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    while (true) {
      const std::vector<CopyRegion>* chunks;
      {
        std::unique_lock lock(mu_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        chunks = chunks_;
      }
      Drain(*chunks);
      std::lock_guard lock(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  const size_t chunk_bytes_;
  std::mutex copy_mu_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::vector<CopyRegion>* chunks_ = nullptr;
  std::atomic<size_t> next_{0};
  size_t busy_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

CopyEnginePtr MakeHostCopyEngine(int threads, size_t chunk_bytes) {
  return std::make_unique<HostCopyEngine>(threads, chunk_bytes);
}

}  // namespace ckpt::cuda
