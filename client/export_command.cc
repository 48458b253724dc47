#include "client/export_command.h"

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <iostream>

#include <nlohmann/json.hpp>

#include "client/ctl_exit.h"
#include "client/progress_bar.h"
#include "storage/filesystem.h"
#include "common/status.h"
#include "client/export/exporter.h"
#include "format/checkpoint_store.h"
#include "storage/open_store.h"

namespace ckpt::ctl {
namespace {

int Fail(const std::string& message, int code) {
  std::cerr << "ckptctl export: " << message << "\n";
  return code;
}

}  // namespace

int RunExport(const ExportArgs& args) {
  FilesystemPtr fs = MakePosixFilesystem();
  absl::StatusOr<storage::StorePtr> objects =
      storage::OpenStore(args.root, fs, {args.s3_endpoint, args.s3_credentials_file});
  if (!objects.ok()) return Fail(Message(objects.status()), 1);
  format::CheckpointStore store(*objects, args.root);
  exporter::ExportOptions options;
  options.out = args.out;
  options.extra_files = args.with;
  absl::StatusOr<exporter::ExportFormat> format = exporter::ParseExportFormat(args.format);
  if (!format.ok()) return Fail(Message(format.status()), 1);
  options.format = *format;
  absl::StatusOr<uint64_t> max = exporter::ParseByteSize(args.max_shard_size);
  if (!max.ok()) return Fail("--max-shard-size: " + Message(max.status()), 1);
  options.max_shard_bytes = *max;
  absl::StatusOr<uint64_t> buffer = exporter::ParseByteSize(args.buffer_size);
  if (!buffer.ok()) return Fail("--buffer-size: " + Message(buffer.status()), 1);
  options.slice_bytes = *buffer;
  if (!args.dtype.empty()) {
    static const std::map<std::string, std::string> kDTypes = {
        {"bf16", "BF16"}, {"fp16", "F16"}, {"fp32", "F32"}};
    auto it = kDTypes.find(args.dtype);
    if (it == kDTypes.end()) return Fail(fmt::format("--dtype {}: bf16, fp16 or fp32", args.dtype), 1);
    options.dtype = it->second;
  }
  if (!args.rename_file.empty()) {
    absl::StatusOr<std::string> text = ReadSmallFile(*fs, args.rename_file);
    if (!text.ok()) return Fail("--rename: " + Message(text.status()), 1);
    absl::StatusOr<exporter::RenameRules> rules = exporter::RenameRules::Parse(*text, args.rename_file);
    if (!rules.ok()) return Fail(Message(rules.status()), 1);
    options.rename = std::move(*rules);
  }
  absl::StatusOr<format::TensorSelection> selection = format::TensorSelection::Make(args.include, args.exclude);
  if (!selection.ok()) return Fail(Message(selection.status()), 1);
  options.selection = std::move(*selection);

  std::string job = args.job;
  if (job.empty()) {
    absl::StatusOr<std::vector<std::string>> jobs = store.ListJobs();
    if (!jobs.ok()) return Fail(Message(jobs.status()), ExitFor(jobs.status()));
    if (jobs->size() != 1) {
      return Fail(fmt::format("{} holds {} jobs ({}): name one with --job", args.root, jobs->size(),
                              fmt::join(*jobs, ", ")),
                  1);
    }
    job = jobs->front();
  }
  absl::StatusOr<format::Manifest> manifest = store.LoadManifest(job, args.step);
  if (!manifest.ok()) {
    // Where it looked, too: the root of the daemon at --socket, or the one given.
    return Fail(fmt::format("{} (in the checkpoint root {})", Message(manifest.status()), args.root),
                ExitFor(manifest.status()));
  }

  ProgressBar bar("export", ProgressBar::Style::kBar);
  if (args.progress && !args.json && ::isatty(STDERR_FILENO)) {
    options.progress = [&](uint64_t done, uint64_t total) { bar.Update(done, total); };
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<exporter::ExportReport> report =
      exporter::ExportStep(*fs, store.objects(), format::CheckpointStore::StepKey(job, args.step),
                           *manifest, options);
  if (!report.ok()) {
    const absl::Status& s = report.status();
    return Fail(Message(s), ExitFor(s));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (args.json) {
    nlohmann::json out = {{"job", job},
                          {"step", args.step},
                          {"out", args.out},
                          {"format", args.format},
                          {"tensors", report->tensors},
                          {"bytes_written", report->bytes_written},
                          {"bytes_read", report->bytes_read},
                          {"optimizer_tensors_left_out", report->optimizer_tensors_left_out},
                          {"seconds", seconds},
                          {"files", report->files},
                          {"notes", report->notes}};
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::cout << fmt::format("exported step {} of job {} to {}: {} tensors, {} in {} files, {:.1f} s ({:.0f} MB/s)\n",
                           args.step, job, args.out, report->tensors, HumanBytes(report->bytes_written),
                           report->files.size(), seconds,
                           seconds > 0 ? static_cast<double>(report->bytes_written) / seconds / 1e6 : 0.0);
  if (report->optimizer_tensors_left_out > 0) {
    std::cout << fmt::format("  left out {} optimizer tensors (optim.*): --format full keeps them\n",
                             report->optimizer_tensors_left_out);
  }
  for (const std::string& note : report->notes) std::cout << "  " << note << "\n";
  return 0;
}

}  // namespace ckpt::ctl
