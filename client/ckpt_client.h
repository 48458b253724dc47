// ckpt::Client: the trainer side of ckptd.
//
//   auto client = ckpt::Client::Connect({.socket = "/run/ckptd/ckptd.sock", .job = "llm",
//                                        .rank = 0, .world_size = 8});
//   ckpt::Tensor* w = *(*client)->AllocateTensor("layer0.weight", "F32", {4096, 4096});
//   (*client)->Register();
//   if (auto r = (*client)->Restore(); r.ok() && r->found) step = r->step;
//   ... train; every N steps:
//   uint64_t t = *(*client)->Snapshot(step, {{"loss", "1.23"}}, {{"rng", rng_bytes}});
//   (*client)->WaitStaged(t);      // before the next optimizer step mutates the buffers
//
// Snapshot() writes one command into a shared-memory ring and returns in microseconds;
// the daemon copies the registered buffers, then writes and commits in the background.
// Every call returns a status: when ckptd is absent or dies, training can carry on.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckptd::v1 {
class TensorSpec;
}  // namespace ckptd::v1

namespace ckpt {

// kAbandoned: this process stopped waiting for the snapshot because ckptd exited or stalled;
// ckptd never commits it.
enum class TicketState { kUnknown = 0, kPending, kStaged, kCommitted, kFailed, kRejected, kAbandoned };

const char* ToString(TicketState state);

struct TicketStatus {
  TicketState state = TicketState::kUnknown;
  std::string error;  // why, for failed and rejected tickets
};

// Flattened (row-major) element indices [begin, end) of a global tensor.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// A host tensor in shared memory that ckptd can read without a copy in the trainer.
struct Tensor {
  std::string name;
  std::string dtype;  // safetensors dtype: F32, BF16, I64, ...
  std::vector<int64_t> shape;
  void* data = nullptr;
  size_t nbytes = 0;
  // Placement in a global tensor sharded across ranks; empty when the tensor is whole.
  std::vector<int64_t> global_shape;
  std::vector<int64_t> global_offset;
  bool on_device = false;  // a GPU buffer registered with AddCudaTensor
  // Bytes after `data + nbytes`, in the same allocation, that the trainer may use and ckptd
  // neither copies nor restores (FSDP2 pads its shards to equal sizes).
  size_t spare_bytes = 0;
  // A flat shard (FSDP style): these ranges of the flattened global tensor, one after another
  // in this 1-D tensor. Then `global_shape` is set and `global_offset` empty.
  std::vector<ElementRange> flat_ranges;
  // The trainer no longer changes it (a frozen base model): ckptd copies it once and takes
  // later snapshots' bytes from its own copy, checking it every --frozen-check-every
  // snapshots. Set it before Register(), or with Freeze()/Thaw() after.
  bool frozen = false;
  // Updated a few rows at a time (an embedding with sparse gradients): with ckptd
  // --increments on, compared in chunks of about 1 KiB (at least a row). Set before Register().
  bool sparse = false;
};

// A tensor's piece in an FSDP-style flat parameter shard: elements `range` of the tensor
// (flattened, of shape `global_shape`), stored from element `at` of the shard on.
struct FlatPiece {
  std::string name;
  std::vector<int64_t> global_shape;
  ElementRange range;
  int64_t at = 0;
};

// A rank's shard of a flat parameter: `numel` elements at `data`, with the pieces in it, each
// registered as a tensor of its own.
struct FlatShard {
  void* data = nullptr;
  size_t numel = 0;
  std::vector<Tensor*> pieces;
};

using Metadata = std::map<std::string, std::string>;
// Opaque per-rank blobs: up to 256 KiB in all travel in the command ring, more as shared
// memory of their own (bounded by ckptd's staging budget).
using TrainState = std::map<std::string, std::string>;

struct RestoreInfo {
  // Where the bytes came from: ckptd's memory, this node's disk, the remote tier, or the
  // node's peers (rebuilt from the fragments they hold, --replication).
  enum class Source { kMemory, kDisk, kRemote, kPeer };

  bool found = false;  // false: no committed checkpoint yet (a fresh start)
  uint64_t step = 0;
  Source source = Source::kDisk;
  uint64_t bytes = 0;
  Metadata metadata;
  TrainState train_state;
  uint64_t tensors = 0;  // restored
  uint64_t skipped = 0;  // of this rank's tensors in the checkpoint, not restored
  // With RestoreOptions::allow_missing: selected tensors on one side only (at most 1000).
  std::vector<std::string> not_in_checkpoint;
  std::vector<std::string> not_registered;
  // Newer steps given up because some rank found them damaged; each names the step and why.
  std::vector<std::string> warnings;
  uint32_t saved_world_size = 0;  // the step's; another than the job's now: resharded
  // Nothing found: other jobs on this node this user may restore (a misspelt job name?).
  std::vector<std::string> other_jobs;
};

// "memory", "disk" or "remote".
const char* RestoreSourceName(RestoreInfo::Source source);

// What Restore() reads. Patterns are shell globs on tensor names (`*` matches dots too): a
// tensor is restored when no include is given or one matches, and no exclude matches; the
// other registered tensors keep their values. Train state always comes back.
struct RestoreOptions {
  std::optional<uint64_t> step;  // nullopt: the latest step every rank has (collective)
  std::vector<std::string> include;
  std::vector<std::string> exclude;
  // Selected tensors registered but not in the checkpoint (or the reverse) are skipped and
  // listed in RestoreInfo instead of failing the restore.
  bool allow_missing = false;
  // Floating-point tensors (F64, F32, F16, BF16) saved in another dtype than registered are
  // cast, rounding to nearest even as PyTorch does, instead of refused.
  bool cast = false;
};

// How GPU tensors reach ckptd. kIpc: ckptd maps them through CUDA IPC and copies them on
// its own streams (zero copies in the trainer). kHostCopy: where CUDA IPC is impossible
// (containers without a shared PID namespace), the trainer copies them into host mirrors on
// a side stream and ckptd stages the mirrors. $CKPTD_CUDA_TRANSPORT=host-copy selects it too.
enum class CudaTransport { kIpc, kHostCopy };

struct ClientOptions {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string job;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // Small tensors share arenas that grow from 1 MiB, doubling, up to this; a tensor larger
  // than half the next one gets an arena of its own, of its size.
  size_t arena_bytes = 64u << 20;
  // Arenas of 32 MiB and more go in huge pages while the pool (vm.nr_hugepages) has room:
  // allocating, registering and snapshotting them costs far less CPU (docs/operators.md).
  bool huge_pages = true;
  // Copy-on-write snapshots of arenas in huge pages: ckptd write-protects them and releases
  // the trainer at once, then copies; a write to a part not copied yet waits for that part.
  // Needs userfaultfd (root, CAP_SYS_PTRACE, access to /dev/userfaultfd, or
  // vm.unprivileged_userfaultfd=1), and tensors that no device writes by DMA; otherwise
  // ckptd copies before releasing. Off by default: on the hosts measured so far the copy
  // then competes with the optimizer step for memory bandwidth and the step is held about
  // as long (docs/benchmarks.md).
  bool copy_on_write = false;
  std::chrono::milliseconds rpc_timeout{30000};
  std::chrono::milliseconds daemon_dead_after{3000};  // no heartbeat for this long: dead
  // After ckptd exited (a restart, a crash), Snapshot() registers again with whatever ckptd
  // listens on the socket, at most this often and waiting at most `reconnect_timeout` for
  // its answer (a ckptd that is not there fails at once); 0 turns it off. A ckptd that only
  // stalled keeps the session, which works again when it resumes.
  std::chrono::milliseconds reconnect_every{5000};
  std::chrono::milliseconds reconnect_timeout{2000};
  CudaTransport cuda_transport = CudaTransport::kIpc;
  uint32_t keep_last = 0;  // this job keeps its newest K checkpoints; 0: ckptd's --keep-last
  // Which of this job's committed steps ckptd copies to its remote tier (ckptd --remote):
  // steps whose number is a multiple of `every_steps`, and of those the first of each
  // `interval_seconds` window (0: all). nullopt: ckptd's --upload-every-steps and
  // --upload-interval. Every rank gives the same (one that differs from the job's live
  // ranks on the node is refused).
  struct UploadPolicy {
    uint32_t every_steps = 1;
    double interval_seconds = 0;
  };
  std::optional<UploadPolicy> upload;
};

class Client {
 public:
  // Connects to ckptd; Unavailable with the socket path in the message if it is not there.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Allocates a zeroed host tensor in shared memory. After Register() it is registered by
  // the next Update(), replacing the tensor of the same name if there is one (whose record
  // stays valid, but is no longer checkpointed).
  absl::StatusOr<Tensor*> AllocateTensor(const std::string& name, const std::string& dtype,
                                         const std::vector<int64_t>& shape,
                                         const std::vector<int64_t>& global_shape = {},
                                         const std::vector<int64_t>& global_offset = {},
                                         size_t spare_bytes = 0);

  // Allocates a 1-D tensor holding `ranges` of the flattened tensor of `global_shape` one
  // after another (a flat shard: ascending, disjoint ranges). Restores fill it from any
  // saved placement of that tensor, and any placement restores from it.
  absl::StatusOr<Tensor*> AllocateFlatTensor(const std::string& name, const std::string& dtype,
                                             const std::vector<int64_t>& global_shape,
                                             const std::vector<ElementRange>& ranges);

  // Allocates a rank's shard of an FSDP-style flat parameter: one buffer of `numel` elements
  // of `dtype` in which each piece sits at its own place, so a shard holding the end of one
  // tensor and the start of the next (and the padding FSDP puts between and after them) is
  // the one contiguous buffer the trainer needs. Elements no piece covers are not
  // checkpointed. InvalidArgument naming the piece that leaves the shard or overlaps another.
  absl::StatusOr<FlatShard> AllocateFlatShard(const std::string& dtype, int64_t numel,
                                              const std::vector<FlatPiece>& pieces);

  // Adds an existing GPU buffer (allocated with cudaMalloc or PyTorch's default caching
  // allocator) that ckptd will map through CUDA IPC. Only before Register(). Fails at once,
  // naming the tensor, for memory CUDA IPC cannot share (expandable segments,
  // cudaMallocAsync pools) or when CUDA is unusable in this process.
  absl::StatusOr<Tensor*> AddCudaTensor(const std::string& name, const std::string& dtype,
                                        const std::vector<int64_t>& shape, void* device_ptr,
                                        const std::vector<int64_t>& global_shape = {},
                                        const std::vector<int64_t>& global_offset = {});

  // Registers every allocated tensor with the daemon and opens the session.
  absl::Status Register();

  // After Register(): stops checkpointing `name` at the next Update().
  absl::Status RemoveTensor(const std::string& name);
  // Marks a tensor frozen (Tensor::frozen) or ordinary again; after Register() it takes
  // effect at the next Update(), which maps nothing again. A thawed tensor is copied at every
  // snapshot from the next one on; a tensor frozen (again) is copied at the next snapshot,
  // then taken from ckptd's copy: Thaw() then Freeze() after changing a frozen tensor.
  // Marks an allocated tensor sparse (Tensor::sparse) before it is registered: by
  // Register(), or by Update() for one added since. FailedPrecondition once it is.
  absl::Status MarkSparse(const std::string& name);
  absl::Status Freeze(const std::string& name) { return SetFrozen(name, true); }
  absl::Status Thaw(const std::string& name) { return SetFrozen(name, false); }
  // Sends what changed since Register() (or the last Update()): tensors allocated since,
  // including replacements (an embedding table that grew), and removals. Every other
  // tensor stays registered and mapped, so this costs only what changed. Call it between
  // snapshots; all or nothing. GPU tensors cannot be added this way (register again).
  absl::Status Update();

  // Queues a snapshot of every registered tensor plus `train_state`; returns a ticket in
  // microseconds. Do not mutate the tensors until WaitStaged(ticket) returns. With GPU
  // tensors a CPU more than TrainerSync::kSnapshotEvents (8) snapshots ahead of ckptd waits
  // here, up to 60 s, until ckptd has taken the oldest of them (cuda/trainer_sync.h says why).
  absl::StatusOr<uint64_t> Snapshot(uint64_t step, const Metadata& metadata = {},
                                    const TrainState& train_state = {});

  TicketStatus Poll(uint64_t ticket) const;

  // Gives up on every snapshot not yet staged (call it before changing the tensors without
  // WaitStaged having returned staged, e.g. after a timeout): ckptd then never commits them.
  // The waits do it themselves when ckptd exits or stalls. Returns how many.
  int AbandonPending();

  // GPU tensors only. Snapshots are taken at a point of `stream` (a cudaStream_t; by
  // default the legacy default stream): Snapshot() records an event there and ckptd's copy
  // waits for it on the device, so the CPU never waits.
  void SetCudaStream(void* stream);
  // Makes `stream` wait on the device until `ticket` is staged (or failed): the CPU goes on
  // launching kernels; only work queued after this on `stream` waits. If ckptd dies, the
  // wait is released (the client's watchdog) rather than hanging the GPU.
  absl::Status StreamWaitStaged(uint64_t ticket, void* stream);
  // Until the snapshot is staged (or failed/rejected): the tensors may be mutated again.
  absl::StatusOr<TicketStatus> WaitStaged(uint64_t ticket,
                                          std::chrono::milliseconds timeout = std::chrono::minutes(10));
  // Until the checkpoint is durable on storage for every rank (or failed).
  absl::StatusOr<TicketStatus> WaitCommitted(uint64_t ticket,
                                             std::chrono::milliseconds timeout = std::chrono::minutes(30));

  // Restores the latest committed checkpoint (or `step`) into the registered tensors.
  absl::StatusOr<RestoreInfo> Restore(std::optional<uint64_t> step = std::nullopt);
  // Restores only the selected tensors (e.g. exclude {"optim.*"}: the weights of a full
  // checkpoint for fine-tuning).
  absl::StatusOr<RestoreInfo> Restore(const RestoreOptions& options);

  // Saving by time: whether the job saves at `step`, saving every `interval`. Every rank of
  // the job gets the same answer for a step (ckptd decides on one clock, the group's
  // coordinator's across nodes), so ask for every step rather than reading a local clock.
  // `run` is the step this run resumed from (0 on a fresh start). Costs one local call.
  absl::StatusOr<bool> ShouldSave(uint64_t step, std::chrono::milliseconds interval,
                                  uint64_t run = 0);

  absl::Status Unregister();

  const std::vector<std::unique_ptr<Tensor>>& tensors() const { return tensors_; }
  const std::string& session_id() const { return session_id_; }
  // What the job held on this node when it last registered: its committed steps in the
  // job's order (the 16 newest, newest last) and how many there were in all. A trainer
  // that saves without having restored warns when there are some (docs/users.md).
  const std::vector<uint64_t>& committed_steps() const { return committed_steps_; }
  uint64_t committed_count() const { return committed_count_; }

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  Tensor* AddRecord(Tensor tensor);
  absl::Status SetFrozen(const std::string& name, bool frozen);
  void FillSpec(const Tensor& tensor, ::ckptd::v1::TensorSpec* spec) const;
  absl::StatusOr<void*> AllocateInArena(size_t bytes);

  // After `down` (ckptd unavailable): Ok once registered with a ckptd that replaced an
  // exited one; `down` (or why registering failed) otherwise.
  absl::Status RegisterAgainIfDaemonRestarted(const absl::Status& down);
  // Why there is no session: never registered, or its ckptd exited (Unavailable).
  absl::Status NoSession(const char* what) const;
  // Waits until the snapshot event of ticket `ticket` may be recorded again (GPU tensors).
  absl::Status WaitSnapshotEventFree(uint64_t ticket);
  static constexpr std::chrono::milliseconds kSnapshotEventWait{60'000};

  std::unique_ptr<Impl> impl_;
  std::vector<std::unique_ptr<Tensor>> tensors_;
  std::string session_id_;
  std::vector<uint64_t> committed_steps_;
  uint64_t committed_count_ = 0;
};

}  // namespace ckpt
