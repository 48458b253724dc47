// A session's frozen tensors across its snapshots (docs/design/incremental.md, section 7).
// A tensor registered frozen (TensorSpec.frozen, UpdateRequest.freeze) is copied from the
// trainer once; later snapshots fill it from the session's previous snapshot, after the
// trainer is released: no device-to-host copy, no trainer wait, and (frozen_sums.h) no
// hashing. Every `check_every`-th snapshot copies frozen tensors from the trainer again and
// compares them with the previous snapshot's, so that user code that changed one in place is
// caught and saved. Bytes are tracked by generation: every snapshot entry of one generation
// holds the same bytes. Used under the session's data mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "daemon/staging/frozen_sums.h"
#include "daemon/staging/registered_tensor.h"
#include "daemon/staging/staged_snapshot.h"

namespace ckpt::daemon {

// What one snapshot does with each registered tensor.
struct FrozenPlan {
  struct Tensor {
    bool frozen = false;
    // The previous snapshot's entry of the same bytes: filled from there, or (a check)
    // compared with the trainer's copy. -1: none (copied from the trainer, a new generation).
    int64_t source_entry = -1;
    bool fill = false;
    uint64_t generation = 0;  // of the source entry's bytes
  };
  StagedSnapshotPtr source;     // held while the snapshot is staged; null: no fills
  std::vector<Tensor> tensors;  // per registered tensor; empty: none frozen
  bool check = false;           // frozen tensors are copied from the trainer and compared

  bool any_fill() const;
  // Copies everything from the trainer instead (staging memory is short: the source's block
  // is given back).
  void DropSource();
};

class FrozenTensors {
 public:
  // `check_every`: every N-th snapshot with frozen tensors copies and compares them (0: never).
  explicit FrozenTensors(uint32_t check_every) : check_every_(check_every) {}

  // The session's tensors now (registration, update, freeze, thaw). `replaced`: names whose
  // buffer was registered anew (their bytes are unknown).
  void Registered(const std::vector<RegisteredTensor>& tensors, const std::set<std::string>& replaced);
  // A restore wrote the trainer's tensors: the next snapshot copies every frozen one.
  void Invalidate();
  FrozenPlan Plan(const std::vector<RegisteredTensor>& tensors);
  uint64_t NewGeneration() { return ++last_generation_; }
  // A check found `name` changed in place although registered frozen: it is copied from the
  // trainer at every snapshot from now on, until it is frozen anew (Registered's `replaced`).
  void ChangedInPlace(const std::string& name) { changed_in_place_.insert(name); }
  // `snap` staged whole: the next snapshot's source, its generations the tensors' now.
  void Staged(const StagedSnapshotPtr& snap);
  const std::shared_ptr<FrozenSums>& sums() const { return sums_; }

 private:
  const uint32_t check_every_;
  uint64_t last_generation_ = 0;
  uint32_t fills_since_check_ = 0;
  std::map<std::string, uint64_t> generations_;  // frozen tensors; 0: bytes not known
  std::set<std::string> changed_in_place_;
  std::weak_ptr<StagedSnapshot> last_;  // alive while persist or the hot cache holds it
  std::shared_ptr<FrozenSums> sums_ = std::make_shared<FrozenSums>();
};

}  // namespace ckpt::daemon
