// Free pages in the node's pool of huge pages (vm.nr_hugepages): whether huge-page arenas,
// and so copy-on-write snapshots, can be had right now. tools/test.sh reserves a pool when
// it runs as root on a machine without one; tests check the fallback otherwise.
#pragma once

#include <cstddef>
#include <fstream>
#include <string>

namespace ckpt::testing {

// A HugePages_* figure of /proc/meminfo ("Free", "Total"); 0 when absent.
inline size_t HugePagesFigure(const std::string& name) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t value = 0;
  while (meminfo >> key) {
    if (key == "HugePages_" + name + ":" && (meminfo >> value)) return value;
    meminfo.ignore(1 << 10, '\n');
  }
  return 0;
}

inline size_t FreeHugePages() { return HugePagesFigure("Free"); }
// The whole pool: what no arena can exceed and still get huge pages, whatever the tests
// beside this one take and give back meanwhile.
inline size_t TotalHugePages() { return HugePagesFigure("Total"); }

}  // namespace ckpt::testing
