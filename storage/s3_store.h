// The Store on an S3-compatible object store (AWS S3, GCS's XML API with HMAC keys, Ceph
// RGW, MinIO), through libcurl: it signs every request with AWS Signature V4 itself
// (CURLOPT_AWS_SIGV4), and does HTTP, TLS and connection reuse. An object is written as one
// PUT when it fits in a part, else as a multipart upload whose parts (S3Options::part_bytes)
// go up `parallel` at a time while the next ones are appended; reads of more than a part are
// ranged GETs `parallel` at a time. Every request is retried with jittered back-off on 5xx,
// 429 and dropped or stalled connections; a part that fails is sent again, not the object.
//
// There is no rename: objects are written in place (StagingPrefix is the published prefix
// itself), and Publish puts the marker last, so a reader that goes by markers never sees an
// incomplete step; RemovePrefix clears what was never published.
#pragma once

#include "storage/s3_config.h"
#include "storage/store.h"

namespace ckpt::storage {

absl::StatusOr<StorePtr> MakeS3Store(S3Options options);

}  // namespace ckpt::storage
