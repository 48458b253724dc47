// Every bad input gets a clear error naming the problem, and nothing stored is lost.
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <thread>
#include <signal.h>

#include "tests/fakes/wait_until.h"
#include "tests/integration/common.h"

using namespace ckpt::testing;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

// A safetensors file's JSON header (8-byte little-endian length, then the JSON).
json SafetensorsHeader(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), sizeof length);
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  return json::parse(text, nullptr, false);
}

void SaveOk(Daemon& d, const TempDir& dir, const std::string& job, int seed, int step) {
  auto r = Run(Helper(d, {"--job", job, "--seed", std::to_string(seed), "--bytes", "1000000", "save",
                          "--step", std::to_string(step), "--wait-committed"}),
               dir.path());
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c;
  f.read(&c, 1);
  c ^= 0x40;
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("bad registrations are refused with a message naming the problem") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  struct Case {
    const char* name;
    const char* job;
    const char* expect;
  };
  for (Case c : {Case{"wrong-size", "j", "tensor w: size mismatch: F32 [16] needs 64 bytes, buffer has 60"},
                 Case{"bad-dtype", "j", "unknown dtype \"F99\""},
                 Case{"outside-segment", "j", "lie outside arena 0"},
                 Case{"duplicate-name", "j", "tensor w is registered twice"},
                 Case{"reserved-name", "j", "reserved"},
                 Case{"flat-past-end", "j", "tensor w: the piece has flat element range [8, 24), which is empty, out of order, overlaps the one before or lies outside the 20 elements"},
                 Case{"flat-overlap", "j", "tensor w: the piece has flat element range [4, 10)"},
                 Case{"flat-with-offset", "j", "tensor w: flat element ranges need the global shape and no global offset"},
                 Case{"missing-arena", "j", "tensor w: arena 1 was not handed over (this session has 1)"},
                 Case{"no-arenas", "j", "tensor w: arena 0 was not handed over (this session has 0)"},
                 Case{"unknown-token", "j", "is unknown or expired"},
                 Case{"reused-token", "j", "is unknown or expired"},
                 Case{"unsealed-arena", "j", "handover refused: refused: arena 0 of 1: the descriptor received is not shared memory sealed"},
                 Case{"pipe-arena", "j", "handover refused: refused: arena 0 of 1: the descriptor received is not shared memory sealed"},
                 Case{"sparse-arena", "j", "is not fully allocated"},
                 Case{"same-arena-twice", "j", "tensor u (arena 1): the same shared memory was handed over twice"},
                 Case{"bad-rank", "j", "rank 1 is not below world size 1"},
                 Case{"bad-upload-interval", "j", "upload interval -1 s is out of range"},
                 Case{"bad-job", "../etc", "invalid job name \"../etc\""},
                 Case{"cuda-on-host-daemon", "j",
                      "tensor w is on GPU GPU-00000000-0000-0000-0000-000000000000, but this "
                      "ckptd has no usable CUDA device"}}) {
    auto r = Run(Helper(d, {"--job", c.job, "register-bad", "--case", c.name}), dir.path());
    INFO(c.name << ": " << r.out << r.err << "\nckptd:\n" << d.Log());
    CHECK(r.exit_code == 0);
    CHECK(Contains(r.out, c.expect));
  }
  CHECK_FALSE(std::filesystem::exists(dir / "etc"));
  CHECK(Run(Helper(d, {"register-bad", "--case", "none"}), dir.path()).exit_code == 1);
}

TEST_CASE("arena memory registered is bounded per user (4 x --staging-bytes)") {
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "8M"});
  d.Start();
  auto r = Run(Helper(d, {"register-bad", "--case", "big-arena"}), dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, "code=8"));  // RESOURCE_EXHAUSTED
  CHECK(Contains(r.out, "more would pass the bound of 33554432 bytes per user (4 x --staging-bytes)"));
  // Within the budget, the same user registers and checkpoints.
  SaveOk(d, dir, "small", 1, 1);
}

TEST_CASE("--cuda-ipc=false refuses CUDA IPC handles before anything is opened") {
  TempDir dir;
  Daemon d(dir, {"--cuda-ipc=false"});
  d.Start();
  auto r = Run(Helper(d, {"register-bad", "--case", "cuda-on-host-daemon"}), dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, "code=7"));  // PERMISSION_DENIED
  CHECK(Contains(r.out, "tensor w: this ckptd does not accept CUDA IPC handles"));
  CHECK(nlohmann::json::parse(d.Ctl({"--json", "status"}).out)["config"]["cuda_ipc"] == false);
}

TEST_CASE("a GPU tensor from a process without usable CUDA is refused, naming the tensor") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  auto r = Run(Helper(d, {"add-cuda"}), dir.path());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(Contains(r.out, "tensor gpu.weight: CUDA is not usable in this process"));
  CHECK(Contains(d.Log(), "host copy engine only"));
  // The host-copy transport (no CUDA IPC) refuses the same way.
  ::setenv("CKPTD_CUDA_TRANSPORT", "host-copy", 1);
  auto copy = Run(Helper(d, {"add-cuda"}), dir.path());
  ::unsetenv("CKPTD_CUDA_TRANSPORT");
  CHECK(copy.exit_code == 0);
  CHECK(Contains(copy.out, "tensor gpu.weight: CUDA is not usable in this process"));
}

TEST_CASE("unknown sessions and tickets get clear errors") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  auto r = Run(Helper(d, {"unknown"}), dir.path());
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(Contains(r.out, "wait-session code=5 message=unknown session \"no-such-session\""));
  CHECK(Contains(r.out, "restore-session code=5 message=unknown session"));
  CHECK(Contains(r.out, "wait-ticket code=5 message=ticket 4242 is unknown"));
  CHECK(Contains(r.out, "poll-ticket state=unknown error=ticket 4242 is unknown"));
}

TEST_CASE("a truncated shard: verify names file and tensor, restore refuses, nothing else lost") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveOk(d, dir, "tr", 1, 10);
  SaveOk(d, dir, "tr", 2, 20);
  REQUIRE(d.Stop() == 0);  // restart so restore cannot use memory
  std::string shard = ShardPath(d.root() + "/tr/step-00000020", 0);
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 1000);
  d.Start();
  auto v = d.Ctl({"--job", "tr", "verify", "20"});
  INFO(v.out << v.err);
  CHECK(v.exit_code == 3);
  CHECK(Contains(v.out, "DAMAGED"));
  CHECK(Contains(v.out, std::filesystem::path(shard).filename().string()));
  CHECK(Contains(v.out, "truncated"));
  CHECK(Contains(v.out, "tensor tiny in"));  // the last entry is the one cut short
  // Restoring step 20 by name is refused; the latest step falls back to step 10, saying why.
  auto named = Run(Helper(d, {"--job", "tr", "--seed", "2", "--bytes", "1000000", "check", "--step", "20"}),
                   dir.path());
  CHECK(named.exit_code == 2);
  CHECK(Contains(named.out, "truncated"));
  CHECK(Contains(named.out, "buffers untouched"));
  auto latest = Run(Helper(d, {"--job", "tr", "--seed", "1", "--bytes", "1000000", "check"}), dir.path());
  INFO(latest.out << latest.err);
  CHECK(latest.exit_code == 0);
  CHECK(Contains(latest.out, "restored step=10"));
  CHECK(Contains(latest.out, "warning: step 20 is damaged (rank 0: "));
  CHECK(Contains(latest.out, "truncated"));
  CHECK(Contains(latest.out, "restored step 10 instead"));
  CHECK(d.Ctl({"--job", "tr", "verify", "10"}).exit_code == 0);
  CHECK(Run(Helper(d, {"--job", "tr", "--seed", "1", "--bytes", "1000000", "check", "--step", "10"}),
            dir.path()).exit_code == 0);
  CHECK(Contains(d.Ctl({"status"}).out, "verify"));
}

namespace {

// The same bytes in the header's place: `from` replaced by `to` (as long) where it first
// occurs in the shard's JSON header.
void EditHeader(const std::string& path, const std::string& from, const std::string& to) {
  REQUIRE(from.size() == to.size());
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t length = 0;
  f.read(reinterpret_cast<char*>(&length), sizeof length);
  std::string text(length, '\0');
  f.read(text.data(), static_cast<std::streamsize>(length));
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  f.seekp(static_cast<std::streamoff>(8 + at));
  f.write(to.data(), static_cast<std::streamsize>(to.size()));
}

// Step 20 of `job` is damaged (by `damage`, after the daemon stopped): the latest restore
// gives it up, saying why, and restores step 10 bit for bit.
void FallsBackToStep10(Daemon& d, const TempDir& dir, const std::string& job, const std::string& why) {
  auto latest = Run(Helper(d, {"--job", job, "--seed", "1", "--bytes", "1000000", "check"}), dir.path());
  INFO(job << ": " << latest.out << latest.err << d.Log());
  CHECK(latest.exit_code == 0);
  CHECK(Contains(latest.out, "restored step=10"));
  CHECK(Contains(latest.out, "warning: step 20 is damaged (rank 0: "));
  CHECK(Contains(latest.out, why));
  CHECK(Contains(latest.out, "restored step 10 instead"));
}

}  // namespace

TEST_CASE("a shard as a symlink, unreadable (EIO) or with another dtype: restores fall back") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  for (const char* job : {"sl", "dt", "eio"}) {
    SaveOk(d, dir, job, 1, 10);
    SaveOk(d, dir, job, 2, 20);
  }
  REQUIRE(d.Stop() == 0);  // restarted: nothing restores from memory
  auto shard = [&](const std::string& job, const char* step) {
    return ShardPath(d.root() + "/" + job + "/step-000000" + step, 0);
  };
  // A symlink in the shard's place (here to step 10's own shard): never followed.
  const std::string symlinked = shard("sl", "20");
  std::filesystem::remove(symlinked);
  std::filesystem::create_symlink(shard("sl", "10"), symlinked);
  // The header says I32 where the manifest says F32: the same size, the same bytes, and
  // checksums that match, but not the tensor the manifest describes.
  EditHeader(shard("dt", "20"), R"("model.a":{"dtype":"F32")", R"("model.a":{"dtype":"I32")");
  // The disk fails to read step 20's data region (its header reads).
  const std::string eio = "eio-reading:/eio/step-00000020/" + std::filesystem::path(shard("eio", "20")).filename().string();
  ::setenv("CKPTD_FAULT", eio.c_str(), 1);
  d.Start();
  ::unsetenv("CKPTD_FAULT");
  auto v = d.Ctl({"--job", "dt", "verify", "20"});
  INFO(v.out << v.err);
  CHECK(v.exit_code == 3);
  CHECK(Contains(v.out, "header says I32"));
  FallsBackToStep10(d, dir, "sl", "Too many levels of symbolic links");
  FallsBackToStep10(d, dir, "dt", "header says I32 [");
  FallsBackToStep10(d, dir, "eio", "Input/output error");
  // Step 20 asked for by name is refused, naming the damage, the buffers untouched.
  auto named = Run(Helper(d, {"--job", "dt", "--seed", "2", "--bytes", "1000000", "check", "--step", "20"}),
                   dir.path());
  CHECK(named.exit_code == 2);
  CHECK(Contains(named.out, "header says I32"));
  CHECK(Contains(named.out, "buffers untouched"));
}

TEST_CASE("session updates: refused ones change nothing; a real one registers only what changed") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  auto r = Run(Helper(d, {"--job", "up", "--bytes", "8000", "update", "--step", "1"}), dir.path());
  INFO(r.out << r.err << d.Log());
  REQUIRE(r.exit_code == 0);
  CHECK(Contains(r.out, "nothing: code=3 the update changes nothing"));
  CHECK(Contains(r.out, "unknown-removed: code=3 tensor no.such cannot be removed: it is not registered"));
  CHECK(Contains(r.out, "twice: code=3 tensor extra.x is named twice in the update"));
  CHECK(Contains(r.out, "bad-arena: code=3 tensor extra.y: arena 99 was not handed over"));
  CHECK(Contains(r.out, "all-removed: code=3 the update would leave no tensor registered"));
  CHECK(Contains(r.out, "arena-numbering: code=9 this update numbers its arenas from 7, but the session has 1"));
  CHECK(Contains(r.out, "foreign-session: code=5"));
  CHECK(Contains(r.out, "step 1: committed"));
  CHECK(Contains(r.out, "update: ok"));
  CHECK(Contains(r.out, "step 2: committed"));
  // Step 1 as registered (no refused update left anything behind); step 2 as updated.
  json one = SafetensorsHeader(ShardPath(d.root() + "/up/step-00000001", 0));
  CHECK(one.contains("model.b"));
  CHECK_FALSE(one.contains("extra.ok"));
  CHECK_FALSE(one.contains("extra.z"));
  json two = SafetensorsHeader(ShardPath(d.root() + "/up/step-00000002", 0));
  CHECK_FALSE(two.contains("model.b"));
  REQUIRE(two.contains("extra.c"));
  CHECK(two["extra.c"]["shape"] == json::array({3}));
  CHECK(two["model.a"]["shape"][0].get<int64_t>() == 2 * one["model.a"]["shape"][0].get<int64_t>());
  CHECK(Contains(d.Log(), "updated: 2 tensors added or replaced, 1 removed"));
}

TEST_CASE("a bit-flipped shard: verify names tensor and file, restore refuses") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveOk(d, dir, "bf", 3, 10);
  REQUIRE(d.Stop() == 0);
  std::string shard = ShardPath(d.root() + "/bf/step-00000010", 0);
  FlipByte(shard, std::filesystem::file_size(shard) - 200000);  // inside the I64 tensor model.b
  d.Start();
  auto v = d.Ctl({"--job", "bf", "verify", "10"});
  INFO(v.out);
  CHECK(v.exit_code == 3);
  CHECK(Contains(v.out, "checksum mismatch"));
  CHECK(Contains(v.out, std::filesystem::path(shard).filename().string()));
  CHECK((Contains(v.out, "tensor model.b") || Contains(v.out, "tensor optim.c")));
  auto c = Run(Helper(d, {"--job", "bf", "--seed", "3", "--bytes", "1000000", "check"}), dir.path());
  CHECK(c.exit_code == 2);
  CHECK(Contains(c.out, "checksum mismatch"));
  CHECK(Contains(c.out, "buffers untouched"));  // checked before a byte reached the trainer
  auto json = d.Ctl({"--job", "bf", "--json", "verify", "10"});
  CHECK(Contains(json.out, "\"ok\": false"));
}

TEST_CASE("verify finds extra, missing and swapped files, naming each; exit 3") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  SaveOk(d, dir, "sw", 1, 10);
  SaveOk(d, dir, "sw", 2, 20);  // the same tensors, other values
  const std::string step = d.root() + "/sw/step-00000020";
  auto damaged = [&](const std::vector<std::string>& expect) {
    auto v = d.Ctl({"--job", "sw", "verify", "20"});
    INFO(v.out << v.err);
    CHECK(v.exit_code == 3);
    for (const std::string& e : expect) CHECK(Contains(v.out, e));
  };
  CHECK(d.Ctl({"--job", "sw", "verify", "20"}).exit_code == 0);
  { std::ofstream(step + "/notes.txt") << "left by hand"; }
  damaged({"notes.txt: a file the manifest does not list"});
  std::filesystem::remove(step + "/notes.txt");
  // Step 10's file in step 20's place: a valid shard, but not the one the manifest describes.
  // (One run saved both, so with increments their files have the same name too.)
  const std::string shard = ShardPath(step, 0);
  const std::string name = std::filesystem::path(shard).filename().string();
  std::filesystem::copy_file(ShardPath(d.root() + "/sw/step-00000010", 0), shard,
                             std::filesystem::copy_options::overwrite_existing);
  damaged({"checksum mismatch", name, "tensor model."});
  std::filesystem::remove(shard);
  damaged({name + ": missing (rank 0's shard)"});
  CHECK(d.Ctl({"--job", "sw", "verify", "10"}).exit_code == 0);  // the other step is untouched
}

TEST_CASE("a registration larger than the staging budget is refused at once") {
  TempDir dir;
  Daemon d(dir, {"--staging-bytes", "4M"});
  d.Start();
  auto r = Run(Helper(d, {"--job", "big", "--bytes", "8000000", "save"}), dir.path());
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.out, "staging budget (--staging-bytes)"));
}

TEST_CASE("the socket is 0660 and peers without permission are turned away") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  struct stat st;
  REQUIRE(::stat(d.socket().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0660);
  if (::geteuid() != 0) return;  // dropping to another uid needs root
  ::chmod(std::filesystem::path(d.socket()).parent_path().c_str(), 0755);
  ::chmod(d.socket().c_str(), 0666);  // filesystem lets everyone in: peer credentials must not
  auto r = Run(Helper(d, {"--as-uid", "65534", "--job", "x", "save"}), dir.path());
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.out, "cannot reach ckptd"));
  CHECK(Contains(d.Log(), "refused connection"));
  CHECK(Contains(d.Log(), "uid 65534"));
}

TEST_CASE("duplicate rank registration is refused while the first trainer lives") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  Process first(Trainer(d, {"--job", "dup", "--steps", "400", "--save-every", "100", "--step-sleep-ms", "10",
                            "--state-bytes", "1000"}),
                dir.path(), "first");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto second = Run(Helper(d, {"--job", "dup", "save"}), dir.path());
  CHECK(second.exit_code == 2);
  CHECK(Contains(second.out, "rank 0 of job dup is already registered by pid"));
  first.Signal(SIGKILL);
  first.Wait();
}

TEST_CASE("ranks of one job asking for different upload policies: the one that differs is refused, naming both") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  // Rank 0 registers with the node's policy (every step) and stays.
  Process first(Helper(d, {"--job", "pol", "--world-size", "2", "hold", "--hold-seconds", "30"}), dir.path(), "first");
  REQUIRE(WaitUntil([&] { return Status(d)["sessions"].size() == 1; }, 10s, 20ms));
  auto second = Run(Helper(d, {"--job", "pol", "--world-size", "2", "--rank", "1", "--upload-every-steps", "2", "save"}),
                    dir.path());
  INFO(second.out << second.err);
  CHECK(second.exit_code == 2);
  CHECK(Contains(second.out, "rank 1 of job pol asks to upload every 2 steps, its other ranks every step"));
  first.Signal(SIGKILL);
  first.Wait();
  // With no rank of the job left, a new run may choose another policy.
  REQUIRE(WaitUntil([&] { return Status(d)["sessions"].empty(); }, 10s, 20ms));
  auto alone = Run(Helper(d, {"--job", "pol", "--upload-every-steps", "2", "save", "--wait-committed"}), dir.path());
  INFO(alone.out << alone.err);
  CHECK(alone.exit_code == 0);
}

TEST_CASE("metadata that is not text fails that snapshot alone; ckptd and the others go on") {
  TempDir dir;
  Daemon d(dir);
  d.Start();
  auto bad = Run(Helper(d, {"--job", "utf", "--bytes", "100000", "save", "--step", "1",
                            "--bad-metadata", "--wait-committed"}),
                 dir.path());
  INFO(bad.out << bad.err);
  CHECK(bad.exit_code != 0);
  CHECK(Contains(bad.out, "not valid UTF-8"));
  auto good = Run(Helper(d, {"--job", "utf", "--bytes", "100000", "save", "--step", "2",
                             "--wait-committed"}),
                  dir.path());
  CHECK(good.exit_code == 0);
  CHECK(d.Ctl({"status"}).exit_code == 0);
}
