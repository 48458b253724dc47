// The metrics registry's text exposition (format 0.0.4, what Prometheus parses): names,
// escaping, cumulative histogram buckets, values, and the bound on label values a trainer
// chooses. The full endpoint is parsed with the stock parser in client/python/tests/test_metrics.py.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "daemon/metrics/error_cause.h"
#include "daemon/metrics/registry.h"

using namespace ckpt::metrics;

namespace {

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("counters and gauges are written with HELP, TYPE and escaped label values") {
  Registry r;
  auto& c = r.AddCounter({"x_total", "Things.\nTwo lines \\ one backslash.", {"job"}});
  c.With({"a\"b\\c\nd"}).Add(2);
  auto& g = r.AddGauge({"y_bytes", "Bytes.", {}});
  g.With({}).Set(1.5e9);
  const std::string out = r.Render();
  CHECK(Contains(out, "# HELP x_total Things.\\nTwo lines \\\\ one backslash.\n# TYPE x_total counter\n"));
  CHECK(Contains(out, "x_total{job=\"a\\\"b\\\\c\\nd\"} 2\n"));
  CHECK(Contains(out, "# TYPE y_bytes gauge\ny_bytes 1500000000\n"));
}

TEST_CASE("histogram buckets are cumulative and end with +Inf, _sum and _count") {
  Registry r;
  auto& h = r.AddHistogram({"t_seconds", "Time.", {"tier"}}, {0.1, 1, 10});
  Histogram& disk = h.With({"disk"});
  for (double v : {0.05, 0.1, 0.5, 5.0, 50.0}) disk.Observe(v);
  const std::string out = r.Render();
  CHECK(Contains(out, "t_seconds_bucket{tier=\"disk\",le=\"0.1\"} 2\n"));  // le is inclusive
  CHECK(Contains(out, "t_seconds_bucket{tier=\"disk\",le=\"1\"} 3\n"));
  CHECK(Contains(out, "t_seconds_bucket{tier=\"disk\",le=\"10\"} 4\n"));
  CHECK(Contains(out, "t_seconds_bucket{tier=\"disk\",le=\"+Inf\"} 5\n"));
  CHECK(Contains(out, "t_seconds_sum{tier=\"disk\"} 55.65\n"));
  CHECK(Contains(out, "t_seconds_count{tier=\"disk\"} 5\n"));
}

TEST_CASE("values use Prometheus' spellings of infinity and NaN, and round-trip") {
  CHECK(FormatValue(std::numeric_limits<double>::infinity()) == "+Inf");
  CHECK(FormatValue(-std::numeric_limits<double>::infinity()) == "-Inf");
  CHECK(FormatValue(std::nan("")) == "NaN");
  CHECK(std::stod(FormatValue(0.1 + 0.2)) == 0.1 + 0.2);
}

TEST_CASE("label values a trainer chooses are bounded: past max_series they fold into _other") {
  Registry r;
  auto& c = r.AddCounter({"jobs_total", "Per job.", {"job", "tier"}, /*max_series=*/3, /*fold_label=*/0});
  for (int i = 0; i < 1000; ++i) c.With({"job" + std::to_string(i), "disk"}).Add();
  const std::string out = r.Render();
  CHECK(Contains(out, "jobs_total{job=\"job0\",tier=\"disk\"} 1\n"));
  CHECK(Contains(out, "jobs_total{job=\"job2\",tier=\"disk\"} 1\n"));
  CHECK_FALSE(Contains(out, "job3\""));
  CHECK(Contains(out, "jobs_total{job=\"_other\",tier=\"disk\"} 997\n"));

  std::vector<std::pair<LabelValues, double>> rows;
  for (int i = 0; i < 100; ++i) rows.push_back({{"u" + std::to_string(i)}, 1});
  auto folded = FoldRows(rows, 64, 0);
  REQUIRE(folded.size() == 65);
  CHECK(folded.back().first == LabelValues{"_other"});
  CHECK(folded.back().second == 36);
  // Ages fold to the oldest of them, not their sum.
  rows.push_back({{"u100"}, 7});
  auto oldest = FoldRows(rows, 64, 0, /*keep_max=*/true);
  REQUIRE(oldest.size() == 65);
  CHECK(oldest.back().first == LabelValues{"_other"});
  CHECK(oldest.back().second == 7);
}

TEST_CASE("errors count under a few causes read from their status code, each exported from the start") {
  CHECK(ErrorCause(absl::UnavailableError("S3 PUT: Couldn't connect to server (after 6 attempts)")) == "unavailable");
  CHECK(ErrorCause(absl::DeadlineExceededError("no answer")) == "timeout");
  CHECK(ErrorCause(absl::PermissionDeniedError("403 SignatureDoesNotMatch")) == "refused");
  CHECK(ErrorCause(absl::UnauthenticatedError("bad token")) == "refused");
  CHECK(ErrorCause(absl::ResourceExhaustedError("replica memory")) == "no_space");
  CHECK(ErrorCause(absl::NotFoundError("bucket")) == "not_found");
  CHECK(ErrorCause(absl::DataLossError("checksum")) == "corrupt");
  CHECK(ErrorCause(absl::InternalError("?")) == "other");
  const auto& all = ErrorCauses();
  for (auto code : {absl::StatusCode::kCancelled, absl::StatusCode::kUnknown, absl::StatusCode::kInvalidArgument,
                    absl::StatusCode::kAborted, absl::StatusCode::kUnimplemented, absl::StatusCode::kFailedPrecondition}) {
    CHECK(std::find(all.begin(), all.end(), ErrorCause(absl::Status(code, "x"))) != all.end());
  }
}
