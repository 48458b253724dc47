// What erasure coding a staged snapshot costs (issue 25): encode and decode throughput of
// daemon/replicate's ErasureCode (Intel ISA-L) per core and on every core, against a plain
// memcpy of the same bytes measured in the same run (the limit: coding reads the data once
// and writes m/k of it; a memcpy reads and writes it all). Decode is measured at its worst:
// the first m data fragments lost, rebuilt from the rest and the parity. Each figure is the
// best of --rounds, after one untimed pass.
//
//   bazel run -c opt //tests/bench:erasure_bench -- [--mib 256] [--rounds 5] [--json]
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "daemon/replicate/erasure_code.h"

namespace {

using Clock = std::chrono::steady_clock;

// The best of `rounds` timed calls of `f`, after one untimed.
template <typename F>
double Best(int rounds, F&& f) {
  f();
  double best = 1e30;
  for (int i = 0; i < rounds; ++i) {
    auto start = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

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
  std::vector<uint8_t> data(bytes), copy(bytes), out(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  nlohmann::ordered_json result = {{"bytes", bytes}, {"threads", threads}};
  const double memcpy_s = Best(rounds, [&] { std::memcpy(copy.data(), data.data(), bytes); });
  result["memcpy_gbps"] = bytes / memcpy_s / 1e9;
  if (!json) std::cout << fmt::format("memcpy of {} MiB: {:.2f} GB/s (the limit)\n", mib, bytes / memcpy_s / 1e9);

  nlohmann::ordered_json codes = nlohmann::ordered_json::array();
  for (auto [k, m] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 2}, {8, 3}}) {
    auto code = ckpt::replicate::ErasureCode::Make(k, m);
    if (!code.ok()) return 1;
    const size_t len = code->FragmentBytes(bytes);
    std::vector<std::vector<uint8_t>> fragments(static_cast<size_t>(k + m), std::vector<uint8_t>(len));
    std::vector<uint8_t*> ptrs;
    for (auto& f : fragments) ptrs.push_back(f.data());
    std::vector<ckpt::replicate::FragmentView> survivors;  // the first m data fragments lost
    for (int i = std::min(m, k); i < k + m; ++i) survivors.push_back({i, fragments[static_cast<size_t>(i)]});
    nlohmann::ordered_json row = {{"code", fmt::format("{}+{}", k, m)}};
    for (int t : {1, threads}) {
      const double enc = Best(rounds, [&] { (void)code->Encode(data, ptrs, t); });
      const double dec = Best(rounds, [&] { (void)code->Decode(survivors, out, t); });
      if (out != data) {
        std::cerr << fmt::format("{}+{}: decode gave other bytes\n", k, m);
        return 1;
      }
      const std::string suffix = t == 1 ? "_1_thread" : "_all_threads";
      row["encode_gbps" + suffix] = bytes / enc / 1e9;
      row["decode_gbps" + suffix] = bytes / dec / 1e9;
      row["encode_vs_memcpy" + suffix] = memcpy_s / enc;
      if (!json) {
        std::cout << fmt::format("{}+{} on {} thread(s): encode {:.2f} GB/s ({:.0f}% of memcpy), decode of {} lost {:.2f} GB/s\n",
                                 k, m, t, bytes / enc / 1e9, memcpy_s / enc * 100, std::min(m, k), bytes / dec / 1e9);
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
