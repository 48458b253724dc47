#include "daemon/persist/manifest.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace ckpt::persist {

using nlohmann::json;

uint64_t Manifest::total_bytes() const {
  uint64_t total = 0;
  for (const ManifestShard& s : shards) total += s.bytes;
  return total;
}

std::string TrainStateKey(const std::string& name) { return "__train_state__." + name; }

std::string ManifestToJson(const Manifest& m) {
  json tensors = json::object();
  for (const auto& [name, t] : m.tensors) {
    json shards = json::array();
    for (const TensorShard& s : t.shards) {
      shards.push_back({{"rank", s.rank},
                        {"file", s.file},
                        {"data_offsets", {s.begin, s.end}},
                        {"offset", s.offset},
                        {"shape", s.shape},
                        {"checksum", s.checksum}});
    }
    tensors[name] = {{"dtype", t.dtype}, {"global_shape", t.global_shape}, {"shards", shards}};
  }
  json shards = json::array();
  for (const ManifestShard& s : m.shards) {
    json state = json::object();
    for (const auto& [name, e] : s.train_state) {
      state[name] = {{"data_offsets", {e.begin, e.end}}, {"checksum", e.checksum}};
    }
    shards.push_back({{"rank", s.rank},
                      {"file", s.file},
                      {"bytes", s.bytes},
                      {"metadata", s.metadata},
                      {"train_state", state}});
  }
  json j = {{"format", "ckptd-manifest"},
            {"format_version", m.format_version},
            {"job", m.job},
            {"step", m.step},
            {"unix_time", m.unix_time},
            {"wall_time", m.wall_time},
            {"world_size", m.world_size},
            {"ckptd_version", m.ckptd_version},
            {"metadata", m.metadata},
            {"shards", shards},
            {"tensors", tensors}};
  return j.dump(1);
}

absl::StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: invalid manifest: {}", source, why));
  };
  if (!j.is_object()) return bad("not a JSON object");
  try {
    if (j.value("format", "") != "ckptd-manifest") return bad("\"format\" is not ckptd-manifest");
    Manifest m;
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version > kManifestFormatVersion) {
      return bad(fmt::format("format version {} is newer than this ckptd understands ({})",
                             m.format_version, kManifestFormatVersion));
    }
    m.job = j.at("job").get<std::string>();
    m.step = j.at("step").get<uint64_t>();
    m.unix_time = j.at("unix_time").get<double>();
    m.wall_time = j.at("wall_time").get<std::string>();
    m.world_size = j.at("world_size").get<uint32_t>();
    m.ckptd_version = j.at("ckptd_version").get<std::string>();
    m.metadata = j.at("metadata").get<std::map<std::string, std::string>>();
    for (const auto& s : j.at("shards")) {
      ManifestShard shard;
      shard.rank = s.at("rank").get<uint32_t>();
      shard.file = s.at("file").get<std::string>();
      shard.bytes = s.at("bytes").get<uint64_t>();
      shard.metadata = s.at("metadata").get<std::map<std::string, std::string>>();
      for (auto it = s.at("train_state").begin(); it != s.at("train_state").end(); ++it) {
        TrainStateEntry e;
        e.begin = it->at("data_offsets").at(0).get<uint64_t>();
        e.end = it->at("data_offsets").at(1).get<uint64_t>();
        e.checksum = it->at("checksum").get<std::string>();
        shard.train_state[it.key()] = e;
      }
      if (shard.rank != m.shards.size()) return bad("shards are not ranks 0..world_size-1");
      if (shard.file.find('/') != std::string::npos) return bad("shard file names a directory");
      m.shards.push_back(std::move(shard));
    }
    if (m.shards.size() != m.world_size) return bad("shard count differs from world_size");
    for (auto it = j.at("tensors").begin(); it != j.at("tensors").end(); ++it) {
      ManifestTensor t;
      t.dtype = it->at("dtype").get<std::string>();
      t.global_shape = it->at("global_shape").get<std::vector<int64_t>>();
      for (const auto& s : it->at("shards")) {
        TensorShard shard;
        shard.rank = s.at("rank").get<uint32_t>();
        shard.file = s.at("file").get<std::string>();
        shard.begin = s.at("data_offsets").at(0).get<uint64_t>();
        shard.end = s.at("data_offsets").at(1).get<uint64_t>();
        shard.offset = s.at("offset").get<std::vector<int64_t>>();
        shard.shape = s.at("shape").get<std::vector<int64_t>>();
        shard.checksum = s.at("checksum").get<std::string>();
        if (shard.rank >= m.world_size) return bad(fmt::format("tensor {}: bad rank", it.key()));
        t.shards.push_back(std::move(shard));
      }
      m.tensors[it.key()] = std::move(t);
    }
    return m;
  } catch (const json::exception& e) {
    return bad(e.what());
  }
}

}  // namespace ckpt::persist
