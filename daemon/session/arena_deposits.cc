#include "daemon/session/arena_deposits.h"

#include <fmt/format.h>

#include <random>

#include "common/status.h"
#include "daemon/staging/write_protector.h"
#include "shm/sealed_segment.h"

namespace ckpt::daemon {
namespace {

std::string RandomToken() {
  std::random_device rd;  // /dev/urandom: a token must not be guessable
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

const char* What(ArenaDeposits::Kind kind) {
  switch (kind) {
    case ArenaDeposits::Kind::kArenas: return "arenas";
    case ArenaDeposits::Kind::kWriteProtect: return "a userfaultfd";
    case ArenaDeposits::Kind::kPayload: return "a snapshot payload";
  }
  return "?";
}

}  // namespace

absl::Status ArenaDeposits::Check(const std::vector<UniqueFd>& fds, Kind kind) {
  if (kind == Kind::kWriteProtect) {
    if (fds.size() != 1) {
      return absl::InvalidArgumentError(
          fmt::format("write-protection takes one userfaultfd, not {} descriptors", fds.size()));
    }
    return WriteProtector::CheckReceivable(fds[0].get());
  }
  if (kind == Kind::kPayload && fds.size() != 1) {
    return absl::InvalidArgumentError(
        fmt::format("a snapshot payload is one sealed memfd, not {} descriptors", fds.size()));
  }
  if (fds.empty()) return absl::InvalidArgumentError("no arenas attached");
  for (size_t i = 0; i < fds.size(); ++i) {
    if (absl::Status sealed = shm::SealedSegment::CheckReceivable(fds[i].get()); !sealed.ok()) {
      return Annotate(sealed, fmt::format("arena {} of {}", i, fds.size()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ArenaDeposits::Put(const PeerIdentity& depositor,
                                               std::vector<UniqueFd> fds, Kind kind) {
  CKPT_RETURN_IF_ERROR(Check(fds, kind));
  std::lock_guard lock(mu_);
  auto now = std::chrono::steady_clock::now();
  ExpireLocked(now);
  size_t& mine = fds_of_uid_[depositor.uid];
  if (mine + fds.size() > options_.max_fds_per_uid || fds_ + fds.size() > options_.max_fds) {
    return absl::ResourceExhaustedError(fmt::format(
        "too many arenas handed over and not yet registered ({} of uid {}, {} in all; at most "
        "{} per user and {} in all, kept {} ms)",
        mine, depositor.uid, fds_, options_.max_fds_per_uid, options_.max_fds,
        options_.expire_after.count()));
  }
  std::string token = RandomToken();
  mine += fds.size();
  fds_ += fds.size();
  batches_.emplace(token, Batch{depositor.pid, depositor.uid, kind, std::move(fds),
                               now + options_.expire_after});
  return token;
}

absl::StatusOr<std::vector<UniqueFd>> ArenaDeposits::Take(const std::string& token,
                                                          const PeerIdentity& caller, Kind kind) {
  std::lock_guard lock(mu_);
  ExpireLocked(std::chrono::steady_clock::now());
  auto it = batches_.find(token);
  if (it == batches_.end()) {
    return absl::NotFoundError(fmt::format(
        "token \"{}\" for {} is unknown or expired ({} must be used within {} ms of being "
        "handed over)",
        token.substr(0, 64), What(kind), What(kind), options_.expire_after.count()));
  }
  if (it->second.pid != caller.pid || it->second.uid != caller.uid) {
    return absl::PermissionDeniedError(fmt::format(
        "token \"{}\" was handed over by another process (pid {} uid {}), not by the "
        "caller ({})",
        token, it->second.pid, it->second.uid, caller.Describe()));
  }
  if (it->second.kind != kind) {
    return absl::InvalidArgumentError(fmt::format("token \"{}\" was handed over with {}, not {}",
                                                  token.substr(0, 64), What(it->second.kind), What(kind)));
  }
  std::vector<UniqueFd> fds = std::move(it->second.fds);
  fds_ -= fds.size();
  fds_of_uid_[it->second.uid] -= fds.size();
  batches_.erase(it);
  return fds;
}

size_t ArenaDeposits::held_fds() const {
  std::lock_guard lock(mu_);
  return fds_;
}

void ArenaDeposits::ExpireLocked(std::chrono::steady_clock::time_point now) {
  for (auto it = batches_.begin(); it != batches_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    fds_ -= it->second.fds.size();
    fds_of_uid_[it->second.uid] -= it->second.fds.size();
    it = batches_.erase(it);
  }
}

}  // namespace ckpt::daemon
