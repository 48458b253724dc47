#include <catch2/catch.hpp>

#include "common/names.h"
#include "common/status.h"

using ckpt::Message;

TEST_CASE("job names that are safe directory names are accepted") {
  for (const char* ok : {"llm", "run-7", "a.b_c", "0", "Job.2026-11-22"}) {
    CHECK(ckpt::ValidateJobName(ok).ok());
  }
}

TEST_CASE("hostile job names are refused with a message naming them") {
  for (const char* bad : {"../etc", "..", ".", "", "a/b", "-x", ".hidden", "a b", "a\nb"}) {
    absl::Status s = ckpt::ValidateJobName(bad);
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Message(s).find("invalid job name") != std::string::npos);
  }
  CHECK(Message(ckpt::ValidateJobName("../etc")).find("../etc") != std::string::npos);
  CHECK_FALSE(ckpt::ValidateJobName(std::string(129, 'a')).ok());
  CHECK(Message(ckpt::ValidateJobName("a\x01")).find("\\x01") != std::string::npos);
}

TEST_CASE("tensor names: printable, not reserved") {
  CHECK(ckpt::ValidateTensorName("layers.0.attn.q_proj.weight").ok());
  CHECK(ckpt::ValidateTensorName("optim.exp_avg/layer 1").ok());
  CHECK_FALSE(ckpt::ValidateTensorName("").ok());
  CHECK_FALSE(ckpt::ValidateTensorName("__metadata__").ok());
  CHECK_FALSE(ckpt::ValidateTensorName("a\"b").ok());
  CHECK_FALSE(ckpt::ValidateTensorName("tab\there").ok());
  CHECK_FALSE(ckpt::ValidateTensorName(std::string(513, 'x')).ok());
}

TEST_CASE("UTF-8 is checked byte by byte") {
  for (std::string ok : {std::string(), std::string("loss"), std::string("\xc3\xbc"),
                         std::string("\xe6\x97\xa5\xe6\x9c\xac"), std::string("\xf0\x9f\x98\x80"),
                         std::string("a\0b", 3)}) {
    CHECK(ckpt::IsValidUtf8(ok));
  }
  for (std::string bad : {"\xff", "\x80", "\xc0\xaf", "\xed\xa0\x80", "\xe6\x97", "\xf4\x90\x80\x80",
                          "ok\xc3", "\xf8\x88\x80\x80\x80"}) {
    CHECK_FALSE(ckpt::IsValidUtf8(bad));
  }
}

TEST_CASE("snapshot metadata must be text with sane keys") {
  CHECK(ckpt::ValidateMetadata({{"loss", "1.5"}, {"note", "\xc3\xbc"}}).ok());
  CHECK_FALSE(ckpt::ValidateMetadata({{"", "x"}}).ok());
  CHECK_FALSE(ckpt::ValidateMetadata({{std::string(257, 'k'), "x"}}).ok());
  CHECK_FALSE(ckpt::ValidateMetadata({{"a\nb", "x"}}).ok());
  auto bad_key = ckpt::ValidateMetadata({{"\xff\xfe", "x"}});
  REQUIRE_FALSE(bad_key.ok());
  CHECK(ckpt::Message(bad_key).find("not valid UTF-8") != std::string::npos);
  auto bad_value = ckpt::ValidateMetadata({{"k", "\xc0\xaf"}});
  REQUIRE_FALSE(bad_value.ok());
  CHECK(ckpt::Message(bad_value).find("train state") != std::string::npos);
}
