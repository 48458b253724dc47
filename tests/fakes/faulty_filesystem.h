// A Filesystem that forwards to the real one but fails a chosen operation with a chosen
// errno, after a number of successful calls: ENOSPC on the third write, EIO on fsync...
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "storage/filesystem.h"
#include "common/status.h"

namespace ckpt::testing {

class FaultyFilesystem final : public Filesystem {
 public:
  enum class Op { kNone, kCreate, kWrite, kSync, kSyncDir, kRename, kMakeDir };

  explicit FaultyFilesystem(FilesystemPtr real) : real_(std::move(real)) {}

  // Fails the (skip+1)-th call of `op` and every later one with `err`.
  void FailAfter(Op op, int skip, int err) {
    op_ = op;
    remaining_ = skip;
    err_ = err;
  }
  void Heal() { op_ = Op::kNone; }
  // Bytes passed to successful WriteAt (ReadAt) calls so far.
  uint64_t bytes_written() const { return bytes_written_; }
  uint64_t bytes_read() const { return bytes_read_; }
  // Successful WriteAt calls so far.
  uint64_t writes() const { return writes_; }

  absl::StatusOr<UniqueFd> CreateFile(const std::string& path) override {
    if (Trip(Op::kCreate)) return ErrnoStatus(err_, "create " + path);
    return real_->CreateFile(path);
  }
  absl::StatusOr<UniqueFd> CreateFileDirect(const std::string& path) override {
    if (Trip(Op::kCreate)) return ErrnoStatus(err_, "create " + path);
    if (no_direct_) return ErrnoStatus(EINVAL, "create " + path + " (O_DIRECT)");
    return real_->CreateFileDirect(path);
  }
  absl::Status Truncate(int fd, uint64_t size) override { return real_->Truncate(fd, size); }
  // Behave like a filesystem without O_DIRECT support (tmpfs).
  void DisableDirectIo() { no_direct_ = true; }
  absl::StatusOr<UniqueFd> OpenForRead(const std::string& path) override {
    if (before_open_for_read_) before_open_for_read_(path);
    return real_->OpenForRead(path);
  }
  absl::StatusOr<UniqueFd> OpenForDirectRead(const std::string& path) override {
    if (no_direct_) return ErrnoStatus(EINVAL, "open " + path + " (O_DIRECT)");
    absl::StatusOr<UniqueFd> fd = real_->OpenForDirectRead(path);
    if (fd.ok() && refuse_direct_reads_) {
      std::lock_guard lock(mu_);
      direct_read_fds_.insert(fd->get());
    }
    return fd;
  }
  // Behave like a file system that opens with O_DIRECT and then refuses the reads (EINVAL).
  void RefuseDirectReads() { refuse_direct_reads_ = true; }
  absl::Status WriteAt(int fd, const void* data, size_t size, uint64_t offset) override {
    if (Trip(Op::kWrite)) return ErrnoStatus(err_, "write");
    absl::Status s = real_->WriteAt(fd, data, size, offset);
    if (s.ok()) {
      bytes_written_ += size;
      ++writes_;
    }
    return s;
  }
  absl::Status ReadAt(int fd, void* data, size_t size, uint64_t offset) override {
    if (refuse_direct_reads_) {
      std::lock_guard lock(mu_);
      if (direct_read_fds_.count(fd)) return ErrnoStatus(EINVAL, "read (O_DIRECT)");
    }
    absl::Status s = real_->ReadAt(fd, data, size, offset);
    if (s.ok()) bytes_read_ += size;
    return s;
  }
  absl::Status SyncFile(int fd) override {
    if (Trip(Op::kSync)) return ErrnoStatus(err_, "fsync");
    return real_->SyncFile(fd);
  }
  void DropFromCache(int fd) override { real_->DropFromCache(fd); }
  absl::Status SyncDir(const std::string& path) override {
    if (Trip(Op::kSyncDir)) return ErrnoStatus(err_, "fsync directory " + path);
    {
      std::lock_guard lock(synced_mu_);
      synced_dirs_.push_back(path);
    }
    return real_->SyncDir(path);
  }
  // Directories passed to SyncDir so far, in order.
  std::vector<std::string> synced_dirs() const {
    std::lock_guard lock(synced_mu_);
    return synced_dirs_;
  }
  // Runs before every rename (on the renaming thread): a test holds one back there to
  // widen a race. Set it before the filesystem is in use.
  void BeforeRename(std::function<void(const std::string& from)> hook) {
    before_rename_ = std::move(hook);
  }
  // Runs before every OpenForRead, likewise: a test changes the store between a listing
  // and the reads that follow it.
  void BeforeOpenForRead(std::function<void(const std::string& path)> hook) {
    before_open_for_read_ = std::move(hook);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (before_rename_) before_rename_(from);
    if (Trip(Op::kRename)) return ErrnoStatus(err_, "rename " + from);
    return real_->Rename(from, to);
  }
  absl::Status MakeDir(const std::string& path) override {
    if (Trip(Op::kMakeDir)) return ErrnoStatus(err_, "mkdir " + path);
    return real_->MakeDir(path);
  }
  absl::Status MakePrivateDir(const std::string& path) override {
    if (Trip(Op::kMakeDir)) return ErrnoStatus(err_, "mkdir " + path);
    return real_->MakePrivateDir(path);
  }
  absl::Status RemoveTree(const std::string& path) override { return real_->RemoveTree(path); }
  bool IsDirectory(const std::string& path) override { return real_->IsDirectory(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    return real_->ListDir(path);
  }
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    return real_->FileSize(path);
  }
  bool Exists(const std::string& path) override { return real_->Exists(path); }

 private:
  bool Trip(Op op) {
    if (op != op_) return false;
    return remaining_.fetch_sub(1) <= 0;
  }

  FilesystemPtr real_;
  std::atomic<Op> op_{Op::kNone};
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> writes_{0};
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<int> remaining_{0};
  int err_ = 0;
  bool no_direct_ = false;
  std::atomic<bool> refuse_direct_reads_ = false;
  std::mutex mu_;
  std::set<int> direct_read_fds_;  // guarded by mu_; a test keeps its readers open while it reads
  mutable std::mutex synced_mu_;
  std::vector<std::string> synced_dirs_;
  std::function<void(const std::string&)> before_rename_;
  std::function<void(const std::string&)> before_open_for_read_;
};

}  // namespace ckpt::testing
