// How the benchmarks time a call: the best of `rounds` timed calls after one untimed (which
// pays first-use costs: page faults, connections, caches).
#pragma once

#include <algorithm>
#include <chrono>

namespace ckpt::bench {

template <typename F>
double Best(int rounds, F&& f) {
  f();
  double best = 1e30;
  for (int i = 0; i < rounds; ++i) {
    auto start = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

}  // namespace ckpt::bench
