// A protobuf message as JSON the way ckptctl --json prints every answer: field names as in
// the .proto, every field present, and numbers as numbers (protobuf's own JSON writes
// 64-bit integers as strings, so `list` gave steps as "12" where `show` gave 12).
#pragma once

#include <google/protobuf/message.h>
#include <nlohmann/json.hpp>

namespace ckpt::ctl {

nlohmann::json ProtoToJson(const google::protobuf::Message& message);

}  // namespace ckpt::ctl
