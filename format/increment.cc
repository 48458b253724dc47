#include "format/increment.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <set>

#include "format/json_fields.h"

namespace ckpt::format {

using json_fields::BadField;
using json_fields::Int;
using json_fields::Required;
using json_fields::Str;
using nlohmann::json;

namespace {

std::vector<StepRun> StepsOf(const std::vector<Origin>& origins) {
  std::set<StepRun> steps;
  for (const Origin& o : origins) steps.insert({o.step, o.run});
  return {steps.begin(), steps.end()};
}

}  // namespace

const Origin* Increment::Find(uint64_t step, uint32_t rank) const {
  auto it = std::lower_bound(origins.begin(), origins.end(), std::pair{step, rank}, [](const Origin& o, const auto& key) {
    return std::pair{o.step, o.rank} < key;
  });
  return it != origins.end() && it->step == step && it->rank == rank ? &*it : nullptr;
}

std::string TaggedShardFileName(uint32_t rank, uint64_t tag) {
  return fmt::format("rank-{:05d}.{:016x}.safetensors", rank, tag);
}

bool IsTaggedShardFileName(std::string_view name, uint32_t rank) {
  // "rank-" 5+ digits "." 16 hex ".safetensors": the digits are exactly the rank's as written.
  const std::string prefix = fmt::format("rank-{:05d}.", rank);
  constexpr std::string_view kSuffix = ".safetensors";
  if (name.size() != prefix.size() + 16 + kSuffix.size() || name.substr(0, prefix.size()) != prefix ||
      name.substr(name.size() - kSuffix.size()) != kSuffix) {
    return false;
  }
  std::string_view tag = name.substr(prefix.size(), 16);
  return std::all_of(tag.begin(), tag.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string HeldStepDirName(uint64_t step, uint64_t run) { return fmt::format("step-{:08d}.held-{:016x}", step, run); }

bool ParseHeldStepDirName(std::string_view name, StepRun* held) {
  constexpr std::string_view kStep = "step-", kHeld = ".held-";
  const size_t at = name.find(kHeld);
  if (name.substr(0, kStep.size()) != kStep || at == std::string_view::npos) return false;
  uint64_t step = 0, run = 0;
  const char* step_end = name.data() + at;
  const char* end = name.data() + name.size();
  auto [after_step, step_error] = std::from_chars(name.data() + kStep.size(), step_end, step);
  auto [after_run, run_error] = std::from_chars(step_end + kHeld.size(), end, run, 16);
  if (step_error != std::errc() || after_step != step_end || run_error != std::errc() || after_run != end) {
    return false;
  }
  // Exactly the name HeldStepDirName writes: no other spelling of the same numbers.
  if (HeldStepDirName(step, run) != name) return false;
  *held = {step, run};
  return true;
}

std::vector<std::string> OriginFileKeys(const Origin& origin) {
  return {fmt::format("step-{:08d}/{}", origin.step, origin.file),
          fmt::format("{}/{}", HeldStepDirName(origin.step, origin.run), origin.file)};
}

uint64_t PieceChunks(uint64_t bytes, uint64_t chunk_bytes) {
  return bytes <= chunk_bytes || chunk_bytes == 0 ? 1 : (bytes + chunk_bytes - 1) / chunk_bytes;
}

std::pair<uint64_t, uint64_t> ChunkSpan(uint64_t piece_bytes, uint64_t chunk_bytes, uint64_t chunk_begin,
                                        uint64_t chunk_end) {
  return {std::min(piece_bytes, chunk_begin * chunk_bytes), std::min(piece_bytes, chunk_end * chunk_bytes)};
}

std::string DeltaEntryName(const std::string& tensor, uint32_t chunk_begin, uint32_t chunk_end) {
  return fmt::format("__delta__.{}-{}.{}", chunk_begin, chunk_end, tensor);
}

bool EntryHoldsTensor(std::string_view entry, std::string_view tensor) {
  if (entry == tensor) return true;
  constexpr std::string_view kDelta = "__delta__.";
  if (entry.substr(0, kDelta.size()) != kDelta) return false;
  entry.remove_prefix(kDelta.size());
  const size_t dot = entry.find('.');  // after "<c0>-<c1>"
  if (dot == std::string_view::npos) return false;
  std::string_view range = entry.substr(0, dot);
  const size_t dash = range.find('-');
  auto digits = [](std::string_view s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return dash != std::string_view::npos && digits(range.substr(0, dash)) && digits(range.substr(dash + 1)) &&
         entry.substr(dot + 1) == tensor;
}

std::string ExtentsProblem(const std::vector<Extent>& extents, uint64_t chunks, uint32_t rank,
                           const Increment& increment, uint64_t step) {
  uint64_t next = 0;
  for (const Extent& e : extents) {
    if (e.chunk_begin != next || e.chunk_end <= e.chunk_begin || e.chunk_end > chunks) {
      return fmt::format("extent of chunks [{}, {}) does not continue from chunk {} inside the piece's {} chunks",
                         e.chunk_begin, e.chunk_end, next, chunks);
    }
    if (e.step && (*e.step == step || increment.Find(*e.step, rank) == nullptr)) {
      return fmt::format("extent of chunks [{}, {}) is in step {}, which the increment's origins do not list for "
                         "rank {}",
                         e.chunk_begin, e.chunk_end, *e.step, rank);
    }
    next = e.chunk_end;
  }
  if (next != chunks) return fmt::format("its extents cover {} of its {} chunks", next, chunks);
  return {};
}

std::string IncrementProblem(const Increment& increment, uint64_t step, bool is_index) {
  for (size_t i = 0; i < increment.origins.size(); ++i) {
    const Origin& o = increment.origins[i];
    if (o.step == step) return fmt::format("origin of rank {} is step {} itself", o.rank, step);
    if (!IsTaggedShardFileName(o.file, o.rank)) {
      return fmt::format("origin of step {} rank {}: file \"{}\" is not rank-{:05d}.<16 hex digits>.safetensors",
                         o.step, o.rank, o.file, o.rank);
    }
    if (i > 0 && std::pair{o.step, o.rank} <= std::pair{increment.origins[i - 1].step, increment.origins[i - 1].rank}) {
      return "origins are not in strictly ascending (step, rank) order";
    }
  }
  for (size_t i = 0; i < increment.origin_steps.size(); ++i) {
    if (increment.origin_steps[i].step == step) return fmt::format("origin_steps lists step {} itself", step);
    if (i > 0 && increment.origin_steps[i] <= increment.origin_steps[i - 1]) {
      return "origin_steps are not in strictly ascending (step, run) order";
    }
  }
  if (is_index) {
    if (!increment.origins.empty()) return "an index lists origins; they belong in its parts";
    return {};
  }
  if (StepsOf(increment.origins) != increment.origin_steps) {
    return "origin_steps are not the steps its origins name";
  }
  return {};
}

void AddIncrement(Increment& into, const Increment& more) {
  into.own_bytes += more.own_bytes;
  into.referenced_bytes += more.referenced_bytes;
  into.origins.insert(into.origins.end(), more.origins.begin(), more.origins.end());
  std::sort(into.origins.begin(), into.origins.end(),
            [](const Origin& a, const Origin& b) { return std::pair{a.step, a.rank} < std::pair{b.step, b.rank}; });
  std::set<StepRun> steps(into.origin_steps.begin(), into.origin_steps.end());
  steps.insert(more.origin_steps.begin(), more.origin_steps.end());
  into.origin_steps.assign(steps.begin(), steps.end());
}

void RemoveOrigins(Increment& increment, const std::function<bool(uint32_t rank)>& remove) {
  std::erase_if(increment.origins, [&](const Origin& o) { return remove(o.rank); });
  increment.origin_steps = StepsOf(increment.origins);
}

Increment ParseIncrement(const json& j) {
  Increment increment;
  increment.own_bytes = Int<uint64_t>(Required(j, "increment", "own_bytes"), "increment.own_bytes");
  increment.referenced_bytes =
      Int<uint64_t>(Required(j, "increment", "referenced_bytes"), "increment.referenced_bytes");
  const json& steps = Required(j, "increment", "origin_steps");
  if (!steps.is_array()) throw BadField("\"increment.origin_steps\" is not an array");
  for (const json& s : steps) {
    increment.origin_steps.push_back({Int<uint64_t>(Required(s, "increment.origin_steps", "step"), "step"),
                                      Int<uint64_t>(Required(s, "increment.origin_steps", "run"), "run")});
  }
  if (auto origins = j.find("origins"); origins != j.end()) {
    if (!origins->is_array()) throw BadField("\"increment.origins\" is not an array");
    for (const json& o : *origins) {
      Origin origin;
      origin.step = Int<uint64_t>(Required(o, "increment.origins", "step"), "step");
      origin.run = Int<uint64_t>(Required(o, "increment.origins", "run"), "run");
      origin.rank = Int<uint32_t>(Required(o, "increment.origins", "rank"), "rank");
      origin.file = Str(Required(o, "increment.origins", "file"), "file");
      origin.bytes = Int<uint64_t>(Required(o, "increment.origins", "bytes"), "bytes");
      increment.origins.push_back(std::move(origin));
    }
  }
  return increment;
}

std::vector<Extent> ParseExtents(const json& j) {
  if (!j.is_array()) throw BadField("\"extents\" is not an array");
  std::vector<Extent> extents;
  extents.reserve(j.size());
  for (const json& e : j) {
    const json& chunks = Required(e, "extents", "chunks");
    if (!chunks.is_array() || chunks.size() != 2) throw BadField("\"extents.chunks\" is not a pair");
    Extent extent;
    extent.chunk_begin = Int<uint32_t>(chunks[0], "extents.chunks");
    extent.chunk_end = Int<uint32_t>(chunks[1], "extents.chunks");
    extent.at = Int<uint64_t>(Required(e, "extents", "at"), "extents.at");
    if (auto step = e.find("step"); step != e.end()) extent.step = Int<uint64_t>(*step, "extents.step");
    extents.push_back(extent);
  }
  return extents;
}

// Keys in nlohmann's (sorted) order, as ManifestToJson writes every object: the manifest's
// checksum is of that text.
void WriteIncrement(JsonText& w, const Increment& increment) {
  w.BeginObject();
  w.Key("origin_steps");
  w.BeginArray();
  for (const StepRun& s : increment.origin_steps) {
    w.BeginObject();
    w.Field("run", s.run);
    w.Field("step", s.step);
    w.EndObject();
  }
  w.EndArray();
  if (!increment.origins.empty()) {
    w.Key("origins");
    w.BeginArray();
    for (const Origin& o : increment.origins) {
      w.BeginObject();
      w.Field("bytes", o.bytes);
      w.Field("file", o.file);
      w.Field("rank", o.rank);
      w.Field("run", o.run);
      w.Field("step", o.step);
      w.EndObject();
    }
    w.EndArray();
  }
  w.Field("own_bytes", increment.own_bytes);
  w.Field("referenced_bytes", increment.referenced_bytes);
  w.EndObject();
}

void WriteExtents(JsonText& w, const std::vector<Extent>& extents) {
  w.BeginArray();
  for (const Extent& e : extents) {
    w.BeginObject();
    w.Field("at", e.at);
    w.Key("chunks");
    w.Pair(e.chunk_begin, e.chunk_end);
    if (e.step) w.Field("step", *e.step);
    w.EndObject();
  }
  w.EndArray();
}

}  // namespace ckpt::format
