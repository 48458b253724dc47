#include "storage/local_store.h"

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>

#include "common/status.h"
#include "common/unique_fd.h"
#include "storage/aligned_buffer.h"

namespace ckpt::storage {
namespace {

constexpr uint64_t kBlock = 4096;               // O_DIRECT alignment
constexpr uint64_t kBounceBytes = 8u << 20;     // small and unaligned appends are gathered here
constexpr uint64_t kStraightBytes = 1u << 20;   // aligned appends this large are written as they are

std::string ParentOf(const std::string& path) {
  return std::filesystem::path(path).parent_path().string();
}

class LocalObjectWriter final : public ObjectWriter {
 public:
  LocalObjectWriter(FilesystemPtr fs, std::string path, UniqueFd fd, bool direct)
      : fs_(std::move(fs)), path_(std::move(path)), fd_(std::move(fd)), direct_(direct) {}

  // The first failure is every later call's answer: a write that failed leaves the file
  // short or the buffer unwritten, and no retry may append after it or finish it as whole.
  absl::Status Append(const char* data, size_t size) override {
    CKPT_RETURN_IF_ERROR(failed_);
    failed_ = AppendOnce(data, size);
    return failed_;
  }

  absl::StatusOr<uint64_t> Finish() override {
    CKPT_RETURN_IF_ERROR(failed_);
    absl::StatusOr<uint64_t> size = FinishOnce();
    failed_ = size.status();
    return size;
  }

 private:
  absl::Status AppendOnce(const char* data, size_t size) {
    if (!direct_) {
      CKPT_RETURN_IF_ERROR(Annotate(fs_->WriteAt(fd_.get(), data, size, size_), path_));
      size_ += size;
      return absl::OkStatus();
    }
    while (size > 0) {
      // A large run of aligned memory goes out straight from the caller's memory, after
      // what was gathered before it (whole blocks only, or the file's offsets would not be).
      if (size >= kStraightBytes && reinterpret_cast<uintptr_t>(data) % kBlock == 0 && pending_ % kBlock == 0) {
        CKPT_RETURN_IF_ERROR(WriteGathered());
        const size_t whole = size / kBlock * kBlock;
        CKPT_RETURN_IF_ERROR(Annotate(fs_->WriteAt(fd_.get(), data, whole, size_), path_));
        size_ += whole;
        data += whole;
        size -= whole;
        continue;  // a last partial block is gathered
      }
      // Anything else is gathered in an aligned buffer and written kBounceBytes at a time:
      // O_DIRECT needs aligned memory, offsets and sizes, and an incremental shard's runs
      // (changed chunks, often a block each, from anywhere in staging: docs/design/
      // incremental.md, section 5) written one by one made thousands of synchronous writes
      // where a full shard makes one per 32 MiB (docs/benchmarks.md, sparse tables).
      if (!bounce_) bounce_ = AllocateAligned(kBounceBytes);
      if (!bounce_) return absl::ResourceExhaustedError("no memory for an aligned write buffer");
      const size_t n = std::min<size_t>(size, kBounceBytes - pending_);
      std::memcpy(bounce_.get() + pending_, data, n);
      pending_ += n;
      data += n;
      size -= n;
      if (pending_ == kBounceBytes) CKPT_RETURN_IF_ERROR(WriteGathered());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> FinishOnce() {
    if (pending_ > 0) {
      // The last partial block is written padded with zeros, and the file cut back.
      const size_t padded = (pending_ + kBlock - 1) / kBlock * kBlock;
      std::memset(bounce_.get() + pending_, 0, padded - pending_);
      CKPT_RETURN_IF_ERROR(Annotate(fs_->WriteAt(fd_.get(), bounce_.get(), padded, size_), path_));
      size_ += pending_;
      if (padded != pending_) CKPT_RETURN_IF_ERROR(Annotate(fs_->Truncate(fd_.get(), size_), path_));
      pending_ = 0;
    }
    CKPT_RETURN_IF_ERROR(Annotate(fs_->SyncFile(fd_.get()), path_));
    if (!direct_) fs_->DropFromCache(fd_.get());  // durable; never read back from the cache
    return size_;
  }

  // Writes the whole blocks gathered; a last partial block moves to the buffer's start.
  absl::Status WriteGathered() {
    const size_t whole = pending_ / kBlock * kBlock;
    if (whole == 0) return absl::OkStatus();
    CKPT_RETURN_IF_ERROR(Annotate(fs_->WriteAt(fd_.get(), bounce_.get(), whole, size_), path_));
    size_ += whole;
    pending_ -= whole;
    if (pending_ > 0) std::memmove(bounce_.get(), bounce_.get() + whole, pending_);
    return absl::OkStatus();
  }

  FilesystemPtr fs_;  // shared: an object may outlive the store that made it
  const std::string path_;
  UniqueFd fd_;
  const bool direct_;
  uint64_t size_ = 0;   // written to the file; a multiple of kBlock until Finish()
  size_t pending_ = 0;  // bytes gathered at the start of bounce_, not written yet
  AlignedBuffer bounce_;
  absl::Status failed_;
};

class LocalObjectReader final : public ObjectReader {
 public:
  LocalObjectReader(FilesystemPtr fs, std::string path, UniqueFd fd, UniqueFd direct, uint64_t size)
      : fs_(std::move(fs)), path_(std::move(path)), fd_(std::move(fd)), direct_(std::move(direct)),
        size_(size) {}

  uint64_t size() const override { return size_; }
  const std::string& name() const override { return path_; }
  absl::Status ReadAt(void* data, size_t size, uint64_t offset) const override {
    // Aligned reads go around the page cache, as the files were written: the disk fills the
    // caller's memory with no copy, and a checkpoint read once (an upload, a restore) does
    // not fill the cache. Copying out of the cache cost the uploader a core on its own.
    const size_t aligned = size / kBlock * kBlock;
    if (direct_.valid() && aligned > 0 && offset % kBlock == 0 &&
        reinterpret_cast<uintptr_t>(data) % kBlock == 0) {
      absl::Status direct = fs_->ReadAt(direct_.get(), data, aligned, offset);
      // Some file systems open with O_DIRECT and refuse the read (EINVAL): buffered then.
      if (!absl::IsInvalidArgument(direct)) {
        CKPT_RETURN_IF_ERROR(Annotate(direct, path_));
        if (aligned == size) return absl::OkStatus();
        return Annotate(fs_->ReadAt(fd_.get(), static_cast<char*>(data) + aligned, size - aligned,
                                    offset + aligned),
                        path_);
      }
    }
    return Annotate(fs_->ReadAt(fd_.get(), data, size, offset), path_);
  }

 private:
  FilesystemPtr fs_;  // shared: an object may outlive the store that made it
  const std::string path_;
  UniqueFd fd_;
  UniqueFd direct_;  // O_DIRECT, where the filesystem allows it
  const uint64_t size_;
};

class LocalStore final : public Store {
 public:
  LocalStore(FilesystemPtr fs, std::string root, LocalStoreOptions options)
      : fs_(std::move(fs)), root_(std::move(root)), options_(options) {}

  std::string Describe(std::string_view key) const override { return Path(key); }

  absl::StatusOr<std::unique_ptr<ObjectWriter>> Create(const std::string& key) override {
    const std::string path = Path(key);
    CKPT_RETURN_IF_ERROR(MakeParents(key));
    auto direct = fs_->CreateFileDirect(path);
    if (direct.ok()) {
      return std::unique_ptr<ObjectWriter>(
          new LocalObjectWriter(fs_, path, std::move(*direct), /*direct=*/true));
    }
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_->CreateFile(path));
    return std::unique_ptr<ObjectWriter>(new LocalObjectWriter(fs_, path, std::move(fd), false));
  }

  absl::StatusOr<std::unique_ptr<ObjectReader>> Open(const std::string& key) override {
    const std::string path = Path(key);
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_->OpenForRead(path));
    CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(path));
    absl::StatusOr<UniqueFd> direct = fs_->OpenForDirectRead(path);  // none: buffered alone
    return std::unique_ptr<ObjectReader>(new LocalObjectReader(
        fs_, path, std::move(fd), direct.ok() ? std::move(*direct) : UniqueFd(), size));
  }

  absl::StatusOr<bool> Exists(const std::string& key) override {
    const std::string path = Path(key);
    return fs_->Exists(path) && !fs_->IsDirectory(path);
  }

  absl::StatusOr<std::vector<ListEntry>> List(const std::string& prefix) override {
    const std::string dir = Path(prefix);
    std::vector<ListEntry> entries;
    if (!fs_->Exists(dir)) return entries;
    CKPT_ASSIGN_OR_RETURN(std::vector<std::string> names, fs_->ListDir(dir));
    for (std::string& name : names) {
      ListEntry e;
      const std::string path = dir + "/" + name;
      e.is_prefix = fs_->IsDirectory(path);
      if (!e.is_prefix) e.bytes = fs_->FileSize(path).value_or(0);
      e.name = std::move(name);
      entries.push_back(std::move(e));
    }
    std::sort(entries.begin(), entries.end(),
              [](const ListEntry& a, const ListEntry& b) { return a.name < b.name; });
    return entries;
  }

  absl::Status Put(const std::string& key, std::string_view contents) override {
    CKPT_RETURN_IF_ERROR(MakeParents(key));
    return WriteFileAtomically(*fs_, Path(key), std::string(contents));
  }

  absl::StatusOr<std::string> Get(const std::string& key, size_t max_bytes) override {
    const std::string path = Path(key);
    CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(path));
    if (size > max_bytes) {
      return absl::OutOfRangeError(fmt::format("{} is {} bytes; at most {} expected", path, size, max_bytes));
    }
    return ReadSmallFile(*fs_, path);
  }

  std::string StagingPrefix(const std::string& published) const override {
    return published + ".tmp";
  }

  absl::Status Publish(const std::string& staging, const std::string& published,
                       const std::string& marker, std::string_view contents) override {
    const std::string from = Path(staging);
    const std::string to = Path(published);
    if (fs_->Exists(to)) {
      return absl::AlreadyExistsError(fmt::format("{} already exists", to));
    }
    CKPT_RETURN_IF_ERROR(MakeParents(staging + "/" + marker));
    CKPT_RETURN_IF_ERROR(WriteFileAtomically(*fs_, from + "/" + marker, std::string(contents)));
    CKPT_RETURN_IF_ERROR(fs_->Rename(from, to));
    const std::string parent = ParentOf(to);
    CKPT_RETURN_IF_ERROR(fs_->SyncDir(parent));
    // The parent's own entry must be durable too (a job's first step: its directory is new),
    // or a crash could lose everything published under it; once per parent per run.
    {
      std::lock_guard lock(mu_);
      if (!synced_parents_.insert(parent).second) return absl::OkStatus();
    }
    absl::Status synced = fs_->SyncDir(ParentOf(parent));
    if (!synced.ok()) {
      std::lock_guard lock(mu_);
      synced_parents_.erase(parent);
    }
    return synced;
  }

  absl::Status Retract(const std::string& published, const std::string& marker) override {
    const std::string dir = Path(published);
    if (!fs_->Exists(dir + "/" + marker)) {
      return absl::NotFoundError(fmt::format("{} holds no {}", dir, marker));
    }
    // Out of sight first, durably: a crash then leaves a ".deleting" directory (removed at
    // start-up), never a step half deleted that still looks complete.
    // A name of its own: a leftover of a crash (swept at start-up) never blocks the rename.
    static std::atomic<uint64_t> sequence{0};
    const std::string aside = fmt::format("{}.deleting.{}.{}", dir, ::getpid(), ++sequence);
    CKPT_RETURN_IF_ERROR(fs_->Rename(dir, aside));
    CKPT_RETURN_IF_ERROR(fs_->SyncDir(ParentOf(dir)));
    return fs_->RemoveTree(aside);
  }

  absl::Status RemovePrefix(const std::string& prefix) override {
    return fs_->RemoveTree(Path(prefix));
  }

  absl::Status Retire(const std::string& published, const std::string& held) override {
    const std::string from = Path(published), to = Path(held);
    if (fs_->Exists(to)) return absl::AlreadyExistsError(fmt::format("{} already exists", to));
    CKPT_RETURN_IF_ERROR(fs_->Rename(from, to));
    return fs_->SyncDir(ParentOf(from));
  }

 private:
  // Makes the directories above `key` (the top-level one private when asked).
  absl::Status MakeParents(const std::string& key) {
    const std::string parent = ParentOf(Path(key));
    if (options_.private_top_level) {
      if (size_t slash = key.find('/'); slash != std::string::npos && slash > 0) {
        const std::string top = Path(key.substr(0, slash));
        const bool was_there = fs_->Exists(top);
        CKPT_RETURN_IF_ERROR(fs_->MakePrivateDir(top));
        if (!was_there && options_.top_level_made) options_.top_level_made(key.substr(0, slash));
      }
    }
    return fs_->MakeDir(parent);
  }

  std::string Path(std::string_view key) const {
    if (root_.empty()) return std::string(key);
    if (key.empty()) return root_;
    return root_ + "/" + std::string(key);
  }

  FilesystemPtr fs_;
  const std::string root_;
  const LocalStoreOptions options_;
  std::mutex mu_;
  std::set<std::string> synced_parents_;  // guarded by mu_
};

}  // namespace

StorePtr MakeLocalStore(FilesystemPtr fs, std::string root, LocalStoreOptions options) {
  return std::make_shared<LocalStore>(std::move(fs), std::move(root), options);
}

}  // namespace ckpt::storage
