#include "storage/secret.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cctype>

#include "common/status.h"

namespace ckpt {

absl::StatusOr<std::string> ReadToken(Filesystem& fs, const std::string& path,
                                      std::string_view flag) {
  auto text = ReadSmallFile(fs, path);
  if (!text.ok()) return Annotate(text.status(), std::string(flag));
  std::string token = std::move(*text);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.size() < 16) {
    return absl::InvalidArgumentError(fmt::format(
        "{} must hold a token of at least 16 characters (e.g. openssl rand -hex 32)", flag));
  }
  return token;
}

bool SecretEquals(std::string_view given, std::string_view expected) {
  unsigned char a[SHA256_DIGEST_LENGTH], b[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(given.data()), given.size(), a);
  SHA256(reinterpret_cast<const unsigned char*>(expected.data()), expected.size(), b);
  return CRYPTO_memcmp(a, b, sizeof(a)) == 0;
}

}  // namespace ckpt
