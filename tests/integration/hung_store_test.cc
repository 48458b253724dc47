// A remote tier that stops answering, or refuses ckptd's keys, never stops the local tier
// (issue 44): real ckptd processes with --remote pointed at a gateway the test plays (a TCP
// listener that accepts connections and never answers, or answers every request 403), and
// trainer processes of several users. Registrations of every user's jobs, new or known,
// and ckptctl go on; a new job commits locally; its upload says within seconds what it
// waits on, or names why the remote tier refuses it. No object store is needed.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"
#include "tests/integration/tcp_proxy.h"

using namespace ckpt::testing;
using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

// The gateway the test plays, with keys as the AWS SDKs would find them. It forwards to
// nothing: it only ever swallows connections or answers them itself.
struct Gateway {
  Gateway() : listener("127.0.0.1", PickFreePort()) {
    ::setenv("AWS_ENDPOINT_URL_S3", ("http://" + listener.address()).c_str(), 1);
    ::setenv("AWS_ACCESS_KEY_ID", "hung-store-test-key", 1);
    ::setenv("AWS_SECRET_ACCESS_KEY", "hung-store-test-secret", 1);
    ::setenv("AWS_REGION", "us-east-1", 1);
  }
  TcpProxy listener;
};

// Lets every local user reach the socket: only ckptd's own checks stand in the way.
void OpenSocket(const Daemon& d) {
  ::chmod(std::filesystem::path(d.socket()).parent_path().c_str(), 0755);
  ::chmod(d.socket().c_str(), 0666);
  ::chmod((d.socket() + ".ctl").c_str(), 0666);
}

std::vector<std::string> SaveArgs(int uid, const std::string& job, uint64_t step) {
  return {"--as-uid", std::to_string(uid), "--job", job, "--bytes", "100000", "save", "--step", std::to_string(step),
          "--wait-committed"};
}

// A trainer of `uid` saves `step` of `job` and waits for its commit; how long it took.
RunResult SaveAs(const Daemon& d, const TempDir& dir, int uid, const std::string& job, uint64_t step,
                 std::chrono::milliseconds* took = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  RunResult r = Run(Helper(d, SaveArgs(uid, job, step)), dir.path(), 90s);
  if (took != nullptr) {
    *took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  }
  return r;
}

// The first upload `ckptctl status` lists for `job` (an empty object when none).
json FirstUpload(const Daemon& d, const std::string& job) {
  json s = Status(d);
  if (!s.contains("jobs")) return json::object();
  for (const json& j : s["jobs"]) {
    if (j.value("job", "") == job && j.contains("uploads") && !j["uploads"].empty()) return j["uploads"][0];
  }
  return json::object();
}

}  // namespace

TEST_CASE("a gateway that never answers: every user's registrations and ckptctl go on, the upload says what it waits on") {
  REQUIRE(::geteuid() == 0);  // the suite runs as root so that it can be other users
  Gateway gateway;
  gateway.listener.Cut(TcpProxy::CutMode::kBlackhole);
  TempDir dir;
  Daemon d(dir, {"--remote", "s3://ckptd-hung/p", "--allow-uid", "1000", "--allow-uid", "1001"});
  d.Start();
  OpenSocket(d);
  // Jobs made while the gateway hangs: each first registration waits for it a few seconds
  // at most, then commits locally.
  for (auto [uid, job] : {std::pair{0, "roots"}, std::pair{1000, "old"}}) {
    RunResult made = SaveAs(d, dir, uid, job, 1);
    INFO(job << ": " << made.out << made.err << Tail(d.Log()));
    REQUIRE(made.exit_code == 0);
    REQUIRE(Contains(made.out, "committed"));
  }
  // Another user's new job asks the gateway who owns it; meanwhile, and after, every known
  // job registers, saves and commits as if the gateway were not there, and ckptctl answers.
  Process fresh(Helper(d, SaveArgs(1001, "fresh", 1)), dir.path(), "fresh");
  for (uint64_t step = 2; step <= 3; ++step) {
    for (auto [uid, job] : {std::pair{0, "roots"}, std::pair{1000, "old"}}) {
      std::chrono::milliseconds took{};
      RunResult saved = SaveAs(d, dir, uid, job, step, &took);
      INFO(job << " step " << step << ": " << saved.out << saved.err << Tail(d.Log()));
      CHECK(saved.exit_code == 0);
      CHECK(Contains(saved.out, "committed"));
      CHECK(took < 20s * kSanitizerSlowdown);  // the trainer's own deadline is 30 s
    }
  }
  // ckptctl lists the local tier, and names the remote one's silence, within its deadline.
  const auto list_began = std::chrono::steady_clock::now();
  RunResult listed = d.Ctl({"--timeout", "10", "--job", "old", "list"});
  INFO(listed.out << listed.err);
  CHECK(Contains(listed.out, "old  3 "));
  CHECK(Contains(listed.out + listed.err, "the remote tier s3://ckptd-hung/p cannot be listed: no answer in"));
  CHECK(listed.exit_code == 3);
  CHECK(std::chrono::steady_clock::now() - list_began < 12s * kSanitizerSlowdown);
  // The new job commits locally ...
  REQUIRE(fresh.Wait(90s) == 0);
  INFO(fresh.Stdout() << fresh.Stderr());
  CHECK(Contains(fresh.Stdout(), "committed"));
  // ... and its upload says, within seconds, what it waits on.
  const auto committed = std::chrono::steady_clock::now();
  json upload;
  CHECK(WaitUntil([&] {
    upload = FirstUpload(d, "fresh");
    return upload.value("state", "") == "waiting" &&
           Contains(upload.value("last_error", ""), "waiting for the remote tier to say who owns job fresh");
  }, 10s, 100ms));
  INFO(upload.dump() << Tail(d.Log()));
  CHECK(std::chrono::steady_clock::now() - committed < 10s * kSanitizerSlowdown);
  CHECK(Contains(upload.value("last_error", ""), "GET s3://ckptd-hung/p/fresh/.owner has had no answer for"));
  CHECK(Contains(d.Ctl({"status"}).out, "waiting for the remote tier to say who owns job fresh"));
  // Stopped while its questions wait on the gateway, ckptd ends them at once.
  const auto stop_began = std::chrono::steady_clock::now();
  CHECK(d.Stop() == 0);
  CHECK(std::chrono::steady_clock::now() - stop_began < 15s * kSanitizerSlowdown);
}

TEST_CASE("a gateway that refuses ckptd's keys: other users' new jobs commit locally, the upload names the cause") {
  REQUIRE(::geteuid() == 0);
  Gateway gateway;
  const std::string body =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SignatureDoesNotMatch</Code>"
      "<Message>The request signature we calculated does not match the signature you provided.</Message></Error>";
  gateway.listener.Answer(fmt::format("HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: "
                                      "{}\r\nConnection: close\r\n\r\n{}",
                                      body.size(), body));
  TempDir dir;
  Daemon d(dir, {"--remote", "s3://ckptd-refused/p", "--allow-uid", "1001"});
  d.Start();
  OpenSocket(d);
  RunResult saved = SaveAs(d, dir, 1001, "mine", 1);
  INFO(saved.out << saved.err << Tail(d.Log()));
  REQUIRE(saved.exit_code == 0);
  CHECK(Contains(saved.out, "committed"));
  json upload;
  CHECK(WaitUntil([&] {
    upload = FirstUpload(d, "mine");
    return Contains(upload.value("last_error", ""), "SignatureDoesNotMatch");
  }, 30s, 100ms));
  INFO(upload.dump());
  CHECK(Contains(upload.value("last_error", ""), "cannot ask the remote tier who owns job mine"));
  CHECK(Contains(upload.value("last_error", ""), "403"));
  // The user's restore of its own job goes on from the local tier.
  RunResult restored =
      Run(Helper(d, {"--as-uid", "1001", "--job", "mine", "--bytes", "100000", "check"}), dir.path(), 90s);
  INFO(restored.out << restored.err);
  CHECK(restored.exit_code == 0);
  CHECK(Contains(restored.out, "restored step=1"));
  CHECK(d.Stop() == 0);
}
