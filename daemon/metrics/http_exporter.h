// Serves a Registry at GET /metrics over HTTP/1.1 (Boost.Beast), for Prometheus to scrape:
// --metrics-addr. Plain HTTP on an address the operator chose (loopback unless told
// otherwise); the figures name jobs, never data. A few connections at a time, each with a
// deadline, so a slow or idle client delays only scrapes, never the daemon.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/metrics/registry.h"

namespace ckpt::metrics {

class HttpExporter {
 public:
  // Listens on `addr` (HOST:PORT; PORT 0 picks a free one) and serves what `render`
  // writes (a Registry's Render, and more) until destroyed.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& addr,
                                                             std::function<std::string()> render);
  virtual ~HttpExporter() = default;
  virtual int port() const = 0;
};

}  // namespace ckpt::metrics
