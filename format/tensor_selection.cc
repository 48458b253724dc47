#include "format/tensor_selection.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fnmatch.h>

#include <algorithm>

namespace ckpt::format {
namespace {

absl::Status CheckPatterns(const char* which, const std::vector<std::string>& patterns) {
  if (patterns.size() > TensorSelection::kMaxPatterns) {
    return absl::InvalidArgumentError(fmt::format("{} {} patterns; at most {}", patterns.size(),
                                                  which, TensorSelection::kMaxPatterns));
  }
  for (const std::string& p : patterns) {
    if (p.empty()) return absl::InvalidArgumentError(fmt::format("an empty {} pattern", which));
    if (p.size() > TensorSelection::kMaxPatternBytes) {
      return absl::InvalidArgumentError(fmt::format("{} pattern \"{}...\" is longer than {} bytes",
                                                    which, p.substr(0, 32),
                                                    TensorSelection::kMaxPatternBytes));
    }
    if (p.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(fmt::format("{} pattern has a NUL byte", which));
    }
  }
  return absl::OkStatus();
}

bool AnyMatches(const std::vector<std::string>& patterns, std::string_view name) {
  std::string text(name);  // fnmatch wants a terminated string
  return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) {
    return ::fnmatch(p.c_str(), text.c_str(), 0) == 0;
  });
}

}  // namespace

absl::StatusOr<TensorSelection> TensorSelection::Make(std::vector<std::string> include,
                                                      std::vector<std::string> exclude) {
  if (auto s = CheckPatterns("include", include); !s.ok()) return s;
  if (auto s = CheckPatterns("exclude", exclude); !s.ok()) return s;
  size_t total = 0;
  for (const auto* list : {&include, &exclude}) {
    for (const std::string& p : *list) total += p.size();
  }
  if (total > kMaxTotalBytes) {
    return absl::InvalidArgumentError(fmt::format("the patterns add up to {} bytes; at most {}",
                                                  total, kMaxTotalBytes));
  }
  TensorSelection selection;
  selection.include_ = std::move(include);
  selection.exclude_ = std::move(exclude);
  return selection;
}

bool TensorSelection::Selects(std::string_view name) const {
  if (!include_.empty() && !AnyMatches(include_, name)) return false;
  return !AnyMatches(exclude_, name);
}

bool TensorSelection::train_state_only() const {
  return std::find(exclude_.begin(), exclude_.end(), "*") != exclude_.end();
}

std::string TensorSelection::Describe() const {
  if (everything()) return "every tensor";
  std::string out;
  if (!include_.empty()) out = fmt::format("include [{}]", fmt::join(include_, ", "));
  if (!exclude_.empty()) {
    out += fmt::format("{}exclude [{}]", out.empty() ? "" : ", ", fmt::join(exclude_, ", "));
  }
  return out;
}

}  // namespace ckpt::format
