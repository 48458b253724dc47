#include "daemon/config.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cctype>
#include <sstream>
#include <string_view>
#include <tuple>
#include <nlohmann/json.hpp>

#include "common/log.h"

namespace ckpt::daemon {

absl::StatusOr<uint64_t> ParseBytes(const std::string& text) {
  size_t pos = 0;
  uint64_t value = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
    if (value > (UINT64_MAX - 9) / 10) return absl::InvalidArgumentError("byte count too large");
    value = value * 10 + static_cast<uint64_t>(text[pos++] - '0');
  }
  if (pos == 0) return absl::InvalidArgumentError(fmt::format("\"{}\" is not a byte count", text));
  std::string suffix = text.substr(pos);
  int shift = 0;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else if (suffix == "K" || suffix == "KiB") {
    shift = 10;
  } else if (suffix == "M" || suffix == "MiB") {
    shift = 20;
  } else if (suffix == "G" || suffix == "GiB") {
    shift = 30;
  } else if (suffix == "T" || suffix == "TiB") {
    shift = 40;
  } else {
    return absl::InvalidArgumentError(
        fmt::format("\"{}\": unknown size suffix \"{}\" (use K, M, G or T)", text, suffix));
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) {
    return absl::InvalidArgumentError(fmt::format("\"{}\" is too large", text));
  }
  return value << shift;
}

absl::StatusOr<uint32_t> ParseDurationMs(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    return absl::InvalidArgumentError(fmt::format("\"{}\" is not a duration", text));
  }
  std::string unit = text.substr(pos);
  double ms = 0;
  if (unit.empty() || unit == "s") {
    ms = value * 1000;
  } else if (unit == "ms") {
    ms = value;
  } else if (unit == "m") {
    ms = value * 60'000;
  } else if (unit == "h") {
    ms = value * 3'600'000;
  } else {
    return absl::InvalidArgumentError(
        fmt::format("\"{}\": unknown duration unit \"{}\" (use ms, s, m or h)", text, unit));
  }
  if (!(ms >= 1) || ms > 24 * 3'600'000.0) {
    return absl::InvalidArgumentError(fmt::format("\"{}\" is not between 1ms and 24h", text));
  }
  return static_cast<uint32_t>(ms);
}

std::string Config::ToJson() const {
  nlohmann::json j = {{"root", root},
                      {"socket", socket},
                      {"admin_addr", admin_addr},
                      {"admin_allow_remote", admin_allow_remote},
                      {"admin_token_file", admin_token_file},
                      {"metrics_addr", metrics_addr},
                      {"staging_bytes", staging_bytes},
                      {"staging_chunk_bytes", staging_chunk_bytes},
                      {"prefault_staging", prefault_staging},
                      {"keep_last", keep_last},
                      {"user_quota_bytes", user_quota_bytes},
                      {"job_quota_bytes", job_quota_bytes},
                      {"keep_every", keep_every},
                      {"io_threads", io_threads},
                      {"copy_threads", copy_threads},
                      {"when_busy", when_busy == WhenBusy::kSkip ? "skip" : "wait"},
                      {"busy_wait_ms", busy_wait_ms},
                      {"shutdown_timeout_ms", shutdown_timeout_ms},
                      {"allow_uids", allow_uids},
                      {"max_connections_per_uid", max_connections_per_uid},
                      {"allow_gids", allow_gids},
                      {"job_gids", job_gids},
                      {"cuda_ipc", cuda_ipc},
                      {"log_level", log_level},
                      {"node_rank", node_rank},
                      {"num_nodes", num_nodes},
                      {"coordinator", coordinator},
                      {"group_addr", group_addr},
                      {"group_token_file", group_token_file},
                      {"shared_root", shared_root},
                      {"group_tls", !group_tls_cert.empty()},
                      {"group_timeout_ms", group_timeout_ms},
                      {"step_timeout_ms", step_timeout_ms},
                      {"restore_timeout_ms", restore_timeout_ms},
                      {"group_relay_fanout", group_relay_fanout},
                      {"replication", replication_k == 0 ? "" : fmt::format("{}+{}", replication_k, replication_m)},
                      {"replica_bytes", replica_bytes},
                      {"failure_domain", failure_domain},
                      {"replica_fetch_port", replica_fetch_port},
                      {"increments", increments},
                      {"increment_chunk_bytes", increment_chunk_bytes},
                      {"full_every", full_every},
                      {"frozen_check_every", frozen_check_every},
                      {"remote", remote},
                      {"remote_mode", remote_mode == RemoteMode::kDirect ? "direct" : "tiered"},
                      {"s3_endpoint", s3_endpoint},
                      {"s3_credentials_file", s3_credentials_file},
                      {"upload_every_steps", upload_every_steps},
                      {"upload_interval_ms", upload_interval_ms},
                      {"upload_wait_ms", upload_wait_ms},
                      {"remote_keep_last", remote_keep_last},
                      {"remote_keep_every", remote_keep_every},
                      {"version", kVersion}};
  return j.dump();
}

ParseResult ParseFlags(int argc, char** argv) {
  ParseResult result;
  Config& c = result.config;
  CLI::App app{"ckptd: per-node checkpoint daemon for GPU training"};
  // The last value of a repeated flag wins, so drop-ins and wrappers can override.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string staging = "4G";
  std::string staging_chunk = "128M";
  std::string user_quota = "0", job_quota = "0";
  std::string when_busy = "skip";
  app.add_option("--root", c.root, "checkpoint root directory")->capture_default_str();
  app.add_option("--socket", c.socket, "Unix socket for trainers and ckptctl (mode 0660)")
      ->capture_default_str();
  app.add_option("--admin-addr", c.admin_addr, "also serve the admin API on HOST:PORT (loopback)");
  app.add_flag("--admin-allow-remote", c.admin_allow_remote,
               "allow a non-loopback --admin-addr (reads are unauthenticated: use a firewall)");
  app.add_option("--admin-token-file", c.admin_token_file,
                 "file holding the token that delete calls over --admin-addr must carry")
      ->envname("CKPTD_ADMIN_TOKEN_FILE");
  app.add_option("--metrics-addr", c.metrics_addr,
                 "serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: 127.0.0.1)");
  app.add_option("--staging-bytes", staging, "staging memory budget, e.g. 8G")
      ->capture_default_str()
      ->envname("CKPTD_STAGING_BYTES");
  app.add_option("--staging-chunk", staging_chunk,
                 "bytes per staging copy call; the shard writer starts on each chunk once it "
                 "has landed")
      ->capture_default_str();
  app.add_option("--prefault-staging", c.prefault_staging, "touch staging memory at start")
      ->capture_default_str();
  app.add_option("--keep-last", c.keep_last, "keep the newest K checkpoints (0: all)")
      ->capture_default_str();
  app.add_option("--keep-every", c.keep_every, "also keep every step divisible by N (0: off)")
      ->capture_default_str();
  std::string increments = "on", increment_chunk = "4M";
  app.add_option("--increments", increments,
                 "on: write and upload only what changed since the rank's previous step, referencing the rest "
                 "(format version 5; peers of --replication hold each step whole); off: every step's files whole "
                 "(format version 4, what a ckptd without increments reads)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--increment-chunk-bytes", increment_chunk,
                 "with increments: about how large the chunks compared with the previous step are "
                 "(64K to 64M)")
      ->capture_default_str();
  app.add_option("--full-every", c.full_every,
                 "with increments: every N-th save of a rank rewrites what it references in files "
                 "mostly dead (a rebase; 0: never)")
      ->capture_default_str();
  app.add_option("--frozen-check-every", c.frozen_check_every,
                 "every N-th snapshot copies a trainer's frozen tensors (registered frozen; PyTorch: "
                 "requires_grad=False) again and saves any that changed in place; the others take them from "
                 "ckptd's last copy (0: never)")
      ->capture_default_str();
  app.add_option("--user-quota-bytes", user_quota,
                 "bytes of checkpoints the jobs of one uid may hold on --root, e.g. 500G (0: no bound); a shard "
                 "that would pass it is not written and its step fails")
      ->capture_default_str();
  app.add_option("--job-quota-bytes", job_quota, "bytes of checkpoints one job may hold on --root (0: no bound)")
      ->capture_default_str();
  app.add_option("--io-threads", c.io_threads, "threads writing shards")->capture_default_str();
  app.add_option("--copy-threads", c.copy_threads, "threads of the host copy engine")
      ->capture_default_str();
  app.add_option("--when-busy", when_busy,
                 "staging memory full: skip the snapshot (reported on its ticket) or wait")
      ->check(CLI::IsMember({"skip", "wait"}))
      ->capture_default_str();
  app.add_option("--busy-wait-ms", c.busy_wait_ms, "longest wait with --when-busy=wait")
      ->capture_default_str();
  app.add_option("--shutdown-timeout-ms", c.shutdown_timeout_ms,
                 "on SIGTERM, how long to let in-flight writes finish")
      ->capture_default_str();
  app.add_option("--max-connections-per-uid", c.max_connections_per_uid,
                 "open connections one uid may hold on the trainer socket (0: no bound); beyond, "
                 "new ones are closed at once, so that one user cannot take ckptd to its descriptor limit")
      ->capture_default_str();
  app.add_option("--allow-uid", c.allow_uids,
                 "uids allowed to connect besides the daemon's own and root")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--job-group", c.job_gids,
                 "a GID whose members share the jobs any of them creates (repeatable); "
                 "otherwise only the uid that created a job may use it")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--allow-gid", c.allow_gids,
                 "gids allowed to connect besides the daemon's own")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--cuda-ipc", c.cuda_ipc,
                 "accept GPU buffers as CUDA IPC handles (false: trainers must use the "
                 "host-copy transport; for nodes shared by users who do not trust each other)")
      ->capture_default_str();
  app.add_option("--log-level", c.log_level, "trace, debug, info, warn, error")
      ->capture_default_str();
  std::string group_timeout = "10s", step_timeout = "5m", restore_timeout = "5m";
  app.add_option("--node-rank", c.node_rank, "this node's rank in the group (0: coordinator)")
      ->envname("CKPTD_NODE_RANK")
      ->capture_default_str();
  app.add_option("--num-nodes", c.num_nodes, "nodes in the group (1: no group)")
      ->envname("CKPTD_NUM_NODES")
      ->capture_default_str();
  app.add_option("--coordinator", c.coordinator, "HOST:PORT of node 0's group server")
      ->envname("CKPTD_COORDINATOR");
  app.add_option("--group-addr", c.group_addr,
                 "HOST:PORT this node's group server listens on (default: the coordinator's "
                 "port on node 0, an ephemeral port elsewhere)")
      ->envname("CKPTD_GROUP_ADDR");
  app.add_option("--group-token-file", c.group_token_file,
                 "file holding the group's shared token (every group call carries it)")
      ->envname("CKPTD_GROUP_TOKEN_FILE");
  app.add_flag("--shared-root", c.shared_root,
               "--root is one filesystem shared by every node: the coordinator writes the one "
               "manifest and renames; nodes write only their shards")
      ->envname("CKPTD_SHARED_ROOT");
  app.add_option("--group-tls-cert", c.group_tls_cert, "PEM certificate for mutual TLS")
      ->envname("CKPTD_GROUP_TLS_CERT");
  app.add_option("--group-tls-key", c.group_tls_key, "PEM private key for mutual TLS")
      ->envname("CKPTD_GROUP_TLS_KEY");
  app.add_option("--group-tls-ca", c.group_tls_ca, "PEM CA that signed every node's certificate")
      ->envname("CKPTD_GROUP_TLS_CA");
  app.add_option("--group-timeout", group_timeout, "a member silent this long is lost")
      ->envname("CKPTD_GROUP_TIMEOUT")
      ->capture_default_str();
  app.add_option("--step-timeout", step_timeout,
                 "a step still missing ranks this long after its first rank is aborted")
      ->envname("CKPTD_STEP_TIMEOUT")
      ->capture_default_str();
  app.add_option("--group-relay-fanout", c.group_relay_fanout,
                 "nodes send heartbeats, prepares and outcome polls to their parent in a tree of this fan-out, "
                 "which batches them (0: every node calls node 0; groups of at most fan-out + 1 "
                 "nodes have no relays)")
      ->envname("CKPTD_GROUP_RELAY_FANOUT")
      ->capture_default_str();
  std::string replication, replica_bytes = "0";
  app.add_option("--replication", replication,
                 "K+M: keep each node's staged shards in its peers' memory as K data and M parity "
                 "fragments, so that any M nodes of a coding group of K+M may be lost (1+1: a mirror)")
      ->envname("CKPTD_REPLICATION");
  app.add_option("--replica-bytes", replica_bytes,
                 "memory for the fragments this node holds of its peers' shards (0: --staging-bytes)")
      ->envname("CKPTD_REPLICA_BYTES")
      ->capture_default_str();
  app.add_option("--replica-fetch-port", c.replica_fetch_port,
                 "port of the TCP channel that restores fetch peers' fragments on, on the group address's host "
                 "(0: any free port; -1: none, fetch over gRPC; never used with --group-tls-*)")
      ->envname("CKPTD_REPLICA_FETCH_PORT")
      ->capture_default_str();
  app.add_option("--failure-domain", c.failure_domain,
                 "this node's rack or topology zone: a coding group keeps one node's fragments in "
                 "different domains where it can")
      ->envname("CKPTD_FAILURE_DOMAIN");
  app.add_option("--restore-timeout", restore_timeout,
                 "how long restoring ranks wait for every rank of their job")
      ->envname("CKPTD_RESTORE_TIMEOUT")
      ->capture_default_str();
  std::string remote_mode = "tiered", upload_interval = "0", upload_wait = "30m";
  app.add_option("--remote", c.remote,
                 "s3://bucket/prefix: the off-node tier (endpoint, region and credentials as "
                 "the AWS SDKs find them)")
      ->envname("CKPTD_REMOTE");
  app.add_option("--remote-mode", remote_mode,
                 "tiered: commit locally and upload committed steps behind; direct: write "
                 "checkpoints straight to --remote (no local disk)")
      ->check(CLI::IsMember({"tiered", "direct"}))
      ->envname("CKPTD_REMOTE_MODE")
      ->capture_default_str();
  app.add_option("--s3-endpoint", c.s3_endpoint,
                 "S3 endpoint URL (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)");
  app.add_option("--s3-credentials-file", c.s3_credentials_file,
                 "AWS credentials file (mode 0600) instead of the environment");
  app.add_option("--upload-every-steps", c.upload_every_steps,
                 "upload committed steps whose number is a multiple of N")
      ->capture_default_str();
  app.add_option("--upload-interval", upload_interval,
                 "upload at most the first committed step of each window this long (0: off)")
      ->capture_default_str();
  app.add_option("--upload-wait", upload_wait,
                 "how long the coordinator waits for every node's part of an upload")
      ->capture_default_str();
  app.add_option("--remote-keep-last", c.remote_keep_last,
                 "keep the newest K uploaded steps (0: all)")
      ->capture_default_str();
  app.add_option("--remote-keep-every", c.remote_keep_every,
                 "also keep every uploaded step divisible by N (0: off)")
      ->capture_default_str();
  app.add_flag("--check-config", c.check_config, "validate the configuration, print it, exit");
  app.set_config("--config", "", "read options from a TOML file (keys are the long flag names)");
  app.allow_config_extras(false);  // a misspelt key is an error, not a silent default
  app.set_version_flag("--version", kVersion);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ConfigError& e) {
    // CLI11 says "INI was not able to parse KEY" of a TOML file's unknown key.
    std::string what = e.what();
    const std::string marker = "not able to parse ";
    const auto at = what.find(marker);
    result.exit = true;
    result.exit_code = 2;
    result.message = at == std::string::npos
                         ? fmt::format("ckptd: --config: {}\n", what)
                         : fmt::format("ckptd: --config: unknown key \"{}\" (the keys are the long flag names without "
                                       "the dashes, e.g. staging-bytes; ckptd --help lists them)\n",
                                       what.substr(at + marker.size()));
    return result;
  } catch (const CLI::ParseError& e) {
    result.exit = true;
    result.exit_code = e.get_exit_code();
    std::ostringstream out, err;
    app.exit(e, out, err);
    result.message = out.str() + err.str();
    return result;
  }
  for (auto [flag, text, out] : {std::tuple{"--staging-bytes", &staging, &c.staging_bytes},
                                 std::tuple{"--staging-chunk", &staging_chunk, &c.staging_chunk_bytes},
                                 std::tuple{"--user-quota-bytes", &user_quota, &c.user_quota_bytes},
                                 std::tuple{"--replica-bytes", &replica_bytes, &c.replica_bytes},
                                 std::tuple{"--increment-chunk-bytes", &increment_chunk, &c.increment_chunk_bytes},
                                 std::tuple{"--job-quota-bytes", &job_quota, &c.job_quota_bytes}}) {
    auto bytes = ParseBytes(*text);
    if (!bytes.ok()) {
      result.exit = true;
      result.exit_code = 2;
      result.message = fmt::format("{}: {}\n", flag, std::string(bytes.status().message()));
      return result;
    }
    *out = *bytes;
  }
  // The last field: whether "0" turns the setting off (rather than being too short).
  for (auto [flag, text, out, zero_is_off] :
       {std::tuple{"--group-timeout", &group_timeout, &c.group_timeout_ms, false},
        std::tuple{"--step-timeout", &step_timeout, &c.step_timeout_ms, false},
        std::tuple{"--restore-timeout", &restore_timeout, &c.restore_timeout_ms, false},
        std::tuple{"--upload-interval", &upload_interval, &c.upload_interval_ms, true},
        std::tuple{"--upload-wait", &upload_wait, &c.upload_wait_ms, false}}) {
    if (zero_is_off && *text == "0") {
      *out = 0;
      continue;
    }
    auto ms = ParseDurationMs(*text);
    if (!ms.ok()) {
      result.exit = true;
      result.exit_code = 2;
      result.message = fmt::format("{}: {}\n", flag, std::string(ms.status().message()));
      return result;
    }
    *out = *ms;
  }
  // Loopback unless an address is named: the figures name jobs.
  if (!c.metrics_addr.empty() && c.metrics_addr.find(':') == std::string::npos) c.metrics_addr = ":" + c.metrics_addr;
  if (c.metrics_addr.rfind(':', 0) == 0) c.metrics_addr = "127.0.0.1" + c.metrics_addr;
  if (c.metrics_addr.rfind("localhost:", 0) == 0) c.metrics_addr = "127.0.0.1" + c.metrics_addr.substr(9);
  if (!replication.empty()) {
    absl::StatusOr<std::pair<uint32_t, uint32_t>> code = ParseReplication(replication);
    if (!code.ok()) {
      result.exit = true;
      result.exit_code = 2;
      result.message = fmt::format("--replication: {}\n", std::string(code.status().message()));
      return result;
    }
    std::tie(c.replication_k, c.replication_m) = *code;
  }
  c.when_busy = when_busy == "wait" ? WhenBusy::kWait : WhenBusy::kSkip;
  c.increments = increments == "on";
  c.remote_mode = remote_mode == "direct" ? RemoteMode::kDirect : RemoteMode::kTiered;
  return result;
}

absl::StatusOr<std::pair<uint32_t, uint32_t>> ParseReplication(const std::string& text) {
  // Digits, one '+', digits: nothing a stream would also take ("+2+1", "2++1", " 2+1").
  const size_t plus = text.find('+');
  const auto digits = [](std::string_view d) {
    return !d.empty() && d.size() <= 3 && d.find_first_not_of("0123456789") == std::string_view::npos;
  };
  if (plus == std::string::npos || !digits(std::string_view(text).substr(0, plus)) ||
      !digits(std::string_view(text).substr(plus + 1))) {
    return absl::InvalidArgumentError(fmt::format("\"{}\" is not K+M (e.g. 2+1, 4+2; 1+1 is a mirror)", text));
  }
  const uint32_t k = static_cast<uint32_t>(std::stoul(text.substr(0, plus)));
  const uint32_t m = static_cast<uint32_t>(std::stoul(text.substr(plus + 1)));
  if (k < 1 || m < 1 || k + m > 32) {  // three digits each: no overflow
    return absl::InvalidArgumentError(fmt::format(
        "\"{}\": K and M must be at least 1 each and K+M at most 32 (a coding group is a few nodes)", text));
  }
  return std::pair{k, m};
}

absl::Status Validate(const Config& c) {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (c.root.empty()) return bad("--root must not be empty");
  if (c.socket.empty()) return bad("--socket must not be empty");
  if (c.socket.size() > 100) return bad("--socket path is longer than a Unix socket allows (100)");
  if (c.staging_bytes < (1u << 20)) return bad("--staging-bytes must be at least 1M");
  if (c.staging_chunk_bytes < (1u << 20)) return bad("--staging-chunk must be at least 1M");
  if (c.io_threads < 1 || c.io_threads > 256) return bad("--io-threads must be 1..256");
  if (c.copy_threads < 1 || c.copy_threads > 256) return bad("--copy-threads must be 1..256");
  if (!c.admin_addr.empty()) {
    auto colon = c.admin_addr.rfind(':');
    if (colon == std::string::npos || colon + 1 == c.admin_addr.size()) {
      return bad(fmt::format("--admin-addr \"{}\" is not HOST:PORT", c.admin_addr));
    }
    std::string host = c.admin_addr.substr(0, colon);
    bool loopback = host == "localhost" || host == "127.0.0.1" || host == "[::1]" ||
                    host.rfind("127.", 0) == 0;
    if (!loopback && !c.admin_allow_remote) {
      return bad(fmt::format(
          "--admin-addr {} is not a loopback address; add --admin-allow-remote to expose the "
          "admin API beyond this host",
          c.admin_addr));
    }
  }
  if (!c.metrics_addr.empty()) {
    auto colon = c.metrics_addr.rfind(':');
    const std::string port = c.metrics_addr.substr(colon + 1);
    if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(port) > 65535) {
      return bad(fmt::format("--metrics-addr \"{}\" is not HOST:PORT (or PORT for 127.0.0.1)", c.metrics_addr));
    }
  }
  if (c.num_nodes == 0 || c.num_nodes > 65536) return bad("--num-nodes must be 1..65536");
  if (c.node_rank >= c.num_nodes) {
    return bad(fmt::format("--node-rank {} is not in 0..{} (--num-nodes {})", c.node_rank,
                           c.num_nodes - 1, c.num_nodes));
  }
  if (c.num_nodes > 1) {
    if (c.coordinator.empty()) return bad("--coordinator HOST:PORT is required with --num-nodes > 1");
    if (c.group_token_file.empty()) {
      return bad("--group-token-file is required with --num-nodes > 1: every group call is "
                 "authenticated with the shared token");
    }
    int tls = !c.group_tls_cert.empty() + !c.group_tls_key.empty() + !c.group_tls_ca.empty();
    if (tls != 0 && tls != 3) {
      return bad("--group-tls-cert, --group-tls-key and --group-tls-ca go together (mutual TLS)");
    }
    for (const auto& [flag, addr] : {std::pair{"--coordinator", &c.coordinator},
                                     std::pair{"--group-addr", &c.group_addr}}) {
      if (addr->empty()) continue;
      auto colon = addr->rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == addr->size()) {
        return bad(fmt::format("{} \"{}\" is not HOST:PORT", flag, *addr));
      }
    }
  }
  if (c.shared_root && c.num_nodes < 2) return bad("--shared-root needs --num-nodes > 1");
  if (c.step_timeout_ms < 100) return bad("--step-timeout must be at least 100ms");
  if (c.group_timeout_ms < 100) return bad("--group-timeout must be at least 100ms");
  if (c.group_relay_fanout == 1) return bad("--group-relay-fanout 1 makes a chain, not a tree: use 2 or more, or 0");
  if (!c.remote.empty() && c.remote.rfind("s3://", 0) != 0) {
    return bad(fmt::format("--remote \"{}\" is not an s3://bucket/prefix URL", c.remote));
  }
  if (c.remote.empty() && c.remote_mode == RemoteMode::kDirect) {
    return bad("--remote-mode direct needs --remote s3://bucket/prefix");
  }
  if (c.remote_mode == RemoteMode::kDirect && (c.user_quota_bytes != 0 || c.job_quota_bytes != 0)) {
    return bad("--user-quota-bytes and --job-quota-bytes bound what --root holds; with --remote-mode direct "
               "nothing is written there (bound the bucket with the object store's own quotas)");
  }
  if (c.remote_mode == RemoteMode::kDirect && c.shared_root) {
    return bad("--remote-mode direct and --shared-root exclude each other: the remote store "
               "is then the one place every node writes");
  }
  if (c.upload_every_steps == 0) return bad("--upload-every-steps must be at least 1");
  if (c.increment_chunk_bytes < (uint64_t{64} << 10) || c.increment_chunk_bytes > (uint64_t{64} << 20)) {
    return bad(fmt::format("--increment-chunk-bytes {} is outside 64K to 64M", c.increment_chunk_bytes));
  }
  if (c.replication_k != 0) {
    const uint32_t members = c.replication_k + c.replication_m;
    if (c.num_nodes < members) {
      return bad(fmt::format("--replication {}+{} needs coding groups of {} nodes; --num-nodes is {}",
                             c.replication_k, c.replication_m, members, c.num_nodes));
    }
    if (c.shared_root) {
      return bad("--replication keeps copies of node-local checkpoints; with --shared-root every node "
                 "already reads every shard from the shared filesystem");
    }
  }
  if (c.failure_domain.size() > 256) return bad("--failure-domain is longer than 256 bytes");
  if (c.replica_fetch_port < -1 || c.replica_fetch_port > 65535) {
    return bad(fmt::format("--replica-fetch-port {} is not -1, 0 or a port", c.replica_fetch_port));
  }
  spdlog::level::level_enum level = spdlog::level::from_str(c.log_level);
  if (level == spdlog::level::off && c.log_level != "off") {
    return bad(fmt::format("--log-level \"{}\" is not one of trace, debug, info, warn, error",
                           c.log_level));
  }
  return absl::OkStatus();
}

}  // namespace ckpt::daemon
