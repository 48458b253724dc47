#include "daemon/group/part_values_proto.h"

#include <fmt/format.h>

#include <vector>

namespace ckpt::group {

void ToProto(const format::PartValues& values, ckptd::group::v1::PartValues* out) {
  out->set_run(values.run);
  out->set_unix_time(values.unix_time);
  out->set_wall_time(values.wall_time);
  out->mutable_metadata()->insert(values.metadata.begin(), values.metadata.end());
  out->mutable_rank_bytes()->Reserve(static_cast<int>(values.ranks.size()));
  for (size_t i = 0; i < values.ranks.size(); ++i) {
    const format::PartValues::Rank& rank = values.ranks[i];
    out->add_rank_bytes(rank.bytes);
    if (rank.metadata.empty()) continue;
    auto* m = out->add_rank_metadata();
    m->set_index(static_cast<uint32_t>(i));
    m->mutable_metadata()->insert(rank.metadata.begin(), rank.metadata.end());
  }
  out->mutable_xxh3()->Add(values.xxh3.begin(), values.xxh3.end());
  for (const std::string& checksum : values.checksums) out->add_checksums(checksum);
  out->set_checksums_withheld(values.withheld);
  out->mutable_places()->Add(values.places.begin(), values.places.end());
  if (values.increment) {
    auto* inc = out->mutable_increment();
    inc->set_own_bytes(values.increment->own_bytes);
    inc->set_referenced_bytes(values.increment->referenced_bytes);
    for (const format::StepRun& s : values.increment->origin_steps) {
      auto* step = inc->add_origin_steps();
      step->set_step(s.step);
      step->set_run(s.run);
    }
    for (const format::Origin& o : values.increment->origins) {
      auto* origin = inc->add_origins();
      origin->set_step(o.step);
      origin->set_run(o.run);
      origin->set_rank(o.rank);
      origin->set_file(o.file);
      origin->set_bytes(o.bytes);
    }
  }
}

absl::StatusOr<format::PartValues> FromProto(const ckptd::group::v1::PartValues& values, uint64_t step) {
  format::PartValues out;
  out.step = step;
  out.run = values.run();
  out.unix_time = values.unix_time();
  out.wall_time = values.wall_time();
  out.metadata.insert(values.metadata().begin(), values.metadata().end());
  if (values.ranks_size() > 0 && (values.rank_bytes_size() > 0 || values.rank_metadata_size() > 0)) {
    return absl::InvalidArgumentError("values carry ranks and rank_bytes: send one form");
  }
  if (values.ranks_size() > 0) {
    out.ranks.reserve(values.ranks_size());
    for (const auto& rank : values.ranks()) {
      out.ranks.push_back({rank.bytes(), {rank.metadata().begin(), rank.metadata().end()}});
    }
  } else {
    out.ranks.resize(values.rank_bytes_size());
    for (int i = 0; i < values.rank_bytes_size(); ++i) out.ranks[i].bytes = values.rank_bytes(i);
    std::vector<bool> named(out.ranks.size());
    for (const auto& m : values.rank_metadata()) {
      if (m.index() >= out.ranks.size()) {
        return absl::InvalidArgumentError(
            fmt::format("rank_metadata names index {}, but rank_bytes has {} ranks", m.index(), out.ranks.size()));
      }
      if (named[m.index()]) {
        return absl::InvalidArgumentError(fmt::format("rank_metadata names index {} twice", m.index()));
      }
      named[m.index()] = true;
      out.ranks[m.index()].metadata.insert(m.metadata().begin(), m.metadata().end());
    }
  }
  out.xxh3.assign(values.xxh3().begin(), values.xxh3().end());
  out.checksums.assign(values.checksums().begin(), values.checksums().end());
  out.withheld = values.checksums_withheld();
  out.places.assign(values.places().begin(), values.places().end());
  if (values.has_increment()) {
    const auto& inc = values.increment();
    format::Increment& increment = out.increment.emplace();
    increment.own_bytes = inc.own_bytes();
    increment.referenced_bytes = inc.referenced_bytes();
    for (const auto& s : inc.origin_steps()) increment.origin_steps.push_back({s.step(), s.run()});
    for (const auto& o : inc.origins()) increment.origins.push_back({o.step(), o.run(), o.rank(), o.file(), o.bytes()});
    // What every manifest's reader checks of an increment, here at the boundary.
    if (std::string problem = format::IncrementProblem(increment, step, /*is_index=*/false); !problem.empty()) {
      return absl::InvalidArgumentError(fmt::format("the part's increment: {}", problem));
    }
  }
  return out;
}

}  // namespace ckpt::group
