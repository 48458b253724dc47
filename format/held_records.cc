#include "format/held_records.h"

#include <fmt/format.h>

#include <charconv>
#include <nlohmann/json.hpp>

namespace ckpt::format {
namespace {

constexpr char kRecordFormat[] = "ckptd-held";

// The run's 16 hex digits at the start of `s` (exactly as written: lowercase, zero-padded).
bool ParseRun(std::string_view s, uint64_t* run) {
  if (s.size() < 16) return false;
  uint64_t v = 0;
  auto [end, error] = std::from_chars(s.data(), s.data() + 16, v, 16);
  if (error != std::errc() || end != s.data() + 16 || fmt::format("{:016x}", v) != s.substr(0, 16)) return false;
  *run = v;
  return true;
}

}  // namespace

std::string RetiredRecordName(uint64_t run) { return fmt::format("held-{:016x}.json", run); }

std::string CarriedRecordName(uint64_t run, uint32_t node) { return fmt::format("held-{:016x}.node-{}.json", run, node); }

bool ParseHeldRecordName(std::string_view name, uint64_t* run) {
  constexpr std::string_view kPrefix = "held-";
  if (name.substr(0, kPrefix.size()) != kPrefix) return false;
  uint64_t r = 0;
  if (!ParseRun(name.substr(kPrefix.size()), &r)) return false;
  const std::string_view rest = name.substr(kPrefix.size() + 16);
  if (rest != ".json") {
    constexpr std::string_view kNode = ".node-";
    if (rest.substr(0, kNode.size()) != kNode) return false;
    uint32_t node = 0;
    const std::string_view digits = rest.substr(kNode.size());
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), node);
    if (error != std::errc() || CarriedRecordName(r, node) != name) return false;
  }
  *run = r;
  return true;
}

std::string HeldRecordJson(const HeldRecord& record) {
  nlohmann::json j = {{"format", kRecordFormat}, {"job", record.job}, {"step", record.step}, {"run", record.run}};
  nlohmann::json files = nlohmann::json::array();
  for (const HeldFile& f : record.files) files.push_back({{"file", f.file}, {"bytes", f.bytes}});
  j["files"] = std::move(files);
  if (record.carried_for) j["carried_for"] = *record.carried_for;
  return j.dump() + "\n";
}

absl::StatusOr<HeldRecord> ParseHeldRecord(std::string_view text, const std::string& where) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(fmt::format("{} is not a held-step record: {}", where, why));
  };
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return bad("not a JSON object");
  if (j.value("format", std::string()) != kRecordFormat) return bad(fmt::format("no \"format\": \"{}\"", kRecordFormat));
  auto number = [&](const char* key) -> std::optional<uint64_t> {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_unsigned()) return std::nullopt;
    return it->get<uint64_t>();
  };
  HeldRecord r;
  auto job = j.find("job");
  std::optional<uint64_t> step = number("step"), run = number("run");
  if (job == j.end() || !job->is_string() || !step || !run) return bad("job, step and run are required");
  r.job = job->get<std::string>();
  r.step = *step;
  r.run = *run;
  auto files = j.find("files");
  if (files == j.end() || !files->is_array()) return bad("no \"files\" list");
  for (const nlohmann::json& f : *files) {
    if (!f.is_object() || !f.contains("file") || !f["file"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned()) {
      return bad("a file without its name and size");
    }
    HeldFile h{f["file"].get<std::string>(), f["bytes"].get<uint64_t>()};
    // A plain name within the step's prefix: a record never names another step's objects.
    if (h.file.empty() || h.file.find('/') != std::string::npos || h.file == "." || h.file == "..") {
      return bad(fmt::format("\"{}\" is not a file name of the step", h.file));
    }
    r.files.push_back(std::move(h));
  }
  if (j.contains("carried_for")) {
    r.carried_for = number("carried_for");
    if (!r.carried_for) return bad("carried_for is not a step");
  }
  return r;
}

}  // namespace ckpt::format
