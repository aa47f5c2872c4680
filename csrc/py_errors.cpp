#include "py_errors.hpp"

#include <pybind11/pybind11.h>

#include "io_error.hpp"

namespace py = pybind11;

namespace dcpds {

void register_io_error_translator() {
  py::register_local_exception_translator([](std::exception_ptr p) {
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
}

}  // namespace dcpds
