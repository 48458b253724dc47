// Coding groups: every node in exactly one group of at least k + m, members spread over
// failure domains where the nodes allow it, and the same groups whatever the input order.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <set>

#include "common/status.h"
#include "daemon/replicate/coding_groups.h"

using namespace ckpt::replicate;

namespace {

std::vector<NodePlace> Racks(uint32_t nodes, uint32_t racks) {
  std::vector<NodePlace> out;
  for (uint32_t n = 0; n < nodes; ++n) out.push_back({n, racks ? "rack" + std::to_string(n % racks) : ""});
  return out;
}

void CheckCover(const CodingGroups& g, uint32_t nodes, size_t size) {
  std::set<uint32_t> seen;
  for (const CodingGroup& group : g.groups) {
    CHECK(group.nodes.size() >= size);
    CHECK(group.nodes.size() < 2 * size);
    for (uint32_t n : group.nodes) CHECK(seen.insert(n).second);
  }
  CHECK(seen.size() == nodes);
}

}  // namespace

TEST_CASE("every node is in one group of k + m or a little more") {
  for (uint32_t nodes : {6u, 7u, 11u, 64u, 1000u}) {
    auto g = FormCodingGroups(Racks(nodes, 0), 4, 2);
    REQUIRE(g.ok());
    CheckCover(*g, nodes, 6);
    CHECK(g->groups.size() == nodes / 6);
    CHECK(g->warning.empty());
  }
}

TEST_CASE("members of a group are in different racks when there are as many racks as members") {
  auto g = FormCodingGroups(Racks(48, 8), 4, 2);  // 8 racks of 6, 8 groups of 6
  REQUIRE(g.ok());
  CheckCover(*g, 48, 6);
  for (const CodingGroup& group : g->groups) CHECK(group.shared_domains.empty());
  CHECK(g->warning.empty());
}

TEST_CASE("too few racks: groups share a rack, and the warning says which and why") {
  auto g = FormCodingGroups(Racks(12, 2), 2, 1);  // 2 racks of 6 nodes, 4 groups of 3
  REQUIRE(g.ok());
  CheckCover(*g, 12, 3);
  for (const CodingGroup& group : g->groups) CHECK(group.shared_domains.size() == 1);
  CHECK_THAT(g->warning, Catch::Contains("4 of 4 coding groups of 2+1"));
  CHECK_THAT(g->warning, Catch::Contains("has 6 nodes for 4 groups"));
}

TEST_CASE("the same groups whatever order the nodes are listed in") {
  std::vector<NodePlace> nodes = Racks(37, 5);
  auto first = FormCodingGroups(nodes, 3, 2);
  REQUIRE(first.ok());
  std::mt19937 rng(3);
  for (int i = 0; i < 5; ++i) {
    std::shuffle(nodes.begin(), nodes.end(), rng);
    auto again = FormCodingGroups(nodes, 3, 2);
    REQUIRE(again.ok());
    REQUIRE(again->groups.size() == first->groups.size());
    for (size_t j = 0; j < first->groups.size(); ++j) CHECK(again->groups[j].nodes == first->groups[j].nodes);
  }
}

TEST_CASE("too few nodes, a node twice or no code are refused, naming the problem") {
  CHECK_THAT(ckpt::Message(FormCodingGroups(Racks(5, 0), 4, 2).status()), Catch::Contains("5 node(s) cannot form a coding group of 4+2"));
  CHECK_THAT(ckpt::Message(FormCodingGroups({{1, ""}, {1, ""}, {2, ""}}, 2, 1).status()), Catch::Contains("node 1 is listed twice"));
  CHECK_THAT(ckpt::Message(FormCodingGroups(Racks(4, 0), 0, 1).status()), Catch::Contains("not a code"));
}
