// `ckptctl export`: a committed step as the files other tools load, from the step's files
// alone (no daemon). Every tensor is consolidated into its full global shape, whatever
// placement the ranks saved it in, through the read planner (format/read_plan.h):
// streamed in slices of at most ExportOptions::slice_bytes, so memory stays bounded by a
// slice however large the tensor, and every byte read is checked against the manifest's
// checksums before it is written.
//
// Formats (docs/format.md, "Export"):
//   hf           Hugging Face: OUT/model-0000k-of-0000n.safetensors of at most
//                max_shard_bytes each, and OUT/model.safetensors.index.json
//                ({"metadata": {"total_size"}, "weight_map"}). Model weights only.
//   safetensors  One consolidated file OUT. Model weights only.
//   full         Everything, optimizer state and train state included: OUT/model.safetensors,
//                OUT/optimizer.safetensors, OUT/train_state.safetensors (each rank's blobs
//                as U8 tensors "rank-00000.<name>") and OUT/checkpoint.json.
// hf and full also hold the files stored with the step (format/user_files.h) under their own
// names, each the lowest rank's that stores it.
// "Model weights" are the tensors not named optim.* (the optimizer-state convention of
// ckptd.torch and of docs/users.md).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/filesystem.h"
#include "storage/store.h"
#include "client/export/rename_rules.h"
#include "format/manifest.h"
#include "format/tensor_selection.h"

namespace ckpt::exporter {

enum class ExportFormat { kHuggingFace, kSafetensors, kFull };

// "hf", "safetensors", "full"; InvalidArgument naming the choices otherwise.
absl::StatusOr<ExportFormat> ParseExportFormat(const std::string& name);

// "5GB", "500MB", "2GiB", "1048576": bytes (decimal units as Hugging Face's
// max_shard_size, binary ones with "i").
absl::StatusOr<uint64_t> ParseByteSize(const std::string& text);

inline constexpr char kOptimizerPrefix[] = "optim.";

struct ExportOptions {
  ExportFormat format = ExportFormat::kHuggingFace;
  std::string out;  // a folder to create (hf, full) or a file (safetensors); must not exist
  uint64_t max_shard_bytes = 5'000'000'000;  // hf: Hugging Face's default "5GB"
  std::string dtype;                         // "", F32, F16 or BF16 (hf and safetensors)
  RenameRules rename;
  format::TensorSelection selection;
  uint64_t slice_bytes = uint64_t{64} << 20;  // read, converted and written at a time
  // hf, full: files copied into the folder as they are (a model's config.json, its
  // tokenizer), under their own base names; one the step stores too is replaced.
  std::vector<std::string> extra_files;
  // After each slice: bytes of tensor data written so far, of `total`.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct ExportReport {
  std::vector<std::string> files;  // written, under `out` (hf, full) or `out` itself
  uint64_t tensors = 0;
  uint64_t bytes_written = 0;  // tensor data, as exported
  uint64_t bytes_read = 0;     // from the shard files, checked
  uint64_t optimizer_tensors_left_out = 0;  // hf, safetensors: optim.* tensors
  // What the user should know of what was written: a file of the step that ranks stored
  // with different bytes, one that --with replaced, files a single-file export leaves out.
  std::vector<std::string> notes;
};

// Exports the step `manifest` describes, whose files are in `step_dir`. Writes into a
// temporary name beside `out` and renames it into place at the end: `out` appears whole or
// not at all. Errors name the tensor and file (DataLoss for a checksum mismatch or a file
// that disagrees with its manifest; InvalidArgument for options, names that collide after
// renaming, or nothing selected).
absl::StatusOr<ExportReport> ExportStep(Filesystem& fs, storage::Store& source,
                                        const std::string& step_dir,
                                        const format::Manifest& manifest,
                                        const ExportOptions& options);

}  // namespace ckpt::exporter
