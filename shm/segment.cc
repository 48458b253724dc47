#include "shm/segment.h"

#include <sys/stat.h>

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
    impl->region = bip::mapped_region(impl->object, bip::read_write);
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
