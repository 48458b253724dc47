#include "format/json_text.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace ckpt::format {

void JsonText::Newline(size_t depth) {
  out_ += '\n';
  out_.append(depth * static_cast<size_t>(indent_), ' ');
}

void JsonText::Separate() {
  if (after_key_) {  // the value of the key just written
    after_key_ = false;
    return;
  }
  if (levels_.empty()) return;
  if (levels_.back().items++ > 0) out_ += ',';
  if (indent_ >= 0) Newline(levels_.size());
}

void JsonText::BeginObject() {
  Separate();
  out_ += '{';
  levels_.push_back({true, 0});
}

void JsonText::BeginArray() {
  Separate();
  out_ += '[';
  levels_.push_back({false, 0});
}

void JsonText::EndObject() {
  const bool empty = levels_.back().items == 0;
  levels_.pop_back();
  if (!empty && indent_ >= 0) Newline(levels_.size());
  out_ += '}';
}

void JsonText::EndArray() {
  const bool empty = levels_.back().items == 0;
  levels_.pop_back();
  if (!empty && indent_ >= 0) Newline(levels_.size());
  out_ += ']';
}

void JsonText::Key(std::string_view key) {
  Separate();
  Escaped(key);
  out_ += indent_ >= 0 ? ": " : ":";
  after_key_ = true;
}

void JsonText::Escaped(std::string_view s) {
  bool plain = true;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u > 0x7e || c == '"' || c == '\\') {
      plain = false;
      break;
    }
  }
  if (plain) {
    out_ += '"';
    out_ += s;
    out_ += '"';
    return;
  }
  // Escapes and UTF-8 exactly as nlohmann does (and refused where it refuses): rare in
  // names ckptd writes, so its own serializer is cheap enough here.
  out_ += nlohmann::json(std::string(s)).dump();
}

void JsonText::String(std::string_view s) {
  Separate();
  Escaped(s);
}

// fmt::format_int writes into a buffer of its own: format_to through a back_inserter
// appends a character at a time (node 0 writes 80,000 rank numbers into every decision).
void JsonText::Unsigned(uint64_t v) {
  Separate();
  const fmt::format_int text(v);
  out_.append(text.data(), text.size());
}

void JsonText::Signed(int64_t v) {
  Separate();
  const fmt::format_int text(v);
  out_.append(text.data(), text.size());
}

void JsonText::Double(double v) {
  Separate();
  out_ += nlohmann::json(v).dump();  // nlohmann's shortest round-trip form ("1.5", "0.0", null)
}

void JsonText::Strings(const std::vector<std::string>& values) {
  BeginArray();
  for (const std::string& s : values) String(s);
  EndArray();
}

void JsonText::StringMap(const std::map<std::string, std::string>& values) {
  BeginObject();
  for (const auto& [k, v] : values) {
    Key(k);
    String(v);
  }
  EndObject();
}

}  // namespace ckpt::format
