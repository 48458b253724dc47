// One trainer rank's session: the buffers it registered (mapped from its shared-memory
// arenas), its control block, and the thread that takes its snapshot commands. The session
// watches its trainer (pidfd) and ends when the trainer exits; snapshots already staged
// are still written and committed.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/timed_mutex.h"
#include "common/unique_fd.h"
#include "cuda/ipc_memory_cache.h"
#include "cuda/trainer_sync.h"
#include "daemon/session/arena_budget.h"
#include "daemon/session/arena_deposits.h"
#include "daemon/session/peer_identity.h"
#include "daemon/session/session_events.h"
#include "daemon/staging/frozen_tensors.h"
#include "daemon/staging/snapshot_sink.h"
#include "daemon/staging/stager.h"
#include "proto/trainer.pb.h"
#include "shm/command_ring.h"
#include "shm/sealed_segment.h"

namespace ckpt::daemon {

class Session final : public TicketSink, public std::enable_shared_from_this<Session> {
 public:
  struct Limits {
    uint64_t staging_bytes = 0;  // registrations larger than the budget are refused
    cuda::IpcMemoryCache* gpu_memory = nullptr;  // null: this daemon has no usable GPU
    std::string no_gpu_reason;
    bool cuda_ipc = true;  // --cuda-ipc: false refuses CUDA IPC handles outright
    ArenaBudget* arena_budget = nullptr;  // what mapped arenas may cost; null: unbounded
    uid_t daemon_uid = 0;
    std::vector<uint32_t> allow_uids;
    // Where a snapshot payload too large for a ring slot was handed over (ArenaDeposits,
    // kind kPayload); null: such snapshots fail.
    ArenaDeposits* deposits = nullptr;
    uint32_t frozen_check_every = 20;  // --frozen-check-every (0: never)
    // How many ranks of a job have a session on this daemon (StagedSnapshot::local_ranks);
    // null: one.
    std::function<uint32_t(const std::string& job)> local_ranks;
  };

  // Validates the request, maps the trainer's arenas and creates the control block.
  // `caller` is who connected (PeerTable), never taken from the request. `arenas` are the
  // descriptors the caller handed over for this registration (ArenaDeposits), in the order
  // of the request's arena_tokens; TensorSpec.arena indexes them. `write_protect` is the
  // trainer's userfaultfd (RegisterRequest.write_protect_token), if it handed one over:
  // arenas in huge pages then get copy-on-write snapshots (daemon/staging/cow_copy.h).
  static absl::StatusOr<std::shared_ptr<Session>> Create(const ::ckptd::v1::RegisterRequest& request,
                                                         const Limits& limits,
                                                         const PeerIdentity& caller,
                                                         std::vector<UniqueFd> arenas,
                                                         UniqueFd write_protect = {});
  ~Session() override;

  // Adds, replaces (by name) and removes tensors of a running session (UpdateRequest): only
  // what changed is mapped. All or nothing. `arenas` are those handed over for this update.
  // Returns the bytes now registered.
  absl::StatusOr<uint64_t> Update(const ::ckptd::v1::UpdateRequest& request, const Limits& limits,
                                  std::vector<UniqueFd> arenas);
  static constexpr size_t kMaxSessionArenas = 16384;
  static constexpr size_t kMaxSessionTensors = size_t{1} << 20;
  // How long an update waits for a snapshot or restore of the session to finish.
  static constexpr std::chrono::milliseconds kUpdateWait{2000};

  // Starts the command thread.
  void Start(Stager& stager, SnapshotSink& persist, SessionEvents& events);
  // From now on snapshot commands are rejected (shutdown); staged ones carry on.
  void RefuseNewSnapshots() { refusing_ = true; }
  // Closes the control block (waking trainer waiters) and joins the command thread.
  void Stop();

  const std::string& id() const { return id_; }
  const std::string& job() const { return job_; }
  // When it registered, on the wall clock (ns): its snapshots' session_started_unix_ns.
  uint64_t started_unix_ns() const { return started_unix_ns_; }
  uint32_t rank() const { return rank_; }
  uint32_t world_size() const { return world_size_; }
  int32_t pid() const { return pid_; }
  uid_t uid() const { return uid_; }
  int control_fd() const { return control_->fd(); }
  uint64_t registered_bytes() const { return registered_bytes_.load(); }
  // Only under data_mutex() (an update replaces them); tensor_count() anywhere.
  const std::vector<RegisteredTensor>& tensors() const { return tensors_; }
  size_t tensor_count() const { return tensor_count_.load(); }
  // As snapshot `ticket` sees it: the copy waits for that ticket's snapshot event.
  SessionView view(uint64_t ticket = 0) const {
    void* after = snapshot_events_.empty() ? nullptr : snapshot_events_[ticket % snapshot_events_.size()]->get();
    return {job_, uid_, rank_, world_size_, &tensors_, after, write_protect_.get(), frozen_.get()};
  }
  // A restore wrote the trainer's tensors (whatever it ended with): the next snapshot copies
  // the frozen ones from the trainer. Under data_mutex().
  void TensorsRestored() { frozen_->Invalidate(); }
  bool trainer_alive() const { return trainer_alive_.load(); }
  // Tells the trainer this daemon is alive (SessionRegistry's ticker, every 100 ms).
  // Also drops a restored train state left unfetched for kRestoredStateKept.
  void Heartbeat();
  // Checks the trainer now rather than at the command thread's next tick.
  bool CheckTrainerAlive();
  bool ended() const { return ended_.load(); }
  uint64_t last_staged_step() const { return last_staged_step_.load(); }
  uint64_t last_committed_step() const { return last_committed_step_.load(); }

  // The RPC path of a snapshot: publishes into this session's ring as the trainer would.
  // Refused for a session with GPU tensors (its client numbers the snapshot events).
  absl::StatusOr<uint64_t> PublishSnapshot(uint64_t step, const shm::SnapshotPayload& payload);
  shm::CommandProducer producer() const { return shm::CommandProducer(control_block_); }

  void SetTicketState(uint64_t ticket, shm::TicketStateValue state,
                      std::string_view error = {}) override;

  // A restore's train state too large for its reply waits here until the trainer fetches
  // it on the descriptor socket (ControlFdServer); a later restore replaces it.
  void SetRestoredTrainState(shm::SealedSegmentPtr state);
  shm::SealedSegmentPtr TakeRestoredTrainState();
  uint64_t restored_state_bytes() const { return restored_bytes_.load(); }  // waiting to be fetched
  static constexpr std::chrono::seconds kRestoredStateKept{60};

  // Serialises restores with snapshots of this session.
  TimedMutex& data_mutex() { return data_mu_; }

 private:
  Session() = default;
  absl::Status AddGpuTensor(const ::ckptd::v1::TensorSpec& t, const Limits& limits,
                            RegisteredTensor& out);
  // Validates `spec` and describes where its bytes are. A host tensor's arena is mapped
  // when a tensor first lives there: `handed` are the descriptors handed over for this
  // registration or update, which are arenas_[first_handed...].
  absl::StatusOr<RegisteredTensor> BuildTensor(const ::ckptd::v1::TensorSpec& spec,
                                               const Limits& limits, std::vector<UniqueFd>& handed,
                                               size_t first_handed);
  // The tensors after `request` (Update's work before the all-or-nothing swap).
  absl::StatusOr<std::vector<RegisteredTensor>> Updated(const ::ckptd::v1::UpdateRequest& request,
                                                        const Limits& limits,
                                                        std::vector<UniqueFd>& arenas,
                                                        size_t first_handed);
  void CommandLoop(Stager& stager, SnapshotSink& persist, SessionEvents& events);
  void HandleSnapshot(shm::Command command, Stager& stager, SnapshotSink& persist,
                      SessionEvents& events);
  bool PollTrainerAlive();
  // Staged, unless the trainer abandoned the ticket first (false).
  bool MarkStaged(uint64_t ticket);
  // Counts one more arena (refusing the same memory twice, and beyond the budget).
  absl::Status ChargeArena(int fd, const Limits& limits);
  // Registers arena `index` (just mapped as `mapped`, its descriptor still open) for
  // write-protection at the address the trainer gave, when that is possible and worth it;
  // why not otherwise.
  absl::Status ProtectArena(size_t index, const shm::SealedSegment& mapped);
  // Takes the trainer's arena addresses for arenas [first, first + addresses.size()).
  absl::Status NoteArenaAddresses(const google::protobuf::RepeatedField<uint64_t>& addresses,
                                  size_t first, size_t handed);

  std::string id_;
  std::string job_;
  uint32_t rank_ = 0;
  uint32_t world_size_ = 0;
  int32_t pid_ = 0;
  uid_t uid_ = 0;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  const uint64_t started_unix_ns_ = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count());
  UniqueFd pidfd_;
  std::vector<shm::SealedSegmentPtr> arenas_;  // mapped; their descriptors closed
  std::unique_ptr<WriteProtector> write_protect_;  // null: snapshots copy before releasing
  std::vector<uint64_t> arena_addresses_;  // the trainer's, per arena; 0: not protected
  std::set<std::pair<dev_t, ino_t>> arena_inodes_;
  ArenaBudget* arena_budget_ = nullptr;  // given back what was charged when the session goes
  size_t charged_arenas_ = 0;
  uint64_t charged_bytes_ = 0;
  std::vector<std::shared_ptr<cuda::IpcMapping>> gpu_mappings_;  // kept open for the session
  // The trainer's, for GPU tensors: ticket t's copy waits for t % size() (TrainerSync).
  std::vector<std::unique_ptr<cuda::IpcEvent>> snapshot_events_;
  static constexpr int kMaxSnapshotEvents = 64;
  std::vector<RegisteredTensor> tensors_;  // guarded by data_mu_ once started
  std::unique_ptr<FrozenTensors> frozen_;  // guarded by data_mu_ once started
  std::function<uint32_t(const std::string&)> local_ranks_;  // Limits::local_ranks
  std::atomic<size_t> tensor_count_{0};
  std::atomic<uint64_t> registered_bytes_{0};
  shm::SealedSegmentPtr control_;
  shm::ControlBlock* control_block_ = nullptr;
  std::mutex ticket_mu_;  // SetTicketState from I/O threads and the command thread
  std::mutex rpc_mu_;     // RPC snapshots are a second producer: one at a time
  TimedMutex data_mu_;  // timed: an update waits a bounded time, then says busy
  std::unique_ptr<shm::CommandConsumer> consumer_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> ended_{false};
  std::atomic<bool> trainer_alive_{true};
  std::atomic<bool> refusing_{false};  // shutting down: new snapshots are rejected
  std::atomic<uint64_t> last_staged_step_{0};
  std::atomic<uint64_t> last_committed_step_{0};
  std::map<uint64_t, uint64_t> ticket_steps_;  // guarded by ticket_mu_
  ArenaDeposits* deposits_ = nullptr;
  uint64_t staging_bytes_ = 0;  // the daemon's whole staging budget: no payload is larger
  std::mutex restored_mu_;
  shm::SealedSegmentPtr restored_train_state_;  // guarded by restored_mu_
  std::chrono::steady_clock::time_point restored_at_;  // guarded by restored_mu_
  std::atomic<uint64_t> restored_bytes_{0};
};

using SessionPtr = std::shared_ptr<Session>;

}  // namespace ckpt::daemon
