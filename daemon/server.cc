#include "daemon/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include "common/filesystem.h"
#include "common/log.h"
#include "common/status.h"
#include "cuda/copy_engine.h"
#include "cuda/copy_priority.h"
#include "cuda/cuda_copy_engine.h"
#include "cuda/ipc_memory_cache.h"
#include "cuda/device.h"
#include "cuda/staging_pool.h"
#include "daemon/checkpointer.h"
#include "daemon/control/admin_service.h"
#include "daemon/control/status_board.h"
#include "daemon/control/trainer_service.h"
#include "daemon/control/unix_listener.h"
#include "daemon/persist/checkpoint_store.h"
#include "daemon/persist/shard_writer.h"
#include "daemon/restorer.h"
#include "daemon/session/session_registry.h"
#include "daemon/staging/stager.h"
#include "shm/sweep.h"

namespace ckpt::daemon {

// Arenas of dead trainers are removed only once this old (see shm/sweep.h).
constexpr std::chrono::seconds kArenaSweepAge{600};

// Declared in dependency order: destroyed in reverse.
struct Server::Parts {
  Config config;
  StatusBoard board;
  FilesystemPtr fs;
  std::unique_ptr<persist::CheckpointStore> store;
  cuda::StagingPoolPtr pool;
  cuda::CopyEnginePtr engine;
  std::vector<cuda::CopyEnginePtr> device_engines;  // one per GPU; empty without one
  std::unique_ptr<cuda::IpcMemoryCache> gpu_memory;
  cuda::CopyPriority copy_priority;
  persist::ShardWriterPtr writer;
  std::unique_ptr<Checkpointer> checkpointer;
  std::unique_ptr<Stager> stager;
  std::unique_ptr<Restorer> restorer;
  SessionRegistry sessions;
  std::unique_ptr<TrainerService> trainer_service;
  std::unique_ptr<AdminService> admin_service;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<UnixListener> listener;
  bool shut_down = false;
};

Server::Server(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

Server::~Server() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const Config& config) {
  auto& log = log::Get(log::Component::kMain);
  auto p = std::make_unique<Parts>();
  p->config = config;
  log.info("ckptd {} starting: {}", kVersion, config.ToJson());

  p->fs = MakePosixFilesystem();
  CKPT_RETURN_IF_ERROR(Annotate(p->fs->MakeDir(config.root), "--root"));
  p->store = std::make_unique<persist::CheckpointStore>(p->fs, config.root);
  CKPT_ASSIGN_OR_RETURN(int stale, p->store->RemoveStaleTemp());
  if (stale > 0) log.info("removed {} unfinished step directories left by an earlier run", stale);
  if (int swept = shm::RemoveStaleSegments("ckptd-ctl."); swept > 0) {
    log.info("removed {} stale control segments", swept);
  }
  if (int swept = shm::RemoveStaleSegments("ckpt-arena.", kArenaSweepAge); swept > 0) {
    log.info("removed {} shared-memory arenas of trainers that died before registering", swept);
  }

  CKPT_ASSIGN_OR_RETURN(p->pool, cuda::StagingPool::Create(config.staging_bytes,
                                                           config.prefault_staging));
  p->engine = cuda::MakeHostCopyEngine(config.copy_threads);
  // CUDA is detected once. Without a usable device the host path serves everything and
  // GPU tensors are refused at registration with this reason.
  const cuda::DeviceInfo& device = cuda::DetectDevices();
  std::string no_gpu_reason = device.reason;
  if (device.available()) {
    // One engine (4 streams) per GPU, so that each GPU's copies use its own DMA engines.
    absl::Status usable = p->pool->PinForCuda();
    for (int d = 0; usable.ok() && d < device.device_count; ++d) {
      auto engine = cuda::MakeCudaCopyEngine({.device = d, .streams = 4});
      if (engine.ok()) {
        p->device_engines.push_back(std::move(*engine));
      } else {
        usable = engine.status();
      }
    }
    if (usable.ok()) {
      p->gpu_memory = std::make_unique<cuda::IpcMemoryCache>();
      log.info("CUDA: {} device(s); staging memory pinned; a copy engine of 4 streams per device",
               device.device_count);
    } else {
      p->device_engines.clear();
      no_gpu_reason = Message(usable);
      log.error("CUDA: device present but unusable ({}); host copy engine only", no_gpu_reason);
    }
  } else {
    log.info("CUDA: no usable device ({}); host copy engine only", device.reason);
  }
  p->writer = persist::MakeLocalFsShardWriter(p->fs, [priority = &p->copy_priority] {
    priority->YieldToCopies(std::chrono::milliseconds(500));
  });
  Checkpointer::Options options;
  options.retention = {config.keep_last, config.keep_every};
  options.io_threads = config.io_threads;
  p->checkpointer = std::make_unique<Checkpointer>(*p->store, *p->writer, p->board, options);
  std::vector<cuda::CopyEngine*> device_engines;
  for (const auto& e : p->device_engines) device_engines.push_back(e.get());
  Stager::Options staging;
  staging.when_busy = config.when_busy;
  staging.busy_wait = std::chrono::milliseconds(config.busy_wait_ms);
  staging.chunk_bytes = config.staging_chunk_bytes;
  p->stager = std::make_unique<Stager>(*p->pool, *p->engine, *p->checkpointer, staging,
                                       &p->copy_priority, device_engines);
  p->restorer = std::make_unique<Restorer>(*p->store, *p->checkpointer, *p->engine,
                                           &p->copy_priority, device_engines, p->pool.get());

  Session::Limits limits;
  limits.staging_bytes = p->pool->capacity();
  limits.gpu_memory = p->gpu_memory.get();
  limits.no_gpu_reason = no_gpu_reason;
  limits.daemon_uid = ::geteuid();
  limits.allow_uids = config.allow_uids;
  p->trainer_service = std::make_unique<TrainerService>(p->sessions, *p->stager, *p->checkpointer,
                                                        *p->restorer, p->board, limits);
  p->admin_service = std::make_unique<AdminService>(p->config, *p->store, *p->checkpointer,
                                                    p->sessions, *p->pool, p->board);

  CKPT_ASSIGN_OR_RETURN(p->listener, UnixListener::Bind(config.socket));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(64 << 20);
  builder.RegisterService(p->trainer_service.get());
  builder.RegisterService(p->admin_service.get());
  int admin_port = 0;
  if (!config.admin_addr.empty()) {
    // Only the admin service is reachable over TCP: trainers must use the Unix socket,
    // where peer credentials are checked.
    builder.AddListeningPort(config.admin_addr, grpc::InsecureServerCredentials(), &admin_port);
  }
  p->grpc_server = builder.BuildAndStart();
  if (!p->grpc_server) return absl::InternalError("gRPC server failed to start");
  if (!config.admin_addr.empty()) {
    if (admin_port == 0) {
      return absl::UnavailableError(fmt::format("cannot listen on --admin-addr {}", config.admin_addr));
    }
    log.info("admin API on {} (port {})", config.admin_addr, admin_port);
  }
  PeerPolicy policy{::geteuid(), ::getegid(), config.allow_uids, config.allow_gids};
  CKPT_RETURN_IF_ERROR(p->listener->Serve(p->grpc_server.get(), policy));
  log.info("listening on {} (mode 0660); checkpoints under {}", config.socket, config.root);
  return std::unique_ptr<Server>(new Server(std::move(p)));
}

void Server::Shutdown() {
  Parts& p = *parts_;
  if (p.shut_down) return;
  p.shut_down = true;
  auto& log = log::Get(log::Component::kMain);
  log.info("shutting down: finishing in-flight writes (up to {} ms)", p.config.shutdown_timeout_ms);
  p.listener->Stop();
  p.grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  p.checkpointer->Shutdown(std::chrono::milliseconds(p.config.shutdown_timeout_ms));
  p.sessions.Clear();
  log.info("shut down cleanly");
}

}  // namespace ckpt::daemon
