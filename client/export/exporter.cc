#include "client/export/exporter.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <memory>
#include <chrono>
#include <fstream>
#include <future>
#include <iterator>
#include <set>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/names.h"
#include "common/status.h"
#include "client/export/dtype_convert.h"
#include "format/safetensors.h"
#include "format/plan_reader.h"
#include "format/read_plan.h"
#include "format/user_files.h"

namespace ckpt::exporter {
namespace {

using Shape = std::vector<int64_t>;

// One tensor of the export: where it comes from and what it becomes.
struct Item {
  std::string source;  // name in the checkpoint
  std::string name;    // name in the export
  std::string dtype;   // saved
  std::string out_dtype;
  Shape shape;  // global
  uint64_t out_bytes = 0;
};

// One output file and the tensors in it, in order.
struct OutFile {
  std::string name;
  std::vector<const Item*> items;
  uint64_t bytes = 0;
};

bool IsOptimizerState(const std::string& name) {
  return name.compare(0, sizeof(kOptimizerPrefix) - 1, kOptimizerPrefix) == 0;
}

uint64_t Elements(const Shape& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Visits `global` in row-major slices of at most `budget` bytes (or one row of the innermost
// dimension, which is at least one element): boxes whose bytes are contiguous in the
// tensor, so that they are written one after another.
template <typename F>
absl::Status ForEachSlice(const Shape& global, size_t itemsize, uint64_t budget, F f) {
  const size_t n = global.size();
  if (n == 0) return f(Shape{}, Shape{});
  if (Elements(global) == 0) return absl::OkStatus();
  // d: the outermost dimension whose inner block fits the budget; slices cut along it.
  size_t d = 0;
  uint64_t inner = itemsize;  // bytes of one index of dimension d
  for (size_t k = 1; k < n; ++k) inner *= static_cast<uint64_t>(global[k]);
  while (d + 1 < n && inner > budget) inner /= static_cast<uint64_t>(global[++d]);
  const auto chunk = static_cast<int64_t>(std::max<uint64_t>(1, budget / inner));
  Shape offset(n, 0);
  while (true) {
    Shape shape(n, 1);
    for (size_t k = d + 1; k < n; ++k) shape[k] = global[k];
    shape[d] = std::min(chunk, global[d] - offset[d]);
    CKPT_RETURN_IF_ERROR(f(offset, shape));
    offset[d] += shape[d];
    size_t k = d;
    while (offset[k] >= global[k]) {
      if (k == 0) return absl::OkStatus();
      offset[k] = 0;
      ++offset[--k];
    }
  }
}

class Writer {
 public:
  Writer(Filesystem& fs, storage::Store& source, const format::Manifest& manifest,
         const std::string& step_dir, const ExportOptions& options, uint64_t total)
      : fs_(fs),
        manifest_(manifest),
        options_(options),
        reader_(source, step_dir, manifest, nullptr),
        total_(total) {}

  // Writes `file` as `path`: the header, then each tensor's slices in order.
  absl::Status WriteFile(const std::string& path, const OutFile& file,
                         const std::map<std::string, std::string>& metadata) {
    std::vector<format::TensorEntry> entries;
    uint64_t at = 0;
    for (const Item* item : file.items) {
      entries.push_back({item->name, item->out_dtype, item->shape, at, at + item->out_bytes});
      at += item->out_bytes;
    }
    uint64_t position = 0;
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, CreateWithHeader(path, entries, metadata, position));
    for (const Item* item : file.items) {
      absl::Status written = WriteTensor(fd.get(), *item, position);
      if (!written.ok()) {
        (void)Drain();  // before the descriptor closes
        return written;
      }
      position += item->out_bytes;
    }
    CKPT_RETURN_IF_ERROR(Drain());
    return fs_.SyncFile(fd.get());
  }

  // Train state blobs of every rank, for --format full.
  absl::Status WriteTrainState(const std::string& path) {
    std::vector<format::TensorEntry> entries;
    std::vector<std::string> blobs;
    uint64_t at = 0;
    for (const format::ManifestShard& shard : manifest_.shards) {
      CKPT_ASSIGN_OR_RETURN(std::vector<format::NamedBytes> state, reader_.TrainState(shard.rank));
      for (format::NamedBytes& blob : state) {
        const auto size = static_cast<int64_t>(blob.data.size());
        entries.push_back({fmt::format("rank-{:05d}.{}", shard.rank, blob.name), "U8", {size}, at,
                           at + blob.data.size()});
        at += blob.data.size();
        blobs.push_back(std::move(blob.data));
      }
    }
    uint64_t position = 0;
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, CreateWithHeader(path, entries, {{"format", "ckptd-train-state"}}, position));
    for (const std::string& blob : blobs) {
      CKPT_RETURN_IF_ERROR(fs_.WriteAt(fd.get(), blob.data(), blob.size(), position));
      position += blob.size();
    }
    return fs_.SyncFile(fd.get());
  }

  // Rank `rank`'s train-state blobs, checked against the manifest's checksums.
  absl::StatusOr<std::vector<format::NamedBytes>> TrainState(uint32_t rank) { return reader_.TrainState(rank); }

  uint64_t bytes_read() const { return reader_.bytes_from_disk(); }

 private:
  // Creates the safetensors file `path` holding `entries` and writes its header; `data_start`
  // is where the entries' bytes go.
  absl::StatusOr<UniqueFd> CreateWithHeader(const std::string& path,
                                            const std::vector<format::TensorEntry>& entries,
                                            const std::map<std::string, std::string>& metadata,
                                            uint64_t& data_start) {
    const std::string header = format::EncodeHeader(entries, metadata);
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd, fs_.CreateFile(path));
    CKPT_RETURN_IF_ERROR(fs_.WriteAt(fd.get(), header.data(), header.size(), 0));
    data_start = header.size();
    return fd;
  }

  // The slices come in row-major order, each contiguous with the last: written one after
  // another from `position`.
  absl::Status WriteTensor(int fd, const Item& item, uint64_t position) {
    CKPT_ASSIGN_OR_RETURN(size_t in_size, DTypeSize(item.dtype));
    CKPT_ASSIGN_OR_RETURN(size_t out_size, DTypeSize(item.out_dtype));
    return ForEachSlice(item.shape, std::max(in_size, out_size), options_.slice_bytes,
                        [&](const Shape& offset, const Shape& shape) -> absl::Status {
      format::WantedTensor wanted{item.source, item.dtype, shape, item.shape, offset, {}, std::nullopt};
      CKPT_ASSIGN_OR_RETURN(format::ReadPlan plan, format::PlanRead(manifest_, {wanted}));
      const uint64_t count = Elements(shape);
      // Two buffers: this slice is read and converted while the previous one is written.
      std::vector<char>& buffer = buffers_[current_];
      buffer.resize(count * std::max(in_size, out_size));
      CKPT_RETURN_IF_ERROR(reader_.Read(plan.tensors[0], buffer.data()));
      ConvertElements(item.dtype, item.out_dtype, buffer.data(), buffer.data(), count);
      const uint64_t bytes = count * out_size;
      const uint64_t at = position;
      position += bytes;
      CKPT_RETURN_IF_ERROR(Drain());
      writing_ = std::async(std::launch::async, [this, fd, &buffer, bytes, at] {
        return fs_.WriteAt(fd, buffer.data(), bytes, at);
      });
      current_ ^= 1;
      done_ += bytes;
      if (options_.progress) options_.progress(done_, total_);
      return absl::OkStatus();
    });
  }

  // The write in flight, if any: its status, once.
  absl::Status Drain() {
    if (!writing_.valid()) return absl::OkStatus();
    return writing_.get();
  }

  Filesystem& fs_;
  const format::Manifest& manifest_;
  const ExportOptions& options_;
  format::PlanReader reader_;
  const uint64_t total_;
  uint64_t done_ = 0;
  std::vector<char> buffers_[2];
  int current_ = 0;
  std::future<absl::Status> writing_;  // of buffers_[current_ ^ 1]; waited for when destroyed
};

// The tensors to export, renamed, in name order (the checkpoint's).
absl::StatusOr<std::vector<Item>> ChooseTensors(const format::Manifest& manifest,
                                               const ExportOptions& options, ExportReport& report) {
  std::vector<Item> items;
  std::map<std::string, std::string> taken;  // export name -> checkpoint name
  const bool weights_only = options.format != ExportFormat::kFull;
  for (const auto& [name, tensor] : manifest.tensors) {
    if (!options.selection.Selects(name)) continue;
    if (weights_only && IsOptimizerState(name)) {
      ++report.optimizer_tensors_left_out;
      continue;
    }
    std::optional<std::string> renamed = options.rename.Apply(name);
    if (!renamed) continue;
    if (absl::Status valid = ValidateTensorName(*renamed); !valid.ok()) {
      return absl::InvalidArgumentError(fmt::format("tensor {} renamed to \"{}\": {}", name, *renamed,
                                                    Message(valid)));
    }
    if (auto [it, fresh] = taken.emplace(*renamed, name); !fresh) {
      return absl::InvalidArgumentError(fmt::format(
          "tensors {} and {} would both be exported as {}: fix the rename rules", it->second, name,
          *renamed));
    }
    CKPT_ASSIGN_OR_RETURN(std::string out_dtype, ExportDType(tensor.dtype, options.dtype));
    CKPT_ASSIGN_OR_RETURN(uint64_t bytes, TensorBytes(name, out_dtype, tensor.global_shape));
    items.push_back({name, *renamed, tensor.dtype, out_dtype, tensor.global_shape, bytes});
  }
  if (items.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "nothing to export from step {}: no tensor is selected{}", manifest.step,
        weights_only ? " (hf and safetensors leave out optimizer state, optim.*)" : ""));
  }
  return items;
}

// hf: consecutive tensors up to max_shard_bytes a file (a larger tensor gets one alone).
std::vector<OutFile> PlanFiles(const std::vector<Item>& items, const ExportOptions& options) {
  std::vector<OutFile> files;
  if (options.format == ExportFormat::kFull) {
    files.resize(2);
    files[0].name = "model.safetensors";
    files[1].name = "optimizer.safetensors";
    for (const Item& item : items) files[IsOptimizerState(item.source) ? 1 : 0].items.push_back(&item);
    std::erase_if(files, [](const OutFile& f) { return f.items.empty(); });
    return files;
  }
  for (const Item& item : items) {
    if (files.empty() || (options.format == ExportFormat::kHuggingFace && !files.back().items.empty() &&
                          files.back().bytes + item.out_bytes > options.max_shard_bytes)) {
      files.emplace_back();
    }
    files.back().items.push_back(&item);
    files.back().bytes += item.out_bytes;
  }
  for (size_t k = 0; k < files.size(); ++k) {
    files[k].name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, files.size());
  }
  return files;
}

// The files stored with the step (format/user_files.h) into `folder`, each the lowest rank's
// that stores it, its bytes checked; their names into `written`.
absl::Status WriteUserFiles(Filesystem& fs, Writer& writer, const format::Manifest& manifest,
                            const std::string& folder, ExportReport& report, std::set<std::string>& written) {
  std::map<uint32_t, std::vector<format::UserFile>> by_rank;
  for (format::UserFile& f : format::UserFiles(manifest)) by_rank[f.rank].push_back(std::move(f));
  for (const auto& [rank, files] : by_rank) {
    CKPT_ASSIGN_OR_RETURN(std::vector<format::NamedBytes> state, writer.TrainState(rank));
    for (const format::UserFile& f : files) {
      auto blob = std::find_if(state.begin(), state.end(), [&](const format::NamedBytes& b) {
        return format::UserFileName(b.name) == std::string_view(f.name);
      });
      if (absl::Status valid = format::ValidateUserFileName(f.name); !valid.ok()) {
        // A manifest is data: a name that is not a plain file name never becomes a path.
        return absl::DataLossError(fmt::format("rank {}'s file of step {}: {}", rank, manifest.step, Message(valid)));
      }
      if (blob == state.end()) {
        return absl::DataLossError(fmt::format("rank {}'s file {} of step {} cannot be read", rank, f.name, manifest.step));
      }
      if (fs.Exists(folder + "/" + f.name)) {
        return absl::InvalidArgumentError(fmt::format(
            "step {} stores a file named {}, which this export writes itself: export with another --format",
            manifest.step, f.name));
      }
      CKPT_RETURN_IF_ERROR(WriteFileAtomically(fs, folder + "/" + f.name, blob->data));
      report.files.push_back(f.name);
      written.insert(f.name);
      if (!f.same_everywhere) {
        report.notes.push_back(fmt::format("ranks {} store different files named {}: rank {}'s is written",
                                           fmt::join(f.ranks, ","), f.name, rank));
      }
    }
  }
  return absl::OkStatus();
}

std::string CheckpointJson(const format::Manifest& m) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const format::ManifestShard& s : m.shards) ranks.push_back({{"rank", s.rank}, {"metadata", s.metadata}});
  nlohmann::json j = {{"format", "ckptd-full-export"}, {"job", m.job},           {"step", m.step},
                      {"world_size", m.world_size},     {"wall_time", m.wall_time}, {"metadata", m.metadata},
                      {"ranks", ranks}};
  return j.dump(1) + "\n";
}

}  // namespace

absl::StatusOr<ExportFormat> ParseExportFormat(const std::string& name) {
  if (name == "hf") return ExportFormat::kHuggingFace;
  if (name == "safetensors") return ExportFormat::kSafetensors;
  if (name == "full") return ExportFormat::kFull;
  return absl::InvalidArgumentError(fmt::format("unknown export format \"{}\": hf, safetensors or full", name));
}

absl::StatusOr<uint64_t> ParseByteSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit = text.substr(digits);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, uint64_t> kUnits = {
      {"", 1},          {"B", 1},
      {"KB", 1000},     {"MB", 1000 * 1000},       {"GB", 1000 * 1000 * 1000},
      {"KIB", 1 << 10}, {"MIB", 1 << 20},          {"GIB", uint64_t{1} << 30}};
  auto u = kUnits.find(unit);
  if (digits == 0 || digits > 12 || u == kUnits.end()) {
    return absl::InvalidArgumentError(fmt::format(
        "\"{}\" is not a size: a number and a unit (B, KB, MB, GB, KiB, MiB, GiB)", text));
  }
  const uint64_t number = std::stoull(text.substr(0, digits));
  if (number > (uint64_t{1} << 50) / u->second) {
    return absl::InvalidArgumentError(fmt::format("\"{}\" is more than a PiB", text));
  }
  const uint64_t bytes = number * u->second;
  if (bytes == 0) return absl::InvalidArgumentError("a size of 0 bytes holds nothing");
  return bytes;
}

absl::StatusOr<ExportReport> ExportStep(Filesystem& fs, storage::Store& source,
                                        const std::string& step_dir,
                                        const format::Manifest& manifest,
                                        const ExportOptions& options) {
  if (options.out.empty()) return absl::InvalidArgumentError("no output path given");
  if (options.format == ExportFormat::kFull && !options.dtype.empty()) {
    return absl::InvalidArgumentError("--dtype applies to hf and safetensors exports; full keeps every dtype");
  }
  if (!options.extra_files.empty() && options.format == ExportFormat::kSafetensors) {
    return absl::InvalidArgumentError("--with copies files into an export folder: use it with hf or full");
  }
  if (fs.Exists(options.out)) {
    return absl::AlreadyExistsError(fmt::format("{} exists: export writes a new file or folder", options.out));
  }
  if (manifest.scope) {
    // It lists this node's ranks only: an export from it would silently leave out the rest.
    return absl::FailedPreconditionError(fmt::format(
        "step {} of job {} here is node {}'s part of a step saved across {} nodes (its manifest lists only the "
        "ranks this node holds): export it from node 0's checkpoint root, or from the remote tier",
        manifest.step, manifest.job, manifest.scope->node, manifest.scope->nodes));
  }
  ExportReport report;
  CKPT_ASSIGN_OR_RETURN(std::vector<Item> items, ChooseTensors(manifest, options, report));
  std::vector<OutFile> files = PlanFiles(items, options);
  uint64_t total = 0;
  for (const Item& item : items) total += item.out_bytes;

  // Everything goes into `staging`, renamed to `out` when complete.
  // A name of its own: another export into the same place, or a file of the user's that
  // happens to be called so, is never touched.
  const std::string staging = fmt::format("{}.export-tmp.{}.{}", options.out, ::getpid(),
                                          std::chrono::steady_clock::now().time_since_epoch().count());
  if (fs.Exists(staging)) return absl::AlreadyExistsError(fmt::format("{} exists", staging));
  const bool folder = options.format != ExportFormat::kSafetensors;
  if (folder) CKPT_RETURN_IF_ERROR(fs.MakeDir(staging));
  auto fail = [&](absl::Status status) {
    (void)fs.RemoveTree(staging);
    return status;
  };
  Writer writer(fs, source, manifest, step_dir, options, total);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  for (const OutFile& file : files) {
    const std::string path = folder ? staging + "/" + file.name : staging;
    if (absl::Status s = writer.WriteFile(path, file, metadata); !s.ok()) return fail(s);
    report.files.push_back(folder ? file.name : options.out);
  }
  if (options.format == ExportFormat::kHuggingFace) {
    nlohmann::json weight_map = nlohmann::json::object();
    for (const OutFile& file : files) {
      for (const Item* item : file.items) weight_map[item->name] = file.name;
    }
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    if (absl::Status s = WriteFileAtomically(fs, staging + "/model.safetensors.index.json", index.dump(2) + "\n");
        !s.ok()) {
      return fail(s);
    }
    report.files.push_back("model.safetensors.index.json");
  }
  if (options.format == ExportFormat::kFull) {
    if (absl::Status s = writer.WriteTrainState(staging + "/train_state.safetensors"); !s.ok()) return fail(s);
    if (absl::Status s = WriteFileAtomically(fs, staging + "/checkpoint.json", CheckpointJson(manifest)); !s.ok()) {
      return fail(s);
    }
    report.files.push_back("train_state.safetensors");
    report.files.push_back("checkpoint.json");
  }
  std::set<std::string> step_files;
  if (folder) {
    if (absl::Status s = WriteUserFiles(fs, writer, manifest, staging, report, step_files); !s.ok()) return fail(s);
  } else if (const size_t n = format::UserFiles(manifest).size(); n > 0) {
    report.notes.push_back(fmt::format("left out the {} file(s) stored with the step: --format hf or full writes them", n));
  }
  for (const std::string& extra : options.extra_files) {
    const std::string base = extra.substr(extra.rfind('/') + 1);
    if (base.empty() || base == "." || base == "..") {
      return fail(absl::InvalidArgumentError(fmt::format("--with {}: not a file name", extra)));
    }
    // A file the user names, read as the user would (a Hugging Face cache's config.json is a
    // symlink), unlike checkpoint files, which are never followed through links.
    std::ifstream in(extra, std::ios::binary);
    if (!in) return fail(absl::NotFoundError(fmt::format("--with {}: cannot open it", extra)));
    const std::string contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (step_files.erase(base) > 0) {  // asked for by name: it wins over the step's own
      report.files.erase(std::find(report.files.begin(), report.files.end(), base));
      report.notes.push_back(fmt::format("--with {} replaced the file {} stored with the step", extra, base));
    } else if (fs.Exists(staging + "/" + base)) {
      return fail(absl::InvalidArgumentError(fmt::format("--with {}: the export already has a file {}", extra, base)));
    }
    if (absl::Status s = WriteFileAtomically(fs, staging + "/" + base, contents); !s.ok()) return fail(s);
    report.files.push_back(base);
  }
  if (folder) {
    if (absl::Status s = fs.SyncDir(staging); !s.ok()) return fail(s);
  }
  if (absl::Status s = fs.Rename(staging, options.out); !s.ok()) return fail(s);
  const std::string parent = options.out.find('/') == std::string::npos
                                 ? "."
                                 : options.out.substr(0, std::max<size_t>(options.out.rfind('/'), 1));
  CKPT_RETURN_IF_ERROR(fs.SyncDir(parent));
  report.tensors = items.size();
  report.bytes_written = total;
  report.bytes_read = writer.bytes_read();
  return report;
}

}  // namespace ckpt::exporter
