#include "common/scattered_bytes.h"

#include <algorithm>
#include <cstring>

namespace ckpt {

void ScatteredBytes::Append(const char* at, uint64_t size) {
  if (size == 0) return;
  if (!spans_.empty() && spans_.back().at + (spans_.back().end - spans_.back().begin) == at) {
    spans_.back().end += size;
    return;
  }
  const uint64_t begin = this->size();
  spans_.push_back({begin, begin + size, at});
}

size_t ScatteredBytes::SpanIndex(uint64_t offset) const {
  // The first span that ends past `offset`.
  auto it = std::upper_bound(spans_.begin(), spans_.end(), offset,
                             [](uint64_t value, const Span& s) { return value < s.end; });
  return static_cast<size_t>(it - spans_.begin());
}

const char* ScatteredBytes::Contiguous(uint64_t offset, uint64_t len) const {
  if (len == 0) {
    if (offset > size()) return nullptr;
    // Any address will do for nothing; one inside the memory named, when there is any.
    static const char kNothing = 0;
    const size_t i = SpanIndex(offset);
    return i < spans_.size() ? spans_[i].at + (offset - spans_[i].begin) : &kNothing;
  }
  const size_t i = SpanIndex(offset);
  if (i >= spans_.size() || offset + len > spans_[i].end) return nullptr;
  return spans_[i].at + (offset - spans_[i].begin);
}

void ScatteredBytes::CopyTo(uint64_t offset, uint64_t len, void* dst) const {
  char* out = static_cast<char*>(dst);
  ForEach(offset, len, [&](const char* at, uint64_t n) {
    std::memcpy(out, at, n);
    out += n;
  });
}

}  // namespace ckpt
