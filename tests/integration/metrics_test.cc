// /metrics says which tier is behind (issue 47): real ckptd daemons in a group with peer
// replicas and a remote tier on a real Ceph gateway (tests/fakes/ceph_cluster.h) behind a TCP
// proxy the test cuts.
// The store stops, a member is killed, staging memory fills, and each shows on the scrape:
// the remote tier's step stays while the local one advances, the upload backlog and its
// errors' cause, the steps in flight, the coordinator's per-member series (and no other
// node's), and staging memory against its capacity, as the shipped alerting rules
// (deploy/prometheus/ckptd-rules.yml) read them. And a job's last commit survives a restart.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

#include "tests/fakes/ceph_cluster.h"
#include "tests/integration/cluster.h"
#include "tests/integration/tcp_proxy.h"

using namespace ckpt::testing;
using namespace ckpt::testing::cluster;

namespace {

// The value of the series written exactly as `series` (its name and labels in ckptd's
// order), or nullopt when the scrape has no such series.
std::optional<double> Value(const std::string& scrape, const std::string& series) {
  std::istringstream lines(scrape);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 && line[series.size()] == ' ') {
      return std::stod(line.substr(series.size() + 1));
    }
  }
  return std::nullopt;
}

double ValueOr(const std::string& scrape, const std::string& series, double otherwise = -1) {
  return Value(scrape, series).value_or(otherwise);
}

std::string Tier(const std::string& family, const std::string& job, const std::string& tier) {
  return fmt::format("{}{{ckpt_job=\"{}\",tier=\"{}\"}}", family, job, tier);
}
std::string OfJob(const std::string& family, const std::string& job) {
  return fmt::format("{}{{ckpt_job=\"{}\"}}", family, job);
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The manifest's commit time of `step` of `job` under `root`.
double ManifestTime(const std::string& root, const std::string& job, uint64_t step) {
  return json::parse(ReadFile(root + "/" + job + "/" + StepName(step) + "/manifest.json")).at("unix_time").get<double>();
}

}  // namespace

TEST_CASE("the remote tier stopped, a member lost, staging memory full: /metrics names each") {
  auto& ceph = CephCluster::Get();
  for (const auto& [name, value] : ceph.env()) ::setenv(name.c_str(), value.c_str(), 1);
  const std::string endpoint = ceph.env().at("AWS_ENDPOINT_URL_S3");
  TcpProxy store("127.0.0.1", std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
  ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + store.address()).c_str(), 1);
  const std::string bucket = "s3://" + ceph.Options().bucket + "/" + ceph.FreshPrefix();

  Cluster c({{0}, {1}, {2}});
  // A step that waits for ranks that never come stays in flight while the test looks.
  c.step_timeout = std::to_string(120 * kSanitizerSlowdown) + "s";
  constexpr uint64_t kStaging = 8 << 20;
  c.extra_flags = {"--remote", bucket, "--staging-bytes", std::to_string(kStaging), "--replication", "2+1"};
  c.StartAll();
  REQUIRE_WITHIN(c, kJoinBound, "every member alive", c.AllAlive());
  const double began = UnixNow();

  // Step 1 reaches every tier: node 0, the publisher, sees it in the remote one.
  c.SaveAllCommitted(1);
  REQUIRE_WITHIN(c, 60s, "step 1 published remotely",
                 ValueOr(c.Metrics(0), Tier("ckptd_job_tier_step", "g", "remote")) == 1);
  // The group's decision reaches node 0's view of it with a heartbeat, which under TSan can
  // come after the upload.
  REQUIRE_WITHIN(c, 30s, "step 1 global in node 0's view",
                 ValueOr(c.Metrics(0), Tier("ckptd_job_tier_step", "g", "global")) == 1);
  std::string m0 = c.Metrics(0);
  INFO(m0);
  CHECK(ValueOr(m0, Tier("ckptd_job_tier_step", "g", "local")) == 1);
  CHECK(ValueOr(m0, Tier("ckptd_job_tier_step", "g", "global")) == 1);
  REQUIRE_WITHIN(c, 30s, "step 1 replicated in node 0's coding group",
                 ValueOr(c.Metrics(0), Tier("ckptd_job_tier_step", "g", "replicated")) == 1);
  const double step1_time = ManifestTime(c.dir(0).path() + "/root", "g", 1);
  CHECK(ValueOr(m0, Tier("ckptd_job_tier_timestamp_seconds", "g", "remote")) == Approx(step1_time).margin(1e-3));
  CHECK(ValueOr(m0, Tier("ckptd_job_tier_timestamp_seconds", "g", "replicated")) == Approx(step1_time).margin(1e-3));
  CHECK(ValueOr(m0, Tier("ckptd_job_tier_timestamp_seconds", "g", "local")) >= began - 1);
  CHECK(ValueOr(m0, OfJob("ckptd_job_upload_backlog_steps", "g")) == 0);
  CHECK(ValueOr(m0, "ckptd_upload_errors_total{cause=\"unavailable\"}") == 0);

  // The store stops answering: step 2 commits on every node's disk and the group, and goes
  // no further. The upload's errors are counted by cause on every node (each uploads its
  // part), and the step waits in each node's backlog.
  store.Cut(TcpProxy::CutMode::kRefuse);
  c.SaveAllCommitted(2);
  for (int n = 0; n < 2; ++n) {
    INFO("node " << n);
    REQUIRE_WITHIN(c, 60s * kSanitizerSlowdown, "an upload error counted as unavailable",
                   ValueOr(c.Metrics(n), "ckptd_upload_errors_total{cause=\"unavailable\"}") >= 1);
    const std::string m = c.Metrics(n);
    INFO(m);
    CHECK(ValueOr(m, Tier("ckptd_job_tier_step", "g", "local")) == 2);
    CHECK(ValueOr(m, OfJob("ckptd_job_upload_backlog_steps", "g")) == 1);
    CHECK(ValueOr(m, OfJob("ckptd_job_upload_backlog_bytes", "g")) >= c.bytes);
    CHECK(ValueOr(m, OfJob("ckptd_job_upload_oldest_seconds", "g")) > 0);
    CHECK(ValueOr(m, "ckptd_upload_errors_total{cause=\"refused\"}") == 0);
  }
  m0 = c.Metrics(0);
  {
    INFO(m0);
    // The remote tier is behind the local one by a step, and says so in time too.
    CHECK(ValueOr(m0, Tier("ckptd_job_tier_step", "g", "remote")) == 1);
    CHECK(ValueOr(m0, Tier("ckptd_job_tier_step", "g", "global")) == 2);
    CHECK(ValueOr(m0, Tier("ckptd_job_tier_timestamp_seconds", "g", "local")) ==
          Approx(ManifestTime(c.dir(0).path() + "/root", "g", 2)).margin(1e-3));
    CHECK(ValueOr(m0, Tier("ckptd_job_tier_timestamp_seconds", "g", "remote")) == Approx(step1_time).margin(1e-3));
    CHECK(ValueOr(m0, OfJob("ckptd_job_last_commit_timestamp_seconds", "g")) ==
          ValueOr(m0, Tier("ckptd_job_tier_timestamp_seconds", "g", "local")));
    // What status knows, the scrape shows: the upload's last error is the store's.
    CHECK(Contains(c.node(0).Ctl({"status"}).out, "S3 "));
  }

  // Staging memory fills: rank 0 saves step 3 with a snapshot as large as most of node 0's
  // staging memory; the other ranks never save it, so it stays in flight.
  const uint64_t fill = kStaging - (kStaging / 32);
  auto args = c.RankArgs(0, 3);
  *(std::find(args.begin(), args.end(), "--bytes") + 1) = std::to_string(fill);
  args.insert(args.end(), {"save", "--step", "3"});
  Process filler(Helper(c.node(0), args), c.dir(0).path(), "fill");
  const int filled = filler.Wait(kProcessBound);
  INFO(filler.Stdout() << filler.Stderr());
  REQUIRE(filled == 0);
  REQUIRE_WITHIN(c, 30s, "step 3 in flight on node 0",
                 ValueOr(c.Metrics(0), OfJob("ckptd_job_steps_in_flight", "g")) == 1);
  m0 = c.Metrics(0);
  {
    INFO(m0 << filler.Stdout() << filler.Stderr());
    const double in_flight = ValueOr(m0, "ckptd_staging_bytes{state=\"in_flight\"}");
    const double capacity = ValueOr(m0, "ckptd_staging_bytes{state=\"capacity\"}");
    CHECK(capacity == kStaging);
    // CkptdStagingNearlyFull's ratio.
    CHECK(in_flight / capacity > 0.9);
    CHECK(ValueOr(m0, Tier("ckptd_job_tier_step", "g", "local")) == 2);
  }

  // Node 2 dies. The coordinator names it, with its address; the other nodes export no
  // series per member (a large group's nodes would each export the whole group), only the
  // count by state and their own contact with the coordinator.
  const std::string address = MemberAddress(Status(c.node(0)), 2);
  REQUIRE_FALSE(address.empty());
  CHECK(ValueOr(c.Metrics(0), fmt::format("ckptd_group_member_lost{{node_rank=\"2\",address=\"{}\"}}", address)) == 0);
  c.node(2).Kill();
  const std::string lost2 = fmt::format("ckptd_group_member_lost{{node_rank=\"2\",address=\"{}\"}}", address);
  REQUIRE_WITHIN(c, 30s * kSanitizerSlowdown, "node 2 lost on the coordinator's scrape", ValueOr(c.Metrics(0), lost2) == 1);
  m0 = c.Metrics(0);
  {
    INFO(m0);
    CHECK(ValueOr(m0, fmt::format("ckptd_group_member_lost{{node_rank=\"1\",address=\"{}\"}}",
                                  MemberAddress(Status(c.node(0)), 1))) == 0);
    CHECK(ValueOr(m0, fmt::format("ckptd_group_member_heartbeat_age_seconds{{node_rank=\"2\",address=\"{}\"}}",
                                  address)) > 1);
    CHECK(ValueOr(m0, "ckptd_group_members{state=\"lost\"}") == 1);
  }
  REQUIRE_WITHIN(c, 30s * kSanitizerSlowdown, "node 1 hears node 2 lost",
                 ValueOr(c.Metrics(1), "ckptd_group_members{state=\"lost\"}") == 1);
  const std::string m1 = c.Metrics(1);
  INFO(m1);
  CHECK_FALSE(Contains(m1, "ckptd_group_member_lost{"));
  CHECK_FALSE(Contains(m1, "ckptd_group_member_heartbeat_age_seconds{"));
  CHECK(ValueOr(m1, "ckptd_group_coordinator_contact_age_seconds") >= 0);
  CHECK(ValueOr(m1, "ckptd_group_coordinator_contact_age_seconds") < 30 * kSanitizerSlowdown);
  CHECK(ValueOr(m1, Tier("ckptd_job_tier_step", "g", "local")) == 2);
}

TEST_CASE("a job's newest commit is found on disk at start: its step and time outlive a restart") {
  TempDir dir;
  const int port = PickFreePort();
  Daemon d(dir, {"--metrics-addr", std::to_string(port)});
  d.Start();
  RunResult saved = Run(Helper(d, {"--job", "quiet", "--bytes", "100000", "save", "--step", "7", "--wait-committed"}),
                        dir.path());
  INFO(saved.out << saved.err << d.Log());
  REQUIRE(saved.exit_code == 0);
  const double committed = ManifestTime(d.root(), "quiet", 7);
  REQUIRE(d.Stop() == 0);
  // Restarted, with no trainer and nothing committed since: the job that stopped committing
  // before the restart is still there for `time() - ckptd_job_last_commit_timestamp_seconds`.
  d.Start();
  const std::string m = HttpGet(port, "/metrics");
  INFO(m);
  CHECK(ValueOr(m, OfJob("ckptd_job_last_committed_step", "quiet")) == 7);
  CHECK(ValueOr(m, OfJob("ckptd_job_last_commit_timestamp_seconds", "quiet")) == Approx(committed).margin(1e-3));
  CHECK(ValueOr(m, Tier("ckptd_job_tier_step", "quiet", "local")) == 7);
  CHECK(ValueOr(m, OfJob("ckptd_job_last_commit_age_seconds", "quiet")) >= 0);
  CHECK(ValueOr(m, "ckptd_jobs_committed") == 1);
  CHECK(d.Stop() == 0);
}
