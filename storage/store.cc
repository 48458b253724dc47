#include "storage/store.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/status.h"
#include "storage/aligned_buffer.h"

namespace ckpt::storage {

absl::StatusOr<uint64_t> Store::CopyFrom(const ObjectReader& from, const std::string& key,
                                         const CopyProgress& progress, std::string_view /*version*/) {
  constexpr size_t kPiece = size_t{16} << 20;
  const uint64_t size = from.size();
  AlignedBuffer buffer = AllocateAligned(static_cast<size_t>(std::min<uint64_t>(kPiece, std::max<uint64_t>(size, 1))));
  if (buffer == nullptr) return absl::ResourceExhaustedError(fmt::format("no memory to copy {}", from.name()));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ObjectWriter> out, Create(key));
  for (uint64_t offset = 0; offset < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, size - offset));
    CKPT_RETURN_IF_ERROR(from.ReadAt(buffer.get(), n, offset));
    CKPT_RETURN_IF_ERROR(out->Append(buffer.get(), n));
    offset += n;
    CKPT_RETURN_IF_ERROR(progress(n));
  }
  CKPT_ASSIGN_OR_RETURN(uint64_t written, out->Finish());
  if (written != size) {
    return absl::DataLossError(fmt::format("{}: {} bytes written of {}", Describe(key), written, size));
  }
  return written;
}

}  // namespace ckpt::storage
