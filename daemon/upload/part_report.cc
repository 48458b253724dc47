#include "daemon/upload/part_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "format/json_text.h"
#include "format/manifest.h"

namespace ckpt::daemon::upload {
namespace {

using nlohmann::json;

// A field missing, of the wrong type or out of range: a report is data from the bucket,
// which every node of the group can write, and is checked as a manifest is.
struct BadReport : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const json& Field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) throw BadReport(fmt::format("no \"{}\"", name));
  return *it;
}

uint64_t Unsigned(const json& v, const char* name, uint64_t most) {
  if (!v.is_number_unsigned() || v.get<uint64_t>() > most) {
    throw BadReport(fmt::format("\"{}\" is not an integer in [0, {}]", name, most));
  }
  return v.get<uint64_t>();
}

std::string Digest(const json& v, const char* name) {
  constexpr std::string_view kPrefix = "xxh3:";
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s.size() == kPrefix.size() + 16 && s.compare(0, kPrefix.size(), kPrefix) == 0 &&
        s.find_first_not_of("0123456789abcdef", kPrefix.size()) == std::string::npos) {
      return s;
    }
  }
  throw BadReport(fmt::format("\"{}\" is not \"xxh3:\" and 16 lowercase hex digits", name));
}

}  // namespace

std::string PartReportJson(const PartReport& r) {
  json j{{"format", "ckptd-upload-report"},
         {"run", r.run},
         {"node", r.node},
         {"digest", r.digest},
         {"ranks", r.ranks},
         {"shard_bytes", r.shard_bytes},
         {"part_bytes", r.part_bytes},
         {"part_checksum", r.part_checksum}};
  if (!r.files.empty()) j["files"] = r.files;
  if (r.step) j["step"] = *r.step;
  if (r.increment) {
    // The manifest's own JSON of it (format/increment.h), so both read it alike.
    format::JsonText w;
    format::WriteIncrement(w, *r.increment);
    j["increment"] = json::parse(w.Take());
  }
  return j.dump();
}

absl::StatusOr<PartReport> ParsePartReport(const std::string& text, const std::string& source) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not an upload report: {}", source, why));
  };
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return bad("not a JSON object");
  try {
    const json& format = Field(j, "format");
    if (!format.is_string() || format.get<std::string>() != "ckptd-upload-report") {
      return bad("\"format\" is not ckptd-upload-report");
    }
    PartReport r;
    r.run = Unsigned(Field(j, "run"), "run", std::numeric_limits<uint64_t>::max());
    r.node = static_cast<uint32_t>(Unsigned(Field(j, "node"), "node", std::numeric_limits<uint32_t>::max()));
    r.digest = Digest(Field(j, "digest"), "digest");
    r.part_bytes = Unsigned(Field(j, "part_bytes"), "part_bytes", std::numeric_limits<uint64_t>::max());
    r.part_checksum = Digest(Field(j, "part_checksum"), "part_checksum");
    const json& ranks = Field(j, "ranks");
    const json& bytes = Field(j, "shard_bytes");
    if (!ranks.is_array() || !bytes.is_array() || ranks.empty() || ranks.size() != bytes.size()) {
      return bad("\"ranks\" and \"shard_bytes\" are not arrays of one entry per rank");
    }
    for (size_t i = 0; i < ranks.size(); ++i) {
      r.ranks.push_back(static_cast<uint32_t>(Unsigned(ranks[i], "ranks", std::numeric_limits<uint32_t>::max())));
      r.shard_bytes.push_back(Unsigned(bytes[i], "shard_bytes", std::numeric_limits<uint64_t>::max()));
      if (i > 0 && r.ranks[i] <= r.ranks[i - 1]) return bad("\"ranks\" are not strictly ascending");
    }
    if (auto files = j.find("files"); files != j.end()) {
      if (!files->is_array() || files->size() != ranks.size()) {
        return bad("\"files\" is not an array of one entry per rank");
      }
      for (size_t i = 0; i < files->size(); ++i) {
        const json& f = (*files)[i];
        if (!f.is_string() || (f.get<std::string>() != format::ShardFileName(r.ranks[i]) &&
                               !format::IsTaggedShardFileName(f.get<std::string>(), r.ranks[i]))) {
          return bad(fmt::format("\"files\"[{}] is not a shard file name of rank {}", i, r.ranks[i]));
        }
        r.files.push_back(f.get<std::string>());
      }
    } else {
      // Written before files were reported: every step's files were untagged then.
      for (uint32_t rank : r.ranks) r.files.push_back(format::ShardFileName(rank));
    }
    if (auto step = j.find("step"); step != j.end()) {
      r.step = Unsigned(*step, "step", std::numeric_limits<uint64_t>::max());
    }
    if (auto inc = j.find("increment"); inc != j.end()) {
      if (!r.step) return bad("an \"increment\" without its \"step\"");
      if (!inc->is_object()) return bad("\"increment\" is not an object");
      r.increment = format::ParseIncrement(*inc);
      if (std::string why = format::IncrementProblem(*r.increment, *r.step, /*is_index=*/false); !why.empty()) {
        return bad("\"increment\": " + why);
      }
      for (const format::Origin& o : r.increment->origins) {
        if (!std::binary_search(r.ranks.begin(), r.ranks.end(), o.rank)) {
          return bad(fmt::format("\"increment\" names an origin of rank {}, not one of the report's", o.rank));
        }
      }
    }
    return r;
  } catch (const std::exception& e) {  // BadReport, or nlohmann's type and key errors
    return bad(e.what());
  }
}

}  // namespace ckpt::daemon::upload
