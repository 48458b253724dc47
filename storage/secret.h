// Shared secrets (the group token, the admin token): reading them from the file an operator
// names, and comparing them without leaking their contents through timing.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "storage/filesystem.h"

namespace ckpt {

// The token in `path` with trailing whitespace (a final newline) removed; refused, naming
// `flag`, when the file cannot be read or holds fewer than 16 characters.
absl::StatusOr<std::string> ReadToken(Filesystem& fs, const std::string& path,
                                      std::string_view flag);

// True when `given` equals `expected`. Both are hashed (SHA-256) and the digests compared
// with OpenSSL's constant-time memcmp, so the time taken says nothing about either the
// contents or the length of `expected`.
bool SecretEquals(std::string_view given, std::string_view expected);

}  // namespace ckpt
