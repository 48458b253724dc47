// Runs a command under the restrictions of deploy/systemd/ckptd.service, applied by hand
// where no system manager runs (CI, containers): what systemd would do for the unit, so
// that a test proves ckptd works inside it.
//
//   sandbox_exec --syscalls FILE [--writable DIR]... [--uid N --gid N] -- COMMAND...
//
// In order: a mount namespace whose root file system is read-only but for the --writable
// directories (ProtectSystem=strict + ReadWritePaths) and whose /proc shows only the user's
// own processes (ProtectProc=invisible); every capability dropped from the
// bounding set and, with --uid/--gid, an unprivileged user (User=, Group=,
// CapabilityBoundingSet=); no new privileges (NoNewPrivileges=); a seccomp filter that
// allows the system calls named in FILE, one per line, and fails every other with EPERM
// (SystemCallFilter=, SystemCallErrorNumber=EPERM), and sockets of the families Unix, IPv4
// and IPv6 only (RestrictAddressFamilies=).
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "sandbox_exec: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(125);
}

void ReadOnlyRootExcept(const std::vector<std::string>& writable) {
  if (::unshare(CLONE_NEWNS) != 0) Die("unshare(CLONE_NEWNS)");
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) Die("make / private");
  // Each writable directory becomes a mount of its own first, so that the read-only
  // remount of / below leaves it as it is.
  for (const std::string& dir : writable) {
    if (::mount(dir.c_str(), dir.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) Die("bind " + dir);
  }
  if (::mount(nullptr, "/", nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY, nullptr) != 0) Die("remount / read-only");
  // ProtectProc=invisible: other users' processes are not in /proc.
  if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible") != 0) {
    Die("mount /proc with hidepid=invisible");
  }
}

void DropPrivileges(long uid, long gid) {
  for (int cap = 0; cap <= CAP_LAST_CAP; ++cap) {
    if (::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) Die("drop capability");
  }
  if (gid >= 0 && (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0)) Die("setgid");
  if (uid >= 0 && ::setresuid(uid, uid, uid) != 0) Die("setuid");
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) Die("no_new_privs");
}

std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  if (!in) Die("open " + path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

void FilterSyscalls(const std::vector<std::string>& names) {
  scmp_filter_ctx ctx = ::seccomp_init(SCMP_ACT_ERRNO(EPERM));
  if (ctx == nullptr) Die("seccomp_init");
  int allowed = 0;
  for (const std::string& name : names) {
    if (name.empty() || name == "socket") continue;
    int nr = ::seccomp_syscall_resolve_name(name.c_str());
    if (nr == __NR_SCMP_ERROR) continue;  // another architecture's, or unknown to libseccomp
    if (::seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0) == 0) ++allowed;
  }
  for (int family : {AF_UNIX, AF_INET, AF_INET6}) {
    if (::seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(socket), 1, SCMP_A0(SCMP_CMP_EQ, family)) != 0) {
      Die("seccomp socket rule");
    }
  }
  if (allowed < 100) {
    errno = EINVAL;
    Die("only " + std::to_string(allowed) + " system calls allowed");
  }
  if (::seccomp_load(ctx) != 0) Die("seccomp_load");
  ::seccomp_release(ctx);
}

}  // namespace

int main(int argc, char** argv) {
  std::string syscalls;
  std::vector<std::string> writable;
  long uid = -1, gid = -1;
  int i = 1;
  for (; i < argc && std::strcmp(argv[i], "--") != 0; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) break;
    if (flag == "--syscalls") {
      syscalls = argv[++i];
    } else if (flag == "--writable") {
      writable.push_back(argv[++i]);
    } else if (flag == "--uid") {
      uid = std::strtol(argv[++i], nullptr, 10);
    } else if (flag == "--gid") {
      gid = std::strtol(argv[++i], nullptr, 10);
    } else {
      break;
    }
  }
  if (i >= argc || std::strcmp(argv[i], "--") != 0 || i + 1 >= argc || syscalls.empty()) {
    std::fprintf(stderr, "usage: sandbox_exec --syscalls FILE [--writable DIR]... [--uid N --gid N] -- COMMAND...\n");
    return 64;
  }
  const std::vector<std::string> names = ReadLines(syscalls);  // while it may still be read
  ReadOnlyRootExcept(writable);
  DropPrivileges(uid, gid);
  FilterSyscalls(names);
  ::execv(argv[i + 1], argv + i + 1);
  Die(std::string("exec ") + argv[i + 1]);
}
