#include "storage/s3_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ckpt::storage {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  size_t e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// One profile of an INI credentials file: aws_access_key_id and friends.
absl::Status ReadCredentialsFile(const std::string& path, const std::string& profile,
                                 bool must_be_private, S3Credentials& out) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(fmt::format("S3 credentials file {} cannot be read", path));
  }
  if (must_be_private && ((st.st_mode & 077) != 0 || st.st_uid != ::geteuid())) {
    return absl::PermissionDeniedError(fmt::format(
        "S3 credentials file {} must be owned by this user and mode 0600 (it is {:04o}): "
        "others could read the keys",
        path, st.st_mode & 07777));
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(fmt::format("S3 credentials file {} cannot be read", path));
  std::string line, section;
  S3Credentials found;
  while (std::getline(in, line)) {
    line = Trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = Trim(line.substr(1, line.size() - 2));
      if (section.rfind("profile ", 0) == 0) section = Trim(section.substr(8));
      continue;
    }
    if (section != profile) continue;
    size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string key = Trim(line.substr(0, eq)), value = Trim(line.substr(eq + 1));
    if (key == "aws_access_key_id") found.access_key = value;
    if (key == "aws_secret_access_key") found.secret_key = value;
    if (key == "aws_session_token") found.session_token = value;
  }
  if (found.access_key.empty() || found.secret_key.empty()) {
    return absl::NotFoundError(fmt::format(
        "S3 credentials file {} has no aws_access_key_id and aws_secret_access_key in profile {}",
        path, profile));
  }
  out = found;
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseS3Url(const std::string& url, S3Options& options) {
  constexpr std::string_view kScheme = "s3://";
  if (url.rfind(kScheme, 0) != 0) {
    return absl::InvalidArgumentError(fmt::format("{}: not an s3:// URL", url));
  }
  std::string rest = url.substr(kScheme.size());
  size_t slash = rest.find('/');
  std::string bucket = rest.substr(0, slash);
  std::string prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  // S3's bucket naming rules: 3-63 of a-z, 0-9, '.', '-', starting and ending alphanumeric.
  bool ok = bucket.size() >= 3 && bucket.size() <= 63 && std::isalnum(static_cast<unsigned char>(bucket.front())) &&
            std::isalnum(static_cast<unsigned char>(bucket.back()));
  for (char c : bucket) ok = ok && (std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '-');
  if (!ok) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: \"{}\" is not a valid bucket name (3-63 of a-z, 0-9, '.', '-')", url, bucket));
  }
  if (prefix.find("//") != std::string::npos || (!prefix.empty() && prefix.front() == '/')) {
    return absl::InvalidArgumentError(fmt::format("{}: the prefix has an empty path component", url));
  }
  options.bucket = bucket;
  options.prefix = prefix;
  return absl::OkStatus();
}

absl::Status ResolveS3Environment(S3Options& options, const std::string& credentials_file) {
  if (options.endpoint.empty()) options.endpoint = Env("AWS_ENDPOINT_URL_S3");
  if (options.endpoint.empty()) options.endpoint = Env("AWS_ENDPOINT_URL");
  if (std::string region = Env("AWS_REGION"); !region.empty()) {
    options.region = region;
  } else if (std::string fallback = Env("AWS_DEFAULT_REGION"); !fallback.empty()) {
    options.region = fallback;
  }
  if (options.endpoint.empty()) {
    options.endpoint = fmt::format("https://s3.{}.amazonaws.com", options.region);
    options.path_style = false;  // AWS's own endpoint: virtual-hosted addressing
  }
  while (!options.endpoint.empty() && options.endpoint.back() == '/') options.endpoint.pop_back();
  if (options.endpoint.rfind("http://", 0) != 0 && options.endpoint.rfind("https://", 0) != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "S3 endpoint {} must start with http:// or https://", options.endpoint));
  }
  if (!options.credentials.access_key.empty()) return absl::OkStatus();
  if (!credentials_file.empty()) {
    std::string profile = Env("AWS_PROFILE").empty() ? "default" : Env("AWS_PROFILE");
    return ReadCredentialsFile(credentials_file, profile, /*must_be_private=*/true, options.credentials);
  }
  options.credentials.access_key = Env("AWS_ACCESS_KEY_ID");
  options.credentials.secret_key = Env("AWS_SECRET_ACCESS_KEY");
  options.credentials.session_token = Env("AWS_SESSION_TOKEN");
  if (!options.credentials.access_key.empty() && !options.credentials.secret_key.empty()) {
    return absl::OkStatus();
  }
  std::string shared = Env("AWS_SHARED_CREDENTIALS_FILE");
  if (shared.empty() && !Env("HOME").empty()) shared = Env("HOME") + "/.aws/credentials";
  std::string profile = Env("AWS_PROFILE").empty() ? "default" : Env("AWS_PROFILE");
  if (!shared.empty() && ReadCredentialsFile(shared, profile, false, options.credentials).ok()) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or give "
      "--s3-credentials-file (mode 0600), or write ~/.aws/credentials");
}

}  // namespace ckpt::storage
