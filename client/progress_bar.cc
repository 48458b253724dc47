#include "client/progress_bar.h"

#include <fmt/format.h>

#include <iostream>

namespace ckpt::ctl {

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, units[u]);
}

void ProgressBar::Update(uint64_t done, uint64_t total) {
  if (finished_) return;
  const auto now = std::chrono::steady_clock::now();
  // A bar redraws at most 10 times a second; a log gets a line every 2 s.
  const auto every = style_ == Style::kBar ? std::chrono::milliseconds(100) : std::chrono::milliseconds(2000);
  const bool last = done >= total;
  if (!last && now - last_ < every) return;
  last_ = now;
  finished_ = last;
  const double seconds = std::chrono::duration<double>(now - start_).count();
  const double fraction = total == 0 ? 1.0 : static_cast<double>(done) / static_cast<double>(total);
  const std::string figures =
      fmt::format("{} of {}, {:.0f} MB/s", HumanBytes(done), HumanBytes(total),
                  seconds > 0 ? static_cast<double>(done) / seconds / 1e6 : 0.0);
  if (style_ == Style::kLines) {
    std::cerr << fmt::format("{}: {:3.0f}% ({})\n", what_, fraction * 100, figures) << std::flush;
    return;
  }
  const int width = 30, filled = static_cast<int>(fraction * width);
  std::cerr << fmt::format("\r{:3.0f}% [{}{}] {} ", fraction * 100, std::string(filled, '='),
                           std::string(width - filled, ' '), figures)
            << (last ? "\n" : "") << std::flush;
}

}  // namespace ckpt::ctl
