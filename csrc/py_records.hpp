// The typed records of the Python boundary of dcp_datastates._engine.
//
// Python hands the engine named records instead of tuples told apart by
// their length: a region is a HostRegion, StridedRegion or DeviceRegion (all
// subclasses of Region), a read is a ReadRequest with SegmentChecks, and
// jobs answer with Segments and ReadFailures. Every record is validated when
// it is made, with an error naming the class and the field, so a wrong
// value fails where the caller built it rather than deep in an engine
// thread. The records are immutable (read-only attributes) and convert to
// the engine's own structs without touching Python again.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine.hpp"

namespace dcpds {

namespace py = pybind11;

// The Python classes' C++ side. Each is an engine Region (sliced to one when
// a job takes it) plus what its Python attributes report.
struct HostRegion : Region {};
struct StridedRegion : Region {
  std::vector<int64_t> sizes;    // as given (Region::strided holds the merged layout)
  std::vector<int64_t> strides;  // in elements
  uint64_t itemsize = 0;
};
struct DeviceRegion : Region {};

// Validating constructors behind the keyword constructors of the Python classes.
HostRegion make_host_region(py::handle address, py::handle nbytes, py::handle file_offset);
StridedRegion make_strided_region(py::handle address, py::handle nbytes, py::handle file_offset,
                                  py::handle sizes, py::handle strides, py::handle itemsize);
DeviceRegion make_device_region(py::handle address, py::handle nbytes, py::handle file_offset,
                                py::handle device, py::handle ready_event);
ReadCheck make_segment_check(py::handle offset_in_request, py::handle nbytes, py::handle crc32c);

// A file's checksum segments (a rank index's), sorted by offset and disjoint:
// a ReadRequest made with it takes the segments of its range as its checks,
// which must tile that range exactly (a gap is a damaged index or metadata).
struct SegmentTable {
  std::vector<Segment> segments;
  // Walks the segments from `offset` while they tile [offset, offset + len)
  // without a gap, appending each as a check (relative to `offset`) when
  // `out` is given; returns the file offset where the tiling stopped
  // (offset + len when it covers the range).
  uint64_t tile(uint64_t offset, uint64_t len, std::vector<ReadCheck>* out) const;
  std::vector<ReadCheck> checks(uint64_t offset, uint64_t len) const;  // throws ValueError on a gap
};

ReadRequest make_read_request(py::handle file_index, py::handle offset, py::handle nbytes,
                              py::handle address, py::handle checks, const SegmentTable* verify_with);

// The fields of a value record, in constructor order: its equality and hash
// (and, during the transition, its tuple form).
py::tuple fields_of(const ReadCheck& c);
py::tuple fields_of(const Segment& s);
py::tuple fields_of(const ReadFailure& f);

// Python sequences of records -> the engine's structs (GIL held).
std::vector<Region> regions_from(const py::handle& regions);
std::vector<ReadRequest> read_requests_from(const py::handle& requests);

// Binds Region and its subclasses, SegmentCheck, SegmentTable, ReadRequest, Segment and ReadFailure.
void bind_records(py::module_& m);

}  // namespace dcpds
