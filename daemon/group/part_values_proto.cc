#include "daemon/group/part_values_proto.h"

namespace ckpt::group {

void ToProto(const format::PartValues& values, ckptd::group::v1::PartValues* out) {
  out->set_run(values.run);
  out->set_unix_time(values.unix_time);
  out->set_wall_time(values.wall_time);
  out->mutable_metadata()->insert(values.metadata.begin(), values.metadata.end());
  for (const format::PartValues::Rank& rank : values.ranks) {
    auto* r = out->add_ranks();
    r->set_bytes(rank.bytes);
    r->mutable_metadata()->insert(rank.metadata.begin(), rank.metadata.end());
  }
  out->mutable_xxh3()->Add(values.xxh3.begin(), values.xxh3.end());
  for (const std::string& checksum : values.checksums) out->add_checksums(checksum);
  out->set_checksums_withheld(values.withheld);
}

format::PartValues FromProto(const ckptd::group::v1::PartValues& values, uint64_t step) {
  format::PartValues out;
  out.step = step;
  out.run = values.run();
  out.unix_time = values.unix_time();
  out.wall_time = values.wall_time();
  out.metadata.insert(values.metadata().begin(), values.metadata().end());
  out.ranks.reserve(values.ranks_size());
  for (const auto& rank : values.ranks()) {
    out.ranks.push_back({rank.bytes(), {rank.metadata().begin(), rank.metadata().end()}});
  }
  out.xxh3.assign(values.xxh3().begin(), values.xxh3().end());
  out.checksums.assign(values.checksums().begin(), values.checksums().end());
  out.withheld = values.checksums_withheld();
  return out;
}

}  // namespace ckpt::group
