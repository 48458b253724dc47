#include "storage/open_store.h"

#include "common/status.h"
#include "storage/local_store.h"
#include "storage/s3_store.h"

namespace ckpt::storage {

absl::StatusOr<StorePtr> OpenStore(const std::string& where, FilesystemPtr fs,
                                   const OpenStoreOptions& options) {
  if (!IsS3Url(where)) return MakeLocalStore(std::move(fs), where, {.private_top_level = true});
  S3Options s3;
  CKPT_RETURN_IF_ERROR(ParseS3Url(where, s3));
  s3.endpoint = options.s3_endpoint;
  CKPT_RETURN_IF_ERROR(ResolveS3Environment(s3, options.s3_credentials_file));
  return MakeS3Store(std::move(s3));
}

}  // namespace ckpt::storage
