#include "daemon/group/group_server.h"

#include <fmt/format.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "common/log.h"
#include "common/status.h"
#include "daemon/group/group_service.h"

namespace ckpt::group {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

spdlog::logger& Log() { return log::Get(log::Component::kGroup); }

constexpr milliseconds kTickPeriod{50};
constexpr milliseconds kDrainPeriod{10};
constexpr milliseconds kShutdownGrace{1'000};
// A peer that connects and never completes the TLS/HTTP2 handshake is dropped after this.
constexpr milliseconds kHandshakeTimeout{5'000};
constexpr int kMaxMessageBytes = 64 << 20;
// A node has a few prepares, one outcome poll per step in flight and one gather per
// restoring rank open at a time.
constexpr int kMaxStreamsPerConnection = 256;
constexpr size_t kMemoryQuotaBytes = size_t{1} << 30;

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const GroupOptions& options) {
  if (!options.tls()) return grpc::InsecureServerCredentials();
  if (options.tls_key_pem.empty() || options.tls_ca_pem.empty()) {
    return absl::InvalidArgumentError(
        "group TLS needs a certificate, its key and the CA, all three");
  }
  // Mutual TLS: a peer without a certificate signed by the group's CA cannot even reach
  // the token check.
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = options.tls_ca_pem;
  ssl.pem_key_cert_pairs.push_back({options.tls_key_pem, options.tls_cert_pem});
  return grpc::SslServerCredentials(ssl);
}

// "host:port" with the port the kernel gave; the host as configured.
std::string BoundAddress(const std::string& listen_addr, int port) {
  size_t colon = listen_addr.rfind(':');
  std::string host = colon == std::string::npos ? listen_addr : listen_addr.substr(0, colon);
  return fmt::format("{}:{}", host, port);
}

class GrpcGroupServer final : public GroupServer {
 public:
  GrpcGroupServer(const GroupOptions& options, uint64_t incarnation, DecisionLog* log,
                  CommitCoordinator::Publisher publish, const UploadTargets* uploading, grpc::Service* also)
      : options_(options),
        also_(also),
        state_(options.coordinator_role()
                   ? std::make_unique<CoordinatorState>(options, *log, std::move(publish), uploading)
                   : nullptr),
        service_(options, incarnation, state_.get()) {}

  ~GrpcGroupServer() override { Shutdown(); }

  absl::Status Start() {
    CKPT_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                          Credentials(options_));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(options_.listen_addr, credentials, &port);
    builder.RegisterService(&service_);
    if (also_ != nullptr) builder.RegisterService(also_);
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    int keepalive_ms = static_cast<int>(std::max<milliseconds>(options_.group_timeout,
                                                               milliseconds(1'000)).count());
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms);
    // Clients ping every max(group_timeout / 2, 1 s), also between calls: accept that
    // rather than answering with GOAWAY "too many pings".
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                               static_cast<int>(kHandshakeTimeout.count()));
    // The token is checked once a request is read, so bound what peers that do not hold
    // it can make the server hold: calls per connection, and memory for them all (gRPC
    // answers RESOURCE_EXHAUSTED beyond it, and nodes retry).
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
    grpc::ResourceQuota quota("ckptd-group");
    quota.Resize(kMemoryQuotaBytes);
    builder.SetResourceQuota(quota);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      server_.reset();
      return absl::UnavailableError(fmt::format(
          "the group server cannot listen on {} (in use, or not an address of this host?)",
          options_.listen_addr));
    }
    address_ = BoundAddress(options_.listen_addr, port);
    if (state_ != nullptr) ticker_ = std::thread([this] { TickLoop(); });
    Log().info("group server listening on {} ({}, node {} of {}{})", address_,
               options_.tls() ? "mutual TLS" : "plaintext", options_.node_rank, options_.num_nodes,
               state_ != nullptr ? ", coordinator" : "");
    return absl::OkStatus();
  }

  const std::string& address() const override { return address_; }
  const Membership* membership() const override {
    return state_ != nullptr ? &state_->membership : nullptr;
  }
  CommitCoordinator* coordinator() override {
    return state_ != nullptr ? &state_->commits : nullptr;
  }

  void StartRelay(RelayUpstream& upstream) override {
    std::lock_guard lock(mu_);
    if (state_ != nullptr || options_.relay_fanout == 0 || relay_ != nullptr || shut_down_) return;
    relay_ = std::make_unique<Relay>(options_.node_rank, upstream);
    service_.SetRelay(relay_.get());
  }

  Relay::Counters relayed() const override {
    std::lock_guard lock(mu_);
    return relay_ != nullptr ? relay_->counters() : Relay::Counters{};
  }

  void Shutdown() override {
    {
      std::lock_guard lock(mu_);
      if (shut_down_) return;
      shut_down_ = true;
      draining_ = true;
    }
    cv_.notify_all();
    service_.StopWaiting();
    // What the relay holds fails now (its nodes call the coordinator), and its calls
    // upstream end: nothing of it may hold gRPC's shutdown.
    if (relay_ != nullptr) relay_->Stop();
    // gRPC's Shutdown waits for every call to finish; meanwhile the ticker keeps failing
    // the long polls that were already waiting or that raced with StopWaiting.
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (ticker_.joinable()) ticker_.join();
    if (state_ != nullptr) Drain();
    if (server_ != nullptr) server_->Wait();
  }

 private:
  void TickLoop() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      bool draining = draining_;
      lock.unlock();
      try {
        if (draining) {
          Drain();
        } else {
          Tick();
        }
      } catch (const std::exception& e) {
        Log().error("group ticker: unexpected exception: {}", e.what());
      } catch (...) {
        Log().error("group ticker: unexpected exception");
      }
      lock.lock();
      cv_.wait_for(lock, draining_ ? kDrainPeriod : kTickPeriod, [&] {
        return stopping_ || draining_ != draining;
      });
    }
  }

  void Tick() {
    auto now = Clock::now();
    // A ticker that woke far later than its period means this process did not run (CPU
    // starved, throttled by a container's quota, paused): the heartbeats it did not read
    // meanwhile say nothing of the members, so they are not counted against them.
    const milliseconds stall_bound = std::max<milliseconds>(options_.group_timeout / 4, 10 * kTickPeriod);
    if (last_tick_ != Clock::time_point{} && now - last_tick_ > stall_bound) {
      const size_t given = state_->membership.Resumed(now);
      Log().warn("the coordinator did not run for {:.1f} s (CPU starved or paused): {} members get {:.1f} s to be "
                 "heard before any is marked lost",
                 std::chrono::duration<double>(now - last_tick_).count(), given,
                 std::chrono::duration<double>(options_.group_timeout / 2).count());
    }
    last_tick_ = now;
    state_->commits.Tick(now);
    state_->gathers.Expire(now);
    state_->uploads.DropStale(now);
    for (const LostMember& lost : state_->membership.Expire(now)) {
      Log().warn("{}: aborting undecided steps", lost.why);
      state_->commits.MemberLost(lost.node, lost.why, lost.version, lost.silent_since_unix_ns);
    }
  }

  void Drain() {
    state_->commits.ReleaseWaiters();
    state_->gathers.FailAll("the coordinator is shutting down");
  }

  const GroupOptions options_;
  grpc::Service* const also_;  // may be null
  // Declared before the service and the server, so destroyed after both.
  const std::unique_ptr<CoordinatorState> state_;
  GroupService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;

  std::unique_ptr<Relay> relay_;  // set once, under mu_; outlives the server's calls

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool shut_down_ = false;  // Shutdown has begun
  bool draining_ = false;   // long polls are to be failed, not waited on
  bool stopping_ = false;   // the ticker is to exit
  std::thread ticker_;
  Clock::time_point last_tick_{};  // the ticker's own
};

}  // namespace

absl::StatusOr<GroupServerPtr> StartGroupServer(const GroupOptions& options, uint64_t incarnation,
                                                DecisionLog* log,
                                                CommitCoordinator::Publisher publish,
                                                const UploadTargets* uploading, grpc::Service* also) {
  if (options.token.empty()) {
    return absl::InvalidArgumentError("the group server needs a group token (--group-token-file)");
  }
  if (options.num_nodes == 0 || options.node_rank >= options.num_nodes) {
    return absl::InvalidArgumentError(fmt::format("node rank {} is not in 0..{}",
                                                  options.node_rank, options.num_nodes - 1));
  }
  if (options.coordinator_role() && log == nullptr) {
    return absl::InvalidArgumentError("the coordinator needs a decision log");
  }
  auto server = std::make_unique<GrpcGroupServer>(options, incarnation, log, std::move(publish),
                                                  uploading, also);
  CKPT_RETURN_IF_ERROR(server->Start());
  return GroupServerPtr(std::move(server));
}

}  // namespace ckpt::group
