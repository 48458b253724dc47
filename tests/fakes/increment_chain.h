// A job's steps written by hand in format version 5 (incremental steps, docs/format.md), into
// <root>/<job>/step-NNNNNNNN/, as ckptd's writer will write them: what the readers' tests read
// (restores through the planner, verify, export, the Python readers) before anything in
// ckptd writes increments. Every tensor is split by rows over the ranks (rank r holds rows
// [r * rows, (r + 1) * rows) of a [world * rows, ...] tensor), cut into chunks of
// `chunk_bytes`; a chunk equal to the same chunk of the chain's previous step is referenced
// where its bytes were first written (one hop), the rest written as `__delta__` entries, or
// the piece whole when most of it changed.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "format/checksum.h"
#include "format/manifest.h"
#include "format/safetensors.h"

namespace ckpt::testing {

class IncrementChain {
 public:
  // One tensor of the chain: its dtype and global shape, split by its first dimension.
  struct Tensor {
    std::string dtype = "F32";
    std::vector<int64_t> global_shape;
  };
  // Per tensor, per rank, the piece's bytes; per rank, its train state.
  struct Step {
    std::map<std::string, std::vector<std::string>> pieces;
    std::vector<std::map<std::string, std::string>> train_state;
    bool full = false;  // nothing referenced
  };

  IncrementChain(std::string root, std::string job, uint32_t world, std::map<std::string, Tensor> tensors,
                 uint64_t chunk_bytes)
      : root_(std::move(root)), job_(std::move(job)), world_(world), tensors_(std::move(tensors)),
        chunk_bytes_(chunk_bytes) {}

  std::string StepDir(uint64_t step) const { return root_ + "/" + job_ + "/" + fmt::format("step-{:08d}", step); }
  // Rank r's file of `step` (its tag: the run's, plus the rank).
  std::string FilePath(uint64_t step, uint32_t rank) const {
    return StepDir(step) + "/" + files_.at(step).at(rank).file;
  }

  // Writes `step` of run `run` against the previous Write's step, commits it (manifest last)
  // and returns its manifest.
  format::Manifest Write(uint64_t step, uint64_t run, const Step& s) {
    namespace fs = std::filesystem;
    fs::create_directories(StepDir(step));
    format::Manifest m;
    m.job = job_;
    m.step = step;
    m.unix_time = 1.7e9 + static_cast<double>(step);
    m.wall_time = "2026-11-29T00:00:00Z";
    m.world_size = world_;
    m.ckptd_version = "0.1.0";
    m.run = run;
    m.checksum_chunk_bytes = format::kChecksumChunkBytes;
    format::Increment& inc = m.increment.emplace();
    std::map<std::pair<uint64_t, uint32_t>, format::Origin> origins;
    auto reference = [&](uint64_t from, uint32_t rank) {
      const FileInfo& f = files_.at(from).at(rank);
      origins[{from, rank}] = format::Origin{from, f.run, rank, f.file, f.bytes};
    };
    for (uint32_t rank = 0; rank < world_; ++rank) {
      const std::string file = format::TaggedShardFileName(rank, run * 1000 + rank);
      std::vector<format::TensorEntry> entries;
      std::string data;
      auto add = [&](const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                     const std::string& bytes) {
        entries.push_back({name, dtype, std::move(shape), data.size(), data.size() + bytes.size()});
        data += bytes;
        return entries.back().begin;
      };
      for (const auto& [name, t] : tensors_) {
        const std::string& bytes = s.pieces.at(name).at(rank);
        std::vector<int64_t> shape = t.global_shape;
        shape[0] /= world_;
        format::TensorShard piece;
        piece.rank = rank;
        piece.offset.assign(shape.size(), 0);
        piece.offset[0] = shape[0] * rank;
        piece.shape = shape;
        piece.checksum = format::ChecksumOf(bytes.data(), bytes.size());
        piece.chunk_bytes = chunk_bytes_;
        const uint64_t chunks = format::PieceChunks(bytes.size(), chunk_bytes_);
        std::vector<Where>& where = where_[{name, rank}];
        std::vector<Where> now(chunks);
        std::vector<bool> changed(chunks, true);
        uint64_t changed_count = chunks;
        for (uint64_t c = 0; c < chunks; ++c) {
          const auto [lo, hi] = format::ChunkSpan(bytes.size(), chunk_bytes_, c, c + 1);
          now[c].checksum = format::ChecksumOf(bytes.data() + lo, hi - lo);
          if (chunks > 1) piece.chunk_checksums.push_back(now[c].checksum);
          if (!s.full && where.size() == chunks && where[c].checksum == now[c].checksum) {
            changed[c] = false;
            --changed_count;
          }
        }
        if (changed_count * 2 > chunks || s.full) {  // whole
          piece.file = file;
          piece.begin = add(name, t.dtype, shape, bytes);
          piece.end = piece.begin + bytes.size();
          for (uint64_t c = 0; c < chunks; ++c) now[c].step = step, now[c].at = piece.begin + c * chunk_bytes_;
        } else {
          for (uint64_t c = 0; c < chunks;) {
            uint64_t e = c + 1;
            if (changed[c]) {
              while (e < chunks && changed[e]) ++e;
              const auto [lo, hi] = format::ChunkSpan(bytes.size(), chunk_bytes_, c, e);
              const uint64_t at = add(format::DeltaEntryName(name, c, e), t.dtype,
                                      {static_cast<int64_t>((hi - lo) / *DTypeSize(t.dtype))}, bytes.substr(lo, hi - lo));
              piece.extents.push_back({static_cast<uint32_t>(c), static_cast<uint32_t>(e), std::nullopt, at});
              for (uint64_t k = c; k < e; ++k) now[k].step = step, now[k].at = at + (k - c) * chunk_bytes_;
            } else {
              // Unchanged chunks in one file, one after another: one extent.
              while (e < chunks && !changed[e] && where[e].step == where[c].step &&
                     where[e].at == where[c].at + (e - c) * chunk_bytes_) {
                ++e;
              }
              piece.extents.push_back(
                  {static_cast<uint32_t>(c), static_cast<uint32_t>(e), where[c].step, where[c].at});
              reference(where[c].step, rank);
              const auto [lo, hi] = format::ChunkSpan(bytes.size(), chunk_bytes_, c, e);
              inc.referenced_bytes += hi - lo;
              for (uint64_t k = c; k < e; ++k) now[k].step = where[k].step, now[k].at = where[k].at;
            }
            c = e;
          }
        }
        where = std::move(now);
        m.tensors[name].dtype = t.dtype;
        m.tensors[name].global_shape = t.global_shape;
        m.tensors[name].shards.push_back(std::move(piece));
      }
      format::ManifestShard shard{rank, file, 0, {}, {}};
      for (const auto& [name, blob] : s.train_state.at(rank)) {
        const std::string key = format::TrainStateKey(name);
        auto& last = blobs_[{name, rank}];
        format::TrainStateEntry e;
        e.checksum = format::ChecksumOf(blob.data(), blob.size());
        if (!s.full && last.checksum == e.checksum) {
          e.step = last.step;
          e.begin = last.at;
          e.end = last.at + blob.size();
          reference(last.step, rank);
          inc.referenced_bytes += blob.size();
        } else {
          e.begin = add(key, "U8", {static_cast<int64_t>(blob.size())}, blob);
          e.end = e.begin + blob.size();
          last = {step, e.begin, e.checksum};
        }
        shard.train_state[name] = e;
      }
      const std::string header = format::EncodeHeader(entries, {}, 4096);
      std::ofstream(StepDir(step) + "/" + file, std::ios::binary) << header << data;
      shard.bytes = header.size() + data.size();
      inc.own_bytes += shard.bytes;
      files_[step][rank] = {file, shard.bytes, run};
      m.shards.push_back(std::move(shard));
    }
    for (auto& [key, origin] : origins) {
      inc.origins.push_back(origin);
      if (inc.origin_steps.empty() || inc.origin_steps.back() != format::StepRun{origin.step, origin.run}) {
        inc.origin_steps.push_back({origin.step, origin.run});
      }
    }
    std::sort(inc.origin_steps.begin(), inc.origin_steps.end());
    inc.origin_steps.erase(std::unique(inc.origin_steps.begin(), inc.origin_steps.end()), inc.origin_steps.end());
    std::ofstream(StepDir(step) + "/manifest.json", std::ios::binary) << format::ManifestToJson(m);
    return m;
  }

 private:
  // Where a chunk's bytes are: the step whose file holds them, and where in its data region.
  struct Where {
    std::string checksum;
    uint64_t step = 0;
    uint64_t at = 0;
  };
  struct Blob {
    uint64_t step = 0;
    uint64_t at = 0;
    std::string checksum;
  };
  struct FileInfo {
    std::string file;
    uint64_t bytes = 0;
    uint64_t run = 0;
  };

  const std::string root_, job_;
  const uint32_t world_;
  const std::map<std::string, Tensor> tensors_;
  const uint64_t chunk_bytes_;
  std::map<std::pair<std::string, uint32_t>, std::vector<Where>> where_;  // the previous step's
  std::map<std::pair<std::string, uint32_t>, Blob> blobs_;
  std::map<uint64_t, std::map<uint32_t, FileInfo>> files_;
};

}  // namespace ckpt::testing
