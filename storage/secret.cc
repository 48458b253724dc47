#include "storage/secret.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>

#include "common/status.h"
#include "common/unique_fd.h"

namespace ckpt {

absl::StatusOr<std::string> ReadOperatorFile(const std::string& path, std::string_view flag) {
  // O_NONBLOCK: a FIFO named by mistake must not hang the start.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd.valid()) return Annotate(ErrnoStatus(errno, "open " + path), std::string(flag));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (1 << 20)) {
    return absl::InvalidArgumentError(
        fmt::format("{}: {} is not a regular file of at most 1 MiB", flag, path));
  }
  std::string contents(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::pread(fd.get(), contents.data() + done, contents.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Annotate(ErrnoStatus(n < 0 ? errno : EIO, "read " + path), std::string(flag));
    done += static_cast<size_t>(n);
  }
  return contents;
}

absl::StatusOr<std::string> ReadToken(const std::string& path, std::string_view flag) {
  CKPT_ASSIGN_OR_RETURN(std::string token, ReadOperatorFile(path, flag));
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.size() < 16) {
    return absl::InvalidArgumentError(fmt::format(
        "{} must hold a token of at least 16 characters (e.g. openssl rand -hex 32)", flag));
  }
  return token;
}

namespace {

// OpenSSL 3's one-shot SHA256() and EVP_Digest() look the algorithm up in its provider
// store and allocate a context on every call, under locks: at node 0, which checks a token
// on every group call, that was milliseconds of each step's CPU at 10,000 nodes (perf).
// The low-level context (deprecated in 3.0, still the same SHA-256) does neither.
void Sha256(std::string_view data, unsigned char (&out)[SHA256_DIGEST_LENGTH]) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  SHA256_CTX context;
  SHA256_Init(&context);
  SHA256_Update(&context, data.data(), data.size());
  SHA256_Final(out, &context);
#pragma GCC diagnostic pop
}

}  // namespace

bool SecretEquals(std::string_view given, std::string_view expected) {
  unsigned char a[SHA256_DIGEST_LENGTH], b[SHA256_DIGEST_LENGTH];
  Sha256(given, a);
  Sha256(expected, b);
  return CRYPTO_memcmp(a, b, sizeof(a)) == 0;
}

}  // namespace ckpt
