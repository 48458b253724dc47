#include "tests/integration/harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

namespace ckpt::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool SocketAnswers(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

std::string Runfile(const std::string& rel) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir && workspace) return std::string(srcdir) + "/" + workspace + "/" + rel;
  return rel;
}

Process::Process(std::vector<std::string> argv, const std::string& dir, const std::string& tag) {
  static int counter = 0;
  std::string base = dir + "/" + tag + "." + std::to_string(counter++);
  out_path_ = base + ".out";
  err_path_ = base + ".err";
  pid_ = ::fork();
  REQUIRE(pid_ >= 0);
  if (pid_ == 0) {
    int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::perror("execv");
    _exit(127);
  }
}

Process::~Process() {
  if (Running()) {
    Signal(SIGKILL);
    Wait(std::chrono::seconds(10));
  }
}

bool Process::Running() {
  if (status_ != -1) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

int Process::Wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + Stretched(timeout);  // longer under TSan, or loaded
  while (Running()) {
    if (std::chrono::steady_clock::now() > deadline) {
      Signal(SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      status_ = 128 + SIGKILL;
      FAIL("process " << pid_ << " (" << out_path_ << ") did not finish in time; stdout:\n"
           << Stdout() << "\nstderr:\n" << Stderr());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return status_;
}

void Process::Signal(int sig) {
  if (status_ == -1) ::kill(pid_, sig);
}

std::string Process::Stdout() const { return ReadFile(out_path_); }
std::string Process::Stderr() const { return ReadFile(err_path_); }

bool Process::WaitForStdout(const std::string& needle, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + Stretched(timeout);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Stdout().find(needle) != std::string::npos) return true;
    if (!Running()) return Stdout().find(needle) != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

std::vector<std::string> AsUser(int uid, const std::string& groups, std::vector<std::string> argv) {
  std::vector<std::string> full = {"/usr/bin/setpriv", "--reuid", std::to_string(uid), "--regid", std::to_string(uid)};
  if (groups.empty()) {
    full.push_back("--clear-groups");
  } else {
    full.insert(full.end(), {"--groups", groups});
  }
  full.push_back("--");
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

RunResult Run(std::vector<std::string> argv, const std::string& dir,
              std::chrono::milliseconds timeout) {
  Process p(std::move(argv), dir, "run");
  RunResult r;
  r.exit_code = p.Wait(timeout);
  r.out = p.Stdout();
  r.err = p.Stderr();
  return r;
}

Daemon::Daemon(const TempDir& dir, std::vector<std::string> extra_flags, std::string binary)
    : dir_(dir), flags_(std::move(extra_flags)), binary_(std::move(binary)), socket_(socket_dir_ / "ckptd.sock"),
      root_(dir / "root") {}

Daemon::~Daemon() {
  if (process_ && process_->Running()) Kill();
}

void Daemon::Start() {
  std::vector<std::string> argv = {binary_.empty() ? Runfile("daemon/ckptd") : binary_, "--root", root_, "--socket", socket_,
                                   "--staging-bytes", "512M", "--prefault-staging", "false",
                                   "--log-level", "debug"};
  argv.insert(argv.end(), flags_.begin(), flags_.end());
  argv.insert(argv.begin(), wrapper_.begin(), wrapper_.end());
  process_ = std::make_unique<Process>(argv, dir_.path(), "ckptd" + std::to_string(starts_++));
  auto deadline = std::chrono::steady_clock::now() + Stretched(std::chrono::seconds(20));
  while (!SocketAnswers(socket_)) {
    if (!process_->Running()) FAIL("ckptd exited at start:\n" << process_->Stderr());
    if (std::chrono::steady_clock::now() > deadline) FAIL("ckptd did not start:\n" << process_->Stderr());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string Tail(const std::string& text, size_t n) {
  return text.size() <= n ? text : "..." + text.substr(text.size() - n);
}

int Daemon::Stop() {
  process_->Signal(SIGTERM);
  const int rc = process_->Wait(std::chrono::seconds(60));
  // What it said last (a sanitizer's report is written as it exits) goes with the check of
  // its exit code.
  if (rc != 0) UNSCOPED_INFO("ckptd exited with " << rc << "; the end of its log:\n" << Tail(Log(), 12000));
  return rc;
}

void Daemon::Kill() {
  process_->Signal(SIGKILL);
  process_->Wait(std::chrono::seconds(10));
}

void Daemon::Signal(int sig) { process_->Signal(sig); }

std::string Daemon::Log() const { return process_ ? process_->Stderr() : ""; }

RunResult Daemon::Ctl(std::vector<std::string> args) const {
  std::vector<std::string> argv = {Runfile("client/ckptctl"), "--socket", socket_};
  argv.insert(argv.end(), args.begin(), args.end());
  return Run(argv, dir_.path());
}

}  // namespace ckpt::testing
