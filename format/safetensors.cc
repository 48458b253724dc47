#include "format/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/status.h"
#include "format/json_text.h"

namespace ckpt::format {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // safetensors' own limit

}  // namespace
std::string EncodeHeader(const std::vector<TensorEntry>& tensors,
                         const std::map<std::string, std::string>& metadata, size_t alignment) {
  // Written in the entries' order, as a tree of nlohmann::ordered_json would write it, but
  // straight to text: an ordered_json object finds each new key by a linear search, and an
  // increment of a sparse table has tens of thousands of entries (a quadratic header took
  // most of its write time).
  JsonText header;
  header.BeginObject();
  if (!metadata.empty()) header.Field("__metadata__", metadata);
  for (const TensorEntry& t : tensors) {
    header.Key(t.name);
    header.BeginObject();
    header.Field("dtype", t.dtype);
    header.Field("shape", t.shape);
    header.Key("data_offsets");
    header.Pair(t.begin, t.end);
    header.EndObject();
  }
  header.EndObject();
  std::string json = header.Take();
  json.append((alignment - ((8 + json.size()) % alignment)) % alignment, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

absl::Status CheckHeaderFits(const std::string& encoded, size_t entries, const std::string& file, uint64_t limit) {
  const uint64_t json_bytes = encoded.size() - 8;
  if (json_bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(fmt::format(
      "{}: its safetensors header would be {} bytes ({} entries), over the {} bytes safetensors readers accept; "
      "register fewer tensors, or shorter names",
      file, json_bytes, entries, limit));
}

absl::StatusOr<SafetensorsHeader> ReadHeader(const storage::ObjectReader& object) {
  const uint64_t file_size = object.size();
  const std::string& path = object.name();
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{}: not a valid safetensors file: {}", path, why));
  };
  if (file_size < 8) return bad(fmt::format("only {} bytes", file_size));
  unsigned char prefix[8];
  CKPT_RETURN_IF_ERROR(object.ReadAt(prefix, 8, 0));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes || n > file_size - 8) {
    return bad(fmt::format("header length {} exceeds the file ({} bytes)", n, file_size));
  }
  std::string json(n, '\0');
  CKPT_RETURN_IF_ERROR(object.ReadAt(json.data(), n, 8));
  nlohmann::json parsed = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object()) return bad("header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = 8 + n;
  header.data_bytes = file_size - header.data_start;
  for (auto it = parsed.begin(); it != parsed.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return bad("__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return bad("__metadata__ values must be strings");
        header.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const nlohmann::json& v = *it;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
        !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      return bad(fmt::format("entry for tensor {} is malformed", it.key()));
    }
    TensorEntry t;
    t.name = it.key();
    t.dtype = v["dtype"].get<std::string>();
    for (const auto& d : v["shape"]) {
      if (!d.is_number_integer()) return bad(fmt::format("tensor {} has a bad shape", t.name));
      t.shape.push_back(d.get<int64_t>());
    }
    if (!v["data_offsets"][0].is_number_unsigned() || !v["data_offsets"][1].is_number_unsigned()) {
      return bad(fmt::format("tensor {} has bad data_offsets", t.name));
    }
    t.begin = v["data_offsets"][0].get<uint64_t>();
    t.end = v["data_offsets"][1].get<uint64_t>();
    if (t.end < t.begin) return bad(fmt::format("tensor {} ends before it begins", t.name));
    if (absl::Status s = CheckTensorBytes(t.name, t.dtype, t.shape, t.end - t.begin); !s.ok()) {
      return bad(Message(s));
    }
    header.tensors.push_back(std::move(t));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.begin < b.begin; });
  uint64_t expected = 0;
  for (const TensorEntry& t : header.tensors) {
    if (t.begin != expected) {
      return bad(fmt::format("tensor {} starts at {}, expected {} (hole or overlap)", t.name,
                             t.begin, expected));
    }
    expected = t.end;
  }
  if (expected != header.data_bytes) {
    return bad(fmt::format("tensors cover {} data bytes but the file holds {} (truncated?)",
                           expected, header.data_bytes));
  }
  return header;
}

}  // namespace ckpt::format
