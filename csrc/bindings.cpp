// Python face of the engine (module dcp_datastates._engine).
//
// Conversions from Python happen with the GIL held; everything that blocks
// (opening files, waiting for jobs, the probes) runs with it released. Job
// objects keep the Python buffers they point into alive until the job has
// finished, even when the job is dropped before wait() on an error path.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "crc32c.hpp"
#include "cuda_runtime.hpp"
#include "disk_probe.hpp"
#include "engine.hpp"
#include "fault_injection.hpp"

namespace py = pybind11;
using namespace dcpds;

namespace {

DirectMode parse_mode(const std::string& s) {
  if (s == "auto") return DirectMode::kAuto;
  if (s == "on" || s == "direct") return DirectMode::kDirect;
  if (s == "off" || s == "buffered") return DirectMode::kBuffered;
  throw std::invalid_argument("direct_io must be 'auto', 'on' or 'off', got '" + s + "'");
}

// A region is one of
//   (pointer, nbytes, file_offset)                              contiguous host memory
//   (pointer, nbytes, file_offset, sizes, strides, itemsize)    strided host memory
//                                                                (strides in elements)
//   (pointer, nbytes, file_offset, device, ready_event)         contiguous CUDA memory
std::vector<Region> to_regions(const py::list& regions) {
  std::vector<Region> out;
  out.reserve(regions.size());
  for (const auto& item : regions) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 3 && t.size() != 5 && t.size() != 6)
      throw std::invalid_argument(
          "a region is (pointer, nbytes, file_offset), (pointer, nbytes, file_offset, sizes, "
          "strides, itemsize) or (pointer, nbytes, file_offset, device, ready_event)");
    Region r{reinterpret_cast<const uint8_t*>(t[0].cast<uintptr_t>()), t[1].cast<uint64_t>(),
             t[2].cast<uint64_t>()};
    if (t.size() == 6) {
      auto sizes = t[3].cast<std::vector<int64_t>>();
      auto strides = t[4].cast<std::vector<int64_t>>();
      auto itemsize = t[5].cast<uint64_t>();
      uint64_t n = itemsize;
      for (int64_t s : sizes) n *= static_cast<uint64_t>(s < 0 ? 0 : s);
      if (n != r.len)
        throw std::invalid_argument("strided region of " + std::to_string(r.len) +
                                    " bytes does not match its sizes and itemsize (" +
                                    std::to_string(n) + " bytes)");
      r.strided = StridedLayout::make(sizes, strides, itemsize);
    } else if (t.size() == 5) {
      r.device = t[3].cast<int>();
      if (r.device < 0) throw std::invalid_argument("a CUDA region needs a device index >= 0");
      r.ready_event = reinterpret_cast<void*>(t[4].cast<uintptr_t>());
    }
    out.push_back(std::move(r));
  }
  return out;
}

// Drops a reference without ever destroying what it points to: in a fork child
// a job may still count waiters (threads of the parent) on its condition
// variable, and destroying that would hang.
template <class T>
void leak(std::shared_ptr<T>& p) {
  new std::shared_ptr<T>(std::move(p));
}

py::list segments_to_py(const std::vector<Segment>& segs) {
  py::list out;
  for (const auto& s : segs) out.append(py::make_tuple(s.offset, s.len, s.crc));
  return out;
}

class PyWriteJob {
 public:
  PyWriteJob(std::shared_ptr<Engine> e, std::shared_ptr<WriteJob> j, py::list keep)
      : engine_(std::move(e)), job_(std::move(j)), keep_(std::move(keep)) {}
  ~PyWriteJob() {
    if (!engine_->owned_here()) {  // a fork child: no thread of the engine reads that memory here
      leak(job_);
      leak(engine_);
      return;
    }
    // Never let the engine read memory Python is about to free.
    if (!job_->done()) {
      job_->cancel("write job for " + job_->path() + " was dropped before it finished");
      engine_->seal(job_);
      py::gil_scoped_release nogil;
      try {
        job_->wait();
      } catch (...) {
      }
    }
  }
  void append(const py::list& regions, const py::list& keep) {
    auto r = to_regions(regions);
    for (const auto& k : keep) keep_.append(k);
    engine_->append(job_, std::move(r));
  }
  void seal() { engine_->seal(job_); }
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
  // the buffers may be freed now, long before the job ends. On failure they
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
  py::list wait() {
    owned("waiting for a write");
    std::vector<Segment> segs;
    {
      py::gil_scoped_release nogil;
      segs = job_->wait();
    }
    keep_ = py::list();
    return segments_to_py(segs);
  }
  void cancel(const std::string& why) {
    owned("cancelling a write");
    job_->cancel(why);
  }
  bool done() {
    owned("asking whether a write is done");
    return job_->done();
  }
  bool direct() { return job_->direct(); }
  const std::string& path() { return job_->path(); }

 private:
  // Every call that takes the job's lock or waits for the engine's threads
  // checks the process first: in a fork child they would block forever.
  void owned(const char* what) const { engine_->require_owner(what, job_->path()); }

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<WriteJob> job_;
  py::list keep_;
};

class PyReadJob {
 public:
  PyReadJob(std::shared_ptr<Engine> e, std::shared_ptr<ReadJob> j, py::list keep)
      : engine_(std::move(e)), job_(std::move(j)), keep_(std::move(keep)) {}
  ~PyReadJob() {
    if (!engine_->owned_here()) {  // a fork child: see ~PyWriteJob
      leak(job_);
      leak(engine_);
      return;
    }
    if (!job_->done()) {
      job_->cancel();
      py::gil_scoped_release nogil;
      job_->wait();
    }
  }
  py::list wait() {
    engine_->require_owner("waiting for a read");
    std::vector<ReadFailure> f;
    {
      py::gil_scoped_release nogil;
      f = job_->wait();
    }
    keep_ = py::list();
    py::list out;
    for (const auto& x : f)
      out.append(py::make_tuple(x.request, x.kind, x.err, x.path, x.offset, x.message));
    return out;
  }
  bool done() {
    engine_->require_owner("asking whether a read is done");
    return job_->done();
  }

 private:
  std::shared_ptr<Engine> engine_;
  std::shared_ptr<ReadJob> job_;
  py::list keep_;
};

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "Native data-movement engine of dcp_datastates (pybind11, no torch dependency).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      // OSError(errno, message, filename) picks the matching subclass
      // (FileExistsError, PermissionError, ...); the offset rides along.
      py::object exc = py::module_::import("builtins").attr("OSError")(e.err(), e.what(), e.path());
      exc.attr("offset") = e.offset();
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::register_exception<ForkedEngineError>(m, "ForkedEngineError", PyExc_RuntimeError);

  py::class_<PyWriteJob>(m, "WriteJob")
      .def("append", &PyWriteJob::append, py::arg("regions"), py::arg("keep") = py::list(),
           "Add regions at or after every offset planned so far.")
      .def("seal", &PyWriteJob::seal, "No more regions: the job fsyncs once all are written.")
      .def("wait_staged", &PyWriteJob::wait_staged,
           "Block until every region has left the caller's memory; False if the job failed.")
      .def("release_staged", &PyWriteJob::release_staged,
           "wait_staged(), then let go of every buffer given so far (the engine no longer "
           "reads them); False (and nothing released) if the job failed.")
      .def("wait", &PyWriteJob::wait,
           "Block until written and fsynced; returns [(offset, nbytes, crc32c)] per piece.")
      .def("cancel", &PyWriteJob::cancel)
      .def_property_readonly("done", &PyWriteJob::done)
      .def_property_readonly("direct", &PyWriteJob::direct)
      .def_property_readonly("path", &PyWriteJob::path);

  py::class_<PyReadJob>(m, "ReadJob")
      .def("wait", &PyReadJob::wait,
           "Block until done; returns [(request, kind, errno, path, offset, message)] failures.")
      .def_property_readonly("done", &PyReadJob::done);

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      // Engine::release, not delete: an engine that reaches its end in a fork
      // child is leaked there instead of joining threads that do not exist.
      .def(py::init([](unsigned io_threads, uint64_t pool_bytes, uint64_t window_bytes) {
             return std::shared_ptr<Engine>(new Engine(io_threads, pool_bytes, window_bytes),
                                            &Engine::release);
           }),
           py::arg("io_threads"), py::arg("pool_bytes"), py::arg("window_bytes"))
      .def_property_readonly("owner_pid", &Engine::owner_pid,
                             "The process that created the engine (the only one it works in).")
      .def(
          "write",
          [](std::shared_ptr<Engine> self, const std::string& path, const py::list& regions,
             const py::list& keep, const std::string& direct_io, uint64_t preallocate, bool durable) {
            auto r = to_regions(regions);
            auto mode = parse_mode(direct_io);
            std::shared_ptr<WriteJob> job;
            {
              py::gil_scoped_release nogil;
              job = self->start_write(path, std::move(r), mode, preallocate, durable);
            }
            return std::make_unique<PyWriteJob>(self, job, keep);
          },
          py::arg("path"), py::arg("regions"), py::arg("keep") = py::list(),
          py::arg("direct_io") = "auto", py::arg("preallocate") = 0, py::arg("durable") = true,
          "Create `path` and start writing regions [(pointer, nbytes, file_offset)]; "
          "durable=False skips the final fsync (scratch files only).")
      .def(
          "read",
          [](std::shared_ptr<Engine> self, std::vector<std::string> paths, const py::list& requests,
             const py::list& keep) {
            std::vector<ReadRequest> reqs;
            reqs.reserve(requests.size());
            for (const auto& item : requests) {
              auto t = item.cast<py::tuple>();
              if (t.size() != 5)
                throw std::invalid_argument(
                    "a read request is (file_index, offset, nbytes, pointer, checks)");
              ReadRequest r{t[0].cast<uint32_t>(), t[1].cast<uint64_t>(), t[2].cast<uint64_t>(),
                            reinterpret_cast<uint8_t*>(t[3].cast<uintptr_t>()), {}};
              for (const auto& c : t[4].cast<py::list>()) {
                auto ct = c.cast<py::tuple>();
                r.checks.push_back(
                    {ct[0].cast<uint64_t>(), ct[1].cast<uint64_t>(), ct[2].cast<uint32_t>()});
              }
              reqs.push_back(std::move(r));
            }
            std::shared_ptr<ReadJob> job;
            {
              py::gil_scoped_release nogil;
              job = self->start_read(std::move(paths), std::move(reqs));
            }
            return std::make_unique<PyReadJob>(self, job, keep);
          },
          py::arg("paths"), py::arg("requests"), py::arg("keep") = py::list(),
          "Read requests [(file_index, offset, nbytes, pointer, [(rel, nbytes, crc32c)])].")
      .def(
          "pin_pool",
          [](Engine& e) {
            py::gil_scoped_release nogil;
            return e.pin_pool();
          },
          "Pin the host pool for CUDA copies; returns '' or why it could not be pinned.")
      .def_property_readonly("pool_pinned", &Engine::pool_pinned)
      .def_property_readonly("io_threads", &Engine::io_threads)
      .def_property_readonly("window_bytes", &Engine::window_bytes)
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
  m.def("crc32c_backend", &crc32c_backend);
  m.def(
      "load_cuda_runtime",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        return CudaRuntime::load(path);
      },
      py::arg("path") = "",
      "Resolve the CUDA runtime from `path` (or one already loaded in the process); returns '' "
      "on success or why it failed.");
  m.def("cuda_runtime_path", []() -> py::object {
    CudaRuntime* rt = CudaRuntime::get();
    if (rt == nullptr) return py::none();
    return py::str(rt->path);
  });
  m.def(
      "probe_sequential_write",
      [](const std::string& path, uint64_t total, uint64_t block, bool direct) {
        py::gil_scoped_release nogil;
        return probe_sequential_write(path, total, block, direct);
      },
      py::arg("path"), py::arg("total"), py::arg("block") = 8 << 20, py::arg("direct") = true);
  m.def(
      "probe_sequential_read",
      [](const std::string& path, uint64_t block) {
        uint64_t n = 0;
        double s;
        {
          py::gil_scoped_release nogil;
          s = probe_sequential_read(path, block, &n);
        }
        return py::make_tuple(n, s);
      },
      py::arg("path"), py::arg("block") = 8 << 20);
  m.def(
      "drop_page_cache",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        drop_page_cache(path);
      },
      py::arg("path"));
  // Fault injection, for the reliability tests only (see dcp_datastates._faults).
  m.def(
      "_fault_add",
      [](int op, const std::string& path_part, uint64_t offset, int action, int err, int64_t skip,
         int64_t times) {
        if (op < 0 || op > 3) throw std::invalid_argument("fault op must be 0..3");
        if (action < 0 || action > 2) throw std::invalid_argument("fault action must be 0..2");
        FaultRule r;
        r.op = static_cast<FaultOp>(op);
        r.path_part = path_part;
        r.offset = offset;
        r.action = static_cast<FaultAction>(action);
        r.err = err;
        r.skip = skip;
        r.times = times;
        faults::add(std::move(r));
      },
      py::arg("op"), py::arg("path_part"), py::arg("offset"), py::arg("action"), py::arg("err"),
      py::arg("skip"), py::arg("times"));
  m.def("_fault_clear", &faults::clear);
  m.def("_fault_fired", &faults::fired, py::arg("rule_index"));
  m.def("_faults_armed", []() { return faults::g_armed.load(); });
  m.def(
      "_fault_point",
      [](int op, const std::string& path, uint64_t offset, uint64_t nbytes) -> uint64_t {
        if (op == static_cast<int>(FaultOp::kWrite) || op == static_cast<int>(FaultOp::kRead))
          return faults::limit_transfer(static_cast<FaultOp>(op), path, offset, nbytes);
        faults::check_call(static_cast<FaultOp>(op), path);
        return nbytes;
      },
      py::arg("op"), py::arg("path"), py::arg("offset") = 0, py::arg("nbytes") = 0,
      "Python-side I/O (index, metadata, renames) passes through the same fault rules.");
  m.attr("ALIGNMENT") = kAlign;
}
