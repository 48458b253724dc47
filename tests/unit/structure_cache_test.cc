// The coordinator's cache of part structures: found by digest, bounded in bytes, least
// recently used dropped first, the newest always kept.
#include <catch2/catch.hpp>

#include "daemon/group/structure_cache.h"
#include "tests/fakes/manifest_part.h"

using namespace ckpt;

namespace {

std::shared_ptr<const format::PartStructure> Structure(const std::string& job) {
  return format::SplitPart(testing::ManifestPart(job, 1, 4, {0, 1})).structure;
}

}  // namespace

TEST_CASE("structure cache: found by digest, least recently used dropped first") {
  auto a = Structure("a"), b = Structure("b"), c = Structure("c");
  group::StructureCache probe(size_t{1} << 30);
  probe.Add(a);
  const size_t one = probe.bytes();
  REQUIRE(one > a->json_bytes);
  group::StructureCache cache(2 * one + one / 2);  // room for two
  cache.Add(a);
  cache.Add(b);
  CHECK(cache.Find(a->digest) == a);  // a is now the most recently used
  cache.Add(c);                       // b goes
  CHECK(cache.size() == 2);
  CHECK(cache.Find(b->digest) == nullptr);
  CHECK(cache.Find(a->digest) == a);
  CHECK(cache.Find(c->digest) == c);
  cache.Add(c);  // again: no second copy
  CHECK(cache.size() == 2);
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
