#include "daemon/upload/upload_policy.h"

#include <fmt/format.h>

#include <cmath>

namespace ckpt::daemon::upload {

std::string Describe(const UploadPolicy& policy) {
  std::string steps = policy.every_steps <= 1 ? "every step" : fmt::format("every {} steps", policy.every_steps);
  if (policy.interval.count() <= 0) return steps;
  return fmt::format("{}, the first of each {} ms", steps, policy.interval.count());
}

bool ShouldUpload(const UploadPolicy& policy, uint64_t step, double unix_time,
                  std::optional<double> previous_unix_time) {
  if (!OnStepGrid(policy, step)) return false;
  if (policy.interval.count() <= 0 || !previous_unix_time) return true;
  const double window = static_cast<double>(policy.interval.count()) / 1000.0;
  return std::floor(unix_time / window) != std::floor(*previous_unix_time / window);
}

}  // namespace ckpt::daemon::upload
