#include "daemon/upload/uploader.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <set>
#include <tuple>
#include <utility>

#include "daemon/metrics/daemon_metrics.h"
#include "common/log.h"
#include "common/status.h"
#include "daemon/group/committed_step.h"
#include "format/checksum.h"
#include "format/indexed_manifest.h"

namespace ckpt::daemon::upload {
namespace {

using Clock = std::chrono::steady_clock;

spdlog::logger& Log() { return log::Get(log::Component::kUpload); }

// Where a node reports that its part of a step is uploaded, by the run that saved it:
// "<job>/.uploads/step-N/node-K". Beside the step's prefix rather than in it (a step holds
// only what its manifest lists), and bound to the run, so that objects of the same names
// and sizes left by another run that once reached the same step number never pass for it.
std::string ReportPrefix(const std::string& job, uint64_t step) {
  return fmt::format("{}/.uploads/step-{:08d}", job, step);
}
std::string ReportKey(const std::string& job, uint64_t step, uint32_t node) {
  return fmt::format("{}/node-{}", ReportPrefix(job, step), node);
}

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// What a shard's bytes are, for resuming its upload: the run that saved the step and the
// checksums of everything in the file. Two shards of one key that agree on it hold the same
// bytes, so the parts a failed copy sent can be completed by another copy; a step saved
// again (another run, or the same run after a restore that went back) never mixes with them.
std::string ShardVersion(const format::Manifest& m, const format::ManifestShard& shard) {
  format::Checksum sum;
  auto add = [&](const std::string& s) {
    const uint64_t n = s.size();  // length first: no two sequences of strings hash alike
    sum.Update(&n, sizeof n);
    sum.Update(s.data(), s.size());
  };
  // Everything the file's header says, as well as its data: a step saved again with the
  // same tensors but other metadata has another header.
  for (const auto& [name, tensor] : m.tensors) {
    for (const format::TensorShard& piece : tensor.shards) {
      if (piece.rank != shard.rank) continue;
      add(name);
      add(tensor.dtype);
      add(fmt::format("{}|{}|{}|{}", fmt::join(piece.shape, ","), piece.begin, piece.end, piece.checksum));
    }
  }
  for (const auto& [name, entry] : shard.train_state) add(fmt::format("{}|{}|{}|{}", name, entry.begin, entry.end, entry.checksum));
  for (const auto& [key, value] : shard.metadata) add(key + "=" + value);
  return fmt::format("{}/{}/{}/{}", m.run, m.unix_time, shard.bytes, sum.Finish());
}

// Whether `rank`'s file in `m` is its staged snapshot whole, in staging order: always up to
// version 4; in an incremental step when it references nothing (a first save, or one whose
// bytes mostly changed, which the writer streams whole). An increment's file holds only its
// changed chunks, laid out anew, and its staging block may still be filling frozen tensors.
bool HoldsWholeSnapshot(const format::Manifest& m, uint32_t rank) {
  if (!m.increment) return true;
  for (const auto& [name, tensor] : m.tensors) {
    for (const format::TensorShard& piece : tensor.shards) {
      if (piece.rank == rank && !piece.extents.empty()) return false;
    }
  }
  for (const format::ManifestShard& shard : m.shards) {
    if (shard.rank != rank) continue;
    for (const auto& [name, entry] : shard.train_state) {
      if (entry.step.has_value()) return false;
    }
  }
  return true;
}

}  // namespace

Uploader::Uploader(format::CheckpointStore& local, format::CheckpointStore& remote,
                   persist::RetentionKeeper& local_retention, Options options,
                   std::function<void(const std::string&)> uploaded,
                   std::function<void(const std::string&)> on_error)
    : local_(local), remote_(remote), retention_(local_retention), options_(options),
      uploaded_(std::move(uploaded)), on_error_(std::move(on_error)) {
  thread_ = std::thread([this] {
    CatchUp();
    Loop();
  });
}

Uploader::~Uploader() { Stop(); }

void Uploader::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  // Requests in flight end now, not after a gateway that stopped answering has timed each
  // attempt out; the upload resumes at the next start.
  remote_.objects().Cancel();
  if (thread_.joinable()) thread_.join();
}

void Uploader::Committed(const format::Manifest& manifest, std::map<uint32_t, InMemoryShard> in_memory) {
  std::lock_guard lock(mu_);
  if (stopping_) return;
  JobState& job = jobs_[manifest.job];
  const UploadPolicy policy = options_.policies->For(manifest.job);
  if (!OnStepGrid(policy, manifest.step)) return;
  const bool due = ShouldUpload(policy, manifest.step, manifest.unix_time, job.previous);
  job.previous = manifest.unix_time;
  if (!due) return;
  // The pin is taken here, before the commit hook schedules local retention.
  job.queued = Pending{manifest,
                       std::make_unique<persist::RetentionKeeper::Pin>(retention_, manifest.job,
                                                                       manifest.step),
                       Clock::now(), std::move(in_memory), /*index=*/{}};
  job.retry_at = {};
  cv_.notify_all();
}

void Uploader::CatchUp() {
  absl::StatusOr<std::vector<std::string>> jobs = local_.ListJobs();
  if (!jobs.ok()) {
    Log().warn("cannot list local jobs to resume uploads: {}", Message(jobs.status()));
    return;
  }
  for (const std::string& job : *jobs) {
    AbortLeftUploads(job);
    absl::StatusOr<std::vector<uint64_t>> steps = local_.ListStepsInRunOrder(job);
    if (!steps.ok()) continue;
    for (auto it = steps->rbegin(); it != steps->rend(); ++it) {
      if (!OnStepGrid(options_.policies->For(job), *it)) continue;
      // Only the newest step on the grid: what a restart interrupted, or what a newer
      // policy would have picked anyway.
      if (remote_.Committed(job, *it)) break;
      // As committed here: an indexed step's index, joined when its upload begins.
      absl::StatusOr<format::Manifest> manifest =
          local_.LoadManifest(job, *it, format::CheckpointStore::Depth::kIndexOnly);
      if (!manifest.ok()) break;
      std::lock_guard lock(mu_);
      JobState& state = jobs_[job];
      if (!state.queued) {
        Log().info("[{} s{}] not in the remote tier yet: uploading it", job, *it);
        state.queued = Pending{*manifest,
                               std::make_unique<persist::RetentionKeeper::Pin>(retention_, job, *it),
                               Clock::now(), /*in_memory=*/{}, /*index=*/{}};
      }
      break;
    }
  }
}

void Uploader::AbortLeftUploads(const std::string& job) {
  absl::StatusOr<std::vector<storage::UnfinishedUpload>> left = remote_.objects().ListUnfinishedUploads(job);
  if (!left.ok()) {
    Log().warn("[{}] cannot list the multipart uploads an earlier ckptd left unfinished: {}", job,
               Message(left.status()));
    return;
  }
  // This node's own files only ("<job>/step-N/<file>", of a step it holds, a file it
  // uploads): in a group the other nodes upload theirs beside them, perhaps right now.
  // Nothing of this process is in flight yet, so every one of those is an earlier one's.
  std::map<uint64_t, std::set<std::string>> mine;  // by step, read once each
  int aborted = 0;
  for (const storage::UnfinishedUpload& u : *left) {
    const std::string rest = u.key.substr(std::min(u.key.size(), job.size() + 1));
    const size_t slash = rest.find('/');
    uint64_t step = 0;
    if (u.key.compare(0, job.size() + 1, job + "/") != 0 || slash == std::string::npos ||
        !format::ParseStepDirName(rest.substr(0, slash), &step)) {
      continue;
    }
    if (!mine.count(step)) {
      std::set<std::string>& files = mine[step];
      if (absl::StatusOr<format::Manifest> m = local_.LoadManifest(job, step); m.ok()) {
        for (const format::ManifestShard* shard : ShardsToUpload(*m)) files.insert(shard->file);
      }
    }
    if (!mine[step].count(rest.substr(slash + 1))) continue;
    if (absl::Status s = remote_.objects().AbortUpload(u); !s.ok()) {
      Log().warn("[{} s{}] cannot abort the unfinished upload of {}: {}", job, step,
                 remote_.objects().Describe(u.key), Message(s));
      continue;
    }
    ++aborted;
  }
  if (aborted > 0) {
    Log().info("[{}] aborted {} multipart upload(s) of this node's files that an earlier ckptd left unfinished", job,
               aborted);
  }
}

std::vector<const format::ManifestShard*> Uploader::ShardsToUpload(const format::Manifest& manifest) const {
  std::set<uint32_t> ranks;
  if (options_.node) {
    for (const format::ManifestNode& n : manifest.nodes) {
      if (n.node == *options_.node) ranks.insert(n.ranks.begin(), n.ranks.end());
    }
  }
  std::vector<const format::ManifestShard*> shards;
  for (const format::ManifestShard& s : manifest.shards) {
    if (!options_.node || ranks.count(s.rank)) shards.push_back(&s);
  }
  return shards;
}

absl::StatusOr<std::map<std::string, uint64_t>> Uploader::RemoteSizes(const std::string& prefix) {
  CKPT_ASSIGN_OR_RETURN(std::vector<storage::ListEntry> there, remote_.objects().List(prefix));
  std::map<std::string, uint64_t> sizes;
  for (const storage::ListEntry& e : there) {
    if (!e.is_prefix) sizes[e.name] = e.bytes;
  }
  return sizes;
}

void Uploader::SetState(const std::string& state) {
  std::lock_guard lock(mu_);
  progress_.state = state;
}

bool Uploader::StoppingOrReplaced(const std::string& job) {
  std::lock_guard lock(mu_);
  return stopping_ || jobs_[job].queued.has_value();
}

absl::Status Uploader::CopyFile(const Pending& p, const format::ManifestShard& shard) {
  const format::Manifest& m = p.manifest;
  // Objects go where the remote store writes a step before it is published: the step's
  // own keys on S3, where the manifest alone publishes it.
  const std::string key = remote_.TempStepKey(m.job, m.step) + "/" + shard.file;
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<storage::ObjectReader> in,
                        local_.objects().Open(format::CheckpointStore::StepKey(m.job, m.step) + "/" + shard.file));
  // MemoryFirst checks too that the file's data region is as long as the staged one.
  if (auto it = p.in_memory.find(shard.rank); it != p.in_memory.end() && HoldsWholeSnapshot(m, shard.rank)) {
    in = MemoryFirst(std::move(in), it->second, &from_memory_);
  }
  // CopyFrom checks that every byte arrived. A copy that a gateway's outage cut short
  // resumes with the parts it sent, and only for the same bytes (ShardVersion).
  return remote_.objects().CopyFrom(*in, key, [this](uint64_t n) {
    std::lock_guard lock(mu_);
    if (stopping_) return absl::CancelledError("ckptd is stopping");
    progress_.bytes_done += n;
    return absl::OkStatus();
  }, ShardVersion(m, shard)).status();
}

std::map<format::StepRun, std::vector<format::Origin>> Uploader::OriginsToUpload(const format::Manifest& m) const {
  std::map<format::StepRun, std::vector<format::Origin>> by_step;
  if (!m.increment) return by_step;
  std::set<uint32_t> ranks;
  for (const format::ManifestShard* s : ShardsToUpload(m)) ranks.insert(s->rank);
  for (const format::Origin& o : m.increment->origins) {
    if (ranks.count(o.rank)) by_step[{o.step, o.run}].push_back(o);
  }
  return by_step;
}

absl::StatusOr<std::optional<std::string>> Uploader::RemoteOrigin(const std::string& job, const format::Origin& origin) {
  // Beside the step's own files (published, retired or carried on an object store), or
  // where a store that renames keeps carried ones.
  std::vector<std::string> keys = {format::CheckpointStore::StepKey(job, origin.step) + "/" + origin.file,
                                   remote_.CarriedFileKey(job, {origin.step, origin.run}, origin.file)};
  for (const std::string& key : keys) {
    const size_t slash = key.rfind('/');
    CKPT_ASSIGN_OR_RETURN(const auto sizes, RemoteSizes(key.substr(0, slash)));
    auto it = sizes.find(key.substr(slash + 1));
    if (it != sizes.end() && it->second == origin.bytes) return std::optional<std::string>(key);
  }
  return std::optional<std::string>();
}

absl::Status Uploader::CarryOrigins(const format::Manifest& m) {
  const uint32_t node = options_.node.value_or(0);
  for (const auto& [step_run, origins] : OriginsToUpload(m)) {
    std::vector<format::HeldFile> missing;
    for (const format::Origin& o : origins) {
      CKPT_ASSIGN_OR_RETURN(std::optional<std::string> there, RemoteOrigin(m.job, o));
      if (!there) missing.push_back({o.file, o.bytes});
    }
    if (missing.empty()) continue;
    {
      std::lock_guard lock(mu_);
      for (const format::HeldFile& f : missing) progress_.bytes_total += f.bytes;
    }
    // The record first: a kill before the files leaves nothing that no record names, and the
    // remote retention keeps what it names while this step may still be published.
    CKPT_RETURN_IF_ERROR(remote_.RecordCarried(m.job, step_run, node, m.step, missing));
    for (const format::HeldFile& f : missing) {
      // Where this node's disk keeps it: the step, or its held directory once retired here.
      std::unique_ptr<storage::ObjectReader> in;
      absl::Status opened = absl::NotFoundError("no key");
      for (const std::string& key : format::OriginFileKeys({step_run.step, step_run.run, 0, f.file, f.bytes})) {
        absl::StatusOr<std::unique_ptr<storage::ObjectReader>> o = local_.objects().Open(m.job + "/" + key);
        if (o.ok()) {
          in = std::move(*o);
          break;
        }
        opened = o.status();
      }
      if (!in) {
        return absl::DataLossError(fmt::format("step {} references {} of step {}, which this node no longer holds: {}",
                                               m.step, f.file, step_run.step, Message(opened)));
      }
      if (in->size() != f.bytes) {
        return absl::DataLossError(fmt::format("{} is {} bytes here; step {} references {}", in->name(), in->size(),
                                               m.step, f.bytes));
      }
      CKPT_RETURN_IF_ERROR(remote_.objects()
                               .CopyFrom(*in, remote_.CarriedFileKey(m.job, step_run, f.file),
                                         [this](uint64_t n) {
                                           std::lock_guard lock(mu_);
                                           if (stopping_) return absl::CancelledError("ckptd is stopping");
                                           progress_.bytes_done += n;
                                           return absl::OkStatus();
                                         },
                                         fmt::format("carried/{:016x}/{}", step_run.run, f.bytes))
                               .status());
      Log().info("[{} s{}] carried {} of step {} ({} bytes) to the remote tier: it references it", m.job, m.step,
                 f.file, step_run.step, f.bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status Uploader::CheckOrigins(const format::Manifest& m) {
  std::vector<format::Origin> all;
  for (const auto& [step_run, origins] : OriginsToUpload(m)) all.insert(all.end(), origins.begin(), origins.end());
  return CheckOrigins(m, all);
}

absl::Status Uploader::CheckOrigins(const format::Manifest& m, const std::vector<format::Origin>& origins) {
  // One listing per place a file may be (a step's prefix, or a store's held directory), not
  // one per file: a publisher checks every rank's origins of a large group.
  std::map<std::string, std::map<std::string, uint64_t>> listed;
  for (const format::Origin& o : origins) {
    bool there = false;
    for (const std::string& key : {format::CheckpointStore::StepKey(m.job, o.step) + "/" + o.file,
                                   remote_.CarriedFileKey(m.job, {o.step, o.run}, o.file)}) {
      const size_t slash = key.rfind('/');
      const std::string prefix = key.substr(0, slash);
      if (!listed.count(prefix)) {
        CKPT_ASSIGN_OR_RETURN(listed[prefix], RemoteSizes(prefix));
      }
      auto it = listed[prefix].find(key.substr(slash + 1));
      if (it != listed[prefix].end() && it->second == o.bytes) {
        there = true;
        break;
      }
    }
    if (!there) {
      return absl::DataLossError(fmt::format("{} of step {}, which step {} references, is not in the remote tier "
                                             "({} bytes)", o.file, o.step, m.step, o.bytes));
    }
  }
  return absl::OkStatus();
}

absl::Status Uploader::CheckUploaded(const format::Manifest& manifest) {
  CKPT_ASSIGN_OR_RETURN(const auto sizes, RemoteSizes(remote_.TempStepKey(manifest.job, manifest.step)));
  for (const format::ManifestShard& s : manifest.shards) {
    auto it = sizes.find(s.file);
    if (it == sizes.end() || it->second != s.bytes) {
      return absl::DataLossError(fmt::format("rank {}'s file {} is not in the remote tier as uploaded ({} bytes)",
                                             s.rank, s.file, s.bytes));
    }
  }
  return absl::OkStatus();
}

namespace {

// Where this node holds the whole step's manifest (node 0, when the coordinator assembled
// it): whether `r` reports exactly the ranks and shard sizes it gives the reporting node.
bool AgreesWithWhole(const format::Manifest& manifest, const PartReport& r) {
  if (manifest.scope) return true;  // this node's own ranks only: nothing to compare
  std::vector<uint32_t> ranks;
  for (const format::ManifestNode& n : manifest.nodes) {
    if (n.node == r.node) ranks = n.ranks;
  }
  if (ranks != r.ranks) return false;
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const format::ManifestShard* shard = manifest.Shard(r.ranks[i]);
    if (shard == nullptr || shard->bytes != r.shard_bytes[i] || shard->file != r.files[i]) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<PartReport>> Uploader::WaitForReports(const format::Manifest& manifest,
                                                                  Clock::duration own_upload_took) {
  const std::string prefix = remote_.TempStepKey(manifest.job, manifest.step);
  const uint32_t me = *options_.node;
  std::vector<bool> mine(manifest.world_size, false);
  for (const format::ManifestShard& s : manifest.shards) {
    if (s.rank < manifest.world_size && (manifest.scope || manifest.NodeOf(s.rank) == me)) mine[s.rank] = true;
  }
  const Clock::time_point start = Clock::now();
  bool announced = false;
  while (true) {
    CKPT_ASSIGN_OR_RETURN(const auto sizes, RemoteSizes(prefix));
    // The other nodes' reports of this run's step whose files are all there, as reported.
    std::vector<bool> held = mine;
    std::vector<PartReport> reports;
    std::optional<std::string> digest;
    if (manifest.scope) digest = manifest.scope->digest;
    if (auto listed = remote_.objects().List(ReportPrefix(manifest.job, manifest.step)); listed.ok()) {
      for (const storage::ListEntry& e : *listed) {
        if (e.is_prefix) continue;
        const std::string key = ReportPrefix(manifest.job, manifest.step) + "/" + e.name;
        absl::StatusOr<std::string> text = remote_.objects().Get(key, kMaxPartReportBytes);
        if (!text.ok()) continue;
        absl::StatusOr<PartReport> r = ParsePartReport(*text, remote_.objects().Describe(key));
        // Each node reports under its own name, once; of this run, and of the commit the
        // others' (or this node's own manifest) name.
        if (!r.ok() || e.name != fmt::format("node-{}", r->node) || r->run != manifest.run || r->node == me ||
            (digest && r->digest != *digest) || !AgreesWithWhole(manifest, *r)) {
          continue;
        }
        // A version 5 step's parts report their origins (pinned and checked before the index
        // goes up), of this very step: a report without them cannot be indexed.
        std::string unfit;
        if (manifest.increment && !r->increment) {
          unfit = "names no origins, but the step is incremental (written by an older ckptd?)";
        } else if (!manifest.increment && r->increment) {
          unfit = "names origins, but the step is not incremental here";
        } else if (r->increment && r->step != manifest.step) {
          unfit = fmt::format("is of step {}", r->step.value_or(0));
        } else if (r->increment) {
          unfit = format::IncrementProblem(*r->increment, manifest.step, /*is_index=*/false);
        }
        if (!unfit.empty()) {
          if (warned_reports_.insert({manifest.job, manifest.step, r->node}).second) {
            Log().warn("[{} s{}] node {}'s upload report {}: not indexed; waiting for another", manifest.job,
                       manifest.step, r->node, unfit);
          }
          continue;
        }
        auto there = [&](const std::string& file, uint64_t bytes) {
          auto it = sizes.find(file);
          return it != sizes.end() && it->second == bytes;
        };
        bool whole = there(format::ManifestPartFileName(r->node), r->part_bytes);
        for (size_t i = 0; i < r->ranks.size() && whole; ++i) {
          whole = r->ranks[i] < held.size() && !held[r->ranks[i]] && there(r->files[i], r->shard_bytes[i]);
        }
        if (!whole) continue;
        for (uint32_t rank : r->ranks) held[rank] = true;
        digest = r->digest;
        reports.push_back(std::move(*r));
      }
    }
    std::vector<uint32_t> missing;  // ranks
    for (uint32_t rank = 0; rank < held.size(); ++rank) {
      if (!held[rank]) missing.push_back(rank);
    }
    if (missing.empty()) return reports;
    // Where this node holds the whole step's manifest it can name the nodes.
    std::set<uint32_t> nodes;
    for (uint32_t r : missing) {
      if (std::optional<uint32_t> n = manifest.NodeOf(r); n && !manifest.scope) nodes.insert(*n);
    }
    const std::string who = fmt::format("{}ranks {}{}", nodes.empty() ? "" : fmt::format("node(s) {}: ", fmt::join(nodes, ", ")),
                                        fmt::join(missing.begin(), missing.begin() + std::min<size_t>(missing.size(), 8), ", "),
                                        missing.size() > 8 ? ", ..." : "");
    if (!announced) {
      SetState("waiting for nodes");
      announced = true;
    }
    const Clock::duration waited = Clock::now() - start;
    if (waited > options_.wait_for_parts) {
      return absl::DeadlineExceededError(fmt::format(
          "the nodes of {} did not upload their part within {} s", who,
          std::chrono::duration_cast<std::chrono::seconds>(options_.wait_for_parts).count()));
    }
    // Nodes pick the newest committed step when they are behind, and may have picked a
    // newer one than this: once a newer step is queued here, wait only as long as the
    // others could plausibly still be uploading this one.
    if (waited > 2 * own_upload_took + std::chrono::seconds(30) && StoppingOrReplaced(manifest.job)) {
      return absl::CancelledError(fmt::format("a newer step is queued and the nodes of {} have not uploaded "
                                              "their part of this one", who));
    }
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, options_.poll, [this] { return stopping_; });
    if (stopping_) return absl::CancelledError("ckptd is stopping");
  }
}

absl::Status Uploader::Upload(Pending& p) {
  if (p.manifest.index) {
    // An indexed step (a shared root's, too large for one manifest) was announced by its
    // index: its files are listed in its parts, joined here, off the commit path.
    CKPT_ASSIGN_OR_RETURN(format::Manifest whole, local_.LoadManifest(p.manifest.job, p.manifest.step));
    p.index = std::exchange(p.manifest, std::move(whole));
  }
  const format::Manifest& m = p.manifest;
  if (options_.before_upload) {
    absl::Status ready = options_.before_upload(m.job);
    before_upload_waiting_ = absl::IsDeadlineExceeded(ready);
    CKPT_RETURN_IF_ERROR(ready);
  }
  if (remote_.Committed(m.job, m.step)) {
    // Uploaded before a restart; or a step of the same number from another run, which is
    // not this one and is never replaced behind a reader's back.
    CKPT_ASSIGN_OR_RETURN(format::Manifest there,
                          remote_.LoadManifest(m.job, m.step, format::CheckpointStore::Depth::kIndexOnly));
    if (there.run == m.run) return absl::OkStatus();
    return absl::AlreadyExistsError(fmt::format(
        "the remote tier already holds a step {} of job {} saved by another run; this run's step "
        "{} stays local (delete the remote one to upload it)", m.step, m.job, m.step));
  }
  // What an earlier attempt of this process at this very step already sent is not sent
  // again (each object is whole or absent: a multipart upload appears only once completed).
  // Objects found from before (a restart, another run) are sent again: their names and
  // sizes do not say which run wrote them.
  std::map<std::string, uint64_t> sizes;
  const auto attempt = std::make_tuple(m.job, m.step, m.run);
  if (attempted_.count(attempt)) {
    CKPT_ASSIGN_OR_RETURN(sizes, RemoteSizes(remote_.TempStepKey(m.job, m.step)));
  }
  attempted_.insert(attempt);
  // An incremental step's origins: pinned in the remote retention once no removal of them is
  // under way, so that what is found there now stays; then carried where missing.
  std::vector<std::unique_ptr<persist::RetentionKeeper::Pin>> origin_pins;
  if (m.increment && options_.remote_retention != nullptr) {
    for (const format::StepRun& o : m.increment->origin_steps) {
      origin_pins.push_back(persist::RetentionKeeper::Pin::AfterRemoval(*options_.remote_retention, m.job, o.step));
    }
  }
  std::vector<const format::ManifestShard*> todo;
  {
    std::lock_guard lock(mu_);
    progress_.bytes_total = progress_.bytes_done = 0;
    for (const format::ManifestShard* s : ShardsToUpload(m)) {
      progress_.bytes_total += s->bytes;
      if (auto it = sizes.find(s->file); it != sizes.end() && it->second == s->bytes) {
        progress_.bytes_done += s->bytes;
      } else {
        todo.push_back(s);
      }
    }
  }
  const Clock::time_point start = Clock::now();
  CKPT_RETURN_IF_ERROR(CarryOrigins(m));
  // Several files at once (each with the store's own parallel parts): one rank's file alone
  // rarely fills the link.
  std::atomic<size_t> next{0};
  std::mutex first_error_mu;
  absl::Status first_error;
  auto work = [&] {
    for (size_t i = next++; i < todo.size(); i = next++) {
      absl::Status copied = CopyFile(p, *todo[i]);
      if (!copied.ok()) {
        std::lock_guard lock(first_error_mu);
        if (first_error.ok()) first_error = copied;
        next = todo.size();  // the others finish the file they are on
      }
    }
  };
  std::vector<std::thread> workers;
  const size_t threads = std::min<size_t>(todo.size(), static_cast<size_t>(std::max(options_.parallel_files, 1)));
  for (size_t t = 1; t < threads; ++t) workers.emplace_back(work);
  work();
  for (std::thread& t : workers) t.join();
  CKPT_RETURN_IF_ERROR(first_error);
  if (!options_.node) {
    // One daemon, or a shared root's coordinator: every file is this node's to upload.
    CKPT_RETURN_IF_ERROR(CheckUploaded(m));
    CKPT_RETURN_IF_ERROR(CheckOrigins(m));
    return PublishManifest(m, p.index);  // the manifest, last
  }
  // A group with node-local disks: the step goes up as an index and each node's own
  // manifest (format/indexed_manifest.h), which no node but its own holds.
  if (!options_.publishes) {
    // This node's part is there: its manifest, then the report that tells the publisher.
    if (!m.scope) return absl::FailedPreconditionError("this node's manifest of the step is not node-scoped");
    CKPT_RETURN_IF_ERROR(CheckOrigins(m));  // what its ranks reference is there, carried or found
    CKPT_ASSIGN_OR_RETURN(std::string text, LocalManifestText(m));
    CKPT_RETURN_IF_ERROR(
        remote_.objects().Put(remote_.TempStepKey(m.job, m.step) + "/" + format::ManifestPartFileName(*options_.node), text));
    return remote_.objects().Put(ReportKey(m.job, m.step, *options_.node), PartReportJson(ReportOf(m, m.scope->digest, text)));
  }
  CKPT_ASSIGN_OR_RETURN(std::vector<PartReport> reports, WaitForReports(m, Clock::now() - start));
  // The other nodes' origins, as this node's: pinned in the remote retention (a removal under
  // way finishes first), then found there, so that none goes before the index that holds it
  // is published. A node found its origins there before reporting; retention may have run
  // since (a node restored an older step and references what no kept step does).
  for (const PartReport& r : reports) {
    if (!r.increment || options_.remote_retention == nullptr) continue;
    for (const format::StepRun& o : r.increment->origin_steps) {
      origin_pins.push_back(persist::RetentionKeeper::Pin::AfterRemoval(*options_.remote_retention, m.job, o.step));
    }
  }
  CKPT_RETURN_IF_ERROR(CheckOrigins(m));
  std::vector<format::Origin> theirs;
  for (const PartReport& r : reports) {
    if (r.increment) theirs.insert(theirs.end(), r.increment->origins.begin(), r.increment->origins.end());
  }
  CKPT_RETURN_IF_ERROR(CheckOrigins(m, theirs));
  if (reports.empty()) return PublishManifest(m, p.index);  // every rank of the step is this node's
  CKPT_RETURN_IF_ERROR(PublishIndex(m, reports));
  (void)remote_.objects().RemovePrefix(ReportPrefix(m.job, m.step));  // leftovers: RemoveOrphans
  return absl::OkStatus();
}

absl::StatusOr<std::string> Uploader::LocalManifestText(const format::Manifest& m) {
  return local_.objects().Get(format::CheckpointStore::StepKey(m.job, m.step) + "/manifest.json",
                              format::CheckpointStore::kMaxManifestBytes);
}

PartReport Uploader::ReportOf(const format::Manifest& part, const std::string& digest, const std::string& text) const {
  PartReport r;
  r.run = part.run;
  r.node = options_.node.value_or(0);
  r.digest = digest;
  for (const format::ManifestShard& s : part.shards) {
    r.ranks.push_back(s.rank);
    r.shard_bytes.push_back(s.bytes);
    r.files.push_back(s.file);  // tagged in version 5: the name the part gives it
  }
  r.part_bytes = text.size();
  r.part_checksum = format::ManifestDigest(text);
  if (part.increment) {
    r.increment = part.increment;
    r.step = part.step;
  }
  return r;
}

absl::Status Uploader::PublishIndex(const format::Manifest& m, const std::vector<PartReport>& reports) {
  const uint32_t node = *options_.node;
  // This node's part: its own manifest as committed here, or, where it holds the whole
  // step's (node 0, when the coordinator assembled it), its ranks cut from it, scoped to the
  // commit the other nodes' parts name.
  const std::string& digest = m.scope ? m.scope->digest : reports.front().digest;
  format::Manifest mine = m.scope ? m : group::NodeManifestFromWhole(m, digest, node);
  std::string text;
  if (m.scope) {
    CKPT_ASSIGN_OR_RETURN(text, LocalManifestText(m));
  } else {
    text = format::ManifestToJson(mine);
  }
  const std::string to = remote_.TempStepKey(m.job, m.step) + "/";
  format::Manifest index = format::IndexHeader(mine);
  std::vector<PartReport> parts = reports;
  if (!mine.shards.empty()) {
    CKPT_RETURN_IF_ERROR(remote_.objects().Put(to + format::ManifestPartFileName(node), text));
    parts.push_back(ReportOf(mine, digest, text));
  }
  std::sort(parts.begin(), parts.end(), [](const PartReport& a, const PartReport& b) { return a.node < b.node; });
  for (const PartReport& r : parts) {
    // In version 5 the index's origin steps are the union of its parts' (what the remote
    // retention holds by); its own and referenced bytes, the whole step's, are every part's.
    format::AddToIndex(index, {r.node, r.ranks}, r.part_bytes, r.part_checksum,
                       r.increment ? r.increment->origin_steps : std::vector<format::StepRun>{});
  }
  // What readers will check of it, before it is the step's commit marker: an index no reader
  // accepts would be a step that neither restores nor is ever cleaned up.
  CKPT_RETURN_IF_ERROR(format::ParseManifest(format::ManifestToJson(index), "the step's index").status());
  return remote_.Commit(index);  // the index, last
}

absl::Status Uploader::PublishManifest(const format::Manifest& m, const std::optional<format::Manifest>& index) {
  // A step too large for one manifest was published here as an index and a part per node
  // (format/indexed_manifest.h): the remote tier gets the same files, the index last, so that
  // its readers join the parts the index names by their checksums.
  if (!index) return remote_.Commit(m);
  const std::string from = format::CheckpointStore::StepKey(m.job, m.step) + "/";
  const std::string to = remote_.TempStepKey(m.job, m.step) + "/";
  for (const format::ManifestPart& part : index->index->parts) {
    CKPT_ASSIGN_OR_RETURN(std::string text,
                          local_.objects().Get(from + part.file, format::CheckpointStore::kMaxManifestBytes));
    CKPT_RETURN_IF_ERROR(remote_.objects().Put(to + part.file, text));
  }
  return remote_.Commit(*index);
}

void Uploader::RemoveOrphans(const std::string& job, uint64_t published) {
  if (auto reports = remote_.objects().List(job + "/.uploads"); reports.ok()) {
    for (const storage::ListEntry& e : *reports) {
      uint64_t step;
      if (e.is_prefix && format::ParseStepDirName(e.name, &step) && step < published) {
        (void)remote_.objects().RemovePrefix(ReportPrefix(job, step));
      }
    }
  }
  absl::StatusOr<std::vector<storage::ListEntry>> entries = remote_.objects().List(job);
  if (!entries.ok()) return;
  for (const storage::ListEntry& e : *entries) {
    uint64_t step;
    if (!e.is_prefix || !format::ParseStepDirName(e.name, &step) || step >= published) continue;
    {
      std::lock_guard lock(mu_);
      auto it = jobs_.find(job);
      if (it != jobs_.end() && it->second.queued && it->second.queued->manifest.step == step) continue;
    }
    if (remote_.Committed(job, step)) continue;
    absl::Status removed = remote_.AbortStep(job, step);
    if (removed.ok()) {
      Log().info("[{} s{}] removed an unfinished remote step (older than step {})", job, step,
                 published);
    } else {
      Log().warn("[{} s{}] cannot remove an unfinished remote step: {}", job, step, Message(removed));
    }
  }
}

absl::StatusOr<Uploader::Pending> Uploader::FollowedFromDisk(const std::string& job, uint64_t step) {
  // Pinned before it is looked at: retention cannot delete it in between.
  auto pin = std::make_unique<persist::RetentionKeeper::Pin>(retention_, job, step);
  absl::StatusOr<format::Manifest> manifest = local_.LoadManifest(job, step);
  if (manifest.ok()) return Pending{*std::move(manifest), std::move(pin), Clock::now(), /*in_memory=*/{}, /*index=*/{}};
  absl::StatusOr<std::vector<uint64_t>> steps = local_.ListSteps(job);
  if (steps.ok() && (steps->empty() || steps->back() < step)) {
    return absl::UnavailableError(fmt::format("[{} s{}] not committed on this node yet", job, step));
  }
  return absl::NotFoundError(fmt::format(
      "[{} s{}] node 0 uploads this step, but this node no longer holds it (deleted by local "
      "retention): its part is not uploaded; --keep-last larger than the steps committed during "
      "an upload avoids this", job, step));
}

void Uploader::Loop() {
  while (true) {
    std::string job;
    std::optional<uint64_t> followed;  // Options::follow: the publisher's step
    {
      std::unique_lock lock(mu_);
      Clock::time_point wake = Clock::time_point::max();
      while (!stopping_) {
        const Clock::time_point now = Clock::now();
        wake = Clock::time_point::max();
        for (auto& [name, state] : jobs_) {
          if (options_.follow) {
            followed = options_.follow(name);
            if (!followed || followed == state.followed) continue;
          } else if (!state.queued) {
            continue;
          }
          if (state.retry_at <= now) {
            job = name;
            break;
          }
          wake = std::min(wake, state.retry_at);
        }
        if (!job.empty()) break;
        // A follower looks for the publisher's next step as the heartbeats bring it.
        if (options_.follow) wake = std::min(wake, now + options_.poll);
        if (wake == Clock::time_point::max()) {
          cv_.wait(lock);
        } else {
          cv_.wait_until(lock, wake);
        }
      }
      if (stopping_) return;
      JobState& state = jobs_[job];
      if (!followed || (state.queued && state.queued->manifest.step == *followed)) {
        current_ = std::move(state.queued);
        state.queued.reset();
      }
    }
    if (!current_) {
      absl::StatusOr<Pending> from_disk = FollowedFromDisk(job, *followed);
      std::lock_guard lock(mu_);
      if (absl::IsUnavailable(from_disk.status())) {
        jobs_[job].retry_at = Clock::now() + options_.poll;
        continue;
      }
      if (!from_disk.ok()) {
        Log().warn("{}", Message(from_disk.status()));
        jobs_[job].followed = followed;
        continue;
      }
      current_ = std::move(*from_disk);
    }
    if (options_.announce) options_.announce(job, current_->manifest.step);
    {
      std::lock_guard lock(mu_);
      progress_ = UploadProgress{};
      progress_.job = job;
      progress_.step = current_->manifest.step;
      progress_.state = "uploading";
      progress_.last_error = jobs_[job].last_error;
    }
    const uint64_t step = current_->manifest.step;
    const Clock::time_point started = Clock::now();
    from_memory_ = 0;
    before_upload_waiting_ = false;
    absl::Status s = Upload(*current_);
    std::unique_lock lock(mu_);
    JobState& state = jobs_[job];
    const bool was_waiting = std::exchange(state.waiting, false);
    if (s.ok()) {
      metrics::Metrics().upload_seconds.With({}).Observe(SecondsSince(started));
      metrics::Metrics().uploaded_bytes.With({}).Add(static_cast<double>(progress_.bytes_total));
      Log().info("[{} s{}] in the remote tier {} ({} bytes from this node in {:.2f} s, {} of them "
                 "read from staging memory)", job, step,
                 options_.publishes ? "(manifest written)" : "(this node's part)",
                 progress_.bytes_total, SecondsSince(started), from_memory_.load());
      for (auto it = attempted_.begin(); it != attempted_.end();) {  // bounded by the queue
        it = std::get<0>(*it) == job && std::get<1>(*it) <= step ? attempted_.erase(it) : std::next(it);
      }
      for (auto it = warned_reports_.begin(); it != warned_reports_.end();) {
        it = std::get<0>(*it) == job && std::get<1>(*it) <= step ? warned_reports_.erase(it) : std::next(it);
      }
      state.failures = 0;
      state.last_error.clear();
      if (options_.follow) state.followed = step;
      if (options_.publishes) {
        // Housekeeping before the step counts as done, so that status shows it going on.
        progress_.state = "removing unfinished older steps";
        lock.unlock();
        RemoveOrphans(job, step);
        uploaded_(job);
        lock.lock();
        Published& published = last_uploaded_[job];
        if (step >= published.step) published = {step, current_->manifest.unix_time};
      }
      current_.reset();
      continue;
    }
    if (stopping_) {
      current_.reset();
      return;
    }
    const std::string message = fmt::format("[{} s{}] upload: {}", job, step, Message(s));
    state.last_error = Message(s);
    if (before_upload_waiting_) {
      // Nothing failed yet: the answer the step waits for has not come. Asked again soon,
      // with no back-off (the question itself goes on meanwhile), and said once.
      state.waiting = true;
      state.retry_at = Clock::now() + options_.waiting_retry;
      if (!state.queued) state.queued = std::move(current_);  // else the newer step waits instead
      current_.reset();
      if (!was_waiting) {
        metrics::Metrics().UploadError(s);
        Log().warn("{}", message);
        lock.unlock();
        on_error_(message);
      }
      continue;
    }
    metrics::Metrics().Fail(metrics::Cause::kStorage);
    metrics::Metrics().UploadError(s);
    if (absl::IsAlreadyExists(s)) {
      // Retrying cannot help: said once, on the log and status.
      Log().error("{}", message);
      if (options_.follow) state.followed = step;
      current_.reset();
      lock.unlock();
      on_error_(message);
      continue;
    }
    if (absl::IsCancelled(s) || (state.queued && !options_.follow)) {
      // A newer step waits: it replaces this one (its objects go as orphans). A follower
      // retries the publisher's step until the publisher moves on.
      Log().warn("{}; uploading step {} instead", message,
                 state.queued ? state.queued->manifest.step : step);
      current_.reset();
      continue;
    }
    state.failures++;
    const auto backoff = std::min<Clock::duration>(
        options_.max_backoff, options_.first_backoff * (1 << std::min(state.failures - 1, 6)));
    Log().warn("{} (attempt {}); retrying in {:.0f} s", message, state.failures,
               std::chrono::duration<double>(backoff).count());
    state.retry_at = Clock::now() + backoff;
    if (!state.queued) state.queued = std::move(current_);  // else a follower's newer one stays
    current_.reset();
    lock.unlock();
    on_error_(message);
  }
}

std::vector<UploadProgress> Uploader::InProgress() const {
  std::lock_guard lock(mu_);
  std::vector<UploadProgress> out;
  if (current_) {
    UploadProgress p = progress_;
    p.age_s = SecondsSince(current_->queued);
    out.push_back(std::move(p));
  }
  for (const auto& [job, state] : jobs_) {
    if (!state.queued) continue;
    UploadProgress p;
    p.job = job;
    p.step = state.queued->manifest.step;
    p.state = state.waiting ? "waiting" : state.failures > 0 ? "retrying" : "queued";
    p.last_error = state.last_error;
    p.age_s = SecondsSince(state.queued->queued);
    for (const format::ManifestShard* s : ShardsToUpload(state.queued->manifest)) p.bytes_total += s->bytes;
    out.push_back(std::move(p));
  }
  return out;
}

std::map<std::string, uint64_t> Uploader::LastUploaded() const {
  std::lock_guard lock(mu_);
  std::map<std::string, uint64_t> out;
  for (const auto& [job, published] : last_uploaded_) out[job] = published.step;
  return out;
}

std::map<std::string, Uploader::Published> Uploader::LastPublished() const {
  std::lock_guard lock(mu_);
  return last_uploaded_;
}

}  // namespace ckpt::daemon::upload
