#include "common/names.h"

#include <cctype>

#include <fmt/format.h>

#include <string>

namespace ckpt {
namespace {

bool IsNameChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}

// Escapes control and non-ASCII bytes so that hostile names print safely in messages.
std::string Printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 200)) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (s.size() > 200) out += "...";
  return out;
}

}  // namespace

absl::Status ValidateJobName(std::string_view job) {
  if (job.empty() || job.size() > 128) {
    return absl::InvalidArgumentError(
        fmt::format("invalid job name \"{}\": must be 1 to 128 characters", Printable(job)));
  }
  if (!std::isalnum(static_cast<unsigned char>(job[0]))) {
    return absl::InvalidArgumentError(fmt::format(
        "invalid job name \"{}\": must start with a letter or digit", Printable(job)));
  }
  for (char c : job) {
    if (!IsNameChar(c)) {
      return absl::InvalidArgumentError(fmt::format(
          "invalid job name \"{}\": only letters, digits, '.', '_' and '-' are allowed",
          Printable(job)));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateTensorName(std::string_view name) {
  if (name.empty() || name.size() > 512) {
    return absl::InvalidArgumentError(fmt::format(
        "invalid tensor name \"{}\": must be 1 to 512 characters", Printable(name)));
  }
  if (name.substr(0, 2) == "__") {
    return absl::InvalidArgumentError(fmt::format(
        "invalid tensor name \"{}\": the \"__\" prefix is reserved", Printable(name)));
  }
  for (char c : name) {
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') {
      return absl::InvalidArgumentError(fmt::format(
          "invalid tensor name \"{}\": only printable ASCII without quotes or backslashes",
          Printable(name)));
    }
  }
  return absl::OkStatus();
}

bool IsValidUtf8(std::string_view text) {
  static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};  // shortest form per length
  size_t i = 0;
  while (i < text.size()) {
    auto c = static_cast<unsigned char>(text[i]);
    size_t more = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : 4;
    if (more == 4 || more >= text.size() - i) return more == 0;
    uint32_t cp = more == 0 ? c : c & (0x3Fu >> more);
    for (size_t k = 1; k <= more; ++k) {
      auto cc = static_cast<unsigned char>(text[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3Fu);
    }
    if (cp < kMin[more] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += more + 1;
  }
  return true;
}

absl::Status ValidateMetadata(const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) {
    if (key.empty() || key.size() > 256) {
      return absl::InvalidArgumentError(fmt::format(
          "metadata key \"{}\" must be 1 to 256 bytes", Printable(key.substr(0, 64))));
    }
    for (char c : key) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
        return absl::InvalidArgumentError(fmt::format(
            "metadata key \"{}\" holds a control character", Printable(key)));
      }
    }
    if (!IsValidUtf8(key)) {
      return absl::InvalidArgumentError(
          fmt::format("metadata key \"{}\" is not valid UTF-8", Printable(key)));
    }
    if (!IsValidUtf8(value)) {
      return absl::InvalidArgumentError(fmt::format(
          "the value of metadata key \"{}\" is not valid UTF-8 (metadata is text; put binary "
          "data in train state)",
          Printable(key)));
    }
  }
  return absl::OkStatus();
}

}  // namespace ckpt
