#include "py_faults.hpp"

#include <cerrno>

#include "fault_injection.hpp"

namespace py = pybind11;

namespace dcpds {

void bind_faults(py::module_& m) {
  m.doc() = "Fault injection for the reliability tests (see dcp_datastates.native.faults).";
  py::enum_<FaultOp>(m, "Op", "The operation a rule hooks.")
      .value("write", FaultOp::kWrite)
      .value("read", FaultOp::kRead)
      .value("fsync", FaultOp::kFsync)
      .value("rename", FaultOp::kRename);
  py::enum_<FaultAction>(m, "Action",
                         "What a firing rule does: fail with errno after the bytes before its offset "
                         "(error), move fewer bytes than asked (short), SIGKILL the process (kill), or "
                         "wait, then go through (stall: a slow disk).")
      .value("error", FaultAction::kError)
      .value("short", FaultAction::kShort)
      .value("kill", FaultAction::kKill)
      .value("stall", FaultAction::kStall);
  m.attr("ANY_OFFSET") = py::int_(kAnyOffset);
  m.def(
      "add",
      [](FaultOp op, const std::string& path_part, uint64_t offset, FaultAction action, int err, int64_t skip,
         int64_t times, int64_t stall_us) {
        if (skip < 0) throw py::value_error("faults.add: skip must be >= 0, got " + std::to_string(skip));
        if (times < -1) throw py::value_error("faults.add: times must be >= -1, got " + std::to_string(times));
        if (stall_us < 0 || stall_us > 60'000'000)
          throw py::value_error("faults.add: stall_us must be between 0 and 60 s, got " + std::to_string(stall_us));
        FaultRule r;
        r.op = op;
        r.path_part = path_part;
        r.offset = offset;
        r.action = action;
        r.err = err;
        r.skip = skip;
        r.times = times;
        r.stall_us = stall_us;
        return faults::add(std::move(r));
      },
      py::arg("op"), py::arg("path_part") = "", py::arg("offset") = kAnyOffset, py::arg("action") = FaultAction::kError,
      py::arg("errno") = EIO, py::arg("skip") = 0, py::arg("times") = 1, py::arg("stall_us") = 0,
      "Arm a rule; returns its index (for fired()). It matches `op` on paths containing `path_part`; "
      "a write or read rule fires on the call whose bytes contain `offset` (ANY_OFFSET: every call), "
      "after `skip` matches, `times` times (-1: always); a stall rule waits `stall_us` first.");
  m.def("clear", &faults::clear, "Remove every rule.");
  m.def(
      "fired",
      [](size_t index) {
        int64_t n = faults::fired(index);
        if (n < 0) throw py::index_error("no fault rule " + std::to_string(index) + " is armed");
        return n;
      },
      py::arg("rule_index"), "How many times rule `rule_index` has fired.");
  m.def("armed", []() { return faults::g_armed.load(); }, "Whether any rule is armed.");
  m.def(
      "point",
      [](FaultOp op, const std::string& path, uint64_t offset, uint64_t nbytes) -> uint64_t {
        if (op == FaultOp::kWrite || op == FaultOp::kRead) return faults::limit_transfer(op, path, offset, nbytes);
        faults::check_call(op, path);
        return nbytes;
      },
      py::arg("op"), py::arg("path"), py::arg("offset") = 0, py::arg("nbytes") = 0,
      "Python-side I/O (index, metadata, renames) passes through the same rules: returns how many of "
      "`nbytes` the transfer may move, or raises the injected OSError (or kills the process).");
}

}  // namespace dcpds
