// Fault injection for the reliability tests: make chosen I/O calls fail.
//
// Tests arm rules (dcp_datastates.native.faults, through _engine.faults); production code pays one relaxed
// atomic load per call while none is armed. A rule matches an operation on a
// file whose path contains `path_part`; for writes and reads it fires on the
// call whose byte range contains `offset` (kAnyOffset: on every call). What
// it does:
//   kError  the bytes before `offset` are written (as a kernel does when the
//           disk fills mid-write), then the call fails with `err`;
//   kShort  the call transfers fewer bytes than asked (4 KiB-aligned, as
//           block devices do); the caller must retry the rest;
//   kKill   the bytes before `offset` are written, then the process dies by
//           SIGKILL (crash tests: a torn file, no cleanup);
//   kStall  the call waits `stall_us` microseconds, then goes through (a slow
//           disk: what overlaps with I/O must not wait for it).
// `skip` matching calls pass before the rule fires; it then fires `times`
// times (-1: on every later match).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace dcpds {

constexpr uint64_t kAnyOffset = ~uint64_t{0};

enum class FaultOp { kWrite = 0, kRead = 1, kFsync = 2, kRename = 3 };
enum class FaultAction { kError = 0, kShort = 1, kKill = 2, kStall = 3 };

struct FaultRule {
  FaultOp op;
  std::string path_part;
  uint64_t offset = 0;
  FaultAction action = FaultAction::kError;
  int err = 0;
  int64_t skip = 0;
  int64_t times = 1;
  int64_t stall_us = 0;  // kStall
  int64_t fired = 0;
};

namespace faults {

extern std::atomic<bool> g_armed;

// Returns the rule's index (for fired()).
size_t add(FaultRule rule);
void clear();
int64_t fired(size_t rule_index);

// Before a transfer of [offset, offset + len) of `path`: returns how many
// bytes the call may move (len when no rule fires), or throws IoError, or
// kills the process. A return of 0 means "fail now" has been thrown instead.
uint64_t before_transfer(FaultOp op, const std::string& path, uint64_t offset, uint64_t len);
// Before an operation without a byte range (fsync, rename): throws or kills.
void before_call(FaultOp op, const std::string& path);

inline uint64_t limit_transfer(FaultOp op, const std::string& path, uint64_t offset, uint64_t len) {
  if (!g_armed.load(std::memory_order_relaxed)) return len;
  return before_transfer(op, path, offset, len);
}
inline void check_call(FaultOp op, const std::string& path) {
  if (g_armed.load(std::memory_order_relaxed)) before_call(op, path);
}

}  // namespace faults
}  // namespace dcpds
