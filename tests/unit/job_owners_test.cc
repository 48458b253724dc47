// Owner records in the remote tier (JobOwners with Options::remote), over a real local
// store standing in for the bucket: a node with an empty disk takes the remote record as
// the job's owner, and a job of the same name owned by someone else is never published over,
// however often the uploader asks. A bucket that stops answering holds no registration;
// a replacement node asks its peers whose a job is before anyone claims its name.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include "common/status.h"
#include "daemon/session/job_owners.h"
#include "storage/filesystem.h"
#include "storage/local_store.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"

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
  JobOwners fresh(*fs, dir.path() + "/fresh", {.daemon_uid = 0, .job_gids = {}, .remote = bucket});
  absl::Status intruder = fresh.Claim("mine", User(1001));
  CHECK(absl::IsPermissionDenied(intruder));
  CHECK_THAT(std::string(intruder.message()), Catch::Contains("job mine belongs to uid 1000"));
  CHECK(fresh.Claim("mine", User(1000)).ok());
  CHECK(fresh.PublishRemote("mine").ok());

  // A node where uid 1001 made a job of that name before the remote tier was configured.
  JobOwners other(*fs, dir.path() + "/other", {.daemon_uid = 0, .job_gids = {}, .remote = nullptr});
  REQUIRE(other.Claim("mine", User(1001)).ok());
  JobOwners later(*fs, dir.path() + "/other", {.daemon_uid = 0, .job_gids = {}, .remote = bucket});
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
  JobOwners owners(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = bucket});
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

namespace {

using namespace std::chrono_literals;
using ckpt::daemon::KnownOwner;
using ckpt::daemon::OwnerSource;

// A bucket whose gateway stopped answering while `hung`: Get and Put wait until it answers
// again or the store is cancelled (as the S3 store's requests do).
class HungStore final : public ckpt::storage::Store {
 public:
  explicit HungStore(ckpt::storage::StorePtr inner) : inner_(std::move(inner)) {}
  void Hang(bool hung) {
    {
      std::lock_guard lock(mu_);
      hung_ = hung;
    }
    cv_.notify_all();
  }
  // Every request fails with `error` from now on (a gateway that refuses the keys).
  void Refuse(absl::Status error) {
    std::lock_guard lock(mu_);
    error_ = std::move(error);
  }

  std::string Describe(std::string_view key) const override { return "s3://hung/" + std::string(key); }
  absl::StatusOr<std::unique_ptr<ckpt::storage::ObjectWriter>> Create(const std::string& key) override {
    return inner_->Create(key);
  }
  absl::StatusOr<std::unique_ptr<ckpt::storage::ObjectReader>> Open(const std::string& key) override {
    return inner_->Open(key);
  }
  absl::StatusOr<bool> Exists(const std::string& key) override { return inner_->Exists(key); }
  absl::StatusOr<std::vector<ckpt::storage::ListEntry>> List(const std::string& prefix) override {
    return inner_->List(prefix);
  }
  absl::Status Put(const std::string& key, std::string_view contents) override {
    CKPT_RETURN_IF_ERROR(Wait());
    return inner_->Put(key, contents);
  }
  absl::StatusOr<std::string> Get(const std::string& key, size_t max_bytes) override {
    CKPT_RETURN_IF_ERROR(Wait());
    return inner_->Get(key, max_bytes);
  }
  std::string StagingPrefix(const std::string& published) const override { return inner_->StagingPrefix(published); }
  absl::Status Publish(const std::string& staging, const std::string& published, const std::string& marker,
                       std::string_view contents) override {
    return inner_->Publish(staging, published, marker, contents);
  }
  absl::Status Retract(const std::string& published, const std::string& marker) override {
    return inner_->Retract(published, marker);
  }
  absl::Status RemovePrefix(const std::string& prefix) override { return inner_->RemovePrefix(prefix); }
  void Cancel() override {
    {
      std::lock_guard lock(mu_);
      cancelled_ = true;
    }
    cv_.notify_all();
  }

 private:
  absl::Status Wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return !hung_ || cancelled_; });
    return cancelled_ ? absl::CancelledError("S3: ckptd is stopping") : error_;
  }
  ckpt::storage::StorePtr inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool hung_ = false, cancelled_ = false;
  absl::Status error_;
};

// The group's peers as a test sets them: an owner, nobody, or an error.
class FakePeers final : public OwnerSource {
 public:
  explicit FakePeers(absl::StatusOr<std::optional<KnownOwner>> answer) : answer_(std::move(answer)) {}
  std::string Describe() const override { return "the group's peers"; }
  absl::StatusOr<std::optional<KnownOwner>> Find(const std::string&) override {
    ++asked;
    return answer_;
  }
  std::atomic<int> asked{0};

 private:
  absl::StatusOr<std::optional<KnownOwner>> answer_;
};

template <typename F>
std::chrono::milliseconds Took(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
}

}  // namespace

TEST_CASE("a remote tier that never answers holds no registration: known jobs at once, new ones after the wait") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  auto hung = std::make_shared<HungStore>(ckpt::storage::MakeLocalStore(fs, dir.path() + "/bucket"));
  JobOwners owners(*fs, dir.path() + "/root",
                   {.daemon_uid = 0, .job_gids = {}, .remote = hung, .remote_only = false,
                    .ask_wait = 2s, .publish_wait = 200ms});
  REQUIRE(owners.Claim("known", User(1000)).ok());  // asked while the gateway answered
  hung->Hang(true);
  // A new job's first registration waits for the remote tier ask_wait at most, then goes
  // on: its steps commit locally.
  absl::Status fresh;
  std::thread first([&] { fresh = owners.Claim("fresh", User(1001)); });
  std::this_thread::sleep_for(50ms);  // its question on its way
  // Meanwhile every registration and admin call of a job this node knows answers at once.
  CHECK(Took([&] {
          CHECK(owners.MayClaim("known", User(1000)).ok());
          CHECK(absl::IsPermissionDenied(owners.MayClaim("known", User(1001))));
          CHECK(owners.Check("known", User(1000), "list steps of").ok());
          CHECK(owners.Check("fresh", User(0), "list steps of").ok());  // root asks nobody
          CHECK(owners.CheckRemote("known", User(0)).ok());
        }) < 1s);
  first.join();
  CHECK(fresh.ok());
  CHECK(owners.LocalOwner("fresh") == 1001u);
  // Its upload says what it waits for, soon, and asks no second time meanwhile.
  absl::Status published = owners.PublishRemote("fresh");
  CHECK(absl::IsDeadlineExceeded(published));
  CHECK_THAT(std::string(published.message()),
             Catch::Contains("waiting for the remote tier to say who owns job fresh: GET s3://hung/fresh/.owner "
                             "has had no answer for"));
  CHECK(absl::IsDeadlineExceeded(owners.PublishRemote("fresh")));
  // The gateway answers again: the record goes up.
  hung->Hang(false);
  REQUIRE(ckpt::testing::WaitUntil([&] { return owners.PublishRemote("fresh").ok(); }, 5s, 20ms));
  CHECK(hung->Get("fresh/.owner", 4096).value_or("") == "{\"uid\":1001}\n");
  // A question still waiting when ckptd stops ends with it.
  hung->Hang(true);
  std::thread last([&] { (void)owners.MayClaim("other", User(1001)); });
  std::this_thread::sleep_for(50ms);
  CHECK(Took([&] { owners.Stop(); }) < 1s);
  last.join();
}

TEST_CASE("a remote tier that refuses the credentials: new jobs commit locally, the upload names the cause") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  auto bucket = std::make_shared<HungStore>(ckpt::storage::MakeLocalStore(fs, dir.path() + "/bucket"));
  bucket->Refuse(absl::PermissionDeniedError(
      "S3 GET s3://hung/mine/.owner: HTTP 403 SignatureDoesNotMatch: The request signature we calculated does not match"));
  JobOwners owners(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = bucket});
  CHECK(owners.Claim("mine", User(1001)).ok());
  absl::Status published = owners.PublishRemote("mine");
  CHECK(absl::IsUnavailable(published));
  CHECK_THAT(std::string(published.message()), Catch::Contains("cannot ask the remote tier who owns job mine"));
  CHECK_THAT(std::string(published.message()), Catch::Contains("HTTP 403 SignatureDoesNotMatch"));
  // --remote-mode direct: every step would be written there, so the name is refused.
  JobOwners direct(*fs, dir.path() + "/direct", {.daemon_uid = 0, .job_gids = {}, .remote = bucket, .remote_only = true});
  absl::Status refused = direct.Claim("mine", User(1001));
  CHECK(absl::IsPermissionDenied(refused));
  CHECK_THAT(std::string(refused.message()), Catch::Contains("cannot ask the remote tier who owns it"));
  CHECK(direct.Claim("mine", User(0)).ok());
}

TEST_CASE("a replacement node asks its peers whose a job is before anyone claims its name") {
  TempDir dir;
  auto fs = ckpt::MakePosixFilesystem();
  SECTION("a peer names the owner: another uid is refused, naming both, the owner's record is written") {
    JobOwners owners(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = nullptr});
    auto peers = std::make_unique<FakePeers>(std::optional<KnownOwner>(KnownOwner{1000, 4000, "node 1's owner record of the job"}));
    FakePeers* asked = peers.get();
    owners.AskPeers(std::move(peers));
    absl::Status squat = owners.MayClaim("demo", User(1002));
    CHECK(absl::IsPermissionDenied(squat));
    CHECK_THAT(std::string(squat.message()), Catch::Contains("job demo belongs to uid 1000 (and group 4000)"));
    CHECK_THAT(std::string(squat.message()), Catch::Contains("node 1's owner record of the job says so"));
    CHECK(absl::IsPermissionDenied(owners.Claim("demo", User(1002))));
    CHECK_FALSE(std::filesystem::exists(dir.path() + "/root/demo/.owner"));
    CHECK(owners.Claim("demo", User(1000)).ok());
    std::ifstream record(dir.path() + "/root/demo/.owner");
    std::string text((std::istreambuf_iterator<char>(record)), std::istreambuf_iterator<char>());
    CHECK(text == "{\"gid\":4000,\"uid\":1000}\n");
    // Known here now: nobody is asked again.
    const int before = asked->asked;
    CHECK(owners.MayClaim("demo", User(1000)).ok());
    CHECK(asked->asked == before);
  }
  SECTION("peers that know nothing: a new job, the first comer's") {
    JobOwners owners(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = nullptr});
    owners.AskPeers(std::make_unique<FakePeers>(std::optional<KnownOwner>()));
    CHECK(owners.Claim("new", User(1002)).ok());
    CHECK(owners.LocalOwner("new") == 1002u);
  }
  SECTION("peers that cannot be asked: refused to all but root") {
    JobOwners owners(*fs, dir.path() + "/root", {.daemon_uid = 0, .job_gids = {}, .remote = nullptr});
    owners.AskPeers(std::make_unique<FakePeers>(absl::UnavailableError("node 1: connection refused")));
    absl::Status refused = owners.MayClaim("demo", User(1002));
    CHECK(absl::IsPermissionDenied(refused));
    CHECK_THAT(std::string(refused.message()), Catch::Contains("its group's peers could not say who owns it (node 1: connection refused)"));
    CHECK(owners.Claim("demo", User(0)).ok());
  }
}
