// Benchmark-only module dcp_datastates._probes: raw disk and memory bandwidth probes.
//
// The benchmarks report our throughput as a ratio of what the same disk does
// for the simplest sequential I/O. That is measuring equipment, not part of
// saving or loading, so it lives in its own extension and the production
// module (_engine) does not carry it. Every probe releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "crc32c.hpp"
#include "disk_probe.hpp"
#include "py_errors.hpp"

namespace py = pybind11;
using namespace dcpds;

PYBIND11_MODULE(_probes, m) {
  m.doc() = "Raw sequential disk probes for dcp_datastates' benchmarks (not used by the library).";
  register_io_error_translator();
  m.def(
      "probe_sequential_write",
      [](const std::string& path, uint64_t total, uint64_t block, bool direct) {
        py::gil_scoped_release nogil;
        return probe_sequential_write(path, total, block, direct);
      },
      py::arg("path"), py::arg("total"), py::arg("block") = 8 << 20, py::arg("direct") = true,
      "Write `total` bytes to a new `path` in `block`-byte writes (O_DIRECT if `direct`), then "
      "fsync; returns the seconds taken, fsync included.");
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
      py::arg("path"), py::arg("block") = 8 << 20,
      "Read all of `path` in `block`-byte buffered reads; returns (bytes read, seconds).");
  m.def(
      "probe_memcpy",
      [](uint64_t total, uint64_t block, unsigned reps) {
        py::gil_scoped_release nogil;
        return probe_memcpy(total, block, reps);
      },
      py::arg("total"), py::arg("block") = 8 << 20, py::arg("reps") = 3,
      "Copy `total` bytes between two prefaulted buffers in `block`-byte memcpy calls on one "
      "thread; returns the seconds of the fastest of `reps` repetitions.");
  m.def("crc32c_kernels", &crc32c_kernels, "The CRC-32C implementations this CPU can run.");
  m.def(
      "crc32c_with",
      [](const std::string& kernel, py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1)
          throw std::invalid_argument("crc32c_with takes a contiguous byte buffer");
        py::gil_scoped_release nogil;
        return crc32c_with(kernel, crc, info.ptr, static_cast<size_t>(info.size));
      },
      py::arg("kernel"), py::arg("data"), py::arg("crc") = 0,
      "CRC-32C of `data` extending `crc`, computed by the named kernel (ValueError if this CPU lacks it).");
  m.def(
      "drop_page_cache",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        drop_page_cache(path);
      },
      py::arg("path"), "Flush `path` and drop it from the page cache, so the next read comes from the disk.");
}
