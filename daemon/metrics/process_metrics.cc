#include "daemon/metrics/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace ckpt::metrics {
namespace {

// Fields of /proc/self/stat after the command name (which may hold spaces and parentheses:
// the last ')' ends it). Field 3 (state) is fields[0].
std::vector<std::string> StatFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  std::getline(in, line);
  std::vector<std::string> fields;
  auto close = line.rfind(')');
  if (close == std::string::npos) return fields;
  std::istringstream rest(line.substr(close + 1));
  for (std::string f; rest >> f;) fields.push_back(f);
  return fields;
}

// When the system booted, in Unix time: from the clocks, not /proc/stat (which a unit's
// ProcSubset=pid hides).
double BootTime() {
  timespec real{}, boot{};
  ::clock_gettime(CLOCK_REALTIME, &real);
  ::clock_gettime(CLOCK_BOOTTIME, &boot);
  return static_cast<double>(real.tv_sec - boot.tv_sec) + (real.tv_nsec - boot.tv_nsec) * 1e-9;
}

double OpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  double n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n - 1;  // the directory's own descriptor
}

FamilySpec Spec(const char* name, const char* help) { return {name, help, {}}; }

}  // namespace

void CollectProcess(Exposition& out) {
  const std::vector<std::string> f = StatFields();
  // After the name: utime is field 14, stime 15, starttime 22, vsize 23, rss 24 (proc(5)),
  // so fields[11], [12], [19], [20], [21].
  if (f.size() < 22) return;
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  out.Samples(Spec("process_cpu_seconds_total", "Total user and system CPU time spent in seconds."),
              {{{}, (std::stod(f[11]) + std::stod(f[12])) / ticks}}, /*counter=*/true);
  out.Samples(Spec("process_open_fds", "Number of open file descriptors."), {{{}, OpenFds()}});
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    out.Samples(Spec("process_max_fds", "Maximum number of open file descriptors."),
                {{{}, static_cast<double>(limit.rlim_cur)}});
  }
  out.Samples(Spec("process_virtual_memory_bytes", "Virtual memory size in bytes."), {{{}, std::stod(f[20])}});
  out.Samples(Spec("process_resident_memory_bytes", "Resident memory size in bytes."),
              {{{}, std::stod(f[21]) * page}});
  out.Samples(Spec("process_start_time_seconds", "Start time of the process since unix epoch in seconds."),
              {{{}, BootTime() + std::stod(f[19]) / ticks}});
}

}  // namespace ckpt::metrics
