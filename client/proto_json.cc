#include "client/proto_json.h"

#include <google/protobuf/descriptor.h>

namespace ckpt::ctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

nlohmann::json Value(const Message& m, const Reflection& r, const FieldDescriptor* f, int i) {
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return rep ? r.GetRepeatedInt32(m, f, i) : r.GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64: return rep ? r.GetRepeatedInt64(m, f, i) : r.GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32: return rep ? r.GetRepeatedUInt32(m, f, i) : r.GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64: return rep ? r.GetRepeatedUInt64(m, f, i) : r.GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE: return rep ? r.GetRepeatedDouble(m, f, i) : r.GetDouble(m, f);
    case FieldDescriptor::CPPTYPE_FLOAT: return rep ? r.GetRepeatedFloat(m, f, i) : r.GetFloat(m, f);
    case FieldDescriptor::CPPTYPE_BOOL: return rep ? r.GetRepeatedBool(m, f, i) : r.GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM: return (rep ? r.GetRepeatedEnum(m, f, i) : r.GetEnum(m, f))->name();
    case FieldDescriptor::CPPTYPE_STRING:  // text; ckptctl prints invalid UTF-8 replaced
      return rep ? r.GetRepeatedString(m, f, i) : r.GetString(m, f);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r.GetRepeatedMessage(m, f, i) : r.GetMessage(m, f));
  }
  return nullptr;
}

}  // namespace

nlohmann::json ProtoToJson(const Message& message) {
  nlohmann::json out = nlohmann::json::object();
  const auto* d = message.GetDescriptor();
  const Reflection& r = *message.GetReflection();
  for (int k = 0; k < d->field_count(); ++k) {
    const FieldDescriptor* f = d->field(k);
    if (f->is_map()) {  // repeated {key, value} entries: an object
      nlohmann::json object = nlohmann::json::object();
      for (int i = 0; i < r.FieldSize(message, f); ++i) {
        const Message& entry = r.GetRepeatedMessage(message, f, i);
        const auto* ed = entry.GetDescriptor();
        nlohmann::json key = Value(entry, *entry.GetReflection(), ed->field(0), 0);
        object[key.is_string() ? key.get<std::string>() : key.dump()] =
            Value(entry, *entry.GetReflection(), ed->field(1), 0);
      }
      out[f->name()] = std::move(object);
    } else if (f->is_repeated()) {
      nlohmann::json list = nlohmann::json::array();
      for (int i = 0; i < r.FieldSize(message, f); ++i) list.push_back(Value(message, r, f, i));
      out[f->name()] = std::move(list);
    } else {
      out[f->name()] = Value(message, r, f, 0);
    }
  }
  return out;
}

}  // namespace ckpt::ctl
