// A private temporary directory under $TEST_TMPDIR (or $TMPDIR), removed on destruction.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace ckpt::testing {

class TempDir {
 public:
  // `base` overrides $TEST_TMPDIR, e.g. "/tmp" for Unix sockets, whose paths must be short.
  explicit TempDir(const char* base = nullptr) {
    if (base == nullptr) base = std::getenv("TEST_TMPDIR");
    if (base == nullptr) base = std::getenv("TMPDIR");
    std::string pattern = std::string(base ? base : "/tmp") + "/ckpt-XXXXXX";
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace ckpt::testing
