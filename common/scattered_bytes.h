// Bytes that read as one range [0, size()) but lie in several places in memory: a staged
// snapshot whose frozen tensors are held once for all of a session's snapshots (its own
// tensors in its staging block, the frozen ones in a frozen block shared with the snapshots
// before and after it). Readers that take one entry at a time get one address for it
// (Contiguous); those that read across entries (the full writer, the erasure coder, the
// uploader) walk the spans or copy out.
//
// A view: it owns none of the memory it names, which its holder keeps alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ckpt {

class ScatteredBytes {
 public:
  struct Span {
    uint64_t begin = 0;  // where it lies in [0, size())
    uint64_t end = 0;
    const char* at = nullptr;
  };

  ScatteredBytes() = default;
  // One span: `size` bytes at `data`.
  ScatteredBytes(const char* data, uint64_t size) { Append(data, size); }

  // Adds `size` bytes at `at` after the last; joined to the last span when they follow it in
  // memory. Empty ones add nothing.
  void Append(const char* at, uint64_t size);

  uint64_t size() const { return spans_.empty() ? 0 : spans_.back().end; }
  const std::vector<Span>& spans() const { return spans_; }

  // The address of [offset, offset + len) when it lies in one span (always, for len 0 within
  // [0, size()]); null when it crosses spans or passes the end.
  const char* Contiguous(uint64_t offset, uint64_t len) const;

  // fn(const char* at, uint64_t len) over [offset, offset + len), clipped to size(), in
  // order, a call per span it touches.
  template <typename Fn>
  void ForEach(uint64_t offset, uint64_t len, Fn&& fn) const {
    const uint64_t end = offset + len < size() ? offset + len : size();
    for (size_t i = SpanIndex(offset); offset < end && i < spans_.size(); ++i) {
      const Span& s = spans_[i];
      const uint64_t stop = s.end < end ? s.end : end;
      fn(s.at + (offset - s.begin), stop - offset);
      offset = stop;
    }
  }

  // Copies [offset, offset + len) into `dst`; the caller keeps it within size().
  void CopyTo(uint64_t offset, uint64_t len, void* dst) const;

 private:
  // The span holding byte `offset` (spans_.size() when past the end).
  size_t SpanIndex(uint64_t offset) const;

  std::vector<Span> spans_;
};

}  // namespace ckpt
