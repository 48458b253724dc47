#include "daemon/upload/part_report.h"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include <nlohmann/json.hpp>

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
  return json{{"format", "ckptd-upload-report"},
              {"run", r.run},
              {"node", r.node},
              {"digest", r.digest},
              {"ranks", r.ranks},
              {"shard_bytes", r.shard_bytes},
              {"part_bytes", r.part_bytes},
              {"part_checksum", r.part_checksum}}
      .dump();
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
    return r;
  } catch (const std::exception& e) {  // BadReport, or nlohmann's type and key errors
    return bad(e.what());
  }
}

}  // namespace ckpt::daemon::upload
