#include "daemon/upload/part_report.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace ckpt::daemon::upload {

using nlohmann::json;

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
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not an upload report: {}", source, why));
  };
  if (!j.is_object() || j.value("format", "") != "ckptd-upload-report") return bad("no \"format\": ckptd-upload-report");
  try {
    PartReport r;
    r.run = j.at("run").get<uint64_t>();
    r.node = j.at("node").get<uint32_t>();
    r.digest = j.at("digest").get<std::string>();
    r.ranks = j.at("ranks").get<std::vector<uint32_t>>();
    r.shard_bytes = j.at("shard_bytes").get<std::vector<uint64_t>>();
    r.part_bytes = j.at("part_bytes").get<uint64_t>();
    r.part_checksum = j.at("part_checksum").get<std::string>();
    if (r.ranks.empty() || r.ranks.size() != r.shard_bytes.size()) return bad("ranks and shard_bytes do not pair up");
    for (size_t i = 1; i < r.ranks.size(); ++i) {
      if (r.ranks[i] <= r.ranks[i - 1]) return bad("ranks are not ascending");
    }
    return r;
  } catch (const json::exception& e) {
    return bad(e.what());
  }
}

}  // namespace ckpt::daemon::upload
