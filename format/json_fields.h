// Typed fields of a manifest's JSON, read strictly: the helpers that manifest.cc and
// increment.cc parse with. A field of the wrong type or out of range for its C++ type throws
// BadField, which the parser turns into DataLoss naming the manifest.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

namespace ckpt::format::json_fields {

struct BadField : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// nlohmann's get<> would cast a float such as 1e300 to an integer, which is undefined
// behaviour (found by the fuzzer): integers are taken only as integers, in range.
template <typename T>
T Int(const nlohmann::json& v, const char* field) {
  static_assert(std::is_integral_v<T>);
  if (v.is_number_unsigned()) {
    uint64_t x = v.get<uint64_t>();
    if (x <= static_cast<uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(x);
  } else if (v.is_number_integer()) {
    int64_t x = v.get<int64_t>();
    if constexpr (std::is_signed_v<T>) {
      if (x >= std::numeric_limits<T>::min() && x <= std::numeric_limits<T>::max()) {
        return static_cast<T>(x);
      }
    }
  }
  throw BadField(fmt::format("\"{}\" is not an integer in range", field));
}

template <typename T>
std::vector<T> Ints(const nlohmann::json& v, const char* field) {
  if (!v.is_array()) throw BadField(fmt::format("\"{}\" is not an array", field));
  std::vector<T> out;
  out.reserve(v.size());
  for (const nlohmann::json& e : v) out.push_back(Int<T>(e, field));
  return out;
}

inline double Real(const nlohmann::json& v, const char* field) {
  if (!v.is_number()) throw BadField(fmt::format("\"{}\" is not a number", field));
  return v.get<double>();
}

inline std::string Str(const nlohmann::json& v, const char* field) {
  if (!v.is_string()) throw BadField(fmt::format("\"{}\" is not a string", field));
  return v.get<std::string>();
}

// The member `name` of object `o` (called `where` in messages), which must be there.
inline const nlohmann::json& Required(const nlohmann::json& o, const char* where, const char* name) {
  if (!o.is_object()) throw BadField(fmt::format("\"{}\" is not an object", where));
  auto it = o.find(name);
  if (it == o.end()) throw BadField(fmt::format("\"{}\" has no \"{}\"", where, name));
  return *it;
}

// "xxh3:" and 16 lowercase hex digits, as ChecksumOf writes them.
inline bool IsDigest(const std::string& s) {
  constexpr std::string_view kPrefix = "xxh3:";
  return s.size() == kPrefix.size() + 16 && s.compare(0, kPrefix.size(), kPrefix) == 0 &&
         std::all_of(s.begin() + kPrefix.size(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace ckpt::format::json_fields
