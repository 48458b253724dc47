#include "daemon/control/durability_figures.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "daemon/control/node_figures.h"

namespace ckpt::daemon {
namespace {

using Rows = std::vector<std::pair<metrics::LabelValues, double>>;

// The newest step of a job that its coding group holds sealed, or none.
const ::ckptd::v1::StepReplication* NewestReplicated(const ::ckptd::v1::JobStatus& job) {
  const ::ckptd::v1::StepReplication* newest = nullptr;
  for (const auto& r : job.replication()) {
    if (r.state() == "replicated" && (newest == nullptr || r.step() > newest->step())) newest = &r;
  }
  return newest;
}

void JobFigures(const DurabilitySources& src, metrics::Exposition& out) {
  const ::ckptd::v1::StatusReply& status = src.status;
  std::map<std::string, const metrics::LastCommits::Commit*> local;
  for (const metrics::LastCommits::Commit& c : src.commits) local[c.job] = &c;
  // The jobs whose steps are listed: the first kMaxLabelled of the reply (the most recently
  // committed come first).
  std::set<std::string> listed;
  for (const auto& job : status.jobs()) {
    if (listed.size() >= kMaxLabelled) break;
    listed.insert(job.job());
  }
  const bool replication = !status.group().replication().empty();
  Rows steps, times, in_flight, backlog_steps, backlog_bytes, oldest;
  for (const auto& job : status.jobs()) {
    const std::string& name = job.job();
    const bool uploads = !status.remote().empty();
    in_flight.push_back({{name}, static_cast<double>(job.pending_steps_size())});
    if (uploads) {
      double bytes = 0, age = 0;
      for (const auto& u : job.uploads()) {
        bytes += static_cast<double>(u.bytes_total() - std::min(u.bytes_done(), u.bytes_total()));
        age = std::max(age, u.age_s());
      }
      backlog_steps.push_back({{name}, static_cast<double>(job.uploads_size())});
      backlog_bytes.push_back({{name}, bytes});
      oldest.push_back({{name}, age});
    }
    if (!listed.count(name)) continue;
    auto tier = [&](const char* t, uint64_t step, double unix_time) {
      steps.push_back({{name, t}, static_cast<double>(step)});
      if (unix_time > 0) times.push_back({{name, t}, unix_time});
    };
    const auto mine = local.find(name);
    double local_time = 0;
    if (mine != local.end()) {
      local_time = std::chrono::duration<double>(mine->second->at.time_since_epoch()).count();
      tier("local", mine->second->step, local_time);
    }
    if (job.has_global()) {
      // The group's step's time is known here when this node committed it too.
      const bool same = mine != local.end() && mine->second->step == job.latest_global_step();
      tier("global", job.latest_global_step(), same ? local_time : 0);
    }
    if (job.has_remote()) tier("remote", job.latest_remote_step(), job.latest_remote_unix_time());
    if (const auto* r = NewestReplicated(job)) {
      tier("replicated", r->step(), r->unix_time());
    } else if (replication && mine != local.end()) {
      // Committed here and nothing of it held by the peers: a step 0 of time 0, so that a rule
      // comparing the tiers' times sees the replicas behind (rather than no series at all).
      steps.push_back({{name, "replicated"}, 0});
      times.push_back({{name, "replicated"}, 0});
    }
  }
  out.Samples({"ckptd_job_tier_step",
               "Each job's newest step in each tier: local (committed on this node's store), global (the group "
               "committed it, as last heard), remote (published in the remote tier, as this node saw), replicated "
               "(sealed in the coding group's memory; 0 when no step is). The 64 most recently committed jobs.",
               {"ckpt_job", "tier"}},
              steps);
  out.Samples({"ckptd_job_tier_timestamp_seconds",
               "Unix time at which that step committed (its manifest's time); absent where unknown, 0 for replicated "
               "when no step is.",
               {"ckpt_job", "tier"}},
              times);
  out.Samples({"ckptd_job_steps_in_flight", "Steps of each job being written or committed on this node.",
               {"ckpt_job"}},
              metrics::FoldRows(std::move(in_flight), kMaxLabelled, 0));
  if (!status.remote().empty()) {
    out.Samples({"ckptd_job_upload_backlog_steps",
                 "Steps of each job waiting for or in upload to the remote tier (at most one uploading, one queued).",
                 {"ckpt_job"}},
                metrics::FoldRows(std::move(backlog_steps), kMaxLabelled, 0));
    out.Samples({"ckptd_job_upload_backlog_bytes", "Bytes of this node's files of those steps not yet uploaded.",
                 {"ckpt_job"}},
                metrics::FoldRows(std::move(backlog_bytes), kMaxLabelled, 0));
    out.Samples({"ckptd_job_upload_oldest_seconds",
                 "Seconds since the oldest of those steps was queued for upload (0 when none waits).", {"ckpt_job"}},
                metrics::FoldRows(std::move(oldest), kMaxLabelled, 0, /*keep_max=*/true));
  }
}

void QuotaFigures(const persist::DiskQuota& quota, metrics::Exposition& out) {
  Rows used;
  for (const auto& [uid, bytes] : quota.UsageByUser()) used.push_back({{std::to_string(uid)}, static_cast<double>(bytes)});
  out.Samples({"ckptd_user_disk_bytes",
               "Bytes of checkpoints each user's jobs hold on the root (as --user-quota-bytes counts them).", {"uid"}},
              metrics::FoldRows(std::move(used), kMaxLabelled, 0));
  out.Samples({"ckptd_quota_bytes", "The bounds on the root: scope=user (--user-quota-bytes), job (--job-quota-bytes); "
               "0: none.", {"scope"}},
              {{{"user"}, static_cast<double>(quota.limits().per_user)},
               {{"job"}, static_cast<double>(quota.limits().per_job)}});
}

void GroupFigures(const ::ckptd::v1::GroupStatus& g, metrics::Exposition& out) {
  const double contact = g.last_contact_age_s() < 0 ? std::numeric_limits<double>::infinity() : g.last_contact_age_s();
  out.Samples({"ckptd_group_coordinator_contact_age_seconds",
               "Seconds since the coordinator last answered this node (+Inf: never).", {}},
              {{{}, contact}});
  // Only the coordinator's table has every member's heartbeat; the others' views are the
  // coordinator's word, so one node exports the group's members, not every node each.
  if (g.node_rank() != 0) return;
  Rows lost, ages;
  for (const auto& m : g.members()) {
    metrics::LabelValues labels = {std::to_string(m.node_rank()), m.address()};
    lost.push_back({labels, m.state() == "lost" ? 1.0 : 0.0});
    if (m.last_heartbeat_age_s() >= 0) ages.push_back({labels, m.last_heartbeat_age_s()});
  }
  out.Samples({"ckptd_group_member_lost",
               "1 for each member the coordinator holds lost, 0 for the others (node 0 only).",
               {"node_rank", "address"}},
              lost);
  out.Samples({"ckptd_group_member_heartbeat_age_seconds",
               "Seconds since each member's last heartbeat reached the coordinator (node 0 only).",
               {"node_rank", "address"}},
              ages);
}

}  // namespace

void CollectDurabilityFigures(const DurabilitySources& src, metrics::Exposition& out) {
  JobFigures(src, out);
  if (src.quota != nullptr) QuotaFigures(*src.quota, out);
  if (src.status.group().enabled()) GroupFigures(src.status.group(), out);
}

}  // namespace ckpt::daemon
