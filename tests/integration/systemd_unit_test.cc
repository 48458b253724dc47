// deploy/systemd/ckptd.service (issue 22 item 2): as hardened as the anchors' units
// (`systemd-analyze security` scores it 2.5 or better), and ckptd works inside it. No system
// manager runs where CI runs, so the unit's restrictions are applied by hand (sandbox_exec:
// the unit's own system-call filter expanded by systemd-analyze, capabilities dropped, an
// unprivileged user, a read-only file system but for its directories, three socket
// families) and two ranks save and restore through a daemon running under them.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "tests/fakes/temp_dir.h"
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

}  // namespace

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
