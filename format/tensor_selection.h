// Which tensors a restore reads: include and exclude patterns on tensor names (shell globs,
// fnmatch(3): `*` also matches dots, so "optim.*" is every optimizer tensor). A name is
// selected when no include pattern is given or one matches, and no exclude pattern
// matches. Fine-tuning from a full checkpoint restores the weights without the optimizer
// state (exclude "optim.*"); a debugging session restores one layer (include "layers.3.*").
// An exclude pattern of exactly "*" selects nothing on purpose: such a restore brings back the
// train state alone (ckptd.torch's load(on_shapes=) reads the saved shapes so, before it
// resizes the model and restores the tensors).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::format {

class TensorSelection {
 public:
  static constexpr size_t kMaxPatterns = 1024;
  static constexpr size_t kMaxPatternBytes = 1024;
  static constexpr size_t kMaxTotalBytes = 64 << 10;  // of all patterns: bounds a restore's matching

  TensorSelection() = default;  // everything

  // InvalidArgument naming the pattern that is empty, too long or not text, or when there
  // are more than kMaxPatterns.
  static absl::StatusOr<TensorSelection> Make(std::vector<std::string> include,
                                              std::vector<std::string> exclude);

  bool Selects(std::string_view name) const;
  bool everything() const { return include_.empty() && exclude_.empty(); }
  // Excludes "*": no tensor, the train state only (not a typo that happens to match none).
  bool train_state_only() const;
  // "include [a, b], exclude [c]": for messages.
  std::string Describe() const;

 private:
  std::vector<std::string> include_;
  std::vector<std::string> exclude_;
};

}  // namespace ckpt::format
