// IoError -> OSError, shared by the engine module and the benchmark probes.
//
// Both extensions raise the engine's IoError; Python sees OSError (or the
// errno subclass, e.g. FileExistsError) with `filename` and an extra
// `offset` attribute, so callers can name the file and map the offset back
// to the state-dict key stored there.
#pragma once

namespace dcpds {

// Registers the translator for the module being initialised (call it from
// PYBIND11_MODULE): module-local, so each extension translates its own errors.
void register_io_error_translator();

}  // namespace dcpds
