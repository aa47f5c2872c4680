// The `faults` submodule of dcp_datastates._engine: fault injection for the
// reliability tests. It lives in the engine (its rules hook the engine's own
// pwrite/pread/fsync calls) but apart from the production API, so nothing
// else reaches it by accident; dcp_datastates.native.faults is its Python face.
#pragma once

#include <pybind11/pybind11.h>

namespace dcpds {

void bind_faults(pybind11::module_& faults);

}  // namespace dcpds
