// `ckptctl export`: writes a committed step as Hugging Face safetensors shards, one
// consolidated safetensors file, or a full unsharded copy, reading the step's files directly
// (no daemon needed: the job may be long gone). See client/export/exporter.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ckpt::ctl {

struct ExportArgs {
  std::string root = "/var/lib/ckptd";  // or s3://bucket/prefix
  std::string s3_endpoint;          // empty: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
  std::string s3_credentials_file;  // empty: the AWS environment or ~/.aws/credentials
  std::string job;  // empty: the only job under root
  uint64_t step = 0;
  std::string out;
  std::string format = "hf";
  std::string max_shard_size = "5GB";
  std::string buffer_size = "64MiB";  // read, converted and written at a time
  std::string dtype;  // bf16, fp16, fp32; empty: as saved
  std::string rename_file;
  std::vector<std::string> include, exclude;
  std::vector<std::string> with;  // files copied into the folder (config.json, tokenizer)
  bool progress = true;  // a bar on stderr when it is a terminal
  bool json = false;
};

// Exit status (client/ctl_exit.h): 0 done, 1 an error (bad arguments, no such step, I/O),
// 2 the store did not answer, 3 the checkpoint is damaged or disagrees with its manifest.
int RunExport(const ExportArgs& args);

}  // namespace ckpt::ctl
