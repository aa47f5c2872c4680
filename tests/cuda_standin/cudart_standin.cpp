// A stand-in for the CUDA runtime library, so the engine's CUDA path runs on
// machines without a GPU (tests/test_cuda_standin.py builds it with the
// system compiler and loads it with _engine.load_cuda_runtime(path)).
//
// It exports every entry point the engine resolves (csrc/cuda_runtime.cpp)
// with the runtime's C signatures, and behaves the way the engine relies on:
//   - "device memory" is host memory; copies are memcpy;
//   - a stream is an ordered queue run by a thread of its own, so work on a
//     stream runs in order and after the call that queued it returns;
//   - an event completes when its stream reaches it, after an injectable
//     delay; cudaStreamWaitEvent makes a stream wait for the event's latest
//     record at the time of the call; destroyed events are handed out again
//     by cudaEventCreateWithFlags (newest first), as pooled handles are;
//   - streams and events belong to the device current on the calling thread
//     when they are made; recording an event on a stream of another device
//     fails, as it does on a GPU;
//   - host registrations are recorded (and double or unknown ones refused);
//   - any call can be made to fail with a chosen error code.
// Every call is logged, one line each, for the tests to read back.
//
// The control API (standin_*) is called by the tests through ctypes.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Err = int;
constexpr Err kSuccess = 0;
constexpr Err kInvalidValue = 1;
constexpr Err kInvalidDevice = 101;
constexpr Err kInvalidResourceHandle = 400;
constexpr Err kHostMemoryAlreadyRegistered = 712;
constexpr Err kHostMemoryNotRegistered = 713;

struct Event {
  int id = 0;
  int device = 0;
  bool live = false;
  uint64_t recorded = 0;       // records so far (never reset: handles are reused)
  uint64_t completed = 0;      // records completed so far
  uint64_t created_at = 0;     // `recorded` when this handle was last created
};

struct Stream {
  int id = 0;
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  uint64_t queued = 0;
  uint64_t finished = 0;
  bool stopping = false;
  std::thread worker;
};

struct FailRule {
  std::string call;
  Err code;
  int skip;
  int times;  // -1: every match
};

// Never destroyed: stream threads may still be parked when the process exits.
struct State {
  std::mutex mu;  // everything below except the streams' queues
  std::condition_variable events_cv;
  std::vector<std::string> log;
  std::vector<FailRule> rules;
  std::vector<std::unique_ptr<Event>> events;
  std::vector<Event*> free_events;
  std::map<uintptr_t, Stream*> streams;
  std::map<uintptr_t, size_t> registered;
  int device_count = 2;
  long event_delay_us = 0;
  long copy_delay_us = 0;
  int next_id = 1;
};

State& state() {
  static State* s = new State;
  return *s;
}

thread_local int t_device = 0;

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  return buf;
}

void log_locked(const std::string& line) { state().log.push_back(line); }

// The code an injected failure makes `call` return (0: none). Logged.
Err injected(const char* call) {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.mu);
  for (auto& r : s.rules) {
    if (r.call != call || r.times == 0) continue;
    if (r.skip > 0) {
      --r.skip;
      continue;
    }
    if (r.times > 0) --r.times;
    log_locked(std::string(call) + " -> injected error " + std::to_string(r.code));
    return r.code;
  }
  return kSuccess;
}

void sleep_us(long us) {
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

void stream_loop(Stream* st) {
  for (;;) {
    std::function<void()> op;
    {
      std::unique_lock<std::mutex> lk(st->mu);
      st->cv.wait(lk, [&] { return st->stopping || !st->queue.empty(); });
      if (st->queue.empty()) return;  // stopping, drained
      op = std::move(st->queue.front());
      st->queue.pop_front();
    }
    op();
    {
      std::lock_guard<std::mutex> lk(st->mu);
      ++st->finished;
    }
    st->cv.notify_all();
  }
}

void enqueue(Stream* st, std::function<void()> op) {
  {
    std::lock_guard<std::mutex> lk(st->mu);
    st->queue.push_back(std::move(op));
    ++st->queued;
  }
  st->cv.notify_all();
}

Stream* find_stream(void* handle) {
  auto it = state().streams.find(reinterpret_cast<uintptr_t>(handle));
  return it == state().streams.end() ? nullptr : it->second;
}

Event* find_event(void* handle) {
  auto* ev = static_cast<Event*>(handle);
  for (const auto& e : state().events)
    if (e.get() == ev) return ev->live ? ev : nullptr;
  return nullptr;
}

bool is_registered(const void* p, size_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto& [base, len] : state().registered)
    if (base <= a && a + n <= base + len) return true;
  return false;
}

// Blocks until `ev` has completed its record number `target`.
void wait_event(Event* ev, uint64_t target) {
  std::unique_lock<std::mutex> lk(state().mu);
  state().events_cv.wait(lk, [&] { return ev->completed >= target; });
}

}  // namespace

extern "C" {

// ----------------------------------------------------------------- the runtime API

Err cudaSetDevice(int device) {
  if (Err e = injected("cudaSetDevice")) return e;
  std::lock_guard<std::mutex> lk(state().mu);
  if (device < 0 || device >= state().device_count) {
    log_locked("cudaSetDevice device=" + std::to_string(device) + " -> invalid device");
    return kInvalidDevice;
  }
  t_device = device;
  log_locked("cudaSetDevice device=" + std::to_string(device));
  return kSuccess;
}

Err cudaStreamCreateWithFlags(void** stream, unsigned flags) {
  if (Err e = injected("cudaStreamCreateWithFlags")) return e;
  auto* st = new Stream;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st->id = state().next_id++;
    st->device = t_device;
    state().streams[reinterpret_cast<uintptr_t>(st)] = st;
    log_locked("cudaStreamCreateWithFlags stream=S" + std::to_string(st->id) + " device=" +
               std::to_string(st->device) + " flags=" + std::to_string(flags));
  }
  st->worker = std::thread(stream_loop, st);
  *stream = st;
  return kSuccess;
}

Err cudaStreamDestroy(void* stream) {
  if (Err e = injected("cudaStreamDestroy")) return e;
  Stream* st;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st = find_stream(stream);
    if (st == nullptr) return kInvalidResourceHandle;
    state().streams.erase(reinterpret_cast<uintptr_t>(stream));
    log_locked("cudaStreamDestroy stream=S" + std::to_string(st->id));
  }
  {
    std::lock_guard<std::mutex> lk(st->mu);
    st->stopping = true;  // work already queued still runs, as on a GPU
  }
  st->cv.notify_all();
  st->worker.join();
  delete st;
  return kSuccess;
}

Err cudaStreamSynchronize(void* stream) {
  if (Err e = injected("cudaStreamSynchronize")) return e;
  Stream* st;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st = find_stream(stream);
    if (st == nullptr) return kInvalidResourceHandle;
    log_locked("cudaStreamSynchronize stream=S" + std::to_string(st->id));
  }
  std::unique_lock<std::mutex> lk(st->mu);
  const uint64_t target = st->queued;
  st->cv.wait(lk, [&] { return st->finished >= target; });
  return kSuccess;
}

Err cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  if (Err e = injected("cudaStreamWaitEvent")) return e;
  Stream* st;
  Event* ev;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st = find_stream(stream);
    ev = find_event(event);
    if (st == nullptr || ev == nullptr) return kInvalidResourceHandle;
    if (flags != 0) return kInvalidValue;
    target = ev->recorded;
    log_locked("cudaStreamWaitEvent stream=S" + std::to_string(st->id) + " event=E" + std::to_string(ev->id) +
               " current=" + std::to_string(t_device));
    if (target == ev->created_at) return kSuccess;  // never recorded: nothing to wait for
  }
  enqueue(st, [ev, target] { wait_event(ev, target); });
  return kSuccess;
}

Err cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* stream) {
  if (Err e = injected("cudaMemcpyAsync")) return e;
  Stream* st;
  long delay;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st = find_stream(stream);
    if (st == nullptr) return kInvalidResourceHandle;
    if (kind < 0 || kind > 4) return kInvalidValue;
    delay = state().copy_delay_us;
    log_locked("cudaMemcpyAsync stream=S" + std::to_string(st->id) + " stream_device=" +
               std::to_string(st->device) + " current=" + std::to_string(t_device) + " src=" + hex(src) +
               " dst=" + hex(dst) + " nbytes=" + std::to_string(n) + " kind=" + std::to_string(kind) +
               " dst_pinned=" + (is_registered(dst, n) ? "1" : "0"));
  }
  enqueue(st, [dst, src, n, delay] {
    sleep_us(delay);
    std::memcpy(dst, src, n);
  });
  return kSuccess;
}

Err cudaEventCreateWithFlags(void** event, unsigned flags) {
  if (Err e = injected("cudaEventCreateWithFlags")) return e;
  std::lock_guard<std::mutex> lk(state().mu);
  State& s = state();
  Event* ev;
  if (!s.free_events.empty()) {  // the newest destroyed handle first
    ev = s.free_events.back();
    s.free_events.pop_back();
  } else {
    s.events.push_back(std::make_unique<Event>());
    ev = s.events.back().get();
    ev->id = s.next_id++;
  }
  ev->live = true;
  ev->device = t_device;
  ev->created_at = ev->recorded;
  *event = ev;
  log_locked("cudaEventCreateWithFlags event=E" + std::to_string(ev->id) + " device=" + std::to_string(ev->device) +
             " flags=" + std::to_string(flags));
  return kSuccess;
}

Err cudaEventRecord(void* event, void* stream) {
  if (Err e = injected("cudaEventRecord")) return e;
  Stream* st;
  Event* ev;
  uint64_t number;
  long delay;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st = find_stream(stream);
    ev = find_event(event);
    if (st == nullptr || ev == nullptr) return kInvalidResourceHandle;
    if (ev->device != st->device) {  // as on a GPU: an event is recorded on a stream of its own device
      log_locked("cudaEventRecord event=E" + std::to_string(ev->id) + " stream=S" + std::to_string(st->id) +
                 " -> event of device " + std::to_string(ev->device) + " on a stream of device " +
                 std::to_string(st->device));
      return kInvalidResourceHandle;
    }
    number = ++ev->recorded;
    delay = state().event_delay_us;
    log_locked("cudaEventRecord event=E" + std::to_string(ev->id) + " stream=S" + std::to_string(st->id) +
               " current=" + std::to_string(t_device));
  }
  enqueue(st, [ev, number, delay] {
    sleep_us(delay);
    {
      std::lock_guard<std::mutex> lk(state().mu);
      if (ev->completed < number) ev->completed = number;
    }
    state().events_cv.notify_all();
  });
  return kSuccess;
}

Err cudaEventSynchronize(void* event) {
  if (Err e = injected("cudaEventSynchronize")) return e;
  Event* ev;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    ev = find_event(event);
    if (ev == nullptr) return kInvalidResourceHandle;
    target = ev->recorded;
    log_locked("cudaEventSynchronize event=E" + std::to_string(ev->id));
    if (target == ev->created_at) return kSuccess;
  }
  wait_event(ev, target);
  return kSuccess;
}

Err cudaEventDestroy(void* event) {
  if (Err e = injected("cudaEventDestroy")) return e;
  std::lock_guard<std::mutex> lk(state().mu);
  Event* ev = find_event(event);
  if (ev == nullptr) return kInvalidResourceHandle;
  ev->live = false;  // a pending record still completes; the handle may be handed out again
  state().free_events.push_back(ev);
  log_locked("cudaEventDestroy event=E" + std::to_string(ev->id));
  return kSuccess;
}

Err cudaHostRegister(void* ptr, size_t n, unsigned flags) {
  if (Err e = injected("cudaHostRegister")) return e;
  std::lock_guard<std::mutex> lk(state().mu);
  const auto key = reinterpret_cast<uintptr_t>(ptr);
  if (ptr == nullptr || n == 0) return kInvalidValue;
  if (state().registered.count(key)) return kHostMemoryAlreadyRegistered;
  state().registered[key] = n;
  log_locked("cudaHostRegister ptr=" + hex(ptr) + " nbytes=" + std::to_string(n) + " flags=" + std::to_string(flags));
  return kSuccess;
}

Err cudaHostUnregister(void* ptr) {
  if (Err e = injected("cudaHostUnregister")) return e;
  std::lock_guard<std::mutex> lk(state().mu);
  if (state().registered.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) return kHostMemoryNotRegistered;
  log_locked("cudaHostUnregister ptr=" + hex(ptr));
  return kSuccess;
}

const char* cudaGetErrorString(Err code) {
  switch (code) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case 2: return "out of memory";
    case kInvalidDevice: return "invalid device ordinal";
    case kInvalidResourceHandle: return "invalid resource handle";
    case 700: return "an illegal memory access was encountered";
    case kHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case kHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case 999: return "unknown error";
    default: return "unrecognized error code";
  }
}

// ----------------------------------------------------------------- control API for the tests

// Forgets the log and the failure rules; sets the device count and the delays.
void standin_reset(int device_count, long event_delay_us, long copy_delay_us) {
  std::lock_guard<std::mutex> lk(state().mu);
  state().log.clear();
  state().rules.clear();
  state().device_count = device_count;
  state().event_delay_us = event_delay_us;
  state().copy_delay_us = copy_delay_us;
}

// The next `times` calls of `call` after `skip` more return `code` (-1: all of them).
void standin_fail(const char* call, int code, int skip, int times) {
  std::lock_guard<std::mutex> lk(state().mu);
  state().rules.push_back({call, code, skip, times});
}

void standin_set_delays(long event_delay_us, long copy_delay_us) {
  std::lock_guard<std::mutex> lk(state().mu);
  state().event_delay_us = event_delay_us;
  state().copy_delay_us = copy_delay_us;
}

// A "kernel" on `stream`: after `delay_us`, sets `n` bytes at `dst` to `value`.
Err standin_enqueue_fill(void* stream, void* dst, int value, size_t n, long delay_us) {
  Stream* st;
  {
    std::lock_guard<std::mutex> lk(state().mu);
    st = find_stream(stream);
    if (st == nullptr) return kInvalidResourceHandle;
    log_locked("kernel fill stream=S" + std::to_string(st->id) + " dst=" + hex(dst) + " nbytes=" + std::to_string(n));
  }
  enqueue(st, [dst, value, n, delay_us] {
    sleep_us(delay_us);
    std::memset(dst, value, n);
  });
  return kSuccess;
}

// The log, one call a line; returns the bytes it needs (copies at most cap - 1 and a NUL).
size_t standin_log(char* buf, size_t cap) {
  std::lock_guard<std::mutex> lk(state().mu);
  std::string all;
  for (const auto& line : state().log) all += line + "\n";
  if (buf != nullptr && cap > 0) {
    const size_t n = all.size() < cap - 1 ? all.size() : cap - 1;
    std::memcpy(buf, all.data(), n);
    buf[n] = '\0';
  }
  return all.size() + 1;
}

// Live objects: "streams", "events" or "registered" (host registrations).
int standin_count(const char* what) {
  std::lock_guard<std::mutex> lk(state().mu);
  const std::string w = what;
  if (w == "streams") return static_cast<int>(state().streams.size());
  if (w == "registered") return static_cast<int>(state().registered.size());
  if (w == "events") {
    int n = 0;
    for (const auto& e : state().events) n += e->live ? 1 : 0;
    return n;
  }
  return -1;
}

}  // extern "C"
