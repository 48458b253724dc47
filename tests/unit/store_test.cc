// The Store contract (storage/store.h), run over each implementation: objects written from
// chunks of any alignment read back byte for byte, nothing unpublished is visible under its
// published name, the marker comes with everything else, a retraction never leaves a step
// half visible, and faults are statuses naming the object.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <numeric>
#include <utility>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/status.h"
#include "daemon/persist/shard_writer.h"
#include "format/checkpoint_store.h"
#include "format/checksum.h"
#include "format/verify.h"
#include "storage/local_store.h"
#include "storage/s3_store.h"
#include "tests/fakes/ceph_cluster.h"
#include "tests/fakes/faulty_filesystem.h"
#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"
#include "tests/integration/tcp_proxy.h"

using namespace ckpt;
using namespace ckpt::storage;
using ckpt::testing::FaultyFilesystem;
using ckpt::testing::TempDir;

namespace {

// A local store on the test's own directory (ext4 here: the O_DIRECT path), and one on
// /dev/shm (tmpfs refuses O_DIRECT: the buffered path).
struct LocalDisk {
  TempDir dir;
  std::shared_ptr<FaultyFilesystem> fs = std::make_shared<FaultyFilesystem>(MakePosixFilesystem());
  StorePtr store = MakeLocalStore(fs, dir.path());
};
struct LocalTmpfs {
  TempDir dir{"/dev/shm"};
  std::shared_ptr<FaultyFilesystem> fs = std::make_shared<FaultyFilesystem>(MakePosixFilesystem());
  StorePtr store = MakeLocalStore(fs, dir.path());
};

// A bucket on a real Ceph RADOS Gateway (tools/ceph.sh), one cluster for the whole binary,
// a prefix of its own per case. Small parts, so that multipart uploads and parallel ranged
// GETs happen with a few MiB.
struct S3Rgw {
  S3Rgw() {
    S3Options options = testing::CephCluster::Get().Options();
    options.prefix = testing::CephCluster::Get().FreshPrefix();
    options.part_bytes = 5u << 20;
    options.parallel = 4;
    prefix = options.prefix;
    auto made = MakeS3Store(options);
    REQUIRE(made.ok());
    store = *made;
  }
  StorePtr store;
  std::string prefix;
};

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) >> 3);
  return v;
}

// Bytes that never repeat at any period a store could confuse (Pattern repeats every 2 KiB,
// so a part read from another part's offset would still compare equal).
std::vector<char> Unique(size_t n, uint64_t seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t z = (i + seed * 0x9e3779b97f4a7c15ULL) * 0xbf58476d1ce4e5b9ULL;  // splitmix64's mix
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    v[i] = static_cast<char>(z ^ (z >> 31));
  }
  return v;
}

// The test cluster's gateway behind a proxy the test controls (faults, crafted answers):
// S3Options of a fresh prefix that reach RGW through `proxy`.
int GatewayPort(testing::CephCluster& ceph) {
  const std::string endpoint = ceph.Options().endpoint;  // http://127.0.0.1:PORT
  return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
}
S3Options ThroughProxy(testing::CephCluster& ceph, const testing::TcpProxy& proxy) {
  S3Options options = ceph.Options();
  options.endpoint = "http://" + proxy.address();
  options.prefix = ceph.FreshPrefix();
  return options;
}

struct AlignedFree {
  void operator()(char* p) const { std::free(p); }
};

std::vector<std::string> Names(Store& store, const std::string& prefix) {
  auto listed = store.List(prefix);
  REQUIRE(listed.ok());
  std::vector<std::string> names;
  for (const ListEntry& e : *listed) names.push_back(e.name + (e.is_prefix ? "/" : ""));
  return names;
}

}  // namespace

TEMPLATE_TEST_CASE("objects written from chunks of any alignment read back byte for byte", "",
                   LocalDisk, LocalTmpfs, S3Rgw) {
  TestType t;
  // An unaligned header-sized piece, aligned 4 KiB multiples straight from aligned memory,
  // an unaligned-memory multiple, short runs that start and end mid-block (an incremental
  // shard's own runs: each waits for the next to fill its last block), and a short tail.
  const size_t sizes[] = {8192, 3 << 20, 12288, 1000, 100, 5000, 4096, 8192 + 17, 3, 1000};
  std::vector<char> all;
  auto writer = t.store->Create("job/step-00000001.tmp/rank-00000.safetensors");
  REQUIRE(writer.ok());
  int seed = 0;
  for (size_t n : sizes) {
    std::vector<char> piece = Pattern(n, ++seed);
    std::unique_ptr<char, AlignedFree> aligned(static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096)));
    std::memcpy(aligned.get(), piece.data(), n);
    const char* from = seed % 3 == 0 ? piece.data() : aligned.get();  // every third from unaligned memory
    REQUIRE((*writer)->Append(from, n).ok());
    all.insert(all.end(), piece.begin(), piece.end());
  }
  auto size = (*writer)->Finish();
  REQUIRE(size.ok());
  CHECK(*size == all.size());

  auto reader = t.store->Open("job/step-00000001.tmp/rank-00000.safetensors");
  REQUIRE(reader.ok());
  CHECK((*reader)->size() == all.size());
  for (auto [offset, n] : {std::pair<size_t, size_t>{0, all.size()}, {5, 100}, {8190, 5000},
                           {all.size() - 10, 10}}) {
    std::vector<char> got(n);
    REQUIRE((*reader)->ReadAt(got.data(), n, offset).ok());
    CHECK(std::equal(got.begin(), got.end(), all.begin() + offset));
  }
  // Into aligned memory at aligned offsets (a local file reads those with O_DIRECT where
  // the filesystem allows it, its unaligned tail through the page cache).
  std::unique_ptr<char, AlignedFree> into(static_cast<char*>(std::aligned_alloc(4096, (all.size() + 4096 + 4095) / 4096 * 4096)));
  for (auto [offset, n] : {std::pair<size_t, size_t>{0, all.size()}, {4096, 8192}, {8192, all.size() - 8192},
                           {0, 4095}}) {
    REQUIRE((*reader)->ReadAt(into.get(), n, offset).ok());
    CHECK(std::equal(into.get(), into.get() + n, all.begin() + offset));
  }
  CHECK(absl::IsOutOfRange((*reader)->ReadAt(into.get(), 8192, all.size() / 4096 * 4096)));
  std::vector<char> beyond(10);
  auto past = (*reader)->ReadAt(beyond.data(), 10, all.size() - 5);
  CHECK(absl::IsOutOfRange(past));
  CHECK(Message(past).find("rank-00000.safetensors") != std::string::npos);
}

// An incremental shard appends its changed chunks one by one, each often a block, from all
// over staging memory: written as they came, a sparse table's increment made ~30,000
// synchronous O_DIRECT writes and took 3x a full checkpoint's time (docs/benchmarks.md).
// True, having said so, when files in `dir` do not open with O_DIRECT (ext4 and xfs do;
// tmpfs before Linux 6.6 does not, and there the store writes through the page cache, each
// append at once): a case about gathered O_DIRECT writes is skipped there.
bool SkippedWithoutDirectIo(const std::string& dir) {
  const std::string probe = dir + "/direct-probe";
  const int fd = ::open(probe.c_str(), O_CREAT | O_WRONLY | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  if (fd < 0) std::cout << "SKIPPED: the test's directory refuses O_DIRECT (" << dir << ")\n";
  return fd < 0;
}

TEST_CASE("small appends to a local file are gathered into large writes, large aligned ones go straight") {
  LocalDisk t;
  if (SkippedWithoutDirectIo(t.dir.path())) return;
  auto writer = t.store->Create("job/step-00000001.tmp/rank-00000.safetensors");
  REQUIRE(writer.ok());
  const size_t source_bytes = 32u << 20;
  std::unique_ptr<char, AlignedFree> source(static_cast<char*>(std::aligned_alloc(4096, source_bytes)));
  std::vector<char> pattern = Unique(source_bytes, 7);
  std::memcpy(source.get(), pattern.data(), source_bytes);
  std::vector<char> all;
  auto append = [&](const char* from, size_t n) {
    REQUIRE((*writer)->Append(from, n).ok());
    all.insert(all.end(), from, from + n);
  };
  std::vector<char> header = Pattern(4096, 8);
  append(header.data(), header.size());                                      // unaligned memory
  for (size_t i = 0; i < 3000; ++i) append(source.get() + 2 * i * 4096, 4096);  // every other block
  append(source.get() + (30u << 20), 2u << 20);                              // a large aligned run
  append(source.get() + 5, 10);                                              // a short tail
  auto size = (*writer)->Finish();
  REQUIRE(size.ok());
  CHECK(*size == all.size());
  // One write when 8 MiB were gathered, one for the rest gathered before the large run, the
  // run itself, and the padded tail at Finish().
  CHECK(t.fs->writes() == 4);
  auto reader = t.store->Open("job/step-00000001.tmp/rank-00000.safetensors");
  REQUIRE(reader.ok());
  std::vector<char> got(all.size());
  REQUIRE((*reader)->ReadAt(got.data(), got.size(), 0).ok());
  CHECK(got == all);
}

TEST_CASE("a write of gathered appends that fails is returned by Finish, naming the file") {
  LocalDisk t;
  if (SkippedWithoutDirectIo(t.dir.path())) return;
  auto writer = t.store->Create("job/step-00000002.tmp/rank-00003.safetensors");
  REQUIRE(writer.ok());
  std::vector<char> bytes = Pattern(5000, 2);
  t.fs->FailAfter(FaultyFilesystem::Op::kWrite, 0, ENOSPC);
  REQUIRE((*writer)->Append(bytes.data(), bytes.size()).ok());  // gathered: nothing written yet
  auto finished = (*writer)->Finish();
  REQUIRE_FALSE(finished.ok());
  CHECK(Message(finished.status()).find("rank-00003.safetensors") != std::string::npos);
  CHECK(Message(finished.status()).find("No space left") != std::string::npos);
}

TEMPLATE_TEST_CASE("after a failed write every later append and Finish fail: never a short file finished as whole",
                   "", LocalDisk, LocalTmpfs) {
  TestType t;
  auto writer = t.store->Create("job/step-00000002.tmp/rank-00004.safetensors");
  REQUIRE(writer.ok());
  std::unique_ptr<char, AlignedFree> run(static_cast<char*>(std::aligned_alloc(4096, 2u << 20)));
  std::memset(run.get(), 7, 2u << 20);
  t.fs->FailAfter(FaultyFilesystem::Op::kWrite, 0, ENOSPC);
  CHECK_FALSE((*writer)->Append(run.get(), 2u << 20).ok());  // written straight, and refused
  t.fs->Heal();
  CHECK_FALSE((*writer)->Append(run.get(), 4096).ok());
  auto finished = (*writer)->Finish();
  REQUIRE_FALSE(finished.ok());
  CHECK(Message(finished.status()).find("rank-00004.safetensors") != std::string::npos);
}

// S3 opens an object with one ranged GET (its size from Content-Range, its first bytes
// kept): empty objects have no byte to range over, and a Get's limit must tell an object of
// exactly that size from a larger one.
TEMPLATE_TEST_CASE("empty, small and missing objects: sizes, whole gets and limits", "", LocalDisk,
                   LocalTmpfs, S3Rgw) {
  TestType t;
  REQUIRE(t.store->Put("job/empty", "").ok());
  auto empty = t.store->Open("job/empty");
  REQUIRE(empty.ok());
  CHECK((*empty)->size() == 0);
  char byte = 0;
  CHECK(absl::IsOutOfRange((*empty)->ReadAt(&byte, 1, 0)));
  auto got = t.store->Get("job/empty", 10);
  REQUIRE(got.ok());
  CHECK(got->empty());

  const std::vector<char> pattern = Unique(70000, 3);  // over the first GET's 64 KiB
  const std::string contents(pattern.begin(), pattern.end());
  REQUIRE(t.store->Put("job/small", contents).ok());
  auto small = t.store->Open("job/small");
  REQUIRE(small.ok());
  CHECK((*small)->size() == contents.size());
  std::string tail(contents.size() - 60000, '\0');  // across the kept first bytes' end
  REQUIRE((*small)->ReadAt(tail.data(), tail.size(), 60000).ok());
  CHECK(tail == contents.substr(60000));
  got = t.store->Get("job/small", contents.size());
  REQUIRE(got.ok());
  CHECK(*got == contents);
  auto over = t.store->Get("job/small", contents.size() - 1);
  CHECK(absl::IsOutOfRange(over.status()));
  CHECK_THAT(Message(over.status()), Catch::Contains("small") && Catch::Contains("70000"));

  auto missing = t.store->Open("job/missing");
  CHECK(absl::IsNotFound(missing.status()));
  CHECK_THAT(Message(missing.status()), Catch::Contains("job/missing"));
  CHECK(absl::IsNotFound(t.store->Get("job/missing", 10).status()));
}

// A local file as an upload reads it: the source of CopyFrom (a real file on the test's
// disk), and one whose reads fail from some offset on (a disk that went bad mid-upload).
class FailingFrom final : public ObjectReader {
 public:
  FailingFrom(const ObjectReader& real, uint64_t fail_at) : real_(real), fail_at_(fail_at) {}
  uint64_t size() const override { return real_.size(); }
  const std::string& name() const override { return real_.name(); }
  absl::Status ReadAt(void* data, size_t size, uint64_t offset) const override {
    if (offset + size > fail_at_) return absl::DataLossError(name() + ": input/output error");
    return real_.ReadAt(data, size, offset);
  }

 private:
  const ObjectReader& real_;
  const uint64_t fail_at_;
};

TEMPLATE_TEST_CASE("an object copied from a local file arrives whole, or not at all", "", LocalDisk,
                   S3Rgw) {
  TestType t;
  LocalDisk source;
  // 13 MiB and a bit: three and a bit 5 MiB parts on S3, read ahead and sent out of order.
  const std::vector<char> all = Unique((13u << 20) + 1234, 9);
  REQUIRE(source.store->Put("job/rank-00000.safetensors", std::string_view(all.data(), all.size())).ok());
  auto from = source.store->Open("job/rank-00000.safetensors");
  REQUIRE(from.ok());

  std::atomic<uint64_t> reported = 0;
  auto copied = t.store->CopyFrom(**from, "up/rank-00000.safetensors", [&](uint64_t n) {
    reported += n;
    return absl::OkStatus();
  }, "v1");
  REQUIRE(copied.ok());
  CHECK(*copied == all.size());
  CHECK(reported == all.size());
  auto back = t.store->Get("up/rank-00000.safetensors", all.size());
  REQUIRE(back.ok());
  CHECK(*back == std::string(all.data(), all.size()));

  // Stopped on the way (the daemon stopping): the error is the stop, and on S3 the upload
  // is aborted, never completed into an object.
  auto stopped = t.store->CopyFrom(**from, "up/stopped.safetensors",
                                   [](uint64_t) { return absl::CancelledError("ckptd is stopping"); }, "v1");
  CHECK(absl::IsCancelled(stopped.status()));
  // A source that fails halfway: its error, naming the file.
  FailingFrom failing(**from, 7u << 20);
  auto failed = t.store->CopyFrom(failing, "up/failed.safetensors", [](uint64_t) { return absl::OkStatus(); }, "");
  CHECK(absl::IsDataLoss(failed.status()));
  CHECK_THAT(Message(failed.status()), Catch::Contains("rank-00000.safetensors"));
  if constexpr (std::is_same_v<TestType, S3Rgw>) {
    CHECK_FALSE(*t.store->Exists("up/stopped.safetensors"));
    CHECK_FALSE(*t.store->Exists("up/failed.safetensors"));
    CHECK_THAT(testing::CephCluster::Get().UnfinishedUploads(t.prefix), !Catch::Contains("<UploadId>"));
  }
}

TEST_CASE("no multipart upload is left behind: one a stop cut short is aborted, one a kill left is removed with its prefix") {
  testing::CephCluster& ceph = testing::CephCluster::Get();
  S3Options options = ceph.Options();
  options.prefix = ceph.FreshPrefix();
  options.part_bytes = 5u << 20;
  auto store = MakeS3Store(options);
  REQUIRE(store.ok());
  LocalDisk source;
  const std::vector<char> all = Unique(32u << 20, 3);
  REQUIRE(source.store->Put("rank-00000.safetensors", std::string_view(all.data(), all.size())).ok());
  auto from = source.store->Open("rank-00000.safetensors");
  REQUIRE(from.ok());

  // ckptd stops once a part is in: Cancel ends the copy, and its upload is still aborted.
  std::atomic<bool> part_in = false, cancelled = false;
  absl::StatusOr<uint64_t> copied;
  std::thread copying([&] {
    copied = (*store)->CopyFrom(**from, "job/step-00000001/rank-00000.safetensors", [&](uint64_t) {
      part_in = true;
      while (!cancelled) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return absl::OkStatus();
    }, "v1");
  });
  REQUIRE(testing::WaitUntil([&] { return part_in.load(); }, std::chrono::seconds(30), std::chrono::milliseconds(1)));
  (*store)->Cancel();
  cancelled = true;
  copying.join();
  CHECK(absl::IsCancelled(copied.status()));
  CHECK_THAT(ceph.UnfinishedUploads(options.prefix), !Catch::Contains("<UploadId>"));

  // A writer killed mid-upload leaves its upload begun: invisible to a listing, removed with
  // the step's prefix (an orphaned step's clean-up) all the same.
  auto fresh = MakeS3Store(options);
  REQUIRE(fresh.ok());
  ceph.Curl("POST", "/" + options.prefix + "/job/step-00000002/rank-00000.safetensors?uploads=");
  REQUIRE_THAT(ceph.UnfinishedUploads(options.prefix), Catch::Contains("<UploadId>"));
  CHECK(Names(**fresh, "job/step-00000002").empty());
  REQUIRE((*fresh)->RemovePrefix("job/step-00000002").ok());
  CHECK_THAT(ceph.UnfinishedUploads(options.prefix), !Catch::Contains("<UploadId>"));
}

TEST_CASE("a multipart copy cut short resumes with the parts it sent; another version starts over") {
  testing::CephCluster& ceph = testing::CephCluster::Get();
  testing::TcpProxy proxy("127.0.0.1", GatewayPort(ceph));
  S3Options options = ThroughProxy(ceph, proxy);
  options.part_bytes = 5u << 20;
  options.parallel = 2;
  options.attempts = 1;  // the outage fails the copy at once
  auto store = MakeS3Store(options);
  REQUIRE(store.ok());
  LocalDisk source;
  const std::vector<char> all = Unique(40u << 20, 5);
  REQUIRE(source.store->Put("rank-00000.safetensors", std::string_view(all.data(), all.size())).ok());
  auto from = source.store->Open("rank-00000.safetensors");
  REQUIRE(from.ok());
  const std::string key = "job/step-00000001/rank-00000.safetensors";
  auto ok = [](uint64_t) { return absl::OkStatus(); };

  // The gateway goes away once two parts are in.
  std::atomic<int> parts_in = 0;
  auto cut = (*store)->CopyFrom(**from, key, [&](uint64_t n) {
    if (n > 0 && ++parts_in == 2) proxy.Cut(testing::TcpProxy::CutMode::kRefuse);
    return absl::OkStatus();
  }, "run-1");
  REQUIRE_FALSE(cut.ok());
  CHECK_FALSE(absl::IsCancelled(cut.status()));
  proxy.Heal();
  // The same version again: only the missing parts go (at least the two that were in stay).
  const uint64_t before = proxy.forwarded_bytes();
  auto resumed = (*store)->CopyFrom(**from, key, ok, "run-1");
  REQUIRE(resumed.ok());
  CHECK(proxy.forwarded_bytes() - before < all.size() - (9u << 20));
  auto back = (*store)->Get(key, all.size());
  REQUIRE(back.ok());
  CHECK(*back == std::string(all.data(), all.size()));
  CHECK_THAT(ceph.UnfinishedUploads(options.prefix), !Catch::Contains("<UploadId>"));

  // Cut short again, then copied as another version (another run's step of the same number):
  // every part is sent again, and the first upload is aborted, not left behind.
  parts_in = 0;
  const std::string other = "job/step-00000002/rank-00000.safetensors";
  REQUIRE_FALSE((*store)->CopyFrom(**from, other, [&](uint64_t n) {
    if (n > 0 && ++parts_in == 2) proxy.Cut(testing::TcpProxy::CutMode::kRefuse);
    return absl::OkStatus();
  }, "run-1").ok());
  proxy.Heal();
  const uint64_t again = proxy.forwarded_bytes();
  REQUIRE((*store)->CopyFrom(**from, other, ok, "run-2").ok());
  CHECK(proxy.forwarded_bytes() - again > all.size());
  CHECK_THAT(ceph.UnfinishedUploads(options.prefix), !Catch::Contains("<UploadId>"));
}

// A server (or a proxy in front of one) whose answer to the first GET of an object is not
// what was asked: its bytes must never be taken for the object's start or size.
TEST_CASE("an S3 object's first answer that is not its first bytes is refused, never trusted") {
  testing::CephCluster& ceph = testing::CephCluster::Get();
  testing::TcpProxy proxy("127.0.0.1", GatewayPort(ceph));
  S3Options options = ThroughProxy(ceph, proxy);
  options.attempts = 1;
  auto store = MakeS3Store(options);
  REQUIRE(store.ok());
  auto answer = [&](const std::string& status, const std::string& headers, const std::string& body) {
    proxy.Answer(fmt::format("HTTP/1.1 {}\r\n{}Content-Length: {}\r\nConnection: close\r\n\r\n{}", status,
                             headers, body.size(), body));
  };
  // Bytes 10-19 of a 20-byte object, in an answer as long as the object.
  answer("206 Partial Content", "Content-Range: bytes 10-19/20\r\n", "0123456789abcdefghij");
  auto open = (*store)->Open("job/x");
  CHECK(absl::IsDataLoss(open.status()));
  CHECK_THAT(Message(open.status()), Catch::Contains("job/x"));
  CHECK(absl::IsDataLoss((*store)->Get("job/x", 100).status()));
  // No size at all.
  answer("206 Partial Content", "", "hello");
  CHECK(absl::IsDataLoss((*store)->Open("job/x").status()));
  // "Not satisfiable" for an object the server then says is not empty (and to every HEAD).
  answer("416 Requested Range Not Satisfiable", "", "");
  CHECK_FALSE((*store)->Open("job/x").ok());
  CHECK_FALSE((*store)->Get("job/x", 100).ok());
  // A server that ignores Range and sends all of a large object: refused, not buffered.
  answer("200 OK", "", std::string(100000, 'x'));
  auto ignored = (*store)->Open("job/x");
  CHECK_FALSE(ignored.ok());
  CHECK_THAT(Message(ignored.status()), Catch::Contains("ignore Range"));
  // Healed, the same calls work against the real gateway.
  proxy.Heal();
  REQUIRE((*store)->Put("job/x", "hello").ok());
  auto got = (*store)->Get("job/x", 100);
  REQUIRE(got.ok());
  CHECK(*got == "hello");
}

TEST_CASE("Cancel ends S3 requests to a gateway that stopped answering, at once") {
  testing::CephCluster& ceph = testing::CephCluster::Get();
  testing::TcpProxy proxy("127.0.0.1", GatewayPort(ceph));
  S3Options options = ThroughProxy(ceph, proxy);
  auto store = MakeS3Store(options);  // stall timeout 30 s, 6 attempts
  REQUIRE(store.ok());
  proxy.Cut(testing::TcpProxy::CutMode::kBlackhole);
  absl::Status put;
  std::thread waiting([&] { put = (*store)->Put("job/x", "hello"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // in its request
  const auto began = std::chrono::steady_clock::now();
  (*store)->Cancel();
  waiting.join();
  CHECK(std::chrono::steady_clock::now() - began < std::chrono::seconds(5));
  CHECK(absl::IsCancelled(put));
  CHECK_THAT(Message(put), Catch::Contains("job/x") && Catch::Contains("stopping"));
  proxy.Heal();
  CHECK(absl::IsCancelled((*store)->Get("job/x", 10).status()));  // and every later call
}

TEMPLATE_TEST_CASE("a published step appears whole, marker last; a retracted one is gone", "",
                   LocalDisk, LocalTmpfs, S3Rgw) {
  TestType t;
  const std::string staging = t.store->StagingPrefix("job/step-00000002");
  for (int r = 0; r < 2; ++r) {
    auto w = t.store->Create(staging + "/rank-0000" + std::to_string(r) + ".safetensors");
    REQUIRE(w.ok());
    std::vector<char> bytes = Pattern(5000, r);
    REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
    REQUIRE((*w)->Finish().ok());
  }
  // Written, not published: no marker (and where the store can rename, nothing at all)
  // under the published name.
  if (staging != "job/step-00000002") CHECK(Names(*t.store, "job/step-00000002").empty());
  CHECK_FALSE(*t.store->Exists("job/step-00000002/manifest.json"));
  REQUIRE(t.store->Publish(staging, "job/step-00000002", "manifest.json", "{}").ok());
  CHECK(Names(*t.store, "job/step-00000002") ==
        std::vector<std::string>{"manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"});
  CHECK(Names(*t.store, "job") == std::vector<std::string>{"step-00000002/"});
  CHECK(*t.store->Get("job/step-00000002/manifest.json", 1024) == "{}");
  CHECK(absl::IsOutOfRange(t.store->Get("job/step-00000002/manifest.json", 1).status()));
  // Publishing over a step that is there is refused; nothing of it changes.
  CHECK(absl::IsAlreadyExists(t.store->Publish(staging, "job/step-00000002", "manifest.json", "other")));
  CHECK(*t.store->Get("job/step-00000002/manifest.json", 1024) == "{}");

  REQUIRE(t.store->Retract("job/step-00000002", "manifest.json").ok());
  CHECK(Names(*t.store, "job").empty());
  CHECK(absl::IsNotFound(t.store->Retract("job/step-00000002", "manifest.json")));
  CHECK(t.store->RemovePrefix("job/nothing-here").ok());
  // What was written and never published goes with its staging prefix.
  REQUIRE(t.store->Put(t.store->StagingPrefix("job/step-00000003") + "/rank-00000.safetensors", "x").ok());
  REQUIRE(t.store->RemovePrefix(t.store->StagingPrefix("job/step-00000003")).ok());
  CHECK(Names(*t.store, "job").empty());
}

TEST_CASE("an S3 object larger than a part goes up in parallel parts and reads back in ranges") {
  S3Rgw t;
  // 3 parts of 5 MiB and a short last one, appended in pieces that straddle part boundaries.
  std::vector<char> all = Pattern((15u << 20) + 12345, 9);
  auto w = t.store->Create("big/object");
  REQUIRE(w.ok());
  for (size_t at = 0; at < all.size(); at += 3u << 20) {
    REQUIRE((*w)->Append(all.data() + at, std::min<size_t>(3u << 20, all.size() - at)).ok());
  }
  REQUIRE((*w)->Finish().ok());
  auto r = t.store->Open("big/object");
  REQUIRE(r.ok());
  REQUIRE((*r)->size() == all.size());
  std::vector<char> got(all.size());
  REQUIRE((*r)->ReadAt(got.data(), got.size(), 0).ok());
  CHECK(got == all);
  std::vector<char> middle(7u << 20);
  REQUIRE((*r)->ReadAt(middle.data(), middle.size(), (4u << 20) + 3).ok());
  CHECK(std::equal(middle.begin(), middle.end(), all.begin() + (4u << 20) + 3));
  CHECK(Names(*t.store, "big") == std::vector<std::string>{"object"});
  CHECK(absl::IsNotFound(t.store->Open("big/absent").status()));
  CHECK_FALSE(*t.store->Exists("big/absent"));
  // An object abandoned before Finish leaves nothing listed (its upload is aborted).
  {
    auto dropped = t.store->Create("big/dropped");
    REQUIRE(dropped.ok());
    REQUIRE((*dropped)->Append(all.data(), 11u << 20).ok());
  }
  CHECK(Names(*t.store, "big") == std::vector<std::string>{"object"});
}

TEST_CASE("S3 credentials that are wrong, and a bucket that is not there, are named") {
  S3Options options = testing::CephCluster::Get().Options();
  options.credentials.secret_key = "not-the-secret-key-of-this-user";
  auto store = MakeS3Store(options);
  REQUIRE(store.ok());
  auto put = (*store)->Put("x", "y");
  CHECK(absl::IsPermissionDenied(put));
  CHECK_THAT(Message(put), Catch::Contains("SignatureDoesNotMatch") && Catch::Contains("credentials"));
  CHECK(Message(put).find("not-the-secret") == std::string::npos);  // never in a message
  options = testing::CephCluster::Get().Options();
  options.bucket = "no-such-bucket";
  auto absent = MakeS3Store(options);
  REQUIRE(absent.ok());
  auto missing = (*absent)->Put("x", "y");
  CHECK(absl::IsNotFound(missing));
  CHECK_THAT(Message(missing), Catch::Contains("NoSuchBucket") && Catch::Contains("s3://no-such-bucket/x"));
  // A server that is not there: retried, then named.
  options = testing::CephCluster::Get().Options();
  options.endpoint = "http://127.0.0.1:9";  // discard: nothing listens
  options.attempts = 2;
  auto nobody = MakeS3Store(options);
  REQUIRE(nobody.ok());
  auto unreachable = (*nobody)->Put("x", "y");
  CHECK(absl::IsUnavailable(unreachable));
  CHECK_THAT(Message(unreachable), Catch::Contains("after 2 attempts"));
}

TEST_CASE("a file system that opens with O_DIRECT and refuses the reads: read through the page cache") {
  LocalDisk t;
  std::vector<char> bytes = Pattern(3 * 4096 + 100, 5);
  auto w = t.store->Create("job/step-00000004.tmp/rank-00000.safetensors");
  REQUIRE(w.ok());
  REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
  REQUIRE((*w)->Finish().ok());
  t.fs->RefuseDirectReads();
  auto reader = t.store->Open("job/step-00000004.tmp/rank-00000.safetensors");
  REQUIRE(reader.ok());
  std::unique_ptr<char, AlignedFree> into(static_cast<char*>(std::aligned_alloc(4096, 4 * 4096)));
  REQUIRE((*reader)->ReadAt(into.get(), bytes.size(), 0).ok());
  CHECK(std::equal(bytes.begin(), bytes.end(), into.get()));
}

TEMPLATE_TEST_CASE("a failed flush or publish is a status naming the object, never a torn step", "",
                   LocalDisk, LocalTmpfs) {
  TestType t;
  auto w = t.store->Create("job/step-00000003.tmp/rank-00000.safetensors");
  REQUIRE(w.ok());
  std::vector<char> bytes = Pattern(4096, 1);
  REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
  t.fs->FailAfter(FaultyFilesystem::Op::kSync, 0, EIO);
  auto finished = (*w)->Finish();
  CHECK_FALSE(finished.ok());
  CHECK(Message(finished.status()).find("rank-00000.safetensors") != std::string::npos);
  t.fs->FailAfter(FaultyFilesystem::Op::kRename, 0, ENOSPC);
  CHECK_FALSE(t.store->Publish("job/step-00000003.tmp", "job/step-00000003", "manifest.json", "{}").ok());
  CHECK(Names(*t.store, "job/step-00000003").empty());
}

TEST_CASE("a checkpoint on S3: written in place, a step only once its manifest is, verified, deleted") {
  S3Rgw t;
  format::CheckpointStore store(t.store, "s3://test");
  persist::ShardWriterPtr writer = persist::MakeShardWriter(t.store);
  // Two ranks' rows of a 2 x (5 MiB + 3) tensor of F32: multipart objects, and entries of more
  // than one 8 MiB checksum chunk... and one train-state blob each.
  const int64_t cols = ((5 << 20) + 3);
  std::vector<std::vector<float>> rows(2);
  format::Manifest m;
  m.job = "job";
  m.step = 7;
  m.world_size = 2;
  m.ckptd_version = "test";
  REQUIRE(store.BeginStep("job", 7).ok());
  for (uint32_t r = 0; r < 2; ++r) {
    rows[r].resize(cols);
    std::iota(rows[r].begin(), rows[r].end(), static_cast<float>(r * cols));
    daemon::StagedShard shard;
    shard.rank = r;
    shard.data_bytes = cols * sizeof(float);
    shard.region = ScatteredBytes(reinterpret_cast<const char*>(rows[r].data()), shard.data_bytes);
    shard.entries = {{"w", "F32", {1, cols}, 0, shard.data_bytes}};
    auto written = writer->Write(shard, store.TempStepKey("job", 7));
    REQUIRE(written.ok());
    m.shards.push_back({r, written->file, written->bytes, {}, {}});
    m.tensors["w"].dtype = "F32";
    m.tensors["w"].global_shape = {2, cols};
    format::TensorShard piece{r, written->file, 0, shard.data_bytes, {static_cast<int64_t>(r), 0}, {1, cols},
                              written->checksums.at("w")};
    piece.chunk_checksums = written->chunk_checksums.at("w");
    m.tensors["w"].shards.push_back(piece);
  }
  m.checksum_chunk_bytes = format::kChecksumChunkBytes;
  // Written, not committed: no step, but an unfinished one to sweep.
  CHECK(store.ListSteps("job")->empty());
  CHECK(*store.ListTempSteps() == std::vector<std::pair<std::string, uint64_t>>{{"job", 7}});
  REQUIRE(store.Commit(m).ok());
  CHECK(*store.ListSteps("job") == std::vector<uint64_t>{7});
  CHECK(store.ListTempSteps()->empty());
  CHECK(absl::IsAlreadyExists(store.Commit(m)));
  CHECK(absl::IsAlreadyExists(store.BeginStep("job", 7)));  // in place: never over a step
  auto loaded = store.LoadManifest("job", 7);
  REQUIRE(loaded.ok());
  auto report = format::VerifyCheckpoint(store, "job", 7);
  REQUIRE(report.ok());
  CHECK(report->ok());
  CHECK(report->bytes_checked == 2 * cols * sizeof(float));
  // A damaged object is found, and named by its URL.
  REQUIRE(t.store->Put("job/step-00000007/rank-00001.safetensors", "garbage").ok());
  auto damaged = format::VerifyCheckpoint(store, "job", 7);
  REQUIRE(damaged.ok());
  CHECK_FALSE(damaged->ok());
  CHECK_THAT(damaged->problems.at(0), Catch::Contains("s3://") && Catch::Contains("rank-00001.safetensors"));
  REQUIRE(store.Delete("job", 7).ok());
  CHECK(store.ListSteps("job")->empty());
  CHECK(Names(*t.store, "job").empty());
}
