#include "fault_injection.hpp"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "io_error.hpp"

namespace dcpds {
namespace faults {

std::atomic<bool> g_armed{false};

namespace {

std::mutex g_mu;
std::vector<FaultRule> g_rules;

const char* op_name(FaultOp op) {
  switch (op) {
    case FaultOp::kWrite: return "write";
    case FaultOp::kRead: return "read";
    case FaultOp::kFsync: return "fsync";
    case FaultOp::kRename: return "rename";
  }
  return "?";
}

uint64_t g_generation = 0;  // bumped by clear(): a claim never outlives its rule set

// Claims one firing of a matching rule, under the lock: returns a copy of it
// (with `fired` set to its index) or nothing.
std::optional<FaultRule> claim(FaultOp op, const std::string& path, bool ranged, uint64_t offset,
                               uint64_t len, uint64_t* generation) {
  std::lock_guard<std::mutex> lk(g_mu);
  *generation = g_generation;
  for (size_t i = 0; i < g_rules.size(); ++i) {
    FaultRule& r = g_rules[i];
    if (r.op != op || path.find(r.path_part) == std::string::npos) continue;
    // A ranged rule fires on the call whose bytes contain its offset (kAnyOffset: every call).
    if (ranged && r.offset != kAnyOffset && !(offset <= r.offset && r.offset < offset + len)) continue;
    if (r.times >= 0 && r.fired >= r.times) continue;
    if (r.skip > 0) {
      --r.skip;
      continue;
    }
    ++r.fired;
    FaultRule copy = r;
    copy.fired = static_cast<int64_t>(i);
    return copy;
  }
  return std::nullopt;
}

// Gives a claimed firing back (the call only moved the bytes before the fault).
void unclaim(size_t index, uint64_t generation) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (generation == g_generation && index < g_rules.size()) --g_rules[index].fired;
}

[[noreturn]] void die() {
  ::kill(::getpid(), SIGKILL);
  for (;;) ::pause();
}

}  // namespace

size_t add(FaultRule rule) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_rules.push_back(std::move(rule));
  g_armed.store(true);
  return g_rules.size() - 1;
}

void clear() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_rules.clear();
  ++g_generation;
  g_armed.store(false);
}

int64_t fired(size_t rule_index) {
  std::lock_guard<std::mutex> lk(g_mu);
  return rule_index < g_rules.size() ? g_rules[rule_index].fired : -1;
}

uint64_t before_transfer(FaultOp op, const std::string& path, uint64_t offset, uint64_t len) {
  uint64_t generation = 0;
  std::optional<FaultRule> rule = claim(op, path, true, offset, len, &generation);
  if (!rule) return len;
  const FaultRule& r = *rule;
  if (r.action == FaultAction::kStall) {
    std::this_thread::sleep_for(std::chrono::microseconds(r.stall_us));
    return len;
  }
  uint64_t before = (r.offset != kAnyOffset && r.offset > offset) ? r.offset - offset : 0;
  if (len % 4096 == 0) before = before / 4096 * 4096;  // O_DIRECT transfers stay block-aligned
  if (r.action == FaultAction::kShort) {
    // Transfers of whole 4 KiB blocks (O_DIRECT windows) are cut at a block
    // boundary, as block devices do; others anywhere.
    uint64_t n = before > 0 ? before : len / 2;
    if (len % 4096 == 0 && len > 4096) n = n / 4096 * 4096;
    if (n == 0) n = len > 4096 && len % 4096 == 0 ? 4096 : 1;
    return n < len ? n : len;
  }
  if (before > 0) {
    // Let the bytes before the fault through first; the rule stays armed for
    // the next call, which starts at the fault's offset.
    unclaim(static_cast<size_t>(r.fired), generation);
    return before;
  }
  if (r.action == FaultAction::kKill) die();
  throw IoError(r.err, path, static_cast<int64_t>(offset),
                describe_errno(std::string(op_name(op)) + " (injected fault)", r.err,
                               static_cast<int64_t>(offset), len));
}

void before_call(FaultOp op, const std::string& path) {
  uint64_t generation = 0;
  std::optional<FaultRule> rule = claim(op, path, false, 0, 0, &generation);
  if (!rule) return;
  if (rule->action == FaultAction::kStall) {
    std::this_thread::sleep_for(std::chrono::microseconds(rule->stall_us));
    return;
  }
  if (rule->action == FaultAction::kKill) die();
  throw IoError(rule->err, path, -1,
                describe_errno(std::string(op_name(op)) + " (injected fault)", rule->err, -1, 0));
}

}  // namespace faults
}  // namespace dcpds
