// ckptd's one typed configuration: parsed from flags once, validated once
// (`ckptd --check-config`), logged at start and returned by `ckptctl status`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::daemon {

enum class WhenBusy { kSkip, kWait };
enum class RemoteMode { kTiered, kDirect };

struct Config {
  std::string root = "/var/lib/ckptd";
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string admin_addr;              // empty: admin only on the Unix socket
  bool admin_allow_remote = false;     // allow a non-loopback --admin-addr
  // Holds the token that destructive admin calls over --admin-addr must carry; empty:
  // they are refused over TCP (the Unix socket, where peers are checked, still allows them).
  std::string admin_token_file;
  // Prometheus metrics at http://HOST:PORT/metrics; empty: none. "PORT" or ":PORT" mean
  // 127.0.0.1:PORT (ParseFlags writes it so).
  std::string metrics_addr;
  uint64_t staging_bytes = 4ull << 30;
  uint64_t staging_chunk_bytes = 128ull << 20;  // per copy call; writing follows chunk by chunk
  bool prefault_staging = true;
  uint32_t keep_last = 3;              // 0 keeps everything
  // Bytes of checkpoints on --root per owning uid and per job (persist/disk_quota.h); 0: none.
  uint64_t user_quota_bytes = 0;
  uint64_t job_quota_bytes = 0;
  uint64_t keep_every = 0;
  // --increments on: steps written in format version 5, unchanged chunks referenced where an
  // earlier step wrote them (docs/design/incremental.md), on every tier.
  bool increments = true;
  uint64_t increment_chunk_bytes = uint64_t{4} << 20;  // --increment-chunk-bytes
  uint32_t full_every = 20;                            // --full-every (saves; 0: never)
  // Every N-th snapshot of a session copies its frozen tensors from the trainer again and
  // compares them with ckptd's copy (0: never; docs/python.md, "Frozen parameters").
  uint32_t frozen_check_every = 20;
  int io_threads = 2;
  int copy_threads = 2;
  WhenBusy when_busy = WhenBusy::kSkip;
  uint32_t busy_wait_ms = 30000;
  uint32_t shutdown_timeout_ms = 30000;
  std::vector<uint32_t> allow_uids;    // beside the daemon's own uid and root
  // Open connections to the trainer socket per uid; beyond, new ones are closed at once.
  uint32_t max_connections_per_uid = 1024;
  std::vector<uint32_t> allow_gids;    // beside the daemon's own gid
  // Members of these groups share the jobs any of them creates (otherwise a job is its
  // creator's uid's alone).
  std::vector<uint32_t> job_gids;
  // GPU buffers shared through CUDA IPC handles. A handle is a bearer capability (the driver
  // does not say which process exported an allocation): a node whose users do not trust each
  // other turns this off, and trainers stage GPU tensors through host mirrors in their
  // arenas (CKPTD_CUDA_TRANSPORT=host-copy), which only the trainer can hand over.
  bool cuda_ipc = true;
  std::string log_level = "info";

  // The group (docs/operators.md, "Several nodes"). num_nodes 1: no group.
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;
  std::string coordinator;           // HOST:PORT of node 0's group server
  std::string group_addr;            // HOST:PORT this node's group server binds
  std::string group_token_file;      // the shared secret (required with num_nodes > 1)
  bool shared_root = false;          // --root is one filesystem shared by every node
  std::string group_tls_cert, group_tls_key, group_tls_ca;  // mutual TLS: all three or none
  uint32_t group_timeout_ms = 10'000;   // a member silent this long is lost
  uint32_t step_timeout_ms = 300'000;   // a step still missing ranks this long is aborted
  uint32_t restore_timeout_ms = 300'000;  // ranks wait this long for each other at restore
  // Heartbeats, prepares and outcome polls go up a tree of this fan-out (0: to node 0).
  uint32_t group_relay_fanout = 32;
  // Peer replicas (docs/operators.md, "Peer replicas"): each node's staged shards go to the
  // other members of its coding group as k data and m parity fragments. 0: off.
  uint32_t replication_k = 0;
  uint32_t replication_m = 0;
  uint64_t replica_bytes = 0;  // what this node holds of its peers' fragments; 0: --staging-bytes
  std::string failure_domain;  // a rack or topology zone: no two fragments of a node in one
  // The restores' TCP fetch channel: its port on the group address's host (0: any free
  // one, -1: none, fragments fetched over gRPC).
  int32_t replica_fetch_port = 0;
  // The remote tier (docs/operators.md, "Off the node"): an s3://bucket/prefix URL.
  // Tiered: the local root commits as always and committed steps are uploaded behind it.
  // Direct: the checkpoints themselves are written to the remote store; --root keeps only
  // the daemon's lock and the group's decisions.
  std::string remote;
  RemoteMode remote_mode = RemoteMode::kTiered;
  std::string s3_endpoint;          // empty: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
  std::string s3_credentials_file;  // mode 0600; empty: the AWS SDKs' places
  uint64_t upload_every_steps = 1;  // upload committed steps whose number is a multiple of N
  uint32_t upload_interval_ms = 0;  // and at most the first step of each such window; 0: off
  uint32_t upload_wait_ms = 1'800'000;  // the coordinator waits this long for every node's part
  uint32_t remote_keep_last = 0;    // 0 keeps every uploaded step
  uint64_t remote_keep_every = 0;
  bool check_config = false;

  std::string ToJson() const;
};

// Parses argv (CLI11). Returns the config, or an error whose message is the usage text or
// the problem; `exit_code` is set when the process should exit (help, version, errors).
struct ParseResult {
  Config config;
  bool exit = false;
  int exit_code = 0;
  std::string message;
};
ParseResult ParseFlags(int argc, char** argv);

// Checks ranges and combinations; the message names the flag.
absl::Status Validate(const Config& config);

// "500ms", "3s", "2m", "1h"; a bare number is seconds. InvalidArgument otherwise.
absl::StatusOr<uint32_t> ParseDurationMs(const std::string& text);

// "2+1", "4+2": --replication's K data and M parity fragments. InvalidArgument otherwise.
absl::StatusOr<std::pair<uint32_t, uint32_t>> ParseReplication(const std::string& text);

// "4G" -> 4 GiB, "512M", "1048576"; InvalidArgument otherwise.
absl::StatusOr<uint64_t> ParseBytes(const std::string& text);

inline constexpr char kVersion[] = "0.1.0";

}  // namespace ckpt::daemon
