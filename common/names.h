// Validation of every name that reaches a path, a shm segment or a file header. Hostile
// input (path traversal, control characters, reserved prefixes) is refused with a message
// that names the offending value.
#pragma once

#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace ckpt {

// Job names become directory names: [A-Za-z0-9][A-Za-z0-9._-]{0,127}.
absl::Status ValidateJobName(std::string_view job);

// Tensor and train-state names become safetensors keys: 1..512 printable ASCII characters,
// not starting with "__" (reserved for ckptd's own entries such as "__metadata__").
absl::Status ValidateTensorName(std::string_view name);

// Snapshot metadata: keys of 1..256 bytes without control characters, keys and values
// valid UTF-8 (they are written into JSON headers and manifests).
absl::Status ValidateMetadata(const std::map<std::string, std::string>& metadata);

// True when `text` is well-formed UTF-8 (no overlong forms, surrogates or code points
// beyond U+10FFFF).
bool IsValidUtf8(std::string_view text);

}  // namespace ckpt
