// The Store contract (storage/store.h), run over each implementation: objects written from
// chunks of any alignment read back byte for byte, nothing unpublished is visible under its
// published name, the marker comes with everything else, a retraction never leaves a step
// half visible, and faults are statuses naming the object.
#include <catch2/catch.hpp>

#include <errno.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/status.h"
#include "storage/local_store.h"
#include "tests/fakes/faulty_filesystem.h"
#include "tests/fakes/temp_dir.h"

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

std::vector<char> Pattern(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) >> 3);
  return v;
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
                   LocalDisk, LocalTmpfs) {
  TestType t;
  // An unaligned header-sized piece, aligned 4 KiB multiples straight from aligned memory,
  // an unaligned-memory multiple, and a short tail: what a shard writer sends.
  const size_t sizes[] = {8192, 3 << 20, 12288, 1000};
  std::vector<char> all;
  auto writer = t.store->Create("job/step-00000001.tmp/rank-00000.safetensors");
  REQUIRE(writer.ok());
  int seed = 0;
  for (size_t n : sizes) {
    std::vector<char> piece = Pattern(n, ++seed);
    std::unique_ptr<char, AlignedFree> aligned(static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096)));
    std::memcpy(aligned.get(), piece.data(), n);
    const char* from = seed == 3 ? piece.data() : aligned.get();  // the third from unaligned memory
    REQUIRE((*writer)->Append(from, n).ok());
    all.insert(all.end(), piece.begin(), piece.end());
  }
  auto after_tail = (*writer)->Append(all.data(), 4096);
  CHECK(absl::IsFailedPrecondition(after_tail));
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
  std::vector<char> beyond(10);
  auto past = (*reader)->ReadAt(beyond.data(), 10, all.size() - 5);
  CHECK(absl::IsOutOfRange(past));
  CHECK(Message(past).find("rank-00000.safetensors") != std::string::npos);
}

TEMPLATE_TEST_CASE("a published step appears whole, marker last; a retracted one is gone", "",
                   LocalDisk, LocalTmpfs) {
  TestType t;
  for (int r = 0; r < 2; ++r) {
    auto w = t.store->Create("job/step-00000002.tmp/rank-0000" + std::to_string(r) + ".safetensors");
    REQUIRE(w.ok());
    std::vector<char> bytes = Pattern(5000, r);
    REQUIRE((*w)->Append(bytes.data(), bytes.size()).ok());
    REQUIRE((*w)->Finish().ok());
  }
  // Written, not published: nothing under the published name.
  CHECK(Names(*t.store, "job/step-00000002").empty());
  CHECK_FALSE(*t.store->Exists("job/step-00000002/manifest.json"));
  REQUIRE(t.store->Publish("job/step-00000002.tmp", "job/step-00000002", "manifest.json", "{}").ok());
  CHECK(Names(*t.store, "job/step-00000002") ==
        std::vector<std::string>{"manifest.json", "rank-00000.safetensors", "rank-00001.safetensors"});
  CHECK(Names(*t.store, "job") == std::vector<std::string>{"step-00000002/"});
  CHECK(*t.store->Get("job/step-00000002/manifest.json", 1024) == "{}");
  CHECK(absl::IsOutOfRange(t.store->Get("job/step-00000002/manifest.json", 1).status()));
  // Publishing over a step that is there is refused; nothing of it changes.
  REQUIRE(t.store->Create("job/step-00000002.tmp/x").ok());
  CHECK(absl::IsAlreadyExists(t.store->Publish("job/step-00000002.tmp", "job/step-00000002",
                                               "manifest.json", "other")));
  CHECK(*t.store->Get("job/step-00000002/manifest.json", 1024) == "{}");
  REQUIRE(t.store->RemovePrefix("job/step-00000002.tmp").ok());

  REQUIRE(t.store->Retract("job/step-00000002", "manifest.json").ok());
  CHECK(Names(*t.store, "job").empty());
  CHECK(absl::IsNotFound(t.store->Retract("job/step-00000002", "manifest.json")));
  CHECK(t.store->RemovePrefix("job/nothing-here").ok());
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
