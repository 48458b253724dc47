// Write-protection of a trainer's arenas, for copy-on-write snapshots (cow_copy.h).
//
// The trainer creates a userfaultfd (which always acts on the creating process's memory)
// and hands it to ckptd; ckptd registers the trainer's arena mappings with it. At a
// snapshot ckptd write-protects the arenas and releases the trainer at once: a trainer
// thread that then writes a protected page stops in the kernel until ckptd has copied that
// part of the arena and lifted the protection. Reads never stop.
//
// Only arenas in huge pages are worth it: protection changes and faults then cover 2 MiB
// each. In 4 KiB pages every page the trainer writes after the copy takes a minor fault of
// its own, which on the development VM cost 3x the plain copy (docs/benchmarks.md).
//
// If ckptd dies, the kernel drops the registration and wakes every waiting thread, so a
// trainer never hangs on a dead daemon (the trainer closes its own copy of the descriptor
// once handed over). If the trainer dies, the calls below fail and the copy goes on from
// ckptd's own mapping.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace ckpt::daemon {

class WriteProtector {
 public:
  // OK when `fd` is a userfaultfd (a line saying why not otherwise). Cheap.
  static absl::Status CheckReceivable(int fd);
  // Takes a trainer's userfaultfd whose API handshake has not been done yet, and does it,
  // asking for write-protection of shared memory and huge pages.
  static absl::StatusOr<WriteProtector> Create(UniqueFd uffd);

  // Registers the trainer's mapping [trainer_begin, trainer_begin + bytes) of an arena for
  // write-protection (the caller has checked that it maps that arena: MapsArena).
  absl::Status Register(uint64_t trainer_begin, uint64_t bytes);
  // Write-protects / releases a registered range (whole huge pages). Release wakes the
  // trainer's threads waiting on it.
  absl::Status Protect(uint64_t begin, uint64_t bytes);
  absl::Status Release(uint64_t begin, uint64_t bytes);
  // Wakes threads waiting on a range that is already released (a fault read late).
  void Wake(uint64_t begin, uint64_t bytes);

  // The address of the next write fault, waiting at most `wait`; nullopt when none came.
  std::optional<uint64_t> NextFault(std::chrono::milliseconds wait);

  // True when the trainer `pid` maps the file `inode` at exactly [begin, begin + bytes)
  // from its start (/proc/<pid>/maps): a registration must cover the arena it claims to,
  // or writes to the real mapping would go unseen.
  static bool MapsArena(int pid, uint64_t begin, uint64_t bytes, uint64_t inode);

  // Registered ranges: {trainer_begin, bytes}.
  struct Range {
    uint64_t begin;
    uint64_t bytes;
  };
  const std::vector<Range>& ranges() const { return ranges_; }

 private:
  explicit WriteProtector(UniqueFd uffd) : uffd_(std::move(uffd)) {}
  absl::Status Set(uint64_t begin, uint64_t bytes, bool protect);

  UniqueFd uffd_;
  std::vector<Range> ranges_;
};

}  // namespace ckpt::daemon
