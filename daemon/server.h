// The running daemon: the only place that picks concrete implementations (filesystem,
// copy engine, shard writer) and wires the stages together.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/config.h"

namespace ckpt::daemon {

class Server {
 public:
  struct Parts;  // every stage, in dependency order (server.cc)

  static absl::StatusOr<std::unique_ptr<Server>> Start(const Config& config);
  ~Server();

  // Stops accepting, lets in-flight writes finish (up to --shutdown-timeout-ms), aborts the
  // rest and ends every session. Idempotent.
  void Shutdown();

 private:
  explicit Server(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace ckpt::daemon
