// Counting what a daemon's log (or any output) says: how often a line's text occurs, where
// Contains (common.h) only says whether it does.
#pragma once

#include <cstddef>
#include <string>

namespace ckpt::testing {

// How many times `needle` occurs in `text`, overlapping occurrences each counted.
inline size_t Occurrences(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace ckpt::testing
