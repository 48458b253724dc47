// Sealed segments, arenas and the command ring, across real processes (fork).
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <atomic>
#include <optional>
#include <thread>

#include "common/status.h"
#include "common/unique_fd.h"
#include "shm/arena.h"
#include "tests/fakes/huge_pages.h"
#include "shm/command_ring.h"
#include "shm/futex.h"
#include "shm/payload.h"
#include "shm/payload_segment.h"
#include "shm/sealed_segment.h"

using namespace ckpt;
using namespace ckpt::shm;
using namespace std::chrono_literals;

namespace {

std::string UniqueName(const char* tag) {
  static int n = 0;
  return "/ckpt-test." + std::to_string(::getpid()) + "." + tag + std::to_string(n++);
}

// Runs `child` in a forked process; returns its exit status.
template <typename Fn>
int InChild(Fn child) {
  pid_t pid = ::fork();
  if (pid == 0) _exit(child());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

struct Ring {
  SealedSegmentPtr segment;
  ControlBlock* block;
  Ring() {
    segment = *SealedSegment::Create(UniqueName("ctl"), kControlBlockBytes);
    InitializeControlBlock(segment->data(), ::getpid(), ::getpid());
    block = *ValidateControlBlock(segment->data(), segment->size());
  }
};

}  // namespace

TEST_CASE("arena allocations are aligned, zeroed and bounded") {
  auto arena = Arena::Create(1 << 20);
  REQUIRE(arena.ok());
  auto a = (*arena)->Allocate(10);
  auto b = (*arena)->Allocate(100, 4096);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(*a % 64 == 0);
  CHECK(*b % 4096 == 0);
  CHECK(*b >= *a + 10);
  CHECK(static_cast<char*>((*arena)->at(*b))[50] == 0);
  auto full = (*arena)->Allocate(2 << 20);
  CHECK(absl::IsResourceExhausted(full.status()));
  CHECK(Message(full.status()).find((*arena)->name()) != std::string::npos);
}

TEST_CASE("an arena has no name: it reaches another process only as a descriptor") {
  auto arena = Arena::Create(4096);
  REQUIRE(arena.ok());
  // Nothing in /dev/shm: no other user can open it by name.
  CHECK_FALSE(std::filesystem::exists("/dev/shm/" + (*arena)->name()));
  // The receiving side maps the same memory from the descriptor and cannot shrink it.
  UniqueFd dup(::fcntl((*arena)->fd(), F_DUPFD_CLOEXEC, 0));
  auto daemon_side = SealedSegment::Map(std::move(dup));
  REQUIRE(daemon_side.ok());
  std::memcpy((*arena)->at(0), "x", 1);
  CHECK(static_cast<char*>((*daemon_side)->data())[0] == 'x');
  (*daemon_side)->DropFd();  // the mapping outlives its descriptor
  static_cast<char*>((*daemon_side)->data())[1] = 'y';
  CHECK(static_cast<char*>((*arena)->at(0))[1] == 'y');
  CHECK(::ftruncate((*arena)->fd(), 0) != 0);
  CHECK(errno == EPERM);
}

TEST_CASE("a large arena lives in huge pages while the pool has room, in base pages otherwise") {
  const size_t page = ckpt::shm::HugePageSize();
  REQUIRE(page > 0);
  // Small arenas never take huge pages: rounding up would waste more than 1/16.
  auto small = Arena::Create(1 << 20, /*huge_pages=*/true);
  REQUIRE(small.ok());
  CHECK_FALSE((*small)->huge());
  CHECK((*small)->capacity() == (1u << 20));
  // Asked without huge pages: base pages whatever the pool holds.
  auto plain = Arena::Create(Arena::kMinHugeArena, /*huge_pages=*/false);
  REQUIRE(plain.ok());
  CHECK_FALSE((*plain)->huge());
  // More than the pool holds falls back to base pages, never fails. More than the whole
  // pool, not its free pages: tests beside this one take and return pages meanwhile (a TSan
  // run met a pool that had grown back between the count and the arena).
  const size_t beyond = (ckpt::testing::TotalHugePages() + 1) * page + Arena::kMinHugeArena;
  auto fallback = Arena::Create(beyond, /*huge_pages=*/true);
  REQUIRE(fallback.ok());
  CHECK_FALSE((*fallback)->huge());
  CHECK((*fallback)->capacity() == beyond);
  fallback->reset();
  // Within the pool (when the machine reserved one): huge pages, rounded up to a whole page,
  // received by the other side like any arena.
  const size_t asked = Arena::kMinHugeArena + 4096;
  const size_t rounded = (asked + page - 1) / page * page;
  auto huge = Arena::Create(asked, /*huge_pages=*/true);
  REQUIRE(huge.ok());
  INFO("free huge pages: " << ckpt::testing::FreeHugePages());
  if ((*huge)->huge()) {
    CHECK((*huge)->capacity() == rounded);
    CHECK(ckpt::shm::IsHugeTlb((*huge)->fd()));
    auto daemon_side = SealedSegment::Map(UniqueFd(::fcntl((*huge)->fd(), F_DUPFD_CLOEXEC, 0)));
    REQUIRE(daemon_side.ok());
    CHECK((*daemon_side)->huge());
    CHECK((*daemon_side)->size() == rounded);
    std::memcpy((*huge)->at(rounded - 8), "hugepage", 8);
    CHECK(std::memcmp(static_cast<char*>((*daemon_side)->data()) + rounded - 8, "hugepage", 8) == 0);
    CHECK(::ftruncate((*huge)->fd(), 0) != 0);  // sealed like any arena
  } else {
    // Only when the pool cannot hold it right now.
    CHECK(ckpt::testing::FreeHugePages() * page < rounded);
    CHECK((*huge)->capacity() == asked);
  }
}

TEST_CASE("a received descriptor that is not sealed, or has holes, is refused") {
  UniqueFd plain(::memfd_create("ckpt-test-unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(::ftruncate(plain.get(), 4096) == 0);
  REQUIRE(::posix_fallocate(plain.get(), 0, 4096) == 0);
  CHECK_FALSE(SealedSegment::CheckReceivable(plain.get()).ok());
  auto unsealed = SealedSegment::Map(UniqueFd(::fcntl(plain.get(), F_DUPFD_CLOEXEC, 0)));
  REQUIRE_FALSE(unsealed.ok());
  CHECK(Message(unsealed.status()).find("not shared memory sealed") != std::string::npos);
  // Sealed but sparse: a terabyte the mapper would have to find pages for.
  UniqueFd sparse(::memfd_create("ckpt-test-sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  REQUIRE(::ftruncate(sparse.get(), off_t{1} << 40) == 0);
  REQUIRE(::fcntl(sparse.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  CHECK_FALSE(SealedSegment::CheckReceivable(sparse.get()).ok());
  auto holes = SealedSegment::Map(std::move(sparse));
  REQUIRE_FALSE(holes.ok());
  CHECK(Message(holes.status()).find("not fully allocated") != std::string::npos);
  // A pipe is no shared memory at all.
  int p[2];
  REQUIRE(::pipe(p) == 0);
  UniqueFd read_end(p[0]), write_end(p[1]);
  CHECK_FALSE(SealedSegment::CheckReceivable(read_end.get()).ok());
}

TEST_CASE("payloads round-trip and hostile bytes are refused, never trusted") {
  SnapshotPayload p;
  p.metadata = {{"loss", "0.5"}, {"", ""}};
  p.train_state = {{"rng", std::string("\0\1\2", 3)}, {"empty", ""}};
  std::vector<uint8_t> buf(EncodedSize(p));
  REQUIRE(EncodePayload(p, buf.data(), buf.size()).ok());
  auto back = DecodePayload(buf.data(), buf.size());
  REQUIRE(back.ok());
  CHECK(back->metadata == p.metadata);
  CHECK(back->train_state[0].data == p.train_state[0].data);
  CHECK(absl::IsResourceExhausted(EncodePayload(p, buf.data(), buf.size() - 1).status()));
  for (size_t cut = 0; cut < buf.size(); ++cut) CHECK_FALSE(DecodePayload(buf.data(), cut).ok());
  std::vector<uint8_t> lying = {1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f};
  CHECK_FALSE(DecodePayload(lying.data(), lying.size()).ok());
}

TEST_CASE("the ring carries snapshots from a trainer process to the daemon") {
  Ring ring;
  CommandConsumer consumer(ring.block);
  int rc = InChild([&] {
    CommandProducer producer(ring.block);
    for (uint64_t step = 1; step <= 3; ++step) {
      SnapshotPayload p;
      p.metadata["step"] = std::to_string(step);
      if (!producer.PublishSnapshot(step * 10, p).ok()) return 1;
    }
    return 0;
  });
  REQUIRE(rc == 0);
  for (uint64_t step = 1; step <= 3; ++step) {
    auto cmd = consumer.Next(1s);
    REQUIRE(cmd.has_value());
    CHECK(cmd->ticket == step);
    CHECK(cmd->step == step * 10);
    REQUIRE(cmd->payload.ok());
    CHECK(cmd->payload->metadata.at("step") == std::to_string(step));
  }
  CHECK_FALSE(consumer.Next(10ms).has_value());
}

TEST_CASE("ticket states reach a waiting trainer in another process") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  uint64_t ticket = *producer.PublishSnapshot(5, {});
  std::thread daemon([&] {
    auto cmd = consumer.Next(1s);
    std::this_thread::sleep_for(20ms);
    consumer.SetTicketState(cmd->ticket, kTicketStaged);
    std::this_thread::sleep_for(20ms);
    consumer.SetTicketState(cmd->ticket, kTicketFailed, "disk on fire");
  });
  int rc = InChild([&] {
    auto staged = producer.Wait(ticket, false, 5s, 5s);
    if (!staged.ok() || staged->state == kTicketPending) return 1;
    auto final_state = producer.Wait(ticket, true, 5s, 5s);
    if (!final_state.ok() || final_state->state != kTicketFailed) return 2;
    return final_state->error == "disk on fire" ? 0 : 3;
  });
  daemon.join();
  CHECK(rc == 0);
}

TEST_CASE("a full ring refuses at once instead of blocking the trainer") {
  Ring ring;
  CommandProducer producer(ring.block);
  for (uint32_t i = 0; i < kRingSlots; ++i) REQUIRE(producer.PublishSnapshot(i + 1, {}).ok());
  auto start = std::chrono::steady_clock::now();
  auto full = producer.PublishSnapshot(100, {});
  CHECK(std::chrono::steady_clock::now() - start < 50ms);
  CHECK(absl::IsResourceExhausted(full.status()));
}

TEST_CASE("oversized train state is refused with its size") {
  Ring ring;
  CommandProducer producer(ring.block);
  SnapshotPayload big;
  big.train_state = {{"blob", std::string(kSlotPayloadBytes, 'x')}};
  auto r = producer.PublishSnapshot(1, big);
  CHECK(absl::IsResourceExhausted(r.status()));
  CHECK(Message(r.status()).find("at most") != std::string::npos);
}

TEST_CASE("a payload too large for a slot travels as a deposited segment, named by its token") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  SnapshotPayload big;
  big.metadata["loss"] = "0.5";
  big.train_state = {{"history", std::string(3 * kSlotPayloadBytes, 'h')}, {"rng", "r"}};
  auto segment = EncodeToSegment(big, "test-payload");
  REQUIRE(segment.ok());
  REQUIRE(producer.PublishDepositedSnapshot(7, "0123abcd").ok());
  auto cmd = consumer.Next(1s);
  REQUIRE(cmd.has_value());
  CHECK(cmd->step == 7);
  CHECK(cmd->deposit_token == "0123abcd");
  REQUIRE(cmd->payload.ok());
  CHECK(cmd->payload->train_state.empty());  // the session redeems the token for it
  auto back = DecodeSegment(**segment);
  REQUIRE(back.ok());
  CHECK(back->metadata == big.metadata);
  REQUIRE(back->train_state.size() == 2);
  CHECK(back->train_state[0].data == big.train_state[0].data);
  // A token is short: a longer one is refused by the producer, and a slot that claims one
  // is refused by the daemon.
  CHECK_FALSE(producer.PublishDepositedSnapshot(8, std::string(kMaxDepositTokenBytes + 1, 't')).ok());
  CHECK_FALSE(producer.PublishDepositedSnapshot(8, "").ok());
  for (uint32_t lie : {kMaxDepositTokenBytes + 1, 0u}) {  // too long, or no token at all
    REQUIRE(producer.PublishDepositedSnapshot(8, "t").ok());
    ring.block->commands[(ring.block->tail.load() - 1) % kRingSlots].payload_bytes = lie;
    auto lying = consumer.Next(1s);
    REQUIRE(lying.has_value());
    CHECK_FALSE(lying->payload.ok());
    CHECK(lying->deposit_token.empty());
  }
}

TEST_CASE("a deposited payload is read without mapping it: holes read as zeros, lies are refused") {
  SnapshotPayload p;
  p.train_state = {{"history", std::string(1 << 20, 'h')}};
  auto segment = EncodeToSegment(p, "test-payload");
  REQUIRE(segment.ok());
  auto back = DecodeMemfd((*segment)->fd(), (*segment)->size());
  REQUIRE(back.ok());
  CHECK(back->train_state[0].data == p.train_state[0].data);
  // The trainer punches its pages out after handing it over: never a fault, at most a
  // payload that no longer says what it did.
  REQUIRE(::fallocate((*segment)->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == 0);
  auto holed = DecodeMemfd((*segment)->fd(), (*segment)->size());
  CHECK_FALSE(holed.ok());
  // Bytes after the last entry, and more entries than a payload may hold, are refused.
  std::vector<uint8_t> buf(EncodedSize(p) + 1);
  REQUIRE(EncodePayload(p, buf.data(), buf.size()).ok());
  CHECK_FALSE(DecodePayload(buf.data(), buf.size()).ok());
  CHECK(DecodePayload(buf.data(), buf.size() - 1).ok());
  std::vector<uint8_t> many = {0, 0, 0, 0, 0xff, 0xff, 0, 0};  // 65535 entries claimed, none there
  CHECK_FALSE(DecodePayload(many.data(), many.size()).ok());
  SnapshotPayload crowded;
  for (uint32_t i = 0; i <= kMaxPayloadEntries; ++i) crowded.train_state.push_back({std::to_string(i), ""});
  std::vector<uint8_t> room(EncodedSize(crowded));
  auto refused = EncodePayload(crowded, room.data(), room.size());
  CHECK(absl::IsInvalidArgument(refused.status()));
}

TEST_CASE("a silent or closed daemon is detected instead of waiting forever") {
  Ring ring;
  CommandProducer producer(ring.block);
  uint64_t ticket = *producer.PublishSnapshot(1, {});
  ring.block->daemon_heartbeat_ns = MonotonicNanos() - 10'000'000'000ULL;
  auto r = producer.Wait(ticket, false, 5s, 1s);
  CHECK(absl::IsUnavailable(r.status()));
  CHECK(Message(r.status()).find("not responding") != std::string::npos);
  // The trainer goes on without ckptd: the snapshot it stopped waiting for is abandoned.
  CHECK(producer.Poll(ticket).state == kTicketAbandoned);
  CommandConsumer(ring.block).Heartbeat();
  uint64_t next = *producer.PublishSnapshot(2, {});
  CommandConsumer(ring.block).Close();
  auto closed = producer.Wait(next, false, 5s, 1s);
  CHECK(absl::IsUnavailable(closed.status()));
  CHECK(producer.Poll(next).state == kTicketAbandoned);
}

TEST_CASE("a daemon that exits is seen at once through its liveness pipe, in any PID namespace") {
  Ring ring;
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  ckpt::UniqueFd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  CommandProducer producer(ring.block, read_end.get());
  CommandConsumer(ring.block).Heartbeat();
  uint64_t ticket = *producer.PublishSnapshot(1, {});
  CHECK(producer.CheckDaemonRunning().ok());
  std::thread exits([&] {
    std::this_thread::sleep_for(50ms);
    write_end.reset();  // what the kernel does when ckptd exits
  });
  auto started = std::chrono::steady_clock::now();
  auto r = producer.Wait(ticket, false, 30s, 10s);  // the heartbeat would take 10 s to tell
  auto waited = std::chrono::steady_clock::now() - started;
  exits.join();
  CHECK(absl::IsUnavailable(r.status()));
  CHECK(Message(r.status()) == "ckptd exited");
  CHECK(waited < 1s);  // 50 ms and one liveness slice (20 ms), with room for a loaded machine
  CHECK(producer.Poll(ticket).state == kTicketAbandoned);
}

TEST_CASE("a snapshot is staged or abandoned, never both: the daemon and the trainer race once") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  // The trainer abandons first: the daemon's copy does not count, and later states keep it.
  uint64_t first = *producer.PublishSnapshot(1, {});
  REQUIRE(consumer.Next(0ms).has_value());
  CHECK(producer.AbandonPending() == 1);
  CHECK_FALSE(consumer.SetTicketState(first, kTicketStaged));
  CHECK_FALSE(consumer.SetTicketState(first, kTicketCommitted));
  CHECK(consumer.SetTicketState(first, kTicketFailed, "abandoned") == false);
  CHECK(producer.Poll(first).state == kTicketAbandoned);
  // The daemon stages first: abandoning finds nothing pending, and the ticket commits.
  uint64_t second = *producer.PublishSnapshot(2, {});
  REQUIRE(consumer.Next(0ms).has_value());
  CHECK(consumer.SetTicketState(second, kTicketStaged));
  CHECK(producer.AbandonPending() == 0);
  CHECK(consumer.SetTicketState(second, kTicketCommitted));
  CHECK(producer.Poll(second).state == kTicketCommitted);
  // Both at once, many times: exactly one side wins each ticket.
  for (int i = 0; i < 2000; ++i) {
    uint64_t t = *producer.PublishSnapshot(3 + i, {});
    REQUIRE(consumer.Next(0ms).has_value());
    std::atomic<bool> staged{false};
    int abandoned = 0;
    std::thread daemon([&] { staged = consumer.SetTicketState(t, kTicketStaged); });
    abandoned = producer.AbandonPending();
    daemon.join();
    REQUIRE(staged.load() != (abandoned == 1));
    REQUIRE(producer.Poll(t).state == (staged ? kTicketStaged : kTicketAbandoned));
  }
}

TEST_CASE("waiting times out with a clear message") {
  Ring ring;
  CommandProducer producer(ring.block);
  uint64_t ticket = *producer.PublishSnapshot(1, {});
  auto r = producer.Wait(ticket, false, 100ms, 5s);
  CHECK(absl::IsDeadlineExceeded(r.status()));
  CHECK(Message(r.status()).find("not staged") != std::string::npos);
}

TEST_CASE("a control block from another ABI is refused") {
  Ring ring;
  ring.block->abi_version = 99;
  CHECK_FALSE(ValidateControlBlock(ring.segment->data(), ring.segment->size()).ok());
  ring.block->magic = 0;
  CHECK_FALSE(ValidateControlBlock(ring.segment->data(), ring.segment->size()).ok());
  CHECK_FALSE(ValidateControlBlock(ring.segment->data(), 16).ok());
}

TEST_CASE("the staged-ticket word only moves forward, and failures release waiters too") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  uint64_t t1 = *producer.PublishSnapshot(1, {});
  uint64_t t2 = *producer.PublishSnapshot(2, {});
  CHECK(ring.block->staged_ticket.load() == 0);
  consumer.SetTicketState(t1, kTicketStaged);
  CHECK(ring.block->staged_ticket.load() == t1);
  consumer.SetTicketState(t1, kTicketCommitted);  // committing does not move it
  CHECK(ring.block->staged_ticket.load() == t1);
  consumer.SetTicketState(t2, kTicketRejected, "busy");  // GPU waiters for t2 must wake too
  CHECK(ring.block->staged_ticket.load() == t2);
  consumer.SetTicketState(t1, kTicketFailed, "late persist failure");  // never backwards
  CHECK(ring.block->staged_ticket.load() == t2);
  CHECK(reinterpret_cast<uintptr_t>(&ring.block->staged_ticket) % 4096 == 0);
}

TEST_CASE("tickets count from 1; the events-taken word says which the daemon is done with, never backwards") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  CHECK(producer.NextTicket() == 1);
  uint64_t t1 = *producer.PublishSnapshot(1, {});
  CHECK(t1 == 1);
  CHECK(producer.NextTicket() == 2);
  uint64_t t2 = *producer.PublishSnapshot(2, {});
  CHECK(producer.EventsTaken() == 0);
  // A ticket failed early (its step ended) is not "taken": the word moves only when the
  // daemon says so.
  consumer.SetTicketState(t1, kTicketFailed, "the step was aborted");
  CHECK(producer.EventsTaken() == 0);
  consumer.MarkTaken(t1);
  CHECK(producer.EventsTaken() == t1);
  consumer.MarkTaken(t2);
  consumer.MarkTaken(t1);
  CHECK(producer.EventsTaken() == t2);
}

TEST_CASE("host-copy transport: the daemon stages only after the trainer's copy lands") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  REQUIRE(producer.PublishSnapshot(7, {}, /*wait_client_copy=*/1).ok());
  auto cmd = consumer.Next(1s);
  REQUIRE(cmd.has_value());
  CHECK(cmd->wait_client_copy == 1);
  CHECK_FALSE(consumer.WaitClientCopy(1, 50ms));  // not copied yet: times out
  int rc = InChild([&] {  // the trainer's CUDA callback, in the trainer's process
    std::this_thread::sleep_for(50ms);
    producer.MarkClientCopyDone(1);
    return 0;
  });
  CHECK(rc == 0);
  CHECK(consumer.WaitClientCopy(1, 1s));
  CHECK_FALSE(consumer.WaitClientCopy(1000, 10ms));  // ahead of the last copy: not done
  producer.MarkClientCopyDone(0xFFFFFFFFu);
  CHECK(consumer.WaitClientCopy(0xFFFFFFF0u, 10ms));
  producer.MarkClientCopyDone(2);  // the counter wrapped (0 is never used)
  CHECK(consumer.WaitClientCopy(0xFFFFFFFFu, 10ms));
  CHECK_FALSE(consumer.WaitClientCopy(3, 10ms));
  CommandConsumer(ring.block).Close();
  CHECK_FALSE(consumer.WaitClientCopy(5, 5s));  // a closed session gives up at once
}

TEST_CASE("a trainer rewriting a command while the daemon reads it cannot move the daemon's reads") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  // The hostile trainer, in a process of its own as it would be: keeps flipping every
  // slot's length between valid and huge, and its payload's inner lengths with it.
  pid_t flipper = ::fork();
  if (flipper == 0) {
    for (uint32_t i = 0;; ++i) {
      for (auto& slot : ring.block->commands) {
        std::atomic_ref<uint32_t>(slot.payload_bytes)
            .store(i % 2 ? 0xFFFFFFF0u : 8u, std::memory_order_relaxed);
        std::atomic_ref<uint8_t>(slot.payload[0]).store(static_cast<uint8_t>(i), std::memory_order_relaxed);
      }
    }
  }
  REQUIRE(flipper > 0);
  int decoded = 0, refused = 0;
  for (int round = 0; round < 2000; ++round) {
    if (!producer.PublishSnapshot(round + 1, {}).ok()) continue;
    std::optional<Command> command = consumer.Next(std::chrono::milliseconds(10));
    if (!command) continue;
    (command->payload.ok() ? decoded : refused)++;
  }
  ::kill(flipper, SIGKILL);
  ::waitpid(flipper, nullptr, 0);
  CHECK(decoded + refused > 0);  // every command came back as a value or an error, no crash
}

TEST_CASE("a sealed segment cannot be shrunk or grown by whoever receives it") {
  auto made = ckpt::shm::SealedSegment::Create("ckptd-test-ctl", 1 << 16);
  REQUIRE(made.ok());
  static_cast<char*>((*made)->data())[100] = 42;
  // The other side gets a duplicate of the descriptor, as SCM_RIGHTS would give it.
  auto other = ckpt::shm::SealedSegment::Map(ckpt::UniqueFd(::dup((*made)->fd())));
  REQUIRE(other.ok());
  CHECK(static_cast<char*>((*other)->data())[100] == 42);
  CHECK(::ftruncate((*other)->fd(), 0) != 0);
  CHECK(errno == EPERM);
  CHECK(::ftruncate((*other)->fd(), 1 << 20) != 0);
  static_cast<char*>((*made)->data())[(1 << 16) - 1] = 7;  // still mapped, still there
  CHECK(static_cast<char*>((*other)->data())[(1 << 16) - 1] == 7);
  // A descriptor that is not sealed is refused by the receiver.
  auto plain = ckpt::UniqueFd(::memfd_create("plain", MFD_CLOEXEC));
  REQUIRE(::ftruncate(plain.get(), 4096) == 0);
  CHECK_FALSE(ckpt::shm::SealedSegment::Map(std::move(plain)).ok());
}

TEST_CASE("a trainer that moves the ring's indices ends only its own ring") {
  Ring ring;
  CommandProducer producer(ring.block);
  CommandConsumer consumer(ring.block);
  REQUIRE(producer.PublishSnapshot(1, {}).ok());
  REQUIRE(consumer.Next(std::chrono::milliseconds(10)).has_value());
  // Rewinding the shared head does not make the daemon read the slot again.
  ring.block->head.store(0);
  CHECK_FALSE(consumer.Next(std::chrono::milliseconds(10)).has_value());
  CHECK_FALSE(consumer.broken());
  // A tail far ahead of anything a producer could publish breaks the ring, once.
  ring.block->tail.store(1000);
  CHECK_FALSE(consumer.Next(std::chrono::milliseconds(10)).has_value());
  CHECK(consumer.broken());
  CHECK_FALSE(consumer.Next(std::chrono::milliseconds(10)).has_value());
}
