// What a node of a group with node-local disks tells the publisher once its part of a step is
// in the remote tier: its ranks' shard files and its node-scoped manifest, which becomes the
// step's part (format/indexed_manifest.h). The publisher writes the step's index from these
// reports alone, without reading any node's manifest. Kept at "<job>/.uploads/step-N/node-K",
// beside the step's prefix, and bound to the run that saved the step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/increment.h"

namespace ckpt::daemon::upload {

struct PartReport {
  uint64_t run = 0;        // Manifest::run of the step uploaded
  uint32_t node = 0;
  std::string digest;      // the commit's (StepScope::digest)
  std::vector<uint32_t> ranks;         // ascending
  std::vector<uint64_t> shard_bytes;   // of each rank's shard file, in `ranks` order
  uint64_t part_bytes = 0;             // of the node's manifest-node-NNNNN.json
  std::string part_checksum;           // "xxh3:<16 hex>" of its text
  // Each rank's shard file as its manifest names it, in `ranks` order: tagged in format
  // version 5 (format::TaggedShardFileName). A report without them (written before they
  // were reported, or with `files` left empty) means format::ShardFileName of each rank:
  // what every step's file was called before version 5, and the parser fills them in so.
  std::vector<std::string> files;
  // A version 5 part's increment: the whole step's own and referenced bytes (every part
  // carries them), and the origins of this node's ranks with their steps. The publisher
  // pins and checks those origins, and its index's origin_steps are the union of the parts'.
  // nullopt: a step of version 4 or older. A report with one names its step too (`step`),
  // which the increment is checked against (no origin is the step itself).
  std::optional<format::Increment> increment;
  std::optional<uint64_t> step;
};

// A report is small: a node's ranks, a few numbers each.
inline constexpr size_t kMaxPartReportBytes = size_t{1} << 20;

std::string PartReportJson(const PartReport& report);
// DataLoss naming `source` when `text` is not a report (another version's, or damaged): a
// field of a wrong type; a file that is not its rank's (either name); an increment whose
// origins are not ascending, tagged and of the report's ranks.
absl::StatusOr<PartReport> ParsePartReport(const std::string& text, const std::string& source);

}  // namespace ckpt::daemon::upload
