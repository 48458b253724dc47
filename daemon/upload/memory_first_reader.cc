#include "daemon/upload/memory_first_reader.h"

#include <algorithm>

#include "common/status.h"
#include "format/safetensors.h"

namespace ckpt::daemon::upload {
namespace {

class MemoryFirstReader final : public storage::ObjectReader {
 public:
  MemoryFirstReader(std::unique_ptr<storage::ObjectReader> file, InMemoryShard memory,
                    uint64_t data_start, std::atomic<uint64_t>* from_memory)
      : file_(std::move(file)), memory_(std::move(memory)), data_start_(data_start),
        from_memory_(from_memory) {}

  uint64_t size() const override { return file_->size(); }
  const std::string& name() const override { return file_->name(); }

  absl::Status ReadAt(void* data, size_t size, uint64_t offset) const override {
    if (offset > file_->size() || size > file_->size() - offset) return file_->ReadAt(data, size, offset);
    char* out = static_cast<char*>(data);
    // The header (and anything before the data region) from the file.
    const size_t head = offset < data_start_ ? std::min<uint64_t>(size, data_start_ - offset) : 0;
    if (head > 0) CKPT_RETURN_IF_ERROR(file_->ReadAt(out, head, offset));
    if (head == size) return absl::OkStatus();
    // Held for this copy only: the stager waits at most for one memcpy.
    if (std::shared_ptr<const ScatteredBytes> memory = memory_.data.lock()) {
      memory->CopyTo(offset + head - data_start_, size - head, out + head);
      if (from_memory_ != nullptr) *from_memory_ += size - head;
      return absl::OkStatus();
    }
    return file_->ReadAt(out + head, size - head, offset + head);
  }

 private:
  std::unique_ptr<storage::ObjectReader> file_;
  const InMemoryShard memory_;
  const uint64_t data_start_;
  std::atomic<uint64_t>* from_memory_;
};

}  // namespace

std::unique_ptr<storage::ObjectReader> MemoryFirst(std::unique_ptr<storage::ObjectReader> file,
                                                   InMemoryShard memory,
                                                   std::atomic<uint64_t>* from_memory) {
  if (memory.data.expired()) return file;
  absl::StatusOr<format::SafetensorsHeader> header = format::ReadHeader(*file);
  if (!header.ok() || header->data_bytes != memory.bytes ||
      header->data_start + header->data_bytes != file->size()) {
    return file;
  }
  return std::make_unique<MemoryFirstReader>(std::move(file), std::move(memory), header->data_start,
                                             from_memory);
}

}  // namespace ckpt::daemon::upload
