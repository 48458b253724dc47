#include "daemon/session/session_registry.h"

#include <fmt/format.h>

#include "common/log.h"
#include "common/status.h"

namespace ckpt::daemon {

SessionRegistry::SessionRegistry() : ticker_([this] { TickLoop(); }) {}

SessionRegistry::~SessionRegistry() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  ticker_.join();
}

void SessionRegistry::TickLoop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    for (const auto& [id, s] : sessions_) s->Heartbeat();
    last_tick_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count(),
                        std::memory_order_relaxed);
    std::vector<SessionPtr> reaped = ReapLocked();
    if (!reaped.empty()) {
      lock.unlock();
      reaped.clear();  // unmaps their arenas and control blocks, outside the lock
      lock.lock();
      continue;
    }
    wake_.wait_for(lock, kTick);
  }
}

std::chrono::nanoseconds SessionRegistry::SinceLastTick() const {
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(now) -
         std::chrono::nanoseconds(last_tick_ns_.load(std::memory_order_relaxed));
}

void SessionRegistry::HoldLockWhile(const std::function<bool()>& stalled) {
  std::lock_guard lock(mu_);
  while (stalled()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

std::vector<SessionPtr> SessionRegistry::ReapLocked() {
  std::vector<SessionPtr> reaped;
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->ended()) {
      reaped.push_back(std::move(it->second));
      it = sessions_.erase(it);
    } else {
      ++it;
    }
  }
  return reaped;
}

absl::Status SessionRegistry::Add(SessionPtr session) {
  std::vector<SessionPtr> reaped;
  std::lock_guard lock(mu_);
  reaped = ReapLocked();
  for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
    const auto& [id, other] = *it;
    if (other->job() == session->job() && other->rank() == session->rank()) {
      // A trainer restarted right after a crash: its predecessor's session is stale. (One
      // of this very process was ended before: EndOwnSession.)
      if (!other->CheckTrainerAlive()) {
        log::Get(log::Component::kSession)
            .info("[{}/r{}] trainer pid {} exited; session ends (pid {} takes the rank)",
                  other->job(), other->rank(), other->pid(), session->pid());
        reaped.push_back(std::move(it->second));
        sessions_.erase(it);
        break;
      }
      return absl::AlreadyExistsError(fmt::format(
          "rank {} of job {} is already registered by pid {} (session {})", session->rank(),
          session->job(), other->pid(), id));
    }
  }
  sessions_[session->id()] = std::move(session);
  return absl::OkStatus();
}

void SessionRegistry::EndOwnSession(const std::string& job, uint32_t rank,
                                    const PeerIdentity& caller) {
  SessionPtr ended;
  {
    std::lock_guard lock(mu_);
    for (auto it = sessions_.begin(); it != sessions_.end(); ++it) {
      const SessionPtr& s = it->second;
      if (s->job() == job && s->rank() == rank && s->pid() == caller.pid && s->uid() == caller.uid) {
        log::Get(log::Component::kSession)
            .warn("[{}/r{}] pid {} registers again: its earlier session {} ends", job, rank,
                  caller.pid, it->first);
        ended = std::move(it->second);
        sessions_.erase(it);
        break;
      }
    }
  }
  if (ended) ended->Stop();  // outside the lock; what it holds goes with the last reference
}

absl::StatusOr<SessionPtr> SessionRegistry::Find(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->ended()) {
    return absl::NotFoundError(fmt::format("unknown session \"{}\" (never registered, or ended)",
                                           id.substr(0, 64)));
  }
  return it->second;
}

absl::StatusOr<SessionPtr> SessionRegistry::FindFor(const std::string& id,
                                                    const PeerIdentity& caller) const {
  CKPT_ASSIGN_OR_RETURN(SessionPtr s, Find(id));
  if (s->pid() != caller.pid || s->uid() != caller.uid) {
    return absl::PermissionDeniedError(fmt::format(
        "session {} belongs to pid {} uid {}; {} may not use it", id.substr(0, 64), s->pid(),
        s->uid(), caller.Describe()));
  }
  return s;
}

absl::Status SessionRegistry::Remove(const std::string& id) {
  SessionPtr session;
  {
    std::lock_guard lock(mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(fmt::format("unknown session \"{}\"", id.substr(0, 64)));
    }
    session = std::move(it->second);
    sessions_.erase(it);
  }
  session->Stop();
  return absl::OkStatus();
}

std::vector<SessionPtr> SessionRegistry::All() const {
  std::lock_guard lock(mu_);
  std::vector<SessionPtr> all;
  for (const auto& [id, s] : sessions_) all.push_back(s);
  return all;
}

uint32_t SessionRegistry::RanksOf(const std::string& job) const {
  std::lock_guard lock(mu_);
  uint32_t n = 0;
  for (const auto& [id, s] : sessions_) n += s->job() == job && !s->ended() ? 1 : 0;
  return n;
}

void SessionRegistry::Clear() {
  std::map<std::string, SessionPtr> sessions;
  {
    std::lock_guard lock(mu_);
    sessions.swap(sessions_);
  }
  for (auto& [id, s] : sessions) s->Stop();
}

void SessionRegistry::RefuseNewSnapshots() {
  for (const SessionPtr& s : All()) s->RefuseNewSnapshots();
}

}  // namespace ckpt::daemon
