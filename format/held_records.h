// Held steps on an object store (format version 5; docs/format.md, "Retention of referenced
// steps"): where objects cannot be renamed, a step that later steps reference keeps its files
// where they are, `<job>/step-NNNNNNNN/<file>`, and a record beside them says whose they are:
//   held-<run, 16 hex>.json           the step was retired: its manifest is gone, its files
//                                     stay while kept steps reference them
//   held-<run, 16 hex>.node-<K>.json  node K's uploader carried these files of an earlier
//                                     step (never uploaded as a step) for step `carried_for`
// A record names the files it keeps; every object of a step's prefix that no record names is
// the step's own (or an unfinished upload's) and goes when the step does.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::format {

struct HeldFile {
  std::string file;
  uint64_t bytes = 0;
  bool operator==(const HeldFile&) const = default;
};

struct HeldRecord {
  std::string job;
  uint64_t step = 0;
  uint64_t run = 0;
  std::vector<HeldFile> files;
  // A carried record: the step of the uploader's run that the files were carried for.
  std::optional<uint64_t> carried_for;
};

// "held-18f3a9c2d4e5b6a7.json": a retired step's record.
std::string RetiredRecordName(uint64_t run);
// "held-18f3a9c2d4e5b6a7.node-3.json": node 3's record of the files it carried.
std::string CarriedRecordName(uint64_t run, uint32_t node);
// Whether `name` is exactly one of those names; its run.
bool ParseHeldRecordName(std::string_view name, uint64_t* run);

// A record is small, but names a file per rank of the step.
inline constexpr size_t kMaxHeldRecordBytes = size_t{64} << 20;

std::string HeldRecordJson(const HeldRecord& record);
// A record read from a store: refused (DataLoss, naming `where` and why) unless well formed;
// never throws.
absl::StatusOr<HeldRecord> ParseHeldRecord(std::string_view text, const std::string& where);

}  // namespace ckpt::format
