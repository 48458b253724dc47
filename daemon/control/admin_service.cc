#include "daemon/control/admin_service.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>

#include "common/log.h"
#include "common/names.h"
#include "storage/secret.h"
#include "common/status.h"
#include "daemon/control/grpc_status.h"
#include "format/manifest.h"
#include "format/verify.h"
#include "storage/open_store.h"
#include "proto/format_replies.h"

namespace ckpt::daemon {

using namespace ::ckptd::v1;

namespace {

// What a caller who may not see every job keeps of a status reply: the sessions and jobs it
// may see, and the errors about them ("[job s12] ..."); the node's own figures stay.
void KeepVisible(StatusReply& reply, const std::function<bool(const std::string& job)>& visible) {
  auto* sessions = reply.mutable_sessions();
  sessions->erase(std::remove_if(sessions->begin(), sessions->end(),
                                 [&](const SessionStatus& s) { return !visible(s.job()); }),
                  sessions->end());
  auto* jobs = reply.mutable_jobs();
  jobs->erase(std::remove_if(jobs->begin(), jobs->end(), [&](const JobStatus& j) { return !visible(j.job()); }),
              jobs->end());
  auto* held = reply.mutable_group()->mutable_held_replicas();
  held->erase(std::remove_if(held->begin(), held->end(), [&](const HeldReplica& h) { return !visible(h.job()); }),
              held->end());
  auto* errors = reply.mutable_recent_errors();
  errors->erase(std::remove_if(errors->begin(), errors->end(),
                               [&](const std::string& e) {
                                 const size_t end = e.find(' ');
                                 return e.empty() || e[0] != '[' || end == std::string::npos ||
                                        !visible(e.substr(1, end - 1));
                               }),
                errors->end());
  reply.mutable_group()->clear_last_error();
}

}  // namespace

grpc::Status AdminService::Status(grpc::ServerContext* ctx, const StatusRequest*, StatusReply* reply) {
  return Guarded("Status", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(std::optional<JobFilter> visible, ListableJobs(ctx));
    reply->set_version(kVersion);
    reply->set_root(config_.root);
    reply->set_remote(config_.remote);
    reply->set_uptime_s(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    reply->set_config_json(config_.ToJson());
    reply->set_staging_bytes_total(pool_.capacity());
    reply->set_staging_bytes_used(pool_.used());
    reply->set_staging_prefaulted(pool_.prefault_done());
    for (const SessionPtr& s : sessions_.All()) {
      SessionStatus* out = reply->add_sessions();
      // No session id: status is readable by anyone who may connect, and an id is what a
      // caller names a session by (it is still no use to anyone but the session's process).
      out->set_job(s->job());
      out->set_rank(s->rank());
      out->set_world_size(s->world_size());
      out->set_pid(s->pid());
      out->set_tensors(static_cast<uint32_t>(s->tensor_count()));
      out->set_bytes(s->registered_bytes());
      out->set_last_staged_step(s->last_staged_step());
      out->set_last_committed_step(s->last_committed_step());
      out->set_trainer_alive(s->trainer_alive() && !s->ended());
    }
    auto pending = src_.writes.Pending();
    auto hot = src_.hot.Steps();
    auto in_flight = src_.committer.InFlight();
    for (const commit::StepInFlight& f : in_flight) pending[f.job].push_back(f.step);
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, store_.ListJobs());
    for (const auto* view : {&pending, &hot}) {
      for (const auto& [job, v] : *view) {
        if (std::find(jobs.begin(), jobs.end(), job) == jobs.end()) jobs.push_back(job);
      }
    }
    for (const std::string& job : jobs) {
      JobStatus* out = reply->add_jobs();
      out->set_job(job);
      auto steps = store_.ListStepsInRunOrder(job);
      if (steps.ok() && !steps->empty()) {
        out->set_has_committed(true);
        out->set_latest_committed_step(steps->back());
      }
      if (auto it = pending.find(job); it != pending.end()) {
        std::sort(it->second.begin(), it->second.end());
        it->second.erase(std::unique(it->second.begin(), it->second.end()), it->second.end());
        for (uint64_t s : it->second) out->add_pending_steps(s);
      }
      if (auto it = hot.find(job); it != hot.end()) {
        for (uint64_t s : it->second) out->add_hot_steps(s);
      }
      for (const commit::StepInFlight& f : in_flight) {
        if (f.job != job) continue;
        ::ckptd::v1::StepInFlight* step = out->add_in_flight();
        step->set_step(f.step);
        step->set_world_size(f.world_size);
        for (uint32_t r : f.missing_ranks) step->add_missing_ranks(r);
        step->set_age_s(f.age_s);
        step->set_state(f.state);
        step->set_scope("node");
      }
    }
    if (src_.group_status) src_.group_status(reply);
    if (src_.upload_status) src_.upload_status(reply);
    for (std::string& e : board_.RecentErrors()) reply->add_recent_errors(std::move(e));
    reply->set_snapshots_staged(board_.snapshots_staged);
    reply->set_snapshots_rejected(board_.snapshots_rejected);
    reply->set_checkpoints_committed(board_.checkpoints_committed);
    reply->set_checkpoints_failed(board_.checkpoints_failed);
    reply->set_bytes_persisted(board_.bytes_persisted);
    if (visible) KeepVisible(*reply, *visible);
    return absl::OkStatus();
  });
}

grpc::Status AdminService::List(grpc::ServerContext* ctx, const ListRequest* request, ListReply* reply) {
  return Guarded("List", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(std::optional<JobFilter> visible, ListableJobs(ctx));
    // Only the jobs the caller may see are read at all: another user's job that cannot be
    // listed neither fails the call nor shows in its errors.
    auto list = [&](format::CheckpointStore& store) -> absl::StatusOr<std::vector<format::CheckpointSummary>> {
      if (!visible) return format::ListCheckpoints(store, request->job());
      if (!request->job().empty()) {
        if (!(*visible)(request->job())) return std::vector<format::CheckpointSummary>{};
        return format::ListCheckpoints(store, request->job());
      }
      CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, store.ListJobs());
      std::vector<format::CheckpointSummary> all;
      for (const std::string& job : jobs) {
        if (!(*visible)(job)) continue;
        CKPT_ASSIGN_OR_RETURN(std::vector<format::CheckpointSummary> mine, format::ListCheckpoints(store, job));
        all.insert(all.end(), mine.begin(), mine.end());
      }
      return all;
    };
    CKPT_ASSIGN_OR_RETURN(std::vector<format::CheckpointSummary> listed, list(store_));
    const auto hot = src_.hot.Steps();
    std::map<std::pair<std::string, uint64_t>, ::ckptd::v1::CheckpointInfo> by_step;
    for (const format::CheckpointSummary& c : listed) {
      ::ckptd::v1::CheckpointInfo& info = by_step[{c.job, c.step}];
      ToProto(c, &info);
      if (auto it = hot.find(c.job);
          it != hot.end() && std::find(it->second.begin(), it->second.end(), c.step) != it->second.end()) {
        info.add_tiers("memory");
      }
      if (src_.replicated && src_.replicated(c.job, c.step)) info.add_tiers("replicated");
      info.add_tiers(src_.remote == nullptr && storage::IsS3Url(store_.root()) ? "remote" : "local");
    }
    if (src_.remote != nullptr) {
      // The remote tier lists only whole steps; a store that cannot be listed is named
      // in the reply's errors rather than failing the local listing. It is listed on a
      // thread of its own, waited for until shortly before the caller's deadline: a store
      // that stopped answering (each request waits out its stall timeout, and is retried)
      // never costs the local listing. Listings of the same jobs for the same caller share
      // one request.
      std::string asker = "*";
      if (visible && exposure_.peers != nullptr) {
        if (absl::StatusOr<PeerIdentity> caller = exposure_.peers->Of(ctx->peer()); caller.ok()) {
          asker = std::to_string(caller->uid);
        }
      }
      const auto left = ctx->deadline() - std::chrono::system_clock::now();
      const auto wait = std::clamp<std::chrono::system_clock::duration>(
          left - std::max<std::chrono::system_clock::duration>(std::chrono::seconds(1), left / 10),
          std::chrono::system_clock::duration::zero(), std::chrono::seconds(60));
      auto question = [remote = src_.remote, job = request->job(),
                       visible]() -> absl::StatusOr<std::vector<format::CheckpointSummary>> {
        if (!visible) return format::ListCheckpoints(*remote, job);
        if (!job.empty()) {
          if (!(*visible)(job)) return std::vector<format::CheckpointSummary>{};
          return format::ListCheckpoints(*remote, job);
        }
        CKPT_ASSIGN_OR_RETURN(std::vector<std::string> jobs, remote->ListJobs());
        std::vector<format::CheckpointSummary> all;
        for (const std::string& j : jobs) {
          if (!(*visible)(j)) continue;
          CKPT_ASSIGN_OR_RETURN(std::vector<format::CheckpointSummary> mine, format::ListCheckpoints(*remote, j));
          all.insert(all.end(), mine.begin(), mine.end());
        }
        return all;
      };
      // Waited for in short slices: a caller that goes away (or a server shutting down)
      // ends the wait; the listing goes on for the next caller.
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(wait);
      RemoteListings::Outcome asked;
      do {
        asked = remote_listings_->Ask(request->job() + "\n" + asker, question,
                                      std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(250)));
      } while (!asked.answer && std::chrono::steady_clock::now() < until && !ctx->IsCancelled());
      absl::StatusOr<std::vector<format::CheckpointSummary>> uploaded =
          asked.answer ? *std::move(asked.answer)
                       : absl::DeadlineExceededError(fmt::format(
                             "no answer in {} s (still asked: a later list shows it once it answers)",
                             std::chrono::duration_cast<std::chrono::seconds>(asked.waited).count()));
      if (!uploaded.ok()) {
        reply->add_errors(fmt::format("the remote tier {} cannot be listed: {}", src_.remote->root(),
                                      Message(uploaded.status())));
      } else {
        for (const format::CheckpointSummary& c : *uploaded) {
          auto [it, fresh] = by_step.try_emplace({c.job, c.step});
          if (fresh) ToProto(c, &it->second);
          it->second.add_tiers("remote");
        }
      }
    }
    for (auto& [key, info] : by_step) *reply->add_checkpoints() = std::move(info);
    return absl::OkStatus();
  });
}

grpc::Status AdminService::Show(grpc::ServerContext* ctx, const CheckpointRef* request, ShowReply* reply) {
  return Guarded("Show", [&]() -> absl::Status {
    // A manifest tells a job's metadata, tensor names and checksums: its owner's to read.
    CKPT_RETURN_IF_ERROR(MayAct(ctx, "show", request->job()));
    // An indexed step shows its index: its parts together are larger than a reply may be.
    CKPT_ASSIGN_OR_RETURN(format::Manifest m, store_.LoadManifest(request->job(), request->step(),
                                                                  format::CheckpointStore::Depth::kIndexOnly));
    reply->set_manifest_json(format::ManifestToJson(m));
    return absl::OkStatus();
  });
}

absl::StatusOr<format::VerifyReport> AdminService::RunVerify(grpc::ServerContext* ctx,
                                                             const CheckpointRef& request,
                                                             format::VerifyOptions options) {
  CKPT_RETURN_IF_ERROR(MayAct(ctx, "verify", request.job()));
  // One at a time for the whole daemon: a verify reads a whole step and pins it against
  // retention, and anyone who may read status may ask for one.
  static std::mutex verifying;
  std::unique_lock one(verifying, std::try_to_lock);
  if (!one.owns_lock()) {
    return absl::ResourceExhaustedError("another verify is running; try again when it is done");
  }
  persist::RetentionKeeper::Pin pin(src_.retention, request.job(), request.step());
  options.node = LocalNode();
  CKPT_ASSIGN_OR_RETURN(format::VerifyReport report,
                        format::VerifyCheckpoint(store_, request.job(), request.step(), options));
  if (report.cancelled) {
    // Said in the log: the caller that went away will not read it.
    const std::string why = fmt::format("the verify of step {} of job {} stopped after {} bytes: its caller went away",
                                        request.step(), request.job(), report.bytes_checked);
    log::Get(log::Component::kControl).info("{}", why);
    return absl::CancelledError(why);
  }
  if (!report.ok()) {
    board_.RecordError(fmt::format("[{} s{}] verify: {}", request.job(), request.step(),
                                   report.problems.front()));
  }
  return report;
}

grpc::Status AdminService::Verify(grpc::ServerContext* ctx, const CheckpointRef* request,
                                  VerifyReply* reply) {
  return Guarded("Verify", [&]() -> absl::Status {
    format::VerifyOptions options;
    options.progress = [ctx](uint64_t, uint64_t) { return !ctx->IsCancelled(); };
    CKPT_ASSIGN_OR_RETURN(format::VerifyReport report, RunVerify(ctx, *request, std::move(options)));
    ToProto(report, reply);
    return absl::OkStatus();
  });
}

grpc::Status AdminService::VerifyWithProgress(grpc::ServerContext* ctx, const CheckpointRef* request,
                                              grpc::ServerWriter<VerifyUpdate>* writer) {
  return Guarded("VerifyWithProgress", [&]() -> absl::Status {
    // A few updates a second: enough for a progress bar, nothing next to the reading.
    constexpr auto kEvery = std::chrono::milliseconds(250);
    auto last = std::chrono::steady_clock::now();
    uint64_t total = 0;
    format::VerifyOptions options;
    options.progress = [&](uint64_t checked, uint64_t to_check) {
      if (ctx->IsCancelled()) return false;
      total = to_check;
      const auto now = std::chrono::steady_clock::now();
      if (now - last < kEvery) return true;
      last = now;
      VerifyUpdate update;
      update.set_bytes_checked(checked);
      update.set_bytes_total(to_check);
      return writer->Write(update);  // false: the stream is gone
    };
    CKPT_ASSIGN_OR_RETURN(format::VerifyReport report, RunVerify(ctx, *request, std::move(options)));
    VerifyUpdate last_update;
    last_update.set_bytes_checked(report.bytes_checked);
    last_update.set_bytes_total(std::max(total, report.bytes_checked));
    ToProto(report, last_update.mutable_result());
    if (!writer->Write(last_update)) return absl::CancelledError("the caller went away before the result");
    return absl::OkStatus();
  });
}

absl::StatusOr<std::optional<AdminService::JobFilter>> AdminService::ListableJobs(grpc::ServerContext* ctx) const {
  // Over TCP, reads are the operator's (a firewall guards them); on the socket the caller
  // is known, and another user's job names, steps and sizes are not shown.
  if (exposure_.over_tcp || exposure_.peers == nullptr || exposure_.owners == nullptr) return std::nullopt;
  CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, exposure_.peers->Of(ctx->peer()));
  if (caller.uid == 0 || caller.uid == ::geteuid()) return std::nullopt;
  return JobFilter([owners = exposure_.owners, caller, seen = std::make_shared<std::map<std::string, bool>>()](
                       const std::string& job) {
    auto [it, fresh] = seen->try_emplace(job, false);
    if (fresh) it->second = owners->VisibleTo(job, caller);
    return it->second;
  });
}

absl::Status AdminService::MayAct(grpc::ServerContext* ctx, const char* call,
                                      const std::string& job) const {
  if (!exposure_.over_tcp) {
    // On the socket the caller is known: only who may act on the job (its owner, root, the
    // daemon's user, or the job's group) may read its manifests or destroy its steps.
    if (exposure_.peers == nullptr || exposure_.owners == nullptr) return absl::OkStatus();
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, exposure_.peers->Of(ctx->peer()));
    return exposure_.owners->Check(job, caller, fmt::format("{} steps of", call));
  }
  if (exposure_.token.empty()) {
    return absl::PermissionDeniedError(fmt::format(
        "{} over --admin-addr is refused: this daemon has no --admin-token-file (use the Unix "
        "socket, or give ckptd --admin-token-file and ckptctl --token-file)",
        call));
  }
  const auto& metadata = ctx->client_metadata();
  auto given = metadata.find(kAdminTokenMetadata);
  std::string_view token = given == metadata.end()
                               ? std::string_view()
                               : std::string_view(given->second.data(), given->second.size());
  if (!SecretEquals(token, exposure_.token)) {
    log::Get(log::Component::kControl)
        .warn("refused {} from {}: the admin token is missing or wrong", call, ctx->peer());
    return absl::UnauthenticatedError(fmt::format(
        "{} over --admin-addr needs the admin token (ckptctl --token-file): it is missing or "
        "wrong",
        call));
  }
  return absl::OkStatus();
}

grpc::Status AdminService::Delete(grpc::ServerContext* ctx, const CheckpointRef* request,
                                  DeleteReply* reply) {
  return Guarded("Delete", [&]() -> absl::Status {
    CKPT_RETURN_IF_ERROR(MayAct(ctx, "delete", request->job()));
    CKPT_ASSIGN_OR_RETURN(std::string note, src_.retention.DeleteStep(request->job(), request->step()));
    log::Get(log::Component::kControl)
        .info("[{} s{}] deleted by an operator{}", request->job(), request->step(), note.empty() ? "" : "; " + note);
    reply->set_note(note);
    return absl::OkStatus();
  });
}

}  // namespace ckpt::daemon
