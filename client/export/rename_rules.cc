#include "client/export/rename_rules.h"

#include <fmt/format.h>

#include <algorithm>

#include <nlohmann/json.hpp>

namespace ckpt::exporter {

absl::StatusOr<RenameRules> RenameRules::Parse(const std::string& text, const std::string& source) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: a rename file is a JSON object of \"old name\": \"new name\" pairs", source));
  }
  RenameRules rules;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it->is_string()) {
      return absl::InvalidArgumentError(fmt::format("{}: the rule for \"{}\" is not a string", source, it.key()));
    }
    const std::string& from = it.key();
    const std::string to = it->get<std::string>();
    auto stars = [](const std::string& s) { return std::count(s.begin(), s.end(), '*'); };
    const bool prefix = !from.empty() && from.back() == '*';
    const bool valid = prefix ? stars(from) == 1 && (to.empty() || (to.back() == '*' && stars(to) == 1))
                              : stars(from) == 0 && stars(to) == 0;
    if (!valid) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: rule \"{}\": \"{}\": a \"*\" may only end both names (a prefix rule), or end "
          "the old one mapped to \"\" (left out)",
          source, from, to));
    }
    if (prefix) {
      rules.prefixes_.emplace_back(from.substr(0, from.size() - 1), to);
    } else {
      rules.exact_[from] = to;
    }
  }
  std::sort(rules.prefixes_.begin(), rules.prefixes_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  return rules;
}

std::optional<std::string> RenameRules::Apply(const std::string& name) const {
  if (auto it = exact_.find(name); it != exact_.end()) {
    if (it->second.empty()) return std::nullopt;
    return it->second;
  }
  for (const auto& [from, to] : prefixes_) {
    if (name.compare(0, from.size(), from) != 0) continue;
    if (to.empty()) return std::nullopt;
    return to.substr(0, to.size() - 1) + name.substr(from.size());
  }
  return name;
}

}  // namespace ckpt::exporter
