// Peers' fragments in their own budget (issue 25): checked before they are kept, shared per
// user and job, a sealed step replacing its owner's older ones and never before.
#include <catch2/catch.hpp>

#include <atomic>
#include <span>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "daemon/replicate/erasure_code.h"
#include "daemon/replicate/fragment_store.h"
#include "daemon/replicate/shard_fragments.h"
#include "format/checksum.h"

using ckpt::replicate::ErasureCode;
using ckpt::replicate::FragmentId;
using ckpt::replicate::FragmentMeta;
using ckpt::replicate::FragmentStore;

namespace {

constexpr uint64_t kData = 10'000;  // a rank's shard, coded 2+1: fragments of 5,056 bytes

// Fragment `index` of a 2+1 code of kData bytes of `fill`, as its owner sends it.
std::pair<FragmentMeta, std::string> Fragment(char fill) {
  std::string bytes(ErasureCode::FragmentBytes(kData, 2), fill);
  return {FragmentMeta{2, 1, kData, 7, ckpt::format::ChecksumOf(bytes.data(), bytes.size())}, bytes};
}

FragmentId Id(const std::string& job, uint64_t step, uint32_t owner, uint32_t index, uint32_t rank = 0) {
  return FragmentId{job, step, owner, rank, index};
}

absl::Status Put(FragmentStore& store, const FragmentId& id, uid_t uid = 1000, char fill = 'a') {
  auto [meta, bytes] = Fragment(fill);
  return store.Put(uid, id, meta, bytes);
}

}  // namespace

TEST_CASE("a fragment is kept only when its bytes are what its owner coded") {
  FragmentStore store(1 << 20, {});
  auto [meta, bytes] = Fragment('x');
  REQUIRE(store.Put(1000, Id("j", 5, 2, 1), meta, bytes).ok());
  auto held = store.Find(Id("j", 5, 2, 1));
  REQUIRE(held != nullptr);
  CHECK(held->bytes == bytes);
  CHECK(store.used() == bytes.size());

  std::string flipped = bytes;
  flipped[100] ^= 1;
  auto damaged = store.Put(1000, Id("j", 5, 2, 0), meta, flipped);
  CHECK(absl::IsDataLoss(damaged));
  CHECK_THAT(ckpt::Message(damaged), Catch::Contains("fragment 0 of job j step 5 rank 0 from node 2") &&
                                         Catch::Contains("damaged on the way"));
  auto short_one = store.Put(1000, Id("j", 5, 2, 0), meta, bytes.substr(1));
  CHECK(absl::IsDataLoss(short_one));
  FragmentMeta no_such = meta;
  CHECK(absl::IsInvalidArgument(store.Put(1000, Id("j", 5, 2, 3), no_such, bytes)));  // a 2+1 code has 0..2
  CHECK(store.Find(Id("j", 5, 2, 0)) == nullptr);
  CHECK(store.used() == bytes.size());
}

TEST_CASE("a step sealed and released replaces its owner's older steps, and not before it is whole") {
  FragmentStore store(1 << 20, {});
  REQUIRE(Put(store, Id("j", 5, 2, 0)).ok());
  REQUIRE(Put(store, Id("j", 5, 2, 1)).ok());
  REQUIRE(store.Seal("j", 5, 2, 2).ok());
  // Step 6 arrives in part: step 5 stays, whole, for a restore meanwhile.
  REQUIRE(Put(store, Id("j", 6, 2, 0)).ok());
  auto early = store.Seal("j", 6, 2, 2);
  CHECK(absl::IsFailedPrecondition(early));
  CHECK_THAT(ckpt::Message(early), Catch::Contains("1 of the 2 fragments sent here arrived"));
  CHECK(store.Find(Id("j", 5, 2, 1)) != nullptr);
  // Another owner's steps and another job's are not touched by node 2's seal.
  REQUIRE(Put(store, Id("j", 4, 3, 0)).ok());
  REQUIRE(Put(store, Id("k", 1, 2, 0)).ok());
  REQUIRE(Put(store, Id("j", 6, 2, 1)).ok());
  // A release before the seal is refused: the older steps stay.
  CHECK(absl::IsFailedPrecondition(store.Release("j", 6, 2)));
  REQUIRE(store.Seal("j", 6, 2, 2).ok());
  // Sealed, step 6 is restorable here, and step 5 stays until the owner says every holder
  // sealed 6 (a step sealed at some holders only must leave the one before whole).
  CHECK(store.Find(Id("j", 5, 2, 0)) != nullptr);
  REQUIRE(store.Release("j", 6, 2).ok());
  CHECK(store.Find(Id("j", 5, 2, 0)) == nullptr);
  CHECK(store.Find(Id("j", 4, 3, 0)) != nullptr);
  CHECK(store.Find(Id("k", 1, 2, 0)) != nullptr);
  const size_t fragment = ErasureCode::FragmentBytes(kData, 2);
  CHECK(store.used() == 4 * fragment);
  auto held = store.Held();
  REQUIRE(held.size() == 3);  // by job, owner, step
  CHECK(held[0].job == "j");
  CHECK(held[0].owner == 2);
  CHECK(held[0].step == 6);
  CHECK(held[0].sealed);
  CHECK(held[0].bytes == 2 * fragment);
  CHECK(held[1].owner == 3);
  CHECK_FALSE(held[1].sealed);
  // A sealed step takes no more fragments (a late retry of the sender's).
  CHECK(absl::IsFailedPrecondition(Put(store, Id("j", 6, 2, 2))));
  store.DropJob("j");
  CHECK(store.used() == fragment);
  CHECK(store.Held().size() == 1);
}

TEST_CASE("the budget is --replica-bytes, shared per user and then per job") {
  const size_t fragment = ErasureCode::FragmentBytes(kData, 2);
  SECTION("a fragment that does not fit is refused, naming the budget; the older replicas stay") {
    FragmentStore store(3 * fragment, {});
    REQUIRE(Put(store, Id("j", 5, 2, 0)).ok());
    REQUIRE(Put(store, Id("j", 5, 2, 1)).ok());
    REQUIRE(store.Seal("j", 5, 2, 2).ok());
    REQUIRE(Put(store, Id("j", 6, 2, 0)).ok());
    auto full = Put(store, Id("j", 6, 2, 1));
    CHECK(absl::IsResourceExhausted(full));
    CHECK_THAT(ckpt::Message(full), Catch::Contains("--replica-bytes"));
    CHECK(store.Find(Id("j", 5, 2, 1)) != nullptr);
    CHECK(store.used() == 3 * fragment);
  }
  SECTION("two users: each gets half, whoever asked first") {
    FragmentStore store(4 * fragment, {});
    REQUIRE(Put(store, Id("a", 1, 2, 0), 1000).ok());
    REQUIRE(Put(store, Id("b", 1, 2, 0), 2000).ok());
    REQUIRE(Put(store, Id("a", 1, 2, 1), 1000).ok());
    auto over = Put(store, Id("a", 1, 3, 0), 1000);
    CHECK(absl::IsResourceExhausted(over));
    CHECK_THAT(ckpt::Message(over), Catch::Contains("fair share of the replica memory"));
    CHECK(Put(store, Id("b", 1, 2, 1), 2000).ok());
  }
  SECTION("fragments arriving at once never overfill it") {
    FragmentStore store(5 * fragment, {});
    std::vector<std::thread> senders;
    std::atomic<int> kept{0};
    for (uint32_t i = 0; i < 8; ++i) {
      senders.emplace_back([&, i] {
        if (Put(store, Id("j", 1, i, 0)).ok()) ++kept;
      });
    }
    for (auto& t : senders) t.join();
    CHECK(kept == 5);
    CHECK(store.used() == 5 * fragment);
  }
}

TEST_CASE("the owner gives a step up: what arrived of it goes, a sealed step stays; a step is one user's") {
  FragmentStore store(1 << 20, {});
  REQUIRE(Put(store, Id("j", 5, 2, 0)).ok());
  REQUIRE(Put(store, Id("j", 5, 2, 1)).ok());
  REQUIRE(store.Seal("j", 5, 2, 2, "{\"manifest\": 5}").ok());
  REQUIRE(store.Manifest("j", 2, 5) != nullptr);
  CHECK(*store.Manifest("j", 2, 5) == "{\"manifest\": 5}");
  REQUIRE(Put(store, Id("j", 6, 2, 0)).ok());
  REQUIRE(store.Seal("j", 6, 2, 0).ok());  // given up
  CHECK(store.Find(Id("j", 6, 2, 0)) == nullptr);
  REQUIRE(store.Seal("j", 5, 2, 0).ok());  // too late for a sealed step
  CHECK(store.Find(Id("j", 5, 2, 0)) != nullptr);
  CHECK(store.Manifest("j", 2, 6) == nullptr);
  // Fragments of one step sent for two users: the second is refused.
  REQUIRE(Put(store, Id("j", 7, 2, 0)).ok());
  const std::string bytes(ErasureCode::FragmentBytes(kData, 2), 'x');
  FragmentMeta meta{2, 1, kData, 1, ckpt::format::ChecksumOf(bytes.data(), bytes.size())};
  auto other = store.Put(2000, Id("j", 7, 2, 1), meta, bytes);
  CHECK(absl::IsInvalidArgument(other));
  CHECK_THAT(ckpt::Message(other), Catch::Contains("uid 2000"));
  auto held = store.Held("j", 2);
  REQUIRE(held.size() == 2);
  CHECK(held[0].step == 5);
  CHECK(held[0].uid == 1000);
  CHECK(held[1].step == 7);
}

TEST_CASE("a job whose owner sent nothing for the idle lifetime is dropped, and its share with it") {
  auto now = std::chrono::steady_clock::now();
  FragmentStore store(1 << 20, {}, [&] { return now; });
  REQUIRE(Put(store, Id("old", 5, 2, 0)).ok());
  REQUIRE(Put(store, Id("old", 5, 2, 1)).ok());
  REQUIRE(store.Seal("old", 5, 2, 2).ok());
  now += FragmentStore::kIdleLifetime - std::chrono::minutes(1);
  REQUIRE(Put(store, Id("live", 1, 3, 0)).ok());
  CHECK(store.Find(Id("old", 5, 2, 0)) != nullptr);  // not idle long enough yet
  now += std::chrono::minutes(2);
  REQUIRE(Put(store, Id("live", 2, 3, 0)).ok());  // the next fragment from anyone expires it
  CHECK(store.Find(Id("old", 5, 2, 0)) == nullptr);
  CHECK(store.Find(Id("live", 1, 3, 0)) != nullptr);  // its owner was heard from within it
  CHECK(store.Held().size() == 2);
}

namespace {

using ckpt::replicate::FragmentPatch;

// A real 2+1 coding of a shard, step 5 sent whole and step 6 as a patch of it (chunks of 1 KiB).
struct PatchedStep {
  PatchedStep() {
    auto code = ErasureCode::Make(2, 1);
    REQUIRE(code.ok());
    std::string before(kData, '\0');
    for (size_t i = 0; i < before.size(); ++i) before[i] = static_cast<char>(i * 7 + (i >> 9));
    std::string after = before;
    after[100] ^= 1;    // chunk 0 of fragment 0
    after[5'100] ^= 1;  // chunk 0 of fragment 1 (past its 5,056 bytes)
    after[9'000] ^= 1;  // chunk 3 of fragment 1
    auto as_bytes = [](const std::string& s) { return std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()); };
    auto old = ckpt::replicate::CodeShard(*code, "j", 5, 2, 0, 7, as_bytes(before));
    REQUIRE(old.ok());
    base = (*old)[1];
    auto sums = ckpt::replicate::SumsOf(*old, 2, 1024);
    auto coded = ckpt::replicate::CodePatch(*code, "j", 6, 2, 0, 7, as_bytes(after), 2, sums);
    REQUIRE(coded.ok());
    REQUIRE(coded->chunks == std::vector<uint32_t>{0, 3});
    patched = coded->fragments[1];
    patch = FragmentPatch{5, 1024, coded->chunks};
    auto full = ckpt::replicate::CodeShard(*code, "j", 6, 2, 0, 7, as_bytes(after));
    REQUIRE(full.ok());
    whole = (*full)[1].bytes;
  }
  ckpt::replicate::HeldFragment base;     // fragment 1 of step 5, whole
  ckpt::replicate::HeldFragment patched;  // fragment 1 of step 6: its changed chunks
  FragmentPatch patch;
  std::string whole;  // fragment 1 of step 6, whole
};

}  // namespace

TEST_CASE("a patch of a sealed base fragment is kept as the whole new fragment, counted like one") {
  FragmentStore store(1 << 20, {});
  PatchedStep p;
  REQUIRE(store.Put(1000, p.base.id, p.base.meta, p.base.bytes).ok());
  REQUIRE(store.Seal("j", 5, 2, 1).ok());
  REQUIRE(p.patched.bytes.size() == 2 * 1024);  // chunks 0 and 3 (of 5, the last one 960 bytes)
  const absl::Status put = store.PutPatch(1000, p.patched.id, p.patched.meta, p.patch, p.patched.bytes);
  INFO(ckpt::Message(put));
  REQUIRE(put.ok());
  auto held = store.Find(p.patched.id);
  REQUIRE(held != nullptr);
  CHECK(held->bytes == p.whole);
  CHECK(held->meta.checksum == p.patched.meta.checksum);
  CHECK(store.Find(p.base.id)->bytes == p.base.bytes);  // the base stays until released
  CHECK(store.used() == 2 * p.whole.size());
  REQUIRE(store.Seal("j", 6, 2, 1).ok());
  REQUIRE(store.Release("j", 6, 2).ok());
  CHECK(store.Find(p.base.id) == nullptr);
  CHECK(store.used() == p.whole.size());
}

TEST_CASE("a patch is refused, and nothing kept, without its base or against another one or when it does not check") {
  FragmentStore store(1 << 20, {});
  PatchedStep p;
  auto refused = [&](const absl::Status& s, const char* says) {
    INFO(ckpt::Message(s));
    CHECK_FALSE(s.ok());
    CHECK_THAT(ckpt::Message(s), Catch::Contains(says));
    CHECK(store.Find(p.patched.id) == nullptr);
  };
  SECTION("no base held") {
    refused(store.PutPatch(1000, p.patched.id, p.patched.meta, p.patch, p.patched.bytes), "not held");
    CHECK(store.used() == 0);
    CHECK(store.Held().empty());
  }
  SECTION("the base not sealed") {
    REQUIRE(store.Put(1000, p.base.id, p.base.meta, p.base.bytes).ok());
    const absl::Status s = store.PutPatch(1000, p.patched.id, p.patched.meta, p.patch, p.patched.bytes);
    CHECK(absl::IsFailedPrecondition(s));
    refused(s, "not sealed");
  }
  SECTION("with a base sealed") {
    REQUIRE(store.Put(1000, p.base.id, p.base.meta, p.base.bytes).ok());
    REQUIRE(store.Seal("j", 5, 2, 1).ok());
    const size_t used = store.used();
    SECTION("of another run") {
      FragmentMeta meta = p.patched.meta;
      meta.run = 8;
      refused(store.PutPatch(1000, p.patched.id, meta, p.patch, p.patched.bytes), "run 7");
    }
    SECTION("of another size") {
      FragmentMeta meta = p.patched.meta;
      meta.data_bytes = kData - 1;  // the same fragment size: only the metadata differs
      refused(store.PutPatch(1000, p.patched.id, meta, p.patch, p.patched.bytes), "of 10000 bytes");
    }
    SECTION("of another coding") {
      FragmentMeta meta = p.patched.meta;
      meta.m = 2;
      refused(store.PutPatch(1000, p.patched.id, meta, p.patch, p.patched.bytes), "2+1");
    }
    SECTION("of another uid") {
      refused(store.PutPatch(1001, p.patched.id, p.patched.meta, p.patch, p.patched.bytes), "uid 1000");
    }
    SECTION("of another index: the base fragment is not held") {
      FragmentId id = p.patched.id;
      id.index = 0;
      refused(store.PutPatch(1000, id, p.patched.meta, p.patch, p.patched.bytes), "not held here");
      CHECK(store.Find(id) == nullptr);
    }
    SECTION("of another base step") {
      FragmentPatch patch = p.patch;
      patch.base_step = 4;
      refused(store.PutPatch(1000, p.patched.id, p.patched.meta, patch, p.patched.bytes), "not held");
    }
    SECTION("a changed byte: the checksum fails") {
      std::string bytes = p.patched.bytes;
      bytes[10] ^= 1;
      const absl::Status s = store.PutPatch(1000, p.patched.id, p.patched.meta, p.patch, bytes);
      CHECK(absl::IsDataLoss(s));
      refused(s, "damaged on the way");
    }
    SECTION("the chunks listed wrong: the checksum fails or the size does not fit") {
      FragmentPatch patch = p.patch;
      patch.chunks = {0, 2};  // as many bytes, in the wrong place
      refused(store.PutPatch(1000, p.patched.id, p.patched.meta, patch, p.patched.bytes), "damaged on the way");
      patch.chunks = {0, 4};  // chunk 4 is the short last one
      refused(store.PutPatch(1000, p.patched.id, p.patched.meta, patch, p.patched.bytes), "bytes sent");
      patch.chunks = {3, 0};
      refused(store.PutPatch(1000, p.patched.id, p.patched.meta, patch, p.patched.bytes), "out of order");
      patch.chunks = {0, 9};
      refused(store.PutPatch(1000, p.patched.id, p.patched.meta, patch, p.patched.bytes), "past the");
      patch = p.patch;
      patch.chunk_bytes = 1000;
      refused(store.PutPatch(1000, p.patched.id, p.patched.meta, patch, p.patched.bytes), "chunks of 1000");
    }
    SECTION("over the budget") {
      FragmentStore small(p.base.bytes.size() + 100, {});
      REQUIRE(small.Put(1000, p.base.id, p.base.meta, p.base.bytes).ok());
      REQUIRE(small.Seal("j", 5, 2, 1).ok());
      const absl::Status s = small.PutPatch(1000, p.patched.id, p.patched.meta, p.patch, p.patched.bytes);
      CHECK(absl::IsResourceExhausted(s));
      CHECK(small.Find(p.patched.id) == nullptr);
      CHECK(small.used() == p.base.bytes.size());
    }
    CHECK(store.used() == used);
    CHECK(store.Held().size() == 1);
  }
}
