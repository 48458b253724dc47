// The group's part of ckptd's configuration (docs/operators.md, "Multi-node").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ckpt::group {

struct GroupOptions {
  uint32_t node_rank = 0;
  uint32_t num_nodes = 1;                // 1: no group, single-node commit
  std::string coordinator;               // HOST:PORT of node 0's group server
  std::string listen_addr;               // HOST:PORT this node's group server binds
  std::string token;                     // shared secret, read from --group-token-file
  std::string tls_cert_pem, tls_key_pem, tls_ca_pem;  // all three, or none (plaintext)
  std::chrono::milliseconds group_timeout{10'000};   // silent this long: a member is lost
  std::chrono::milliseconds step_timeout{300'000};   // a step still missing ranks aborts
  std::chrono::milliseconds rpc_timeout{5'000};      // per call, beside long polls
  // Heartbeats, prepares and outcome polls go through a tree of this fan-out
  // (relay_tree.h); 0: every node calls the coordinator.
  uint32_t relay_fanout = 32;
  std::string failure_domain;  // --failure-domain, sent when joining
  // A part whose manifest text is larger than this goes to the coordinator in chunks of
  // `structure_chunk_bytes` before its prepare (gRPC messages are capped at 64 MiB, and a
  // relay's batches at 16 MiB). Settings for tests; operators have no flag for them.
  size_t inline_part_bytes = size_t{8} << 20;
  size_t structure_chunk_bytes = size_t{4} << 20;
  // On a shared root, a step whose whole manifest is larger than this is published as an
  // index and a part per node (format/indexed_manifest.h): what a reader loads at most.
  // Lowered by tests (CKPTD_TEST_MAX_WHOLE_MANIFEST_BYTES) to publish small steps so.
  size_t max_whole_manifest_bytes = size_t{64} << 20;

  bool enabled() const { return num_nodes > 1; }
  bool coordinator_role() const { return enabled() && node_rank == 0; }
  bool tls() const { return !tls_cert_pem.empty(); }
};

}  // namespace ckpt::group
