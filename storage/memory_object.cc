#include "storage/memory_object.h"

#include <fmt/format.h>

#include <cstring>

namespace ckpt::storage {
namespace {

class MemoryObject final : public ObjectReader {
 public:
  MemoryObject(std::string name, std::string bytes) : name_(std::move(name)), bytes_(std::move(bytes)) {}
  uint64_t size() const override { return bytes_.size(); }
  const std::string& name() const override { return name_; }
  absl::Status ReadAt(void* data, size_t size, uint64_t offset) const override {
    if (offset > bytes_.size() || size > bytes_.size() - offset) {
      return absl::OutOfRangeError(fmt::format("{}: {} bytes at {} are past its end ({} bytes)",
                                               name_, size, offset, bytes_.size()));
    }
    std::memcpy(data, bytes_.data() + offset, size);
    return absl::OkStatus();
  }

 private:
  const std::string name_;
  const std::string bytes_;
};

}  // namespace

std::unique_ptr<ObjectReader> ReadFromMemory(std::string name, std::string bytes) {
  return std::make_unique<MemoryObject>(std::move(name), std::move(bytes));
}

}  // namespace ckpt::storage
