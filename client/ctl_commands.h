// ckptctl's commands against a running ckptd (its admin service, and gRPC health), and the
// output every command shares: a table or JSON (one schema per command, numbers as
// numbers), errors as a sentence on stderr or, under --json, as {"error": ...} on stdout,
// and the exit codes of client/ctl_exit.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "client/progress_bar.h"
#include "proto/admin.grpc.pb.h"

namespace ckpt::ctl {

struct Options {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string addr;
  std::string token_file;
  std::string token;  // read from token_file
  std::string job;
  bool json = false;
  std::optional<uint64_t> step;
  // list and verify straight from the files (no daemon): a root or s3://bucket/prefix.
  std::string root;
  std::string s3_endpoint;
  std::string s3_credentials_file;
  std::string service;  // health: "" (ready), ckptd.v1.Trainer (the same), ckptd.v1.Admin (alive)
  double dial_timeout_s = 2;  // connecting to ckptd
  double timeout_s = 0;       // each call (and all of wait); 0: the command's own default
  bool progress = true;       // wait: a line per change on stderr; verify: a bar on a terminal
  bool progress_lines = false;  // verify: progress lines on stderr even when not a terminal
  bool ready = false;           // wait: for the daemon to be ready, not for a step

  std::string Where() const { return addr.empty() ? socket : addr; }
};

// Says what went wrong the way --json asks (stdout, {"error": {...}}) or not (stderr), and
// returns `exit_code`.
int Report(const Options& o, const std::string& command, int exit_code, const std::string& sentence);

class Commands {
 public:
  explicit Commands(const Options& o);

  int Status();
  int List();
  int Show();
  int Verify();
  int Delete();
  int Health();
  // Blocks until STEP (or, without it, a step newer than the latest now) of the job is
  // committed: 0; 1 when it failed; 2 after --timeout. A line per change on stderr.
  int Wait();
  // Blocks until the ckptd at --socket (or --addr) is there and ready (joined to its group):
  // 0; 2 after --timeout, naming what it last saw. A line per change on stderr.
  int WaitReady();
  // The checkpoint root of the ckptd at --socket, if one answers (export reads its files).
  std::optional<std::string> Root();

  // Printing shared with the commands that read files directly (--root).
  static int PrintList(const ::ckptd::v1::ListReply& r, const Options& o);
  // verify's progress on stderr, as the options ask: lines (--progress), a bar on a terminal,
  // or none (--no-progress, --json).
  static std::optional<ProgressBar> VerifyProgress(const Options& o);
  static int PrintVerify(const ::ckptd::v1::VerifyReply& r, const std::string& job, uint64_t step,
                         const Options& o);

 private:
  // Waits up to --dial-timeout for a connection; a sentence saying why not otherwise.
  std::optional<std::string> Connect();
  std::unique_ptr<grpc::ClientContext> Context(double default_s);
  // The exit code and sentence of a failed call.
  int Failed(const std::string& command, const grpc::Status& s, double seconds);
  // --job, or the only job ckptd holds.
  std::optional<std::string> Job(const std::string& command, int* exit_code);
  // The checkpoint show, verify and delete name: connected, --job (or the only one), STEP.
  std::optional<::ckptd::v1::CheckpointRef> Ref(const std::string& command, int* exit_code);

  const Options& o_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<::ckptd::v1::Admin::Stub> stub_;
};

}  // namespace ckpt::ctl
