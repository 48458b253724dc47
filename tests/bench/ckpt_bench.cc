// ckpt_bench: ckptd's data-path figures against this machine's own limits, in one run.
//
//   bazel run //tests/bench:ckpt_bench -- [--ranks 2] [--bytes-per-rank 2G] [--json]
//
// Limits measured first: memcpy bandwidth (1 and --copy-threads threads, best taken) and
// the write bandwidth of --root's filesystem the way ckptd writes (O_DIRECT, 32 MiB writes,
// --io-threads streams, fdatasync; a buffered single stream is shown beside it). Then a real ckptd
// and one client per rank (threads of this process, each its own session):
//   snapshot()   latency of the call, p50/p99 over many calls (small state: the call is a
//                ring write and does not depend on size; the big snapshots' calls are
//                reported too);
//   staging      bytes / (first snapshot() -> every rank staged), all ranks at once; memcpy
//                is measured again right before each round (the host's bandwidth varies);
//   persist      bytes on disk / (last staged -> committed), fsync included; the write limit
//                is measured again right before each round (virtual disks vary). Writing
//                starts while staging runs, so this is the tail the trainer never sees;
//   end to end   bytes on disk / (first snapshot() -> committed): the whole checkpoint,
//                staging and writing overlapped;
//   restore      from daemon memory (hot; median of 5), then from disk after a daemon restart
//                with the page cache dropped where permitted, then from disk by one rank
//                more than saved the step (resharding: rows split another way);
//   export       `ckptctl export --format safetensors` of the last step, against copying
//                the step's files (read + write, the way export does them);
//   torch.save   the same state saved by Debian's python3-torch, fsync included.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <thread>
#include <vector>

#include "client/ckpt_client.h"
#include "common/status.h"
#include "cuda/device.h"
#include "daemon/config.h"
#include "tests/bench/gpu_bench.h"

namespace {

using Clock = std::chrono::steady_clock;
using ckpt::Message;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Gbps(uint64_t bytes, double seconds) { return bytes / seconds / 1e9; }

struct Flags {
  int ranks = 2;
  std::string bytes_per_rank = "2G";
  uint64_t bytes = 0;
  int rounds = 3;
  int latency_samples = 2000;
  int copy_threads = 2;
  int io_threads = 2;
  std::string root;
  std::string ckptd;
  std::string python = "/usr/bin/python3";
  std::string staging_chunk = "128M";
  bool json = false;
  bool skip_torch = false;
  bool gpu = false;
  bool gpu_only = false;
  std::string gpu_bytes = "8G";
  int gpu_step_ms = 100;
  int gpu_snapshot_every = 4;
  // Incremental checkpoints (--increments on): the share of each rank's state that changes
  // between two checkpoints (the first bytes of its first tensor); 0 skips the measure.
  double changed = 0.01;
  // Global tensors each rank's state is split into: 8 large ones by default; a model's
  // hundreds of a few MB each (--tensors 400) is what restores read one by one.
  int tensors = 8;
};

[[noreturn]] void Die(const std::string& why) {
  std::cerr << "ckpt_bench: " << why << "\n";
  std::exit(1);
}

// --- machine limits -------------------------------------------------------------------

double MemcpyGbps(int threads, int reps = 3) {
  const size_t bytes = size_t{1} << 30;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    std::vector<std::thread> pool;
    size_t part = bytes / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] { std::memcpy(dst.data() + t * part, src.data() + t * part, part); });
    }
    for (auto& th : pool) th.join();
    best = std::max(best, Gbps(bytes, Seconds(Clock::now() - t0)));
  }
  return best;
}

// One sequential write of `bytes` in 16 MiB chunks ended by fdatasync, after a sync so that
// earlier dirty pages do not count against it.
double DiskWriteOnce(const std::string& dir, uint64_t bytes) {
  std::string path = dir + "/write-limit.bin";
  std::vector<char> chunk(16 << 20, 7);
  ::sync();
  auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) Die("cannot create " + path);
  for (uint64_t off = 0; off < bytes; off += chunk.size()) {
    if (::write(fd, chunk.data(), chunk.size()) != static_cast<ssize_t>(chunk.size())) Die("write failed");
  }
  ::fdatasync(fd);
  ::close(fd);
  double gbps = Gbps(bytes, Seconds(Clock::now() - t0));
  std::filesystem::remove(path);
  return gbps;
}


// The disk limit the way ckptd writes (daemon/persist/local_fs_shard_writer.cc): `streams`
// files written at once, one per I/O thread, each in 32 MiB O_DIRECT writes from aligned
// memory and ended by fdatasync (buffered where the filesystem refuses O_DIRECT, as
// ckptd does). What ckptd's persist figure is compared with: a single buffered stream
// undersells what the device does for ckptd, and ckptd "beat" it several times over.
double DiskWriteLikeCkptd(const std::string& dir, uint64_t bytes, int streams) {
  constexpr uint64_t kWrite = 32u << 20;
  void* raw = nullptr;
  if (::posix_memalign(&raw, 4096, kWrite) != 0) Die("posix_memalign");
  std::unique_ptr<char, decltype(&std::free)> buffer(static_cast<char*>(raw), &std::free);
  std::memset(buffer.get(), 7, kWrite);
  const uint64_t per_stream = (bytes / streams + kWrite - 1) / kWrite * kWrite;
  ::sync();
  auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (int i = 0; i < streams; ++i) {
    pool.emplace_back([&, i] {
      std::string path = fmt::format("{}/write-limit-direct.{}", dir, i);
      int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
      if (fd < 0) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd < 0) Die("cannot create " + path);
      for (uint64_t off = 0; off < per_stream; off += kWrite) {
        if (::pwrite(fd, buffer.get(), kWrite, static_cast<off_t>(off)) != static_cast<ssize_t>(kWrite)) {
          Die("write failed: " + path);
        }
      }
      ::fdatasync(fd);
      ::close(fd);
    });
  }
  for (auto& th : pool) th.join();
  double gbps = Gbps(per_stream * streams, Seconds(Clock::now() - t0));
  for (int i = 0; i < streams; ++i) std::filesystem::remove(fmt::format("{}/write-limit-direct.{}", dir, i));
  return gbps;
}

bool DropPageCache() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  f << "3\n";
  f.flush();
  return f.good();
}

// --- the daemon -------------------------------------------------------------------------

class DaemonProcess {
 public:
  // Full checkpoints unless `extra` says otherwise: the figures compare whole checkpoints with
  // torch.save, DCP and the disk (the bench saves the same bytes again and again, which
  // increments, ckptd's default, would mostly reference); the increments section measures both.
  DaemonProcess(const Flags& f, uint64_t staging, std::vector<std::string> extra = {"--increments", "off"}) {
    socket_ = f.root + "/ckptd.sock";
    pid_ = ::fork();
    if (pid_ == 0) {
      int log = ::open((f.root + "/ckptd.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(log, 2);
      ::dup2(log, 1);  // nothing of the bench's own output stays open in the daemon
      const char* level = std::getenv("CKPT_BENCH_LOG_LEVEL");
      std::vector<std::string> args = {f.ckptd, "--root", f.root + "/ckpt", "--socket", socket_,
                                       "--staging-bytes", std::to_string(staging),
                                       "--staging-chunk", f.staging_chunk, "--keep-last", "1",
                                       "--copy-threads", std::to_string(f.copy_threads),
                                       "--io-threads", std::to_string(f.io_threads),
                                       "--log-level", level ? level : "warn"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(f.ckptd.c_str(), argv.data());
      _exit(127);
    }
    for (int i = 0; i < 600 && !std::filesystem::exists(socket_); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!std::filesystem::exists(socket_)) Die("ckptd did not start; see " + f.root + "/ckptd.log");
    // Measure a daemon whose staging memory is fully populated, as it is in steady state.
    std::string ctl = std::filesystem::path(f.ckptd).parent_path().parent_path().string() +
                      "/client/ckptctl";
    bool prefaulted = false;
    for (int i = 0; i < 1200 && !prefaulted; ++i) {
      std::string cmd = ctl + " --socket " + socket_ + " --json status 2>/dev/null";
      FILE* p = ::popen(cmd.c_str(), "r");
      std::string text;
      char buf[4096];
      while (p && std::fgets(buf, sizeof buf, p)) text += buf;
      if (p) ::pclose(p);
      prefaulted = text.find("\"staging_prefaulted\": true") != std::string::npos;
      if (!prefaulted) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!prefaulted) Die("`" + ctl + " status` never reported the staging memory prefaulted");
  }
  ~DaemonProcess() {
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
  }
  const std::string& socket() const { return socket_; }

 private:
  pid_t pid_;
  std::string socket_;
};

struct Rank {
  std::unique_ptr<ckpt::Client> client;
  std::vector<ckpt::Tensor*> tensors;
  double register_seconds = 0;  // Register(): arenas handed over, mapped and pre-faulted by ckptd
};

// Registers the state of --ranks ranks of `bytes` each, as --tensors global F32 tensors ("layer.k")
// split by rows over `world` ranks: evenly over --ranks as saved; over another world as
// evenly as it goes (the resharding restore).
std::vector<Rank> Connect(const Flags& f, const DaemonProcess& d, const std::string& job, uint64_t bytes,
                          int world = 0) {
  if (world == 0) world = f.ranks;
  std::vector<Rank> ranks(world);
  const int pieces = bytes >= (uint64_t{1} << 20) * f.tensors ? f.tensors : 1;
  const auto global = static_cast<int64_t>(bytes / pieces / 4) * f.ranks;  // elements
  for (int r = 0; r < world; ++r) {
    const int64_t begin = global * r / world, end = global * (r + 1) / world;
    auto c = ckpt::Client::Connect({.socket = d.socket(), .job = job, .rank = static_cast<uint32_t>(r),
                                    .world_size = static_cast<uint32_t>(world),
                                    .arena_bytes = static_cast<size_t>(end - begin) * 4 * pieces + (1 << 20)});
    if (!c.ok()) Die(Message(c.status()));
    ranks[r].client = std::move(*c);
    for (int k = 0; k < pieces; ++k) {
      auto t = ranks[r].client->AllocateTensor(fmt::format("layer.{}", k), "F32", {end - begin}, {global}, {begin});
      if (!t.ok()) Die(Message(t.status()));
      std::memset((*t)->data, r + k + 1, (*t)->nbytes);  // touch every page
      ranks[r].tensors.push_back(*t);
    }
    auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = ranks[r].client->Register(); !s.ok()) Die(Message(s));
    ranks[r].register_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return ranks;
}

// The device's limit for what export does: read `files` (32 MiB preads, page cache dropped
// first where permitted) and write them to one new file in `dir` (buffered, fdatasync at
// the end), the write of one chunk overlapping the read of the next, as export does.
double CopyLimitGbps(const std::vector<std::string>& files, const std::string& dir) {
  constexpr size_t kChunk = 32u << 20;
  std::vector<char> buffers[2] = {std::vector<char>(kChunk), std::vector<char>(kChunk)};
  const std::string out = dir + "/copy-limit.bin";
  ::sync();
  auto t0 = Clock::now();
  int w = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (w < 0) Die("cannot create " + out);
  uint64_t total = 0;
  int current = 0;
  std::future<void> writing;
  for (const std::string& path : files) {
    int r = ::open(path.c_str(), O_RDONLY);
    if (r < 0) Die("cannot open " + path);
    uint64_t at = 0;
    for (ssize_t n; (n = ::pread(r, buffers[current].data(), kChunk, static_cast<off_t>(at))) > 0; at += n) {
      if (writing.valid()) writing.get();
      writing = std::async(std::launch::async, [&, data = buffers[current].data(), n] {
        if (::write(w, data, n) != n) Die("write failed: " + out);
      });
      current ^= 1;
    }
    total += at;
    ::close(r);
  }
  if (writing.valid()) writing.get();
  ::fdatasync(w);
  ::close(w);
  double gbps = Gbps(total, Seconds(Clock::now() - t0));
  std::filesystem::remove(out);
  return gbps;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// Runs fn(rank) on one thread per rank and waits.
template <typename Fn>
void OnEveryRank(int ranks, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back([&, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// Incremental checkpoints against full ones of the same state, same changes, same run: a
// daemon with --increments off, then one with it on, each taking `rounds` checkpoints after
// the first (which both write whole), `changed` of every rank's state changed before each.
// Per daemon: median snapshot -> committed, and the bytes written per checkpoint.
void MeasureIncrements(const Flags& f, nlohmann::ordered_json& out, const std::function<void(const std::string&)>& note) {
  const uint64_t total = f.bytes * f.ranks;
  for (const bool on : {false, true}) {
    const std::string mode = on ? "on" : "off";
    std::filesystem::remove_all(f.root + "/ckpt/inc");
    DaemonProcess daemon(f, total * 9 / 4 + (64 << 20), {"--increments", mode});
    auto ranks = Connect(f, daemon, "inc", f.bytes);
    std::vector<double> seconds;
    std::vector<double> written;
    for (int round = 0; round <= f.rounds; ++round) {
      for (Rank& r : ranks) {  // the first bytes of the first tensor change: `changed` of the state
        const size_t n = std::min(r.tensors[0]->nbytes, static_cast<size_t>(f.changed * f.bytes));
        std::memset(r.tensors[0]->data, 100 + round, n);
      }
      const uint64_t step = 1000 + round;
      auto t0 = Clock::now();
      OnEveryRank(f.ranks, [&](int r) {
        auto t = ranks[r].client->Snapshot(step);
        if (!t.ok()) Die(Message(t.status()));
        auto c = ranks[r].client->WaitCommitted(*t);
        if (!c.ok() || c->state != ckpt::TicketState::kCommitted) Die("not committed: " + (c.ok() ? c->error : Message(c.status())));
      });
      const double took = Seconds(Clock::now() - t0);
      uint64_t bytes = 0;
      for (const auto& e : std::filesystem::directory_iterator(fmt::format("{}/ckpt/inc/step-{:08d}", f.root, step))) {
        if (e.path().extension() == ".safetensors") bytes += e.file_size();
      }
      if (round == 0) continue;  // the first is whole either way
      seconds.push_back(took);
      written.push_back(static_cast<double>(bytes));
    }
    out["increments_" + mode + "_commit_s"] = Percentile(seconds, 0.5);
    out["increments_" + mode + "_written_bytes"] = Percentile(written, 0.5);
    note(fmt::format("increments {}: snapshot -> committed {:.3f} s, {:.1f} MB written per checkpoint\n", mode,
                     Percentile(seconds, 0.5), Percentile(written, 0.5) / 1e6));
  }
  std::filesystem::remove_all(f.root + "/ckpt/inc");
  out["increments_changed"] = f.changed;
  out["increments_written_vs_full"] =
      out["increments_on_written_bytes"].get<double>() / out["increments_off_written_bytes"].get<double>();
  out["increments_sooner"] = out["increments_off_commit_s"].get<double>() / out["increments_on_commit_s"].get<double>();
}

double TorchSaveGbps(const Flags& f, uint64_t bytes_per_rank) {
  std::string script = fmt::format(R"(
import os, time, torch
ranks, n = {}, {}
state = [{{f"layer.{{k}}": torch.full((n // 8,), float(r + k + 1)) for k in range(8)}} for r in range(ranks)]
t0 = time.perf_counter()
for r in range(ranks):
    path = os.path.join("{}", f"torch-rank{{r}}.pt")
    with open(path, "wb") as fh:
        torch.save(state[r], fh)
        fh.flush()
        os.fsync(fh.fileno())
print(time.perf_counter() - t0)
for r in range(ranks):
    os.remove(os.path.join("{}", f"torch-rank{{r}}.pt"))
)", f.ranks, bytes_per_rank / 4, f.root, f.root);
  std::string path = f.root + "/torch_save_bench.py";
  std::ofstream(path) << script;
  std::string cmd = f.python + " " + path;
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[128] = {0};
  if (p == nullptr || std::fgets(buf, sizeof buf, p) == nullptr) Die("torch.save benchmark failed");
  ::pclose(p);
  return Gbps(bytes_per_rank * f.ranks, std::atof(buf));
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"ckpt_bench: ckptd throughput and latency against this machine's limits"};
  app.add_option("--ranks", f.ranks)->capture_default_str();
  app.add_option("--bytes-per-rank", f.bytes_per_rank, "e.g. 2G, 256M")->capture_default_str();
  app.add_option("--rounds", f.rounds, "checkpoints timed (medians reported)")->capture_default_str();
  app.add_option("--latency-samples", f.latency_samples, "snapshot() calls per rank")->capture_default_str();
  app.add_option("--copy-threads", f.copy_threads)->capture_default_str();
  app.add_option("--tensors", f.tensors, "global tensors per rank's state (each at least 1 MiB)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--io-threads", f.io_threads)->capture_default_str();
  app.add_option("--staging-chunk", f.staging_chunk, "ckptd's --staging-chunk")->capture_default_str();
  app.add_option("--root", f.root, "directory on the storage to measure (default: a temp dir)");
  app.add_option("--ckptd", f.ckptd, "ckptd binary (default: from runfiles)");
  app.add_option("--python", f.python)->capture_default_str();
  app.add_flag("--skip-torch", f.skip_torch);
  app.add_option("--changed", f.changed,
                 "incremental checkpoints: share of the state changed between two (0: not measured)")
      ->capture_default_str();
  app.add_flag("--json", f.json, "print one JSON object");
  app.add_flag("--gpu", f.gpu, "also run the GPU benchmark (pinned limits, IPC staging, step overhead)");
  app.add_flag("--gpu-only", f.gpu_only, "run only the GPU benchmark (and the memcpy limit)");
  app.add_option("--gpu-bytes", f.gpu_bytes, "GPU state for the GPU benchmark")->capture_default_str();
  app.add_option("--gpu-step-ms", f.gpu_step_ms, "busy GPU time per synthetic step")->capture_default_str();
  app.add_option("--gpu-snapshot-every", f.gpu_snapshot_every, "steps between snapshots in the GPU training loop")
      ->check(CLI::PositiveNumber)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // The same size syntax as ckptd's flags (K, M, G, T).
  auto parse_bytes = [](const std::string& flag, const std::string& text) {
    auto bytes = ckpt::daemon::ParseBytes(text);
    if (!bytes.ok()) Die(flag + ": " + Message(bytes.status()));
    return *bytes;
  };
  f.bytes = parse_bytes("--bytes-per-rank", f.bytes_per_rank) / 64 * 64;
  if (f.ckptd.empty()) {
    const char* rf = std::getenv("RUNFILES_DIR");
    // `bazel run` starts us in our runfiles tree; a direct start is usually the repo root.
    f.ckptd = rf ? std::string(rf) + "/ckptd/daemon/ckptd"
                 : std::filesystem::exists("daemon/ckptd") ? "daemon/ckptd" : "bazel-bin/daemon/ckptd";
  }
  // ckptctl is found beside it (../client/ckptctl): a relative "daemon/ckptd" has no parent
  // folder to climb to.
  f.ckptd = std::filesystem::absolute(f.ckptd).string();
  bool own_root = f.root.empty();
  if (own_root) {
    std::string tmpl = "/var/tmp/ckpt-bench.XXXXXX";
    f.root = ::mkdtemp(tmpl.data());
  }
  const uint64_t total = f.bytes * f.ranks;
  auto note = [&](const std::string& s) { if (!f.json) std::cerr << s << std::flush; };

  nlohmann::ordered_json out;
  out["ranks"] = f.ranks;
  out["bytes_per_rank"] = f.bytes;
  out["cpus"] = std::thread::hardware_concurrency();

  note("measuring memcpy bandwidth... ");
  double memcpy1 = MemcpyGbps(1), memcpyn = MemcpyGbps(f.copy_threads);
  out["memcpy_gbps"] = std::max(memcpy1, memcpyn);
  out["memcpy_1thread_gbps"] = memcpy1;
  note(fmt::format("{:.2f} GB/s\n", out["memcpy_gbps"].get<double>()));

  auto run_gpu = [&] {
    if (!ckpt::cuda::DetectDevices().available()) {
      out["gpu_error"] = "no usable CUDA device: " + ckpt::cuda::DetectDevices().reason;
      note("GPU benchmark not run: " + out["gpu_error"].get<std::string>() + "\n");
      return;
    }
    note("GPU benchmark:\n");
    uint64_t gpu_bytes = parse_bytes("--gpu-bytes", f.gpu_bytes);
    DaemonProcess daemon(f, 2 * gpu_bytes + (1ull << 30));
    ckpt::bench::GpuBenchOptions g;
    g.socket = daemon.socket();
    g.bytes = gpu_bytes;
    g.step_ms = f.gpu_step_ms;
    g.snapshot_every = f.gpu_snapshot_every;
    g.note = note;
    bool ran = ckpt::bench::RunGpuBench(g, out);
    note(ran ? "GPU benchmark done\n" : "GPU benchmark not run: " + out["gpu_error"].get<std::string>() + "\n");
  };
  // The GPU benchmark's figures, as measured (gpu_bench.cc names them).
  auto print_gpu_rows = [&] {
    for (const auto& [key, value] : out.items()) {
      if (key.rfind("gpu", 0) != 0) continue;
      std::cout << fmt::format("{:<34} {:>16}\n", key,
                               value.is_number_float() ? fmt::format("{:.3f}", value.get<double>()) : value.dump());
    }
  };
  if (f.gpu_only) {
    run_gpu();
    if (own_root) std::filesystem::remove_all(f.root);
    if (f.json) std::cout << out.dump() << "\n";
    else print_gpu_rows();
    return out.contains("gpu_error") ? 1 : 0;
  }

  {
    DaemonProcess daemon(f, total * 9 / 4 + (64 << 20));
    // snapshot() latency: many calls on a small state (the call's cost does not depend on it).
    note("measuring snapshot() latency... ");
    {
      auto ranks = Connect(f, daemon, "latency", 64 << 10);
      std::vector<std::vector<double>> lat(f.ranks);
      OnEveryRank(f.ranks, [&](int r) {
        for (int i = 1; i <= f.latency_samples; ++i) {
          auto t0 = Clock::now();
          auto ticket = ranks[r].client->Snapshot(i);
          double us = Seconds(Clock::now() - t0) * 1e6;
          if (!ticket.ok()) Die(Message(ticket.status()));
          lat[r].push_back(us);
          (void)ranks[r].client->WaitStaged(*ticket);
        }
      });
      std::vector<double> all;
      for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
      out["snapshot_p50_us"] = Percentile(all, 0.50);
      out["snapshot_p99_us"] = Percentile(all, 0.99);
      out["snapshot_samples"] = all.size();
      note(fmt::format("p50 {:.1f} us, p99 {:.1f} us\n", out["snapshot_p50_us"].get<double>(),
                       out["snapshot_p99_us"].get<double>()));
    }

    note(fmt::format("registering {} ranks x {} bytes...\n", f.ranks, f.bytes));
    auto ranks = Connect(f, daemon, "bench", f.bytes);
    double register_seconds = 0;
    for (const Rank& r : ranks) register_seconds = std::max(register_seconds, r.register_seconds);
    out["register_ms"] = register_seconds * 1e3;
    out["register_gbps"] = Gbps(f.bytes, register_seconds);
    note(fmt::format("Register() of {} bytes: {:.1f} ms ({:.1f} GB/s)\n", f.bytes,
                     register_seconds * 1e3, out["register_gbps"].get<double>()));
    // Virtual disks vary a lot from one second to the next: the write limit is measured
    // right before every round, on the same number of bytes, and medians are reported.
    std::vector<double> stage_gbps, persist_gbps, limit_gbps, persist_ratio, memcpy_gbps, stage_ratio;
    std::vector<double> buffered_gbps;  // the single buffered stream, for reference
    std::vector<double> end_to_end_gbps, end_to_end_ratio;
    double big_call_us = 0;
    for (int round = 1; round <= f.rounds; ++round) {
      buffered_gbps.push_back(DiskWriteOnce(f.root, total));
      limit_gbps.push_back(DiskWriteLikeCkptd(f.root, total, f.io_threads));
      memcpy_gbps.push_back(MemcpyGbps(f.copy_threads, 2));
      std::vector<Clock::time_point> staged_at(f.ranks), committed_at(f.ranks);
      auto t0 = Clock::now();
      OnEveryRank(f.ranks, [&](int r) {
        auto c0 = Clock::now();
        auto t = ranks[r].client->Snapshot(round * 100);
        big_call_us = std::max(big_call_us, Seconds(Clock::now() - c0) * 1e6);
        if (!t.ok()) Die(Message(t.status()));
        auto s = ranks[r].client->WaitStaged(*t);
        staged_at[r] = Clock::now();
        if (!s.ok() || s->state != ckpt::TicketState::kStaged) Die("not staged: " + (s.ok() ? s->error : Message(s.status())));
        auto c = ranks[r].client->WaitCommitted(*t);
        committed_at[r] = Clock::now();
        if (!c.ok() || c->state != ckpt::TicketState::kCommitted) Die("not committed: " + (c.ok() ? c->error : Message(c.status())));
      });
      auto staged = *std::max_element(staged_at.begin(), staged_at.end());
      auto committed = *std::max_element(committed_at.begin(), committed_at.end());
      uint64_t disk_bytes = 0;
      for (const auto& e : std::filesystem::recursive_directory_iterator(
               fmt::format("{}/ckpt/bench/step-{:08d}", f.root, round * 100))) {
        if (e.is_regular_file()) disk_bytes += e.file_size();
      }
      stage_gbps.push_back(Gbps(total, Seconds(staged - t0)));
      persist_gbps.push_back(Gbps(disk_bytes, Seconds(committed - staged)));
      persist_ratio.push_back(persist_gbps.back() / limit_gbps.back());
      end_to_end_gbps.push_back(Gbps(disk_bytes, Seconds(committed - t0)));
      end_to_end_ratio.push_back(end_to_end_gbps.back() / limit_gbps.back());
      stage_ratio.push_back(stage_gbps.back() / memcpy_gbps.back());
      note(fmt::format("round {}: memcpy {:.2f} GB/s, staged {:.2f} GB/s ({:.0f}%); write limit {:.2f} GB/s, "
                       "persisted {:.2f} GB/s ({:.0f}%); end to end {:.2f} GB/s ({:.0f}%)\n",
                       round, memcpy_gbps.back(), stage_gbps.back(), 100 * stage_ratio.back(),
                       limit_gbps.back(), persist_gbps.back(), 100 * persist_ratio.back(),
                       end_to_end_gbps.back(), 100 * end_to_end_ratio.back()));
    }
    out["snapshot_big_call_max_us"] = big_call_us;
    out["staging_gbps"] = Percentile(stage_gbps, 0.5);
    out["staging_vs_memcpy"] = Percentile(stage_ratio, 0.5);
    out["memcpy_round_gbps_min"] = *std::min_element(memcpy_gbps.begin(), memcpy_gbps.end());
    out["memcpy_round_gbps_max"] = *std::max_element(memcpy_gbps.begin(), memcpy_gbps.end());
    out["persist_gbps"] = Percentile(persist_gbps, 0.5);
    out["disk_write_gbps"] = Percentile(limit_gbps, 0.5);
    out["disk_write_gbps_min"] = *std::min_element(limit_gbps.begin(), limit_gbps.end());
    out["disk_write_gbps_max"] = *std::max_element(limit_gbps.begin(), limit_gbps.end());
    out["disk_write_buffered_single_stream_gbps"] = Percentile(buffered_gbps, 0.5);
    out["persist_vs_disk"] = Percentile(persist_ratio, 0.5);
    out["end_to_end_gbps"] = Percentile(end_to_end_gbps, 0.5);
    out["end_to_end_vs_disk"] = Percentile(end_to_end_ratio, 0.5);

    std::vector<std::string> source(f.ranks);
    std::vector<double> hot;
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = Clock::now();
      OnEveryRank(f.ranks, [&](int r) {
        auto info = ranks[r].client->Restore();
        if (!info.ok() || !info->found) Die("hot restore failed");
        source[r] = ckpt::RestoreSourceName(info->source);
      });
      hot.push_back(Gbps(total, Seconds(Clock::now() - t0)));
    }
    out["restore_memory_gbps"] = Percentile(hot, 0.5);
    out["restore_memory_source"] = source[0];
  }
  {
    bool cold = DropPageCache();
    DaemonProcess daemon(f, total + (64 << 20));
    auto ranks = Connect(f, daemon, "bench", f.bytes);
    if (cold) cold = DropPageCache();
    std::vector<std::string> source(f.ranks);
    auto t0 = Clock::now();
    OnEveryRank(f.ranks, [&](int r) {
      auto info = ranks[r].client->Restore();
      if (!info.ok() || !info->found) Die("disk restore failed: " + (info.ok() ? "" : Message(info.status())));
      source[r] = ckpt::RestoreSourceName(info->source);
    });
    out["restore_disk_gbps"] = Gbps(total, Seconds(Clock::now() - t0));
    out["restore_disk_source"] = source[0];
    out["restore_disk_page_cache"] = cold ? "dropped" : "warm (could not drop)";
    ranks.clear();

    // The same step restored by one rank more, each holding other rows: every rank reads
    // parts of the saved shards it overlaps (the read planner's partial, chunk-checked reads).
    const int world = f.ranks + 1;
    auto more = Connect(f, daemon, "bench", f.bytes, world);
    DropPageCache();
    t0 = Clock::now();
    OnEveryRank(world, [&](int r) {
      auto info = more[r].client->Restore();
      if (!info.ok() || !info->found) Die("resharding restore failed: " + (info.ok() ? "" : Message(info.status())));
    });
    out["restore_reshard_world"] = world;
    out["restore_reshard_gbps"] = Gbps(total, Seconds(Clock::now() - t0));
  }
  {
    // ckptctl export of the last step, from its files alone, against copying those files.
    const uint64_t step = static_cast<uint64_t>(f.rounds) * 100;
    const std::string dir = fmt::format("{}/ckpt/bench/step-{:08d}", f.root, step);
    std::vector<std::string> files;
    uint64_t step_bytes = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string()), step_bytes += e.file_size();
    }
    DropPageCache();
    out["copy_limit_gbps"] = CopyLimitGbps(files, f.root);
    DropPageCache();
    const std::string ctl = std::filesystem::path(f.ckptd).parent_path().parent_path().string() + "/client/ckptctl";
    const std::string target = f.root + "/export.safetensors";
    const std::string cmd = fmt::format("{} export --root {}/ckpt --job bench --format safetensors --no-progress {} {} >/dev/null",
                                        ctl, f.root, step, target);
    auto t0 = Clock::now();
    if (std::system(cmd.c_str()) != 0) Die("export failed: " + cmd);
    out["export_gbps"] = Gbps(step_bytes, Seconds(Clock::now() - t0));
    std::filesystem::remove(target);
  }
  if (f.changed > 0) {
    note(fmt::format("incremental checkpoints, {:.1f}% of the state changed each time:\n", 100 * f.changed));
    MeasureIncrements(f, out, note);
  }
  if (f.gpu) run_gpu();
  if (!f.skip_torch) {
    note("torch.save of the same state... ");
    out["torch_save_gbps"] = TorchSaveGbps(f, f.bytes);
    note(fmt::format("{:.2f} GB/s\n", out["torch_save_gbps"].get<double>()));
  }
  double memcpy = out["memcpy_gbps"], disk = out["disk_write_gbps"];
  out["restore_memory_vs_memcpy"] = out["restore_memory_gbps"].get<double>() / memcpy;
  if (own_root) std::filesystem::remove_all(f.root);

  if (f.json) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  auto row = [](const std::string& what, const std::string& value, const std::string& target) {
    std::cout << fmt::format("{:<34} {:>16}   {}\n", what, value, target);
  };
  std::cout << fmt::format("\n{} ranks x {:.2f} GiB, {} CPUs\n", f.ranks, f.bytes / double(1 << 30),
                           out["cpus"].get<unsigned>());
  row("memcpy (limit)", fmt::format("{:.2f} GB/s", memcpy),
      fmt::format("at start; {:.2f} to {:.2f} before rounds", out["memcpy_round_gbps_min"].get<double>(),
                  out["memcpy_round_gbps_max"].get<double>()));
  row("write as ckptd does (limit)", fmt::format("{:.2f} GB/s", disk),
      fmt::format("O_DIRECT, 32 MiB writes, {} streams, fdatasync; median, {:.2f} to {:.2f} across rounds",
                  f.io_threads, out["disk_write_gbps_min"].get<double>(), out["disk_write_gbps_max"].get<double>()));
  row("buffered single stream", fmt::format("{:.2f} GB/s", out["disk_write_buffered_single_stream_gbps"].get<double>()),
      "16 MiB writes + fdatasync, for reference (not the limit)");
  row("snapshot() p50", fmt::format("{:.1f} us", out["snapshot_p50_us"].get<double>()), "");
  row("snapshot() p99", fmt::format("{:.1f} us", out["snapshot_p99_us"].get<double>()), "target < 200 us");
  row("staging", fmt::format("{:.2f} GB/s", out["staging_gbps"].get<double>()),
      fmt::format("median of per-round {:.0f}% of memcpy (target >= 70%)",
                  100 * out["staging_vs_memcpy"].get<double>()));
  row("persist", fmt::format("{:.2f} GB/s", out["persist_gbps"].get<double>()),
      fmt::format("median of per-round {:.0f}% of write (target >= 80%)",
                  100 * out["persist_vs_disk"].get<double>()));
  row("snapshot -> committed", fmt::format("{:.2f} GB/s", out["end_to_end_gbps"].get<double>()),
      fmt::format("median of per-round {:.0f}% of write; staging and writing overlap",
                  100 * out["end_to_end_vs_disk"].get<double>()));
  row("restore from memory", fmt::format("{:.2f} GB/s", out["restore_memory_gbps"].get<double>()),
      fmt::format("{:.0f}% of memcpy (target >= 70%)", 100 * out["restore_memory_vs_memcpy"].get<double>()));
  row("restore from disk", fmt::format("{:.2f} GB/s", out["restore_disk_gbps"].get<double>()),
      "page cache " + out["restore_disk_page_cache"].get<std::string>());
  row(fmt::format("restore from disk on {} ranks", out["restore_reshard_world"].get<int>()),
      fmt::format("{:.2f} GB/s", out["restore_reshard_gbps"].get<double>()),
      "resharding: partial, chunk-checked reads of every overlapping shard");
  row("copy the step's files (limit)", fmt::format("{:.2f} GB/s", out["copy_limit_gbps"].get<double>()),
      "32 MiB preads, each written while the next is read, one buffered file + fdatasync, page cache dropped");
  row("ckptctl export --format safetensors", fmt::format("{:.2f} GB/s", out["export_gbps"].get<double>()),
      fmt::format("{:.0f}% of the copy limit", 100 * out["export_gbps"].get<double>() / out["copy_limit_gbps"].get<double>()));
  if (out.contains("increments_on_commit_s")) {
    row(fmt::format("full checkpoint, {:.0f}% changed", 100 * f.changed),
        fmt::format("{:.3f} s", out["increments_off_commit_s"].get<double>()),
        fmt::format("snapshot -> committed, {:.1f} MB written (--increments off)",
                    out["increments_off_written_bytes"].get<double>() / 1e6));
    row("incremental checkpoint", fmt::format("{:.3f} s", out["increments_on_commit_s"].get<double>()),
        fmt::format("{:.1f} MB written: {:.1f}% of full, committed {:.1f}x sooner (--increments on)",
                    out["increments_on_written_bytes"].get<double>() / 1e6,
                    100 * out["increments_written_vs_full"].get<double>(), out["increments_sooner"].get<double>()));
  }
  if (out.contains("torch_save_gbps")) {
    row("torch.save + fsync", fmt::format("{:.2f} GB/s", out["torch_save_gbps"].get<double>()), "");
  }
  print_gpu_rows();
  return 0;
}
