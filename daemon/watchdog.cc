#include "daemon/watchdog.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/status.h"

namespace ckpt::daemon {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

Watchdog::Watchdog(std::chrono::microseconds interval, std::vector<LivenessProbe> probes, Notify notify)
    : interval_(interval),
      probes_(std::move(probes)),
      notify_(std::move(notify)),
      last_mark_(Clock::now()),
      prober_([this] { ProbeLoop(); }),
      pinger_([this] { PingLoop(); }) {}

Watchdog::~Watchdog() {
  StopProbing();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  pinger_.join();
}

void Watchdog::StopProbing() {
  {
    std::lock_guard lock(mu_);
    stop_probing_ = true;
  }
  wake_.notify_all();
  // Waits for the round in progress: no probe may touch a stage that shutdown takes away.
  if (prober_.joinable()) prober_.join();
}

void Watchdog::ProbeLoop() {
  const auto pause = std::max<Clock::duration>(interval_ / 4, std::chrono::milliseconds(10));
  std::unique_lock lock(mu_);
  while (!stop_probing_) {
    std::string failure;
    for (const LivenessProbe& probe : probes_) {
      probing_ = probe.name;
      probing_since_ = Clock::now();
      lock.unlock();
      absl::Status answered = probe.check();
      lock.lock();
      if (!answered.ok()) {
        failure = fmt::format("{}: {}", probe.name, Message(answered));
        break;
      }
      if (stop_probing_) break;
    }
    probing_.clear();
    if (failure.empty()) {
      last_mark_ = Clock::now();
    }
    last_failure_ = std::move(failure);
    wake_.wait_for(lock, pause, [this] { return stop_probing_; });
  }
}

void Watchdog::PingLoop() {
  auto& log = log::Get(log::Component::kMain);
  bool skipping = false;
  std::unique_lock lock(mu_);
  while (!stop_) {
    const auto now = Clock::now();
    std::string message, problem;
    if (stop_probing_ || now - last_mark_ <= interval_) {
      message = skipping ? "WATCHDOG=1\nSTATUS=serving: the data path answers again" : "WATCHDOG=1";
    } else {
      // What holds the data path: the probe that has not returned, or why the last round failed.
      const std::string why =
          !probing_.empty()
              ? fmt::format("the {} probe has not returned for {:.1f} s", probing_, Seconds(now - probing_since_))
              : fmt::format("the last round failed ({})", last_failure_);
      problem = fmt::format("watchdog: no progress on the data path for {:.1f} s: {}", Seconds(now - last_mark_), why);
      message = "STATUS=" + problem;
    }
    lock.unlock();  // the service manager's socket and the log, outside the lock
    if (!problem.empty()) {
      log.error("{}; WATCHDOG=1 withheld (systemd restarts ckptd after WatchdogSec)", problem);
    } else if (skipping) {
      log.warn("watchdog: the data path answers again; WATCHDOG=1 resumes");
    }
    skipping = !problem.empty();
    notify_(message);
    lock.lock();
    wake_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

}  // namespace ckpt::daemon
