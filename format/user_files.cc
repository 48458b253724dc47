#include "format/user_files.h"

#include <fmt/format.h>

#include <map>

namespace ckpt::format {

absl::Status ValidateUserFileName(std::string_view name) {
  auto allowed = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == '+';
  };
  bool ok = !name.empty() && name.size() <= kMaxUserFileNameBytes && name.front() != '.';
  for (char c : name) ok = ok && allowed(c);
  if (ok) return absl::OkStatus();
  std::string shown(name.substr(0, kMaxUserFileNameBytes));
  for (char& c : shown) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  return absl::InvalidArgumentError(fmt::format(
      "file name \"{}\"{} is not allowed: 1 to {} letters, digits, '.', '_', '-' or '+', not starting "
      "with '.' (a file's own name, no folder)",
      shown, name.size() > kMaxUserFileNameBytes ? "..." : "", kMaxUserFileNameBytes));
}

std::optional<std::string_view> UserFileName(std::string_view train_state_name) {
  if (train_state_name.substr(0, kUserFilePrefix.size()) != kUserFilePrefix) return std::nullopt;
  return train_state_name.substr(kUserFilePrefix.size());
}

absl::Status CheckUserFiles(const std::vector<std::pair<std::string_view, uint64_t>>& train_state) {
  uint64_t total = 0;
  size_t count = 0;
  for (const auto& [entry, bytes] : train_state) {
    std::optional<std::string_view> name = UserFileName(entry);
    if (!name) continue;
    if (absl::Status valid = ValidateUserFileName(*name); !valid.ok()) return valid;
    total += bytes;
    ++count;
  }
  if (count > kMaxUserFiles) {
    return absl::InvalidArgumentError(
        fmt::format("{} files given with one step; a rank may store {} at most", count, kMaxUserFiles));
  }
  if (total > kMaxUserFilesBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "the files given with one step hold {} bytes; a rank may store {} MiB at most (small files such as "
        "a config or a tokenizer: tensors belong in the model or extra_state)",
        total, kMaxUserFilesBytes >> 20));
  }
  return absl::OkStatus();
}

std::vector<UserFile> UserFiles(const Manifest& manifest) {
  std::map<std::string, UserFile> by_name;
  for (const ManifestShard& shard : manifest.shards) {  // ascending ranks
    for (const auto& [entry, state] : shard.train_state) {
      std::optional<std::string_view> name = UserFileName(entry);
      if (!name) continue;
      auto [it, fresh] = by_name.try_emplace(std::string(*name));
      UserFile& f = it->second;
      if (fresh) {
        f.name = std::string(*name);
        f.rank = shard.rank;
        f.bytes = state.end - state.begin;
        f.checksum = state.checksum;
      } else if (state.checksum != f.checksum || state.end - state.begin != f.bytes) {
        f.same_everywhere = false;
      }
      f.ranks.push_back(shard.rank);
    }
  }
  std::vector<UserFile> out;
  for (auto& [name, f] : by_name) out.push_back(std::move(f));
  return out;
}

}  // namespace ckpt::format
