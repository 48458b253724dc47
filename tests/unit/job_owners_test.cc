// Owner records in the remote tier (JobOwners with Options::remote), over a real local
// store standing in for the bucket: a node with an empty disk takes the remote record as
// the job's owner, and a job of the same name owned by someone else is never published over,
// however often the uploader asks.
#include <catch2/catch.hpp>

#include "daemon/session/job_owners.h"
#include "storage/filesystem.h"
#include "storage/local_store.h"
#include "tests/fakes/temp_dir.h"

using ckpt::daemon::JobOwners;
using ckpt::daemon::PeerIdentity;
using ckpt::testing::TempDir;

namespace {

PeerIdentity User(uid_t uid) {
  PeerIdentity p;
  p.pid = 1;
  p.uid = uid;
  p.gid = uid;
  return p;
}

}  // namespace

TEST_CASE("a job owned by another uid in the remote tier is refused, and never published over") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  auto bucket = ckpt::storage::MakeLocalStore(fs, dir.path() + "/bucket");
  REQUIRE(bucket->Put("mine/.owner", "{\"uid\":1000}\n").ok());

  // A node with an empty disk: the remote record decides.
  JobOwners fresh(*fs, dir.path() + "/fresh", {.daemon_uid = 0, .job_gids = {}, .remote = bucket.get()});
  absl::Status intruder = fresh.Claim("mine", User(1001));
  CHECK(absl::IsPermissionDenied(intruder));
  CHECK_THAT(std::string(intruder.message()), Catch::Contains("job mine belongs to uid 1000"));
  CHECK(fresh.Claim("mine", User(1000)).ok());
  CHECK(fresh.PublishRemote("mine").ok());

  // A node where uid 1001 made a job of that name before the remote tier was configured.
  JobOwners other(*fs, dir.path() + "/other", {.daemon_uid = 0, .job_gids = {}, .remote = nullptr});
  REQUIRE(other.Claim("mine", User(1001)).ok());
  JobOwners later(*fs, dir.path() + "/other", {.daemon_uid = 0, .job_gids = {}, .remote = bucket.get()});
  for (int attempt = 0; attempt < 3; ++attempt) {  // the uploader retries
    absl::Status published = later.PublishRemote("mine");
    CHECK(absl::IsPermissionDenied(published));
    CHECK_THAT(std::string(published.message()), Catch::Contains("belongs to uid 1000, here to uid 1001"));
  }
  auto record = bucket->Get("mine/.owner", 4096);
  REQUIRE(record.ok());
  CHECK(*record == "{\"uid\":1000}\n");

  // A job the remote tier has never seen: its record goes there.
  REQUIRE(later.Claim("new", User(1001)).ok());
  CHECK(later.PublishRemote("new").ok());
  CHECK(bucket->Get("new/.owner", 4096).value_or("") == "{\"uid\":1001}\n");
}

TEST_CASE("who may see that a job exists: its owner, from this node's records alone") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  auto bucket = ckpt::storage::MakeLocalStore(fs, dir.path() + "/bucket");
  REQUIRE(bucket->Put("remote-only/.owner", "{\"uid\":1001}\n").ok());
  JobOwners owners(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = bucket.get()});
  REQUIRE(owners.Claim("ours", User(1001)).ok());
  CHECK(owners.VisibleTo("ours", User(1001)));
  CHECK_FALSE(owners.VisibleTo("ours", User(1002)));  // another user never learns the name
  CHECK(owners.VisibleTo("ours", User(0)));
  // Only in the remote tier: not looked up (no request under the lock registrations take).
  CHECK_FALSE(owners.VisibleTo("remote-only", User(1001)));
  CHECK_FALSE(owners.VisibleTo("../etc", User(0)));
  // A record written by another daemon's run, not yet in memory, is read from disk.
  JobOwners restarted(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = nullptr});
  CHECK(restarted.VisibleTo("ours", User(1001)));
  CHECK_FALSE(restarted.VisibleTo("ours", User(1002)));
}
