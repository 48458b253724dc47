#include "shm/payload_segment.h"

#include <unistd.h>

#include <cerrno>
#include <vector>

#include "common/status.h"

namespace ckpt::shm {

absl::StatusOr<SealedSegmentPtr> EncodeToSegment(const SnapshotPayload& payload,
                                                 const std::string& debug_name) {
  const size_t size = EncodedSize(payload);
  CKPT_ASSIGN_OR_RETURN(SealedSegmentPtr segment, SealedSegment::Create(debug_name, size));
  CKPT_RETURN_IF_ERROR(
      EncodePayload(payload, static_cast<uint8_t*>(segment->data()), segment->size()).status());
  return segment;
}

absl::StatusOr<SnapshotPayload> DecodeSegment(const SealedSegment& segment) {
  return DecodePayload(static_cast<const uint8_t*>(segment.data()), segment.size());
}

absl::StatusOr<SnapshotPayload> DecodeMemfd(int fd, size_t size) {
  std::vector<uint8_t> copy(size);
  for (size_t done = 0; done < size;) {
    ssize_t n = ::pread(fd, copy.data() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, "reading the snapshot payload");
    if (n == 0) return absl::InvalidArgumentError("the snapshot payload is shorter than its memfd");
    done += static_cast<size_t>(n);
  }
  return DecodePayload(copy.data(), copy.size());
}

}  // namespace ckpt::shm
