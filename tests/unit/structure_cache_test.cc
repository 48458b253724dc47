// The coordinator's cache of part structures: found by digest, bounded in bytes, least
// recently used summarized first and then dropped, the newest always kept whole.
#include <catch2/catch.hpp>

#include "daemon/group/structure_cache.h"
#include "tests/fakes/manifest_part.h"

using namespace ckpt;

namespace {

std::shared_ptr<const format::PartStructure> Structure(const std::string& job) {
  return format::SplitPart(testing::ManifestPart(job, 1, 4, {0, 1})).structure;
}

}  // namespace

TEST_CASE("structure cache: over the bound the least recently used are kept as summaries first") {
  auto a = Structure("a"), b = Structure("b"), c = Structure("c");
  group::StructureCache probe(size_t{1} << 30);
  probe.Add(a);
  const size_t one = probe.bytes();
  group::StructureCache cache(2 * one + one / 2);  // two whole, and room for summaries
  cache.Add(a);
  cache.Add(b);
  cache.Add(c);  // a becomes a summary
  CHECK(cache.size() == 3);
  CHECK(cache.summaries() == 1);
  auto held = cache.Find(a->digest);
  REQUIRE(held != nullptr);
  CHECK(held->summary);
  CHECK(held->structure.tensors.empty());
  CHECK(held->structure.shards.size() == a->structure.shards.size());
  CHECK(held->checksums == a->checksums);
  CHECK(held->min_bytes == a->min_bytes);
  CHECK(held->json_bytes == a->json_bytes);
  CHECK(cache.bytes() <= 2 * one + one / 2);
  // Its values are checked against the summary as against the whole structure.
  auto values = format::SplitPart(testing::ManifestPart("a", 7, 4, {0, 1})).values;
  CHECK(format::CheckValuesFit(*held, values).ok());
  CHECK_FALSE(format::JoinPart(*held, values).ok());  // but it cannot make the part again
  // Sent whole again, it replaces its summary (and the oldest whole one is summarized).
  cache.Add(a);
  CHECK_FALSE(cache.Find(a->digest)->summary);
  CHECK(cache.summaries() == 1);
  cache.Forget(a->digest);
  CHECK(cache.Find(a->digest) == nullptr);
  CHECK(cache.size() == 2);
}

TEST_CASE("structure cache: summaries are dropped too once even they are over the bound") {
  group::StructureCache cache(1);
  for (const char* job : {"a", "b", "c"}) cache.Add(Structure(job));
  CHECK(cache.size() == 1);  // the newest, whole
  CHECK(cache.summaries() == 0);
  CHECK_FALSE(cache.Find(Structure("c")->digest)->summary);
}

TEST_CASE("structure cache: found by digest, least recently used summarized first") {
  auto a = Structure("a"), b = Structure("b"), c = Structure("c");
  group::StructureCache probe(size_t{1} << 30);
  probe.Add(a);
  const size_t one = probe.bytes();
  REQUIRE(one > a->json_bytes);
  group::StructureCache cache(2 * one + one / 2);  // room for two
  cache.Add(a);
  cache.Add(b);
  CHECK(cache.Find(a->digest) == a);  // a is now the most recently used
  cache.Add(c);                       // b is summarized
  CHECK(cache.size() == 3);
  CHECK(cache.Find(b->digest)->summary);
  CHECK(cache.Find(a->digest) == a);
  CHECK(cache.Find(c->digest) == c);
  cache.Add(c);  // again: no second copy
  CHECK(cache.size() == 3);
  CHECK(cache.bytes() <= 2 * one + one / 2);
  CHECK(cache.Find("xxh3:0000000000000000") == nullptr);
}

TEST_CASE("structure cache: the newest stays even when it alone is over the bound") {
  auto a = Structure("a"), b = Structure("b");
  group::StructureCache cache(1);
  cache.Add(a);
  CHECK(cache.Find(a->digest) == a);
  cache.Add(b);
  CHECK(cache.size() == 1);
  CHECK(cache.Find(b->digest) == b);
}

TEST_CASE("structure cache: without summaries (a shared root), the least recently used are dropped whole") {
  auto a = Structure("a"), b = Structure("b"), c = Structure("c");
  group::StructureCache probe(size_t{1} << 30);
  probe.Add(a);
  const size_t one = probe.bytes();
  group::StructureCache cache(2 * one + one / 2, /*summarize=*/false);
  cache.Add(a);
  cache.Add(b);
  cache.Add(c);
  CHECK(cache.size() == 2);
  CHECK(cache.summaries() == 0);
  CHECK(cache.Find(a->digest) == nullptr);
  CHECK(cache.Find(c->digest) == c);
}

TEST_CASE("structure cache: what was found since the last shrink gets a second chance, the newest is kept") {
  auto a = Structure("a"), b = Structure("b"), c = Structure("c"), d = Structure("d"), e = Structure("e");
  group::StructureCache probe(size_t{1} << 30);
  probe.Add(a);
  const size_t one = probe.bytes();
  group::StructureCache cache(3 * one + one / 2, /*summarize=*/false);  // room for three
  cache.Add(a);
  cache.Add(b);
  cache.Add(c);
  CHECK(cache.Find(a->digest) == a);
  CHECK(cache.Find(b->digest) == b);
  cache.Add(d);  // c, added before d and not found since, goes
  CHECK(cache.Find(c->digest) == nullptr);
  CHECK(cache.size() == 3);
  // Every one held was found since (those marks were cleared when c went; these are new):
  // one of them goes after its second chance, never the one just added.
  CHECK(cache.Find(a->digest) == a);
  CHECK(cache.Find(b->digest) == b);
  CHECK(cache.Find(d->digest) == d);
  cache.Add(e);
  CHECK(cache.size() == 3);
  CHECK(cache.Find(e->digest) == e);
}
