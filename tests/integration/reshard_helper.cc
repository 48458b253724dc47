// A trainer for resharding tests: every rank holds its piece of the same global tensors,
// filled from one global pattern (a value per global element, whatever the world size),
// saves them, or restores and checks its piece bit for bit. Placements:
//   rows  - 2-D tensors split by rows (uneven when the world size does not divide them)
//   cols  - the same tensors split by columns
//   flat  - FSDP style: both tensors, flattened one after the other with 3 elements of
//           padding between them and padded at the end to a multiple of the world size,
//           form one flat parameter that each rank holds an equal slice of (one rank's
//           slice holds the end of one tensor and the start of the next)
// plus a replicated tensor (every rank holds it whole), a scalar and a replicated
// optimizer-state tensor ("optim.*", which exports of model weights leave out).
// With --changed-rows W, the two 2-D tensors change from step to step: at step s, the W
// global rows from (131 s) mod rows on (wrapping) hold other values, so that one session
// saving --steps-list (--increments on) writes a chain of a full step and increments.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "client/ckpt_client.h"
#include "common/status.h"
#include "tests/integration/global_pattern.h"

namespace {

struct Flags {
  std::string socket, job = "reshard", layout = "rows";
  uint32_t rank = 0, world_size = 1, saved_world_size = 0;
  uint64_t step = 5;
  int64_t rows = 3001, cols = 1024;
  bool wait_committed = false, has_step = false;
  std::vector<uint64_t> steps_list;  // save: these steps, one after another, each committed
  int64_t changed_rows = 0;
};

// The value of element `g` of global tensor `t` at `step`.
uint32_t Global(const Flags& f, uint32_t t, uint64_t g, uint64_t step) {
  const uint32_t v = ckpt::testing::GlobalValue(t, g);
  if (f.changed_rows == 0 || t > 1) return v;
  const int64_t row = static_cast<int64_t>(g) / f.cols, band = static_cast<int64_t>(step * 131 % f.rows);
  const bool changed = (row - band + f.rows) % f.rows < f.changed_rows;
  return changed ? v ^ (static_cast<uint32_t>(step) * 0x9E3779B1u | 1u) : v;
}

// [begin, end) of `n` split as evenly as possible over `parts`: the first n % parts get one more.
std::pair<int64_t, int64_t> Split(int64_t n, uint32_t part, uint32_t parts) {
  int64_t base = n / parts, extra = n % parts;
  int64_t begin = part * base + std::min<int64_t>(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

struct Piece {
  ckpt::Tensor* tensor;
  uint32_t id;
  std::vector<int64_t> global, offset, shape;
  ckpt::ElementRange flat;  // for the flat layout: elements of the flattened tensor
};

// Visits each element of the piece: (index in the piece, global flat index).
template <typename F>
void ForEach(const Piece& p, F f) {
  if (p.flat.end > p.flat.begin) {
    for (int64_t g = p.flat.begin; g < p.flat.end; ++g) f(g - p.flat.begin, g);
    return;
  }
  if (p.shape.empty()) return f(0, 0);
  if (p.shape.size() == 1) {
    for (int64_t i = 0; i < p.shape[0]; ++i) f(i, p.offset[0] + i);
    return;
  }
  for (int64_t r = 0; r < p.shape[0]; ++r) {
    for (int64_t c = 0; c < p.shape[1]; ++c) {
      f(r * p.shape[1] + c, (p.offset[0] + r) * p.global[1] + p.offset[1] + c);
    }
  }
}

std::vector<Piece> Setup(ckpt::Client& c, const Flags& f) {
  std::vector<Piece> pieces;
  auto add = [&](const std::string& name, uint32_t id, std::vector<int64_t> global,
                 std::vector<int64_t> offset, std::vector<int64_t> shape) {
    auto t = c.AllocateTensor(name, "F32", shape, global, offset);
    if (!t.ok()) {
      std::cout << "error: " << ckpt::Message(t.status()) << "\n";
      std::exit(2);
    }
    pieces.push_back({*t, id, global, offset, shape, {}});
  };
  if (f.layout == "flat") {
    // The flat parameter: layer0 at 0, 3 elements of padding, layer1, padding to the end.
    const int64_t numel = f.rows * f.cols, gap = 3;
    const int64_t total = 2 * numel + gap;
    const int64_t slice = (total + f.world_size - 1) / f.world_size;
    const int64_t begin = f.rank * slice, end = begin + slice;
    std::vector<ckpt::FlatPiece> wanted;
    for (uint32_t id : {0u, 1u}) {
      const int64_t start = id == 0 ? 0 : numel + gap;  // of the tensor in the parameter
      const int64_t lo = std::max(begin, start), hi = std::min(end, start + numel);
      if (lo < hi) {
        wanted.push_back({fmt::format("layer{}.weight", id), {f.rows, f.cols}, {lo - start, hi - start}, lo - begin});
      }
    }
    auto shard = c.AllocateFlatShard("F32", slice, wanted);
    if (!shard.ok()) {
      std::cout << "error: " << ckpt::Message(shard.status()) << "\n";
      std::exit(2);
    }
    for (size_t i = 0; i < wanted.size(); ++i) {
      const uint32_t id = wanted[i].name == "layer0.weight" ? 0 : 1;
      pieces.push_back({shard->pieces[i], id, {f.rows, f.cols}, {}, {}, wanted[i].range});
    }
  }
  for (uint32_t id : {0u, 1u}) {
    if (f.layout == "flat") break;
    // Tensor 1 is split the other way, so that one save holds both placements.
    bool by_rows = (f.layout == "rows") == (id == 0);
    std::vector<int64_t> global = {f.rows, f.cols};
    auto [b, e] = Split(by_rows ? f.rows : f.cols, f.rank, f.world_size);
    if (by_rows) {
      add(fmt::format("layer{}.weight", id), id, global, {b, 0}, {e - b, f.cols});
    } else {
      add(fmt::format("layer{}.weight", id), id, global, {0, b}, {f.rows, e - b});
    }
  }
  add("replicated", 2, {4096}, {0}, {4096});
  add("scalar", 3, {}, {}, {});
  add("optim.replicated.exp_avg", 4, {64}, {0}, {64});  // optimizer state, by its name
  if (absl::Status s = c.Register(); !s.ok()) {
    std::cout << "error: " << ckpt::Message(s) << "\n";
    std::exit(2);
  }
  return pieces;
}

std::unique_ptr<ckpt::Client> Connect(const Flags& f) {
  auto c = ckpt::Client::Connect({.socket = f.socket, .job = f.job, .rank = f.rank,
                                  .world_size = f.world_size});
  if (!c.ok()) {
    std::cout << "error: " << ckpt::Message(c.status()) << "\n";
    std::exit(2);
  }
  return std::move(*c);
}

int Save(const Flags& f) {
  auto c = Connect(f);
  const std::vector<Piece> pieces = Setup(*c, f);
  const std::vector<uint64_t> steps = f.steps_list.empty() ? std::vector<uint64_t>{f.step} : f.steps_list;
  absl::StatusOr<ckpt::TicketStatus> done;
  for (uint64_t step : steps) {
    for (const Piece& p : pieces) {
      auto* data = static_cast<uint32_t*>(p.tensor->data);
      ForEach(p, [&](int64_t i, uint64_t g) { data[i] = Global(f, p.id, g, step); });
    }
    auto ticket = c->Snapshot(step, {{"rank", std::to_string(f.rank)}},
                              {{"note", fmt::format("rank={}", f.rank)}});
    if (!ticket.ok()) {
      std::cout << "error: " << ckpt::Message(ticket.status()) << "\n";
      return 2;
    }
    // The next step's values go in only once this one is staged (several steps: committed).
    done = f.wait_committed || steps.size() > 1 ? c->WaitCommitted(*ticket) : c->WaitStaged(*ticket);
    if (!done.ok()) {
      std::cout << "error: " << ckpt::Message(done.status()) << "\n";
      return 3;
    }
  }
  std::cout << "saved " << ckpt::ToString(done->state) << " " << done->error << "\n";
  return 0;
}

int Check(const Flags& f) {
  auto c = Connect(f);
  std::vector<Piece> pieces = Setup(*c, f);
  for (const Piece& p : pieces) std::memset(p.tensor->data, 0x5A, p.tensor->nbytes);
  std::optional<uint64_t> step;
  if (f.has_step) step = f.step;
  auto r = c->Restore(step);
  if (!r.ok()) {
    std::cout << "error: " << ckpt::Message(r.status()) << "\n";
    return 2;
  }
  if (!r->found) {
    std::cout << "nothing to restore\n";
    return 3;
  }
  std::cout << fmt::format("restored step={} source={} bytes={}\n", r->step,
                           ckpt::RestoreSourceName(r->source),
                           r->bytes);
  // Train state and metadata: this rank's where the save had it, rank 0's otherwise.
  uint32_t from = f.rank < f.saved_world_size ? f.rank : 0;
  if (r->train_state["note"] != fmt::format("rank={}", from) ||
      r->metadata["rank"] != std::to_string(from)) {
    std::cout << "mismatch train state: " << r->train_state["note"] << "\n";
    return 1;
  }
  for (const Piece& p : pieces) {
    const auto* data = static_cast<const uint32_t*>(p.tensor->data);
    int64_t bad = -1;
    ForEach(p, [&](int64_t i, uint64_t g) {
      if (bad < 0 && data[i] != Global(f, p.id, g, r->step)) bad = i;
    });
    if (bad >= 0) {
      std::cout << "mismatch tensor=" << p.tensor->name << " element=" << bad << "\n";
      return 1;
    }
  }
  std::cout << "match\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"reshard_helper"};
  app.require_subcommand(1);
  app.add_option("--socket", f.socket)->required();
  app.add_option("--job", f.job);
  app.add_option("--rank", f.rank);
  app.add_option("--world-size", f.world_size);
  app.add_option("--layout", f.layout)->check(CLI::IsMember({"rows", "cols", "flat"}));
  app.add_option("--rows", f.rows);
  app.add_option("--cols", f.cols);
  auto* save = app.add_subcommand("save");
  save->add_option("--step", f.step);
  save->add_flag("--wait-committed", f.wait_committed);
  save->add_option("--steps-list", f.steps_list, "save these steps in turn (one session)")->delimiter(',');
  app.add_option("--changed-rows", f.changed_rows, "rows of the 2-D tensors that change from step to step");
  auto* check = app.add_subcommand("check");
  check->add_option("--step", f.step)->each([&](const std::string&) { f.has_step = true; });
  check->add_option("--saved-world-size", f.saved_world_size)->required();
  CLI11_PARSE(app, argc, argv);
  return save->parsed() ? Save(f) : Check(f);
}
