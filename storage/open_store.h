// A store from what an operator types: a local path, or an s3://bucket/prefix URL whose
// endpoint, region and credentials come from the environment (storage/s3_config.h).
#pragma once

#include <string>

#include "storage/filesystem.h"
#include "storage/store.h"

namespace ckpt::storage {

struct OpenStoreOptions {
  std::string s3_endpoint;          // --s3-endpoint; empty: AWS_ENDPOINT_URL_S3 and friends
  std::string s3_credentials_file;  // --s3-credentials-file (mode 0600)
};

inline bool IsS3Url(const std::string& where) { return where.rfind("s3://", 0) == 0; }

absl::StatusOr<StorePtr> OpenStore(const std::string& where, FilesystemPtr fs,
                                   const OpenStoreOptions& options = {});

}  // namespace ckpt::storage
