// A scriptable trainer for integration tests: saves tensors of several dtypes filled with a
// seeded pattern, checks restores bit for bit, and sends hand-made (bad) requests.
#include <grp.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <iostream>
#include <iterator>

#include "client/ckpt_client.h"
#include "common/fd_passing.h"
#include "common/status.h"
#include "proto/admin.grpc.pb.h"
#include "proto/trainer.grpc.pb.h"
#include "shm/arena.h"
#include "tests/integration/sparse_table.h"

namespace {

struct Flags {
  std::string socket, job = "job", dump, bad_case, target, session, victim_token, victim_arena;
  std::string start_file;  // save: registered, snapshot only once this file exists
  int hold_seconds = 30;
  int count = 40;
  uint64_t steps = 30, interval_ms = 300;
  uint32_t rank = 0, world_size = 1;
  uint64_t step = 10, seed = 1, bytes = 1 << 20;
  uint32_t upload_every_steps = 0;
  bool die_after_staged = false, wait_committed = false, has_step = false;
  bool bad_metadata = false;  // metadata that is not text
  bool copy_on_write = false;
  int as_uid = -1;
  int extra_gid = -1;  // a supplementary group to keep after dropping to --as-uid
  // save-steps: the steps one session saves; --changed-bytes: only the first N bytes of
  // model.a change from step to step (they hold the step number), the rest is the seed's.
  std::vector<uint64_t> steps_list;
  uint64_t changed_bytes = 0;
  bool restore_first = false;  // save-steps: restore the newest step first, as a resumed trainer
  // save-steps: once the first step committed, wait for this file (at most 2 minutes) before
  // the next ones: the test decides when the same session saves again.
  std::string then_wait_for;
  // Tensors registered frozen (Tensor::frozen). save-steps --poke-frozen-at S: from step S
  // on, the first of them has its byte 0 changed in place (user code that should not have);
  // check --poked: expect that byte so.
  std::vector<std::string> frozen;
  uint64_t poke_frozen_at = 0;
  bool poked = false;
  // An embedding-like table "emb.weight" of --table-rows rows of --row-bytes (F32), sharded
  // by rows across ranks, registered after the other tensors when --table-rows is set; at
  // every training step --sparse-rows % of its rows change, at random rows
  // (tests/integration/sparse_table.h).
  uint64_t table_rows = 0, row_bytes = 4096;
  double sparse_rows = 0;
  bool table_sparse = false;  // --table-sparse: the table is registered sparse (TensorSpec.sparse)
  // save-loop: a snapshot every --save-every steps, --step-sleep-ms after each step.
  uint64_t save_every = 5;
  uint32_t step_sleep_ms = 0;
};

struct Spec {
  const char* name;
  const char* dtype;
  size_t itemsize;
  int share;  // eighths of --bytes
};
constexpr Spec kSpecs[] = {{"model.a", "F32", 4, 4}, {"model.b", "I64", 8, 2}, {"optim.c", "BF16", 2, 2}};

uint8_t Pattern(uint64_t seed, size_t tensor, size_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ULL ^ (seed * 0xC2B2AE3D27D4EB4FULL) ^ (tensor << 56);
  x ^= x >> 29;
  return static_cast<uint8_t>(x * 0xBF58476D1CE4E5B9ULL >> 56);
}

// Hands `fds` to ckptd's descriptor socket as the client does; the answer's text ("ok
// <token>", or why not).
std::string HandOver(const std::string& socket, const std::vector<int>& fds) {
  auto answer = ckpt::RequestFds(ckpt::DescriptorSocketPath(socket), ckpt::kDepositArenas, 0, fds);
  return answer.ok() ? answer->payload : "error: " + ckpt::Message(answer.status());
}

std::string TokenOf(const std::string& answer) {
  return answer.rfind(ckpt::kDepositAccepted, 0) == 0 ? answer.substr(ckpt::kDepositAccepted.size())
                                                      : std::string();
}

std::unique_ptr<ckpt::Client> Connect(const Flags& f) {
  ckpt::ClientOptions options{.socket = f.socket, .job = f.job, .rank = f.rank,
                              .world_size = f.world_size, .copy_on_write = f.copy_on_write};
  if (f.upload_every_steps != 0) options.upload = {.every_steps = f.upload_every_steps};
  // Room for a large table beside the other tensors.
  options.arena_bytes = std::max<size_t>(options.arena_bytes, f.bytes + f.table_rows * f.row_bytes + (1u << 20));
  auto c = ckpt::Client::Connect(options);
  if (!c.ok()) {
    std::cout << "error: " << ckpt::Message(c.status()) << "\n";
    std::exit(2);
  }
  return std::move(*c);
}

// Setup's tensors: kSpecs, a scalar, a tiny one, then the table when there is one.
constexpr size_t kTableIndex = std::size(kSpecs) + 2;

// The pattern every tensor but the table holds, for `step` when only the first
// --changed-bytes of model.a change (their bytes: the step number).
void Fill(const std::vector<ckpt::Tensor*>& tensors, const Flags& f, uint64_t step) {
  for (size_t t = 0; t < std::min(tensors.size(), kTableIndex); ++t) {
    auto* p = static_cast<uint8_t*>(tensors[t]->data);
    for (size_t i = 0; i < tensors[t]->nbytes; ++i) p[i] = Pattern(f.seed, t, i);
  }
  if (f.changed_bytes != 0) {
    std::memset(tensors[0]->data, static_cast<int>(step & 0xff), std::min<size_t>(f.changed_bytes, tensors[0]->nbytes));
  }
  if (f.poke_frozen_at != 0 && step >= f.poke_frozen_at) {
    for (size_t t = 0; t < tensors.size(); ++t) {
      if (tensors[t]->name != f.frozen.front()) continue;
      static_cast<uint8_t*>(tensors[t]->data)[0] = static_cast<uint8_t>(~Pattern(f.seed, t, 0));
    }
  }
}

// Allocates the standard tensors (plus a scalar and a tiny one) and registers them.
std::vector<ckpt::Tensor*> Setup(ckpt::Client& c, const Flags& f) {
  std::vector<ckpt::Tensor*> out;
  for (const Spec& s : kSpecs) {
    int64_t n = static_cast<int64_t>(f.bytes * s.share / 8 / s.itemsize);
    // Sharded along dim 0 across ranks: the manifest records the placement.
    auto t = c.AllocateTensor(s.name, s.dtype, {n}, {n * f.world_size}, {n * f.rank});
    if (!t.ok()) {
      std::cout << "error: " << ckpt::Message(t.status()) << "\n";
      std::exit(2);
    }
    out.push_back(*t);
  }
  out.push_back(*c.AllocateTensor("step_scalar", "F32", {}));
  out.push_back(*c.AllocateTensor("tiny", "U8", {3}));
  if (f.table_rows != 0) {
    const auto rows = static_cast<int64_t>(f.table_rows), cols = static_cast<int64_t>(f.row_bytes / 4);
    auto t = c.AllocateTensor("emb.weight", "F32", {rows, cols}, {rows * f.world_size, cols},
                              {rows * f.rank, 0});
    if (!t.ok()) {
      std::cout << "error: " << ckpt::Message(t.status()) << "\n";
      std::exit(2);
    }
    if (f.table_sparse) {
      if (absl::Status s = c.MarkSparse("emb.weight"); !s.ok()) {
        std::cout << "error: " << ckpt::Message(s) << "\n";
        std::exit(2);
      }
    }
    out.push_back(*t);
  }
  for (const std::string& name : f.frozen) {
    if (absl::Status s = c.Freeze(name); !s.ok()) {
      std::cout << "error: " << ckpt::Message(s) << "\n";
      std::exit(2);
    }
  }
  if (absl::Status s = c.Register(); !s.ok()) {
    std::cout << "error: " << ckpt::Message(s) << "\n";
    std::exit(2);
  }
  return out;
}

// The table of Setup's tensors, when there is one; its rows change per rank.
std::optional<ckpt::testing::SparseTable> TableOf(const std::vector<ckpt::Tensor*>& tensors, const Flags& f) {
  if (tensors.size() <= kTableIndex) return std::nullopt;
  return ckpt::testing::SparseTable(tensors[kTableIndex]->data, f.table_rows, f.row_bytes, f.seed * 1000 + f.rank,
                                    f.sparse_rows);
}

// "" when every tensor holds what it held at `step` (Fill's pattern, the table's content at
// that step), else the first byte that does not ("mismatch tensor=... byte=...").
std::string Mismatch(const std::vector<ckpt::Tensor*>& tensors, const Flags& f, uint64_t step) {
  for (size_t t = 0; t < std::min(tensors.size(), kTableIndex); ++t) {
    auto* p = static_cast<const uint8_t*>(tensors[t]->data);
    for (size_t i = 0; i < tensors[t]->nbytes; ++i) {
      uint8_t expected = t == 0 && i < f.changed_bytes ? static_cast<uint8_t>(step & 0xff) : Pattern(f.seed, t, i);
      if (f.poked && i == 0 && tensors[t]->name == f.frozen.front()) expected = static_cast<uint8_t>(~expected);
      if (p[i] != expected) return fmt::format("mismatch tensor={} byte={}", tensors[t]->name, i);
    }
  }
  if (auto table = TableOf(tensors, f)) {
    if (int64_t at = table->FirstMismatch(tensors[kTableIndex]->data, step); at >= 0) {
      return fmt::format("mismatch tensor=emb.weight byte={}", at);
    }
  }
  return "";
}

int Save(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  for (size_t t = 0; t < tensors.size(); ++t) {
    auto* p = static_cast<uint8_t*>(tensors[t]->data);
    for (size_t i = 0; i < tensors[t]->nbytes; ++i) p[i] = Pattern(f.seed, t, i);
    if (!f.dump.empty()) {
      std::ofstream(f.dump + "/" + tensors[t]->name + ".bin", std::ios::binary)
          .write(static_cast<const char*>(tensors[t]->data), static_cast<std::streamsize>(tensors[t]->nbytes));
    }
  }
  if (!f.start_file.empty()) {
    // A trainer that registered long before it saves: the test decides when.
    std::cout << "registered, waiting for " << f.start_file << std::endl;
    for (int i = 0; i < 3000 && ::access(f.start_file.c_str(), F_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ckpt::Metadata metadata = {{"seed", std::to_string(f.seed)}};
  if (f.bad_metadata) metadata["\xff\xfe"] = "\xc0\xaf";
  auto ticket = c->Snapshot(f.step, metadata,
                            {{"note", fmt::format("seed={} rank={}", f.seed, f.rank)}});
  if (!ticket.ok()) {
    std::cout << "error: " << ckpt::Message(ticket.status()) << "\n";
    return 2;
  }
  auto staged = c->WaitStaged(*ticket);
  // Committed is staged too: on a loaded machine every rank may be written and the step
  // decided before this process wakes up to look.
  if (!staged.ok() ||
      (staged->state != ckpt::TicketState::kStaged && staged->state != ckpt::TicketState::kCommitted)) {
    std::cout << "not staged: " << (staged.ok() ? ckpt::ToString(staged->state) + std::string(" ") + staged->error
                                                : ckpt::Message(staged.status()))
              << "\n";
    return 3;
  }
  std::cout << "staged ticket=" << *ticket << std::endl;
  if (f.die_after_staged) ::raise(SIGKILL);
  // Mutating right after "staged" must not change the checkpoint.
  for (auto* t : tensors) std::memset(t->data, 0xAB, t->nbytes);
  if (f.wait_committed) {
    auto done = c->WaitCommitted(*ticket);
    if (!done.ok()) {
      std::cout << "error: " << ckpt::Message(done.status()) << "\n";
      return 4;
    }
    std::cout << ckpt::ToString(done->state) << " " << done->error << std::endl;
    return done->state == ckpt::TicketState::kCommitted ? 0 : 5;
  }
  return 0;
}

// One session saves every step of --steps-list (as a training loop does, so that with
// --increments on each save after the first has a base), waiting for each to commit; prints
// "committed S" per step. Exit 5 on a step that fails.
int SaveSteps(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  if (f.restore_first) {
    auto r = c->Restore();
    if (!r.ok() || !r->found) {
      std::cout << "restore: " << (r.ok() ? "nothing to restore" : ckpt::Message(r.status())) << "\n";
      return 3;
    }
    std::cout << fmt::format("restored step={} source={}", r->step, ckpt::RestoreSourceName(r->source)) << std::endl;
  }
  auto table = TableOf(tensors, f);
  for (uint64_t step : f.steps_list) {
    Fill(tensors, f, step);
    if (table) table->AdvanceTo(step);
    auto ticket = c->Snapshot(step, {{"seed", std::to_string(f.seed)}},
                              {{"note", fmt::format("seed={} rank={}", f.seed, f.rank)}});
    if (!ticket.ok()) {
      std::cout << "error: " << ckpt::Message(ticket.status()) << "\n";
      return 2;
    }
    auto done = c->WaitCommitted(*ticket);
    if (!done.ok() || done->state != ckpt::TicketState::kCommitted) {
      std::cout << "step " << step << " failed: " << (done.ok() ? done->error : ckpt::Message(done.status())) << "\n";
      return 5;
    }
    std::cout << "committed " << step << std::endl;
    if (!f.then_wait_for.empty() && step == f.steps_list.front()) {
      for (int i = 0; i < 6000 && ::access(f.then_wait_for.c_str(), F_OK) != 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  return 0;
}

// A training loop for crash tests (kill_loop_test), the trainer_helper twin of
// example_trainer: with --restore-first it restores the newest step and checks it bit for
// bit ("resumed step=N source=S", exit 1 on a mismatch) or prints "starting at step 0";
// then trains steps start+1 .. --steps, each --step-sleep-ms long, snapshotting every
// --save-every with the content of that step (Fill's pattern, --changed-bytes of model.a
// holding the step, the table's rows drawn so far), and prints "committed step=N" as each
// commits. A ckptd that restarts is registered with again by Snapshot().
int SaveLoop(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  auto table = TableOf(tensors, f);
  uint64_t start = 0;
  if (f.restore_first) {
    auto r = c->Restore();
    if (!r.ok()) {
      std::cout << "error: restore failed: " << ckpt::Message(r.status()) << std::endl;
      return 2;
    }
    if (r->found) {
      if (std::string mismatch = Mismatch(tensors, f, r->step); !mismatch.empty()) {
        std::cout << "restored step=" << r->step << ": " << mismatch << std::endl;
        return 1;
      }
      start = r->step;
      std::cout << fmt::format("resumed step={} source={}", start, ckpt::RestoreSourceName(r->source)) << std::endl;
    } else {
      std::cout << "starting at step 0" << std::endl;
    }
  }
  std::map<uint64_t, uint64_t> outstanding;  // ticket -> step, until it ends
  std::optional<uint64_t> last;
  for (uint64_t step = start + 1; step <= f.steps; ++step) {
    if (f.save_every != 0 && step % f.save_every == 0) {
      // The buffers change only once the last snapshot is staged (or has failed).
      if (last) (void)c->WaitStaged(*last);
      Fill(tensors, f, step);
      if (table) table->AdvanceTo(step);
      const std::string session = c->session_id();
      auto ticket = c->Snapshot(step, {{"seed", std::to_string(f.seed)}},
                                {{"note", fmt::format("seed={} rank={}", f.seed, f.rank)}});
      if (c->session_id() != session) outstanding.clear();  // tickets died with the old ckptd
      last.reset();
      if (ticket.ok()) {
        last = *ticket;
        outstanding[*ticket] = step;
      }
    }
    for (auto it = outstanding.begin(); it != outstanding.end();) {
      const ckpt::TicketStatus st = c->Poll(it->first);
      if (st.state == ckpt::TicketState::kCommitted) {
        std::cout << fmt::format("committed step={}", it->second) << std::endl;
      } else if (st.state != ckpt::TicketState::kFailed && st.state != ckpt::TicketState::kRejected &&
                 st.state != ckpt::TicketState::kAbandoned && st.state != ckpt::TicketState::kUnknown) {
        ++it;
        continue;
      }
      it = outstanding.erase(it);
    }
    if (f.step_sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(f.step_sleep_ms));
  }
  return 0;
}

// A training loop that saves by time: asks ckptd at every step, snapshots when told, and
// prints the steps it saved ("saved: 4 9 13") and how the last one ended. Ranks are made to
// reach steps at different moments: rank r starts 70 ms x r late and its steps take
// 25 ms + 20 ms x (step mod (r + 1)).
int TrainByTime(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  std::this_thread::sleep_for(std::chrono::milliseconds(70 * f.rank));
  std::vector<uint64_t> saved;
  std::optional<uint64_t> last;
  for (uint64_t step = 1; step <= f.steps; ++step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25 + 20 * (step % (f.rank + 1))));
    for (auto* t : tensors) std::memset(t->data, static_cast<int>(step), t->nbytes);
    auto save = c->ShouldSave(step, std::chrono::milliseconds(f.interval_ms));
    if (!save.ok()) {
      std::cout << "error: " << ckpt::Message(save.status()) << "\n";
      return 2;
    }
    if (!*save) continue;
    auto ticket = c->Snapshot(step);
    if (!ticket.ok()) {
      std::cout << "error: " << ckpt::Message(ticket.status()) << "\n";
      return 2;
    }
    if (!c->WaitStaged(*ticket).ok()) return 3;
    saved.push_back(step);
    last = *ticket;
  }
  std::cout << "saved:";
  for (uint64_t step : saved) std::cout << " " << step;
  std::cout << std::endl;
  if (!last) return 0;
  auto done = c->WaitCommitted(*last);
  if (!done.ok()) return 4;
  std::cout << ckpt::ToString(done->state) << std::endl;
  return done->state == ckpt::TicketState::kCommitted ? 0 : 5;
}

// Session updates through the real daemon: refused updates (each printed with its status
// code) change nothing, then a real one (model.a grows, model.b goes, extra.c comes) and a
// snapshot of each state, committed. Prints one line per attempt.
int UpdateSession(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  auto attempt = [&](const char* what, auto fill) {
    ::ckptd::v1::UpdateRequest req;
    req.set_session_id(c->session_id());
    req.set_first_arena(1);  // Setup's tensors fit the client's first arena
    fill(req);
    grpc::ClientContext ctx;
    ::ckptd::v1::UpdateReply reply;
    grpc::Status s = stub->Update(&ctx, req, &reply);
    std::cout << what << ": code=" << s.error_code() << " " << s.error_message() << "\n";
  };
  auto spec = [](::ckptd::v1::UpdateRequest& r, const std::string& name, uint32_t arena) {
    auto* t = r.add_tensors();
    t->set_name(name);
    t->set_dtype("U8");
    t->add_shape(4);
    t->set_nbytes(4);
    t->set_arena(arena);
  };
  attempt("nothing", [](auto&) {});
  attempt("unknown-removed", [&](auto& r) {
    spec(r, "extra.ok", 0);  // valid on its own: must not stay behind
    r.add_removed("no.such");
  });
  attempt("twice", [&](auto& r) {
    spec(r, "extra.x", 0);
    spec(r, "extra.x", 0);
  });
  attempt("bad-arena", [&](auto& r) { spec(r, "extra.y", 99); });
  attempt("all-removed", [&](auto& r) {
    for (const auto* t : tensors) r.add_removed(t->name);
  });
  attempt("arena-numbering", [&](auto& r) {
    spec(r, "extra.z", 0);
    r.set_first_arena(7);
  });
  attempt("foreign-session", [&](auto& r) { r.set_session_id("0123456789abcdef0123456789abcdef"); });
  auto commit = [&](uint64_t step) {
    auto ticket = c->Snapshot(step);
    if (!ticket.ok()) return std::string("error: ") + ckpt::Message(ticket.status());
    auto done = c->WaitCommitted(*ticket);
    return done.ok() ? std::string(ckpt::ToString(done->state)) : ckpt::Message(done.status());
  };
  std::cout << "step " << f.step << ": " << commit(f.step) << "\n";
  // model.a grows to twice its rows; model.b is dropped; extra.c is new.
  const ckpt::Tensor* a = tensors[0];
  std::vector<int64_t> grown = a->shape;
  grown[0] *= 2;
  auto bigger = c->AllocateTensor(a->name, a->dtype, grown);
  auto extra = c->AllocateTensor("extra.c", "I32", {3});
  if (!bigger.ok() || !extra.ok()) return 2;
  std::memset((*bigger)->data, 0x11, (*bigger)->nbytes);
  std::memset((*extra)->data, 0x22, (*extra)->nbytes);
  if (absl::Status removed = c->RemoveTensor("model.b"); !removed.ok()) return 2;
  absl::Status updated = c->Update();
  std::cout << "update: " << (updated.ok() ? "ok" : ckpt::Message(updated)) << "\n";
  std::cout << "step " << f.step + 1 << ": " << commit(f.step + 1) << "\n";
  return updated.ok() ? 0 : 3;
}

int Check(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  // A refused restore must leave the trainer's buffers as they were.
  for (auto* t : tensors) std::memset(t->data, 0x5A, t->nbytes);
  std::optional<uint64_t> step;
  if (f.has_step) step = f.step;
  auto r = c->Restore(step);
  if (!r.ok()) {
    bool untouched = true;
    for (auto* t : tensors) {
      const auto* p = static_cast<const uint8_t*>(t->data);
      untouched = untouched && std::all_of(p, p + t->nbytes, [](uint8_t b) { return b == 0x5A; });
    }
    std::cout << "error: " << ckpt::Message(r.status()) << "\n"
              << (untouched ? "buffers untouched" : "buffers overwritten") << "\n";
    return 2;
  }
  if (!r->found) {
    std::cout << "nothing to restore\n";
    return 3;
  }
  for (const std::string& w : r->warnings) std::cout << "warning: " << w << "\n";
  std::cout << fmt::format("restored step={} source={} bytes={}\n", r->step,
                           ckpt::RestoreSourceName(r->source), r->bytes);
  std::string note = fmt::format("seed={} rank={}", f.seed, f.rank);
  if (r->train_state["note"] != note) {
    std::cout << "mismatch train state: " << r->train_state["note"] << "\n";
    return 1;
  }
  if (std::string mismatch = Mismatch(tensors, f, r->step); !mismatch.empty()) {
    std::cout << mismatch << "\n";
    return 1;
  }
  std::cout << "match\n";
  return 0;
}

// Hand-made Register requests that a correct daemon must refuse.
int RegisterBad(const Flags& f) {
  const std::string& c = f.bad_case;
  // "big-arena": more arena memory than a small daemon's budget for one user.
  auto arena = *ckpt::shm::Arena::Create(c == "big-arena" ? (64u << 20) : (1u << 20));
  ::ckptd::v1::RegisterRequest req;
  req.set_job(f.job);
  req.set_rank(f.rank);
  req.set_world_size(f.world_size);
  req.set_pid(::getpid());
  auto* t = req.add_tensors();
  t->set_name("w");
  t->set_dtype("F32");
  t->add_shape(16);
  t->set_arena(0);
  t->set_offset(0);
  t->set_nbytes(64);
  // What the trainer hands over: its arena, unless the case says otherwise.
  std::vector<int> handed = {arena->fd()};
  if (c == "same-arena-twice") {
    handed = {arena->fd(), arena->fd()};  // two descriptors, one memory
    auto* u = req.add_tensors();
    *u = *t;
    u->set_name("u");
    u->set_arena(1);
  }
  ckpt::UniqueFd other;
  if (c == "unsealed-arena" || c == "sparse-arena") {
    other.reset(::memfd_create("hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    (void)::ftruncate(other.get(), 1 << 20);
    if (c == "sparse-arena") (void)::fcntl(other.get(), F_ADD_SEALS, F_SEAL_SHRINK);
    handed = {other.get()};
  } else if (c == "pipe-arena") {
    int p[2];
    if (::pipe(p) != 0) return 65;
    other.reset(p[0]);
    ::close(p[1]);
    handed = {other.get()};
  }
  if (c != "no-arenas") {
    std::string answer = HandOver(f.socket, handed);
    if (TokenOf(answer).empty()) {
      std::cout << "handover refused: " << answer << "\n";
      return 0;
    }
    req.add_arena_tokens(TokenOf(answer));
  }
  if (c == "wrong-size") t->set_nbytes(60);
  else if (c == "bad-dtype") t->set_dtype("F99");
  else if (c == "outside-segment") t->set_offset((1 << 20) - 32);
  else if (c == "duplicate-name") *req.add_tensors() = *t;
  else if (c == "reserved-name") t->set_name("__metadata__");
  else if (c == "flat-past-end" || c == "flat-overlap" || c == "flat-with-offset") {
    // Flat shards (FSDP): 16 elements of a global tensor of 20, in two ranges.
    t->add_global_shape(20);
    auto range = [&](int64_t b, int64_t e) {
      auto* r = t->add_flat_ranges();
      r->set_begin(b);
      r->set_end(e);
    };
    if (c == "flat-past-end") range(0, 4), range(8, 20 + 4);
    if (c == "flat-overlap") range(0, 10), range(4, 10);
    if (c == "flat-with-offset") range(0, 16), t->add_global_offset(0);
  }
  else if (c == "missing-arena") t->set_arena(1);
  else if (c == "unknown-token") req.set_arena_tokens(0, "0123456789abcdef0123456789abcdef");
  else if (c == "reused-token") {
    req.add_tensors()->CopyFrom(*t);
    ::ckptd::v1::RegisterRequest first = req;
    first.mutable_tensors()->RemoveLast();
    first.set_job(f.job + "-first");
    auto stub = ::ckptd::v1::Trainer::NewStub(
        grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ::ckptd::v1::RegisterReply reply;
    if (!stub->Register(&ctx, first, &reply).ok()) return 66;  // the token's one use
    req.mutable_tensors()->RemoveLast();
  }
  else if (c == "bad-rank") req.set_rank(f.world_size);
  else if (c == "bad-upload-interval") req.mutable_upload()->set_interval_seconds(-1);
  else if (c == "cuda-on-host-daemon") {
    t->mutable_cuda()->set_ipc_handle(std::string(64, '\x01'));
    t->mutable_cuda()->set_allocation_bytes(1 << 20);
    t->mutable_cuda()->set_device_uuid("GPU-00000000-0000-0000-0000-000000000000");
  }
  else if (c != "bad-job" && c != "none" && c != "no-arenas" && c != "unsealed-arena" &&
           c != "sparse-arena" && c != "pipe-arena" && c != "same-arena-twice" &&
           c != "big-arena") {
    return 64;
  }
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ::ckptd::v1::RegisterReply reply;
  grpc::Status s = stub->Register(&ctx, req, &reply);
  std::cout << "code=" << s.error_code() << " message=" << s.error_message() << "\n";
  return s.ok() ? 1 : 0;
}

// Calls that name sessions and tickets the daemon never issued.
int Unknown(const Flags& f) {
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ::ckptd::v1::WaitRequest req;
    req.set_session_id("no-such-session");
    req.set_ticket(1);
    ::ckptd::v1::WaitReply reply;
    grpc::Status s = stub->Wait(&ctx, req, &reply);
    std::cout << "wait-session code=" << s.error_code() << " message=" << s.error_message() << "\n";
  }
  {
    grpc::ClientContext ctx;
    ::ckptd::v1::RestoreRequest req;
    req.set_session_id("no-such-session");
    ::ckptd::v1::RestoreReply reply;
    grpc::Status s = stub->Restore(&ctx, req, &reply);
    std::cout << "restore-session code=" << s.error_code() << " message=" << s.error_message() << "\n";
  }
  auto c = Connect(f);
  Setup(*c, f);
  grpc::ClientContext ctx;
  ::ckptd::v1::WaitRequest req;
  req.set_session_id(c->session_id());
  req.set_ticket(4242);
  req.set_timeout_ms(1000);
  ::ckptd::v1::WaitReply reply;
  grpc::Status s = stub->Wait(&ctx, req, &reply);
  std::cout << "wait-ticket code=" << s.error_code() << " message=" << s.error_message() << "\n";
  ckpt::TicketStatus polled = c->Poll(4242);
  std::cout << "poll-ticket state=" << ckpt::ToString(polled.state) << " error=" << polled.error << "\n";
  return 0;
}

// A GPU tensor from a process where CUDA is unusable: refused before any request is sent.
int AddCuda(const Flags& f) {
  auto c = Connect(f);
  auto t = c->AddCudaTensor("gpu.weight", "BF16", {1024}, reinterpret_cast<void*>(0x7f0000000000));
  if (t.ok()) {
    std::cout << "accepted\n";
    return 1;
  }
  std::cout << "error: " << ckpt::Message(t.status()) << "\n";
  return 0;
}

// The RPC snapshot path, as a generic gRPC tool would use it.
int RpcSnapshot(const Flags& f) {
  auto c = Connect(f);
  auto tensors = Setup(*c, f);
  for (size_t t = 0; t < tensors.size(); ++t) {
    auto* p = static_cast<uint8_t*>(tensors[t]->data);
    for (size_t i = 0; i < tensors[t]->nbytes; ++i) p[i] = Pattern(f.seed, t, i);
  }
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ::ckptd::v1::SnapshotRequest req;
  req.set_session_id(c->session_id());
  req.set_step(f.step);
  auto* blob = req.add_train_state();
  blob->set_name("note");
  blob->set_data(fmt::format("seed={} rank={}", f.seed, f.rank));
  ::ckptd::v1::SnapshotReply reply;
  grpc::Status s = stub->Snapshot(&ctx, req, &reply);
  if (!s.ok()) {
    std::cout << "error: " << s.error_message() << "\n";
    return 2;
  }
  grpc::ClientContext wctx;
  ::ckptd::v1::WaitRequest wreq;
  wreq.set_session_id(c->session_id());
  wreq.set_ticket(reply.ticket());
  wreq.set_until_committed(true);
  wreq.set_timeout_ms(30000);
  ::ckptd::v1::WaitReply wreply;
  s = stub->Wait(&wctx, wreq, &wreply);
  std::cout << "ticket=" << reply.ticket() << " state=" << ::ckptd::v1::TicketState_Name(wreply.state())
            << " grpc=" << s.error_code() << "\n";
  return s.ok() && wreply.state() == ::ckptd::v1::TICKET_COMMITTED ? 0 : 1;
}

const char* CodeName(grpc::StatusCode code) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                 "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  return code >= 0 && code <= 16 ? kNames[code] : "?";
}

// Asks ckptd's control socket for a session's control block (and ckptd's liveness pipe),
// as the client does.
absl::StatusOr<ckpt::ReceivedFds> FetchControl(const std::string& socket, const std::string& session) {
  return ckpt::RequestFds(ckpt::DescriptorSocketPath(socket),
                          std::string(ckpt::kFetchControlBlock) + session, 2);
}

// Registers one tensor in an arena of its own, prints the session, where its arena can be
// seen (/proc/<pid>/fd/<n>) and the token of a second arena it handed over but has not
// registered yet, and stays alive (a victim for the tests that try to act on another's
// session or memory).
int Hold(const Flags& f) {
  auto arena = *ckpt::shm::Arena::Create(1 << 20);
  auto spare = *ckpt::shm::Arena::Create(1 << 20);
  std::string token = TokenOf(HandOver(f.socket, {arena->fd()}));
  std::string spare_token = TokenOf(HandOver(f.socket, {spare->fd()}));
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  ::ckptd::v1::RegisterRequest req;
  req.set_job(f.job);
  req.set_world_size(f.world_size);
  req.set_rank(f.rank);
  req.set_pid(::getpid());
  auto* t = req.add_tensors();
  t->set_name("w");
  t->set_dtype("U8");
  t->add_shape(64);
  t->set_nbytes(64);
  req.add_arena_tokens(token);
  grpc::ClientContext ctx;
  ::ckptd::v1::RegisterReply reply;
  grpc::Status s = stub->Register(&ctx, req, &reply);
  if (!s.ok()) {
    std::cout << "error: " << s.error_message() << std::endl;
    return 2;
  }
  // Its own control block: it may map it, never shrink it.
  auto control = FetchControl(f.socket, reply.session_id());
  if (control.ok() && control->fds.size() == 2) {
    bool refused = ::ftruncate(control->fds[0].get(), 0) != 0 && errno == EPERM;
    std::cout << "truncate-control=" << (refused ? "EPERM" : "ALLOWED") << "\n";
  } else {
    std::cout << "truncate-control=no control block\n";
  }
  std::cout << "session=" << reply.session_id() << "\nspare-token=" << spare_token
            << "\narena=/proc/" << ::getpid() << "/fd/" << arena->fd() << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(f.hold_seconds));
  return 0;
}

// Tries to use a session it did not register and to register memory it does not own.
int Steal(const Flags& f) {
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ::ckptd::v1::SnapshotRequest req;
    req.set_session_id(f.session);
    req.set_step(99);
    ::ckptd::v1::SnapshotReply reply;
    grpc::Status s = stub->Snapshot(&ctx, req, &reply);
    std::cout << "snapshot code=" << CodeName(s.error_code()) << " " << s.error_message() << "\n";
  }
  {
    grpc::ClientContext ctx;
    ::ckptd::v1::RestoreRequest req;
    req.set_session_id(f.session);
    ::ckptd::v1::RestoreReply reply;
    grpc::Status s = stub->Restore(&ctx, req, &reply);
    std::cout << "restore code=" << CodeName(s.error_code()) << " " << s.error_message() << "\n";
  }
  {
    grpc::ClientContext ctx;
    ::ckptd::v1::UnregisterRequest req;
    req.set_session_id(f.session);
    ::ckptd::v1::UnregisterReply reply;
    grpc::Status s = stub->Unregister(&ctx, req, &reply);
    std::cout << "unregister code=" << CodeName(s.error_code()) << " " << s.error_message() << "\n";
  }
  {
    auto control = FetchControl(f.socket, f.session);
    std::cout << "control="
              << (control.ok() && !control->fds.empty() ? std::string("GOT")
                                                            : "refused " + (control.ok() ? control->payload : ckpt::Message(control.status())))
              << "\n";
  }
  if (!f.victim_arena.empty()) {
    // The arena itself: it has no name in /dev/shm, and another user's /proc/<pid>/fd is
    // closed to us (the kernel's ptrace check).
    int fd = ::open(f.victim_arena.c_str(), O_RDWR | O_CLOEXEC);
    std::cout << "open-arena=" << (fd >= 0 ? "OPENED" : std::strerror(errno)) << "\n";
    if (fd >= 0) ::close(fd);
  }
  if (!f.victim_token.empty()) {
    ::ckptd::v1::RegisterRequest req;
    req.set_job(f.job);
    req.set_world_size(1);
    req.set_pid(::getpid());
    auto* t = req.add_tensors();
    t->set_name("w");
    t->set_dtype("U8");
    t->add_shape(64);
    t->set_nbytes(64);
    req.add_arena_tokens(f.victim_token);
    grpc::ClientContext ctx;
    ::ckptd::v1::RegisterReply reply;
    grpc::Status s = stub->Register(&ctx, req, &reply);
    std::cout << "register code=" << CodeName(s.error_code()) << " " << s.error_message() << "\n";
  }
  return 0;
}

// Holds --count RPC Waits at once on a ticket that cannot commit (rank 0 of 2, alone), as a
// trainer hogging the daemon's threads would; prints how each ended.
int FloodWaits(const Flags& f) {
  auto c = Connect(f);
  Setup(*c, f);
  auto ticket = c->Snapshot(f.step);
  if (!ticket.ok() || !c->WaitStaged(*ticket).ok()) return 2;
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  std::mutex mu;
  std::map<std::string, int> codes;
  std::string exhausted;
  std::vector<std::thread> threads;
  for (int i = 0; i < f.count; ++i) {
    threads.emplace_back([&] {
      grpc::ClientContext ctx;
      ::ckptd::v1::WaitRequest req;
      req.set_session_id(c->session_id());
      req.set_ticket(*ticket);
      req.set_until_committed(true);
      req.set_timeout_ms(static_cast<uint32_t>(f.hold_seconds * 1000));
      ::ckptd::v1::WaitReply reply;
      grpc::Status s = stub->Wait(&ctx, req, &reply);
      std::lock_guard lock(mu);
      codes[CodeName(s.error_code())]++;
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) exhausted = s.error_message();
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::cout << "flooding" << std::endl;
  for (auto& t : threads) t.join();
  for (const auto& [code, n] : codes) std::cout << code << "=" << n << "\n";
  std::cout << "message=" << exhausted << std::endl;
  return 0;
}

// Admin.Delete over the socket, as whoever this process is.
int AdminDelete(const Flags& f) {
  auto stub = ::ckptd::v1::Admin::NewStub(
      grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ::ckptd::v1::CheckpointRef req;
  req.set_job(f.job);
  req.set_step(f.step);
  ::ckptd::v1::DeleteReply reply;
  grpc::Status s = stub->Delete(&ctx, req, &reply);
  std::cout << "delete code=" << CodeName(s.error_code()) << " " << s.error_message() << "\n";
  return s.ok() ? 0 : 1;
}

// Trainer.Register at any gRPC target (a TCP address, to show it is not served there);
// prints the status code's name.
int RegisterAt(const Flags& f) {
  auto stub = ::ckptd::v1::Trainer::NewStub(
      grpc::CreateChannel(f.target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ::ckptd::v1::RegisterRequest request;
  request.set_job(f.job);
  request.set_world_size(1);
  ::ckptd::v1::RegisterReply reply;
  grpc::Status s = stub->Register(&ctx, request, &reply);
  std::cout << "code=" << CodeName(s.error_code()) << " " << s.error_message() << "\n";
  return s.ok() ? 0 : 1;
}

// grpc.health.v1.Health/Check with an empty request, through a generic stub.
int Health(const Flags& f) {
  auto channel = grpc::CreateChannel("unix:" + f.socket, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer request, response;
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard lock(mu);
                   status = s;
                   done = true;
                   cv.notify_all();
                 });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status = SERVING (1)} encodes as 08 01.
  std::cout << (status.ok() && bytes == std::string("\x08\x01", 2) ? "SERVING" : "NOT SERVING " + status.error_message())
            << "\n";
  return status.ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"trainer_helper"};
  app.require_subcommand(1);
  app.add_option("--socket", f.socket)->required();
  app.add_option("--job", f.job);
  app.add_option("--rank", f.rank);
  app.add_option("--world-size", f.world_size);
  app.add_option("--seed", f.seed);
  app.add_flag("--copy-on-write", f.copy_on_write, "ask for copy-on-write snapshots");
  app.add_option("--bytes", f.bytes);
  app.add_option("--upload-every-steps", f.upload_every_steps, "the job's upload policy (0: the node's)");
  app.add_option("--as-uid", f.as_uid, "drop to this uid (and the same gid) first");
  app.add_option("--frozen", f.frozen, "tensors registered frozen")->delimiter(',');
  app.add_option("--extra-gid", f.extra_gid, "with --as-uid: keep this supplementary group");
  auto* save = app.add_subcommand("save");
  save->add_flag("--bad-metadata", f.bad_metadata);
  save->add_option("--step", f.step);
  save->add_flag("--die-after-staged", f.die_after_staged);
  save->add_flag("--wait-committed", f.wait_committed);
  save->add_option("--dump", f.dump);
  save->add_option("--start-file", f.start_file, "register, then snapshot once this file exists");
  auto* check = app.add_subcommand("check");
  check->add_option("--step", f.step)->each([&](const std::string&) { f.has_step = true; });
  check->add_option("--changed-bytes", f.changed_bytes, "model.a's first N bytes hold the restored step's number");
  check->add_flag("--poked", f.poked, "the first --frozen tensor's byte 0 was changed in place (save-steps)");
  app.add_option("--table-rows", f.table_rows, "also register emb.weight, a table of this many rows (per rank)");
  app.add_option("--row-bytes", f.row_bytes, "its rows' size, a multiple of 8")->capture_default_str();
  app.add_option("--sparse-rows", f.sparse_rows, "% of the table's rows (at random) changed per training step");
  app.add_flag("--table-sparse", f.table_sparse, "register the table sparse (chunked by its rows, about 1 KiB)");
  auto* save_steps = app.add_subcommand("save-steps");
  save_steps->add_option("--steps-list", f.steps_list)->delimiter(',')->required();
  save_steps->add_option("--changed-bytes", f.changed_bytes);
  save_steps->add_option("--then-wait-for", f.then_wait_for, "after the first step, wait for this file");
  save_steps->add_flag("--restore-first", f.restore_first);
  save_steps->add_option("--poke-frozen-at", f.poke_frozen_at,
                         "from this step on, change the first --frozen tensor in place");
  auto* save_loop = app.add_subcommand("save-loop");
  save_loop->add_option("--steps", f.steps);
  save_loop->add_option("--save-every", f.save_every);
  save_loop->add_option("--step-sleep-ms", f.step_sleep_ms);
  save_loop->add_option("--changed-bytes", f.changed_bytes);
  save_loop->add_flag("--restore-first", f.restore_first);
  auto* bad = app.add_subcommand("register-bad");
  bad->add_option("--case", f.bad_case)->required();
  auto* unknown = app.add_subcommand("unknown");
  auto* rpc = app.add_subcommand("rpc-snapshot");
  rpc->add_option("--step", f.step);
  auto* health = app.add_subcommand("health");
  auto* hold = app.add_subcommand("hold");
  hold->add_option("--hold-seconds", f.hold_seconds);
  auto* steal = app.add_subcommand("steal");
  steal->add_option("--session", f.session)->required();
  steal->add_option("--victim-token", f.victim_token, "register with another process's arenas");
  steal->add_option("--victim-arena", f.victim_arena, "open another process's arena directly");
  auto* admin_delete = app.add_subcommand("admin-delete");
  admin_delete->add_option("--step", f.step)->required();
  auto* register_at = app.add_subcommand("register-at");
  register_at->add_option("--target", f.target)->required();
  auto* add_cuda = app.add_subcommand("add-cuda");
  auto* update = app.add_subcommand("update");
  update->add_option("--step", f.step);
  auto* by_time = app.add_subcommand("train-by-time");
  by_time->add_option("--steps", f.steps);
  by_time->add_option("--interval-ms", f.interval_ms);
  auto* flood = app.add_subcommand("flood-waits");
  flood->add_option("--count", f.count);
  flood->add_option("--hold-seconds", f.hold_seconds);
  for (auto* sub : {save, check, bad, unknown, rpc, health, add_cuda, register_at, hold, steal,
                    admin_delete, flood, by_time, update, save_steps, save_loop}) {
    sub->fallthrough();
  }
  CLI11_PARSE(app, argc, argv);
  gid_t extra = static_cast<gid_t>(f.extra_gid);
  if (f.as_uid >= 0 && (::setgroups(f.extra_gid >= 0 ? 1 : 0, &extra) != 0 ||
                        ::setresgid(f.as_uid, f.as_uid, f.as_uid) != 0 ||
                        ::setresuid(f.as_uid, f.as_uid, f.as_uid) != 0)) {
    std::perror("setresuid");
    return 70;
  }
  if (save->parsed()) return Save(f);
  if (check->parsed()) return Check(f);
  if (bad->parsed()) return RegisterBad(f);
  if (unknown->parsed()) return Unknown(f);
  if (rpc->parsed()) return RpcSnapshot(f);
  if (add_cuda->parsed()) return AddCuda(f);
  if (register_at->parsed()) return RegisterAt(f);
  if (hold->parsed()) return Hold(f);
  if (steal->parsed()) return Steal(f);
  if (admin_delete->parsed()) return AdminDelete(f);
  if (flood->parsed()) return FloodWaits(f);
  if (by_time->parsed()) return TrainByTime(f);
  if (save_steps->parsed()) return SaveSteps(f);
  if (save_loop->parsed()) return SaveLoop(f);
  if (update->parsed()) return UpdateSession(f);
  return Health(f);
}
