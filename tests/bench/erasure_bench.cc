// What erasure coding a staged snapshot costs (issue 25): encode and decode throughput of
// daemon/replicate's ErasureCode (Intel ISA-L) per core and on every core, against a plain
// copy of the same bytes measured in the same run (the limit: the faster of memcpy and ISA-L's
// own kernel multiplying by 1; encoding copies the data into its k fragments and writes m/k
// more, so it cannot reach the limit). Decode is measured at its worst:
// the first m data fragments lost, rebuilt from the rest and the parity. Each figure is the
// best of --rounds, after one untimed pass.
//
//   bazel run -c opt //tests/bench:erasure_bench -- [--mib 256] [--rounds 5] [--json]
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <iostream>
#include <thread>
#include <vector>

#include "daemon/replicate/erasure_code.h"
#include "tests/bench/best_of.h"

namespace {

using Clock = std::chrono::steady_clock;

// The best of `rounds` timed calls of `f`, after one untimed.
// Every buffer alike: 2 MiB aligned, huge pages asked for, touched once. Buffers placed by
// chance (some on huge pages, some not) differed by a fifth in the same copy.
struct Buffer {
  explicit Buffer(size_t n) : bytes(n), data(static_cast<uint8_t*>(std::aligned_alloc(kHuge, RoundUp(n)))) {
    ::madvise(data, RoundUp(n), MADV_HUGEPAGE);
    std::memset(data, 0, RoundUp(n));
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::span<uint8_t> span() const { return {data, bytes}; }
  static constexpr size_t kHuge = size_t{2} << 20;
  static size_t RoundUp(size_t n) { return (std::max<size_t>(n, 1) + kHuge - 1) / kHuge * kHuge; }
  size_t bytes;
  uint8_t* data;
};

using ckpt::bench::Best;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"erasure_bench: erasure coding throughput against memcpy"};
  size_t mib = 256;
  int rounds = 5;
  bool json = false;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--mib", mib, "data coded per call, MiB")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--rounds", rounds, "timed calls; the best is reported")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--threads", threads, "threads for the all-core figures")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_flag("--json", json, "print one JSON object");
  CLI11_PARSE(app, argc, argv);

  const size_t bytes = mib << 20;
  Buffer data(bytes), copy(bytes), out(bytes);
  for (size_t i = 0; i < bytes; ++i) data.data[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  nlohmann::ordered_json result = {{"bytes", bytes}, {"threads", threads}};
  // The limit: the faster of glibc's memcpy and ISA-L's own streaming kernel multiplying by 1
  // (a copy through the same vector loads and stores the codec uses; on the 2-vCPU EPYC VM
  // it beat memcpy by a tenth, and a 1+1 decode with it).
  const double glibc_s = Best(rounds, [&] { std::memcpy(copy.data, data.data, bytes); });
  auto identity = ckpt::replicate::ErasureCode::Make(1, 1);
  if (!identity.ok()) return 1;
  std::vector<ckpt::replicate::FragmentView> parity_only = {{1, data.span()}};
  const double kernel_s = Best(rounds, [&] { (void)identity->Decode(parity_only, copy.span(), 1); });
  const double memcpy_s = std::min(glibc_s, kernel_s);
  // On every thread: the same kernel, its columns split as the codec splits them.
  const double all_s = std::min(memcpy_s, Best(rounds, [&] { (void)identity->Decode(parity_only, copy.span(), threads); }));
  result["glibc_memcpy_gbps"] = bytes / glibc_s / 1e9;
  result["isal_copy_gbps"] = bytes / kernel_s / 1e9;
  result["copy_limit_gbps_1_thread"] = bytes / memcpy_s / 1e9;
  result["copy_limit_gbps_all_threads"] = bytes / all_s / 1e9;
  if (!json) {
    std::cout << fmt::format("copy of {} MiB: glibc memcpy {:.2f} GB/s, ISA-L's kernel {:.2f} GB/s: the limit {:.2f} GB/s "
                             "on 1 thread, {:.2f} GB/s on {}\n",
                             mib, bytes / glibc_s / 1e9, bytes / kernel_s / 1e9, bytes / memcpy_s / 1e9,
                             bytes / all_s / 1e9, threads);
  }

  nlohmann::ordered_json codes = nlohmann::ordered_json::array();
  for (auto [k, m] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 2}, {8, 3}}) {
    auto code = ckpt::replicate::ErasureCode::Make(k, m);
    if (!code.ok()) return 1;
    const size_t len = code->FragmentBytes(bytes);
    std::vector<std::unique_ptr<Buffer>> fragments;
    std::vector<uint8_t*> ptrs;
    for (int i = 0; i < k + m; ++i) ptrs.push_back(fragments.emplace_back(std::make_unique<Buffer>(len))->data);
    std::vector<ckpt::replicate::FragmentView> survivors;  // the first m data fragments lost
    for (int i = std::min(m, k); i < k + m; ++i) survivors.push_back({i, fragments[static_cast<size_t>(i)]->span()});
    nlohmann::ordered_json row = {{"code", fmt::format("{}+{}", k, m)}};
    for (int t : {1, threads}) {
      absl::Status encoded, decoded;
      const double enc = Best(rounds, [&] { encoded.Update(code->Encode(data.span(), ptrs, t)); });
      const double dec = Best(rounds, [&] { decoded.Update(code->Decode(survivors, out.span(), t)); });
      // Checked once more from a scrambled buffer: the timed calls could only ever be
      // compared with bytes an earlier code left there.
      std::memset(out.data, 0xa5, bytes);
      decoded.Update(code->Decode(survivors, out.span(), t));
      if (!encoded.ok() || !decoded.ok() || std::memcmp(out.data, data.data, bytes) != 0) {
        std::cerr << fmt::format("{}+{} on {} thread(s): {}\n", k, m, t,
                                 !encoded.ok() ? std::string(encoded.message())
                                 : !decoded.ok() ? std::string(decoded.message())
                                                 : "decode gave other bytes");
        return 1;
      }
      const std::string suffix = t == 1 ? "_1_thread" : "_all_threads";
      row["encode_gbps" + suffix] = bytes / enc / 1e9;
      row["decode_gbps" + suffix] = bytes / dec / 1e9;
      const double limit_s = t == 1 ? memcpy_s : all_s;
      row["encode_vs_copy" + suffix] = limit_s / enc;
      row["decode_vs_copy" + suffix] = limit_s / dec;
      if (!json) {
        std::cout << fmt::format("{}+{} on {} thread(s): encode {:.2f} GB/s ({:.0f}% of the copy), decode of {} lost "
                                 "{:.2f} GB/s ({:.0f}%)\n",
                                 k, m, t, bytes / enc / 1e9, limit_s / enc * 100, std::min(m, k), bytes / dec / 1e9,
                                 limit_s / dec * 100);
      }
      if (threads == 1) break;
    }
    // Bytes of fragments per byte of data: what peers hold of it, (k + m) / k, against 1 for a
    // single whole copy on one peer (a mirror survives one loss; k + m survives m).
    row["fragment_bytes_per_data_byte"] = static_cast<double>(k + m) * len / bytes;
    codes.push_back(row);
  }
  result["codes"] = codes;
  if (json) std::cout << result.dump(2) << "\n";
  return 0;
}
