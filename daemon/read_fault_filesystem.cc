#include "daemon/read_fault_filesystem.h"

#include <errno.h>
#include <unistd.h>

#include <fmt/format.h>

#include "common/status.h"

namespace ckpt::daemon {
namespace {

constexpr uint64_t kHeaderBytes = 4096;  // ckptd aligns a shard's data region to 4096

class ReadFaultFilesystem final : public Filesystem {
 public:
  ReadFaultFilesystem(FilesystemPtr real, std::string suffix) : real_(std::move(real)), suffix_(std::move(suffix)) {}

  absl::StatusOr<UniqueFd> CreateFile(const std::string& path) override { return real_->CreateFile(path); }
  absl::StatusOr<UniqueFd> CreateFileDirect(const std::string& path) override { return real_->CreateFileDirect(path); }
  absl::Status Truncate(int fd, uint64_t size) override { return real_->Truncate(fd, size); }
  absl::StatusOr<UniqueFd> OpenForRead(const std::string& path) override { return real_->OpenForRead(path); }
  absl::StatusOr<UniqueFd> OpenForDirectRead(const std::string& path) override {
    return real_->OpenForDirectRead(path);
  }
  absl::Status WriteAt(int fd, const void* data, size_t size, uint64_t offset) override {
    return real_->WriteAt(fd, data, size, offset);
  }
  absl::Status ReadAt(int fd, void* data, size_t size, uint64_t offset) override {
    // The file the descriptor has open now, by the kernel's name for it: nothing to keep in
    // step with opens and closes.
    if (offset + size > kHeaderBytes && Faulty(fd)) return ErrnoStatus(EIO, "read");
    return real_->ReadAt(fd, data, size, offset);
  }
  absl::Status SyncFile(int fd) override { return real_->SyncFile(fd); }
  void DropFromCache(int fd) override { real_->DropFromCache(fd); }
  absl::Status SyncDir(const std::string& path) override { return real_->SyncDir(path); }
  absl::Status Rename(const std::string& from, const std::string& to) override { return real_->Rename(from, to); }
  absl::Status MakeDir(const std::string& path) override { return real_->MakeDir(path); }
  absl::Status MakePrivateDir(const std::string& path) override { return real_->MakePrivateDir(path); }
  absl::Status RemoveTree(const std::string& path) override { return real_->RemoveTree(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override { return real_->ListDir(path); }
  absl::StatusOr<uint64_t> FileSize(const std::string& path) override { return real_->FileSize(path); }
  bool Exists(const std::string& path) override { return real_->Exists(path); }
  bool IsDirectory(const std::string& path) override { return real_->IsDirectory(path); }

 private:
  bool Faulty(int fd) const {
    char target[4096];
    const ssize_t n = ::readlink(fmt::format("/proc/self/fd/{}", fd).c_str(), target, sizeof target);
    if (n <= 0 || static_cast<size_t>(n) < suffix_.size()) return false;
    return std::string_view(target, static_cast<size_t>(n)).substr(static_cast<size_t>(n) - suffix_.size()) == suffix_;
  }

  FilesystemPtr real_;
  const std::string suffix_;
};

}  // namespace

FilesystemPtr MakeReadFaultFilesystem(FilesystemPtr real, std::string suffix) {
  return std::make_shared<ReadFaultFilesystem>(std::move(real), std::move(suffix));
}

}  // namespace ckpt::daemon
