// Shared secrets (the group token, the admin token): reading them from the file an operator
// names, and comparing them without leaking their contents through timing.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ckpt {

// A file the operator names on the command line (a token, a TLS key or certificate), whole.
// Symbolic links are followed, unlike files under the checkpoint root: a Kubernetes Secret
// volume presents each key as a link into its current version (token -> ..data/token).
// Still only a regular file, of at most 1 MiB; refused naming `flag` otherwise.
absl::StatusOr<std::string> ReadOperatorFile(const std::string& path, std::string_view flag);

// The token in `path` (ReadOperatorFile) with trailing whitespace (a final newline)
// removed; refused, naming `flag`, when it holds fewer than 16 characters.
absl::StatusOr<std::string> ReadToken(const std::string& path, std::string_view flag);

// True when `given` equals `expected`. Both are hashed (SHA-256) and the digests compared
// with OpenSSL's constant-time memcmp, so the time taken says nothing about either the
// contents or the length of `expected`.
bool SecretEquals(std::string_view given, std::string_view expected);

}  // namespace ckpt
