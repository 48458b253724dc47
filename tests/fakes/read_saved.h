// Reads back every piece a step's ranks saved, in their saved placements, through the read
// planner and PlanReader (references followed): what the format tests compare with what
// they wrote.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/status.h"
#include "format/manifest.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "storage/store.h"

namespace ckpt::testing {

// By tensor name, each saved piece's bytes in rank order; `step_key` is the step's prefix in
// `store` (format::CheckpointStore::StepKey).
inline absl::StatusOr<std::map<std::string, std::vector<std::string>>> ReadSavedPieces(
    storage::Store& store, const std::string& step_key, const format::Manifest& m,
    format::PlanReader::HotLookup hot = {}) {
  std::vector<format::WantedTensor> wanted;
  for (const auto& pieces : format::SavedPieces(m)) wanted.insert(wanted.end(), pieces.begin(), pieces.end());
  CKPT_ASSIGN_OR_RETURN(format::ReadPlan plan, format::PlanRead(m, wanted));
  format::PlanReader reader(store, step_key, m, std::move(hot));
  CKPT_RETURN_IF_ERROR(reader.Open(plan.tensors));
  std::map<std::string, std::vector<std::string>> out;
  for (const format::TensorReadPlan& t : plan.tensors) {
    std::string bytes(t.bytes, '\0');
    CKPT_RETURN_IF_ERROR(reader.Read(t, bytes.data()));
    out[t.name].push_back(std::move(bytes));
  }
  return out;
}

}  // namespace ckpt::testing
