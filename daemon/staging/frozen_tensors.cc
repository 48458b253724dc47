#include "daemon/staging/frozen_tensors.h"

#include <algorithm>

namespace ckpt::daemon {

void FrozenTensors::Registered(const std::vector<RegisteredTensor>& tensors,
                               const std::set<std::string>& replaced) {
  std::map<std::string, Known> now;
  for (const RegisteredTensor& t : tensors) {
    if (!t.frozen) continue;
    auto it = known_.find(t.name);
    // Newly frozen (it may have changed while thawed) or a new buffer: its bytes are unknown.
    now[t.name] = it == known_.end() || replaced.count(t.name) != 0 ? Known{} : it->second;
  }
  known_ = std::move(now);
  for (const std::string& name : replaced) changed_in_place_.erase(name);
}

void FrozenTensors::Invalidate() {
  for (auto& [name, known] : known_) known = Known{};
}

FrozenPlan FrozenTensors::Plan(const std::vector<RegisteredTensor>& tensors) {
  FrozenPlan plan;
  if (known_.empty()) return plan;
  plan.tensors.resize(tensors.size());
  plan.check = check_every_ != 0 && shares_since_check_ + 1 >= check_every_;
  plan.force_check = plan.check && checks_put_off_ >= kChecksPutOffAtMost;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const RegisteredTensor& t = tensors[i];
    FrozenPlan::Tensor& p = plan.tensors[i];
    p.frozen = t.frozen;
    auto known = known_.find(t.name);
    if (!t.frozen || known == known_.end() || known->second.generation == 0 || changed_in_place_.count(t.name) != 0) {
      continue;
    }
    const Known& k = known->second;
    std::shared_ptr<const FrozenBlock> block = k.block.lock();
    if (!block || k.dtype != t.dtype || k.shape != t.shape || k.bytes != t.nbytes) continue;
    p.block = std::move(block);
    p.at = k.at;
    p.share = !plan.check;
    p.generation = k.generation;
  }
  return plan;
}

void FrozenTensors::Staged(const StagedSnapshot& snap) {
  if (snap.frozen.empty()) return;
  bool shared = false;
  std::set<uint64_t> live;
  for (size_t i = 0; i < snap.frozen.size(); ++i) {
    const StagedSnapshot::FrozenEntry& f = snap.frozen[i];
    shared = shared || f.shared;
    const format::TensorEntry& e = snap.shard.entries[i];
    auto it = known_.find(e.name);
    if (!f.frozen || f.block < 0 || it == known_.end()) continue;
    it->second = Known{f.generation, snap.frozen_blocks[static_cast<size_t>(f.block)], snap.shard.Data(e),
                       e.dtype, e.shape, e.end - e.begin};
    live.insert(f.generation);
  }
  shares_since_check_ = shared ? shares_since_check_ + 1 : 0;
  sums_->Keep(live);
}

}  // namespace ckpt::daemon
