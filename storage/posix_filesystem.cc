#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <random>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>
#include "storage/filesystem.h"
#include "common/status.h"

namespace ckpt {
namespace {

class PosixFilesystem final : public Filesystem {
 public:
  absl::StatusOr<UniqueFd> CreateFile(const std::string& path) override {
    // O_NOFOLLOW: a symlink planted in the root must not redirect a write elsewhere.
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0640);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("create {}", path));
    return UniqueFd(fd);
  }

  absl::StatusOr<UniqueFd> CreateFileDirect(const std::string& path) override {
    int fd = ::open(path.c_str(),
                    O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT | O_NOFOLLOW, 0640);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("create {} (O_DIRECT)", path));
    return UniqueFd(fd);
  }

  absl::Status Truncate(int fd, uint64_t size) override {
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return ErrnoStatus(errno, "ftruncate");
    return absl::OkStatus();
  }

  absl::StatusOr<UniqueFd> OpenForRead(const std::string& path) override { return Open(path, 0); }
  absl::StatusOr<UniqueFd> OpenForDirectRead(const std::string& path) override {
    return Open(path, O_DIRECT);
  }

  absl::StatusOr<UniqueFd> Open(const std::string& path, int extra_flags) {
    // O_NONBLOCK: a FIFO planted in the root must not hang the daemon in open(); only
    // regular files are read.
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | extra_flags);
    if (fd < 0) {
      return ErrnoStatus(errno, fmt::format("open {}{}", path, extra_flags ? " (O_DIRECT)" : ""));
    }
    UniqueFd file(fd);
    struct stat st;
    if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, fmt::format("stat {}", path));
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(fmt::format("{} is not a regular file", path));
    }
    int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    return file;
  }

  absl::Status WriteAt(int fd, const void* data, size_t size, uint64_t offset) override {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "write");
      }
      p += n;
      size -= static_cast<size_t>(n);
      offset += static_cast<uint64_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status ReadAt(int fd, void* data, size_t size, uint64_t offset) override {
    char* p = static_cast<char*>(data);
    while (size > 0) {
      ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "read");
      }
      if (n == 0) {
        return absl::OutOfRangeError(
            fmt::format("file ends early: {} bytes missing at offset {}", size, offset));
      }
      p += n;
      size -= static_cast<size_t>(n);
      offset += static_cast<uint64_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status SyncFile(int fd) override {
    if (::fsync(fd) != 0) return ErrnoStatus(errno, "fsync");
    return absl::OkStatus();
  }

  void DropFromCache(int fd) override { ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); }

  absl::Status SyncDir(const std::string& path) override {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd.valid()) return ErrnoStatus(errno, fmt::format("open directory {}", path));
    if (::fsync(fd.get()) != 0) return ErrnoStatus(errno, fmt::format("fsync directory {}", path));
    return absl::OkStatus();
  }

  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus(errno, fmt::format("rename {} -> {}", from, to));
    }
    return absl::OkStatus();
  }

  absl::Status MakeDir(const std::string& path) override {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) return ErrnoStatus(ec.value(), fmt::format("mkdir {}", path));
    return absl::OkStatus();
  }

  absl::Status MakePrivateDir(const std::string& path) override {
    std::filesystem::path p(path);
    if (p.has_parent_path()) CKPT_RETURN_IF_ERROR(MakeDir(p.parent_path().string()));
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      return ErrnoStatus(errno, fmt::format("mkdir {}", path));
    }
    return absl::OkStatus();
  }

  bool IsDirectory(const std::string& path) override {
    std::error_code ec;
    return std::filesystem::symlink_status(path, ec).type() == std::filesystem::file_type::directory;
  }

  absl::Status RemoveTree(const std::string& path) override {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) return ErrnoStatus(ec.value(), fmt::format("remove {}", path));
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
      names.push_back(entry.path().filename().string());
    }
    if (ec) return ErrnoStatus(ec.value(), fmt::format("list {}", path));
    return names;
  }

  absl::StatusOr<uint64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, fmt::format("stat {}", path));
    return static_cast<uint64_t>(st.st_size);
  }

  bool Exists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }
};

}  // namespace

FilesystemPtr MakePosixFilesystem() { return std::make_shared<PosixFilesystem>(); }

absl::StatusOr<std::string> ReadSmallFile(Filesystem& fs, const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs.FileSize(path));
  if (size > (64u << 20)) {
    return absl::FailedPreconditionError(fmt::format("{} is too large ({} bytes)", path, size));
  }
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs.OpenForRead(path));
  std::string contents(size, '\0');
  CKPT_RETURN_IF_ERROR(Annotate(fs.ReadAt(fd.get(), contents.data(), size, 0), path));
  return contents;
}

absl::Status WriteFileAtomically(Filesystem& fs, const std::string& path,
                                 const std::string& contents) {
  // A name of this writer's own: daemons sharing a root (--shared-root) may write the same
  // file at once, and a fixed temporary name would let one rename the other's away.
  static std::atomic<uint64_t> sequence{0};
  std::random_device random;
  const std::string tmp = fmt::format("{}.tmp.{}.{}.{:08x}", path, ::getpid(), ++sequence, random());
  absl::Status written = [&]() -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs.CreateFile(tmp));
    CKPT_RETURN_IF_ERROR(Annotate(fs.WriteAt(fd.get(), contents.data(), contents.size(), 0), tmp));
    CKPT_RETURN_IF_ERROR(Annotate(fs.SyncFile(fd.get()), tmp));
    return fs.Rename(tmp, path);
  }();
  if (!written.ok()) {
    (void)fs.RemoveTree(tmp);  // best effort: nothing half-written stays behind
    return written;
  }
  return fs.SyncDir(std::filesystem::path(path).parent_path().string());
}

}  // namespace ckpt
