#include "client/ckpt_client.h"

#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "common/fd_passing.h"
#include "common/status.h"
#include "cuda/device_buffer.h"
#include "cuda/host_mirror.h"
#include "cuda/trainer_sync.h"
#include "common/dtype.h"
#include "proto/trainer.grpc.pb.h"
#include "shm/arena.h"
#include "shm/command_ring.h"
#include "shm/payload_segment.h"
#include "shm/sealed_segment.h"

namespace ckpt {
namespace {

// The session's control block is a sealed memfd the daemon hands over on its control
// socket to the process that registered the session, and to nobody else.
// The session's control block, and the read end of ckptd's liveness pipe (hangs up when
// ckptd exits; daemon/control/control_fd_server.h).
// It is fetched from "<socket>.ctl" beside the socket this client was given, as the arenas
// were handed over, never from the path in the reply: that is where ckptd sees it, which a
// trainer in another mount namespace (ckptd in a container, its socket directory a volume
// mounted elsewhere) may not reach.
absl::StatusOr<std::pair<shm::SealedSegmentPtr, UniqueFd>> FetchControlBlock(
    const std::string& socket, const ::ckptd::v1::RegisterReply& reply) {
  if (reply.control_socket().empty()) {
    return absl::FailedPreconditionError("ckptd gave no control socket: is it an older version?");
  }
  const std::string path = DescriptorSocketPath(socket);
  CKPT_ASSIGN_OR_RETURN(ReceivedFds got,
                        RequestFds(path, std::string(kFetchControlBlock) + reply.session_id(), 2));
  if (got.fds.size() != 2) {
    return absl::PermissionDeniedError(fmt::format(
        "ckptd did not hand over the control block: {}",
        got.payload.empty() ? std::string("no answer") : got.payload));
  }
  CKPT_ASSIGN_OR_RETURN(shm::SealedSegmentPtr block, shm::SealedSegment::Map(std::move(got.fds[0])));
  return std::make_pair(std::move(block), std::move(got.fds[1]));
}

// Hands the arenas to ckptd on its descriptor socket, at most kMaxPassedFds a message; the
// tokens it answers go into the Register request. Sealed memfds have no name: passing the
// descriptor is the only way another process, ckptd included, can map them.
// Hands arenas[first...] to ckptd's descriptor socket in batches; one token per batch.
absl::StatusOr<std::vector<std::string>> HandOverArenas(const std::string& socket,
                                                        const std::vector<shm::ArenaPtr>& arenas,
                                                        size_t first_arena) {
  std::vector<std::string> tokens;
  for (size_t first = first_arena; first < arenas.size(); first += kMaxPassedFds) {
    std::vector<int> fds;
    for (size_t i = first; i < std::min(arenas.size(), first + kMaxPassedFds); ++i) {
      fds.push_back(arenas[i]->fd());
    }
    const std::string path = DescriptorSocketPath(socket);
    CKPT_ASSIGN_OR_RETURN(ReceivedFds answer, RequestFds(path, kDepositArenas, 0, fds));
    std::string_view text = answer.payload;
    if (text.substr(0, kDepositAccepted.size()) != kDepositAccepted) {
      return absl::FailedPreconditionError(fmt::format(
          "ckptd did not take the arenas at {}: {}", path, text.empty() ? "no answer" : text));
    }
    tokens.emplace_back(text.substr(kDepositAccepted.size()));
  }
  return tokens;
}

constexpr std::chrono::milliseconds kDepositTimeout{2000};

// Hands a snapshot's payload that does not fit in a ring slot to ckptd as a sealed memfd;
// the token ckptd answered, for the kCommandSnapshotDeposited command.
absl::StatusOr<std::string> DepositPayload(const std::string& socket, const shm::SnapshotPayload& payload) {
  CKPT_ASSIGN_OR_RETURN(shm::SealedSegmentPtr segment, shm::EncodeToSegment(payload, "ckpt-payload"));
  const int fd = segment->fd();
  const std::string path = DescriptorSocketPath(socket);
  // On the training thread: a ckptd that stalled costs this save, not the step.
  CKPT_ASSIGN_OR_RETURN(ReceivedFds answer, RequestFds(path, kDepositPayload, 0, {&fd, 1}, kDepositTimeout));
  std::string_view text = answer.payload;
  if (text.substr(0, kDepositAccepted.size()) != kDepositAccepted) {
    return absl::FailedPreconditionError(fmt::format(
        "ckptd did not take the snapshot's train state at {}: {}", path,
        text.empty() ? "no answer" : text));
  }
  return std::string(text.substr(kDepositAccepted.size()));
}

// A restore's train state that ckptd kept in shared memory (RestoreReply.train_state_deposited).
absl::StatusOr<shm::SnapshotPayload> FetchTrainState(const std::string& socket,
                                                     const std::string& session_id) {
  const std::string path = DescriptorSocketPath(socket);
  CKPT_ASSIGN_OR_RETURN(ReceivedFds got, RequestFds(path, std::string(kFetchTrainState) + session_id, 1));
  if (got.fds.size() != 1) {
    return absl::FailedPreconditionError(fmt::format(
        "ckptd did not hand over the restored train state: {}",
        got.payload.empty() ? std::string("no answer") : got.payload));
  }
  CKPT_ASSIGN_OR_RETURN(shm::SealedSegmentPtr segment, shm::SealedSegment::Map(std::move(got.fds[0])));
  return shm::DecodeSegment(*segment);
}

// A userfaultfd for this process that also sees writes made by the kernel on the
// trainer's behalf (read(), recv() into a tensor): those would fail with EFAULT under a
// user-mode-only one, so none is used. Invalid where this process may not have one.
UniqueFd OpenUserfaultfd() {
  UniqueFd fd(static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC)));
  if (fd.valid()) return fd;
  // Linux 6.1+: an operator may grant the device to the trainers' group instead.
  UniqueFd device(::open("/dev/userfaultfd", O_RDWR | O_CLOEXEC));
  if (!device.valid()) return {};
  return UniqueFd(::ioctl(device.get(), USERFAULTFD_IOC_NEW, O_CLOEXEC));
}

// Hands this process's userfaultfd to ckptd for copy-on-write snapshots of `arenas`; the
// token for RegisterRequest.write_protect_token, or "" where that cannot be (ckptd then
// copies before releasing). This process keeps no copy of the descriptor: if ckptd dies,
// the kernel drops the protection and wakes any thread waiting on it.
std::string HandOverWriteProtect(const std::string& socket) {
  UniqueFd uffd = OpenUserfaultfd();
  if (!uffd.valid()) return "";
  int fd = uffd.get();
  absl::StatusOr<ReceivedFds> answer =
      RequestFds(DescriptorSocketPath(socket), kDepositWriteProtect, 0, {&fd, 1});
  if (!answer.ok() || answer->payload.substr(0, kDepositAccepted.size()) != kDepositAccepted) return "";
  return answer->payload.substr(kDepositAccepted.size());
}

// Where this process maps each of arenas[first...], for copy-on-write (0: not wanted).
void AddArenaAddresses(const std::vector<shm::ArenaPtr>& arenas, size_t first,
                       google::protobuf::RepeatedField<uint64_t>* out) {
  for (size_t i = first; i < arenas.size(); ++i) {
    out->Add(arenas[i]->huge() ? reinterpret_cast<uint64_t>(arenas[i]->at(0)) : 0);
  }
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& what, const std::string& socket) {
  if (s.ok()) return absl::OkStatus();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::UnavailableError(
        fmt::format("{}: cannot reach ckptd at {}: {}", what, socket, s.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      fmt::format("{}: {}", what, s.error_message()));
}

TicketStatus ToTicketStatus(const shm::TicketResult& r) {
  return {static_cast<TicketState>(r.state), r.error};
}

}  // namespace

const char* ToString(TicketState state) {
  switch (state) {
    case TicketState::kPending: return "pending";
    case TicketState::kStaged: return "staged";
    case TicketState::kCommitted: return "committed";
    case TicketState::kFailed: return "failed";
    case TicketState::kRejected: return "rejected";
    case TicketState::kAbandoned: return "abandoned";
    default: return "unknown";
  }
}

struct Client::Impl {
  ClientOptions options;
  std::map<const Tensor*, cuda::DeviceBufferDescriptor> gpu;  // for tensors on a device
  std::unique_ptr<cuda::TrainerSync> gpu_sync;  // created with the first GPU tensor
  std::unique_ptr<cuda::HostMirror> mirror;     // host-copy transport only
  std::map<const Tensor*, void*> mirror_of;     // GPU tensor -> its host mirror
  uint32_t copy_seq = 0;
  void* cuda_stream = nullptr;
  std::thread watchdog;            // releases GPU waiters if ckptd dies
  std::atomic<bool> stop_watchdog{false};

  ~Impl() { StopWatchdog(); }
  // Stops the watchdog and waits for it, if one runs: a std::thread destroyed or assigned to
  // while it runs ends the process (std::terminate). It never takes the GIL (nor anything a
  // caller holds), so joining it on a Python thread that holds the GIL is safe.
  void StopWatchdog() {
    stop_watchdog = true;
    if (watchdog.joinable()) watchdog.join();
    stop_watchdog = false;
  }
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<::ckptd::v1::Trainer::Stub> stub;
  std::vector<shm::ArenaPtr> arenas;
  size_t handed_arenas = 0;            // arenas[0, handed_arenas) are ckptd's already
  bool copy_on_write = false;          // ckptd took this process's userfaultfd
  shm::Arena* shared_arena = nullptr;  // where small tensors go; one of `arenas`
  // After Register(): what the next Update() sends.
  std::vector<const Tensor*> added;
  std::vector<std::string> removed;
  std::map<std::string, bool> frozen_changes;  // registered tensors frozen (true) or thawed since
  // Records replaced or removed after Register(): callers may still hold their pointers.
  std::vector<std::unique_ptr<Tensor>> retired;
  size_t arena_bytes_reserved = 0;     // by every arena so far
  shm::SealedSegmentPtr control;
  UniqueFd daemon_liveness;  // hangs up when the ckptd that holds our session exits
  std::unique_ptr<shm::CommandProducer> producer;
  std::mutex publish_mu;  // the ring has one producer
  bool mirrors_pinned = false;
  bool registered_once = false;  // Register() succeeded at least once
  // Re-registration after ckptd restarted (ClientOptions::reconnect_every).
  std::chrono::steady_clock::time_point next_reconnect{};
  std::chrono::milliseconds rpc_timeout_now{0};  // 0: options.rpc_timeout

  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    auto timeout = rpc_timeout_now.count() > 0 ? rpc_timeout_now : options.rpc_timeout;
    ctx->set_deadline(std::chrono::system_clock::now() + timeout);
    return ctx;
  }

  // Forgets the session of a ckptd that is gone (nothing is sent: nobody would answer).
  // Its pending snapshots are abandoned and GPU waits on it released first. The control
  // block and its producer stay mapped for the life of the client: another thread may still
  // be waiting on a ticket there, and a GPU stream may still point at its staged word.
  void DropSession() {
    StopWatchdog();
    if (producer) {
      producer->AbandonPending();
      if (control) {
        static_cast<shm::ControlBlock*>(control->data())
            ->staged_ticket.store(UINT64_MAX, std::memory_order_release);
      }
    }
    if (mirror) mirror->Synchronize();  // its callbacks use the producer
    if (producer) retired_producers.push_back(std::move(producer));
    if (control) retired_controls.push_back(std::move(control));
    daemon_liveness.reset();
  }
  std::vector<std::unique_ptr<shm::CommandProducer>> retired_producers;
  std::vector<shm::SealedSegmentPtr> retired_controls;
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Client::~Client() {
  if (!session_id_.empty()) (void)Unregister();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(ClientOptions options) {
  if (options.world_size == 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        fmt::format("rank {} is not below world size {}", options.rank, options.world_size));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  if (const char* t = std::getenv("CKPTD_CUDA_TRANSPORT"); t && std::string(t) == "host-copy") {
    impl->options.cuda_transport = CudaTransport::kHostCopy;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  // gRPC shares connections between channels to the same target process-wide: a client
  // made after ckptd restarted would inherit the dead daemon's connection and fail its
  // first call with "Broken pipe".
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  impl->channel = grpc::CreateCustomChannel("unix:" + impl->options.socket,
                                            grpc::InsecureChannelCredentials(), args);
  auto deadline = std::chrono::system_clock::now() + std::min(impl->options.rpc_timeout,
                                                              std::chrono::milliseconds(5000));
  if (!impl->channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(fmt::format(
        "cannot reach ckptd at {} (is it running, and may this user use the socket?)",
        impl->options.socket));
  }
  impl->stub = ::ckptd::v1::Trainer::NewStub(impl->channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<Tensor*> Client::AllocateTensor(const std::string& name, const std::string& dtype,
                                               const std::vector<int64_t>& shape,
                                               const std::vector<int64_t>& global_shape,
                                               const std::vector<int64_t>& global_offset,
                                               size_t spare_bytes) {
  CKPT_ASSIGN_OR_RETURN(size_t nbytes, TensorBytes(name, dtype, shape));
  if (spare_bytes > (size_t{1} << 40)) {
    return absl::InvalidArgumentError(fmt::format("tensor {}: {} spare bytes is too many", name, spare_bytes));
  }
  CKPT_ASSIGN_OR_RETURN(void* data, AllocateInArena(nbytes + spare_bytes));
  return AddRecord({name, dtype, shape, data, nbytes, global_shape, global_offset,
                    /*on_device=*/false, spare_bytes, /*flat_ranges=*/{}});
}

absl::StatusOr<Tensor*> Client::AllocateFlatTensor(const std::string& name, const std::string& dtype,
                                                   const std::vector<int64_t>& global_shape,
                                                   const std::vector<ElementRange>& ranges) {
  int64_t numel = 0;
  for (const ElementRange& r : ranges) {
    if (r.begin < 0 || r.end <= r.begin || r.end - r.begin > (int64_t{1} << 50) - numel) {
      return absl::InvalidArgumentError(
          fmt::format("tensor {}: flat element range [{}, {}) is empty, negative or too large", name, r.begin, r.end));
    }
    numel += r.end - r.begin;
  }
  if (ranges.empty() || global_shape.empty()) {
    return absl::InvalidArgumentError(
        fmt::format("tensor {}: a flat tensor needs element ranges and its global shape", name));
  }
  CKPT_ASSIGN_OR_RETURN(size_t nbytes, TensorBytes(name, dtype, {numel}));
  CKPT_ASSIGN_OR_RETURN(void* data, AllocateInArena(nbytes));
  return AddRecord({name, dtype, {numel}, data, nbytes, global_shape, {}, /*on_device=*/false, 0, ranges});
}

absl::StatusOr<FlatShard> Client::AllocateFlatShard(const std::string& dtype, int64_t numel,
                                                    const std::vector<FlatPiece>& pieces) {
  CKPT_ASSIGN_OR_RETURN(size_t itemsize, DTypeSize(dtype));
  CKPT_ASSIGN_OR_RETURN(size_t nbytes, TensorBytes("flat shard", dtype, {numel}));
  // Check every piece before allocating anything, so a bad one leaves nothing behind.
  std::vector<std::pair<int64_t, int64_t>> taken;  // [at, at + length) in the shard
  for (const FlatPiece& p : pieces) {
    CKPT_ASSIGN_OR_RETURN(size_t whole, TensorBytes(p.name, dtype, p.global_shape));
    const bool in_tensor = p.range.begin >= 0 && p.range.end > p.range.begin &&
                           p.range.end <= static_cast<int64_t>(whole / itemsize);
    const int64_t length = in_tensor ? p.range.end - p.range.begin : 0;
    if (!in_tensor || p.at < 0 || p.at > numel - length) {
      return absl::InvalidArgumentError(fmt::format(
          "tensor {}: elements [{}, {}) at element {} of a flat shard of {} do not fit the shard "
          "or the tensor",
          p.name, p.range.begin, p.range.end, p.at, numel));
    }
    taken.emplace_back(p.at, p.at + length);
  }
  std::sort(taken.begin(), taken.end());
  for (size_t i = 1; i < taken.size(); ++i) {
    if (taken[i].first < taken[i - 1].second) {
      return absl::InvalidArgumentError(fmt::format(
          "flat shard pieces overlap at element {}", taken[i].first));
    }
  }
  FlatShard shard;
  CKPT_ASSIGN_OR_RETURN(shard.data, AllocateInArena(nbytes));
  shard.numel = static_cast<size_t>(numel);
  for (const FlatPiece& p : pieces) {
    char* at = static_cast<char*>(shard.data) + static_cast<size_t>(p.at) * itemsize;
    const int64_t length = p.range.end - p.range.begin;
    const size_t bytes = static_cast<size_t>(length) * itemsize;
    if (p.global_shape.empty()) {  // a scalar: whole, as it has no flat placement
      shard.pieces.push_back(AddRecord({p.name, dtype, {}, at, bytes, {}, {}, false, 0, {}}));
    } else {
      shard.pieces.push_back(
          AddRecord({p.name, dtype, {length}, at, bytes, p.global_shape, {}, false, 0, {p.range}}));
    }
  }
  return shard;
}

absl::StatusOr<void*> Client::AllocateInArena(size_t bytes) {
  // Every arena byte is reserved shared memory, and ckptd counts it against this user's
  // budget: arenas grow with what is allocated (waste stays under half of it) rather than
  // coming in fixed large chunks, and a large tensor's own arena does not retire the
  // shared one that small tensors are still filling.
  constexpr size_t kFirstArena = 1u << 20;
  constexpr size_t kPage = 4096;
  size_t alloc = std::max<size_t>(bytes, 1);
  if (impl_->shared_arena != nullptr) {
    if (absl::StatusOr<size_t> offset = impl_->shared_arena->Allocate(alloc); offset.ok()) {
      return impl_->shared_arena->at(*offset);
    }
  }
  size_t next = std::clamp(impl_->arena_bytes_reserved, kFirstArena,
                           std::max(impl_->options.arena_bytes, kFirstArena));
  bool own = alloc > next / 2;
  size_t capacity = own ? (alloc + kPage - 1) / kPage * kPage : next;
  CKPT_ASSIGN_OR_RETURN(shm::ArenaPtr arena, shm::Arena::Create(capacity, impl_->options.huge_pages));
  CKPT_ASSIGN_OR_RETURN(size_t offset, arena->Allocate(alloc));
  impl_->arena_bytes_reserved += arena->capacity();
  if (!own) impl_->shared_arena = arena.get();
  impl_->arenas.push_back(std::move(arena));
  return impl_->arenas.back()->at(offset);
}

Tensor* Client::AddRecord(Tensor tensor) {
  const bool registered = !session_id_.empty();
  if (registered) {
    // After Register(): the next Update() adds it, or replaces the tensor of that name.
    auto same = std::find_if(tensors_.begin(), tensors_.end(),
                             [&](const auto& t) { return t->name == tensor.name; });
    if (same != tensors_.end()) {
      std::erase(impl_->added, same->get());
      impl_->retired.push_back(std::move(*same));
      tensors_.erase(same);
    }
  }
  tensors_.push_back(std::make_unique<Tensor>(std::move(tensor)));
  if (registered) impl_->added.push_back(tensors_.back().get());
  return tensors_.back().get();
}

absl::Status Client::MarkSparse(const std::string& name) {
  auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const auto& t) { return t->name == name; });
  if (it == tensors_.end()) return absl::NotFoundError(fmt::format("tensor {} cannot be sparse: it is not allocated", name));
  const bool registered = !session_id_.empty() &&
                          std::find(impl_->added.begin(), impl_->added.end(), it->get()) == impl_->added.end();
  if (registered) {
    return absl::FailedPreconditionError(
        fmt::format("tensor {} is registered already: mark it sparse before Register() (or before the Update() "
                    "that adds it)",
                    name));
  }
  (*it)->sparse = true;
  return absl::OkStatus();
}

absl::Status Client::SetFrozen(const std::string& name, bool frozen) {
  auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const auto& t) { return t->name == name; });
  if (it == tensors_.end()) {
    return absl::NotFoundError(fmt::format("tensor {} cannot be {}: it is not allocated", name,
                                           frozen ? "frozen" : "thawed"));
  }
  if ((*it)->frozen == frozen) return absl::OkStatus();
  (*it)->frozen = frozen;
  // One not registered yet goes with its spec (Register, or Update's added tensors).
  const bool registered = !session_id_.empty() &&
                          std::find(impl_->added.begin(), impl_->added.end(), it->get()) == impl_->added.end();
  if (!registered) return absl::OkStatus();
  // The latest word is sent, never dropped: thawed and frozen again between two updates,
  // the tensor may have changed meanwhile, and a freeze tells ckptd to copy it anew.
  impl_->frozen_changes[name] = frozen;
  return absl::OkStatus();
}

absl::Status Client::RemoveTensor(const std::string& name) {
  if (session_id_.empty()) return absl::FailedPreconditionError("RemoveTensor before Register()");
  auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const auto& t) { return t->name == name; });
  if (it == tensors_.end()) {
    return absl::NotFoundError(fmt::format("tensor {} is not registered", name));
  }
  const bool was_registered = std::find(impl_->added.begin(), impl_->added.end(), it->get()) ==
                              impl_->added.end();
  std::erase(impl_->added, it->get());
  if (was_registered) impl_->removed.push_back(name);
  impl_->retired.push_back(std::move(*it));
  tensors_.erase(it);
  return absl::OkStatus();
}

void Client::FillSpec(const Tensor& t, ::ckptd::v1::TensorSpec* spec) const {
  spec->set_name(t.name);
  spec->set_dtype(t.dtype);
  for (int64_t d : t.shape) spec->add_shape(d);
  spec->set_nbytes(t.nbytes);
  spec->set_frozen(t.frozen);
  spec->set_sparse(t.sparse);
  for (int64_t d : t.global_shape) spec->add_global_shape(d);
  for (int64_t d : t.global_offset) spec->add_global_offset(d);
  for (const ElementRange& r : t.flat_ranges) {
    auto* range = spec->add_flat_ranges();
    range->set_begin(r.begin);
    range->set_end(r.end);
  }
  if (t.on_device && impl_->gpu.count(&t)) {
    const cuda::DeviceBufferDescriptor& d = impl_->gpu.at(&t);
    spec->mutable_cuda()->set_ipc_handle(d.ipc_handle.data(), d.ipc_handle.size());
    spec->mutable_cuda()->set_offset(d.offset);
    spec->mutable_cuda()->set_allocation_bytes(d.allocation_bytes);
    spec->mutable_cuda()->set_device_uuid(d.device_uuid);
    return;
  }
  // Host tensors, and the host mirrors of GPU tensors under the host-copy transport.
  const char* host = static_cast<const char*>(t.on_device ? impl_->mirror_of.at(&t) : t.data);
  for (size_t i = 0; i < impl_->arenas.size(); ++i) {
    const shm::Arena& arena = *impl_->arenas[i];
    if (!arena.Contains(host)) continue;
    spec->set_arena(static_cast<uint32_t>(i));
    spec->set_offset(static_cast<uint64_t>(host - static_cast<const char*>(arena.at(0))));
  }
}

absl::Status Client::Update() {
  if (session_id_.empty()) return absl::FailedPreconditionError("Update before Register()");
  if (impl_->added.empty() && impl_->removed.empty() && impl_->frozen_changes.empty()) return absl::OkStatus();
  ::ckptd::v1::UpdateRequest req;
  req.set_session_id(session_id_);
  for (const Tensor* t : impl_->added) FillSpec(*t, req.add_tensors());
  for (const std::string& name : impl_->removed) req.add_removed(name);
  for (const auto& [name, frozen] : impl_->frozen_changes) {
    if (std::find(impl_->removed.begin(), impl_->removed.end(), name) != impl_->removed.end()) continue;
    *(frozen ? req.add_freeze() : req.add_thaw()) = name;
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> tokens,
                        HandOverArenas(impl_->options.socket, impl_->arenas, impl_->handed_arenas));
  for (std::string& token : tokens) req.add_arena_tokens(std::move(token));
  req.set_first_arena(static_cast<uint32_t>(impl_->handed_arenas));
  if (impl_->copy_on_write) AddArenaAddresses(impl_->arenas, impl_->handed_arenas, req.mutable_arena_addresses());
  ::ckptd::v1::UpdateReply reply;
  auto ctx = impl_->Context();
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->Update(ctx.get(), req, &reply), "update",
                                impl_->options.socket));
  impl_->handed_arenas = impl_->arenas.size();
  impl_->added.clear();
  impl_->removed.clear();
  impl_->frozen_changes.clear();
  return absl::OkStatus();
}

absl::StatusOr<Tensor*> Client::AddCudaTensor(const std::string& name, const std::string& dtype,
                                              const std::vector<int64_t>& shape, void* device_ptr,
                                              const std::vector<int64_t>& global_shape,
                                              const std::vector<int64_t>& global_offset) {
  if (!session_id_.empty()) {
    return absl::FailedPreconditionError(
        "AddCudaTensor after Register(): GPU tensors cannot be added by Update(); register again");
  }
  CKPT_ASSIGN_OR_RETURN(size_t nbytes, TensorBytes(name, dtype, shape));
  if (impl_->options.cuda_transport == CudaTransport::kHostCopy) {
    CKPT_ASSIGN_OR_RETURN(int device, cuda::DeviceOfPointer(name, device_ptr));
    if (!impl_->gpu_sync) {
      CKPT_ASSIGN_OR_RETURN(impl_->gpu_sync, cuda::TrainerSync::Create(device));
    }
    if (!impl_->mirror) {
      CKPT_ASSIGN_OR_RETURN(impl_->mirror, cuda::HostMirror::Create(device));
    }
    CKPT_ASSIGN_OR_RETURN(void* host, AllocateInArena(nbytes));
    Tensor* t = AddRecord({name, dtype, shape, device_ptr, nbytes, global_shape, global_offset,
                           /*on_device=*/true, 0, {}});
    impl_->mirror_of[t] = host;
    impl_->mirror->Add(device_ptr, host, nbytes);
    return t;
  }
  CKPT_ASSIGN_OR_RETURN(cuda::DeviceBufferDescriptor descriptor,
                        cuda::DescribeDeviceBuffer(name, device_ptr, nbytes));
  if (!impl_->gpu_sync) {
    CKPT_ASSIGN_OR_RETURN(impl_->gpu_sync, cuda::TrainerSync::Create(descriptor.device_ordinal));
  }
  Tensor* t = AddRecord({name, dtype, shape, device_ptr, nbytes, global_shape, global_offset,
                         /*on_device=*/true, 0, {}});
  impl_->gpu[t] = std::move(descriptor);
  return t;
}

absl::Status Client::Register() {
  if (!session_id_.empty()) return absl::FailedPreconditionError("already registered");
  ::ckptd::v1::RegisterRequest req;
  req.set_job(impl_->options.job);
  req.set_rank(impl_->options.rank);
  req.set_world_size(impl_->options.world_size);
  req.set_pid(::getpid());
  req.set_keep_last(impl_->options.keep_last);
  if (const auto& upload = impl_->options.upload) {
    req.mutable_upload()->set_every_steps(upload->every_steps);
    req.mutable_upload()->set_interval_seconds(upload->interval_seconds);
  }
  if (!impl_->gpu.empty()) {
    // A session of its own, with tickets from 1 again: fresh events, so that a record for
    // its first tickets can never reach a copy of an earlier session still under way.
    if (impl_->registered_once) CKPT_RETURN_IF_ERROR(impl_->gpu_sync->RenewEvents());
    for (const std::string& handle : impl_->gpu_sync->event_handles()) req.add_cuda_event_handles(handle);
  }
  for (const auto& t : tensors_) FillSpec(*t, req.add_tensors());
  CKPT_ASSIGN_OR_RETURN(std::vector<std::string> tokens,
                        HandOverArenas(impl_->options.socket, impl_->arenas, 0));
  for (std::string& token : tokens) req.add_arena_tokens(std::move(token));
  // Every arena may grow huge ones later (Update), so the descriptor goes over at once.
  if (impl_->options.copy_on_write && impl_->gpu.empty() && !impl_->mirror) {
    req.set_write_protect_token(HandOverWriteProtect(impl_->options.socket));
    impl_->copy_on_write = !req.write_protect_token().empty();
    if (impl_->copy_on_write) AddArenaAddresses(impl_->arenas, 0, req.mutable_arena_addresses());
  }
  ::ckptd::v1::RegisterReply reply;
  auto ctx = impl_->Context();
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->Register(ctx.get(), req, &reply), "register",
                                impl_->options.socket));
  if (impl_->mirror && !impl_->mirrors_pinned) {
    for (auto& a : impl_->arenas) CKPT_RETURN_IF_ERROR(impl_->mirror->PinHost(a->at(0), a->capacity()));
    impl_->mirrors_pinned = true;
  }
  CKPT_ASSIGN_OR_RETURN(auto control, FetchControlBlock(impl_->options.socket, reply));
  impl_->control = std::move(control.first);
  impl_->daemon_liveness = std::move(control.second);
  CKPT_ASSIGN_OR_RETURN(shm::ControlBlock * block,
                        shm::ValidateControlBlock(impl_->control->data(), impl_->control->size()));
  impl_->producer = std::make_unique<shm::CommandProducer>(block, impl_->daemon_liveness.get());
  impl_->handed_arenas = impl_->arenas.size();
  impl_->added.clear();  // everything allocated so far went with this registration
  impl_->removed.clear();
  impl_->frozen_changes.clear();  // so did every flag
  impl_->registered_once = true;
  session_id_ = reply.session_id();
  committed_steps_.assign(reply.committed_steps().begin(), reply.committed_steps().end());
  committed_count_ = reply.committed_count();
  if (!impl_->gpu.empty()) {
    CKPT_RETURN_IF_ERROR(impl_->gpu_sync->MapStagedWord(
        reinterpret_cast<uint64_t*>(&block->staged_ticket)));
    impl_->StopWatchdog();  // a session's own: never one still running from before
    impl_->watchdog = std::thread([impl = impl_.get(), block] {
      while (!impl->stop_watchdog) {
        // The GPU goes on past its waits, so the snapshots ckptd has not copied are torn from
        // then on: abandoned first, so that ckptd never commits them.
        if (!impl->producer ||
            !impl->producer->CheckDaemonAliveOrAbandon(impl->options.daemon_dead_after).ok()) {
          block->staged_ticket.store(UINT64_MAX, std::memory_order_release);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
  }
  return absl::OkStatus();
}

absl::Status Client::NoSession(const char* what) const {
  if (!impl_->registered_once) return absl::FailedPreconditionError(fmt::format("{} before Register()", what));
  return absl::UnavailableError(
      "ckptd exited; this rank registers again with its next snapshot once a ckptd is back");
}

absl::Status Client::RegisterAgainIfDaemonRestarted(const absl::Status& down) {
  // A ckptd that stalled (SIGSTOP, swapping) still holds the session: when its heartbeat
  // comes back, so do snapshots, with nothing to redo. Only a ckptd that exited, or closed
  // the session, is replaced by registering with whatever listens on the socket now.
  const bool gone = !impl_->producer || !impl_->producer->CheckDaemonRunning().ok();
  if (!gone || impl_->options.reconnect_every.count() <= 0) return down;
  auto now = std::chrono::steady_clock::now();
  if (now < impl_->next_reconnect) return down;
  impl_->next_reconnect = now + impl_->options.reconnect_every;
  impl_->DropSession();
  session_id_.clear();
  impl_->rpc_timeout_now = impl_->options.reconnect_timeout;
  absl::Status registered = Register();
  impl_->rpc_timeout_now = std::chrono::milliseconds(0);
  if (!registered.ok()) {
    return absl::UnavailableError(fmt::format(
        "{}; registering again failed ({}), next try in {} ms", Message(down),
        Message(registered), impl_->options.reconnect_every.count()));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Client::Snapshot(uint64_t step, const Metadata& metadata,
                                          const TrainState& train_state) {
  if (!impl_->registered_once) return absl::FailedPreconditionError("Snapshot before Register()");
  if (!impl_->producer) {  // a re-registration failed: try again when it is due
    CKPT_RETURN_IF_ERROR(RegisterAgainIfDaemonRestarted(
        absl::UnavailableError("ckptd exited and no ckptd has taken this rank back yet")));
  }
  if (absl::Status alive = impl_->producer->CheckDaemonAliveOrAbandon(impl_->options.daemon_dead_after);
      !alive.ok()) {
    CKPT_RETURN_IF_ERROR(RegisterAgainIfDaemonRestarted(alive));
  }
  shm::SnapshotPayload payload;
  payload.metadata = metadata;
  for (const auto& [name, data] : train_state) payload.train_state.push_back({name, data});
  // Too large for a ring slot: handed over as shared memory of its own, before the
  // snapshot point, so that the trainer waits for nothing after it.
  std::string deposit_token;
  if (shm::EncodedSize(payload) > shm::kSlotPayloadBytes) {
    // Refused below anyway when full: nothing handed over for nothing.
    CKPT_RETURN_IF_ERROR(impl_->producer->CheckRoom());
    CKPT_ASSIGN_OR_RETURN(deposit_token, DepositPayload(impl_->options.socket, payload));
  }
  std::lock_guard lock(impl_->publish_mu);
  const uint64_t ticket = impl_->producer->NextTicket();
  if (impl_->gpu_sync) {
    if (!impl_->gpu.empty()) {
      // Refused below anyway when full: refused now, rather than after waiting for an event.
      CKPT_RETURN_IF_ERROR(impl_->producer->CheckRoom());
      CKPT_RETURN_IF_ERROR(WaitSnapshotEventFree(ticket));
    }
    CKPT_RETURN_IF_ERROR(impl_->gpu_sync->RecordSnapshotPoint(impl_->cuda_stream, ticket));
  }
  uint32_t wait_copy = 0;
  if (impl_->mirror) {
    // The side stream copies GPU tensors to their mirrors after the snapshot point; ckptd
    // stages this command once the callback says the copy landed. 0 means "no wait".
    wait_copy = ++impl_->copy_seq == 0 ? ++impl_->copy_seq : impl_->copy_seq;
    shm::CommandProducer* producer = impl_->producer.get();
    CKPT_RETURN_IF_ERROR(impl_->mirror->CopyToHostAsync(
        impl_->gpu_sync->event(ticket), [producer, wait_copy] { producer->MarkClientCopyDone(wait_copy); }));
  }
  if (!deposit_token.empty()) return impl_->producer->PublishDepositedSnapshot(step, deposit_token, wait_copy);
  return impl_->producer->PublishSnapshot(step, payload, wait_copy);
}

absl::Status Client::WaitSnapshotEventFree(uint64_t ticket) {
  // ckptd's copy of ticket t waits on event t % kSnapshotEvents: the event may be recorded
  // again once ckptd is done taking ticket t - kSnapshotEvents (events_taken; a ticket's
  // state would not do: a step can fail a ticket while its copy still waits). Only a CPU
  // that many snapshots ahead waits here, and never for work queued after the older
  // snapshot's point: no deadlock with StreamWaitStaged.
  constexpr uint64_t kEvents = cuda::TrainerSync::kSnapshotEvents;
  if (ticket <= kEvents) return absl::OkStatus();
  const uint64_t needed = ticket - kEvents;
  const auto deadline = std::chrono::steady_clock::now() + kSnapshotEventWait;
  for (auto pause = std::chrono::microseconds(50); impl_->producer->EventsTaken() < needed;
       pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(2))) {
    // A ckptd that exited or stopped answering waits on nothing any more (the watchdog
    // releases the stream's waits): go on, as every other call does.
    if (!impl_->producer->CheckDaemonAliveOrAbandon(impl_->options.daemon_dead_after).ok()) {
      return absl::OkStatus();
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(fmt::format(
          "snapshot refused: ckptd has not taken the snapshot {} tickets earlier after {} s (the CPU "
          "is that far ahead of ckptd's GPU copies); its snapshot event cannot be recorded again yet",
          kEvents, kSnapshotEventWait.count() / 1000));
    }
    std::this_thread::sleep_for(pause);
  }
  return absl::OkStatus();
}

void Client::SetCudaStream(void* stream) { impl_->cuda_stream = stream; }

absl::Status Client::StreamWaitStaged(uint64_t ticket, void* stream) {
  if (!impl_->gpu_sync || !impl_->producer) {
    return absl::FailedPreconditionError("StreamWaitStaged needs registered GPU tensors");
  }
  // The stream goes on when ckptd is gone: what is pending is torn from then on.
  CKPT_RETURN_IF_ERROR(impl_->producer->CheckDaemonAliveOrAbandon(impl_->options.daemon_dead_after));
  // Host-copy transport: the GPU buffers are free once the mirror copies are done.
  if (impl_->mirror) return impl_->mirror->StreamWaitCopied(stream);
  return impl_->gpu_sync->StreamWaitStaged(stream, ticket);
}

int Client::AbandonPending() { return impl_->producer ? impl_->producer->AbandonPending() : 0; }

TicketStatus Client::Poll(uint64_t ticket) const {
  if (!impl_->producer) return {TicketState::kUnknown, "not registered"};
  return ToTicketStatus(impl_->producer->Poll(ticket));
}

absl::StatusOr<TicketStatus> Client::WaitStaged(uint64_t ticket, std::chrono::milliseconds timeout) {
  if (!impl_->producer) return NoSession("WaitStaged");
  CKPT_ASSIGN_OR_RETURN(shm::TicketResult r,
                        impl_->producer->Wait(ticket, false, timeout, impl_->options.daemon_dead_after));
  return ToTicketStatus(r);
}

absl::StatusOr<TicketStatus> Client::WaitCommitted(uint64_t ticket,
                                                   std::chrono::milliseconds timeout) {
  if (!impl_->producer) return NoSession("WaitCommitted");
  CKPT_ASSIGN_OR_RETURN(shm::TicketResult r,
                        impl_->producer->Wait(ticket, true, timeout, impl_->options.daemon_dead_after));
  return ToTicketStatus(r);
}

absl::StatusOr<RestoreInfo> Client::Restore(std::optional<uint64_t> step) {
  return Restore(RestoreOptions{.step = step});
}

absl::StatusOr<RestoreInfo> Client::Restore(const RestoreOptions& options) {
  if (session_id_.empty()) return absl::FailedPreconditionError("Restore before Register()");
  ::ckptd::v1::RestoreRequest req;
  req.set_session_id(session_id_);
  if (options.step) {
    req.set_step(*options.step);
    req.set_has_step(true);
  }
  for (const std::string& p : options.include) req.add_include(p);
  for (const std::string& p : options.exclude) req.add_exclude(p);
  req.set_allow_missing(options.allow_missing);
  req.set_cast(options.cast);
  const bool partial = !options.include.empty() || !options.exclude.empty() || options.allow_missing;
  if (partial && impl_->mirror) {
    // Host-copy transport: every mirror goes back to the GPU below, so the mirrors of
    // tensors left out must hold their current values, not those of the last snapshot.
    CKPT_RETURN_IF_ERROR(impl_->mirror->CopyToHostAsync(nullptr, [] {}));
    impl_->mirror->Synchronize();
  }
  ::ckptd::v1::RestoreReply reply;
  auto ctx = std::make_unique<grpc::ClientContext>();  // restores of large states take a while
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->Restore(ctx.get(), req, &reply), "restore",
                                impl_->options.socket));
  RestoreInfo info;
  info.found = reply.found();
  info.step = reply.step();
  info.bytes = reply.bytes();
  info.source = reply.source() == ::ckptd::v1::RESTORE_SOURCE_MEMORY   ? RestoreInfo::Source::kMemory
                : reply.source() == ::ckptd::v1::RESTORE_SOURCE_REMOTE ? RestoreInfo::Source::kRemote
                : reply.source() == ::ckptd::v1::RESTORE_SOURCE_PEER   ? RestoreInfo::Source::kPeer
                                                                        : RestoreInfo::Source::kDisk;
  info.metadata.insert(reply.metadata().begin(), reply.metadata().end());
  for (const auto& b : reply.train_state()) info.train_state[b.name()] = b.data();
  if (reply.train_state_deposited()) {
    CKPT_ASSIGN_OR_RETURN(shm::SnapshotPayload state, FetchTrainState(impl_->options.socket, session_id_));
    for (shm::NamedBlob& blob : state.train_state) info.train_state[blob.name] = std::move(blob.data);
  }
  info.tensors = reply.tensors();
  info.skipped = reply.skipped();
  info.not_in_checkpoint.assign(reply.not_in_checkpoint().begin(), reply.not_in_checkpoint().end());
  info.not_registered.assign(reply.not_registered().begin(), reply.not_registered().end());
  info.warnings.assign(reply.warnings().begin(), reply.warnings().end());
  info.saved_world_size = reply.saved_world_size();
  info.other_jobs.assign(reply.other_jobs().begin(), reply.other_jobs().end());
  // Host-copy transport: ckptd restored the mirrors; bring them up to the GPU.
  if (info.found && impl_->mirror) CKPT_RETURN_IF_ERROR(impl_->mirror->CopyToDevice());
  return info;
}

absl::StatusOr<bool> Client::ShouldSave(uint64_t step, std::chrono::milliseconds interval,
                                        uint64_t run) {
  if (session_id_.empty()) return absl::FailedPreconditionError("ShouldSave before Register()");
  if (interval.count() <= 0 || interval.count() > UINT32_MAX) {
    return absl::InvalidArgumentError(
        fmt::format("interval of {} ms is not in 1..{} ms", interval.count(), UINT32_MAX));
  }
  ::ckptd::v1::ShouldSaveRequest req;
  req.set_session_id(session_id_);
  req.set_step(step);
  req.set_interval_ms(static_cast<uint32_t>(interval.count()));
  req.set_run(run);
  ::ckptd::v1::ShouldSaveReply reply;
  auto ctx = impl_->Context();
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->ShouldSave(ctx.get(), req, &reply), "should-save",
                                impl_->options.socket));
  return reply.save();
}

absl::Status Client::Unregister() {
  if (session_id_.empty()) return absl::OkStatus();
  ::ckptd::v1::UnregisterRequest req;
  req.set_session_id(session_id_);
  ::ckptd::v1::UnregisterReply reply;
  auto ctx = impl_->Context();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  session_id_.clear();
  // A ckptd that exited or stalled would not answer: its session ends with this process
  // (or is taken over by this process's next registration), so nothing waits on it.
  const bool answering = impl_->producer &&
                         impl_->producer->CheckDaemonAlive(impl_->options.daemon_dead_after).ok();
  impl_->DropSession();
  if (!answering) return absl::OkStatus();
  return FromGrpc(impl_->stub->Unregister(ctx.get(), req, &reply), "unregister",
                  impl_->options.socket);
}

const char* RestoreSourceName(RestoreInfo::Source source) {
  switch (source) {
    case RestoreInfo::Source::kMemory: return "memory";
    case RestoreInfo::Source::kRemote: return "remote";
    case RestoreInfo::Source::kPeer: return "peer";
    case RestoreInfo::Source::kDisk: break;
  }
  return "disk";
}

}  // namespace ckpt
