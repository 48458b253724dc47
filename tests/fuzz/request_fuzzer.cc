// libFuzzer target: request validation. The first byte picks the request: a trainer's
// RegisterRequest (validated by Session::Create, as a caller that owns nothing, on a
// daemon without a GPU) or an admin CheckpointRef (the job and step an operator names,
// looked up in an empty checkpoint root).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "storage/filesystem.h"
#include "format/checkpoint_store.h"
#include "daemon/session/session.h"
#include "proto/admin.pb.h"
#include "proto/trainer.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const char* bytes = reinterpret_cast<const char*>(data) + 1;
  int length = static_cast<int>(size - 1);
  if (data[0] & 1) {
    static ckpt::format::CheckpointStore store(ckpt::MakePosixFilesystem(),
                                                "/tmp/ckptd-fuzz-empty-root");
    ::ckptd::v1::CheckpointRef ref;
    if (!ref.ParseFromArray(bytes, length)) return 0;
    (void)store.LoadManifest(ref.job(), ref.step());
    (void)store.ListSteps(ref.job());
    return 0;
  }
  ::ckptd::v1::RegisterRequest request;
  if (!request.ParseFromArray(bytes, length)) return 0;
  ckpt::daemon::Session::Limits limits;
  limits.staging_bytes = 1ull << 30;
  limits.no_gpu_reason = "fuzzing";
  ckpt::daemon::PeerIdentity caller{::getpid(), 65534, 65534, {}};
  auto session = ckpt::daemon::Session::Create(request, limits, caller, /*arenas=*/{});
  if (session.ok()) __builtin_trap();  // the caller owns no shared memory: never valid
  return 0;
}
