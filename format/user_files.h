// Files a trainer stores with a step (a run's config.yaml, a tokenizer): train-state entries
// of the rank that gives them, named kUserFilePrefix + the file's name, so that they travel,
// are checksummed, verified, replicated, uploaded and deleted with the rank's shard like the
// rest of it (docs/format.md, "Files"). Listed by `ckptctl list`, written out by
// `ckptctl export`, given back to the rank by a restore.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "format/manifest.h"

namespace ckpt::format {

inline constexpr std::string_view kUserFilePrefix = "file/";
// What one rank may store with one step: small files, not a second checkpoint (tensors go
// in as tensors). ckptd.torch says the same before sending (client/python/src/ckptd/_files.py).
inline constexpr uint64_t kMaxUserFilesBytes = uint64_t{16} << 20;
inline constexpr size_t kMaxUserFiles = 256;
inline constexpr size_t kMaxUserFileNameBytes = 128;

// A file's name, as written into an export folder: 1..128 of letters, digits, '.', '_',
// '-' and '+', not starting with '.' (no path, nothing hidden).
absl::Status ValidateUserFileName(std::string_view name);

// The file's name when `train_state_name` is a file's entry; nullopt otherwise.
std::optional<std::string_view> UserFileName(std::string_view train_state_name);

// OK when the files among a snapshot's train-state entries (name, bytes) are within the
// limits above and well named; InvalidArgument naming what is not.
absl::Status CheckUserFiles(const std::vector<std::pair<std::string_view, uint64_t>>& train_state);

// A file of a step, as its manifest lists it.
struct UserFile {
  std::string name;
  uint32_t rank = 0;  // the lowest rank that stores it: whose bytes an export writes
  uint64_t bytes = 0;
  std::string checksum;
  std::vector<uint32_t> ranks;  // every rank that stores a file of this name, ascending
  bool same_everywhere = true;  // every one of them with the same checksum
};

// The files of the ranks `manifest` lists (a node-scoped manifest: its node's), by name.
std::vector<UserFile> UserFiles(const Manifest& manifest);

}  // namespace ckpt::format
