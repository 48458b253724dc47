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

TEST_CASE("shared-memory names: one leading slash, no traversal") {
  CHECK(ckpt::ValidateShmName("/ckpt-arena.12.0.abc").ok());
  CHECK_FALSE(ckpt::ValidateShmName("ckpt").ok());
  CHECK_FALSE(ckpt::ValidateShmName("/a/b").ok());
  CHECK_FALSE(ckpt::ValidateShmName("/..").ok());
  CHECK_FALSE(ckpt::ValidateShmName("/").ok());
}
