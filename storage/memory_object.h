// An ObjectReader over bytes already in memory (a fuzzer's input, a test's file).
#pragma once

#include <memory>
#include <string>

#include "storage/store.h"

namespace ckpt::storage {

std::unique_ptr<ObjectReader> ReadFromMemory(std::string name, std::string bytes);

}  // namespace ckpt::storage
