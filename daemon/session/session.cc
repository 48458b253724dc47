#include "daemon/session/session.h"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <random>
#include <cstring>
#include <optional>
#include <set>

#include "common/log.h"
#include "common/names.h"
#include "common/status.h"
#include "common/dtype.h"
#include "format/manifest.h"
#include "daemon/metrics/daemon_metrics.h"
#include "shm/futex.h"
#include "shm/payload_segment.h"
#include "shm/prefault.h"

namespace ckpt::daemon {
namespace {

// Bytes of trainers' payloads being copied out and decoded now, in every session of the
// process: held in ckptd's heap outside the staging pool, so bounded by its size.
struct PayloadsInDecode {
  static inline std::atomic<uint64_t> bytes{0};
  class Slot {
   public:
    bool Take(uint64_t n, uint64_t limit) {
      uint64_t now = bytes.load();
      do {
        if (now + n > limit) return false;
      } while (!bytes.compare_exchange_weak(now, now + n));
      taken_ = n;
      return true;
    }
    ~Slot() { bytes -= taken_; }

   private:
    uint64_t taken_ = 0;
  };
};

spdlog::logger& Log() { return log::Get(log::Component::kSession); }

// The payload `trainer` handed over under `token` (a kCommandSnapshotDeposited command),
// holding `slot` for its size until the caller has staged it.
absl::StatusOr<shm::SnapshotPayload> RedeemPayload(ArenaDeposits* deposits, const PeerIdentity& trainer,
                                                   uint64_t staging_bytes, const std::string& token,
                                                   PayloadsInDecode::Slot& slot) {
  if (deposits == nullptr) {
    return absl::FailedPreconditionError("this ckptd takes no snapshot payloads handed over as memory");
  }
  // Only this session's trainer can have deposited it (the kernel's word on who it was).
  CKPT_ASSIGN_OR_RETURN(std::vector<UniqueFd> fds,
                        deposits->Take(token, trainer, ArenaDeposits::Kind::kPayload));
  struct stat st {};
  if (::fstat(fds[0].get(), &st) != 0) return ErrnoStatus(errno, "the snapshot payload's memfd");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  // Checked before a byte is copied: decoding holds the payload in ckptd's heap until it
  // is staged, and staging could never take more than the whole budget anyway.
  if (size > staging_bytes) {
    return absl::ResourceExhaustedError(fmt::format(
        "the snapshot's metadata and train state take {} bytes, more than ckptd's whole staging "
        "budget ({} bytes, --staging-bytes): keep large state in registered tensors, or give "
        "ckptd a larger budget",
        size, staging_bytes));
  }
  // And every session's payloads being decoded and staged at once are bounded by it too.
  if (!slot.Take(size, staging_bytes)) {
    return absl::ResourceExhaustedError(fmt::format(
        "ckptd is decoding other large train states ({} bytes of --staging-bytes {}); this "
        "snapshot's {} bytes were not taken",
        PayloadsInDecode::bytes.load(), staging_bytes, size));
  }
  return shm::DecodeMemfd(fds[0].get(), size);
}

std::string RandomId() {
  std::random_device rd;
  std::uniform_int_distribution<uint64_t> dist;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd());
  return fmt::format("{:016x}{:016x}", dist(gen), dist(gen));
}

absl::Status ValidatePlacement(const ::ckptd::v1::TensorSpec& t) {
  if (t.global_shape_size() == 0 && t.global_offset_size() == 0 && t.flat_ranges_size() == 0) {
    return absl::OkStatus();  // the whole tensor
  }
  if (t.flat_ranges_size() > 0) {
    // FSDP needs one range per piece; the bound keeps the manifest (read back whole) small.
    constexpr int kMaxFlatRanges = 1024;
    if (t.flat_ranges_size() > kMaxFlatRanges) {
      return absl::InvalidArgumentError(fmt::format(
          "tensor {}: {} flat element ranges; at most {} per tensor", t.name(), t.flat_ranges_size(),
          kMaxFlatRanges));
    }
    if (t.global_shape_size() == 0 || t.global_offset_size() != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "tensor {}: flat element ranges need the global shape and no global offset", t.name()));
    }
  }
  // The same check as every manifest's pieces get (format::CheckPlacement).
  format::TensorShard piece;
  piece.shape.assign(t.shape().begin(), t.shape().end());
  piece.offset.assign(t.global_offset().begin(), t.global_offset().end());
  for (const auto& r : t.flat_ranges()) piece.flat.push_back({r.begin(), r.end()});
  std::vector<int64_t> global(t.global_shape().begin(), t.global_shape().end());
  if (absl::Status placed = format::CheckPlacement(piece, global); !placed.ok()) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: the piece {} (global shape [{}])",
                                                  t.name(), std::string(placed.message()), fmt::join(global, ", ")));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> OpenPidfd(int32_t pid) {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return ErrnoStatus(errno, fmt::format("pidfd_open({})", pid));
  return UniqueFd(fd);
}

}  // namespace

absl::StatusOr<SessionPtr> Session::Create(const ::ckptd::v1::RegisterRequest& req, const Limits& limits,
                                           const PeerIdentity& caller,
                                           std::vector<UniqueFd> arenas,
                                           UniqueFd write_protect) {
  CKPT_RETURN_IF_ERROR(ValidateJobName(req.job()));
  if (req.world_size() < 1 || req.world_size() > 1'000'000) {
    return absl::InvalidArgumentError(fmt::format("world size {} is out of range", req.world_size()));
  }
  if (req.rank() >= req.world_size()) {
    return absl::InvalidArgumentError(
        fmt::format("rank {} is not below world size {}", req.rank(), req.world_size()));
  }
  if (req.tensors_size() == 0) return absl::InvalidArgumentError("no tensors to register");
  if (const double t = req.upload().interval_seconds(); !(t >= 0 && t <= 365.0 * 86400)) {
    return absl::InvalidArgumentError(fmt::format(
        "upload interval {} s is out of range (0, for every step on the grid, to a year)", t));
  }
  if (caller.pid <= 0) {
    return absl::InvalidArgumentError(
        "the caller's pid is unknown (it is in another PID namespace: run the trainer and ckptd "
        "in one, e.g. Kubernetes shareProcessNamespace)");
  }

  SessionPtr s(new Session());
  s->id_ = RandomId();
  s->job_ = req.job();
  s->rank_ = req.rank();
  s->world_size_ = req.world_size();
  // Who the kernel says connected, never what the request says.
  s->pid_ = caller.pid;
  s->uid_ = caller.uid;
  s->deposits_ = limits.deposits;
  s->staging_bytes_ = limits.staging_bytes;
  auto pidfd = OpenPidfd(caller.pid);
  if (!pidfd.ok()) {
    // The caller is gone already (its pid is visible: the kernel translated it into ours):
    // a session nobody could end would hold memory and a thread for ever.
    return absl::FailedPreconditionError(fmt::format(
        "trainer pid {} cannot be watched ({}); it exited while registering?", caller.pid,
        Message(pidfd.status())));
  }
  s->pidfd_ = std::move(*pidfd);
  s->arenas_.resize(arenas.size());
  if (write_protect.valid()) {
    // Copy-on-write is a speed-up: without it snapshots copy before releasing the trainer.
    auto protector = WriteProtector::Create(std::move(write_protect));
    if (protector.ok()) {
      s->write_protect_ = std::make_unique<WriteProtector>(std::move(*protector));
    } else {
      Log().warn("[{}/r{}] copy-on-write snapshots off: {}", s->job_, s->rank_,
                 Message(protector.status()));
    }
  }
  CKPT_RETURN_IF_ERROR(s->NoteArenaAddresses(req.arena_addresses(), 0, arenas.size()));

  std::set<std::string> names;
  for (const ::ckptd::v1::TensorSpec& t : req.tensors()) {
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(fmt::format("tensor {} is registered twice", t.name()));
    }
    CKPT_ASSIGN_OR_RETURN(RegisteredTensor rt, s->BuildTensor(t, limits, arenas, 0));
    s->registered_bytes_ += rt.nbytes;
    s->tensors_.push_back(std::move(rt));
  }
  if (!s->gpu_mappings_.empty()) {
    if (req.cuda_event_handles_size() == 0 || req.cuda_event_handles_size() > kMaxSnapshotEvents) {
      return absl::InvalidArgumentError(fmt::format(
          "GPU tensors need 1 to {} snapshot events, but the registration names {}", kMaxSnapshotEvents,
          req.cuda_event_handles_size()));
    }
    for (const std::string& handle : req.cuda_event_handles()) {
      auto event = cuda::IpcEvent::Open(handle, s->gpu_mappings_.front()->device());
      if (!event.ok()) return Annotate(event.status(), "snapshot event");
      s->snapshot_events_.push_back(std::move(*event));
    }
  }
  if (s->registered_bytes_ > limits.staging_bytes) {
    return absl::FailedPreconditionError(fmt::format(
        "rank {} registers {} bytes but the staging budget (--staging-bytes) is {} bytes",
        req.rank(), s->registered_bytes_.load(), limits.staging_bytes));
  }
  s->frozen_ = std::make_unique<FrozenTensors>(limits.frozen_check_every);
  s->local_ranks_ = limits.local_ranks;
  s->frozen_->Registered(s->tensors_, {});

  // Sealed and nameless: handed to the trainer as a descriptor (ControlFdServer), so the
  // trainer can map it read-write but never shrink it under the daemon.
  CKPT_ASSIGN_OR_RETURN(s->control_, shm::SealedSegment::Create(
                                         fmt::format("ckptd-ctl.{}", s->id_), shm::kControlBlockBytes));
  shm::InitializeControlBlock(s->control_->data(), ::getpid(), req.pid());
  s->control_block_ = static_cast<shm::ControlBlock*>(s->control_->data());
  s->consumer_ = std::make_unique<shm::CommandConsumer>(s->control_block_);
  s->tensor_count_ = s->tensors_.size();
  if (s->write_protect_) {
    uint64_t protected_bytes = 0;
    for (const RegisteredTensor& t : s->tensors_) protected_bytes += t.trainer_address != 0 ? t.nbytes : 0;
    Log().info("[{}/r{}] copy-on-write snapshots for {} of {} bytes", s->job_, s->rank_,
               protected_bytes, s->registered_bytes_.load());
  }
  return s;
}

absl::Status Session::NoteArenaAddresses(const google::protobuf::RepeatedField<uint64_t>& addresses,
                                         size_t first, size_t handed) {
  if (!addresses.empty() && static_cast<size_t>(addresses.size()) != handed) {
    return absl::InvalidArgumentError(fmt::format(
        "{} arena addresses for {} arenas handed over", addresses.size(), handed));
  }
  arena_addresses_.resize(first + handed, 0);
  for (int i = 0; i < addresses.size(); ++i) arena_addresses_[first + i] = addresses[i];
  return absl::OkStatus();
}

absl::Status Session::ProtectArena(size_t index, const shm::SealedSegment& mapped) {
  const uint64_t address = std::exchange(arena_addresses_[index], 0);  // 0 until registered
  if (!write_protect_ || address == 0) return absl::OkStatus();
  // In 4 KiB pages, write-protection costs the trainer more than the copy it saves.
  if (!mapped.huge()) return absl::FailedPreconditionError("not in huge pages");
  struct stat st;
  if (::fstat(mapped.fd(), &st) != 0) return ErrnoStatus(errno, "fstat arena");
  if (!WriteProtector::MapsArena(pid_, address, mapped.size(), st.st_ino)) {
    return absl::InvalidArgumentError(fmt::format(
        "the trainer does not map it at {:#x} (its /proc/{}/maps says otherwise)", address, pid_));
  }
  CKPT_RETURN_IF_ERROR(write_protect_->Register(address, mapped.size()));
  arena_addresses_[index] = address;
  return absl::OkStatus();
}

absl::StatusOr<RegisteredTensor> Session::BuildTensor(const ::ckptd::v1::TensorSpec& t,
                                                      const Limits& limits,
                                                      std::vector<UniqueFd>& handed,
                                                      size_t first_handed) {
  CKPT_RETURN_IF_ERROR(ValidateTensorName(t.name()));
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  CKPT_RETURN_IF_ERROR(CheckTensorBytes(t.name(), t.dtype(), shape, t.nbytes()));
  CKPT_RETURN_IF_ERROR(ValidatePlacement(t));
  RegisteredTensor rt;
  rt.name = t.name();
  rt.dtype = t.dtype();
  rt.shape = std::move(shape);
  rt.nbytes = t.nbytes();
  rt.frozen = t.frozen();
  rt.sparse = t.sparse();
  rt.placement.global_shape.assign(t.global_shape().begin(), t.global_shape().end());
  rt.placement.offset.assign(t.global_offset().begin(), t.global_offset().end());
  for (const auto& r : t.flat_ranges()) rt.placement.flat.push_back({r.begin(), r.end()});
  if (t.has_cuda()) {
    CKPT_RETURN_IF_ERROR(AddGpuTensor(t, limits, rt));
    return rt;
  }
  if (t.arena() >= arenas_.size()) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: arena {} was not handed over (this session has {})", t.name(), t.arena(),
        arenas_.size()));
  }
  shm::SealedSegmentPtr& arena = arenas_[t.arena()];
  if (!arena) {
    if (t.arena() < first_handed) {
      // Arenas are mapped when a tensor first lives there; the others were closed.
      return absl::InvalidArgumentError(fmt::format(
          "tensor {}: arena {} held no tensor when it was handed over and is closed; hand it "
          "over again",
          t.name(), t.arena()));
    }
    UniqueFd& fd = handed[t.arena() - first_handed];
    CKPT_RETURN_IF_ERROR(Annotate(ChargeArena(fd.get(), limits),
                                  fmt::format("tensor {} (arena {})", t.name(), t.arena())));
    auto mapped = shm::SealedSegment::Map(std::move(fd));
    if (!mapped.ok()) {
      return Annotate(mapped.status(), fmt::format("tensor {} (arena {})", t.name(), t.arena()));
    }
    // Fault the whole mapping in now, writable: snapshots and restores then copy at
    // memory speed instead of taking a page fault every 4 KiB.
    if (!shm::PrefaultWritable((*mapped)->data(), (*mapped)->size())) {
      return absl::FailedPreconditionError(fmt::format(
          "tensor {}: arena {} could not be faulted in", t.name(), t.arena()));
    }
    if (absl::Status wp = ProtectArena(t.arena(), **mapped); !wp.ok()) {
      Log().warn("[{}/r{}] arena {} is copied at snapshots, not copy-on-write: {}", job_, rank_,
                 t.arena(), Message(wp));
    }
    (*mapped)->DropFd();
    arena = std::move(*mapped);
  }
  if (t.offset() > arena->size() || t.nbytes() > arena->size() - t.offset()) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: bytes [{}, {}) lie outside arena {} ({} bytes)", t.name(), t.offset(),
        t.offset() + t.nbytes(), t.arena(), arena->size()));
  }
  rt.data = static_cast<char*>(arena->data()) + t.offset();
  if (arena_addresses_[t.arena()] != 0) rt.trainer_address = arena_addresses_[t.arena()] + t.offset();
  return rt;
}

absl::StatusOr<uint64_t> Session::Update(const ::ckptd::v1::UpdateRequest& req, const Limits& limits,
                                         std::vector<UniqueFd> arenas) {
  if (req.tensors_size() == 0 && req.removed_size() == 0 && req.freeze_size() == 0 && req.thaw_size() == 0) {
    return absl::InvalidArgumentError("the update changes nothing (no tensors, none removed, frozen or thawed)");
  }
  // A snapshot being staged reads the tensors: wait for it (briefly: a restore may hold the
  // session for minutes at its barrier, and a waiting update holds a server thread); the
  // next snapshot sees the update.
  std::unique_lock lock(data_mu_, std::defer_lock);
  if (!lock.try_lock_for(kUpdateWait)) {
    return absl::AbortedError(fmt::format(
        "session {} is busy with a snapshot or restore; update again when it is done", id_));
  }
  if (req.first_arena() != arenas_.size()) {
    // Arenas are numbered by the order they were handed over: both sides must count alike
    // (an update applied here whose reply the client never saw would shift every index).
    return absl::FailedPreconditionError(fmt::format(
        "this update numbers its arenas from {}, but the session has {}; register again",
        req.first_arena(), arenas_.size()));
  }
  if (arenas_.size() + arenas.size() > kMaxSessionArenas) {
    return absl::ResourceExhaustedError(fmt::format(
        "{} arenas would be handed to this session; at most {}", arenas_.size() + arenas.size(),
        kMaxSessionArenas));
  }
  // All or nothing: what this update maps and charges is undone if any of it is refused.
  const size_t arenas_before = arenas_.size(), gpu_before = gpu_mappings_.size();
  CKPT_RETURN_IF_ERROR(NoteArenaAddresses(req.arena_addresses(), arenas_before, arenas.size()));
  const std::set<std::pair<dev_t, ino_t>> inodes_before = arena_inodes_;
  const size_t charged_arenas_before = charged_arenas_;
  const uint64_t charged_bytes_before = charged_bytes_;
  auto undo = [&] {
    arenas_.resize(arenas_before);
    arena_addresses_.resize(arenas_before);
    gpu_mappings_.resize(gpu_before);
    arena_inodes_ = inodes_before;
    if (arena_budget_ != nullptr) {
      arena_budget_->Give(uid_, charged_arenas_ - charged_arenas_before,
                          charged_bytes_ - charged_bytes_before);
    }
    charged_arenas_ = charged_arenas_before;
    charged_bytes_ = charged_bytes_before;
  };
  absl::StatusOr<std::vector<RegisteredTensor>> updated = Updated(req, limits, arenas, arenas_before);
  if (!updated.ok()) {
    undo();
    return updated.status();
  }
  uint64_t bytes = 0;
  for (const RegisteredTensor& t : *updated) bytes += t.nbytes;
  if (bytes > limits.staging_bytes) {
    undo();
    return absl::FailedPreconditionError(fmt::format(
        "rank {} would register {} bytes but the staging budget (--staging-bytes) is {} bytes",
        rank_, bytes, limits.staging_bytes));
  }
  tensors_ = std::move(*updated);
  // A tensor given anew, or frozen (again: it may have changed while thawed, or in place),
  // has bytes ckptd does not know: the next snapshot copies it from the trainer.
  std::set<std::string> replaced(req.freeze().begin(), req.freeze().end());
  for (const ::ckptd::v1::TensorSpec& t : req.tensors()) replaced.insert(t.name());
  frozen_->Registered(tensors_, replaced);
  registered_bytes_ = bytes;
  tensor_count_ = tensors_.size();
  return bytes;
}

absl::StatusOr<std::vector<RegisteredTensor>> Session::Updated(const ::ckptd::v1::UpdateRequest& req,
                                                               const Limits& limits,
                                                               std::vector<UniqueFd>& arenas,
                                                               size_t first_handed) {
  arenas_.resize(first_handed + arenas.size());
  std::vector<RegisteredTensor> out = tensors_;
  std::set<std::string> named;
  for (const std::string& name : req.removed()) {
    if (!named.insert(name).second) {
      return absl::InvalidArgumentError(fmt::format("tensor {} is named twice in the update", name));
    }
    auto it = std::find_if(out.begin(), out.end(), [&](const RegisteredTensor& t) { return t.name == name; });
    if (it == out.end()) {
      return absl::InvalidArgumentError(fmt::format("tensor {} cannot be removed: it is not registered", name));
    }
    out.erase(it);
  }
  for (const ::ckptd::v1::TensorSpec& t : req.tensors()) {
    if (!named.insert(t.name()).second) {
      return absl::InvalidArgumentError(fmt::format("tensor {} is named twice in the update", t.name()));
    }
    if (t.has_cuda() && snapshot_events_.empty()) {
      return absl::FailedPreconditionError(fmt::format(
          "tensor {} is on a GPU, but this session registered none (and so no snapshot event): "
          "register again",
          t.name()));
    }
    CKPT_ASSIGN_OR_RETURN(RegisteredTensor rt, BuildTensor(t, limits, arenas, first_handed));
    auto it = std::find_if(out.begin(), out.end(), [&](const RegisteredTensor& x) { return x.name == t.name(); });
    if (it != out.end()) {
      *it = std::move(rt);  // replaced where it was: the shard keeps its order
    } else {
      out.push_back(std::move(rt));
    }
  }
  // Frozen or thawed: only the flag changes (a tensor given anew above takes its spec's).
  std::set<std::string> flagged;
  for (const auto* names : {&req.freeze(), &req.thaw()}) {
    const bool frozen = names == &req.freeze();
    for (const std::string& name : *names) {
      if (!flagged.insert(name).second) {
        return absl::InvalidArgumentError(fmt::format("tensor {} is frozen or thawed twice in the update", name));
      }
      auto it = std::find_if(out.begin(), out.end(), [&](const RegisteredTensor& t) { return t.name == name; });
      if (it == out.end()) {
        return absl::InvalidArgumentError(fmt::format("tensor {} cannot be {}: it is not registered", name,
                                                      frozen ? "frozen" : "thawed"));
      }
      it->frozen = frozen;
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("the update would leave no tensor registered");
  if (out.size() > kMaxSessionTensors) {
    return absl::ResourceExhaustedError(fmt::format("the update would register {} tensors; at most {}",
                                                    out.size(), kMaxSessionTensors));
  }
  return out;
}

absl::Status Session::AddGpuTensor(const ::ckptd::v1::TensorSpec& t, const Limits& limits,
                                   RegisteredTensor& out) {
  if (!limits.cuda_ipc) {
    return absl::PermissionDeniedError(fmt::format(
        "tensor {}: this ckptd does not accept CUDA IPC handles (--cuda-ipc=false, a node "
        "shared by users who do not trust each other); register GPU tensors with the "
        "host-copy transport (CKPTD_CUDA_TRANSPORT=host-copy)",
        t.name()));
  }
  if (limits.gpu_memory == nullptr) {
    return absl::FailedPreconditionError(fmt::format(
        "tensor {} is on GPU {}, but this ckptd has no usable CUDA device ({})", t.name(),
        t.cuda().device_uuid(), limits.no_gpu_reason));
  }
  const auto& c = t.cuda();
  if (c.ipc_handle().size() != cuda::kIpcHandleBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: CUDA IPC handle of {} bytes, expected {}", t.name(), c.ipc_handle().size(),
        cuda::kIpcHandleBytes));
  }
  if (c.offset() > c.allocation_bytes() || t.nbytes() > c.allocation_bytes() - c.offset()) {
    return absl::InvalidArgumentError(fmt::format(
        "tensor {}: bytes [{}, {}) lie outside its CUDA allocation ({} bytes)", t.name(),
        c.offset(), c.offset() + t.nbytes(), c.allocation_bytes()));
  }
  cuda::DeviceBufferDescriptor d;
  std::memcpy(d.ipc_handle.data(), c.ipc_handle().data(), cuda::kIpcHandleBytes);
  d.offset = c.offset();
  d.allocation_bytes = c.allocation_bytes();
  d.device_uuid = c.device_uuid();
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<cuda::IpcMapping> mapping,
                        limits.gpu_memory->Acquire(d, t.name()));
  out.data = mapping->base() + c.offset();
  out.allocation = mapping->base();
  out.on_device = true;
  out.device = mapping->device();
  gpu_mappings_.push_back(std::move(mapping));
  return absl::OkStatus();
}

absl::Status Session::ChargeArena(int fd, const Limits& limits) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat arena");
  // The same memory twice would cost the daemon twice for memory the trainer pays once.
  if (!arena_inodes_.insert({st.st_dev, st.st_ino}).second) {
    return absl::InvalidArgumentError("the same shared memory was handed over twice");
  }
  if (limits.arena_budget != nullptr) {
    CKPT_RETURN_IF_ERROR(limits.arena_budget->Take(uid_, static_cast<uint64_t>(st.st_size)));
    arena_budget_ = limits.arena_budget;
    ++charged_arenas_;
    charged_bytes_ += static_cast<uint64_t>(st.st_size);
  }
  return absl::OkStatus();
}

Session::~Session() {
  if (arena_budget_ != nullptr) arena_budget_->Give(uid_, charged_arenas_, charged_bytes_);
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the loop has already returned
    } else {
      Stop();
    }
  }
}

void Session::Start(Stager& stager, SnapshotSink& persist, SessionEvents& events) {
  thread_ = std::thread([this, &stager, &persist, &events] {
    CommandLoop(stager, persist, events);
  });
}

void Session::Stop() {
  stop_ = true;
  if (consumer_) consumer_->Close();
  shm::FutexWakeAll(&control_block_->doorbell);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  ended_ = true;
}

bool Session::CheckTrainerAlive() {
  if (trainer_alive_ && !PollTrainerAlive()) trainer_alive_ = false;
  return trainer_alive_;
}

bool Session::PollTrainerAlive() {
  if (!pidfd_.valid()) return true;
  struct pollfd p = {pidfd_.get(), POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;  // readable once the process has exited
}

void Session::CommandLoop(Stager& stager, SnapshotSink& persist, SessionEvents& events) {
  while (!stop_) {
    consumer_->Heartbeat();
    if (!PollTrainerAlive()) {
      trainer_alive_ = false;
      Log().info("[{}/r{}] trainer pid {} exited; session ends", job_, rank_, pid_);
      break;
    }
    std::optional<shm::Command> command = consumer_->Next(std::chrono::milliseconds(100));
    if (consumer_->broken()) {
      Log().error("[{}/r{}] trainer pid {} corrupted its command ring (indices out of range); "
                  "session ends",
                  job_, rank_, pid_);
      events.SessionError(fmt::format("[{}/r{}] command ring corrupted by the trainer", job_, rank_));
      break;
    }
    if (!command) continue;
    uint64_t ticket = command->ticket;
    try {
      HandleSnapshot(std::move(*command), stager, persist, events);
    } catch (const std::exception& e) {
      // One session's bad input fails its own snapshot, never the daemon.
      Log().error("[{}/r{}] snapshot failed: {}", job_, rank_, e.what());
      SetTicketState(ticket, shm::kTicketFailed, fmt::format("internal error: {}", e.what()));
    }
    // Done with it, copied or not (the copy is synchronous): the trainer may record this
    // ticket's GPU snapshot event again. Its state says nothing of that: the persist
    // stage can fail a ticket while its copy still waits on the event.
    consumer_->MarkTaken(ticket);
  }
  consumer_->Close();
  ended_ = true;
}

void Session::HandleSnapshot(shm::Command command, Stager& stager, SnapshotSink& persist,
                             SessionEvents& events) {
  const auto taken = std::chrono::steady_clock::now();
  metrics::DaemonMetrics& metrics = metrics::Metrics();
  // A step this session already sent: refusing the repeat must not end the one in flight.
  const uint64_t last = last_staged_step_.load();
  const bool repeat = last != 0 && command.step <= last;
  // Every refusal is counted by outcome and, but for a daemon shutting down, by cause: the
  // trainer's own doing unless the staging budget said no. A refused rank ends its step (the
  // step can no longer complete: its other ranks' memory is freed at once, not held until
  // the step timeout), but for a step this session already sent (a repeat must not end the
  // one in flight) and at shutdown (every undecided step fails then).
  auto reject = [&](shm::TicketStateValue state, const std::string& why,
                    std::optional<metrics::Cause> cause = metrics::Cause::kTrainer, bool ends_step = true) {
    ends_step = ends_step && !repeat;
    metrics.snapshots.With({state == shm::kTicketRejected ? "rejected" : "failed"}).Add();
    if (cause) metrics.Fail(*cause);
    // The stager's messages already name the snapshot ("[job/r1 s260] snapshot: ..."):
    // said once, not twice.
    const std::string tag = fmt::format("[{}/r{} s{}]", job_, rank_, command.step);
    const bool tagged = why.rfind(tag, 0) == 0;
    Log().warn("{} snapshot {}: {}", tag, state == shm::kTicketRejected ? "rejected" : "failed",
               tagged ? why.substr(tag.size() + 1) : why);
    const std::string named = tagged ? why : fmt::format("{} {}", tag, why);
    events.SnapshotRejected(named);
    SetTicketState(command.ticket, state, why);
    if (ends_step) persist.Refused(job_, command.step, rank_, named);
  };
  if (!command.payload.ok()) return reject(shm::kTicketFailed, Message(command.payload.status()));
  PayloadsInDecode::Slot decoding;  // held until the payload is staged
  if (!command.deposit_token.empty()) {
    PeerIdentity trainer;
    trainer.pid = pid_;
    trainer.uid = uid_;
    command.payload = RedeemPayload(deposits_, trainer, staging_bytes_, command.deposit_token, decoding);
    if (!command.payload.ok()) {
      bool busy = absl::IsResourceExhausted(command.payload.status());
      return reject(busy ? shm::kTicketRejected : shm::kTicketFailed, Message(command.payload.status()),
                    busy ? metrics::Cause::kBudget : metrics::Cause::kTrainer);
    }
  }
  if (consumer_->Abandoned(command.ticket)) {
    // Queued before a stall; the trainer went on without it: its tensors are not what they
    // were at the snapshot, so nothing is copied.
    return reject(shm::kTicketFailed, "the trainer stopped waiting for this snapshot before ckptd took it");
  }
  if (refusing_) {
    return reject(shm::kTicketRejected,
                  "ckptd is shutting down: this snapshot was not taken (those already staged "
                  "are still written)",
                  std::nullopt, /*ends_step=*/false);
  }
  if (command.wait_client_copy != 0 &&
      !consumer_->WaitClientCopy(command.wait_client_copy, std::chrono::seconds(60))) {
    return reject(shm::kTicketFailed,
                  "the trainer's GPU-to-host copy for this snapshot did not finish within 60 s");
  }
  if (repeat) {
    return reject(shm::kTicketRejected,
                  fmt::format("step {} is not after this session's last snapshot (step {})",
                              command.step, last));
  }
  // The persist stage gets the snapshot as soon as it is laid out, so that writing starts
  // while the copy is still running (see Stager).
  auto submit = [&](const StagedSnapshotPtr& snap) {
    snap->sink = weak_from_this();
    snap->ticket = command.ticket;
    snap->session_started = started_;
    snap->session_started_unix_ns = started_unix_ns_;
    if (local_ranks_) snap->local_ranks = std::max<uint32_t>(local_ranks_(job_), 1);
    {
      std::lock_guard lock(ticket_mu_);
      ticket_steps_[command.ticket] = command.step;
      while (ticket_steps_.size() > shm::kTicketSlots) ticket_steps_.erase(ticket_steps_.begin());
    }
    last_staged_step_ = command.step;
    persist.Submit(snap);
  };
  absl::StatusOr<StagedSnapshotPtr> staged;
  {
    std::lock_guard lock(data_mu_);
    // The trainer may write from here: after the copy, or, for a copy-on-write snapshot,
    // before it. The step may already be committed by then (its writer finished the moment
    // the last byte landed); the ring keeps a decided ticket decided.
    auto release = [&] {
      if (!MarkStaged(command.ticket)) return false;
      metrics.snapshot_seconds.With({}).Observe(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - taken).count());
      return true;
    };
    staged = stager.Stage(view(command.ticket), command.step, std::move(*command.payload), submit, release);
    if (staged.ok()) frozen_->Staged(**staged);
  }
  if (!staged.ok()) {
    bool busy = absl::IsResourceExhausted(staged.status());
    return reject(busy ? shm::kTicketRejected : shm::kTicketFailed, Message(staged.status()),
                  busy ? metrics::Cause::kBudget : metrics::Cause::kTrainer);
  }
  for (const std::string& name : (*staged)->frozen_changed) {
    // Saved by this step all the same (a check copies from the trainer): said so that the
    // user learns a tensor registered frozen is not.
    Log().warn("[{}/r{} s{}] frozen tensor {} changed in place since the last check: saved, and copied at "
               "every snapshot from now on (freeze it again to stop)",
               job_, rank_, command.step, name);
    metrics.frozen_changes.With({}).Add();
  }
  metrics.frozen_shared_bytes.With({}).Add(static_cast<double>((*staged)->shared_bytes));
  events.SnapshotStaged(*staged, uid_);
  metrics.snapshots.With({"staged"}).Add();
  metrics.staging_seconds.With({}).Observe((*staged)->copy_seconds);
  metrics.staged_bytes.With({}).Add(static_cast<double>((*staged)->shard.data_bytes - (*staged)->shared_bytes));
  const uint64_t copied = (*staged)->shard.data_bytes - (*staged)->shared_bytes;
  Log().debug("[{}/r{} s{}] staged {} bytes ({} of frozen tensors shared with earlier snapshots); copy {:.1f} ms "
              "({:.2f} GB/s)",
              job_, rank_, command.step, (*staged)->shard.data_bytes, (*staged)->shared_bytes,
              (*staged)->copy_seconds * 1e3, copied / std::max((*staged)->copy_seconds, 1e-9) / 1e9);
}

void Session::SetRestoredTrainState(shm::SealedSegmentPtr state) {
  std::lock_guard lock(restored_mu_);
  restored_train_state_ = std::move(state);
  restored_at_ = std::chrono::steady_clock::now();
  restored_bytes_ = restored_train_state_ ? restored_train_state_->size() : 0;
}

shm::SealedSegmentPtr Session::TakeRestoredTrainState() {
  std::lock_guard lock(restored_mu_);
  restored_bytes_ = 0;
  return std::move(restored_train_state_);
}

void Session::Heartbeat() {
  consumer_->Heartbeat();
  // A restore's train state its trainer never fetched (it died, or lies) is not kept.
  std::lock_guard lock(restored_mu_);
  if (restored_train_state_ && std::chrono::steady_clock::now() - restored_at_ > kRestoredStateKept) {
    restored_train_state_.reset();
    restored_bytes_ = 0;
  }
}

absl::StatusOr<uint64_t> Session::PublishSnapshot(uint64_t step, const shm::SnapshotPayload& payload) {
  if (!snapshot_events_.empty()) {
    // The client picks ticket t's snapshot event before publishing; a ticket taken here
    // would shift every later one onto another event (cuda/trainer_sync.h).
    return absl::FailedPreconditionError(
        "a session with GPU tensors snapshots through its shared-memory ring (Client::Snapshot), "
        "not the Snapshot RPC");
  }
  std::lock_guard lock(rpc_mu_);
  return producer().PublishSnapshot(step, payload);
}

bool Session::MarkStaged(uint64_t ticket) {
  std::lock_guard lock(ticket_mu_);
  return consumer_->SetTicketState(ticket, shm::kTicketStaged);
}

void Session::SetTicketState(uint64_t ticket, shm::TicketStateValue state, std::string_view error) {
  std::lock_guard lock(ticket_mu_);
  if (state == shm::kTicketCommitted) {
    auto it = ticket_steps_.find(ticket);
    if (it != ticket_steps_.end() && it->second > last_committed_step_) {
      last_committed_step_ = it->second;
    }
  }
  consumer_->SetTicketState(ticket, state, error);
}

}  // namespace ckpt::daemon
