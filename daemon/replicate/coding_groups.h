// Which nodes hold each other's fragments: a job's nodes split into coding groups of at
// least k + m nodes, each group's members in as many different failure domains (racks,
// Kubernetes topology zones) as the nodes allow, so that a rack lost takes at most one
// member of each group with it where that can be had. Every node computes the same groups
// from the same membership: the function is pure and its result depends only on its input
// as a set.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::replicate {

struct NodePlace {
  uint32_t node = 0;
  std::string domain;  // --failure-domain; empty: a domain of its own
};

struct CodingGroup {
  std::vector<uint32_t> nodes;  // ascending
  // Domains holding more than one member of this group (a rack whose loss costs the group
  // two or more members), each named once; empty when every member's domain differs.
  std::vector<std::string> shared_domains;
};

struct CodingGroups {
  std::vector<CodingGroup> groups;  // in order of their smallest node
  // For `ckptctl status`: why some group shares a domain (empty when none does).
  std::string warning;
};

// Groups of k + m nodes or more: the N mod (k + m) left over are dealt with the others, so
// that groups differ in size by one at most.
// InvalidArgument when there are fewer nodes than k + m, or a node is listed twice.
absl::StatusOr<CodingGroups> FormCodingGroups(std::vector<NodePlace> nodes, int k, int m);

}  // namespace ckpt::replicate
