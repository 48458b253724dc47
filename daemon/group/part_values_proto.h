// format::PartValues on the wire (PrepareRequest.values), both ways: the node's client
// writes them, the coordinator's service reads them.
#pragma once

#include "absl/status/statusor.h"
#include "format/part_structure.h"
#include "proto/group.pb.h"

namespace ckpt::group {

void ToProto(const format::PartValues& values, ckptd::group::v1::PartValues* out);
// Either form of the ranks (PartValues.ranks, or rank_bytes with rank_metadata);
// InvalidArgument, naming the problem, for both at once or metadata of a rank not sent.
absl::StatusOr<format::PartValues> FromProto(const ckptd::group::v1::PartValues& values, uint64_t step);

}  // namespace ckpt::group
