// Where checkpoint bytes live, at the level an object store offers: write an object from a
// stream of chunks, read byte ranges, list by prefix, delete, and publish a step (its
// objects become visible at once, with their marker written last). The format's readers and
// the persist stage's writers use this alone, so the same code runs over a local disk
// (LocalStore: today's files, O_DIRECT and fsync order) and an S3 bucket.
//
// Keys are '/'-separated, relative to the store's root: "job/step-00000010/manifest.json".
// A prefix names a "directory": "job/step-00000010". Stores know nothing of checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ckpt::storage {

// An object being written, start to end, in order. Durable and complete only once Finish()
// returned Ok; an ObjectWriter destroyed before that leaves nothing a reader trusts (a
// local file under a staging prefix that is never published, an aborted S3 upload).
class ObjectWriter {
 public:
  virtual ~ObjectWriter() = default;
  // Appends [data, data + size), of any size and alignment. Large appends of 4 KiB-aligned
  // memory are the fast path (the local store writes them with O_DIRECT, straight from the
  // caller's memory); anything else is copied once, and small appends are gathered into
  // larger writes, so an error may surface at a later Append or at Finish().
  virtual absl::Status Append(const char* data, size_t size) = 0;
  // Makes the object durable (local: fsync; S3: the upload completed); returns its size.
  virtual absl::StatusOr<uint64_t> Finish() = 0;
};

class ObjectReader {
 public:
  virtual ~ObjectReader() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly `size` bytes at `offset`; OutOfRange when the object is shorter.
  virtual absl::Status ReadAt(void* data, size_t size, uint64_t offset) const = 0;
  // What to call the object in messages: a path, or an s3:// URL.
  virtual const std::string& name() const = 0;
};

struct ListEntry {
  std::string name;        // the last component, without the prefix
  bool is_prefix = false;  // a "directory": more keys below it
  uint64_t bytes = 0;      // objects only
};

// A multipart upload begun and neither completed nor aborted (S3): invisible to List, but
// stored and billed until aborted.
struct UnfinishedUpload {
  std::string key;  // relative to the store's root, like every key
  std::string id;
};

class Store {
 public:
  virtual ~Store() = default;

  // What to call `key` in messages (a path, an s3:// URL).
  virtual std::string Describe(std::string_view key) const = 0;

  virtual absl::StatusOr<std::unique_ptr<ObjectWriter>> Create(const std::string& key) = 0;
  virtual absl::StatusOr<std::unique_ptr<ObjectReader>> Open(const std::string& key) = 0;

  // Called as a copy progresses, with the bytes just written, on any of its threads; an
  // error it returns (Cancelled: the daemon is stopping) ends the copy with that error.
  using CopyProgress = std::function<absl::Status(uint64_t bytes)>;
  // Writes the object at `key` with every byte of `from` (an upload: a local shard file to
  // the remote tier); durable once it returns its size. This default streams `from` through
  // Create() in 16 MiB pieces; a store that takes an object in parts (S3) reads each part on
  // the thread that sends it, so that reads overlap the transfer and no part waits for
  // another's read.
  // `version` names what the bytes are (the uploader: the run that saved them). A copy that
  // fails part way (not one cancelled) may leave what it sent for a later copy of the same
  // version to the same key to resume: S3 keeps a failed multipart upload's parts, and the
  // next attempt sends only the parts still missing. Empty: never resumed.
  virtual absl::StatusOr<uint64_t> CopyFrom(const ObjectReader& from, const std::string& key,
                                            const CopyProgress& progress, std::string_view version);
  // Whether an object is at `key`.
  virtual absl::StatusOr<bool> Exists(const std::string& key) = 0;
  // What is directly under `prefix` (one level), sorted by name; empty when nothing is.
  virtual absl::StatusOr<std::vector<ListEntry>> List(const std::string& prefix) = 0;

  // Small whole objects (records, markers), written durably and whole, never torn.
  virtual absl::Status Put(const std::string& key, std::string_view contents) = 0;
  virtual absl::StatusOr<std::string> Get(const std::string& key, size_t max_bytes) = 0;

  // Where the objects of `published` are written before Publish: a prefix of its own where
  // the store can rename (local: "<published>.tmp"), `published` itself where it cannot
  // (S3: objects are written in place and are not part of anything until the marker is).
  virtual std::string StagingPrefix(const std::string& published) const = 0;
  // The objects written under `staging` become visible under `published` in one step, with
  // `marker` (the object whose presence says "complete") written last: a reader that sees
  // the marker sees every object. Local: the marker is written durably into the staging
  // directory, which is renamed and its parent fsynced. AlreadyExists when `published` is.
  virtual absl::Status Publish(const std::string& staging, const std::string& published,
                               const std::string& marker, std::string_view contents) = 0;
  // The reverse: what is under `published` stops being visible at once (a crash never
  // leaves it half deleted and still marked complete), then is removed.
  virtual absl::Status Retract(const std::string& published, const std::string& marker) = 0;
  // Moves what is published at `published` (a step) to `held`, a name no listing of steps
  // shows, where its objects stay readable: a step that later steps still reference
  // (format version 5) retired by retention. Local: one rename, the parent fsynced.
  // Unimplemented where objects cannot move (S3: a held step stays published there until
  // the remote tier learns held records, docs/design/incremental.md).
  virtual absl::Status Retire(const std::string& published, const std::string& held) {
    return absl::UnimplementedError(Describe(published) +
                                    " cannot retire a step and keep its files readable: kept published");
  }
  // Removes the one object at `key`; Ok when none is there. This default removes `key` as a
  // prefix, which on a local disk is the file itself.
  virtual absl::Status Remove(const std::string& key) { return RemovePrefix(key); }
  // Removes everything under `prefix` (objects never published, a staging prefix; on S3
  // also the multipart uploads begun under it and never completed, which a kill leaves
  // invisible but stored). Ok when nothing is there.
  virtual absl::Status RemovePrefix(const std::string& prefix) = 0;
  // The unfinished multipart uploads under `prefix` (what a writer killed mid-upload, or
  // stopped while the store did not answer its abort, leaves), and aborting one of them
  // (Ok when it is gone already). A store without such uploads lists none.
  virtual absl::StatusOr<std::vector<UnfinishedUpload>> ListUnfinishedUploads(const std::string& prefix) {
    (void)prefix;
    return std::vector<UnfinishedUpload>{};
  }
  virtual absl::Status AbortUpload(const UnfinishedUpload& upload) {
    (void)upload;
    return absl::OkStatus();
  }

  // Ends every transfer in flight (within a second) and fails every later call with
  // Cancelled: a daemon stopping does not wait on a store that stopped answering (a request
  // to it waits out its stall timeout, then is retried). An upload cut short still sends its
  // abort, once and briefly (S3: 3 s). A local disk answers; nothing to do.
  virtual void Cancel() {}
};

using StorePtr = std::shared_ptr<Store>;

}  // namespace ckpt::storage
