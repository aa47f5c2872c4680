#include "engine.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "crc32c.hpp"
#include "cuda_runtime.hpp"

namespace dcpds {

namespace {

// Names the calling thread, so that per-thread CPU time (/proc/self/task/*/comm) tells the
// engine's staging copies from its checksums and writes and from the Python threads. A name
// is a label only: a refusal (a name too long, a platform without it) changes nothing else.
void name_this_thread(const char* name) {
  int rc = ::pthread_setname_np(::pthread_self(), name);
  (void)rc;
}

}  // namespace

// ---------------------------------------------------------------- StridedLayout

std::shared_ptr<const StridedLayout> StridedLayout::make(const std::vector<int64_t>& sizes,
                                                         const std::vector<int64_t>& strides,
                                                         uint64_t itemsize) {
  if (sizes.size() != strides.size())
    throw std::invalid_argument("a strided region needs as many strides as sizes");
  if (itemsize == 0) throw std::invalid_argument("a strided region needs a non-zero itemsize");
  std::vector<uint64_t> s;
  std::vector<int64_t> st;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0 || strides[i] < 0)
      throw std::invalid_argument("a strided region has a negative size or stride");
    if (sizes[i] == 0) return nullptr;  // no bytes at all
    if (sizes[i] == 1) continue;        // a unit dimension adds no step
    const int64_t stride = strides[i] * static_cast<int64_t>(itemsize);
    if (!s.empty() && st.back() == stride * sizes[i]) {  // contiguous with the outer one
      s.back() *= static_cast<uint64_t>(sizes[i]);
      st.back() = stride;
    } else {
      s.push_back(static_cast<uint64_t>(sizes[i]));
      st.push_back(stride);
    }
  }
  uint64_t run = itemsize;
  if (!s.empty() && st.back() == static_cast<int64_t>(itemsize)) {
    run = s.back() * itemsize;
    s.pop_back();
    st.pop_back();
  }
  if (s.empty()) return nullptr;
  auto out = std::make_shared<StridedLayout>();
  out->sizes = std::move(s);
  out->strides = std::move(st);
  out->run = run;
  return out;
}

void StridedLayout::gather(uint8_t* dst, const uint8_t* base, uint64_t logical,
                           uint64_t len) const {
  const size_t nd = sizes.size();
  uint64_t r = logical / run, within = logical % run;
  std::vector<uint64_t> idx(nd);
  int64_t addr = 0;
  for (size_t d = nd; d-- > 0;) {
    idx[d] = r % sizes[d];
    r /= sizes[d];
    addr += static_cast<int64_t>(idx[d]) * strides[d];
  }
  auto step = [&] {  // to the next run: odometer over the outer dimensions
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < sizes[d]) {
        addr += strides[d];
        return;
      }
      addr -= static_cast<int64_t>(sizes[d] - 1) * strides[d];
      idx[d] = 0;
    }
  };
  // Element-sized runs (a transposed matrix) get fixed-size copies the
  // compiler inlines; otherwise (and for partial runs) a memcpy per run.
  auto copy_whole_runs = [&](auto n) {
    constexpr uint64_t N = decltype(n)::value;
    for (; len >= N; len -= N, dst += N) {
      std::memcpy(dst, base + addr, N);
      step();
    }
  };
  if (within == 0) {
    if (run == 2) copy_whole_runs(std::integral_constant<uint64_t, 2>{});
    if (run == 4) copy_whole_runs(std::integral_constant<uint64_t, 4>{});
    if (run == 8) copy_whole_runs(std::integral_constant<uint64_t, 8>{});
  }
  while (len > 0) {
    uint64_t take = std::min(run - within, len);
    std::memcpy(dst, base + addr + static_cast<int64_t>(within), take);
    dst += take;
    len -= take;
    within = 0;
    step();
  }
}

// ---------------------------------------------------------------- WriteJob

WriteJob::WriteJob(std::string path, DirectMode mode, uint64_t preallocate, bool durable, bool borrow,
                   bool stream)
    : path_(std::move(path)), mode_(mode), durable_(durable), borrow_(borrow), stream_(stream) {
  if (stream_) return;  // no file: the windows go to the caller (stream_next)
  const int base = O_WRONLY | O_CREAT | O_EXCL;
  if (mode != DirectMode::kBuffered) {
    int err = 0;
    fd_ = Fd::try_open(path_, base | O_DIRECT, 0644, &err);
    if (fd_.valid()) {
      direct_ = true;
    } else if (!(mode == DirectMode::kAuto && err == EINVAL)) {
      throw IoError(err, path_, -1,
                    describe_errno(mode == DirectMode::kDirect ? "open with O_DIRECT" : "open",
                                   err, -1, 0));
    }
  }
  if (!fd_.valid()) fd_ = Fd::open(path_, base);
  struct statfs fs;
  const bool tmpfs =
      ::fstatfs(fd_.get(), &fs) == 0 && static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC;
  if (tmpfs && direct_.load() && mode == DirectMode::kAuto) {
    // tmpfs accepts O_DIRECT (Linux 6.6 and newer) but its pages are the
    // storage: a direct write is a copy into them like a buffered one, and a
    // buffered file lets a borrowed job write from the caller's memory.
    const int flags = ::fcntl(fd_.get(), F_GETFL);
    if (flags < 0 || ::fcntl(fd_.get(), F_SETFL, flags & ~O_DIRECT) < 0) {
      int err = errno;
      throw IoError(err, path_, -1, describe_errno("clearing O_DIRECT (fcntl)", err, -1, 0));
    }
    direct_ = false;
  }
  preallocate_ = preallocate;
  if (preallocate_ == 0) return;
  if (tmpfs) {
    // On tmpfs fallocate allocates and zeroes every page before the writes fill
    // them again: a whole extra pass over the bytes (done here it also made
    // stage() take time proportional to the state, 58 ms for 200 MB; in the I/O
    // thread: 4.44 -> 4.17 GB/s writing /dev/shm, benchmarks/probe_file_writes.cc).
    // So nothing is reserved: a full filesystem fails here, by its free space,
    // and a tmpfs that fills up while the job writes fails that write with
    // ENOSPC like any other error.
    struct statvfs vfs;
    if (::fstatvfs(fd_.get(), &vfs) == 0 &&
        static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < preallocate_)
      throw IoError(ENOSPC, path_, 0, describe_errno("reserving space", ENOSPC, 0, preallocate_));
    preallocate_ = 0;
    return;
  }
  reserve_space();  // cheap on extent-based filesystems: a full disk fails before any byte moves
  preallocate_ = 0;
}

void WriteJob::reserve_space() {
  // Reserving the blocks up front makes a full disk fail before any byte is
  // written, and gives the filesystem one extent to fill.
  if (preallocate_ == 0) return;
  int rc;
  do {
    rc = ::fallocate(fd_.get(), FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(preallocate_));
  } while (rc < 0 && errno == EINTR);
  if (rc < 0 && errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL) {
    int err = errno;
    throw IoError(err, path_, 0, describe_errno("reserving space", err, 0, preallocate_));
  }
}

bool WriteJob::done() {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool WriteJob::wait_staged() {
  std::unique_lock<std::mutex> lk(mu_);
  const size_t target = windows_.size();
  cv_.wait(lk, [&] { return done_ || failed_.load() || staged_prefix_ >= target; });
  return !failed_.load();
}

std::vector<Segment> WriteJob::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_; });
  if (error_) throw *error_;
  return segments_;
}

void WriteJob::fail(const IoError& e) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_) error_ = e;
  failed_ = true;
  cv_.notify_all();
}

void WriteJob::cancel(const std::string& why) {
  fail(IoError(ECANCELED, path_, -1, why));
}

namespace {

// Zeros for the gaps of windows written from the caller's memory: page-aligned
// (an O_DIRECT iovec), never written to. Never freed either: an I/O thread may
// still be writing from it while the process exits and static objects go.
constexpr uint64_t kZeroBytes = 1 << 20;
const uint8_t* zero_block() {
  static const uint8_t* const block = [] {
    void* p = std::aligned_alloc(kAlign, kZeroBytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, kZeroBytes);
    return static_cast<const uint8_t*>(p);
  }();
  return block;
}

void push_zeros(std::vector<iovec>& iov, uint64_t n) {
  for (; n > 0;) {
    const uint64_t take = std::min(n, kZeroBytes);
    iov.push_back({const_cast<uint8_t*>(zero_block()), take});
    n -= take;
  }
}

// Appends the buffers of window bytes [from, to) (a block of the window) to `iov`:
// the slot's, or the pieces' and the zeros between them. `piece` is the first
// piece that may overlap the block; it is advanced past those that end in it.
void block_buffers(const WriteJob::Window& w, uint64_t from, uint64_t to, size_t& piece,
                   std::vector<iovec>& iov) {
  if (!w.from_source) {
    iov.push_back({w.slot + from, to - from});
    return;
  }
  uint64_t cursor = from;
  for (size_t i = piece; i < w.pieces.size() && w.pieces[i].rel < to; ++i) {
    const auto& p = w.pieces[i];
    const uint64_t a = std::max(cursor, p.rel), b = std::min(to, p.rel + p.len);
    if (b <= a) continue;  // ends before the block (or is empty)
    if (a > cursor) push_zeros(iov, a - cursor);
    iov.push_back({const_cast<uint8_t*>(p.src) + (a - p.rel), b - a});
    cursor = b;
  }
  if (to > cursor) push_zeros(iov, to - cursor);
  while (piece < w.pieces.size() && w.pieces[piece].rel + w.pieces[piece].len <= to) ++piece;
}

// The window's bytes as buffers: its slot, or its pieces and the zeros between them.
std::vector<iovec> window_buffers(const WriteJob::Window& w) {
  std::vector<iovec> iov;
  iov.reserve(w.from_source ? 2 * w.pieces.size() + 1 : 1);
  size_t piece = 0;
  block_buffers(w, 0, w.padded(), piece, iov);
  return iov;
}

}  // namespace

// The checksum segments of consecutive pieces, fed in order a part at a time:
// the same segments Engine::checksum() makes of each whole piece.
class SegmentCursor {
 public:
  SegmentCursor(std::vector<Segment>& segs, uint64_t cut) : segs_(segs), cut_(cut) {}
  // Bytes at file offset `offset` that continue the current piece.
  void add(uint64_t offset, const uint8_t* bytes, uint64_t len) {
    while (len > 0) {
      if (!open_) {
        open_ = true;
        seg_ = {offset, 0, 0};
      }
      uint64_t take = len;
      if (cut_ != 0) take = std::min(len, (offset / cut_ + 1) * cut_ - offset);
      seg_.crc = crc32c_extend(seg_.crc, bytes, take);
      seg_.len += take;
      offset += take;
      bytes += take;
      len -= take;
      if (cut_ != 0 && offset % cut_ == 0) close();
    }
  }
  // The piece that started at `offset` (of `src`) is complete.
  void end_piece(uint64_t offset, const uint8_t* src) {
    if (open_)
      close();
    else if (cut_ == 0)
      segs_.push_back({offset, 0, crc32c_extend(0, src, 0)});  // an empty piece, as checksum() has it
  }

 private:
  void close() {
    segs_.push_back(seg_);
    open_ = false;
  }
  std::vector<Segment>& segs_;
  uint64_t cut_;
  bool open_ = false;
  Segment seg_{0, 0, 0};
};

bool WriteJob::writable_from_source(const Window& w) const {
  if (!borrow_ || stream_) return false;  // a streamed window is handed out from its slot
  const bool direct = direct_.load();
  for (const auto& p : w.pieces) {
    if (p.device >= 0 || p.strided != nullptr) return false;
    if (direct && (reinterpret_cast<uintptr_t>(p.src) % kAlign != 0 || p.rel % kAlign != 0 ||
                   p.len % kAlign != 0))
      return false;
  }
  return true;
}

void WriteJob::write_window(const Window& w) {
  std::call_once(reserved_, [this] { reserve_space(); });  // an error fails the job, like a write's
  const std::vector<iovec> iov = window_buffers(w);
  if (!direct_.load()) {
    write_buffered(iov, w.start);
    return;
  }
  try {
    fd_.pwritev_all(iov, w.start);
  } catch (const IoError& e) {
    // Some filesystems accept O_DIRECT at open and refuse it per write; in
    // auto mode the rest of the file is written through the page cache.
    if (e.err() != EINVAL || mode_ != DirectMode::kAuto) throw;
    std::lock_guard<std::mutex> lk(mu_);
    if (!buffered_fd_.valid()) buffered_fd_ = Fd::open(path_, O_WRONLY);
    direct_ = false;
  }
  if (!direct_.load()) write_buffered(iov, w.start);
}

void WriteJob::write_buffered(const std::vector<iovec>& iov, uint64_t offset) {
  // Buffered writes to one file serialize on its inode lock, where the kernel spins a
  // waiting writer on the CPU; a second I/O thread (done checksumming its block) sleeps
  // here instead until the first one's write is done.
  std::lock_guard<std::mutex> turn(buffered_write_mu_);
  (buffered_fd_.valid() ? buffered_fd_ : fd_).pwritev_all(iov, offset);
}

void WriteJob::write_checksummed(const Window& w, std::vector<Segment>& segs, uint64_t cut) {
  std::call_once(reserved_, [this] { reserve_space(); });
  SegmentCursor crc(segs, cut);
  std::vector<iovec> iov;
  size_t next_piece = 0;  // the first piece not yet checksummed to its end
  size_t buffers_from = 0;  // the first piece that may overlap the next block
  for (uint64_t from = 0, end = w.padded(); from < end;) {
    const uint64_t to = std::min(end, from + kFusedBlockBytes);
    for (; next_piece < w.pieces.size() && w.pieces[next_piece].rel < to; ++next_piece) {
      const auto& p = w.pieces[next_piece];
      const uint8_t* src = w.from_source ? p.src : w.slot + p.rel;
      const uint64_t a = std::max(from, p.rel), b = std::min(to, p.rel + p.len);
      if (b > a) crc.add(w.start + a, src + (a - p.rel), b - a);
      if (p.rel + p.len > to) break;  // goes on in the next block
      crc.end_piece(w.start + p.rel, src);
    }
    iov.clear();
    block_buffers(w, from, to, buffers_from, iov);
    write_buffered(iov, w.start + from);
    from = to;
  }
}

void WriteJob::on_staged(Window& w) {
  std::lock_guard<std::mutex> lk(mu_);
  w.staged = true;
  size_t before = staged_prefix_;
  while (staged_prefix_ < windows_.size() && windows_[staged_prefix_].staged) ++staged_prefix_;
  if (staged_prefix_ != before) cv_.notify_all();
}

bool WriteJob::on_flushed(std::vector<Segment>&& segs) {
  std::lock_guard<std::mutex> lk(mu_);
  segments_.insert(segments_.end(), segs.begin(), segs.end());
  ++flushed_;
  return sealed_ && flushed_ == windows_.size();
}

void WriteJob::finalize() {
  if (!failed_.load() && !stream_) {
    try {
      if (durable_) fd_.fsync();
      if (buffered_fd_.valid()) {
        if (durable_) buffered_fd_.fsync();
        buffered_fd_.close();
      }
      fd_.close();
    } catch (const IoError& e) {
      fail(e);
    }
  }
  // A failed job gives its descriptors back now, not when the last Python
  // reference to it goes (an error kept in a traceback would hold them open).
  fd_ = Fd();
  buffered_fd_ = Fd();
  std::lock_guard<std::mutex> lk(mu_);
  std::sort(segments_.begin(), segments_.end(),
            [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
  if (in_flight_ != nullptr) in_flight_->fetch_sub(1);
  done_ = true;
  cv_.notify_all();
}

// ---------------------------------------------------------------- ReadJob

namespace {
// Marks a checkpoint file that is not a regular file (a FIFO, a device); reported as EINVAL.
constexpr int kNotRegular = -2;

std::string open_failure(int err) {
  if (err == ELOOP) return "open refused: the file is a symbolic link (checkpoint files must be regular files)";
  if (err == kNotRegular) return "open refused: not a regular file (checkpoint files must be regular files)";
  return describe_errno("open", err, -1, 0);
}
}  // namespace

bool ReadJob::done() {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_ == 0;
}

std::vector<ReadFailure> ReadJob::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return pending_ == 0; });
  std::sort(failures_.begin(), failures_.end(),
            [](const ReadFailure& a, const ReadFailure& b) { return a.request < b.request; });
  return failures_;
}

void ReadJob::cancel() { cancelled_ = true; }

void ReadJob::add_failure(ReadFailure f) {
  std::lock_guard<std::mutex> lk(mu_);
  failures_.push_back(std::move(f));
}

void ReadJob::piece_done(size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  pending_ -= n;
  if (pending_ != 0) return;
  if (in_flight_ != nullptr) in_flight_->fetch_sub(1);
  cv_.notify_all();
}

void ReadJob::run_pieces(const Piece* first, const Piece* last) {
  if (cancelled_.load()) return;
  const ReadRequest& r = requests_[first->request];
  const std::string& path = paths_[r.file];
  const uint64_t rel = first->rel;
  const uint64_t len = (last - 1)->rel + (last - 1)->len - rel;
  const int64_t off = static_cast<int64_t>(r.offset + rel);
  if (!fds_[r.file].valid()) {
    int err = open_errors_[r.file];
    add_failure({first->request, "io", err == kNotRegular ? EINVAL : err, path, -1, open_failure(err)});
    return;
  }
  // Read a block at a time, each verified while it is still in the core's cache: the
  // bytes cross the memory bus once, in the read.
  const Piece* p = first;  // the first piece not yet verified to its end
  uint32_t crc = 0;        // of p's bytes read so far
  // Mismatches are reported once the whole run is read: a run that ends early is
  // reported as truncated (or as its read error) alone, as one read of it was.
  std::vector<ReadFailure> mismatches;
  auto verify = [&](const Piece& q) {
    if (crc == q.crc) return;
    const int64_t at = static_cast<int64_t>(r.offset + q.rel);
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "checksum mismatch for %llu bytes at offset %lld: stored crc32c %08x, "
                  "data has %08x",
                  static_cast<unsigned long long>(q.len), static_cast<long long>(at), q.crc, crc);
    mismatches.push_back({q.request, "checksum", EIO, path, at, buf});
  };
  for (uint64_t done = 0; done < len || p != last;) {
    const uint64_t want = std::min(len - done, kFusedBlockBytes);
    if (want > 0) {
      try {
        const uint64_t got = fds_[r.file].pread_some(r.dst + rel + done, want, static_cast<uint64_t>(off) + done);
        if (got < want) {
          const int64_t at = off + static_cast<int64_t>(done + got);
          add_failure({first->request, "truncated", EIO, path, at,
                       "file ends at offset " + std::to_string(at) + " but " + std::to_string(len) +
                           " bytes were expected from offset " + std::to_string(off)});
          return;
        }
      } catch (const IoError& e) {
        add_failure({first->request, "io", e.err(), path, e.offset(), e.what()});
        return;
      }
    }
    const uint64_t to = rel + done + want;  // request offset the bytes read reach
    for (; p != last; ++p) {
      const uint64_t a = std::max(rel + done, p->rel), b = std::min(to, p->rel + p->len);
      if (p->checked && b > a) crc = crc32c_extend(crc, r.dst + a, b - a);
      if (p->rel + p->len > to) break;  // goes on in the next block
      if (p->checked) verify(*p);
      crc = 0;
    }
    done += want;
  }
  for (auto& f : mismatches) add_failure(std::move(f));
}

// ---------------------------------------------------------------- Engine

Engine::Engine(unsigned io_threads, uint64_t pool_bytes, uint64_t window_bytes, uint64_t checksum_bytes)
    : owner_pid_(::getpid()),
      window_bytes_(window_bytes),
      checksum_bytes_(checksum_bytes),
      pool_(pool_bytes, window_bytes) {
  if (io_threads == 0 || io_threads > 256)
    throw std::invalid_argument("io_threads must be between 1 and 256, got " +
                                std::to_string(io_threads));
  if (checksum_bytes != 0 &&
      ((checksum_bytes & (checksum_bytes - 1)) != 0 || checksum_bytes > window_bytes))
    throw std::invalid_argument("checksum_bytes must be 0 or a power of two of at most window_bytes (" +
                                std::to_string(window_bytes) + "), got " + std::to_string(checksum_bytes));
  (void)zero_block();  // made here, where a failure reaches the caller, not in an I/O thread
  stager_ = std::thread([this] {
    name_this_thread("dcpds-stage");
    stager_loop();
  });
  copier_ = std::thread([this] {
    name_this_thread("dcpds-d2h");
    copier_loop();
  });
  for (unsigned i = 0; i < io_threads; ++i)
    io_.emplace_back([this] {
      name_this_thread("dcpds-io");
      io_loop();
    });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  stage_cv_.notify_all();
  io_cv_.notify_all();
  pool_.wake_all();
  stager_.join();
  {
    // Only now: the stager may have queued copies until it exited, and every queued
    // window's copies must complete before its slot can be given back.
    std::lock_guard<std::mutex> lk(mu_);
    copies_closed_ = true;
  }
  copy_cv_.notify_all();
  copier_.join();
  for (auto& t : io_) t.join();
  if (CudaRuntime* rt = CudaRuntime::get()) {
    // Errors are ignored here: at interpreter exit the runtime may already be
    // shutting down, and the memory is unmapped right after either way.
    for (auto& s : streams_) rt->stream_destroy(s.second);
    if (pinned_.load()) rt->host_unregister(pool_.base());
  }
}

void Engine::release(Engine* e) {
  if (e != nullptr && e->owned_here()) delete e;
}

bool Engine::owned_here() const { return ::getpid() == owner_pid_; }

void Engine::require_owner(pid_t owner, const char* what, const std::string& path) {
  const pid_t here = ::getpid();
  if (here == owner) return;
  throw ForkedEngineError(
      "dcp_datastates: this engine was created in process " + std::to_string(owner) +
      " before a fork; its threads do not exist in process " + std::to_string(here) + ", so " +
      what + (path.empty() ? std::string() : " (" + path + ")") +
      " would wait forever. Writers and readers get a new engine in a forked process by "
      "themselves; do not keep engines or jobs (dcp_datastates._native.get_engine()) across a fork");
}

void Engine::post_io(std::function<void()> fn, const WriteJob* file) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    io_q_.push_back({std::move(fn), file});
  }
  io_cv_.notify_one();
}

void Engine::enqueue_windows(const std::shared_ptr<WriteJob>& job, std::vector<Region>& regions) {
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& b) { return a.offset < b.offset; });
  std::vector<WriteJob::Window*> added;
  {
    std::lock_guard<std::mutex> lk(job->mu_);
    if (job->sealed_) throw std::logic_error("write job for " + job->path_ + " is already sealed");
    uint64_t prev_end = job->frontier_;
    for (const Region& r : regions) {
      if (r.len == 0) continue;
      // Checked before any window is added: a job with windows that never
      // reach the stager would never finish.
      if (r.strided && r.device >= 0)
        throw std::invalid_argument("strided CUDA regions are not supported; make them contiguous");
      if (r.offset < prev_end)
        throw std::invalid_argument("region at offset " + std::to_string(r.offset) + " of " +
                                    job->path_ + " overlaps bytes already planned up to offset " +
                                    std::to_string(prev_end));
      prev_end = r.offset + r.len;
    }
    WriteJob::Window* cur = nullptr;
    for (const Region& r : regions) {
      if (r.strided) job->layouts_.push_back(r.strided);
      uint64_t pos = r.offset, rem = r.len, logical = 0;
      while (rem > 0) {
        if (cur == nullptr || pos >= cur->start + window_bytes_) {
          cur = &job->windows_.emplace_back();
          cur->index = job->windows_.size() - 1;
          cur->start = align_down(pos);
          added.push_back(cur);
        }
        uint64_t take = std::min(rem, cur->start + window_bytes_ - pos);
        const uint8_t* src = r.strided ? r.src : r.src + logical;
        cur->pieces.push_back(
            {src, pos - cur->start, take, r.strided.get(), logical, r.device, r.ready_event});
        cur->used = pos - cur->start + take;
        pos += take;
        logical += take;
        rem -= take;
      }
    }
    if (cur) job->frontier_ = cur->start + cur->padded();
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) throw std::runtime_error("engine is shutting down");
    for (auto* w : added) stage_q_.push_back({job, w});
  }
  stage_cv_.notify_one();
}

std::shared_ptr<WriteJob> Engine::start_write(const std::string& path, std::vector<Region> regions,
                                              DirectMode mode, uint64_t preallocate, bool durable,
                                              bool borrow, bool stream) {
  require_owner("writing", path);
  auto job = std::make_shared<WriteJob>(path, mode, preallocate, durable, borrow, stream);
  enqueue_windows(job, regions);  // throws before any window reaches the stager
  // Counted only now: a job that failed to start is never finalized. Nothing
  // can finalize it before this either, since it is not sealed yet.
  job->in_flight_ = &in_flight_;
  in_flight_.fetch_add(1);
  return job;
}

void Engine::append(const std::shared_ptr<WriteJob>& job, std::vector<Region> regions) {
  require_owner("appending to a write", job->path());
  enqueue_windows(job, regions);
}

void Engine::seal(const std::shared_ptr<WriteJob>& job) {
  require_owner("sealing a write", job->path());
  bool finish_now;
  {
    std::lock_guard<std::mutex> lk(job->mu_);
    if (job->sealed_) return;
    job->sealed_ = true;
    finish_now = job->flushed_ == job->windows_.size();
    job->cv_.notify_all();
  }
  if (finish_now) post_io([job] { job->finalize(); });
}

void Engine::stager_loop() {
  for (;;) {
    StageTask t;
    {
      std::unique_lock<std::mutex> lk(mu_);
      stage_cv_.wait(lk, [&] { return stopping_ || !stage_q_.empty(); });
      if (stage_q_.empty()) return;  // stopping with nothing queued
      t = std::move(stage_q_.front());
      stage_q_.pop_front();
    }
    stage(t);
  }
}

void Engine::stage(StageTask& t) {
  WriteJob& job = *t.job;
  WriteJob::Window* w = t.window;
  if (!job.failed() && job.writable_from_source(*w)) {
    // No slot and no copy: an I/O thread checksums and writes the caller's
    // memory, and counts the window as staged once it is written.
    w->from_source = true;
    post_flush(t.job, w);
    return;
  }
  if (!job.failed()) {
    w->slot = pool_.acquire([&] { return job.failed() || stopping_.load(); });
    if (w->slot == nullptr && !job.failed()) job.cancel("engine shut down before the write finished");
  }
  if (w->slot != nullptr) {
    uint8_t* dst = w->slot;
    uint64_t cursor = 0;
    bool device = false;
    for (const auto& p : w->pieces) {
      if (p.rel > cursor) std::memset(dst + cursor, 0, p.rel - cursor);
      if (p.device >= 0)
        device = true;  // copied below, asynchronously
      else if (p.strided)
        p.strided->gather(dst + p.rel, p.src, p.logical, p.len);
      else
        std::memcpy(dst + p.rel, p.src, p.len);
      cursor = p.rel + p.len;
    }
    if (w->padded() > cursor) std::memset(dst + cursor, 0, w->padded() - cursor);
    if (device) {
      try {
        copy_from_devices(job, *w);
      } catch (const IoError& e) {
        job.fail(e);
      } catch (const std::exception& e) {  // never let an exception end the stager thread
        job.fail(IoError(EIO, job.path_, static_cast<int64_t>(w->start),
                         std::string("copying from CUDA memory failed: ") + e.what()));
      }
    }
  }
  if (!w->copies_done.empty()) {
    // Staged once its device-to-host copies complete: the copier thread waits for them,
    // apart from the I/O threads, so staging runs at the copies' speed and not behind the
    // writes of earlier windows.
    {
      std::lock_guard<std::mutex> lk(mu_);
      copy_q_.push_back(std::move(t));
    }
    copy_cv_.notify_one();
    return;
  }
  job.on_staged(*w);
  post_flush(t.job, w);
}

void Engine::post_flush(const std::shared_ptr<WriteJob>& job, WriteJob::Window* w) {
  post_io([this, job, w] { flush(job, w); }, job.get());
}

void Engine::copier_loop() {
  for (;;) {
    StageTask t;
    {
      std::unique_lock<std::mutex> lk(mu_);
      copy_cv_.wait(lk, [&] { return copies_closed_ || !copy_q_.empty(); });
      if (copy_q_.empty()) return;  // closed (the stager has exited) with nothing queued
      t = std::move(copy_q_.front());
      copy_q_.pop_front();
    }
    // Windows arrive in the order their copies were queued, which is each stream's order.
    finish_device_copies(*t.job, *t.window);
    post_flush(t.job, t.window);
  }
}

void* Engine::device_stream(int device, const WriteJob& job, int64_t at) {
  for (const auto& s : streams_)  // written by this (the stager) thread only
    if (s.first == device) return s.second;
  CudaRuntime* rt = CudaRuntime::get();
  void* stream = nullptr;
  // Created while `device` is current (the caller set it): a stream belongs to the current device.
  if (int err = rt->stream_create_with_flags(&stream, CudaRuntime::kStreamNonBlocking))
    throw IoError(EIO, job.path(), at,
                  rt->describe(("cudaStreamCreateWithFlags for device " + std::to_string(device)).c_str(), err));
  std::lock_guard<std::mutex> lk(cuda_mu_);
  streams_.emplace_back(device, stream);
  return stream;
}

std::string Engine::pin_pool() {
  require_owner("pinning the host pool");
  CudaRuntime* rt = CudaRuntime::get();
  if (rt == nullptr) return "no CUDA runtime is loaded";
  std::lock_guard<std::mutex> lk(cuda_mu_);
  if (pinned_.load()) return "";
  if (!pin_error_.empty()) return pin_error_;
  if (int err = rt->host_register(pool_.base(), pool_.capacity(), CudaRuntime::kHostRegisterPortable))
    pin_error_ = rt->describe("cudaHostRegister of the host pool", err);
  else
    pinned_ = true;
  return pin_error_;
}

std::string Engine::pin_error() {
  std::lock_guard<std::mutex> lk(cuda_mu_);
  return pin_error_;
}

void Engine::copy_from_devices(WriteJob& job, WriteJob::Window& w) {
  CudaRuntime* rt = CudaRuntime::get();
  const int64_t at = static_cast<int64_t>(w.start);
  if (rt == nullptr)
    throw IoError(ENODEV, job.path_, at,
                  "a region is CUDA memory but no CUDA runtime is loaded in the engine");
  (void)pin_pool();  // pageable copies still work if pinning is refused
  std::vector<int> devices;
  for (const auto& p : w.pieces)
    if (p.device >= 0 && std::find(devices.begin(), devices.end(), p.device) == devices.end())
      devices.push_back(p.device);
  for (int dev : devices) {
    // Streams and events belong to the current device: it is set before either is made or used.
    if (int err = rt->set_device(dev))
      throw IoError(EIO, job.path_, at,
                    rt->describe(("cudaSetDevice(" + std::to_string(dev) + ")").c_str(), err));
    void* stream = device_stream(dev, job, at);
    try {
      copy_on_stream(job, w, dev, stream);
    } catch (...) {
      // Copies already queued on the stream write into the window's slot:
      // they must finish before the slot goes back to the pool (and the
      // caller frees the memory they read). An error here is the one being
      // raised already.
      (void)rt->stream_synchronize(stream);
      throw;
    }
  }
}

void Engine::copy_on_stream(WriteJob& job, WriteJob::Window& w, int device, void* stream) {
  CudaRuntime* rt = CudaRuntime::get();
  const int64_t at = static_cast<int64_t>(w.start);
  // Each distinct ready event is waited for once per window. Not once per job:
  // a caller may destroy an event after wait_staged() and get the same handle
  // back from cudaEventCreate for a later append, which must still be waited for.
  std::vector<void*> waited;
  for (const auto& p : w.pieces) {
    if (p.device != device) continue;
    if (p.ready_event != nullptr &&
        std::find(waited.begin(), waited.end(), p.ready_event) == waited.end()) {
      // Every later copy on this stream is ordered after the producer's work.
      if (int err = rt->stream_wait_event(stream, p.ready_event, 0))
        throw IoError(EIO, job.path_, at, rt->describe("cudaStreamWaitEvent", err));
      waited.push_back(p.ready_event);
    }
    if (int err = rt->memcpy_async(w.slot + p.rel, p.src, p.len, CudaRuntime::kMemcpyDeviceToHost, stream))
      throw IoError(EIO, job.path_, static_cast<int64_t>(w.start + p.rel),
                    rt->describe("cudaMemcpyAsync device-to-host", err));
  }
  void* done = nullptr;
  if (int err = rt->event_create_with_flags(&done, CudaRuntime::kEventDisableTiming))
    throw IoError(EIO, job.path_, at, rt->describe("cudaEventCreateWithFlags", err));
  if (int err = rt->event_record(done, stream)) {
    (void)rt->event_destroy(done);
    throw IoError(EIO, job.path_, at, rt->describe("cudaEventRecord", err));
  }
  w.copies_done.push_back(done);
}

// On the copier thread: waits for the window's device-to-host copies, then counts
// the window as staged. Every event is destroyed whatever happens.
void Engine::finish_device_copies(WriteJob& job, WriteJob::Window& w) {
  CudaRuntime* rt = CudaRuntime::get();
  const int64_t at = static_cast<int64_t>(w.start);
  for (void* ev : w.copies_done) {
    if (int err = rt->event_synchronize(ev); err && !job.failed())
      job.fail(IoError(EIO, job.path(), at,
                       rt->describe("cudaEventSynchronize after the device-to-host copies", err)));
    if (int err = rt->event_destroy(ev); err && !job.failed())
      job.fail(IoError(EIO, job.path(), at, rt->describe("cudaEventDestroy", err)));
  }
  w.copies_done.clear();
  job.on_staged(w);
}

// One pass over the bytes, a CRC per segment: cut at multiples of
// checksum_bytes_ in the file, so segments do not depend on where windows fall.
void Engine::checksum(std::vector<Segment>& segs, uint64_t offset, const uint8_t* bytes, uint64_t len) const {
  SegmentCursor crc(segs, checksum_bytes_);
  crc.add(offset, bytes, len);
  crc.end_piece(offset, bytes);
}

void Engine::flush(const std::shared_ptr<WriteJob>& job, WriteJob::Window* w) {
  if (job->stream_ && w->slot != nullptr && !job->failed()) {
    // Checksummed here, handed to the caller by stream_next(), which gives the slot back.
    std::vector<Segment> segs;
    for (const auto& p : w->pieces) checksum(segs, w->start + p.rel, w->slot + p.rel, p.len);
    std::lock_guard<std::mutex> lk(job->mu_);
    // Failed meanwhile: stream_abandon() may have run already and would never see this
    // window, so it is given back below like any window of a failed job.
    if (!job->failed()) {
      job->segments_.insert(job->segments_.end(), segs.begin(), segs.end());
      w->ready = true;
      job->cv_.notify_all();
      return;
    }
  }
  std::vector<Segment> segs;
  if ((w->slot != nullptr || w->from_source) && !job->failed()) {
    try {
      if (job->direct()) {
        // O_DIRECT: the device reads the memory itself, so there is no cached copy for a
        // checksum to share; one pass, then one large write per window.
        for (const auto& p : w->pieces)
          checksum(segs, w->start + p.rel, w->from_source ? p.src : w->slot + p.rel, p.len);
        job->write_window(*w);
      } else {
        job->write_checksummed(*w, segs, checksum_bytes_);  // each block checksummed while cached
      }
      if (w->from_source) job->from_source_.fetch_add(1);
    } catch (const IoError& e) {
      job->fail(e);
    }
  }
  if (w->from_source) job->on_staged(*w);  // the engine is done with the caller's memory
  if (w->slot != nullptr) {
    pool_.release(w->slot);
    w->slot = nullptr;
  }
  if (job->on_flushed(std::move(segs))) job->finalize();
}

StreamChunk Engine::stream_next(const std::shared_ptr<WriteJob>& job) {
  require_owner("taking a streamed window", job->path());
  WriteJob& j = *job;
  if (!j.stream_) throw std::logic_error("write job for " + j.path_ + " is not streamed");
  for (;;) {
    uint8_t* given_back = nullptr;
    bool last = false, failed = false, ended = false;
    StreamChunk out;
    {
      std::unique_lock<std::mutex> lk(j.mu_);
      if (j.current_ != nullptr) {  // the caller is done with the window it holds
        given_back = j.current_->slot;
        j.current_->slot = nullptr;
        j.current_ = nullptr;
        ++j.flushed_;
        last = j.sealed_ && j.flushed_ == j.windows_.size();
      } else {
        j.cv_.wait(lk, [&] {
          return j.failed_.load() || (j.taken_ < j.windows_.size() && j.windows_[j.taken_].ready) ||
                 (j.sealed_ && j.taken_ == j.windows_.size());
        });
        if (j.failed_.load()) {
          failed = true;
        } else if (j.taken_ < j.windows_.size()) {
          WriteJob::Window& w = j.windows_[j.taken_++];
          j.current_ = &w;
          out = {false, w.start, w.slot, w.padded()};
          return out;
        } else {
          ended = true;
        }
      }
    }
    if (given_back != nullptr) pool_.release(given_back);
    if (last) j.finalize();
    if (failed) {
      // Every slot the caller could still take goes back; windows not flushed yet give theirs
      // back in flush(). The job ends when its owner seals it (or drops it).
      stream_abandon(job);
      std::lock_guard<std::mutex> lk(j.mu_);
      if (j.error_) throw *j.error_;
      throw IoError(ECANCELED, j.path_, -1, "the streamed write failed");
    }
    if (ended) {
      j.wait();  // finalized by whoever gave the last window back; throws on failure
      return StreamChunk{};
    }
  }
}

void Engine::stream_abandon(const std::shared_ptr<WriteJob>& job) {
  WriteJob& j = *job;
  if (!j.stream_) return;
  std::vector<uint8_t*> slots;
  bool last;
  {
    std::lock_guard<std::mutex> lk(j.mu_);
    for (auto& w : j.windows_) {
      if (w.ready && w.slot != nullptr) {  // checksummed, never to be taken (or held by the caller)
        slots.push_back(w.slot);
        w.slot = nullptr;
        ++j.flushed_;
      }
    }
    j.current_ = nullptr;
    j.taken_ = j.windows_.size();
    last = !slots.empty() && j.sealed_ && j.flushed_ == j.windows_.size();
  }
  for (auto* s : slots) pool_.release(s);
  if (last) j.finalize();
}

void Engine::io_loop() {
  for (;;) {
    IoTask task;
    {
      std::unique_lock<std::mutex> lk(mu_);
      io_cv_.wait(lk, [&] { return stopping_ || !io_q_.empty(); });
      if (io_q_.empty()) return;
      // The oldest task whose file no other thread is writing, else the oldest:
      // two threads on one file would wait for each other on its inode lock.
      auto pick = std::find_if(io_q_.begin(), io_q_.end(), [&](const IoTask& t) {
        return t.file == nullptr ||
               std::find(writing_.begin(), writing_.end(), t.file) == writing_.end();
      });
      if (pick == io_q_.end()) pick = io_q_.begin();
      task = std::move(*pick);
      io_q_.erase(pick);
      if (task.file != nullptr) writing_.push_back(task.file);
    }
    task.fn();
    if (task.file != nullptr) {
      std::lock_guard<std::mutex> lk(mu_);
      writing_.erase(std::find(writing_.begin(), writing_.end(), task.file));
    }
  }
}

std::shared_ptr<ReadJob> Engine::start_read(std::vector<std::string> paths,
                                            std::vector<ReadRequest> requests) {
  require_owner("reading", paths.empty() ? std::string() : paths.front());
  auto job = std::make_shared<ReadJob>();
  job->paths_ = std::move(paths);
  job->requests_ = std::move(requests);
  for (const auto& p : job->paths_) {
    // Checkpoint files are regular files: a symlink (to another file, or
    // /dev/zero) or a FIFO in a checkpoint directory is refused, not followed.
    int err = 0;
    Fd fd = Fd::try_open(p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK, 0, &err);
    if (fd.valid()) {
      struct stat st;
      if (::fstat(fd.get(), &st) < 0) {
        err = errno;
        fd = Fd();
      } else if (!S_ISREG(st.st_mode)) {
        err = kNotRegular;
        fd = Fd();
      }
    }
    job->fds_.push_back(std::move(fd));
    job->open_errors_.push_back(err);
  }
  // Pieces: every checksum segment is one piece (so it is verified right after
  // its read, while hot); unchecked gaps are split at window size.
  std::vector<ReadJob::Piece> pieces;
  for (uint64_t i = 0; i < job->requests_.size(); ++i) {
    const ReadRequest& r = job->requests_[i];
    if (r.file >= job->paths_.size())
      throw std::invalid_argument("read request names file index " + std::to_string(r.file) +
                                  " of " + std::to_string(job->paths_.size()));
    uint64_t cur = 0;
    auto gap = [&](uint64_t upto) {
      while (cur < upto) {
        uint64_t take = std::min(upto - cur, window_bytes_);
        pieces.push_back({i, cur, take, false, 0});
        cur += take;
      }
    };
    for (const auto& c : r.checks) {
      if (c.rel < cur || c.rel + c.len > r.len)
        throw std::invalid_argument("checksum segments of read request " + std::to_string(i) +
                                    " are unsorted or outside the request");
      gap(c.rel);
      pieces.push_back({i, c.rel, c.len, true, c.crc});
      cur = c.rel + c.len;
    }
    gap(r.len);
  }
  // Small pieces are batched into one task (up to a window's worth) so that
  // tens of thousands of small tensors do not cost a task each.
  std::vector<std::vector<ReadJob::Piece>> batches;
  uint64_t batch_bytes = 0;
  for (const auto& p : pieces) {
    if (batches.empty() || batch_bytes + p.len > window_bytes_) {
      batches.emplace_back();
      batch_bytes = 0;
    }
    batches.back().push_back(p);
    batch_bytes += p.len;
  }
  job->pending_ = batches.size();
  if (batches.empty()) return job;
  job->in_flight_ = &in_flight_;
  in_flight_.fetch_add(1);
  for (auto& b : batches) {
    post_io([job, batch = std::move(b)] {
      // Runs of adjacent pieces of one request are read with one pread.
      const ReadJob::Piece* run = batch.data();
      const ReadJob::Piece* end = batch.data() + batch.size();
      for (const ReadJob::Piece* p = run; p != end; ++p) {
        const ReadJob::Piece* next = p + 1;
        if (next == end || next->request != p->request || next->rel != p->rel + p->len) {
          job->run_pieces(run, next);
          run = next;
        }
      }
      job->piece_done(1);
    });
  }
  return job;
}

}  // namespace dcpds
