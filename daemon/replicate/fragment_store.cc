#include "daemon/replicate/fragment_store.h"

#include <fmt/format.h>

#include <utility>

#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fragment_checksum.h"

namespace ckpt::replicate {

FragmentStore::FragmentStore(size_t budget, std::function<daemon::StagingLedger::ActiveUsers()> active,
                             std::function<Clock::time_point()> now)
    : budget_(budget),
      active_(std::move(active)),
      now_(std::move(now)),
      ledger_(budget, [this] { return ActiveWithHolders(); }, "the replica memory", "--replica-bytes") {}

void FragmentStore::ExpireLocked() {
  // The newest touch of each (job, owner): one step may be idle while the next arrives.
  std::map<std::pair<std::string, uint32_t>, Clock::time_point> last;
  for (const auto& [key, step] : steps_) {
    auto& t = last[{std::get<0>(key), std::get<1>(key)}];
    t = std::max(t, step.touched);
  }
  const Clock::time_point now = now_();
  for (auto it = steps_.begin(); it != steps_.end();) {
    if (now - last[{std::get<0>(it->first), std::get<1>(it->first)}] > kIdleLifetime) {
      EraseLocked(it++);
    } else {
      ++it;
    }
  }
}

daemon::StagingLedger::ActiveUsers FragmentStore::ActiveWithHolders() const {
  daemon::StagingLedger::ActiveUsers users = active_ ? active_() : daemon::StagingLedger::ActiveUsers{};
  std::lock_guard lock(mu_);
  for (const auto& [key, step] : steps_) users[step.uid].insert(std::get<0>(key));
  return users;
}

absl::Status FragmentStore::Put(uid_t uid, const FragmentId& id, const FragmentMeta& meta, std::string bytes) {
  const std::string what = fmt::format("fragment {} of job {} step {} rank {} from node {}", id.index, id.job, id.step,
                                       id.rank, id.owner);
  if (meta.k < 1 || uint64_t{meta.k} + meta.m > static_cast<uint64_t>(kMaxFragments) ||
      uint64_t{id.index} >= uint64_t{meta.k} + meta.m) {
    return absl::InvalidArgumentError(
        fmt::format("{}: a {}+{} code has no fragment {}", what, meta.k, meta.m, id.index));
  }
  if (bytes.size() != ErasureCode::FragmentBytes(meta.data_bytes, static_cast<int>(meta.k))) {
    return absl::DataLossError(fmt::format("{}: {} bytes, where {} bytes coded {}+{} make fragments of {}", what,
                                           bytes.size(), meta.data_bytes, meta.k, meta.m,
                                           ErasureCode::FragmentBytes(meta.data_bytes, static_cast<int>(meta.k))));
  }
  if (!ChecksumMatches(bytes.data(), bytes.size(), meta.checksum)) {
    return absl::DataLossError(fmt::format("{}: its bytes hash to {}, not {} (damaged on the way)", what,
                                           ChecksumLike(bytes.data(), bytes.size(), meta.checksum), meta.checksum));
  }
  const StepKey key{id.job, id.owner, id.step};
  const size_t size = bytes.size();
  {
    // Reserved before the share is asked, so that two fragments arriving at once never
    // both fit a budget that holds one.
    std::lock_guard lock(mu_);
    ExpireLocked();  // the jobs that stopped make room first
    if (auto it = steps_.find(key); it != steps_.end() && it->second.sealed) {
      return absl::FailedPreconditionError(fmt::format("{}: the step is sealed here already", what));
    }
    if (used_ + size > budget_) {
      return absl::ResourceExhaustedError(fmt::format(
          "{}: {} bytes do not fit --replica-bytes {} ({} in use by other nodes' fragments)", what, size, budget_,
          used_));
    }
    used_ += size;
  }
  absl::StatusOr<daemon::StagingLedger::HoldPtr> hold = ledger_.Admit(uid, id.job, size);
  std::lock_guard lock(mu_);
  Step& step = steps_[key];
  if (!hold.ok() || step.sealed) {
    used_ -= size;
    if (step.fragments.empty() && !step.sealed) steps_.erase(key);
    return hold.ok() ? absl::FailedPreconditionError(fmt::format("{}: the step was sealed meanwhile", what))
                     : hold.status();
  }
  if (step.fragments.empty()) step.uid = uid;  // the first fragment's word; later ones must agree
  if (step.uid != uid) {
    used_ -= size;
    return absl::InvalidArgumentError(
        fmt::format("{}: sent for uid {}, where the step's other fragments are uid {}'s", what, uid, step.uid));
  }
  step.touched = now_();
  auto fragment = std::make_shared<HeldFragment>(HeldFragment{id, meta, std::move(bytes)});
  Entry& entry = step.fragments[id];
  if (entry.fragment) used_ -= entry.fragment->bytes.size();  // sent again: the newer replaces it
  entry = Entry{std::move(fragment), std::move(*hold)};
  return absl::OkStatus();
}

absl::StatusOr<size_t> PatchBytes(const FragmentPatch& patch, size_t fragment_bytes) {
  const uint64_t c = patch.chunk_bytes;
  if (c < kMinChecksumChunkBytes || c > kMaxChecksumChunkBytes || c % 64 != 0) {
    return absl::InvalidArgumentError(fmt::format("a patch in chunks of {} bytes (a multiple of 64 from {} to {})", c,
                                                  kMinChecksumChunkBytes, kMaxChecksumChunkBytes));
  }
  const uint64_t count = (fragment_bytes + c - 1) / c;
  size_t bytes = 0;
  for (size_t i = 0; i < patch.chunks.size(); ++i) {
    const uint32_t chunk = patch.chunks[i];
    if (chunk >= count || (i > 0 && chunk <= patch.chunks[i - 1])) {
      return absl::InvalidArgumentError(fmt::format(
          "a patch's chunk {} is out of order or past the {} chunks of a fragment of {} bytes", chunk, count,
          fragment_bytes));
    }
    bytes += static_cast<size_t>(std::min<uint64_t>(c, fragment_bytes - chunk * c));
  }
  return bytes;
}

absl::Status FragmentStore::PutPatch(uid_t uid, const FragmentId& id, const FragmentMeta& meta,
                                     const FragmentPatch& patch, std::string_view bytes) {
  const std::string what = fmt::format("fragment {} of job {} step {} rank {} from node {}, a patch of step {}",
                                       id.index, id.job, id.step, id.rank, id.owner, patch.base_step);
  if (meta.k < 1 || uint64_t{meta.k} + meta.m > static_cast<uint64_t>(kMaxFragments)) {
    return absl::InvalidArgumentError(fmt::format("{}: no {}+{} code is kept here", what, meta.k, meta.m));
  }
  const size_t size = ErasureCode::FragmentBytes(meta.data_bytes, static_cast<int>(meta.k));
  absl::StatusOr<size_t> expected = PatchBytes(patch, size);
  if (!expected.ok()) return absl::InvalidArgumentError(fmt::format("{}: {}", what, std::string(expected.status().message())));
  if (*expected != bytes.size()) {
    return absl::DataLossError(fmt::format("{}: {} bytes sent for its chunks' {}", what, bytes.size(), *expected));
  }
  if (patch.base_step == id.step) return absl::InvalidArgumentError(fmt::format("{}: a patch of itself", what));
  std::shared_ptr<const HeldFragment> base;
  {
    std::lock_guard lock(mu_);
    auto step = steps_.find({id.job, id.owner, patch.base_step});
    if (step == steps_.end() || !step->second.sealed) {
      return absl::FailedPreconditionError(fmt::format("{}: that step is not {} here", what,
                                                       step == steps_.end() ? "held" : "sealed"));
    }
    if (step->second.uid != uid) {
      return absl::FailedPreconditionError(
          fmt::format("{}: the base step is uid {}'s, not {}'s", what, step->second.uid, uid));
    }
    auto it = step->second.fragments.find({id.job, patch.base_step, id.owner, id.rank, id.index});
    if (it == step->second.fragments.end()) {
      return absl::FailedPreconditionError(fmt::format("{}: the base step's fragment is not held here", what));
    }
    base = it->second.fragment;
  }
  const FragmentMeta& was = base->meta;
  if (was.k != meta.k || was.m != meta.m || was.data_bytes != meta.data_bytes || was.run != meta.run ||
      base->bytes.size() != size) {
    return absl::FailedPreconditionError(fmt::format(
        "{}: the base fragment held here is {}+{} of {} bytes of run {}, not {}+{} of {} bytes of run {}", what, was.k,
        was.m, was.data_bytes, was.run, meta.k, meta.m, meta.data_bytes, meta.run));
  }
  // The base stays whole and shared (a restore may be reading it): the new fragment is a
  // copy with the changed chunks written over.
  std::string patched = base->bytes;
  size_t from = 0;
  for (uint32_t chunk : patch.chunks) {
    const size_t at = static_cast<size_t>(chunk) * patch.chunk_bytes;
    const size_t n = std::min<size_t>(patch.chunk_bytes, size - at);
    patched.replace(at, n, bytes.data() + from, n);
    from += n;
  }
  return Put(uid, id, meta, std::move(patched));
}

absl::Status FragmentStore::Seal(const std::string& job, uint64_t step, uint32_t owner, size_t count,
                                 std::string manifest) {
  std::lock_guard lock(mu_);
  auto it = steps_.find({job, owner, step});
  if (count == 0) {
    // The owner gives the step up (it did not commit, or not every fragment went out).
    if (it != steps_.end() && !it->second.sealed) EraseLocked(it);
    return absl::OkStatus();
  }
  const size_t held = it == steps_.end() ? 0 : it->second.fragments.size();
  if (held != count) {
    return absl::FailedPreconditionError(fmt::format(
        "job {} step {} of node {}: {} of the {} fragments sent here arrived", job, step, owner, held, count));
  }
  if (it->second.sealed) return absl::OkStatus();  // sealed again: the owner retried
  if (used_ + manifest.size() > budget_) {
    return absl::ResourceExhaustedError(fmt::format(
        "job {} step {} of node {}: its manifest of {} bytes does not fit --replica-bytes {} ({} in use)", job, step,
        owner, manifest.size(), budget_, used_));
  }
  used_ += manifest.size();
  it->second.manifest = std::make_shared<const std::string>(std::move(manifest));
  it->second.sealed = true;
  it->second.touched = now_();
  return absl::OkStatus();
}

absl::Status FragmentStore::Release(const std::string& job, uint64_t step, uint32_t owner) {
  std::lock_guard lock(mu_);
  auto it = steps_.find({job, owner, step});
  if (it == steps_.end() || !it->second.sealed) {
    return absl::FailedPreconditionError(
        fmt::format("job {} step {} of node {} is not sealed here: its older steps stay", job, step, owner));
  }
  // The owner's older steps of the job, sealed or not: every holder has the newer one. Older
  // by run, then step: a job restarted from an earlier step (a new run) replaces the steps
  // of its old run whatever their numbers.
  it->second.touched = now_();
  const auto released = std::pair{RunOf(it->second), step};
  for (auto other = steps_.lower_bound({job, owner, 0});
       other != steps_.end() && std::get<0>(other->first) == job && std::get<1>(other->first) == owner;) {
    if (other != it && std::pair{RunOf(other->second), std::get<2>(other->first)} < released) {
      EraseLocked(other++);
    } else {
      ++other;
    }
  }
  return absl::OkStatus();
}

uint64_t FragmentStore::RunOf(const Step& step) {
  return step.fragments.empty() ? 0 : step.fragments.begin()->second.fragment->meta.run;
}

void FragmentStore::EraseLocked(std::map<StepKey, Step>::iterator it) {
  for (const auto& [id, entry] : it->second.fragments) used_ -= entry.fragment->bytes.size();
  if (it->second.manifest) used_ -= it->second.manifest->size();
  steps_.erase(it);  // the holds give the job's share back
}

std::shared_ptr<const HeldFragment> FragmentStore::Find(const FragmentId& id) const {
  std::lock_guard lock(mu_);
  auto step = steps_.find({id.job, id.owner, id.step});
  if (step == steps_.end()) return nullptr;
  auto it = step->second.fragments.find(id);
  return it == step->second.fragments.end() ? nullptr : it->second.fragment;
}

std::shared_ptr<const std::string> FragmentStore::Manifest(const std::string& job, uint32_t owner,
                                                           uint64_t step) const {
  std::lock_guard lock(mu_);
  auto it = steps_.find({job, owner, step});
  return it == steps_.end() ? nullptr : it->second.manifest;
}

std::vector<HeldStep> FragmentStore::Held(const std::string& job, std::optional<uint32_t> owner) const {
  std::lock_guard lock(mu_);
  std::vector<HeldStep> out;
  auto it = job.empty() ? steps_.begin() : steps_.lower_bound({job, owner.value_or(0), 0});
  for (; it != steps_.end(); ++it) {
    const auto& [key, step] = *it;
    // Started at the first key of (job, owner): the first of another is past them all.
    if (!job.empty() && (std::get<0>(key) != job || (owner && std::get<1>(key) != *owner))) break;
    HeldStep h;
    h.job = std::get<0>(key);
    h.owner = std::get<1>(key);
    h.step = std::get<2>(key);
    h.fragments = step.fragments.size();
    h.sealed = step.sealed;
    h.uid = step.uid;
    for (const auto& [id, entry] : step.fragments) {
      h.bytes += entry.fragment->bytes.size();
      h.run = entry.fragment->meta.run;
      h.k = entry.fragment->meta.k;
      h.m = entry.fragment->meta.m;
      h.pieces.emplace_back(id.rank, id.index);
    }
    out.push_back(std::move(h));
  }
  return out;
}

void FragmentStore::DropJob(const std::string& job) {
  std::lock_guard lock(mu_);
  for (auto it = steps_.lower_bound({job, 0, 0}); it != steps_.end() && std::get<0>(it->first) == job;) {
    EraseLocked(it++);
  }
}

size_t FragmentStore::used() const {
  std::lock_guard lock(mu_);
  return used_;
}

}  // namespace ckpt::replicate
