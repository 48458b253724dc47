#include "shm/segment.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <fmt/format.h>

#include "common/names.h"
#include "common/status.h"

namespace ckpt::shm {

namespace bip = boost::interprocess;

struct Segment::Impl {
  bip::shared_memory_object object;
  bip::mapped_region region;
};

Segment::Segment(std::string name, std::unique_ptr<Impl> impl, bool unlink_on_destroy)
    : name_(std::move(name)), impl_(std::move(impl)), unlink_on_destroy_(unlink_on_destroy) {
  data_ = impl_->region.get_address();
  size_ = impl_->region.get_size();
  struct stat st;
  if (::fstat(impl_->object.get_mapping_handle().handle, &st) == 0) owner_uid_ = st.st_uid;
}

Segment::~Segment() {
  impl_.reset();
  if (unlink_on_destroy_) Unlink(name_);
}

absl::StatusOr<SegmentPtr> Segment::Create(const std::string& name, size_t size, mode_t mode,
                                           bool unlink_on_destroy) {
  CKPT_RETURN_IF_ERROR(ValidateShmName(name));
  if (size == 0) return absl::InvalidArgumentError("shared-memory segment of size 0");
  try {
    auto impl = std::make_unique<Impl>();
    bip::permissions perms(mode);
    impl->object = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write, perms);
    // Boost applies the umask at creation; set the exact bits asked for.
    ::fchmod(impl->object.get_mapping_handle().handle, mode);
    impl->object.truncate(static_cast<bip::offset_t>(size));
    // Reserve every page now: on a full tmpfs (a container's 64 MiB /dev/shm) this is
    // ENOSPC here, instead of SIGBUS for whoever first touches a page that cannot be had.
    if (int err = ::posix_fallocate(impl->object.get_mapping_handle().handle, 0,
                                    static_cast<off_t>(size));
        err != 0) {
      bip::shared_memory_object::remove(name.c_str());
      if (err == ENOSPC) {
        return absl::ResourceExhaustedError(fmt::format(
            "/dev/shm has no room for shared memory {} ({} bytes): it is smaller than what the "
            "trainers register (a container's /dev/shm is 64 MiB by default: docker "
            "--shm-size, or a Kubernetes emptyDir with medium: Memory)",
            name, size));
      }
      return absl::InternalError(fmt::format("reserve shared memory {} ({} bytes): {}", name,
                                             size, std::strerror(err)));
    }
    impl->region = bip::mapped_region(impl->object, bip::read_write);
    // Held as long as the creator keeps the segment: the start-up sweep of any process, in
    // any PID namespace, can tell a live segment from a leftover by this lock, not by a pid.
    (void)::flock(impl->object.get_mapping_handle().handle, LOCK_SH | LOCK_NB);
    return SegmentPtr(new Segment(name, std::move(impl), unlink_on_destroy));
  } catch (const bip::interprocess_exception& e) {
    bip::shared_memory_object::remove(name.c_str());
    return absl::InternalError(fmt::format("create shared memory {} ({} bytes): {}", name, size,
                                           e.what()));
  }
}

absl::StatusOr<SegmentPtr> Segment::Open(const std::string& name) {
  CKPT_RETURN_IF_ERROR(ValidateShmName(name));
  try {
    auto impl = std::make_unique<Impl>();
    impl->object = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write);
    struct stat st;
    if (::fstat(impl->object.get_mapping_handle().handle, &st) != 0) {
      return absl::InternalError(fmt::format("stat shared memory {}: {}", name, std::strerror(errno)));
    }
    // A segment with holes (not created by Create) could fail to get a page on first touch
    // and kill this process with SIGBUS: refuse it while that is still an error.
    if (static_cast<uint64_t>(st.st_blocks) * 512 < static_cast<uint64_t>(st.st_size)) {
      return absl::FailedPreconditionError(fmt::format(
          "shared memory {} is not fully allocated ({} of {} bytes): create it with space "
          "reserved (posix_fallocate), as the ckptd client does",
          name, static_cast<uint64_t>(st.st_blocks) * 512, st.st_size));
    }
    impl->region = bip::mapped_region(impl->object, bip::read_write);
    return SegmentPtr(new Segment(name, std::move(impl), false));
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error) {
      return absl::NotFoundError(fmt::format("shared memory {} does not exist", name));
    }
    return absl::InternalError(fmt::format("open shared memory {}: {}", name, e.what()));
  }
}

void Segment::Unlink(const std::string& name) { bip::shared_memory_object::remove(name.c_str()); }

void Segment::UnlinkNow() {
  Unlink(name_);
  unlink_on_destroy_ = false;
}

}  // namespace ckpt::shm
