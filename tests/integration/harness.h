// Real processes for integration tests: ckptd, trainers and ckptctl started from the
// Bazel runfiles, each with a private temp root and socket, output captured to files.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "tests/fakes/sanitizer_slowdown.h"
#include "tests/fakes/temp_dir.h"

namespace ckpt::testing {

// Absolute path of a runfile, e.g. Runfile("daemon/ckptd").
std::string Runfile(const std::string& workspace_relative);

// The last `n` bytes of a log, "..." before them when something was cut: what a failure
// shows of a daemon's log.
std::string Tail(const std::string& text, size_t n = 6000);

class Process {
 public:
  // Starts argv[0] with stdout and stderr sent to files under `dir`.
  Process(std::vector<std::string> argv, const std::string& dir, const std::string& tag);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Exit code, or 128+signal; kills the process and fails the wait after `timeout` (stretched:
  // Stretched, sanitizer_slowdown.h).
  int Wait(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  void Signal(int sig);
  bool Running();
  pid_t pid() const { return pid_; }
  std::string Stdout() const;
  std::string Stderr() const;
  // Waits until stdout contains `needle`; false on timeout or exit without it.
  bool WaitForStdout(const std::string& needle,
                     std::chrono::milliseconds timeout = std::chrono::seconds(30));

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  std::string out_path_, err_path_;
};

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// `argv` run as `uid` (gid the same) with `groups` as its supplementary groups ("" for none,
// "4242,4243" for two), as a user logged in on the node would: through setpriv.
std::vector<std::string> AsUser(int uid, const std::string& groups, std::vector<std::string> argv);

// Runs to completion.
RunResult Run(std::vector<std::string> argv, const std::string& dir,
              std::chrono::milliseconds timeout = std::chrono::seconds(120));

// A ckptd on a private root and socket.
class Daemon {
 public:
  // `binary`: another ckptd than the runfile daemon/ckptd (a copy a sandboxed user may run).
  explicit Daemon(const TempDir& dir, std::vector<std::string> extra_flags = {}, std::string binary = "");
  ~Daemon();

  void Start();  // and wait until the socket answers
  int Stop();    // SIGTERM; returns the exit code
  void Kill();   // SIGKILL
  void Signal(int sig);  // e.g. SIGSTOP and SIGCONT: a daemon that stalls
  pid_t pid() const { return process_ ? process_->pid() : -1; }
  const std::string& socket() const { return socket_; }
  const std::string& root() const { return root_; }
  // Another --root than <dir>/root (a shared file system), for the next Start().
  void set_root(std::string root) { root_ = std::move(root); }
  // A command that runs ckptd (its argv follows), for the next Start(): a sandbox.
  void set_wrapper(std::vector<std::string> wrapper) { wrapper_ = std::move(wrapper); }
  const std::string& socket_dir() const { return socket_dir_.path(); }
  std::string Log() const;

  // ckptctl against this daemon.
  RunResult Ctl(std::vector<std::string> args) const;

 private:
  const TempDir& dir_;
  TempDir socket_dir_{"/tmp"};  // unique, but short enough for sun_path
  std::vector<std::string> flags_;
  std::vector<std::string> wrapper_;
  std::string binary_;
  std::string socket_, root_;
  std::unique_ptr<Process> process_;
  int starts_ = 0;
};

}  // namespace ckpt::testing
