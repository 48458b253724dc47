// What a scrape of --metrics-addr reads from the node's state at that moment, beside the
// counters and histograms the stages keep: build, staging memory (in all, per user, per
// job), sessions, each job's last commit, its time and its age, the group's members by state,
// where each job's steps are durable (durability_figures.h) and the process' own figures. Per-user and per-job series are bounded (kMaxLabelled, the rest
// summed under "_other"; the jobs beyond it are counted, not listed).
#pragma once

#include <functional>
#include <vector>

#include "cuda/staging_pool.h"
#include "daemon/metrics/last_commits.h"
#include "daemon/metrics/registry.h"
#include "daemon/persist/disk_quota.h"
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
  // Fills a StatusReply as a scrape needs it (durability_figures.h: DurabilitySources::status)
  // given the jobs of `commits` it lists first.
  std::function<void(const std::vector<metrics::LastCommits::Commit>& commits, ::ckptd::v1::StatusReply*)> status;
  const persist::DiskQuota* quota = nullptr;  // with --user-quota-bytes or --job-quota-bytes
};

void CollectNodeFigures(const NodeFigureSources& sources, metrics::Exposition& out);

}  // namespace ckpt::daemon
