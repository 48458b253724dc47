// libFuzzer target: the manifest parser, on whole manifests and on nodes' parts, and the
// merge of parts the coordinator does with what it parsed.
#include <cstddef>
#include <cstdint>
#include <string>

#include "format/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  auto scope = data[0] & 1 ? ckpt::format::ManifestScope::kPart : ckpt::format::ManifestScope::kWhole;
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto parsed = ckpt::format::ParseManifest(text, "fuzz", scope);
  if (!parsed.ok()) return 0;
  // What parses must print and parse back the same, and merge with itself without harm.
  std::string again = ckpt::format::ManifestToJson(*parsed);
  auto reparsed = ckpt::format::ParseManifest(again, "fuzz again", scope);
  if (!reparsed.ok()) __builtin_trap();
  (void)ckpt::format::MergeManifestParts({{0, *parsed}, {1, *reparsed}});
  return 0;
}
