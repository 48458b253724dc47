// Where an S3 store is and who may use it: `s3://bucket/prefix`, the endpoint (AWS, GCS's
// XML API, Ceph RGW, MinIO), the region, addressing, TLS and the credentials, taken from the
// places the AWS SDKs look. Credentials never appear in logs, status, errors or argv.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace ckpt::storage {

struct S3Credentials {
  std::string access_key;
  std::string secret_key;
  std::string session_token;  // temporary credentials only
};

struct S3Options {
  std::string bucket;
  std::string prefix;      // inside the bucket, no leading or trailing '/'; may be empty
  std::string endpoint;    // scheme://host[:port]; default https://s3.<region>.amazonaws.com
  std::string region = "us-east-1";
  bool path_style = true;  // bucket in the path (RGW, MinIO) rather than the host name
  std::string ca_bundle;   // empty: the system's CAs
  S3Credentials credentials;
  uint64_t part_bytes = 16u << 20;  // multipart part size (5 MiB .. 5 GiB)
  int parallel = 8;                 // parts (and ranged GETs) in flight per object
  // Requests in flight at once through this store, whatever asks (several uploads, several
  // ranks restoring): past what the gateway serves at once, more only queue up there.
  int max_requests = 16;
  int attempts = 6;                 // per request, retrying 5xx and dropped connections
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds stall_timeout{30000};  // no byte moved for this long: retried
};

// `s3://bucket[/prefix]` into options' bucket and prefix; InvalidArgument naming what is wrong.
absl::Status ParseS3Url(const std::string& url, S3Options& options);

// The endpoint, region and credentials from the environment and files, as the AWS SDKs
// find them: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; AWS_REGION or AWS_DEFAULT_REGION;
// AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, else `credentials_file` (which
// must be mode 0600 or stricter and owned by this user), else AWS_SHARED_CREDENTIALS_FILE or
// ~/.aws/credentials, profile AWS_PROFILE or "default". Values already set in `options`
// (from flags) win.
absl::Status ResolveS3Environment(S3Options& options, const std::string& credentials_file = {});

}  // namespace ckpt::storage
