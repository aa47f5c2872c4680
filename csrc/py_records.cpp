#include "py_records.hpp"

#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <limits>
#include <stdexcept>


namespace dcpds {

namespace {

constexpr uint64_t kMaxFileOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
constexpr uint64_t kMaxAddress = std::numeric_limits<uintptr_t>::max();

std::string field_name(const char* cls, const char* field) { return std::string(cls) + "." + field; }
std::string type_name(py::handle v) { return Py_TYPE(v.ptr())->tp_name; }

// `v` as an integer in [0, max], else TypeError/ValueError naming cls.field.
// Anything with __index__ is accepted (numpy and torch integers), bool is not.
uint64_t as_uint(const char* cls, const char* field, py::handle v, uint64_t max) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
    throw py::type_error(field_name(cls, field) + " must be an int, got " +
                         type_name(v));
  py::int_ i = py::reinterpret_steal<py::int_>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  int overflow = 0;
  const long long ll = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow < 0 || (overflow == 0 && ll < 0))
    throw py::value_error(field_name(cls, field) + " must be >= 0, got " + std::string(py::str(i)));
  const unsigned long long u = PyLong_AsUnsignedLongLong(i.ptr());
  if (PyErr_Occurred() || u > max) {
    PyErr_Clear();
    throw py::value_error(field_name(cls, field) + " must be at most " + std::to_string(max) +
                          ", got " + std::string(py::str(i)));
  }
  return static_cast<uint64_t>(u);
}

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string crc_hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string int_list(const std::vector<int64_t>& v) {
  std::string out = "(";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + (v.size() == 1 ? ",)" : ")");
}

uintptr_t address_of(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// Every item of the sequence `items` (named `what` in errors) as a `T`: an
// instance of the class bound to `Record` (T itself, or its base for the
// regions).
template <class Record, class T>
std::vector<T> records_from(py::handle items, const std::string& what, const char* expected) {
  if (!py::isinstance<py::iterable>(items))
    throw py::type_error(what + " must be a sequence of " + expected + ", got " + type_name(items));
  std::vector<T> out;
  if (py::isinstance<py::sequence>(items)) out.reserve(py::len(items));
  for (auto item : py::reinterpret_borrow<py::iterable>(items)) {
    T value;
    if (py::isinstance<Record>(item))
      value = item.cast<const Record&>();
    else
      throw py::type_error(what + "[" + std::to_string(out.size()) + "] must be a " + expected + ", got " +
                           type_name(item));
    out.push_back(std::move(value));
  }
  return out;
}

// The fields every region has, validated.
void fill_region(Region& r, const char* cls, py::handle address, py::handle nbytes,
                 py::handle file_offset) {
  const uint64_t addr = as_uint(cls, "address", address, kMaxAddress);
  r.len = as_uint(cls, "nbytes", nbytes, kMaxFileOffset);
  r.offset = as_uint(cls, "file_offset", file_offset, kMaxFileOffset);
  if (r.len > kMaxFileOffset - r.offset)
    throw py::value_error(std::string(cls) + ": file_offset " + std::to_string(r.offset) + " + nbytes " +
                          std::to_string(r.len) + " is past the largest file offset");
  if (addr == 0 && r.len > 0)
    throw py::value_error(field_name(cls, "address") + " is 0 (a null pointer) for " +
                          std::to_string(r.len) + " bytes");
  r.src = reinterpret_cast<const uint8_t*>(addr);
}

std::string region_fields(const Region& r) {
  return "address=" + hex(address_of(r.src)) + ", nbytes=" + std::to_string(r.len) +
         ", file_offset=" + std::to_string(r.offset);
}

std::string check_repr(const ReadCheck& c) {
  return "SegmentCheck(offset_in_request=" + std::to_string(c.rel) + ", nbytes=" + std::to_string(c.len) +
         ", crc32c=" + crc_hex(c.crc) + ")";
}

const char* const kFailureKinds[] = {"io", "truncated", "checksum"};

ReadFailure make_read_failure(py::handle request, const std::string& kind, py::handle err,
                              const std::string& path, py::handle offset, const std::string& message) {
  bool known = false;
  for (const char* k : kFailureKinds) known = known || kind == k;
  if (!known)
    throw py::value_error("ReadFailure.kind must be 'io', 'truncated' or 'checksum', got '" + kind + "'");
  ReadFailure f;
  f.request = as_uint("ReadFailure", "request", request, kMaxFileOffset);
  f.kind = kind;
  f.err = static_cast<int>(as_uint("ReadFailure", "errno", err, INT_MAX));
  f.path = path;
  // -1: the failure is not tied to an offset (opening the file failed).
  if (py::isinstance<py::int_>(offset) && offset.cast<long long>() == -1)
    f.offset = -1;
  else
    f.offset = static_cast<int64_t>(as_uint("ReadFailure", "offset", offset, kMaxFileOffset));
  f.message = message;
  return f;
}

}  // namespace

HostRegion make_host_region(py::handle address, py::handle nbytes, py::handle file_offset) {
  HostRegion r;
  fill_region(r, "HostRegion", address, nbytes, file_offset);
  return r;
}

StridedRegion make_strided_region(py::handle address, py::handle nbytes, py::handle file_offset,
                                  py::handle sizes, py::handle strides, py::handle itemsize) {
  const char* cls = "StridedRegion";
  StridedRegion r;
  fill_region(r, cls, address, nbytes, file_offset);
  r.itemsize = as_uint(cls, "itemsize", itemsize, UINT32_MAX);
  if (r.itemsize == 0) throw py::value_error("StridedRegion.itemsize must be > 0, got 0");
  auto ints = [&](const char* field, py::handle seq) {
    if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
      throw py::type_error(field_name(cls, field) + " must be a sequence of ints, got " +
                           type_name(seq));
    std::vector<int64_t> out;
    size_t i = 0;
    for (auto v : py::reinterpret_borrow<py::sequence>(seq)) {
      const std::string f = std::string(field) + "[" + std::to_string(i++) + "]";
      out.push_back(static_cast<int64_t>(as_uint(cls, f.c_str(), v, kMaxFileOffset)));
    }
    return out;
  };
  r.sizes = ints("sizes", sizes);
  r.strides = ints("strides", strides);
  if (r.sizes.size() != r.strides.size())
    throw py::value_error("StridedRegion: sizes has " + std::to_string(r.sizes.size()) +
                          " dimensions but strides has " + std::to_string(r.strides.size()));
  uint64_t n = r.itemsize;
  for (int64_t s : r.sizes)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(s), &n))
      throw py::value_error("StridedRegion: sizes " + int_list(r.sizes) + " overflow 64 bits");
  if (n != r.len)
    throw py::value_error("StridedRegion.nbytes is " + std::to_string(r.len) + " but sizes " +
                          int_list(r.sizes) + " of itemsize " + std::to_string(r.itemsize) + " hold " +
                          std::to_string(n) + " bytes");
  r.strided = StridedLayout::make(r.sizes, r.strides, r.itemsize);
  return r;
}

DeviceRegion make_device_region(py::handle address, py::handle nbytes, py::handle file_offset,
                                py::handle device, py::handle ready_event) {
  DeviceRegion r;
  fill_region(r, "DeviceRegion", address, nbytes, file_offset);
  r.device = static_cast<int>(as_uint("DeviceRegion", "device", device, INT_MAX));
  r.ready_event = ready_event.is_none()
                      ? nullptr
                      : reinterpret_cast<void*>(as_uint("DeviceRegion", "ready_event", ready_event, kMaxAddress));
  return r;
}

ReadCheck make_segment_check(py::handle offset_in_request, py::handle nbytes, py::handle crc32c) {
  ReadCheck c;
  c.rel = as_uint("SegmentCheck", "offset_in_request", offset_in_request, kMaxFileOffset);
  c.len = as_uint("SegmentCheck", "nbytes", nbytes, kMaxFileOffset);
  c.crc = static_cast<uint32_t>(as_uint("SegmentCheck", "crc32c", crc32c, UINT32_MAX));
  return c;
}

uint64_t SegmentTable::tile(uint64_t offset, uint64_t len, std::vector<ReadCheck>* out) const {
  const uint64_t end = offset + len;
  auto it = std::lower_bound(segments.begin(), segments.end(), offset,
                             [](const Segment& s, uint64_t at) { return s.offset < at; });
  uint64_t pos = offset;
  for (; it != segments.end() && pos < end && it->offset == pos && it->offset + it->len <= end; ++it) {
    if (out != nullptr) out->push_back({it->offset - offset, it->len, it->crc});
    pos += it->len;
  }
  return pos;
}

std::vector<ReadCheck> SegmentTable::checks(uint64_t offset, uint64_t len) const {
  std::vector<ReadCheck> out;
  const uint64_t reached = tile(offset, len, &out);
  if (reached != offset + len)
    throw py::value_error("bytes " + std::to_string(reached) + ".." + std::to_string(offset + len) +
                          " of the request are not covered by its SegmentTable");
  return out;
}

ReadRequest make_read_request(py::handle file_index, py::handle offset, py::handle nbytes,
                              py::handle address, py::handle checks, const SegmentTable* verify_with) {
  const char* cls = "ReadRequest";
  ReadRequest r;
  r.file = static_cast<uint32_t>(as_uint(cls, "file_index", file_index, UINT32_MAX));
  r.offset = as_uint(cls, "offset", offset, kMaxFileOffset);
  r.len = as_uint(cls, "nbytes", nbytes, kMaxFileOffset);
  if (r.len > kMaxFileOffset - r.offset)
    throw py::value_error("ReadRequest: offset " + std::to_string(r.offset) + " + nbytes " +
                          std::to_string(r.len) + " is past the largest file offset");
  const uint64_t addr = as_uint(cls, "address", address, kMaxAddress);
  if (addr == 0 && r.len > 0)
    throw py::value_error("ReadRequest.address is 0 (a null pointer) for " + std::to_string(r.len) + " bytes");
  r.dst = reinterpret_cast<uint8_t*>(addr);
  if (verify_with != nullptr) {
    if (!checks.is_none() && py::len(checks) > 0)
      throw py::value_error("ReadRequest takes checks or verify_with, not both");
    r.checks = verify_with->checks(r.offset, r.len);
    return r;
  }
  if (checks.is_none()) return r;
  r.checks = records_from<ReadCheck, ReadCheck>(checks, "ReadRequest.checks", "SegmentCheck");
  uint64_t end = 0;
  for (size_t i = 0; i < r.checks.size(); ++i) {
    const ReadCheck& c = r.checks[i];
    if (c.rel < end || c.len > r.len || c.rel > r.len - c.len)
      throw py::value_error("ReadRequest.checks[" + std::to_string(i) + "] covers bytes [" + std::to_string(c.rel) +
                            ", " + std::to_string(c.rel + c.len) +
                            ") of the request: checks must be sorted, must not overlap and must lie inside its " +
                            std::to_string(r.len) + " bytes");
    end = c.rel + c.len;
  }
  return r;
}

py::tuple fields_of(const ReadCheck& c) { return py::make_tuple(c.rel, c.len, c.crc); }
py::tuple fields_of(const Segment& s) { return py::make_tuple(s.offset, s.len, s.crc); }
py::tuple fields_of(const ReadFailure& f) {
  return py::make_tuple(f.request, f.kind, f.err, f.path, f.offset, f.message);
}

namespace {

// Value records compare and hash by their fields.
template <class T>
void value_semantics(py::class_<T>& cls) {
  cls.def("__eq__", [](const T& a, const T& b) { return fields_of(a).equal(fields_of(b)); }, py::is_operator())
      .def("__hash__", [](const T& v) { return py::hash(fields_of(v)); });
}

}  // namespace

std::vector<Region> regions_from(const py::handle& regions) {
  return records_from<Region, Region>(regions, "regions", "HostRegion, StridedRegion or DeviceRegion");
}

std::vector<ReadRequest> read_requests_from(const py::handle& requests) {
  return records_from<ReadRequest, ReadRequest>(requests, "requests", "ReadRequest");
}

void bind_records(py::module_& m) {
  using py::arg;

  py::class_<Region>(m, "Region",
                     "Bytes the engine writes at `file_offset` of a file: a HostRegion, StridedRegion "
                     "or DeviceRegion (this base class cannot be made itself).")
      .def_property_readonly("address", [](const Region& r) { return address_of(r.src); },
                             "Where the bytes are (host or device address).")
      .def_property_readonly("nbytes", [](const Region& r) { return r.len; })
      .def_property_readonly("file_offset", [](const Region& r) { return r.offset; });

  py::class_<HostRegion, Region>(m, "HostRegion",
                                 "Contiguous host memory: `nbytes` from `address`, written at `file_offset`.")
      .def(py::init([](py::object address, py::object nbytes, py::object file_offset) {
             return make_host_region(address, nbytes, file_offset);
           }),
           py::kw_only(), arg("address"), arg("nbytes"), arg("file_offset"))
      .def("__repr__", [](const HostRegion& r) { return "HostRegion(" + region_fields(r) + ")"; });

  py::class_<StridedRegion, Region>(
      m, "StridedRegion",
      "Host memory with gaps (a transposed or sliced tensor): `sizes` and `strides` (in elements) "
      "of items of `itemsize` bytes from `address`; the engine gathers it run by run, in row-major "
      "order, into `nbytes` contiguous file bytes at `file_offset`.")
      .def(py::init([](py::object address, py::object nbytes, py::object file_offset, py::object sizes,
                       py::object strides, py::object itemsize) {
             return make_strided_region(address, nbytes, file_offset, sizes, strides, itemsize);
           }),
           py::kw_only(), arg("address"), arg("nbytes"), arg("file_offset"), arg("sizes"), arg("strides"),
           arg("itemsize"))
      .def_property_readonly("sizes", [](const StridedRegion& r) { return py::tuple(py::cast(r.sizes)); })
      .def_property_readonly("strides", [](const StridedRegion& r) { return py::tuple(py::cast(r.strides)); })
      .def_property_readonly("itemsize", [](const StridedRegion& r) { return r.itemsize; })
      .def("__repr__", [](const StridedRegion& r) {
        return "StridedRegion(" + region_fields(r) + ", sizes=" + int_list(r.sizes) +
               ", strides=" + int_list(r.strides) + ", itemsize=" + std::to_string(r.itemsize) + ")";
      });

  py::class_<DeviceRegion, Region>(
      m, "DeviceRegion",
      "Contiguous CUDA memory on `device`, copied to the host pool with cudaMemcpyAsync on the "
      "engine's stream for that device, after `ready_event` (a cudaEvent_t the caller recorded on its "
      "own stream; None: no wait).")
      .def(py::init([](py::object address, py::object nbytes, py::object file_offset, py::object device,
                       py::object ready_event) {
             return make_device_region(address, nbytes, file_offset, device, ready_event);
           }),
           py::kw_only(), arg("address"), arg("nbytes"), arg("file_offset"), arg("device"),
           arg("ready_event") = py::none())
      .def_property_readonly("device", [](const DeviceRegion& r) { return r.device; })
      .def_property_readonly("ready_event",
                             [](const DeviceRegion& r) -> py::object {
                               if (r.ready_event == nullptr) return py::none();
                               return py::int_(address_of(r.ready_event));
                             })
      .def("__repr__", [](const DeviceRegion& r) {
        return "DeviceRegion(" + region_fields(r) + ", device=" + std::to_string(r.device) +
               ", ready_event=" + (r.ready_event ? hex(address_of(r.ready_event)) : std::string("None")) + ")";
      });

  py::class_<ReadCheck> check(m, "SegmentCheck",
                        "A checksum segment of a read: `nbytes` from `offset_in_request` (bytes from the "
                        "start of the request) must have CRC-32C `crc32c`.");
  check.def(py::init([](py::object offset_in_request, py::object nbytes, py::object crc32c) {
             return make_segment_check(offset_in_request, nbytes, crc32c);
           }),
           py::kw_only(), arg("offset_in_request"), arg("nbytes"), arg("crc32c"))
      .def_property_readonly("offset_in_request", [](const ReadCheck& c) { return c.rel; })
      .def_property_readonly("nbytes", [](const ReadCheck& c) { return c.len; })
      .def_property_readonly("crc32c", [](const ReadCheck& c) { return c.crc; })
      .def("__repr__", &check_repr);
  value_semantics(check);

  py::class_<SegmentTable>(m, "SegmentTable",
                           "A file's checksum segments (a rank index's): `offsets`, `lengths` and `crc32cs` "
                           "of the same length, sorted by offset, disjoint. A ReadRequest made with "
                           "verify_with=table checks every byte of its range against them.")
      .def(py::init([](const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& lengths,
                       const std::vector<uint32_t>& crc32cs) {
             if (offsets.size() != lengths.size() || offsets.size() != crc32cs.size())
               throw py::value_error("SegmentTable: offsets, lengths and crc32cs differ in length (" +
                                     std::to_string(offsets.size()) + ", " + std::to_string(lengths.size()) +
                                     ", " + std::to_string(crc32cs.size()) + ")");
             SegmentTable t;
             t.segments.reserve(offsets.size());
             uint64_t end = 0;
             for (size_t i = 0; i < offsets.size(); ++i) {
               if (offsets[i] < end || lengths[i] > kMaxFileOffset - offsets[i])
                 throw py::value_error("SegmentTable: segment " + std::to_string(i) + " at offset " +
                                       std::to_string(offsets[i]) + " is out of order or overlaps the one before");
               t.segments.push_back({offsets[i], lengths[i], crc32cs[i]});
               end = offsets[i] + lengths[i];
             }
             return t;
           }),
           py::kw_only(), arg("offsets"), arg("lengths"), arg("crc32cs"))
      .def("__len__", [](const SegmentTable& t) { return t.segments.size(); })
      .def(
          "first_gap",
          [](const SegmentTable& t, uint64_t offset, uint64_t nbytes) -> py::object {
            const uint64_t reached = t.tile(offset, nbytes, nullptr);
            if (reached == offset + nbytes) return py::none();
            return py::make_tuple(reached, offset + nbytes);
          },
          arg("offset"), arg("nbytes"),
          "The first bytes [start, end) of the range that the segments inside it do not tile, or None.")
      .def("__repr__", [](const SegmentTable& t) { return "SegmentTable(" + std::to_string(t.segments.size()) + " segments)"; });

  py::class_<ReadRequest>(m, "ReadRequest",
                          "Read `nbytes` at `offset` of file `file_index` (of the job's paths) into "
                          "`address`, verifying every SegmentCheck (sorted, non-overlapping) right after "
                          "its bytes are read. With `verify_with` (a SegmentTable) the checks are the "
                          "table's segments inside the range, which must tile it (ValueError otherwise).")
      .def(py::init([](py::object file_index, py::object offset, py::object nbytes, py::object address,
                       py::object checks, const SegmentTable* verify_with) {
             return make_read_request(file_index, offset, nbytes, address, checks, verify_with);
           }),
           py::kw_only(), arg("file_index"), arg("offset"), arg("nbytes"), arg("address"),
           arg("checks") = py::tuple(), arg("verify_with") = py::none())
      .def_property_readonly("file_index", [](const ReadRequest& r) { return r.file; })
      .def_property_readonly("offset", [](const ReadRequest& r) { return r.offset; })
      .def_property_readonly("nbytes", [](const ReadRequest& r) { return r.len; })
      .def_property_readonly("address", [](const ReadRequest& r) { return address_of(r.dst); })
      .def_property_readonly("checks", [](const ReadRequest& r) { return py::tuple(py::cast(r.checks)); })
      .def("__repr__", [](const ReadRequest& r) {
        std::string checks;
        for (size_t i = 0; i < r.checks.size() && i < 2; ++i) checks += (i ? ", " : "") + check_repr(r.checks[i]);
        if (r.checks.size() > 2) checks += ", ... " + std::to_string(r.checks.size() - 2) + " more";
        return "ReadRequest(file_index=" + std::to_string(r.file) + ", offset=" + std::to_string(r.offset) +
               ", nbytes=" + std::to_string(r.len) + ", address=" + hex(address_of(r.dst)) + ", checks=(" +
               checks + "))";
      });

  py::class_<Segment> segment(m, "Segment",
                              "A piece of a finished write: `nbytes` at file `offset` whose CRC-32C is "
                              "`crc32c` (what the rank index stores).");
  segment.def(py::init([](py::object offset, py::object nbytes, py::object crc32c) {
             return Segment{as_uint("Segment", "offset", offset, kMaxFileOffset),
                            as_uint("Segment", "nbytes", nbytes, kMaxFileOffset),
                            static_cast<uint32_t>(as_uint("Segment", "crc32c", crc32c, UINT32_MAX))};
           }),
           py::kw_only(), arg("offset"), arg("nbytes"), arg("crc32c"))
      .def_property_readonly("offset", [](const Segment& s) { return s.offset; })
      .def_property_readonly("nbytes", [](const Segment& s) { return s.len; })
      .def_property_readonly("crc32c", [](const Segment& s) { return s.crc; })
      .def("__repr__", [](const Segment& s) {
        return "Segment(offset=" + std::to_string(s.offset) + ", nbytes=" + std::to_string(s.len) +
               ", crc32c=" + crc_hex(s.crc) + ")";
      });
  value_semantics(segment);

  py::class_<ReadFailure> failure(m, "ReadFailure",
                                  "Why request number `request` of a read job failed: `kind` is 'io' (errno "
                                  "`errno`), 'truncated' (the file ends early) or 'checksum'; `offset` is the "
                                  "file offset where it failed (-1: not tied to one, e.g. the file did not open).");
  failure.def(py::init(&make_read_failure), py::kw_only(), arg("request"), arg("kind"), arg("errno"), arg("path"),
           arg("offset"), arg("message"))
      .def_property_readonly("request", [](const ReadFailure& f) { return f.request; })
      .def_property_readonly("kind", [](const ReadFailure& f) { return f.kind; })
      .def_property_readonly("errno", [](const ReadFailure& f) { return f.err; })
      .def_property_readonly("path", [](const ReadFailure& f) { return f.path; })
      .def_property_readonly("offset", [](const ReadFailure& f) { return f.offset; })
      .def_property_readonly("message", [](const ReadFailure& f) { return f.message; })
      .def("__repr__", [](const ReadFailure& f) {
        return "ReadFailure(request=" + std::to_string(f.request) + ", kind=" + std::string(py::repr(py::str(f.kind))) +
               ", errno=" + std::to_string(f.err) + ", path=" + std::string(py::repr(py::str(f.path))) +
               ", offset=" + std::to_string(f.offset) + ", message=" + std::string(py::repr(py::str(f.message))) + ")";
      });
  value_semantics(failure);
}

}  // namespace dcpds
