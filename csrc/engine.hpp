// The data-movement engine: moves byte regions between host memory and files
// without the GIL.
//
// Writes run as a two-stage pipeline with back-pressure:
//   stage  one stager thread copies each window of the file (up to
//          `window_bytes` of consecutive regions, zero-filled gaps) into a
//          slot of the bounded HostPool, blocking while the pool is full;
//   flush  I/O threads checksum the slot (CRC32C per region piece, cut at
//          multiples of `checksum_bytes` in the file when that is set) and
//          pwrite it at its aligned file offset, O_DIRECT when the filesystem
//          accepts it, then free the slot. A buffered window is checksummed
//          and written a block (kFusedBlockBytes) at a time, so each byte is
//          read from memory once, by the checksum, and copied into the page
//          cache from the core's cache; an O_DIRECT window (the device reads
//          memory itself) is checksummed, then written in one call.
// A job that borrows its sources (the caller keeps them unchanged and alive
// until the job is done, as a synchronous save does) skips the copy where the
// destination can take the caller's memory as it is: a window of contiguous
// host pieces is checksummed and written straight from them (pwritev, zeros
// from a shared page for the gaps) when the file is buffered, or when every
// piece is page-aligned for O_DIRECT. Such a window counts as staged once it
// is written. On tmpfs, auto mode writes buffered: O_DIRECT there is only
// another copy into the same page cache.
// A job finishes with one fsync of its file. Windows complete out of order.
// An I/O thread takes the oldest window of a file no other thread is writing
// when there is one: buffered writes to one file serialize on its inode lock
// (tmpfs, ext4, xfs), so a rank striped over several files (one job each)
// keeps every thread on its own file.
// Reads split each request into pieces (at checksum-segment boundaries) and
// pread them in parallel straight into the caller's memory, verifying every
// checksum segment they fully cover; adjacent pieces of one task are read
// a block (kFusedBlockBytes) at a time whatever their sizes, each block
// verified while it is still in the core's cache, so small segments do not
// mean small reads and large ones are not read from memory twice.
//
// Sources may be contiguous host memory, strided host memory (a view such as
// a transpose: gathered into the window run by run, so no contiguous copy is
// ever allocated) or CUDA memory (copied with cudaMemcpyAsync on a side
// stream, after the event the caller recorded on its own stream, into the
// pool, which is pinned on first use; the window counts as staged once that
// copy has completed: a copier thread waits for the copies in the order they
// were queued, so staging finishes at the copies' speed when the pool holds
// the state, whatever the pace of the writes).
//
// A streamed job (`stream`) has no file: its windows are staged and
// checksummed as for a file, then handed, in file order, to the caller
// (Engine::stream_next), who sends them on (an object store's multipart
// upload) and gives each slot back by asking for the next. Memory stays
// within the pool, and the caller's pace is the job's back-pressure.
//
// The engine never sees torch objects: callers pass raw pointers and keep the
// memory alive until the job has finished.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "host_pool.hpp"
#include "io_error.hpp"
#include "posix_file.hpp"

namespace dcpds {

// A host tensor's memory when it is not contiguous: outer dimensions
// (outermost first, strides in bytes) whose innermost step starts a new
// contiguous run of `run` bytes. Built by make(), which merges dimensions
// that are contiguous with each other.
struct StridedLayout {
  std::vector<uint64_t> sizes;
  std::vector<int64_t> strides;
  uint64_t run = 0;
  // nullptr when the sizes/strides describe contiguous memory.
  static std::shared_ptr<const StridedLayout> make(const std::vector<int64_t>& sizes,
                                                   const std::vector<int64_t>& strides,
                                                   uint64_t itemsize);
  // Copies logical bytes [logical, logical + len) of the tensor at `base`.
  void gather(uint8_t* dst, const uint8_t* base, uint64_t logical, uint64_t len) const;
};

struct Region {
  const uint8_t* src;
  uint64_t len;
  uint64_t offset;  // file offset
  std::shared_ptr<const StridedLayout> strided = nullptr;  // host memory with gaps
  int device = -1;               // >= 0: `src` is CUDA memory on this device
  void* ready_event = nullptr;   // CUDA event the copy waits for (caller's stream)
};

struct Segment {
  uint64_t offset;  // file offset
  uint64_t len;
  uint32_t crc;
};

// Buffered writes and all reads move a window's bytes this many at a time, each
// block checksummed (or verified) while it is still in the core's cache.
constexpr uint64_t kFusedBlockBytes = 256 << 10;

class Engine;

// An engine used in a process forked from the one that created it: its
// threads do not exist there, so anything that waits for them would wait
// forever. Raised instead (dcp_datastates._engine.ForkedEngineError).
class ForkedEngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class WriteJob {
 public:
  struct Piece {
    const uint8_t* src;  // start of the piece; for strided sources, the tensor's base
    uint64_t rel;        // offset inside the window
    uint64_t len;
    const StridedLayout* strided;  // kept alive by the job
    uint64_t logical;              // strided: byte offset of the piece inside the tensor
    int device;
    void* ready_event;
  };
  // A window holds pieces of one start_write() or append() call only: the
  // ready events of its pieces are alive while it is staged (the caller keeps
  // them until wait_staged()), which is what lets copy_from_devices() wait for
  // each distinct event once per window.
  struct Window {
    size_t index = 0;
    uint64_t start = 0;  // aligned file offset
    uint64_t used = 0;   // bytes from start to the end of the last piece
    std::vector<Piece> pieces;
    uint8_t* slot = nullptr;
    bool staged = false;
    std::vector<void*> copies_done;  // CUDA events, one per device copied from
    bool from_source = false;  // written straight from the pieces (no slot): see borrow
    bool ready = false;        // streamed: checksummed, its slot waiting for the caller
    uint64_t padded() const { return align_up(used); }
  };

  // `durable`: fsync the file when the job finishes (false only for scratch files
  // that are read back and removed, never part of a checkpoint). `borrow`: the
  // caller keeps every source unchanged and alive until the job is done, so
  // windows may be written from them without a copy (see the top of this file).
  // `stream`: no file is opened; `path` only names the destination in errors.
  WriteJob(std::string path, DirectMode mode, uint64_t preallocate, bool durable = true,
           bool borrow = false, bool stream = false);

  const std::string& path() const { return path_; }
  bool direct() const { return direct_.load(); }
  bool borrows() const { return borrow_; }
  bool streams() const { return stream_; }
  // Windows written straight from the caller's memory so far (no pool copy).
  uint64_t windows_from_source() const { return from_source_.load(); }
  bool done();
  bool failed() const { return failed_.load(); }
  // Blocks until every region appended so far has been copied out of the
  // caller's memory (or the job failed); returns false on failure.
  bool wait_staged();
  // Blocks until the job is sealed, written and fsynced; throws IoError on failure.
  std::vector<Segment> wait();
  // Aborts the remaining windows; in-flight copies and writes finish first.
  void cancel(const std::string& why);

 private:
  friend class Engine;
  void fail(const IoError& e);
  void reserve_space();
  void write_window(const Window& w);
  // Buffered: writes the window a block at a time, each block checksummed first
  // (segments cut at multiples of `cut` in the file, 0: one per piece), so the
  // bytes are read from memory once, by the checksum, and written from cache.
  void write_checksummed(const Window& w, std::vector<Segment>& segs, uint64_t cut);
  // One buffered pwritev of this file at a time (see buffered_write_mu_).
  void write_buffered(const std::vector<iovec>& iov, uint64_t offset);
  // Whether `w` can be written from its pieces' memory as it is (borrowed job).
  bool writable_from_source(const Window& w) const;
  void on_staged(Window& w);
  // Returns true when this was the last window of a sealed job.
  bool on_flushed(std::vector<Segment>&& segs);
  void finalize();

  std::string path_;
  DirectMode mode_;
  bool durable_ = true;
  bool borrow_ = false;
  bool stream_ = false;
  size_t taken_ = 0;            // streamed: windows [0, taken_) were handed to the caller
  Window* current_ = nullptr;   // streamed: the window the caller holds now
  std::atomic<uint64_t> from_source_{0};
  uint64_t preallocate_ = 0;  // bytes to reserve before the first window is written
  std::once_flag reserved_;
  Fd fd_;
  Fd buffered_fd_;  // opened when O_DIRECT writes are refused in auto mode
  std::atomic<bool> direct_{false};
  std::atomic<bool> failed_{false};
  std::mutex buffered_write_mu_;  // one buffered pwrite of this file at a time (write_buffered)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Window> windows_;  // deque: references stay valid as windows are appended
  uint64_t frontier_ = 0;       // appended regions must start at or after this offset
  size_t staged_prefix_ = 0;  // windows [0, staged_prefix_) are all staged
  size_t flushed_ = 0;
  std::vector<std::shared_ptr<const StridedLayout>> layouts_;
  // The engine's count of unfinished jobs: decremented by finalize() before
  // the job is marked done, so a waiter that wakes sees it already counted out.
  std::atomic<int>* in_flight_ = nullptr;
  bool sealed_ = false;
  bool done_ = false;
  std::optional<IoError> error_;
  std::vector<Segment> segments_;
};

// The next window of a streamed job, in file order; `end` once every window
// has been handed out. `data` stays valid until the next stream_next() call.
struct StreamChunk {
  bool end = true;
  uint64_t offset = 0;
  const uint8_t* data = nullptr;
  uint64_t len = 0;
};

struct ReadCheck {
  uint64_t rel;  // offset inside the request
  uint64_t len;
  uint32_t crc;
};

struct ReadRequest {
  uint32_t file;  // index into the job's file list
  uint64_t offset;
  uint64_t len;
  uint8_t* dst;
  std::vector<ReadCheck> checks;  // sorted, non-overlapping, inside [0, len)
};

struct ReadFailure {
  uint64_t request;
  std::string kind;  // "io", "truncated" or "checksum"
  int err;
  std::string path;
  int64_t offset;
  std::string message;
};

class ReadJob {
 public:
  bool done();
  // Blocks until every piece has been read; returns the failures (empty on success).
  std::vector<ReadFailure> wait();
  void cancel();

 private:
  friend class Engine;
  struct Piece {
    uint64_t request;
    uint64_t rel;
    uint64_t len;
    bool checked;
    uint32_t crc;
  };
  // Reads pieces [first, last) of one request, adjacent in it, with one pread;
  // then verifies each checked one.
  void run_pieces(const Piece* first, const Piece* last);
  void add_failure(ReadFailure f);
  void piece_done(size_t n);

  std::vector<std::string> paths_;
  std::vector<Fd> fds_;
  std::vector<int> open_errors_;
  std::vector<ReadRequest> requests_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int>* in_flight_ = nullptr;  // see WriteJob::in_flight_
  std::mutex mu_;
  std::condition_variable cv_;
  size_t pending_ = 0;
  std::vector<ReadFailure> failures_;
};

class Engine {
 public:
  // `checksum_bytes`: 0 for one checksum segment per region piece of a window;
  // else a power of two (at most the window) that cuts them at its multiples in
  // the file, so a partial read is widened to less than a window.
  Engine(unsigned io_threads, uint64_t pool_bytes, uint64_t window_bytes, uint64_t checksum_bytes = 0);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Deletes `e` in the process that created it and leaks it anywhere else (a
  // fork child): there its threads cannot be joined, and its condition
  // variables still count the parent's waiters, so destroying them would hang.
  static void release(Engine* e);
  pid_t owner_pid() const { return owner_pid_; }
  bool owned_here() const;
  // Throws ForkedEngineError outside the creating process: `what` would wait
  // for threads that do not exist there.
  void require_owner(const char* what, const std::string& path = "") const {
    require_owner(owner_pid_, what, path);
  }
  // The same check for a job that outlived its engine reference (a finished job).
  static void require_owner(pid_t owner, const char* what, const std::string& path);
  // Write and read jobs started and not yet finished (a write job counts until
  // it is sealed and written, or failed and wound down).
  int jobs_in_flight() const { return in_flight_.load(); }

  // Creates `path` (it must not exist) and starts writing `regions` (sorted by
  // offset, non-overlapping). More regions may be appended until seal().
  // `stream`: no file; the caller takes the windows with stream_next().
  std::shared_ptr<WriteJob> start_write(const std::string& path, std::vector<Region> regions,
                                        DirectMode mode, uint64_t preallocate, bool durable = true,
                                        bool borrow = false, bool stream = false);
  void append(const std::shared_ptr<WriteJob>& job, std::vector<Region> regions);
  void seal(const std::shared_ptr<WriteJob>& job);
  // A streamed job's next window in file order, once it is staged and
  // checksummed; the window handed out by the previous call goes back to the
  // pool first. Blocks (call it without the GIL). {end: true} once the job is
  // sealed and every window was handed out and given back; throws the job's
  // IoError if it failed (after giving back every window it held).
  StreamChunk stream_next(const std::shared_ptr<WriteJob>& job);
  // A failed or dropped streamed job: give back every slot held by windows
  // the caller will never take, so that the job can wind down.
  void stream_abandon(const std::shared_ptr<WriteJob>& job);

  std::shared_ptr<ReadJob> start_read(std::vector<std::string> paths,
                                      std::vector<ReadRequest> requests);

  // Pins the pool for CUDA copies (cudaHostRegister) if the CUDA runtime is
  // loaded and it is not pinned yet; returns "" or why pinning failed (the
  // copies then still work, from pageable memory). A failure is remembered
  // (pin_error()) and not retried.
  std::string pin_pool();
  bool pool_pinned() const { return pinned_.load(); }
  std::string pin_error();

  unsigned io_threads() const { return static_cast<unsigned>(io_.size()); }
  uint64_t window_bytes() const { return window_bytes_; }
  uint64_t checksum_bytes() const { return checksum_bytes_; }
  HostPool& pool() { return pool_; }

 private:
  struct StageTask {
    std::shared_ptr<WriteJob> job;
    WriteJob::Window* window;
  };
  void enqueue_windows(const std::shared_ptr<WriteJob>& job, std::vector<Region>& regions);
  void stager_loop();
  // Waits, in queue order, for the device-to-host copies of windows the stager
  // queued them for, counts those windows as staged and hands them to the I/O threads.
  void copier_loop();
  void io_loop();
  // `file`: the write job the task writes to (nullptr: reads, anything else),
  // which io_loop() uses to keep threads on different files.
  void post_io(std::function<void()> fn, const WriteJob* file = nullptr);
  void stage(StageTask& t);
  // Queues the window's checksum and write (or, streamed, its hand-over) on the I/O threads.
  void post_flush(const std::shared_ptr<WriteJob>& job, WriteJob::Window* w);
  void flush(const std::shared_ptr<WriteJob>& job, WriteJob::Window* w);
  // Appends the checksum segments of `len` bytes at file offset `offset`.
  void checksum(std::vector<Segment>& segs, uint64_t offset, const uint8_t* bytes, uint64_t len) const;
  void copy_from_devices(WriteJob& job, WriteJob::Window& w);
  void copy_on_stream(WriteJob& job, WriteJob::Window& w, int device, void* stream);
  void* device_stream(int device, const WriteJob& job, int64_t at);
  void finish_device_copies(WriteJob& job, WriteJob::Window& w);

  pid_t owner_pid_;
  uint64_t window_bytes_;
  uint64_t checksum_bytes_;
  HostPool pool_;
  std::mutex mu_;
  std::condition_variable stage_cv_;
  std::condition_variable io_cv_;
  std::deque<StageTask> stage_q_;
  std::condition_variable copy_cv_;
  std::deque<StageTask> copy_q_;  // windows whose device copies are queued (under mu_)
  bool copies_closed_ = false;    // set once the stager has exited (under mu_)
  struct IoTask {
    std::function<void()> fn;
    const WriteJob* file;
  };
  std::deque<IoTask> io_q_;
  std::vector<const WriteJob*> writing_;  // the file of each running write task (under mu_)
  std::atomic<bool> stopping_{false};
  std::atomic<int> in_flight_{0};
  std::mutex cuda_mu_;
  std::vector<std::pair<int, void*>> streams_;  // device -> side stream
  std::atomic<bool> pinned_{false};
  std::string pin_error_;
  std::thread stager_;
  std::thread copier_;
  std::vector<std::thread> io_;
};

}  // namespace dcpds
