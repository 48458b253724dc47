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

// Decodes what ckptd wrote (the trainer's side of a restore).
absl::StatusOr<SnapshotPayload> DecodeSegment(const SealedSegment& segment);

// Decodes the payload in a trainer's memfd (ckptd's side of a snapshot), never mapping it:
// its bytes are copied out with pread first, so holes punched in it read as zeros instead
// of faulting ckptd (SIGBUS), and a trainer still writing it can tear nothing but the copy's
// own bytes. `size` is the memfd's, already checked by the caller.
absl::StatusOr<SnapshotPayload> DecodeMemfd(int fd, size_t size);

}  // namespace ckpt::shm
