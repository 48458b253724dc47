// A snapshot payload (metadata and train state) too large for a ring slot or a gRPC reply
// travels as a sealed memfd of its own, handed over on ckptd's descriptor socket: the
// trainer's snapshot into ckptd (kCommandSnapshotDeposited), a restore's train state back.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "shm/payload.h"
#include "shm/sealed_segment.h"

namespace ckpt::shm {

// A new sealed segment holding `payload`, encoded as shm/payload.h does.
absl::StatusOr<SealedSegmentPtr> EncodeToSegment(const SnapshotPayload& payload,
                                                 const std::string& debug_name);

// Decodes what the other side wrote; its writer may still be writing (each length is
// read once and checked, so a torn write tears only its own bytes).
absl::StatusOr<SnapshotPayload> DecodeSegment(const SealedSegment& segment);

}  // namespace ckpt::shm
