// Free pages in the node's pool of huge pages (vm.nr_hugepages): whether huge-page arenas,
// and so copy-on-write snapshots, can be had right now. tools/test.sh reserves a pool when
// it runs as root on a machine without one; tests check the fallback otherwise.
#pragma once

#include <cstddef>
#include <fstream>
#include <string>

namespace ckpt::testing {

inline size_t FreeHugePages() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t value = 0;
  while (meminfo >> key) {
    if (key == "HugePages_Free:" && (meminfo >> value)) return value;
    meminfo.ignore(1 << 10, '\n');
  }
  return 0;
}

}  // namespace ckpt::testing
