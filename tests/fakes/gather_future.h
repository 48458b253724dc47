// Gather arrivals in tests of what takes them with a callback (GatherMerger, Relay): an
// arrival's answer as a future, and an upstream's answer to a merge.
#pragma once

#include <future>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/group/gather_table.h"

namespace ckpt::testing {

using GatherResult = absl::StatusOr<group::GatherTable::Distinct>;

// What a coordinator would answer a merge whose arrivals were all the round's: each of its
// payloads, with its first participant and how many sent it.
inline group::GatherTable::Distinct AsDistinct(const std::vector<group::GatherTable::Sent>& sent) {
  group::GatherTable::Distinct d;
  for (const group::GatherTable::Sent& s : sent) {
    d.payloads.push_back(s.payload);
    d.senders.push_back(s.participants.front());
    d.counts.push_back(static_cast<uint32_t>(s.participants.size()));
  }
  return d;
}

// `arrive(done)` adds the arrival and returns whether it was taken; a refusal is then the
// answer.
template <typename Arrive>
std::future<GatherResult> GatherFuture(Arrive arrive) {
  auto promise = std::make_shared<std::promise<GatherResult>>();
  auto future = promise->get_future();
  absl::Status added = arrive([promise](GatherResult r) { promise->set_value(std::move(r)); });
  if (!added.ok()) promise->set_value(added);
  return future;
}

}  // namespace ckpt::testing
