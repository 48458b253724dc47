#include "daemon/control/health_reporter.h"

#include <grpcpp/health_check_service_interface.h>

#include "common/log.h"

namespace ckpt::daemon {

HealthReporter::HealthReporter(std::vector<grpc::Server*> servers, std::function<std::string()> not_ready)
    : servers_(std::move(servers)), not_ready_(std::move(not_ready)) {
  for (grpc::Server* s : servers_) {
    if (grpc::HealthCheckServiceInterface* health = s->GetHealthCheckService()) {
      health->SetServingStatus("ckptd.v1.Admin", true);
    }
  }
  Update();
  thread_ = std::thread([this] { Loop(); });
}

HealthReporter::~HealthReporter() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HealthReporter::Update() {
  const std::string reason = not_ready_();
  const bool ready = reason.empty();
  for (grpc::Server* s : servers_) {
    if (grpc::HealthCheckServiceInterface* health = s->GetHealthCheckService()) {
      health->SetServingStatus("", ready);
      health->SetServingStatus("ckptd.v1.Trainer", ready);
    }
  }
  std::lock_guard lock(mu_);
  if (ready == ready_) return;  // said once per change (the reason's words vary meanwhile)
  auto& log = log::Get(log::Component::kMain);
  if (ready) {
    log.info("ready: health SERVING");
  } else {
    log.warn("not ready ({}): health NOT_SERVING", reason);
  }
  ready_ = ready;
}

void HealthReporter::Loop() {
  std::unique_lock lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stopping_; })) {
    lock.unlock();
    Update();
    lock.lock();
  }
}

}  // namespace ckpt::daemon
