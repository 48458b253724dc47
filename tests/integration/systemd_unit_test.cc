// deploy/systemd/ckptd.service (issue 22 item 2): as hardened as the anchors' units
// (`systemd-analyze security` scores it 2.5 or better), and ckptd works inside it. No system
// manager runs where CI runs, so the unit's restrictions are applied by hand (sandbox_exec:
// the unit's own system-call filter expanded by systemd-analyze, capabilities dropped, an
// unprivileged user, a read-only file system but for its directories, three socket
// families) and two ranks save and restore through a daemon running under them.
// Issue 47 item 3, a unit that fits hosts as they are: `systemd-analyze verify` has nothing
// to say about it; --allow-gid users reach the socket in its 0750 runtime directory; a root
// the unit leaves read-only fails the start naming the drop-in; and the service manager's
// protocol as a test-owned socket sees it: READY=1, then WATCHDOG=1 while the data path
// answers and none while it is wedged (CKPTD_FAULT=wedge-sessions-while, a test-only fault).
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <algorithm>
#include <cstring>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tests/fakes/temp_dir.h"
#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;

namespace {

constexpr uid_t kNobody = 65534;

std::string UnitPath() { return Runfile("deploy/systemd/ckptd.service"); }

// Every value the unit gives `key`, in order ("" for `Key=`).
std::vector<std::string> UnitValues(const std::string& key) {
  std::ifstream in(UnitPath());
  REQUIRE(in);
  std::vector<std::string> values;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + "=", 0) == 0) values.push_back(line.substr(key.size() + 1));
  }
  return values;
}

// systemd's system-call groups, from `systemd-analyze syscall-filter`: each group's entries
// (system calls, and other groups).
std::map<std::string, std::vector<std::string>> SyscallGroups(const std::string& dir) {
  RunResult r = Run({"/usr/bin/systemd-analyze", "syscall-filter"}, dir);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  std::map<std::string, std::vector<std::string>> groups;
  std::string current;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("@", 0) == 0) {
      current = line.substr(0, line.find_first_of(" \t"));
      continue;
    }
    std::istringstream words(line);
    std::string entry;
    if (!current.empty() && (words >> entry) && entry[0] != '#') groups[current].push_back(entry);
  }
  return groups;
}

void Expand(const std::map<std::string, std::vector<std::string>>& groups, const std::string& item,
            std::set<std::string>& out) {
  if (item[0] != '@') {
    out.insert(item);
    return;
  }
  auto it = groups.find(item);
  REQUIRE(it != groups.end());
  for (const std::string& e : it->second) Expand(groups, e, out);
}

// The system calls the unit allows: its allow lists, less its deny lists (`~`).
std::set<std::string> AllowedSyscalls(const std::string& dir) {
  const auto groups = SyscallGroups(dir);
  std::set<std::string> allowed, denied;
  for (const std::string& value : UnitValues("SystemCallFilter")) {
    const bool deny = !value.empty() && value[0] == '~';
    std::istringstream words(deny ? value.substr(1) : value);
    for (std::string w; words >> w;) Expand(groups, w, deny ? denied : allowed);
  }
  for (const std::string& d : denied) allowed.erase(d);
  return allowed;
}

// The unit's restrictions for a ckptd run as user nobody, writing only `writable`: the argv
// that runs a command under them (its system-call list written into `dir`).
std::vector<std::string> Sandbox(const TempDir& dir, const std::vector<std::string>& writable) {
  const std::string list = dir.path() + "/syscalls";
  {
    std::ofstream out(list);
    for (const std::string& s : AllowedSyscalls(dir.path())) out << s << "\n";
  }
  std::vector<std::string> argv = {Runfile("tests/integration/sandbox_exec"), "--syscalls", list};
  for (const std::string& w : writable) argv.insert(argv.end(), {"--writable", w});
  argv.insert(argv.end(), {"--uid", std::to_string(kNobody), "--gid", std::to_string(kNobody), "--"});
  return argv;
}

// ckptd copied where user nobody may run it (the runfiles are under root's home).
std::string InstalledCkptd(const TempDir& dir) {
  const std::string binary = dir.path() + "/ckptd";
  std::filesystem::copy_file(Runfile("daemon/ckptd"), binary);
  ::chmod(binary.c_str(), 0755);
  return binary;
}

// The service manager's end of $NOTIFY_SOCKET: a datagram socket this test owns.
class NotifySocket {
 public:
  explicit NotifySocket(std::string path) : path_(std::move(path)) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    REQUIRE(path_.size() < sizeof addr.sun_path);
    std::strncpy(addr.sun_path, path_.c_str(), sizeof addr.sun_path - 1);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  }
  ~NotifySocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }

  // The messages that arrive within `window`, or until one contains `until` (when given).
  std::vector<std::string> Receive(std::chrono::milliseconds window, const std::string& until = "") {
    std::vector<std::string> got;
    const auto deadline = std::chrono::steady_clock::now() + window;
    for (auto now = std::chrono::steady_clock::now(); now < deadline; now = std::chrono::steady_clock::now()) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left, 1))) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) continue;
      got.emplace_back(buf, static_cast<size_t>(n));
      if (!until.empty() && Contains(got.back(), until)) break;
    }
    return got;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

size_t CountContaining(const std::vector<std::string>& messages, const std::string& needle) {
  return static_cast<size_t>(std::count_if(messages.begin(), messages.end(),
                                           [&](const std::string& m) { return Contains(m, needle); }));
}

std::string Joined(const std::vector<std::string>& messages) {
  std::string all;
  for (const std::string& m : messages) all += "[" + m + "] ";
  return all;
}

}  // namespace

TEST_CASE("systemd-analyze verify has nothing to say about the shipped unit") {
  // The unit as installed, with ckptd where this test has it (verify checks the commands exist).
  TempDir dir("/tmp");
  std::ifstream in(UnitPath());
  std::stringstream unit;
  unit << in.rdbuf();
  const std::string text = std::regex_replace(unit.str(), std::regex("/usr/bin/ckptd"), Runfile("daemon/ckptd"));
  REQUIRE(text != unit.str());
  const std::string path = dir.path() + "/ckptd.service";
  std::ofstream(path) << text;
  RunResult r = Run({"/usr/bin/systemd-analyze", "verify", path}, dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out + r.err == "");  // an unknown key or a bad value would be reported, not fatal
  REQUIRE(UnitValues("WatchdogSec") == std::vector<std::string>{"60s"});
  REQUIRE(UnitValues("Restart") == std::vector<std::string>{"on-failure"});
}

TEST_CASE("the shipped unit scores 2.5 or better with systemd-analyze security") {
  TempDir dir;
  RunResult r = Run({"/usr/bin/systemd-analyze", "security", "--offline=true", UnitPath()}, dir.path());
  INFO(r.out << r.err);
  std::smatch m;
  const std::string all = r.out + r.err;
  REQUIRE(std::regex_search(all, m, std::regex(R"(Overall exposure level for ckptd\.service: ([0-9.]+))")));
  CHECK(std::stod(m[1]) <= 2.5);
}

TEST_CASE("ckptd saves and restores under the unit's restrictions, and they hold") {
  // What sandbox_exec applies is what the unit says.
  REQUIRE(UnitValues("CapabilityBoundingSet") == std::vector<std::string>{""});
  REQUIRE(UnitValues("NoNewPrivileges") == std::vector<std::string>{"yes"});
  REQUIRE(UnitValues("ProtectSystem") == std::vector<std::string>{"strict"});
  REQUIRE(UnitValues("RestrictAddressFamilies") == std::vector<std::string>{"AF_UNIX AF_INET AF_INET6"});
  REQUIRE(UnitValues("SystemCallErrorNumber") == std::vector<std::string>{"EPERM"});

  TempDir dir("/tmp");  // where the unprivileged user can reach it (not under /root)
  const std::set<std::string> allowed = AllowedSyscalls(dir.path());
  CHECK(allowed.count("memfd_create"));
  CHECK(allowed.count("pidfd_open"));
  CHECK_FALSE(allowed.count("mount"));  // @privileged is denied
  const std::string list = dir.path() + "/syscalls";
  {
    std::ofstream out(list);
    for (const std::string& s : allowed) out << s << "\n";
  }
  // ckptd installed where its user may run it (the runfiles are under root's home).
  const std::string binary = dir.path() + "/ckptd";
  std::filesystem::copy_file(Runfile("daemon/ckptd"), binary);
  ::chmod(binary.c_str(), 0755);
  Daemon d(dir, {}, binary);
  // User=ckptd: an unprivileged user owning only the state and runtime directories.
  REQUIRE(::chown(dir.path().c_str(), kNobody, kNobody) == 0);
  REQUIRE(::chown(d.socket_dir().c_str(), kNobody, kNobody) == 0);
  const std::vector<std::string> sandbox = {Runfile("tests/integration/sandbox_exec"), "--syscalls", list,
                                            "--writable", dir.path(), "--writable", d.socket_dir(),
                                            "--uid", std::to_string(kNobody), "--gid", std::to_string(kNobody),
                                            "--"};
  d.set_wrapper(sandbox);
  d.Start();

  auto run_ranks = [&](const std::vector<std::string>& what, const std::string& expect) {
    std::vector<std::unique_ptr<Process>> ranks;
    for (int rank : {0, 1}) {
      std::vector<std::string> args = {"--job", "unit", "--rank", std::to_string(rank), "--world-size", "2",
                                       "--seed", std::to_string(300 + rank), "--bytes", "3000000"};
      args.insert(args.end(), what.begin(), what.end());
      ranks.push_back(std::make_unique<Process>(Helper(d, args), dir.path(), "rank" + std::to_string(rank)));
    }
    for (auto& r : ranks) {
      int rc = r->Wait();
      INFO(r->Stdout() << r->Stderr() << "\nckptd:\n" << d.Log());
      CHECK(rc == 0);
      CHECK(Contains(r->Stdout(), expect));
    }
  };
  run_ranks({"save", "--step", "5", "--wait-committed"}, "committed");
  run_ranks({"check"}, "restored step=5 source=memory");
  REQUIRE(d.Stop() == 0);
  d.Start();
  run_ranks({"check"}, "restored step=5 source=disk");
  REQUIRE(d.Stop() == 0);
  INFO(d.Log());
  CHECK_FALSE(Contains(d.Log(), "Operation not permitted"));

  // The restrictions are real: nothing is written outside the unit's directories, other
  // socket families and system calls are refused, and the user is not root.
  auto probe = [&](const std::string& script) {
    std::vector<std::string> argv = sandbox;
    argv.insert(argv.end(), {"/bin/sh", "-c", script});
    return Run(argv, dir.path());
  };
  CHECK(probe("echo x > " + dir.path() + "/allowed").exit_code == 0);
  CHECK(probe("echo x > /var/tmp/ckptd-sandbox-probe-$$").exit_code != 0);
  CHECK(probe("test \"$(id -u)\" = 65534").exit_code == 0);
  CHECK(probe("exec /usr/bin/python3 -c 'import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)'").exit_code != 0);
  CHECK(probe("exec /usr/bin/python3 -c 'import socket; socket.socket(socket.AF_INET6, socket.SOCK_STREAM)'").exit_code == 0);
  // ptrace is outside @system-service and needs no capability to trace oneself: only the
  // filter refuses it (PTRACE_TRACEME returns 0 unfiltered).
  CHECK(probe("exec /usr/bin/python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL(None).ptrace(0, 0, 0, 0) != -1)'")
            .exit_code == 0);
  CHECK(Run({"/usr/bin/python3", "-c", "import ctypes, sys; sys.exit(ctypes.CDLL(None).ptrace(0, 0, 0, 0) != 0)"},
            dir.path()).exit_code == 0);
  // Other users' processes (root's, this test's) are not in the sandbox's /proc.
  CHECK(probe("test ! -e /proc/" + std::to_string(::getpid())).exit_code == 0);
}

TEST_CASE("--allow-gid and --allow-uid users reach the socket in the unit's 0750 runtime directory; others do not") {
  // RuntimeDirectory=ckptd is made 0750 ckptd:ckptd: a trainer in an --allow-gid group that
  // is not ckptd's used to stop at the directory ("permission denied").
  REQUIRE(UnitValues("RuntimeDirectoryMode") == std::vector<std::string>{"0750"});
  TempDir dir("/tmp");
  const std::string binary = InstalledCkptd(dir);
  Daemon d(dir, {"--allow-gid", "4242", "--allow-uid", "4100"}, binary);
  REQUIRE(::chown(dir.path().c_str(), kNobody, kNobody) == 0);
  REQUIRE(::chown(d.socket_dir().c_str(), kNobody, kNobody) == 0);
  REQUIRE(::chmod(d.socket_dir().c_str(), 0750) == 0);
  d.set_wrapper(Sandbox(dir, {dir.path(), d.socket_dir()}));
  d.Start();
  const std::string ckptctl = Runfile("client/ckptctl");

  // A trainer of uid 4000 in group 4242 saves and restores through both sockets.
  for (const auto& [what, expect] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"save", "--step", "3", "--wait-committed"}, "committed"}, {{"check"}, "restored step=3"}}) {
    std::vector<std::string> args = {"--job", "allowed", "--seed", "7", "--bytes", "100000"};
    args.insert(args.end(), what.begin(), what.end());
    RunResult r = Run(AsUser(4000, "4242", Helper(d, args)), dir.path());
    INFO(r.out << r.err << "\nckptd:\n" << Tail(d.Log()));
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, expect));
  }
  RunResult by_uid = Run(AsUser(4100, "", {ckptctl, "--socket", d.socket(), "health"}), dir.path());
  INFO(by_uid.out << by_uid.err);
  CHECK(by_uid.exit_code == 0);

  // Everyone else stops where they stopped before: at the directory, which allowed users
  // may enter but not list.
  RunResult other = Run(AsUser(4001, "", {ckptctl, "--socket", d.socket(), "health"}), dir.path());
  INFO(other.out << other.err);
  CHECK(other.exit_code != 0);
  CHECK(Run(AsUser(4001, "", {"/usr/bin/test", "-e", d.socket()}), dir.path()).exit_code != 0);
  CHECK(Run(AsUser(4000, "4242", {"/bin/ls", d.socket_dir()}), dir.path()).exit_code != 0);
  struct stat st;
  REQUIRE(::stat(d.socket().c_str(), &st) == 0);
  CHECK((st.st_mode & 0007) == 0);
  REQUIRE(d.Stop() == 0);
  CHECK_FALSE(Contains(d.Log(), "--allow-uid/--allow-gid:"));  // no ACL was refused
}

TEST_CASE("a root the unit leaves read-only fails the start, naming the drop-in that fixes it") {
  TempDir dir("/tmp"), nvme("/tmp"), sockets("/tmp");
  const std::string binary = InstalledCkptd(dir);
  REQUIRE(::chown(dir.path().c_str(), kNobody, kNobody) == 0);
  REQUIRE(::chown(sockets.path().c_str(), kNobody, kNobody) == 0);
  REQUIRE(::chown(nvme.path().c_str(), kNobody, kNobody) == 0);
  const std::string root = nvme.path() + "/ckptd";
  auto start = [&](const std::vector<std::string>& writable, const std::string& at) {
    std::vector<std::string> argv = Sandbox(dir, writable);
    argv.insert(argv.end(), {binary, "--root", at, "--socket", sockets.path() + "/ckptd.sock", "--staging-bytes",
                             "64M", "--prefault-staging", "false"});
    return Run(argv, dir.path(), std::chrono::seconds(60));
  };
  // ProtectSystem=strict with the unit's ReadWritePaths: /mnt/nvme is read-only (EROFS),
  // whether the root is there already or not.
  for (bool exists : {false, true}) {
    if (exists) {
      REQUIRE(std::filesystem::create_directory(root));
      REQUIRE(::chown(root.c_str(), kNobody, kNobody) == 0);
    }
    RunResult r = start({dir.path(), sockets.path()}, root);
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK(Contains(r.err, "--root " + root + " is on a file system that is read-only to ckptd"));
    CHECK(Contains(r.err, "Read-only file system"));
    CHECK(Contains(r.err, "systemctl edit ckptd"));
    CHECK(Contains(r.err, "[Service]\nReadWritePaths=" + root + "\n"));
  }
  // With the drop-in (the root among the writable paths) it starts and serves.
  std::vector<std::string> argv = Sandbox(dir, {dir.path(), sockets.path(), root});
  argv.insert(argv.end(), {binary, "--root", root, "--socket", sockets.path() + "/ckptd.sock", "--staging-bytes",
                           "64M", "--prefault-staging", "false"});
  {
    Process daemon(argv, dir.path(), "ckptd-writable");
    REQUIRE(WaitUntil([&] { return Run({Runfile("client/ckptctl"), "--socket", sockets.path() + "/ckptd.sock",
                                        "health"}, dir.path()).exit_code == 0; },
                      std::chrono::seconds(30), std::chrono::milliseconds(200)));
    daemon.Signal(SIGTERM);
    CHECK(daemon.Wait() == 0);
  }
  // Writable but not ckptd's: the message says whose it must be.
  const std::string roots = nvme.path() + "/roots";
  REQUIRE(std::filesystem::create_directory(roots));  // root's, 0755
  RunResult r = start({dir.path(), sockets.path(), nvme.path()}, roots);
  INFO(r.out << r.err);
  CHECK(r.exit_code == 1);
  CHECK(Contains(r.err, "--root " + roots + " is not writable by ckptd (uid 65534"));
  CHECK(Contains(r.err, "chown ckptd:ckptd " + roots));
}

TEST_CASE("READY=1, then WATCHDOG=1 while the data path answers, none while it is wedged") {
  TempDir dir("/tmp");
  NotifySocket manager(dir.path() + "/notify");
  const std::string wedge = dir.path() + "/wedge";
  Daemon d(dir);
  // WatchdogSec=1s: a ping every 500 ms. The fault holds the session registry's lock while
  // `wedge` exists, as a deadlocked thread would: the process lives, the data path does not.
  d.set_wrapper({"/usr/bin/env", "NOTIFY_SOCKET=" + manager.path(), "WATCHDOG_USEC=1000000",
                 "CKPTD_FAULT=wedge-sessions-while:" + wedge});
  d.Start();
  std::vector<std::string> got = manager.Receive(Stretched(std::chrono::seconds(20)), "READY=1");
  INFO(Joined(got) << "\nckptd:\n" << Tail(d.Log()));
  REQUIRE(CountContaining(got, "READY=1") == 1);

  // Periodic pings while it serves; a trainer saves meanwhile.
  RunResult saved = Run(Helper(d, {"--job", "dog", "--bytes", "100000", "save", "--step", "1", "--wait-committed"}),
                        dir.path());
  CHECK(saved.exit_code == 0);
  size_t pings = 0;
  const auto until = std::chrono::steady_clock::now() + Stretched(std::chrono::seconds(20));
  while (pings < 4 && std::chrono::steady_clock::now() < until) {
    pings += CountContaining(manager.Receive(std::chrono::milliseconds(500)), "WATCHDOG=1");
  }
  CHECK(pings >= 4);

  // Wedged: the pings stop, and STATUS= says which probe has not returned.
  std::ofstream(wedge).close();
  got = manager.Receive(Stretched(std::chrono::seconds(20)), "the sessions probe has not returned");
  INFO(Joined(got) << "\nckptd:\n" << Tail(d.Log()));
  REQUIRE(CountContaining(got, "STATUS=watchdog: no progress on the data path") >= 1);
  got = manager.Receive(std::chrono::seconds(3));  // six intervals
  INFO(Joined(got));
  CHECK(CountContaining(got, "WATCHDOG=1") == 0);
  CHECK(CountContaining(got, "the sessions probe has not returned") >= 2);
  CHECK(::kill(d.pid(), 0) == 0);  // a live process, withheld pings: what systemd restarts
  CHECK(Contains(d.Log(), "WATCHDOG=1 withheld"));

  // Unwedged: the pings come back, and the daemon serves again.
  std::filesystem::remove(wedge);
  got = manager.Receive(Stretched(std::chrono::seconds(20)), "WATCHDOG=1");
  INFO(Joined(got));
  CHECK(CountContaining(got, "WATCHDOG=1\nSTATUS=serving: the data path answers again") == 1);
  saved = Run(Helper(d, {"--job", "dog", "--bytes", "100000", "save", "--step", "2", "--wait-committed"}), dir.path());
  CHECK(saved.exit_code == 0);
  REQUIRE(d.Stop() == 0);
  CHECK(CountContaining(manager.Receive(std::chrono::milliseconds(500), "STOPPING=1"), "STOPPING=1") == 1);
}
