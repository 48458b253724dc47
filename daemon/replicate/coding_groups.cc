#include "daemon/replicate/coding_groups.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace ckpt::replicate {

absl::StatusOr<CodingGroups> FormCodingGroups(std::vector<NodePlace> nodes, int k, int m) {
  const size_t size = static_cast<size_t>(std::max(k, 0) + std::max(m, 0));
  if (k < 1 || m < 0) return absl::InvalidArgumentError(fmt::format("coding groups of {}+{}: not a code", k, m));
  if (nodes.size() < size) {
    return absl::InvalidArgumentError(fmt::format(
        "{} node(s) cannot form a coding group of {}+{}: it needs {} nodes", nodes.size(), k, m, size));
  }
  // Nodes of a domain together, the largest domains first, each domain's nodes ascending:
  // dealt round-robin, a domain's nodes land in different groups until it has more nodes
  // than there are groups. Nodes without a domain are each a domain of their own.
  std::map<std::string, std::vector<uint32_t>> by_domain;
  std::vector<uint32_t> alone;
  for (const NodePlace& n : nodes) (n.domain.empty() ? alone : by_domain[n.domain]).push_back(n.node);
  std::vector<std::pair<std::string, std::vector<uint32_t>>> domains(by_domain.begin(), by_domain.end());
  for (uint32_t node : alone) domains.push_back({"", {node}});
  for (auto& [name, members] : domains) std::sort(members.begin(), members.end());
  std::stable_sort(domains.begin(), domains.end(), [](const auto& a, const auto& b) {
    if (a.second.size() != b.second.size()) return a.second.size() > b.second.size();
    return a.second.front() < b.second.front();
  });
  std::vector<uint32_t> order;
  for (const auto& [name, members] : domains) order.insert(order.end(), members.begin(), members.end());
  std::vector<uint32_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    return absl::InvalidArgumentError(fmt::format("node {} is listed twice", *twice));
  }
  const size_t count = nodes.size() / size;
  std::vector<CodingGroup> groups(count);
  for (size_t i = 0; i < order.size(); ++i) groups[i % count].nodes.push_back(order[i]);
  std::map<uint32_t, std::string> domain_of;
  for (const NodePlace& n : nodes) domain_of[n.node] = n.domain;
  size_t sharing = 0;
  for (CodingGroup& g : groups) {
    std::sort(g.nodes.begin(), g.nodes.end());
    std::map<std::string, int> seen;
    for (uint32_t node : g.nodes) {
      if (!domain_of[node].empty()) ++seen[domain_of[node]];
    }
    for (const auto& [name, n] : seen) {
      if (n > 1) g.shared_domains.push_back(name);
    }
    sharing += !g.shared_domains.empty();
  }
  std::sort(groups.begin(), groups.end(), [](const CodingGroup& a, const CodingGroup& b) { return a.nodes < b.nodes; });
  CodingGroups out{std::move(groups), {}};
  if (sharing > 0) {
    out.warning = fmt::format(
        "{} of {} coding groups of {}+{} hold two or more nodes of one failure domain (the largest, {}, has {} "
        "nodes for {} groups): losing that domain can cost such a group more than one member",
        sharing, out.groups.size(), k, m, domains.front().first, domains.front().second.size(), count);
  }
  return out;
}

}  // namespace ckpt::replicate
