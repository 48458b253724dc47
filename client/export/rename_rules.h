// `ckptctl export --rename FILE`: how checkpoint tensor names become the names a model
// loader expects (a training framework's "layers.3.attention.wq.weight" as Hugging Face's
// "model.layers.3.self_attn.q_proj.weight").
//
// FILE is a JSON object. "old.name": "new.name" renames one tensor. A key ending in "*"
// renames by prefix: "layers.*": "model.layers.*" turns "layers.3.w" into
// "model.layers.3.w"; the longest matching prefix wins, and an exact name beats every
// prefix. A name mapped to "" is left out of the export. Names no rule matches keep theirs.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ckpt::exporter {

class RenameRules {
 public:
  RenameRules() = default;  // no renames

  // InvalidArgument, naming `source`, for JSON that is not an object of strings, or a
  // rule whose "*" is anywhere but at the end of both sides.
  static absl::StatusOr<RenameRules> Parse(const std::string& json, const std::string& source);

  // The new name; nullopt when the rules leave the tensor out.
  std::optional<std::string> Apply(const std::string& name) const;

 private:
  std::map<std::string, std::string> exact_;
  std::vector<std::pair<std::string, std::string>> prefixes_;  // longest first
};

}  // namespace ckpt::exporter
