// CPU work split into contiguous ranges, each on a thread of its own (the caller's thread
// takes the first): coding columns (ErasureCode) and hashing chunks (shard_fragments).
#pragma once

#include <cstddef>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace ckpt::replicate {

// fn(begin, end) for every range; a range no thread can be had for runs on the caller's.
template <typename Fn>
void RunOnRanges(const std::vector<std::pair<size_t, size_t>>& ranges, const Fn& fn) {
  if (ranges.empty()) return;
  std::vector<std::thread> workers;
  for (size_t t = 1; t < ranges.size(); ++t) {
    try {
      workers.emplace_back([&fn, range = ranges[t]] { fn(range.first, range.second); });
    } catch (const std::system_error&) {  // no thread to be had: this one does it
      fn(ranges[t].first, ranges[t].second);
    }
  }
  fn(ranges.front().first, ranges.front().second);
  for (std::thread& w : workers) w.join();
}

}  // namespace ckpt::replicate
