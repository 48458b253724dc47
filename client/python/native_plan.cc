#include "client/python/native_plan.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "format/manifest.h"
#include "format/read_plan.h"

namespace py = pybind11;

namespace ckpt::python {
namespace {

// A tensor as a file holds it: (name, dtype, shape, file index, begin, end), the byte range
// within that file's data region.
using Saved = std::tuple<std::string, std::string, std::vector<int64_t>, uint32_t, uint64_t, uint64_t>;
// What a rank wants of a tensor: (name, dtype, local shape, global shape, offset); an empty
// global shape and offset want the whole tensor.
using Wanted = std::tuple<std::string, std::string, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<int64_t>>;
// (source, destination, bytes): source within the saved entry, destination within the piece.
using Run = std::tuple<uint64_t, uint64_t, uint64_t>;
// (file index, entry begin, runs) of one file that gives the piece bytes.
using Read = std::tuple<uint32_t, uint64_t, std::vector<Run>>;

// Each file is a "rank" of a manifest that holds each of its tensors whole: the planner then
// finds which bytes of which file make up each wanted piece, as for a ckptd step.
std::vector<std::tuple<uint64_t, std::vector<Read>>> PlanRead(const std::vector<Saved>& saved,
                                                              const std::vector<Wanted>& wanted) {
  format::Manifest manifest;
  for (const auto& [name, dtype, shape, file, begin, end] : saved) {
    format::ManifestTensor& t = manifest.tensors[name];
    if (!t.shards.empty()) throw py::value_error("tensor " + name + " is in two files");
    t.dtype = dtype;
    t.global_shape = shape;
    format::TensorShard shard;
    shard.rank = file;
    shard.file = format::ShardFileName(file);
    shard.begin = begin;
    shard.end = end;
    shard.offset.assign(shape.size(), 0);
    shard.shape = shape;
    t.shards.push_back(std::move(shard));
    manifest.world_size = std::max(manifest.world_size, file + 1);
  }
  std::vector<format::WantedTensor> pieces;
  for (const auto& [name, dtype, shape, global_shape, offset] : wanted) {
    pieces.push_back({name, dtype, shape, global_shape, offset, {}, std::nullopt});
  }
  absl::StatusOr<format::ReadPlan> plan = format::PlanRead(manifest, pieces);
  if (!plan.ok()) throw py::value_error(Message(plan.status()));
  std::vector<std::tuple<uint64_t, std::vector<Read>>> out;
  for (const format::TensorReadPlan& t : plan->tensors) {
    std::vector<Read> reads;
    for (const format::ShardRead& r : t.reads) {
      std::vector<Run> runs;
      for (const format::ByteRun& run : r.runs) runs.emplace_back(run.source, run.destination, run.bytes);
      reads.emplace_back(r.rank, r.entry_begin, std::move(runs));
    }
    out.emplace_back(t.bytes, std::move(reads));
  }
  return out;
}

}  // namespace

void DefinePlanRead(py::module_& m) {
  m.def("plan_read", &PlanRead, py::arg("saved"), py::arg("wanted"),
        "The read planner over files: saved is [(name, dtype, shape, file, begin, end)], wanted "
        "[(name, dtype, local shape, global shape, offset)]; returns, per wanted piece, (bytes, "
        "[(file, entry begin, [(source, destination, bytes)])]); ValueError naming every piece "
        "that cannot be read");
}

}  // namespace ckpt::python
