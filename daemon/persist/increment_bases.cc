#include "daemon/persist/increment_bases.h"

namespace ckpt::persist {

std::optional<IncrementBases::Base> IncrementBases::Get(const std::string& job, uint32_t rank,
                                                        uint64_t session) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find({job, rank});
  if (it == entries_.end() || it->second.session != session || !it->second.base) return std::nullopt;
  return Base{it->second.base, it->second.saves_since_full, it->second.mostly_changed};
}

void IncrementBases::Planned(const std::string& job, uint32_t rank, uint64_t session, uint64_t step,
                             WriteMode mode, bool mostly_changed) {
  std::lock_guard lock(mu_);
  Entry& e = entries_[{job, rank}];
  if (e.session != session) e = Entry{session, nullptr, 0, false, {}};  // a new session starts over
  e.planned[step] = mode;
  e.mostly_changed = mostly_changed;
}

void IncrementBases::Restored(const format::Manifest& manifest, uint32_t rank, uint64_t session) {
  absl::StatusOr<RankBase> base = BaseFromManifest(manifest, rank);
  if (!base.ok()) return;  // versions 1-4, or a rank the step was not saved with: no base
  std::lock_guard lock(mu_);
  entries_[{manifest.job, rank}] = Entry{session, std::make_shared<const RankBase>(*std::move(base)), 0, false, {}};
}

void IncrementBases::Committed(const format::Manifest& manifest,
                               const std::vector<std::pair<uint32_t, uint64_t>>& ranks) {
  for (const auto& [rank, session] : ranks) {
    // Built outside the lock: a base of a large rank is many chunks.
    absl::StatusOr<RankBase> base = BaseFromManifest(manifest, rank);
    std::lock_guard lock(mu_);
    Entry& e = entries_[{manifest.job, rank}];
    if (e.session != session) e = Entry{session, nullptr, 0, false, {}};
    auto planned = e.planned.find(manifest.step);
    const bool new_cycle = planned == e.planned.end() || planned->second != WriteMode::kIncrement;
    e.planned.erase(e.planned.begin(), e.planned.upper_bound(manifest.step));
    // A step that cannot be a base (versions 1-4: increments off) leaves none: the next save
    // is full.
    e.base = base.ok() ? std::make_shared<const RankBase>(*std::move(base)) : nullptr;
    e.saves_since_full = new_cycle ? 0 : e.saves_since_full + 1;
  }
}

}  // namespace ckpt::persist
