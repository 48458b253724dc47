// Component loggers (STYLE.md #9). Each component has its own named spdlog logger so that
// operators can tell the data path ("staging", "persist") from the control plane.
#pragma once

#include <memory>
#include <string_view>

#include <spdlog/spdlog.h>

namespace ckpt::log {

enum class Component { kShm, kCuda, kStaging, kPersist, kGroup, kControl, kSession, kMain, kUpload };

// Returns the logger for `component`; loggers share one sink and one level.
spdlog::logger& Get(Component component);

// Sets the level of every component logger ("trace", "debug", "info", "warn", "error").
// Returns false for an unknown level name.
bool SetLevel(std::string_view level);

}  // namespace ckpt::log
