// format::PartValues on the wire (PrepareRequest.values), both ways: the node's client
// writes them, the coordinator's service reads them.
#pragma once

#include "format/part_structure.h"
#include "proto/group.pb.h"

namespace ckpt::group {

void ToProto(const format::PartValues& values, ckptd::group::v1::PartValues* out);
format::PartValues FromProto(const ckptd::group::v1::PartValues& values, uint64_t step);

}  // namespace ckpt::group
