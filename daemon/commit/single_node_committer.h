// Every rank of a job runs on this node: a step commits once all world_size ranks are
// durable here (manifest written, step directory renamed; docs/format.md). A step still
// missing ranks after the step timeout, or left behind by a newer committed step, ends.
#pragma once

#include <condition_variable>
#include <map>
#include <string>
#include <thread>

#include "daemon/commit/committer_base.h"

namespace ckpt::daemon::commit {

class SingleNodeCommitter : public CommitterBase {
 public:
  SingleNodeCommitter(format::CheckpointStore& store, CommitHooks hooks, CommitOptions options);
  ~SingleNodeCommitter() override;

  void Durable(const StagedSnapshotPtr& snapshot, persist::WrittenShard shard) override;
  void Shutdown() override;

 private:
  void Commit(const Key& key);
  void AbandonOlder(const Key& committed);
  void TimeoutLoop();

  std::map<std::string, uint64_t> latest_committed_;  // per job; guarded by mu_
  std::condition_variable stop_cv_;
  bool stopping_ = false;  // guarded by mu_
  std::thread timeouts_;
};

}  // namespace ckpt::daemon::commit
