// Trust boundaries between local users (issue 9): the caller's identity comes from the
// socket, a job belongs to the uid that created it, a session only to the process that
// registered it, and shared memory only to the process that hands it over. The test runs as root and drops to
// other uids in the trainer processes it starts.
#include <catch2/catch.hpp>

#include <acl/libacl.h>
#include <signal.h>
#include <sys/acl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <thread>
#include <vector>

#include "common/unique_fd.h"

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;
using namespace std::chrono_literals;

namespace {

// Lets every local user reach the socket: only ckptd's own checks stand in the way.
void OpenSocket(const Daemon& d) {
  ::chmod(std::filesystem::path(d.socket()).parent_path().c_str(), 0755);
  ::chmod(d.socket().c_str(), 0666);
  ::chmod((d.socket() + ".ctl").c_str(), 0666);  // where trainers fetch their control blocks
}

// A connection to the Unix socket at `path` that never speaks.
ckpt::UniqueFd ConnectUnix(const std::string& path) {
  ckpt::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  return fd;
}

std::string Line(const std::string& out, const std::string& key) {
  auto at = out.find(key + "=");
  REQUIRE(at != std::string::npos);
  at += key.size() + 1;
  return out.substr(at, out.find('\n', at) - at);
}

std::vector<std::string> As(int uid, std::vector<std::string> args) {
  args.insert(args.begin(), {"--as-uid", std::to_string(uid)});
  return args;
}

// A trainer of `uid` saves `step` of `job` (100 kB) and waits for its commit.
RunResult SaveAs(const Daemon& d, const TempDir& dir, int uid, const std::string& job, uint64_t step) {
  return Run(Helper(d, As(uid, {"--job", job, "--bytes", "100000", "save", "--step",
                                std::to_string(step), "--wait-committed"})),
             dir.path());
}

}  // namespace

TEST_CASE("a job belongs to the uid that created it, across restarts") {
  REQUIRE(::geteuid() == 0);  // the suite runs as root so that it can be other users
  TempDir dir;
  Daemon d(dir, {"--allow-uid", "1000", "--allow-uid", "1001", "--keep-last", "0"});
  d.Start();
  OpenSocket(d);
  auto save = [&](int uid, uint64_t step) { return SaveAs(d, dir, uid, "mine", step); };
  REQUIRE(save(1000, 1).exit_code == 0);
  REQUIRE(save(1000, 2).exit_code == 0);

  auto intruder = save(1001, 3);
  INFO(intruder.out << intruder.err);
  CHECK(intruder.exit_code != 0);
  CHECK(Contains(intruder.out, "job mine belongs to uid 1000"));
  auto restore = Run(Helper(d, As(1001, {"--job", "mine", "--bytes", "100000", "check"})),
                     dir.path());
  CHECK(restore.exit_code != 0);
  CHECK(Contains(restore.out, "belongs to uid 1000"));
  auto del = Run(Helper(d, As(1001, {"--job", "mine", "admin-delete", "--step", "1"})), dir.path());
  CHECK(del.exit_code == 1);
  CHECK(Contains(del.out, "PERMISSION_DENIED"));
  CHECK(Contains(d.Ctl({"--job", "mine", "list"}).out, "1"));

  // The owner may; so may root (the operator).
  CHECK(Run(Helper(d, As(1000, {"--job", "mine", "admin-delete", "--step", "1"})), dir.path())
            .exit_code == 0);
  CHECK(Run(Helper(d, {"--job", "mine", "admin-delete", "--step", "2"}), dir.path()).exit_code == 0);

  // Ownership is on disk: a restarted ckptd still refuses the other uid.
  CHECK(d.Stop() == 0);
  d.Start();
  OpenSocket(d);
  CHECK(Contains(save(1001, 4).out, "belongs to uid 1000"));
  CHECK(save(1000, 4).exit_code == 0);
}

TEST_CASE("ownership fails closed, and a refused registration claims nothing") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  Daemon d(dir, {"--allow-uid", "1000"});
  d.Start();
  OpenSocket(d);
  // A job with checkpoints but no owner on record (as an older ckptd left it).
  REQUIRE(Run(Helper(d, {"--job", "legacy", "--bytes", "100000", "save", "--step", "1",
                         "--wait-committed"}),
              dir.path()).exit_code == 0);
  std::filesystem::remove(d.root() + "/legacy/.owner");
  CHECK(d.Stop() == 0);
  d.Start();
  OpenSocket(d);
  auto taken = Run(Helper(d, As(1000, {"--job", "legacy", "--bytes", "100000", "save", "--step",
                                       "2"})),
                   dir.path());
  CHECK(taken.exit_code != 0);
  CHECK(Contains(taken.out, "no owner on record"));
  // A registration that fails leaves no claim on the job's name.
  auto bad = Run(Helper(d, As(1000, {"--job", "squat", "register-bad", "--case", "wrong-size"})),
                 dir.path());
  CHECK(bad.exit_code == 0);  // register-bad reports the refusal it expected
  CHECK_FALSE(std::filesystem::exists(d.root() + "/squat/.owner"));
}

TEST_CASE("a session id is not a credential, and memory must be the caller's own") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  Daemon d(dir, {"--allow-uid", "1000", "--allow-uid", "1001"});
  d.Start();
  OpenSocket(d);
  Process victim(Helper(d, As(1000, {"--job", "held", "hold", "--hold-seconds", "60"})),
                 dir.path(), "victim");
  REQUIRE(victim.WaitForStdout("arena="));
  std::string session = Line(victim.Stdout(), "session");
  // Its control block is a sealed memfd: even its own trainer cannot shrink it.
  CHECK(Line(victim.Stdout(), "truncate-control") == "EPERM");
  std::string spare_token = Line(victim.Stdout(), "spare-token");
  std::string arena = Line(victim.Stdout(), "arena");
  REQUIRE_FALSE(spare_token.empty());
  // Arenas are memfds: nothing of the victim's is in /dev/shm for anyone to open.
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    CHECK(entry.path().filename().string().rfind("ckpt-arena.", 0) != 0);
  }

  for (int uid : {1001, 0}) {  // another user, and root in another process
    std::vector<std::string> args = {"--job", "thief", "steal", "--session", session,
                                     "--victim-token", spare_token};
    if (uid != 0) {  // root may open anything in /proc; another user may not
      args.push_back("--victim-arena");
      args.push_back(arena);
    }
    auto r = Run(Helper(d, As(uid, args)), dir.path());
    INFO("as uid " << uid << ": " << r.out << r.err);
    CHECK(Contains(r.out, "snapshot code=PERMISSION_DENIED"));
    CHECK(Contains(r.out, "restore code=PERMISSION_DENIED"));
    CHECK(Contains(r.out, "unregister code=PERMISSION_DENIED"));
    CHECK(Contains(r.out, "control=refused"));  // nor its control block
    // Nor the arenas it handed over: a token is redeemed only by the process that made it.
    CHECK(Contains(r.out, "register code=PERMISSION_DENIED"));
    CHECK(Contains(r.out, "was handed over by another process"));
    if (uid != 0) CHECK(Contains(r.out, "open-arena=Permission denied"));
  }
  // The victim's session is untouched.
  auto status = d.Ctl({"status", "--json"});
  CHECK(Contains(status.out, "\"job\": \"held\""));
  CHECK_FALSE(Contains(status.out, session));  // status does not hand session ids out
  victim.Signal(SIGKILL);
  victim.Wait();
}

TEST_CASE("members of a --job-group share its jobs; supplementary groups count") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  // Only the group may connect: the documented systemd set-up (trainers in group ckptd).
  Daemon d(dir, {"--allow-gid", "2000", "--job-group", "2000"});
  d.Start();
  OpenSocket(d);
  auto save = [&](int uid, std::vector<std::string> extra, uint64_t step) {
    std::vector<std::string> args = As(uid, extra);
    for (std::string a : {"--job", "team", "--bytes", "100000", "save", "--step"}) args.push_back(a);
    args.push_back(std::to_string(step));
    args.push_back("--wait-committed");
    return Run(Helper(d, args), dir.path());
  };
  auto first = save(1000, {"--extra-gid", "2000"}, 1);
  INFO(first.out << first.err);
  REQUIRE(first.exit_code == 0);
  CHECK(save(1001, {"--extra-gid", "2000"}, 2).exit_code == 0);  // a teammate
  auto outsider = save(1002, {}, 3);
  CHECK(outsider.exit_code != 0);
  CHECK(Contains(d.Log(), "refused connection from pid"));
}

TEST_CASE("one user's long calls cannot take every thread of the daemon") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  Daemon d(dir, {"--allow-uid", "1000"});
  d.Start();
  OpenSocket(d);
  // 40 RPC Waits at once from one uid (root here): 32 are served, the rest refused at once.
  Process flood(Helper(d, {"--job", "hog", "--world-size", "2", "--bytes", "100000",
                           "flood-waits", "--count", "40", "--hold-seconds", "8"}),
                dir.path(), "flood");
  REQUIRE(flood.WaitForStdout("flooding"));
  // Meanwhile another user checkpoints through the RPC path (Snapshot, then a Wait).
  auto other = Run(Helper(d, As(1000, {"--job", "fine", "--bytes", "100000", "rpc-snapshot"})),
                   dir.path());
  INFO(other.out << other.err);
  CHECK(other.exit_code == 0);
  CHECK(Contains(other.out, "state=TICKET_COMMITTED"));
  REQUIRE(flood.Wait() == 0);
  std::string out = flood.Stdout();
  INFO(out);
  CHECK(Contains(out, "RESOURCE_EXHAUSTED=8"));
  CHECK(Contains(out, "DEADLINE_EXCEEDED=32"));
  CHECK(Contains(out, "too many Wait calls at once (32 of uid 0"));
}

TEST_CASE("one user's idle descriptor-socket connections do not shut out other users") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  Daemon d(dir, {"--allow-uid", "1000"});
  d.Start();
  OpenSocket(d);
  // 64 connections from root that never speak (the server's whole capacity): 4 are held
  // (each for 2 s, until the server gives up on it), the rest are told "busy" at once.
  std::vector<ckpt::UniqueFd> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(ConnectUnix(d.socket() + ".ctl"));
  // Meanwhile another user hands over its arenas and checkpoints.
  auto other = Run(Helper(d, As(1000, {"--job", "fine", "--bytes", "100000", "save", "--step",
                                       "1", "--wait-committed"})),
                   dir.path());
  INFO(other.out << other.err);
  CHECK(other.exit_code == 0);
  int busy = 0;
  for (auto& fd : idle) {
    char answer[128] = {};
    ssize_t n = ::recv(fd.get(), answer, sizeof answer - 1, MSG_DONTWAIT);
    if (n > 0 && std::string_view(answer).starts_with("busy")) ++busy;
  }
  CHECK(busy == 60);
}

namespace {

// Runs `argv` as `uid` (gid the same) with `groups` as its supplementary groups, the way a
// user logged in on the node would: setpriv(1) drops root before the program starts.
RunResult RunAs(int uid, const std::string& groups, std::vector<std::string> argv,
                const std::string& dir) {
  return Run(AsUser(uid, groups, std::move(argv)), dir);
}

// What an older ckptd left: directories 0755 and files 0640, no ACLs.
void MakeLegacy(const std::string& job_dir) {
  auto reset = [](const std::filesystem::path& p, mode_t mode) {
    acl_t plain = acl_from_mode(mode);
    REQUIRE(acl_set_file(p.c_str(), ACL_TYPE_ACCESS, plain) == 0);
    acl_free(plain);
    if (std::filesystem::is_directory(p)) REQUIRE(acl_delete_def_file(p.c_str()) == 0);
  };
  reset(job_dir, 0755);
  for (const auto& e : std::filesystem::recursive_directory_iterator(job_dir)) {
    reset(e.path(), e.is_directory() ? 0755 : 0640);
  }
}

}  // namespace

TEST_CASE("one user's idle connections to the trainer socket are capped; other users still checkpoint") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  Daemon d(dir, {"--allow-uid", "1000", "--max-connections-per-uid", "16"});
  d.Start();
  OpenSocket(d);
  // Closed by ckptd (end of file) within `within`, or still open.
  auto closed_by_daemon = [](int fd, std::chrono::milliseconds within) {
    return WaitUntil([&] {
      char byte;
      return ::recv(fd, &byte, 1, MSG_DONTWAIT) == 0;
    }, within);
  };
  // Root holds 16 connections that never speak: all are kept. Start()'s probes of the
  // socket (root's too) count until gRPC has closed them, which on a loaded machine can
  // take a moment (a CI run failed so): a connection refused for them is made again.
  std::vector<ckpt::UniqueFd> idle;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    std::erase_if(idle, [&](const ckpt::UniqueFd& fd) { return closed_by_daemon(fd.get(), 0ms); });
    if (idle.size() == 16) break;
    while (idle.size() < 16) idle.push_back(ConnectUnix(d.socket()));
    std::this_thread::sleep_for(200ms);
  }
  REQUIRE(idle.size() == 16);
  for (auto& fd : idle) CHECK_FALSE(closed_by_daemon(fd.get(), 10ms));
  // 40 more: each closed at once, and said once in the log, not 40 times.
  int refused = 0;
  for (int i = 0; i < 40; ++i) {
    ckpt::UniqueFd extra = ConnectUnix(d.socket());
    refused += closed_by_daemon(extra.get(), 2s);
  }
  CHECK(refused == 40);
  std::string log = d.Log();
  size_t said = 0;
  for (size_t at = log.find("already holds 16 connections"); at != std::string::npos;
       at = log.find("already holds 16 connections", at + 1)) {
    ++said;
  }
  CHECK(said == 1);
  // Another user checkpoints meanwhile.
  auto other = Run(Helper(d, As(1000, {"--job", "fine", "--bytes", "100000", "save", "--step", "1",
                                       "--wait-committed"})),
                   dir.path());
  INFO(other.out << other.err);
  CHECK(other.exit_code == 0);
  CHECK(Contains(other.out, "committed"));
  // Once root lets its connections go, it connects again.
  idle.clear();
  CHECK(WaitUntil([&] { return d.Ctl({"status"}).exit_code == 0; }, 10s));
}

TEST_CASE("no user reads another's checkpoints, even in ckptd's group; the owner and root do") {
  REQUIRE(::geteuid() == 0);
  // Under /tmp, open to every user: the test's own temporary directory is under /root.
  TempDir dir("/tmp");
  ::chmod(dir.path().c_str(), 0755);
  Daemon d(dir, {"--allow-uid", "1000", "--allow-uid", "1001", "--keep-last", "0"});
  d.Start();
  OpenSocket(d);
  auto save = [&](uint64_t step) {
    auto r = SaveAs(d, dir, 1000, "private", step);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
  };
  save(1);
  // ckptctl where every user may run it (its runfiles are under /root).
  const std::string ckptctl = dir / "ckptctl";
  std::filesystem::copy_file(Runfile("client/ckptctl"), ckptctl);
  ::chmod(ckptctl.c_str(), 0755);
  const std::string shard = ShardPath(d.root() + "/private/step-00000001", 0);
  REQUIRE(std::filesystem::exists(shard));

  // The attacker is in ckptd's group (here root's, gid 0: the daemon runs as root), as every
  // trainer user is in the documented set-up, so that it may reach the socket.
  auto steal = [&](uint64_t step) {
    auto cat = RunAs(1001, "0", {"/bin/cat", ShardPath(d.root() + "/private/step-0000000" + std::to_string(step), 0)},
                     dir.path());
    INFO(cat.err);
    CHECK(cat.exit_code != 0);
    CHECK(Contains(cat.err, "Permission denied"));
    auto out = dir / ("stolen-" + std::to_string(step));
    auto exported = RunAs(1001, "0", {ckptctl, "export", "--root", d.root(), "--job", "private",
                                      std::to_string(step), out, "--format", "full"},
                          dir.path());
    INFO(exported.out << exported.err);
    CHECK(exported.exit_code != 0);
    CHECK(Contains(exported.out + exported.err, "Permission denied"));
    CHECK_FALSE(std::filesystem::exists(out));
    auto list = RunAs(1001, "0", {"/bin/ls", d.root() + "/private"}, dir.path());
    CHECK(list.exit_code != 0);
  };
  steal(1);
  // Nor through ckptd: a manifest (metadata, names, checksums) is the owner's to read.
  for (const char* call : {"show", "verify"}) {
    auto through = RunAs(1001, "0", {ckptctl, "--socket", d.socket(), "--job", "private", call, "1"},
                         dir.path());
    INFO(call << ": " << through.out << through.err);
    CHECK(through.exit_code != 0);
    CHECK(Contains(through.out + through.err, "belongs to uid 1000"));
    CHECK(RunAs(1000, "", {ckptctl, "--socket", d.socket(), "--job", "private", call, "1"}, dir.path())
              .exit_code == 0);
  }
  // Nor its name, steps and sizes: `list` and `status` through ckptd show a user only the
  // jobs it may see.
  auto listed_as = [&](int uid, const std::string& groups) {
    RunResult r = RunAs(uid, groups, {ckptctl, "--socket", d.socket(), "list"}, dir.path());
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    return r.out;
  };
  CHECK_FALSE(Contains(listed_as(1001, "0"), "private"));
  CHECK(Contains(listed_as(1000, ""), "private"));
  CHECK(Contains(d.Ctl({"list"}).out, "private"));  // root
  // Nor in `status` (its jobs, sessions and errors).
  auto status_as = [&](int uid, const std::string& groups) {
    RunResult r = RunAs(uid, groups, {ckptctl, "--socket", d.socket(), "--json", "status"}, dir.path());
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    return r.out;
  };
  CHECK_FALSE(Contains(status_as(1001, "0"), "private"));
  CHECK(Contains(status_as(1000, ""), "private"));
  CHECK(Contains(d.Ctl({"--json", "status"}).out, "private"));

  // The owner reads her own files (not in ckptd's group at all), and exports them.
  auto mine = RunAs(1000, "", {"/bin/cat", shard}, dir.path());
  CHECK(mine.exit_code == 0);
  ::chmod(dir.path().c_str(), 0777);  // where the owner may write her export
  auto exported = RunAs(1000, "", {ckptctl, "export", "--root", d.root(), "--job", "private", "1",
                                   dir / "hers", "--format", "full"},
                        dir.path());
  INFO(exported.out << exported.err);
  CHECK(exported.exit_code == 0);
  CHECK(std::filesystem::exists(dir / "hers"));
  // Root (the operator) too.
  CHECK(Run({ckptctl, "export", "--root", d.root(), "--job", "private", "1", dir / "root-copy",
             "--format", "full"},
            dir.path())
            .exit_code == 0);

  // A job directory left open by an older ckptd is closed again the first time its job is
  // used after a restart, and what is saved later inherits the owner-only access.
  CHECK(d.Stop() == 0);
  MakeLegacy(d.root() + "/private");
  auto open = RunAs(1001, "0", {"/bin/cat", shard}, dir.path());
  CHECK(open.exit_code == 0);  // what the fix closes: readable by ckptd's group
  d.Start();
  steal(1);  // closed at start-up, before anyone uses the job again
  CHECK(RunAs(1000, "", {"/bin/cat", shard}, dir.path()).exit_code == 0);
  OpenSocket(d);
  save(2);
  steal(1);
  steal(2);
  CHECK(RunAs(1000, "", {"/bin/cat", ShardPath(d.root() + "/private/step-00000002", 0)}, dir.path()).exit_code == 0);
}

TEST_CASE("a job directory deleted under a running ckptd comes back with its owner and access") {
  REQUIRE(::geteuid() == 0);
  TempDir dir("/tmp");
  ::chmod(dir.path().c_str(), 0755);
  Daemon d(dir, {"--allow-uid", "1000", "--allow-uid", "1001", "--keep-last", "0"});
  d.Start();
  OpenSocket(d);
  auto save = [&](int uid, uint64_t step) { return SaveAs(d, dir, uid, "gone", step); };
  REQUIRE(save(1000, 1).exit_code == 0);
  std::filesystem::remove_all(d.root() + "/gone");  // an operator's mistake, a cleanup script
  auto again = save(1000, 2);
  INFO(again.out << again.err);
  REQUIRE(again.exit_code == 0);
  CHECK(Contains(d.Log(), "job gone: its directory was deleted under ckptd"));
  CHECK(std::filesystem::exists(d.root() + "/gone/.owner"));
  const std::string shard = ShardPath(d.root() + "/gone/step-00000002", 0);
  CHECK(RunAs(1000, "", {"/bin/cat", shard}, dir.path()).exit_code == 0);
  // Step 2 verifies: nothing it needs went with the directory. (Each save here is a new
  // trainer, so step 2 has no base to reference; increment_test covers a base that is gone.)
  auto verified = d.Ctl({"--job", "gone", "verify", "2"});
  INFO(verified.out << verified.err);
  CHECK(verified.exit_code == 0);
  CHECK(RunAs(1001, "0", {"/bin/cat", shard}, dir.path()).exit_code != 0);
  // After a restart the owner still owns it (it was "no owner on record": locked out).
  CHECK(d.Stop() == 0);
  d.Start();
  OpenSocket(d);
  auto after = save(1000, 3);
  INFO(after.out << after.err);
  CHECK(after.exit_code == 0);
  CHECK(Contains(save(1001, 4).out, "belongs to uid 1000"));
}

TEST_CASE("one user's jobs cannot fill the root: a user's quota refuses that user's next step and no one else's") {
  REQUIRE(::geteuid() == 0);
  TempDir dir;
  // Each step is one 100 kB shard (and its manifest): three of one user's steps fit, four do not.
  const int metrics_port = PickFreePort();
  Daemon d(dir, {"--allow-uid", "1000", "--allow-uid", "1001", "--keep-last", "0", "--user-quota-bytes", "350K",
                 "--job-quota-bytes", "250K", "--metrics-addr", std::to_string(metrics_port)});
  d.Start();
  OpenSocket(d);
  REQUIRE(SaveAs(d, dir, 1000, "a1", 1).exit_code == 0);
  REQUIRE(SaveAs(d, dir, 1000, "a2", 1).exit_code == 0);
  REQUIRE(SaveAs(d, dir, 1000, "a1", 2).exit_code == 0);
  RunResult over = SaveAs(d, dir, 1000, "a2", 2);
  INFO(over.out << over.err);
  CHECK(over.exit_code != 0);
  CHECK(Contains(over.out, "uid 1000"));
  CHECK(Contains(over.out, "--user-quota-bytes"));
  CHECK(Contains(d.Log(), "--user-quota-bytes"));
  // One job alone: its third step would pass the job's own bound.
  RunResult job_over = SaveAs(d, dir, 1000, "a1", 3);
  CHECK(job_over.exit_code != 0);
  CHECK(Contains(job_over.out, "--job-quota-bytes"));

  // The other user is untouched, and what the first user had committed stays.
  CHECK(SaveAs(d, dir, 1001, "b1", 1).exit_code == 0);
  CHECK(SaveAs(d, dir, 1001, "b2", 1).exit_code == 0);
  CHECK(Contains(d.Ctl({"--job", "a1", "list"}).out, "2"));
  CHECK(std::filesystem::exists(d.root() + "/a1/step-00000001"));
  CHECK(std::filesystem::exists(d.root() + "/a2/step-00000001"));
  CHECK_FALSE(std::filesystem::exists(d.root() + "/a2/step-00000002"));
  CHECK_FALSE(std::filesystem::exists(d.root() + "/a2/step-00000002.tmp"));

  // Room made (the owner deletes a step) is seen at the next write.
  REQUIRE(Run(Helper(d, As(1000, {"--job", "a1", "admin-delete", "--step", "1"})), dir.path()).exit_code == 0);
  CHECK(SaveAs(d, dir, 1000, "a2", 2).exit_code == 0);
  const std::string scrape = HttpGet(metrics_port, "/metrics");
  INFO(scrape);
  CHECK(Contains(scrape, "ckptd_failures_total{cause=\"quota\"} 2"));
  // Each user's bytes on the root against the bound, as the quota counts them.
  auto sample = [&](const std::string& series) {
    const size_t at = scrape.find("\n" + series + " ");
    return at == std::string::npos ? -1.0 : std::stod(scrape.substr(at + series.size() + 2));
  };
  const double bound = sample("ckptd_quota_bytes{scope=\"user\"}");
  CHECK(bound >= 350000);
  CHECK(sample("ckptd_quota_bytes{scope=\"job\"}") >= 250000);
  CHECK(sample("ckptd_user_disk_bytes{uid=\"1000\"}") >= 200000);  // a1 step 2, a2 steps 1 and 2
  CHECK(sample("ckptd_user_disk_bytes{uid=\"1000\"}") <= bound);
  CHECK(sample("ckptd_user_disk_bytes{uid=\"1001\"}") >= 200000);
}
