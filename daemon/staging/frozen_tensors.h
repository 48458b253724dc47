// A session's frozen tensors across its snapshots (docs/design/incremental.md, section 7).
// A tensor registered frozen (TensorSpec.frozen, UpdateRequest.freeze) is copied from the
// trainer once, into a frozen block (staged_snapshot.h); later snapshots share that block
// instead of copying it: no device-to-host copy, no trainer wait, no host copy, its memory
// paid once, and (frozen_sums.h) no hashing. Every `check_every`-th snapshot copies frozen
// tensors from the trainer again, into a new block, and compares them with the last one, so
// that user code that changed one in place is caught and saved. Bytes are tracked by
// generation: every snapshot entry of one generation holds the same bytes. Used under the
// session's data mutex.
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
    // Where its bytes were last staged, when they are known and laid out as now: shared
    // from there, or (a check) compared with the trainer's copy. Null: copied from the
    // trainer, a new generation. Held here while the snapshot is staged.
    std::shared_ptr<const FrozenBlock> block;
    const char* at = nullptr;
    bool share = false;
    uint64_t generation = 0;  // of the bytes at `at`
  };
  std::vector<Tensor> tensors;  // per registered tensor; empty: none frozen
  bool check = false;           // frozen tensors are copied from the trainer and compared
  bool force_check = false;     // a check put off too often: it makes room as a snapshot does
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
  // A check found no room for a second copy of the frozen tensors and was put off: how many
  // times in a row now. Past kChecksPutOffAtMost the next check makes room (evicts hot copies,
  // waits under --when-busy=wait) as any snapshot does.
  static constexpr uint32_t kChecksPutOffAtMost = 3;
  uint32_t CheckPutOff() { return ++checks_put_off_; }
  void CheckRan() { checks_put_off_ = 0; }
  // `snap` staged whole: where its frozen tensors' bytes are, for the next snapshot.
  void Staged(const StagedSnapshot& snap);
  const std::shared_ptr<FrozenSums>& sums() const { return sums_; }

 private:
  // A frozen tensor's bytes as last staged. The block is held weakly: by the snapshots in
  // flight and the hot copy. Once they are gone (the hot cache evicted it for room), the
  // next snapshot copies the tensor from the trainer again.
  struct Known {
    uint64_t generation = 0;  // 0: bytes not known
    std::weak_ptr<const FrozenBlock> block;
    const char* at = nullptr;
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t bytes = 0;
  };

  const uint32_t check_every_;
  uint64_t last_generation_ = 0;
  uint32_t shares_since_check_ = 0;
  uint32_t checks_put_off_ = 0;
  std::map<std::string, Known> known_;  // the frozen tensors
  std::set<std::string> changed_in_place_;
  std::shared_ptr<FrozenSums> sums_ = std::make_shared<FrozenSums>();
};

}  // namespace ckpt::daemon
