#include "daemon/staging/frozen_tensors.h"

#include <algorithm>
#include <optional>
#include <string_view>

namespace ckpt::daemon {

bool FrozenPlan::any_fill() const {
  return std::any_of(tensors.begin(), tensors.end(), [](const Tensor& t) { return t.fill; });
}

void FrozenPlan::DropSource() {
  source.reset();
  for (Tensor& t : tensors) {
    t.source_entry = -1;
    t.fill = false;
  }
}

void FrozenTensors::Registered(const std::vector<RegisteredTensor>& tensors,
                               const std::set<std::string>& replaced) {
  std::map<std::string, uint64_t> now;
  for (const RegisteredTensor& t : tensors) {
    if (!t.frozen) continue;
    auto it = generations_.find(t.name);
    // Newly frozen (it may have changed while thawed) or a new buffer: its bytes are unknown.
    now[t.name] = it == generations_.end() || replaced.count(t.name) != 0 ? 0 : it->second;
  }
  generations_ = std::move(now);
  for (const std::string& name : replaced) changed_in_place_.erase(name);
}

void FrozenTensors::Invalidate() {
  for (auto& [name, generation] : generations_) generation = 0;
}

FrozenPlan FrozenTensors::Plan(const std::vector<RegisteredTensor>& tensors) {
  FrozenPlan plan;
  if (generations_.empty()) return plan;
  plan.tensors.resize(tensors.size());
  plan.source = last_.lock();
  plan.check = check_every_ != 0 && fills_since_check_ + 1 >= check_every_;
  // The source's entry of a name: at the same index when the registration did not change
  // (the usual case), else looked up once per snapshot (tens of thousands of tensors).
  std::map<std::string_view, size_t> by_name;
  auto source_index = [&](size_t i, const std::string& name) -> std::optional<size_t> {
    const StagedSnapshot& source = *plan.source;
    if (i < source.frozen.size() && source.shard.entries[i].name == name) return i;
    if (by_name.empty()) {
      for (size_t j = 0; j < source.frozen.size(); ++j) by_name.emplace(source.shard.entries[j].name, j);
    }
    auto it = by_name.find(name);
    return it == by_name.end() ? std::nullopt : std::optional<size_t>(it->second);
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const RegisteredTensor& t = tensors[i];
    FrozenPlan::Tensor& p = plan.tensors[i];
    p.frozen = t.frozen;
    auto known = generations_.find(t.name);
    if (!t.frozen || known == generations_.end() || known->second == 0 || !plan.source ||
        changed_in_place_.count(t.name) != 0) {
      continue;
    }
    const StagedSnapshot& source = *plan.source;
    const std::optional<size_t> j = source_index(i, t.name);
    if (!j) continue;
    const format::TensorEntry& e = source.shard.entries[*j];
    if (source.frozen[*j].generation != known->second || e.dtype != t.dtype || e.shape != t.shape ||
        e.end - e.begin != t.nbytes) {
      continue;
    }
    p.source_entry = static_cast<int64_t>(*j);
    p.fill = !plan.check;
    p.generation = known->second;
  }
  if (!std::any_of(plan.tensors.begin(), plan.tensors.end(),
                   [](const FrozenPlan::Tensor& t) { return t.source_entry >= 0; })) {
    plan.source.reset();
  }
  return plan;
}

void FrozenTensors::Staged(const StagedSnapshotPtr& snap) {
  if (snap->frozen.empty()) {
    last_.reset();
    return;
  }
  last_ = snap;
  bool filled = false;
  std::set<uint64_t> live;
  for (size_t i = 0; i < snap->frozen.size(); ++i) {
    const StagedSnapshot::FrozenEntry& f = snap->frozen[i];
    filled = filled || f.filled;
    auto it = generations_.find(snap->shard.entries[i].name);
    if (!f.frozen || it == generations_.end()) continue;
    it->second = f.generation;
    live.insert(f.generation);
  }
  fills_since_check_ = filled ? fills_since_check_ + 1 : 0;
  sums_->Keep(live);
}

}  // namespace ckpt::daemon
