// ckptctl's exit codes, defined once (as etcdctl defines its own), and the sentence for a
// call that failed: scripts branch on the code, people read the sentence.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace ckpt::ctl {

enum Exit : int {
  kOk = 0,
  kError = 1,        // the request failed: unknown job or step, refused, bad argument value
  kUnreachable = 2,  // ckptd (or the store) did not answer: not running, no access, timed out
  kDamaged = 3,      // data that fails its checks: a damaged or unreadable checkpoint
  kUsage = 64,       // the command line itself (EX_USAGE)
};

// The exit code of a failed gRPC call.
int ExitFor(const grpc::Status& status);
// The exit code of a failed local operation (export, list or verify with --root).
int ExitFor(const absl::Status& status);

// What went wrong, as a sentence that says what to do: "no ckptd listens at /run/ckptd/
// ckptd.sock (the socket does not exist): is ckptd running? (--socket, CKPTD_SOCKET)" rather
// than gRPC's "failed to connect to all addresses; last error: UNKNOWN: unix:...".
// `where` is the socket or address, `seconds` the timeout the call had.
std::string Explain(const grpc::Status& status, const std::string& where, int seconds);

}  // namespace ckpt::ctl
