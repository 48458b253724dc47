// JSON text written straight from values, byte for byte as nlohmann::json::dump() would write
// the same document (`indent` spaces per level, or compact with -1), without building a
// tree first. A manifest's checksum is over its text as nlohmann writes it (ParseManifest
// checks it that way), so the text must match exactly; writing it directly is what keeps
// node 0's whole manifest of a 10,000-node step (tens of MB) from costing seconds of malloc.
// The caller writes an object's keys in ascending byte order, as nlohmann's std::map does.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace ckpt::format {

class JsonText {
 public:
  explicit JsonText(int indent = -1) : indent_(indent) {}

  void BeginObject();
  void EndObject();
  void BeginArray();
  void EndArray();
  // Inside an object: the next value's key.
  void Key(std::string_view key);

  void String(std::string_view s);
  void Unsigned(uint64_t v);
  void Signed(int64_t v);
  void Double(double v);
  template <typename Int>
  void Number(Int v) {
    if constexpr (std::is_signed_v<Int>) {
      Signed(v);
    } else {
      Unsigned(v);
    }
  }
  template <typename Int>
  void Integers(const std::vector<Int>& values) {
    BeginArray();
    for (Int v : values) Number(v);
    EndArray();
  }
  // A two-element array, [a, b].
  template <typename Int>
  void Pair(Int a, Int b) {
    BeginArray();
    Number(a);
    Number(b);
    EndArray();
  }
  void Strings(const std::vector<std::string>& values);
  void StringMap(const std::map<std::string, std::string>& values);

  // A key and its value, the value written as its type says.
  template <typename T>
  void Field(std::string_view key, const T& value) {
    Key(key);
    Value(value);
  }
  void Value(std::string_view s) { String(s); }
  void Value(const std::string& s) { String(s); }
  void Value(const char* s) { String(s); }
  void Value(double v) { Double(v); }
  template <typename Int>
    requires(std::is_integral_v<Int> && !std::is_same_v<Int, bool>)
  void Value(Int v) {
    Number(v);
  }
  template <typename Int>
  void Value(const std::vector<Int>& values) {
    Integers(values);
  }
  void Value(const std::vector<std::string>& values) { Strings(values); }
  void Value(const std::map<std::string, std::string>& values) { StringMap(values); }

  // The text so far; its size is where the next character goes.
  const std::string& text() const { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  // Before a value (or a key): the comma and line break that separate it from the one
  // before, and its indentation.
  void Separate();
  void Newline(size_t depth);
  void Escaped(std::string_view s);

  const int indent_;
  std::string out_;
  struct Level {
    bool object;
    size_t items;
  };
  std::vector<Level> levels_;
  bool after_key_ = false;
};

}  // namespace ckpt::format
