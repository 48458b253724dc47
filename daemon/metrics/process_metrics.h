// The process_* figures every Prometheus client exports (client_golang's process
// collector): CPU time, resident and virtual memory, open and maximum descriptors, start
// time. Read from /proc at each scrape.
#pragma once

#include "daemon/metrics/registry.h"

namespace ckpt::metrics {

void CollectProcess(Exposition& out);

}  // namespace ckpt::metrics
