// Python face of the engine (module dcp_datastates._engine).
//
// Conversions from Python happen with the GIL held; everything that blocks
// (opening files, waiting for jobs) runs with it released. Job objects keep
// the Python buffers they point into alive until the job has finished, even
// when the job is dropped before wait() on an error path. What crosses the
// boundary is typed: regions, read requests, segments and read failures are
// the records of py_records.hpp; fault injection is the `faults` submodule.
// The benchmark-only disk probes are another extension (probes_bindings.cpp).
#include <cstring>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "crc32c.hpp"
#include "cuda_runtime.hpp"
#include "engine.hpp"
#include "py_errors.hpp"
#include "py_faults.hpp"
#include "py_records.hpp"

namespace py = pybind11;
using namespace dcpds;

namespace {

DirectMode parse_mode(const std::string& s) {
  if (s == "auto") return DirectMode::kAuto;
  if (s == "on" || s == "direct") return DirectMode::kDirect;
  if (s == "off" || s == "buffered") return DirectMode::kBuffered;
  throw std::invalid_argument("direct_io must be 'auto', 'on' or 'off', got '" + s + "'");
}

// Drops a reference without ever destroying what it points to: in a fork child
// a job may still count waiters (threads of the parent) on its condition
// variable, and destroying that would hang.
template <class T>
void leak(std::shared_ptr<T>& p) {
  if (p) new std::shared_ptr<T>(std::move(p));
}

// A job holds its engine only while it may still need the engine's threads:
// once it is done (seen by wait()), the reference is dropped, so a job kept
// around by a writer or a traceback does not keep a released engine (and its
// host pool) alive. The creating process is remembered for the fork checks.
class PyWriteJob {
 public:
  PyWriteJob(std::shared_ptr<Engine> e, std::shared_ptr<WriteJob> j, py::list keep)
      : owner_pid_(e->owner_pid()), engine_(std::move(e)), job_(std::move(j)), keep_(std::move(keep)) {}
  ~PyWriteJob() {
    if (::getpid() != owner_pid_) {  // a fork child: no thread of the engine reads that memory here
      leak(job_);
      leak(engine_);
      return;
    }
    // Never let the engine read memory Python is about to free.
    if (engine_ && !job_->done()) {
      job_->cancel("write job for " + job_->path() + " was dropped before it finished");
      engine_->seal(job_);
      engine_->stream_abandon(job_);  // a streamed job's windows nobody will take
      py::gil_scoped_release nogil;
      try {
        job_->wait();
      } catch (...) {
      }
    }
  }
  void append(const py::object& regions, const py::object& keep) {
    owned("appending to a write");
    auto r = regions_from(regions);
    if (!engine_) throw std::logic_error("write job for " + job_->path() + " is already sealed");
    for (auto k : py::reinterpret_borrow<py::iterable>(keep)) keep_.append(k);
    engine_->append(job_, std::move(r));
  }
  void seal() {
    owned("sealing a write");
    if (engine_) engine_->seal(job_);  // a job without one is finished, hence sealed
  }
  bool wait_staged() {
    owned("waiting for the staging of a write");
    py::gil_scoped_release nogil;
    return job_->wait_staged();
  }
  // wait_staged(), then drop this job's references to every buffer handed to
  // it so far (write() and append() calls made before this one). Staged means
  // the engine is done with the caller's memory: a host window counts as staged
  // after the stager copied (or gathered) its pieces into a pool slot, and the
  // I/O threads checksum and write from that slot only; a window with CUDA
  // pieces counts as staged only after its device-to-host copy completed. So
  // the buffers may be freed now, long before the job ends (a borrowed
  // window written from the caller's memory is staged once written). On failure they
  // are kept (a stager may still be copying from them) and False is returned.
  bool release_staged() {
    owned("waiting for the staging of a write");
    const size_t n = py::len(keep_);  // append() holds the GIL: these are all enqueued
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = job_->wait_staged();
    }
    if (ok) {
      py::list rest;  // buffers appended by other threads while we waited
      for (size_t i = n; i < py::len(keep_); ++i) rest.append(keep_[i]);
      keep_ = rest;
    }
    return ok;
  }
  // wait(), the segments packed as a rank index stores them (u64 offset, u64 length,
  // u32 crc32c, u32 0; little-endian hosts only, as the CRC code assumes): a
  // segment per few KiB makes a Python object each too slow to build.
  py::bytes wait_records() {
    std::vector<Segment> segs = wait();
    std::string out(segs.size() * 24, '\0');
    char* p = out.data();
    for (const Segment& s : segs) {
      const uint32_t crc_and_zero[2] = {s.crc, 0};
      std::memcpy(p, &s.offset, 8);
      std::memcpy(p + 8, &s.len, 8);
      std::memcpy(p + 16, crc_and_zero, 8);
      p += 24;
    }
    return py::bytes(out);
  }
  std::vector<Segment> wait() {
    owned("waiting for a write");
    std::vector<Segment> segs;
    try {
      py::gil_scoped_release nogil;
      segs = job_->wait();
    } catch (...) {
      finished();
      throw;
    }
    finished();
    return segs;
  }
  void cancel(const std::string& why) {
    owned("cancelling a write");
    job_->cancel(why);
    if (engine_) engine_->stream_abandon(job_);
  }
  // A streamed job's next window: (file offset, read-only view of its bytes), valid until the
  // next call; None once every window was handed out (the job is then finished).
  py::object next_chunk() {
    owned("taking a streamed window");
    if (!engine_) {  // finished (wait() returned or raised): a failed job says so, never "the end"
      job_->wait();
      return py::none();
    }
    // Held here, taken while the GIL is: the owner's wait() may end the job and drop engine_
    // from another thread as soon as the GIL is released, while this call still runs.
    const std::shared_ptr<Engine> engine = engine_;
    StreamChunk c;
    {
      py::gil_scoped_release nogil;
      c = engine->stream_next(job_);  // a failure leaves the job to its owner's seal() and wait()
    }
    if (c.end) {
      finished();
      return py::none();
    }
    return py::make_tuple(c.offset, py::memoryview::from_memory(const_cast<uint8_t*>(c.data), static_cast<py::ssize_t>(c.len), true));
  }
  bool done() {
    owned("asking whether a write is done");
    return job_->done();
  }
  bool direct() { return job_->direct(); }
  bool borrows() { return job_->borrows(); }
  bool streams() { return job_->streams(); }
  uint64_t windows_from_source() { return job_->windows_from_source(); }
  const std::string& path() { return job_->path(); }

 private:
  // Every call that takes the job's lock or waits for the engine's threads
  // checks the process first: in a fork child they would block forever.
  void owned(const char* what) const { Engine::require_owner(owner_pid_, what, job_->path()); }
  void finished() {
    keep_ = py::list();
    engine_.reset();
  }

  pid_t owner_pid_;
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<WriteJob> job_;
  py::list keep_;
};

class PyReadJob {
 public:
  PyReadJob(std::shared_ptr<Engine> e, std::shared_ptr<ReadJob> j, py::list keep)
      : owner_pid_(e->owner_pid()), engine_(std::move(e)), job_(std::move(j)), keep_(std::move(keep)) {}
  ~PyReadJob() {
    if (::getpid() != owner_pid_) {  // a fork child: see ~PyWriteJob
      leak(job_);
      leak(engine_);
      return;
    }
    if (engine_ && !job_->done()) {
      job_->cancel();
      py::gil_scoped_release nogil;
      job_->wait();
    }
  }
  std::vector<ReadFailure> wait() {
    Engine::require_owner(owner_pid_, "waiting for a read", "");
    std::vector<ReadFailure> f;
    {
      py::gil_scoped_release nogil;
      f = job_->wait();
    }
    keep_ = py::list();
    engine_.reset();
    return f;
  }
  bool done() {
    Engine::require_owner(owner_pid_, "asking whether a read is done", "");
    return job_->done();
  }

 private:
  pid_t owner_pid_;
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<ReadJob> job_;
  py::list keep_;
};

py::list keep_list(const py::object& keep) {
  py::list out;
  for (auto k : py::reinterpret_borrow<py::iterable>(keep)) out.append(k);
  return out;
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "Native data-movement engine of dcp_datastates (pybind11, no torch dependency).";

  register_io_error_translator();
  py::register_exception<ForkedEngineError>(m, "ForkedEngineError", PyExc_RuntimeError);

  bind_records(m);

  py::class_<PyWriteJob>(m, "WriteJob", "A file being written by the engine (Engine.write()).")
      .def("append", &PyWriteJob::append, py::arg("regions"), py::arg("keep") = py::list(),
           "Add regions at or after every offset planned so far (before seal()); `keep` holds what "
           "their memory belongs to until it is staged.")
      .def("seal", &PyWriteJob::seal, "No more regions: the job fsyncs once all are written.")
      .def("wait_staged", &PyWriteJob::wait_staged,
           "Block until every region has left the caller's memory; False if the job failed.")
      .def("release_staged", &PyWriteJob::release_staged,
           "wait_staged(), then let go of every buffer given so far (the engine no longer "
           "reads them); False (and nothing released) if the job failed.")
      .def("wait", &PyWriteJob::wait,
           "Block until written and fsynced; returns a Segment (offset, nbytes, crc32c) per piece, "
           "sorted by offset. Raises the job's OSError (file and offset named) if it failed.")
      .def("wait_records", &PyWriteJob::wait_records,
           "wait(), the segments as bytes: 24 per segment (u64 offset, u64 nbytes, u32 crc32c, "
           "u32 0, little-endian), the rank index's segment records.")
      .def("cancel", &PyWriteJob::cancel, py::arg("why"),
           "Fail the job with ECANCELED and `why`; copies and writes in flight finish first.")
      .def_property_readonly("done", &PyWriteJob::done)
      .def_property_readonly("direct", &PyWriteJob::direct, "Whether the file is written with O_DIRECT.")
      .def_property_readonly("borrows", &PyWriteJob::borrows,
                             "Whether the job was started with borrow=True.")
      .def_property_readonly("windows_from_source", &PyWriteJob::windows_from_source,
                             "Windows written straight from the caller's memory so far (borrow=True).")
      .def("next_chunk", &PyWriteJob::next_chunk,
           "A streamed job's next window in file order: (offset, read-only memoryview), valid until "
           "the next call, which gives its pool slot back; None when all were handed out. Raises the "
           "job's error (OSError) if it failed.")
      .def_property_readonly("streams", &PyWriteJob::streams, "Whether the job has no file (stream=True).")
      .def_property_readonly("path", &PyWriteJob::path);

  py::class_<PyReadJob>(m, "ReadJob", "Reads running in the engine (Engine.read()).")
      .def("wait", &PyReadJob::wait,
           "Block until done; returns the ReadFailures, sorted by request (empty: all read and verified).")
      .def_property_readonly("done", &PyReadJob::done);

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
                                              "A host pool and the threads that stage, checksum, write and "
                                              "read through it.")
      // Engine::release, not delete: an engine that reaches its end in a fork
      // child is leaked there instead of joining threads that do not exist.
      .def(py::init([](unsigned io_threads, uint64_t pool_bytes, uint64_t window_bytes, uint64_t checksum_bytes) {
             return std::shared_ptr<Engine>(new Engine(io_threads, pool_bytes, window_bytes, checksum_bytes),
                                            &Engine::release);
           }),
           py::kw_only(), py::arg("io_threads"), py::arg("pool_bytes"), py::arg("window_bytes"),
           py::arg("checksum_bytes") = 0,
           "checksum_bytes: 0 for one CRC-32C segment per region piece of a window, else a power of "
           "two (at most window_bytes) cutting segments at its multiples in the file.")
      .def_property_readonly("owner_pid", &Engine::owner_pid,
                             "The process that created the engine (the only one it works in).")
      .def(
          "write",
          [](std::shared_ptr<Engine> self, const std::string& path, const py::object& regions,
             const py::object& keep, const std::string& direct_io, uint64_t preallocate, bool durable,
             bool borrow, bool stream) {
            auto r = regions_from(regions);
            auto mode = parse_mode(direct_io);
            std::shared_ptr<WriteJob> job;
            {
              py::gil_scoped_release nogil;
              job = self->start_write(path, std::move(r), mode, preallocate, durable, borrow, stream);
            }
            return std::make_unique<PyWriteJob>(self, job, keep_list(keep));
          },
          py::arg("path"), py::arg("regions"), py::arg("keep") = py::list(), py::kw_only(),
          py::arg("direct_io") = "auto", py::arg("preallocate") = 0, py::arg("durable") = true,
          py::arg("borrow") = false, py::arg("stream") = false,
          "Create `path` (it must not exist) and start writing `regions` (HostRegion, StridedRegion, "
          "DeviceRegion; non-overlapping). `keep` holds what their memory belongs to. "
          "`preallocate` bytes are reserved first (a full disk fails here); durable=False skips the "
          "final fsync (scratch files only). borrow=True promises that the caller leaves the host "
          "memory of every region (and of later appends) unchanged until the job is done: windows "
          "of contiguous host memory are then written from it without a copy where the file "
          "allows (buffered, or page-aligned for O_DIRECT), and count as staged once written. "
          "stream=True opens no file (`path` names the destination in errors): the windows are "
          "taken in file order with WriteJob.next_chunk().")
      .def(
          "read",
          [](std::shared_ptr<Engine> self, std::vector<std::string> paths, const py::object& requests,
             const py::object& keep) {
            auto reqs = read_requests_from(requests);
            std::shared_ptr<ReadJob> job;
            {
              py::gil_scoped_release nogil;
              job = self->start_read(std::move(paths), std::move(reqs));
            }
            return std::make_unique<PyReadJob>(self, job, keep_list(keep));
          },
          py::arg("paths"), py::arg("requests"), py::arg("keep") = py::list(),
          "Start the ReadRequests (each names a file by its index in `paths`); `keep` holds the "
          "destination buffers until the job is done.")
      .def(
          "pin_pool",
          [](Engine& e) {
            std::string why;
            {
              py::gil_scoped_release nogil;
              why = e.pin_pool();
            }
            if (!why.empty()) throw std::runtime_error("pinning the host pool failed: " + why);
          },
          "Pin the host pool for CUDA copies now (cudaHostRegister; done by the first CUDA copy "
          "otherwise). Raises RuntimeError naming the failed call; the copies still work unpinned.")
      .def_property_readonly("pool_pinned", &Engine::pool_pinned)
      .def_property_readonly("pin_error", &Engine::pin_error,
                             "Why pinning the pool failed ('' if it did not, or was never tried).")
      .def_property_readonly("jobs_in_flight", &Engine::jobs_in_flight,
                             "Write and read jobs started and not yet finished.")
      .def_property_readonly("io_threads", &Engine::io_threads)
      .def_property_readonly("window_bytes", &Engine::window_bytes)
      .def_property_readonly("checksum_bytes", &Engine::checksum_bytes)
      .def_property_readonly("pool_bytes", [](Engine& e) { return e.pool().capacity(); })
      .def_property_readonly("pool_address",
                             [](Engine& e) { return reinterpret_cast<uintptr_t>(e.pool().base()); })
      .def_property_readonly("free_windows", [](Engine& e) { return e.pool().free_slots(); });

  m.def(
      "crc32c",
      [](py::buffer b, uint32_t crc) {
        py::buffer_info info = b.request();
        const void* p = info.ptr;
        size_t n = static_cast<size_t>(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        return crc32c_extend(crc, p, n);
      },
      py::arg("data"), py::arg("crc") = 0, "CRC-32C of a contiguous buffer, optionally extended.");
  m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
        "CRC-32C of A followed by B from crc32c(A), crc32c(B) and len(B).");
  m.def("crc32c_backend", &crc32c_backend, "'sse4.2+pclmul', 'sse4.2', 'armv8-crc' or 'table'.");
  m.def(
      "load_cuda_runtime",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        return CudaRuntime::load(path);
      },
      py::arg("path") = "",
      "Resolve the CUDA runtime from `path` (or one already loaded in the process); returns '' "
      "on success or why it failed. Once per process: the first success wins.");
  m.def(
      "create_cuda_stream",
      []() -> uintptr_t {
        CudaRuntime* rt = CudaRuntime::get();
        if (rt == nullptr)
          throw std::runtime_error("creating a CUDA stream failed: no CUDA runtime is loaded (load_cuda_runtime first)");
        void* stream = nullptr;
        int err = 0;
        {
          py::gil_scoped_release nogil;
          err = rt->stream_create_with_flags(&stream, CudaRuntime::kStreamNonBlocking);
        }
        if (err != 0) throw std::runtime_error(rt->describe("cudaStreamCreateWithFlags for a hashing stream", err));
        return reinterpret_cast<uintptr_t>(stream);
      },
      "A new non-blocking CUDA stream on the calling thread's current device, as an integer "
      "handle (for torch.cuda.ExternalStream). A stream of the caller's own, unlike torch's pool "
      "streams, which NCCL and FSDP also take; never destroyed (callers keep one per device).");
  m.def(
      "cuda_runtime_path",
      []() -> py::object {
        CudaRuntime* rt = CudaRuntime::get();
        if (rt == nullptr) return py::none();
        return py::str(rt->path);
      },
      "The library the CUDA entry points came from, or None before load_cuda_runtime() succeeded.");
  m.attr("ALIGNMENT") = kAlign;
  m.attr("FUSED_BLOCK_BYTES") = kFusedBlockBytes;
  // The CRC kernel is timed and picked here, at import, not on an I/O thread's first use
  // (a fork while another thread is inside that first use would leave the child waiting).
  (void)crc32c_backend();

  py::module_ faults = m.def_submodule("faults");
  bind_faults(faults);
  // Importable by name too (`import dcp_datastates._engine.faults`), as its stub says.
  const std::string faults_name = m.attr("__name__").cast<std::string>() + ".faults";
  py::module_::import("sys").attr("modules")[py::str(faults_name)] = faults;

}
