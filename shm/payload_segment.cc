#include "shm/payload_segment.h"

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

}  // namespace ckpt::shm
