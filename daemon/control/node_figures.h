// What a scrape of --metrics-addr reads from the node's state at that moment, beside the
// counters and histograms the stages keep: build, staging memory (in all, per user, per
// job), sessions, each job's last commit and its age, the group's members by state, and the
// process' own figures. Per-user and per-job series are bounded (kMaxLabelled, the rest
// summed under "_other"; the jobs beyond it are counted, not listed).
#pragma once

#include <functional>

#include "cuda/staging_pool.h"
#include "daemon/metrics/last_commits.h"
#include "daemon/metrics/registry.h"
#include "daemon/session/session_registry.h"
#include "daemon/staging/staging_ledger.h"
#include "proto/admin.pb.h"

namespace ckpt::daemon {

inline constexpr size_t kMaxLabelled = 64;

struct NodeFigureSources {
  cuda::StagingPool& pool;
  StagingLedger& ledger;
  SessionRegistry& sessions;
  const metrics::LastCommits& commits;
  // Fills the group section; empty without a group.
  std::function<void(::ckptd::v1::StatusReply*)> group_status;
};

void CollectNodeFigures(const NodeFigureSources& sources, metrics::Exposition& out);

}  // namespace ckpt::daemon
