#include <catch2/catch.hpp>

#include "common/status.h"
#include "format/user_files.h"

using ckpt::Message;
using namespace ckpt::format;

TEST_CASE("user file names: a file's own name, written safely into an export folder") {
  for (const char* ok : {"config.yaml", "tokenizer.json", "a", "v1+2_x-y.txt", "README"}) {
    CHECK(ValidateUserFileName(ok).ok());
  }
  for (const char* bad : {"", ".hidden", "..", "a/b", "../x", "a b", "tab\t", "caf\xc3\xa9"}) {
    absl::Status s = ValidateUserFileName(bad);
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Message(s).find("is not allowed") != std::string::npos);
  }
  CHECK(ValidateUserFileName(std::string(kMaxUserFileNameBytes, 'a')).ok());
  CHECK_FALSE(ValidateUserFileName(std::string(kMaxUserFileNameBytes + 1, 'a')).ok());
  // Control characters are not echoed into the message (it reaches logs and terminals).
  CHECK(Message(ValidateUserFileName("a\x1b[2Jb")).find('\x1b') == std::string::npos);
}

TEST_CASE("a snapshot's files are checked among its other train state") {
  CHECK(CheckUserFiles({{"step", 8}, {"file/config.yaml", 100}, {"rng.torch", 5000}}).ok());
  CHECK(CheckUserFiles({{"notes/../x", 1}}).ok());  // not a file: any train-state name
  CHECK(Message(CheckUserFiles({{"file/../x", 1}})).find("\"../x\" is not allowed") != std::string::npos);
  CHECK(CheckUserFiles({{"file/a", kMaxUserFilesBytes - 1}, {"file/b", 1}, {"optim.big", kMaxUserFilesBytes}}).ok());
  absl::Status big = CheckUserFiles({{"file/a", kMaxUserFilesBytes}, {"file/b", 1}});
  CHECK(absl::IsInvalidArgument(big));
  CHECK(Message(big).find("16 MiB at most") != std::string::npos);
  std::vector<std::pair<std::string, uint64_t>> many;
  for (size_t i = 0; i <= kMaxUserFiles; ++i) many.emplace_back("file/f" + std::to_string(i), 1);
  std::vector<std::pair<std::string_view, uint64_t>> views(many.begin(), many.end());
  CHECK(Message(CheckUserFiles(views)).find("257 files") != std::string::npos);
}

TEST_CASE("a step's files come from its manifest, the lowest rank's of each name") {
  Manifest m;
  m.world_size = 3;
  auto shard = [](uint32_t rank, std::map<std::string, TrainStateEntry> state) {
    ManifestShard s;
    s.rank = rank;
    s.file = ShardFileName(rank);
    s.train_state = std::move(state);
    return s;
  };
  m.shards.push_back(shard(0, {{"step", {0, 8, "xxh3:1"}}, {"file/a.txt", {8, 12, "xxh3:a"}}}));
  m.shards.push_back(shard(1, {{"file/a.txt", {0, 4, "xxh3:a"}}, {"file/b.txt", {4, 9, "xxh3:b1"}}}));
  m.shards.push_back(shard(2, {{"file/b.txt", {0, 5, "xxh3:b2"}}}));
  std::vector<UserFile> files = UserFiles(m);
  REQUIRE(files.size() == 2);
  CHECK(files[0].name == "a.txt");
  CHECK(files[0].rank == 0);
  CHECK(files[0].bytes == 4);
  CHECK(files[0].ranks == std::vector<uint32_t>{0, 1});
  CHECK(files[0].same_everywhere);
  CHECK(files[1].name == "b.txt");
  CHECK(files[1].rank == 1);
  CHECK(files[1].ranks == std::vector<uint32_t>{1, 2});
  CHECK_FALSE(files[1].same_everywhere);
}
