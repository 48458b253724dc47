// ckptctl export (issue 11): a step saved by 4 ranks, as flat shards or as rows, exported
// from its files alone (the daemon stopped) as Hugging Face shards, one safetensors file and
// a full copy; read back by the project's safetensors reader and by the stock library
// (check_export.py), bit for bit against the global tensors; damage fails the export.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "format/safetensors.h"
#include "storage/local_store.h"
#include "tests/fakes/flip_bit.h"
#include "tests/integration/common.h"
#include "tests/integration/global_pattern.h"

using namespace ckpt::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kRows = 3001, kCols = 1024;
const std::map<std::string, uint32_t> kModel = {
    {"layer0.weight", 0}, {"layer1.weight", 1}, {"replicated", 2}, {"scalar", 3}};

void SaveWithFourRanks(const Daemon& d, const TempDir& dir, const std::string& layout) {
  for (const RunResult& r : ReshardRanks(d, dir, 4, {"--layout", layout, "save", "--wait-committed"})) {
    INFO(r.out << r.err);
    REQUIRE(Contains(r.out, "saved committed"));
  }
}

RunResult Export(const Daemon& d, const TempDir& dir, std::vector<std::string> args) {
  std::vector<std::string> argv = {Runfile("client/ckptctl"), "export", "--root", d.root(), "--job", "reshard"};
  argv.insert(argv.end(), args.begin(), args.end());
  return Run(argv, dir.path());
}

// Reads every tensor of a safetensors file with the project's own reader.
std::map<std::string, std::pair<ckpt::format::TensorEntry, std::vector<char>>> ReadAll(const std::string& path) {
  auto object = ckpt::storage::MakeLocalStore(ckpt::MakePosixFilesystem(), "")->Open(path);
  REQUIRE(object.ok());
  auto header = ckpt::format::ReadHeader(**object);
  REQUIRE(header.ok());
  std::map<std::string, std::pair<ckpt::format::TensorEntry, std::vector<char>>> out;
  for (const auto& e : header->tensors) {
    std::vector<char> data(e.end - e.begin);
    REQUIRE((*object)->ReadAt(data.data(), data.size(), header->data_start + e.begin).ok());
    out[e.name] = {e, std::move(data)};
  }
  return out;
}

bool MatchesGlobal(const std::vector<char>& data, uint32_t id) {
  for (size_t i = 0; i < data.size() / 4; ++i) {
    uint32_t v;
    std::memcpy(&v, data.data() + 4 * i, 4);
    if (v != GlobalValue(id, i)) return false;
  }
  return true;
}

void StockLibraryReads(const TempDir& dir, const std::string& path, const std::map<std::string, uint32_t>& names) {
  const char* python = std::getenv("CKPTD_PYTHON");
  REQUIRE(python != nullptr);  // the test command sets it to the venv with safetensors
  std::vector<std::string> argv = {python, Runfile("tests/integration/check_export.py"), path};
  for (const auto& [name, id] : names) argv.push_back(fmt::format("{}={}", name, id));
  RunResult r = Run(argv, dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, "export ok"));
}

}  // namespace

TEST_CASE("flat shards of 4 ranks export as Hugging Face shards, from the files alone") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveWithFourRanks(d, dir, "flat");
  REQUIRE(d.Stop() == 0);  // no daemon from here on
  const std::string out = dir.path() + "/hf";
  // 1 MiB slices: every tensor is read in many pieces that cut the saved shards anywhere.
  RunResult r = Export(d, dir, {"5", out, "--format", "hf", "--max-shard-size", "20MB", "--buffer-size", "1MiB"});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(Contains(r.out, "exported step 5 of job reshard"));
  CHECK(Contains(r.out, "left out 1 optimizer tensors (optim.*)"));

  auto index = nlohmann::json::parse(std::ifstream(out + "/model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 2 * kRows * kCols * 4 + 4096 * 4 + 4);
  CHECK(index["weight_map"]["layer0.weight"] == "model-00001-of-00002.safetensors");
  CHECK(index["weight_map"]["layer1.weight"] == "model-00002-of-00002.safetensors");
  CHECK_FALSE(index["weight_map"].contains("optim.replicated.exp_avg"));
  std::map<std::string, uint32_t> found;
  for (const char* file : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    for (auto& [name, entry] : ReadAll(out + "/" + file)) {
      INFO(name);
      CHECK(entry.first.dtype == "F32");
      CHECK(MatchesGlobal(entry.second, kModel.at(name)));
      found[name] = kModel.at(name);
    }
  }
  CHECK(found == kModel);
  CHECK(ReadAll(out + "/model-00001-of-00002.safetensors").at("layer0.weight").first.shape ==
        std::vector<int64_t>{kRows, kCols});
  StockLibraryReads(dir, out, kModel);
  // Nothing is written over: the same output again is refused.
  RunResult again = Export(d, dir, {"5", out});
  CHECK(again.exit_code == 1);
  CHECK(Contains(again.err, "exists"));
}

TEST_CASE("row shards export as one safetensors file, selected and renamed; full keeps everything") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveWithFourRanks(d, dir, "rows");
  REQUIRE(d.Stop() == 0);
  {
    std::ofstream rules(dir.path() + "/rename.json");
    rules << R"({"layer*": "model.layers.*", "replicated": "wpe"})";
  }
  const std::string file = dir.path() + "/model.safetensors";
  RunResult r = Export(d, dir, {"5", file, "--format", "safetensors", "--exclude", "scalar", "--rename",
                                dir.path() + "/rename.json", "--buffer-size", "3MiB"});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  StockLibraryReads(dir, file, {{"model.layers.0.weight", 0}, {"model.layers.1.weight", 1}, {"wpe", 2}});

  const std::string full = dir.path() + "/full";
  RunResult f = Export(d, dir, {"5", full, "--format", "full", "--json"});
  INFO(f.out << f.err);
  REQUIRE(f.exit_code == 0);
  auto summary = nlohmann::json::parse(f.out);
  CHECK(summary["tensors"] == 5);
  CHECK(summary["files"].size() == 4);
  auto model = ReadAll(full + "/model.safetensors");
  CHECK(model.size() == 4);
  CHECK(MatchesGlobal(model.at("layer1.weight").second, 1));
  auto optimizer = ReadAll(full + "/optimizer.safetensors");
  REQUIRE(optimizer.count("optim.replicated.exp_avg") == 1);
  CHECK(MatchesGlobal(optimizer.at("optim.replicated.exp_avg").second, 4));
  auto state = ReadAll(full + "/train_state.safetensors");
  REQUIRE(state.count("rank-00003.note") == 1);
  CHECK(std::string(state.at("rank-00003.note").second.begin(), state.at("rank-00003.note").second.end()) == "rank=3");
  auto meta = nlohmann::json::parse(std::ifstream(full + "/checkpoint.json"));
  CHECK(meta["step"] == 5);
  CHECK(meta["world_size"] == 4);

  // Options that make no sense are named, and nothing is written.
  for (auto [args, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"5", dir.path() + "/x", "--dtype", "int4"}, "--dtype int4: bf16, fp16 or fp32"},
           {{"5", dir.path() + "/x", "--max-shard-size", "lots"}, "--max-shard-size: \"lots\" is not a size"},
           {{"5", dir.path() + "/x", "--include", "nothing.*"}, "nothing to export from step 5"},
           {{"5", dir.path() + "/x", "--format", "full", "--dtype", "bf16"}, "full keeps every dtype"},
           {{"9", dir.path() + "/x"}, "no committed checkpoint at step 9"}}) {
    RunResult bad = Export(d, dir, args);
    INFO(bad.out << bad.err);
    CHECK(bad.exit_code != 0);
    CHECK(Contains(bad.err, why));
    CHECK_FALSE(fs::exists(dir.path() + "/x"));
  }
}

TEST_CASE("export verifies what it reads: a flipped bit or a truncated shard fails it, naming both") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveWithFourRanks(d, dir, "rows");
  REQUIRE(d.Stop() == 0);
  const std::string step = d.root() + "/reshard/step-00000005";
  const std::string two = ShardPath(step, 2), one = ShardPath(step, 1);
  FlipDataBit(two, 1000);
  RunResult r = Export(d, dir, {"5", dir.path() + "/hf", "--buffer-size", "1MiB"});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 3);
  CHECK(Contains(r.err, fs::path(two).filename().string()));
  CHECK(Contains(r.err, "layer"));
  CHECK(Contains(r.err, "checksum mismatch"));
  CHECK_FALSE(fs::exists(dir.path() + "/hf"));
  CHECK_FALSE(fs::exists(dir.path() + "/hf.export-tmp"));

  FlipDataBit(two, 1000);  // back as it was
  fs::resize_file(one, fs::file_size(one) - 100);
  RunResult t = Export(d, dir, {"5", dir.path() + "/hf"});
  INFO(t.out << t.err);
  CHECK(t.exit_code == 3);
  CHECK(Contains(t.err, fs::path(one).filename().string()));
  CHECK_FALSE(fs::exists(dir.path() + "/hf"));
}
