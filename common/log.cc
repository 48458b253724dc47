#include "common/log.h"

#include <array>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace ckpt::log {
namespace {

constexpr std::array<const char*, 9> kNames = {"shm",     "cuda",    "staging", "persist", "group",
                                               "control", "session", "main",    "upload"};

struct Registry {
  Registry() {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    for (size_t i = 0; i < kNames.size(); ++i) {
      loggers[i] = std::make_shared<spdlog::logger>(kNames[i], sink);
      loggers[i]->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ [%n] %v");
      loggers[i]->set_level(spdlog::level::info);
    }
  }
  std::array<std::shared_ptr<spdlog::logger>, kNames.size()> loggers;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

}  // namespace

spdlog::logger& Get(Component component) {
  return *registry().loggers[static_cast<size_t>(component)];
}

bool SetLevel(std::string_view level) {
  spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off") return false;
  for (auto& logger : registry().loggers) logger->set_level(parsed);
  return true;
}

}  // namespace ckpt::log
