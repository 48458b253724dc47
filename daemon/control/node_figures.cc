#include "daemon/control/node_figures.h"

#include <map>
#include <string>

#include "daemon/config.h"
#include "daemon/control/durability_figures.h"
#include "daemon/metrics/process_metrics.h"

namespace ckpt::daemon {
namespace {

using Rows = std::vector<std::pair<metrics::LabelValues, double>>;

}  // namespace

void CollectNodeFigures(const NodeFigureSources& src, metrics::Exposition& out) {
  out.Samples({"ckptd_build_info", "ckptd's version; the value is 1.", {"version"}}, {{{kVersion}, 1}});

  uint64_t in_flight = 0;
  Rows by_user, by_job;
  for (const auto& [uid, bytes] : src.ledger.InFlightByUser()) {
    by_user.push_back({{std::to_string(uid)}, static_cast<double>(bytes)});
    in_flight += bytes;
  }
  for (const auto& [job, bytes] : src.ledger.InFlightByJob()) by_job.push_back({{job}, static_cast<double>(bytes)});
  out.Samples({"ckptd_staging_bytes",
               "Staging memory: capacity (--staging-bytes), used (snapshots in flight and committed "
               "copies kept for hot restore), in_flight (reserved by snapshots not yet committed or failed, and by "
               "the frozen blocks sessions share).",
               {"state"}},
              {{{"capacity"}, static_cast<double>(src.pool.capacity())},
               {{"used"}, static_cast<double>(src.pool.used())},
               {{"in_flight"}, static_cast<double>(in_flight)}});
  out.Samples({"ckptd_staging_user_bytes", "Staging memory in flight per user (uid).", {"uid"}},
              metrics::FoldRows(std::move(by_user), kMaxLabelled, 0));
  out.Samples({"ckptd_staging_job_bytes", "Staging memory in flight per job.", {"ckpt_job"}},
              metrics::FoldRows(std::move(by_job), kMaxLabelled, 0));

  double alive = 0, registered = 0;
  std::map<std::string, double> of_job;
  std::vector<SessionPtr> sessions = src.sessions.All();
  for (const SessionPtr& s : sessions) {
    if (s->trainer_alive() && !s->ended()) {
      ++alive;
      of_job[s->job()] += 1;
    }
    registered += static_cast<double>(s->registered_bytes());
  }
  Rows job_sessions;
  for (const auto& [job, n] : of_job) job_sessions.push_back({{job}, n});
  out.Samples({"ckptd_job_sessions", "Live trainer sessions per job (a job training here now).", {"ckpt_job"}},
              metrics::FoldRows(std::move(job_sessions), kMaxLabelled, 0));
  out.Samples({"ckptd_sessions", "Trainer sessions registered, by whether their trainer is alive.", {"state"}},
              {{{"alive"}, alive}, {{"ended"}, static_cast<double>(sessions.size()) - alive}});
  out.Samples({"ckptd_registered_bytes", "Bytes of tensors the registered sessions hold.", {}}, {{{}, registered}});

  size_t jobs = 0;
  const auto now = std::chrono::system_clock::now();
  Rows steps, ages, times;
  const std::vector<metrics::LastCommits::Commit> newest = src.commits.Newest(kMaxLabelled, &jobs);
  for (const metrics::LastCommits::Commit& c : newest) {
    steps.push_back({{c.job}, static_cast<double>(c.step)});
    ages.push_back({{c.job}, std::chrono::duration<double>(now - c.at).count()});
    times.push_back({{c.job}, std::chrono::duration<double>(c.at.time_since_epoch()).count()});
  }
  out.Samples({"ckptd_job_last_committed_step",
               "Each job's newest step committed on this node (found on disk at start, then each commit; the 64 most "
               "recent jobs).",
               {"ckpt_job"}},
              steps);
  out.Samples({"ckptd_job_last_commit_timestamp_seconds",
               "Unix time of each job's newest commit on this node (a step found on disk at start: its manifest's "
               "time), for rules on time() - x.",
               {"ckpt_job"}},
              times);
  out.Samples({"ckptd_job_last_commit_age_seconds", "Seconds since each job's newest commit (the 64 most recent jobs).",
               {"ckpt_job"}},
              ages);
  out.Samples({"ckptd_jobs_committed",
               "Jobs with a committed step on this node (found at start or committed since; at most 1024 remembered).",
               {}},
              {{{}, static_cast<double>(jobs)}});

  ::ckptd::v1::StatusReply reply;
  if (src.status) src.status(newest, &reply);
  CollectDurabilityFigures({reply, newest, src.quota}, out);
  if (reply.group().enabled()) {
    std::map<std::string, double> by_state = {{"waiting", 0}, {"alive", 0}, {"lost", 0}};
    for (const auto& m : reply.group().members()) by_state[m.state()] += 1;
    Rows members;
    for (const auto& [state, n] : by_state) members.push_back({{state}, n});
    out.Samples({"ckptd_group_members", "The group's members by state, as the coordinator last reported them.",
                 {"state"}},
                members);
    out.Samples({"ckptd_group_joined", "1 when this node has joined its group.", {}},
                {{{}, reply.group().joined() ? 1.0 : 0.0}});
    const auto& g = reply.group();
    out.Samples({"ckptd_group_relayed_total",
                 "What this node relayed for the nodes below it in the relay tree: prepares and heartbeats, "
                 "the batches that carried them up, outcome polls answered, the polls up that answered them, "
                 "restore-gather arrivals and the merged calls up that carried them.",
                 {"what"}},
                {{{"prepares"}, static_cast<double>(g.relayed_prepares())},
                 {{"batches"}, static_cast<double>(g.relayed_batches())},
                 {{"heartbeats"}, static_cast<double>(g.relayed_heartbeats())},
                 {{"heartbeat_batches"}, static_cast<double>(g.relayed_heartbeat_batches())},
                 {{"outcome_polls"}, static_cast<double>(g.relayed_outcome_polls())},
                 {{"upstream_polls"}, static_cast<double>(g.relayed_upstream_polls())},
                 {{"gathers"}, static_cast<double>(g.relayed_gathers())},
                 {{"gather_merges"}, static_cast<double>(g.relayed_gather_merges())}},
                /*counter=*/true);
    out.Samples({"ckptd_group_relay_bypasses_total",
                 "Calls this node sent to node 0 itself although it has a parent relay (the relay not yet known "
                 "alive, passed over after a failed call, or refusing).",
                 {}},
                {{{}, static_cast<double>(g.relay_bypasses())}}, /*counter=*/true);
  }
  metrics::CollectProcess(out);
}

}  // namespace ckpt::daemon
