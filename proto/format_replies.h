// What the admin service answers about checkpoints, from what //format computes: one
// mapping for ckptd's admin service and for ckptctl reading the files alone, so both print
// the same and a field added to one is never missing from the other.
#pragma once

#include "format/checkpoint_store.h"
#include "format/verify.h"
#include "proto/admin.pb.h"

namespace ckpt {

inline void ToProto(const format::CheckpointSummary& c, ::ckptd::v1::CheckpointInfo* info) {
  info->set_job(c.job);
  info->set_step(c.step);
  info->set_world_size(c.world_size);
  info->set_bytes(c.bytes);
  info->set_referenced_bytes(c.referenced_bytes);
  info->set_unix_time(c.unix_time);
  info->set_tensors(c.tensors);
  for (const std::string& flag : c.flags) info->add_flags(flag);
  for (const std::string& file : c.files) info->add_files(file);
  info->set_error(c.error);
}

inline void ToProto(const format::VerifyReport& report, ::ckptd::v1::VerifyReply* reply) {
  reply->set_ok(report.ok());
  reply->set_bytes_checked(report.bytes_checked);
  for (uint32_t rank : report.skipped_ranks) reply->add_skipped_ranks(rank);
  reply->set_bytes_referenced(report.bytes_referenced);
  for (const std::string& file : report.referenced_files) reply->add_referenced_files(file);
  for (const std::string& p : report.problems) reply->add_problems(p);
}

}  // namespace ckpt
