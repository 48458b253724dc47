// Passing file descriptors between processes over a Unix socket (SCM_RIGHTS): how a
// trainer hands ckptd a shareable handle of memory that CUDA IPC cannot export (CUDA's
// virtual memory API, PyTorch's expandable segments).
#pragma once

#include <chrono>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace ckpt {

inline constexpr size_t kMaxPassedFds = 64;

// Sends `payload` (at least one byte) with `fds` attached.
absl::Status SendFds(int socket, std::span<const int> fds, std::string_view payload);

struct ReceivedFds {
  std::string payload;
  std::vector<UniqueFd> fds;
};

// Receives one message of at most `max_payload` bytes and `max_fds` descriptors. More
// descriptors than that, or a cut message, is an error (the extra fds are closed). With
// `on_error`, the descriptors that did arrive with a refused message are moved there
// instead of closed here (closing an untrusted descriptor can block: see FdReaper).
absl::StatusOr<ReceivedFds> RecvFds(int socket, size_t max_fds, size_t max_payload,
                                    std::vector<UniqueFd>* on_error = nullptr);

// Connects to the Unix socket at `path`, sends `request` with `send` attached and receives
// the answer (at most `max_fds` descriptors and 4 KiB of text): how a trainer hands ckptd
// its arenas and asks for its control block. An answer of kBusy is retried, with backoff,
// for up to `timeout` (a node's ranks of one user register at once; ckptd serves a few
// connections per user at a time). Gives up after `timeout` in all (Unavailable), also when
// ckptd accepted the connection and stalled.
absl::StatusOr<ReceivedFds> RequestFds(const std::string& path, std::string_view request,
                                       size_t max_fds, std::span<const int> send = {},
                                       std::chrono::milliseconds timeout = std::chrono::seconds(10));

// ckptd's descriptor socket, beside the trainers' gRPC socket (gRPC cannot carry
// descriptors). One request per connection, the first message; the answer is one message.
inline std::string DescriptorSocketPath(const std::string& socket) { return socket + ".ctl"; }
// "control <session id>": the session's control block (one descriptor), or a line why not.
inline constexpr std::string_view kFetchControlBlock = "control ";
// "arenas" with 1..kMaxPassedFds sealed memfds attached: "ok <token>" (the token goes into
// RegisterRequest.arena_tokens), or a line why not.
inline constexpr std::string_view kDepositArenas = "arenas";
inline constexpr std::string_view kDepositAccepted = "ok ";
// "write-protect" with one userfaultfd attached: "ok <token>" (for
// RegisterRequest.write_protect_token), or a line why not.
inline constexpr std::string_view kDepositWriteProtect = "write-protect";
// "payload" with one sealed memfd attached, holding a snapshot's payload (shm/payload.h)
// too large for a ring slot: "ok <token>" (for a kCommandSnapshotDeposited command).
inline constexpr std::string_view kDepositPayload = "payload";
// "train-state <session id>": the train state of the session's last restore, as a sealed
// memfd (one descriptor), when RestoreReply.train_state_deposited says it did not fit in
// the reply; or a line why not.
inline constexpr std::string_view kFetchTrainState = "train-state ";
// The answer to a request that came while too many of its user's were being served.
inline constexpr std::string_view kBusy = "busy: ";

}  // namespace ckpt
