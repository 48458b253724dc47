#include "daemon/replicate/run_each.h"

#include <algorithm>
#include <exception>
#include <thread>

namespace ckpt::replicate {

std::vector<absl::Status> RunEach(size_t count, size_t at_once, const std::function<absl::Status(size_t)>& call) {
  std::vector<absl::Status> results(count);
  at_once = std::max<size_t>(at_once, 1);
  for (size_t first = 0; first < count; first += at_once) {
    std::vector<std::thread> threads;
    for (size_t i = first; i < std::min(count, first + at_once); ++i) {
      threads.emplace_back([&, i] {
        try {
          results[i] = call(i);
        } catch (const std::exception& e) {
          results[i] = absl::ResourceExhaustedError(e.what());
        }
      });
    }
    for (std::thread& t : threads) t.join();
  }
  return results;
}

}  // namespace ckpt::replicate
