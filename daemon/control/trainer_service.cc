#include "daemon/control/trainer_service.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/status.h"
#include "daemon/control/grpc_status.h"
#include "shm/payload_segment.h"

namespace ckpt::daemon {

using namespace ::ckptd::v1;

namespace {

constexpr size_t kMaxSessions = 4096;
constexpr size_t kMaxSessionsPerUid = 1024;
constexpr int kMaxArenaBatches = 64;  // of 64 arenas each: 4,096 arenas a session
constexpr size_t kStepsInReply = 16;   // RegisterReply.committed_steps
constexpr int kJobsInReply = 64;       // RestoreReply.other_jobs
constexpr size_t kJobsLooked = 1024;   // job directories looked at for them
// Train state up to this size comes back in the Restore reply; more, in shared memory.
constexpr uint64_t kInlineTrainStateBytes = 1 << 20;

}  // namespace

absl::StatusOr<std::vector<UniqueFd>> TrainerService::TakeArenas(
    const google::protobuf::RepeatedPtrField<std::string>& tokens, const PeerIdentity& caller) {
  if (tokens.size() > kMaxArenaBatches) {
    return absl::InvalidArgumentError(
        fmt::format("{} arena tokens; at most {}", tokens.size(), kMaxArenaBatches));
  }
  std::vector<UniqueFd> arenas;
  for (const std::string& token : tokens) {
    CKPT_ASSIGN_OR_RETURN(std::vector<UniqueFd> batch, arenas_.Take(token, caller));
    for (UniqueFd& fd : batch) arenas.push_back(std::move(fd));
  }
  return arenas;
}

grpc::Status TrainerService::Register(grpc::ServerContext* ctx, const RegisterRequest* request,
                                      RegisterReply* reply) {
  return Guarded("Register", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    // Every session costs a thread and a control block: bounded per user and in all.
    size_t total = 0, mine = 0;
    for (const SessionPtr& other : sessions_.All()) {
      ++total;
      if (other->uid() == caller.uid) ++mine;
    }
    if (total >= kMaxSessions || mine >= kMaxSessionsPerUid) {
      return absl::ResourceExhaustedError(fmt::format(
          "too many sessions ({} in all, {} of uid {}; at most {} and {} per user)", total, mine,
          caller.uid, kMaxSessions, kMaxSessionsPerUid));
    }
    // The job is the caller's (or it may join it) before anything else is looked at; a new
    // job is recorded as the caller's only once the registration has succeeded.
    if (absl::Status owned = owners_.MayClaim(request->job(), caller); !owned.ok()) {
      log::Get(log::Component::kControl)
          .warn("register refused for job \"{}\" rank {}: {}", request->job().substr(0, 128),
                request->rank(), Message(owned));
      return owned;
    }
    // A process registering a rank it already holds gave up on its earlier session (a
    // stalled ckptd): that one ends now, before the new one is charged for its arenas.
    sessions_.EndOwnSession(request->job(), request->rank(), caller);
    CKPT_ASSIGN_OR_RETURN(std::vector<UniqueFd> arenas, TakeArenas(request->arena_tokens(), caller));
    UniqueFd write_protect;
    if (!request->write_protect_token().empty()) {
      CKPT_ASSIGN_OR_RETURN(std::vector<UniqueFd> uffd,
                            arenas_.Take(request->write_protect_token(), caller,
                                         ArenaDeposits::Kind::kWriteProtect));
      write_protect = std::move(uffd.at(0));
    }
    auto session = Session::Create(*request, limits_, caller, std::move(arenas), std::move(write_protect));
    if (!session.ok()) {
      log::Get(log::Component::kControl)
          .warn("register refused for job \"{}\" rank {}: {}", request->job().substr(0, 128),
                request->rank(), Message(session.status()));
      return session.status();
    }
    SessionPtr s = std::move(*session);
    CKPT_RETURN_IF_ERROR(owners_.Claim(s->job(), caller));  // a racing other uid lost
    if (request->keep_last() != 0) retention_.SetKeepLast(s->job(), request->keep_last());
    // The job's upload policy: what this rank sent (unset: the node's). Ranks of a job that
    // disagree would upload different steps, so one differing from the live ranks' is refused.
    const upload::UploadPolicy policy =
        request->has_upload()
            ? upload::UploadPolicy{std::max<uint64_t>(1, request->upload().every_steps()),
                                   std::chrono::milliseconds(static_cast<int64_t>(
                                       request->upload().interval_seconds() * 1000))}
            : upload_policies_.node_default();
    const std::vector<SessionPtr> live_sessions = sessions_.All();
    const bool job_live = std::any_of(live_sessions.begin(), live_sessions.end(),
                                      [&](const SessionPtr& other) { return other->job() == s->job(); });
    if (const upload::UploadPolicy live = upload_policies_.For(s->job()); job_live && !(live == policy)) {
      return absl::FailedPreconditionError(fmt::format(
          "rank {} of job {} asks to upload {}, its other ranks {}: give every rank the same "
          "upload policy (Python: upload_every_steps, upload_interval_seconds)",
          s->rank(), s->job(), upload::Describe(policy), upload::Describe(live)));
    }
    s->Start(stager_, persist_, board_);
    if (absl::Status added = sessions_.Add(s); !added.ok()) {
      s->Stop();
      return added;
    }
    upload_policies_.Set(s->job(), policy);
    reply->set_session_id(s->id());
    reply->set_control_socket(control_socket_);
    reply->set_registered_bytes(s->registered_bytes());
    // What the job holds already (a run that saves without restoring is warned). Not in
    // direct mode: there it would be a manifest GET per step before the trainer's answer.
    absl::StatusOr<std::vector<uint64_t>> steps = std::vector<uint64_t>{};
    if (!restorer_.StoreIsRemote()) steps = restorer_.CommittedSteps(s->job());
    if (steps.ok()) {
      reply->set_committed_count(steps->size());
      const size_t first = steps->size() - std::min(steps->size(), kStepsInReply);
      for (size_t i = first; i < steps->size(); ++i) reply->add_committed_steps((*steps)[i]);
    }
    log::Get(log::Component::kControl)
        .info("[{}/r{}] registered pid {}: {} tensors, {} bytes (session {})", s->job(), s->rank(),
              s->pid(), s->tensor_count(), s->registered_bytes(), s->id());
    return absl::OkStatus();
  });
}

grpc::Status TrainerService::Snapshot(grpc::ServerContext* ctx, const SnapshotRequest* request,
                                      SnapshotReply* reply) {
  return Guarded("Snapshot", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    CKPT_ASSIGN_OR_RETURN(SessionPtr s, sessions_.FindFor(request->session_id(), caller));
    shm::SnapshotPayload payload;
    payload.metadata.insert(request->metadata().begin(), request->metadata().end());
    for (const Blob& b : request->train_state()) payload.train_state.push_back({b.name(), b.data()});
    CKPT_ASSIGN_OR_RETURN(uint64_t ticket, s->PublishSnapshot(request->step(), payload));
    reply->set_ticket(ticket);
    return absl::OkStatus();
  });
}

grpc::Status TrainerService::Wait(grpc::ServerContext* ctx, const WaitRequest* request,
                                  WaitReply* reply) {
  return Guarded("Wait", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    CKPT_ASSIGN_OR_RETURN(SessionPtr s, sessions_.FindFor(request->session_id(), caller));
    CKPT_ASSIGN_OR_RETURN(CallLimiter::Slot slot, long_calls_.Enter(caller.uid, "Wait"));
    auto timeout = std::chrono::milliseconds(std::min<uint32_t>(request->timeout_ms(), 600'000));
    CKPT_ASSIGN_OR_RETURN(shm::TicketResult result,
                          s->producer().Wait(request->ticket(), request->until_committed(), timeout,
                                             std::chrono::milliseconds(5000)));
    if (result.state == shm::kTicketUnknown) return absl::NotFoundError(result.error);
    reply->set_state(static_cast<TicketState>(result.state));
    reply->set_error(result.error);
    return absl::OkStatus();
  });
}

grpc::Status TrainerService::Restore(grpc::ServerContext* ctx, const RestoreRequest* request,
                                     RestoreReply* reply) {
  return Guarded("Restore", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    CKPT_ASSIGN_OR_RETURN(SessionPtr s, sessions_.FindFor(request->session_id(), caller));
    CKPT_ASSIGN_OR_RETURN(CallLimiter::Slot slot, long_calls_.Enter(caller.uid, "Restore"));
    // A job whose name was taken here while the remote tier could not say whose it is: the
    // remote tier's steps are read only once its record names this node's owner.
    if (absl::Status mine = owners_.CheckRemote(s->job(), caller); !mine.ok()) {
      log::Get(log::Component::kControl).warn("[{}/r{}] restore refused: {}", s->job(), s->rank(), Message(mine));
      return mine;
    }
    RestoreSpec spec;
    if (request->has_step()) spec.step = request->step();
    CKPT_ASSIGN_OR_RETURN(spec.selection,
                          format::TensorSelection::Make({request->include().begin(), request->include().end()},
                                                {request->exclude().begin(), request->exclude().end()}));
    spec.allow_missing = request->allow_missing();
    spec.cast = request->cast();
    std::lock_guard lock(s->data_mutex());
    absl::StatusOr<RestoreResult> restored = restorer_.Restore(s->view(), spec);
    s->TensorsRestored();  // whatever it wrote, frozen tensors are the trainer's to copy again
    if (!restored.ok()) {
      // The trainer sees a message cut to what fits in a gRPC status; the log has all of it.
      log::Get(log::Component::kControl)
          .warn("[{}/r{}] restore failed: {}", s->job(), s->rank(), Message(restored.status()));
      return restored.status();
    }
    RestoreResult& result = *restored;
    if (result.found && restored_hook_) restored_hook_(s->job(), s->rank(), s->started_unix_ns(), result.step, result.source);
    reply->set_found(result.found);
    reply->set_step(result.step);
    reply->set_bytes(result.bytes);
    reply->set_tensors(result.tensors);
    reply->set_skipped(result.skipped);
    for (const std::string& name : result.not_in_checkpoint) reply->add_not_in_checkpoint(name);
    for (const std::string& name : result.not_registered) reply->add_not_registered(name);
    for (const std::string& w : result.warnings) reply->add_warnings(w);
    reply->set_saved_world_size(result.saved_world_size);
    if (!result.found && !restorer_.StoreIsRemote()) {
      // Jobs with committed steps that the caller may see (never another user's job names),
      // from this node's disk alone: a fresh job's first load() costs no remote request.
      if (absl::StatusOr<std::vector<std::string>> jobs = restorer_.Jobs(); jobs.ok()) {
        for (size_t i = 0; i < jobs->size() && i < kJobsLooked && reply->other_jobs_size() < kJobsInReply; ++i) {
          const std::string& other = (*jobs)[i];
          if (other == s->job() || !owners_.VisibleTo(other, caller)) continue;
          if (absl::StatusOr<std::vector<uint64_t>> steps = restorer_.Steps(other); steps.ok() && !steps->empty()) {
            reply->add_other_jobs(other);
          }
        }
      }
    }
    reply->set_source(result.source == RestoreResult::Source::kMemory   ? RESTORE_SOURCE_MEMORY
                      : result.source == RestoreResult::Source::kRemote ? RESTORE_SOURCE_REMOTE
                      : result.source == RestoreResult::Source::kPeer   ? RESTORE_SOURCE_PEER
                                                                        : RESTORE_SOURCE_DISK);
    reply->mutable_metadata()->insert(result.metadata.begin(), result.metadata.end());
    uint64_t state_bytes = 0;
    for (const shm::NamedBlob& blob : result.train_state) state_bytes += blob.data.size();
    if (state_bytes > kInlineTrainStateBytes) {
      // Shared memory, like the tensors: a reply stays small whatever the train state. What
      // one user's sessions leave unfetched is bounded by the staging budget (and each is
      // dropped after Session::kRestoredStateKept).
      uint64_t waiting = 0;
      for (const SessionPtr& other : sessions_.All()) {
        if (other->uid() == caller.uid && other != s) waiting += other->restored_state_bytes();
      }
      if (waiting + state_bytes > limits_.staging_bytes) {
        return absl::ResourceExhaustedError(fmt::format(
            "restore: this user's sessions hold {} bytes of restored train state not yet fetched; "
            "{} more would pass --staging-bytes ({})",
            waiting, state_bytes, limits_.staging_bytes));
      }
      shm::SnapshotPayload state{.train_state = std::move(result.train_state)};
      CKPT_ASSIGN_OR_RETURN(shm::SealedSegmentPtr segment,
                            shm::EncodeToSegment(state, fmt::format("ckptd-restored-{}", s->id())));
      s->SetRestoredTrainState(std::move(segment));
      reply->set_train_state_deposited(true);
      return absl::OkStatus();
    }
    for (auto& blob : result.train_state) {
      Blob* b = reply->add_train_state();
      b->set_name(blob.name);
      b->set_data(std::move(blob.data));
    }
    return absl::OkStatus();
  });
}

grpc::Status TrainerService::Update(grpc::ServerContext* ctx, const UpdateRequest* request,
                                    UpdateReply* reply) {
  return Guarded("Update", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    CKPT_ASSIGN_OR_RETURN(SessionPtr s, sessions_.FindFor(request->session_id(), caller));
    CKPT_ASSIGN_OR_RETURN(std::vector<UniqueFd> arenas, TakeArenas(request->arena_tokens(), caller));
    absl::StatusOr<uint64_t> bytes = s->Update(*request, limits_, std::move(arenas));
    if (!bytes.ok()) {
      log::Get(log::Component::kControl)
          .warn("[{}/r{}] update refused: {}", s->job(), s->rank(), Message(bytes.status()));
      return bytes.status();
    }
    reply->set_registered_bytes(*bytes);
    reply->set_tensors(static_cast<uint32_t>(s->tensor_count()));
    log::Get(log::Component::kControl)
        .info("[{}/r{}] updated: {} tensors added or replaced, {} removed; {} tensors, {} bytes",
              s->job(), s->rank(), request->tensors_size(), request->removed_size(),
              s->tensor_count(), *bytes);
    return absl::OkStatus();
  });
}

grpc::Status TrainerService::ShouldSave(grpc::ServerContext* ctx,
                                        const ShouldSaveRequest* request, ShouldSaveReply* reply) {
  return Guarded("ShouldSave", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    // The job is the session's: a trainer can ask only about its own job.
    CKPT_ASSIGN_OR_RETURN(SessionPtr s, sessions_.FindFor(request->session_id(), caller));
    // In a group the answer comes from the coordinator: a call that may wait that long.
    CKPT_ASSIGN_OR_RETURN(CallLimiter::Slot slot, long_calls_.Enter(caller.uid, "ShouldSave"));
    SaveQuestion question{s->job(), request->run(), request->step(),
                          std::chrono::milliseconds(request->interval_ms())};
    absl::StatusOr<bool> save = saves_.ShouldSave(question);
    if (absl::IsUnavailable(save.status()) || absl::IsDeadlineExceeded(save.status())) {
      // Not "ckptd unreachable": this ckptd answered; the group's clock did not. The
      // trainer skips this step's save, keeping its session.
      return absl::AbortedError(fmt::format("no save decision for step {}: {}", request->step(),
                                            Message(save.status())));
    }
    if (!save.ok()) return save.status();
    reply->set_save(*save);
    return absl::OkStatus();
  });
}

grpc::Status TrainerService::Unregister(grpc::ServerContext* ctx, const UnregisterRequest* request,
                                        UnregisterReply*) {
  return Guarded("Unregister", [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(PeerIdentity caller, peers_.Of(ctx->peer()));
    CKPT_RETURN_IF_ERROR(sessions_.FindFor(request->session_id(), caller).status());
    CKPT_RETURN_IF_ERROR(sessions_.Remove(request->session_id()));
    log::Get(log::Component::kControl).info("session {} unregistered", request->session_id());
    return absl::OkStatus();
  });
}

}  // namespace ckpt::daemon
