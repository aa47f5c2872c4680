// The CUDA runtime, resolved when the process has it, never at build time.
//
// The engine is built with pybind11 only (no CUDA headers or libraries), so
// `pip install .` works on any machine. When a process holding CUDA tensors
// saves, Python tells the engine where the CUDA runtime library that torch
// loaded lives; the engine dlopen()s it and resolves the handful of entry
// points it needs by name. Handles (streams, events) are opaque pointers, as
// in the runtime's own C API, so events recorded by torch on the caller's
// stream can be waited on by the engine's side streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dcpds {

class CudaRuntime {
 public:
  // The runtime loaded by load() (or found already loaded in the process);
  // nullptr when there is none.
  static CudaRuntime* get();
  // dlopen()s `path` (empty: look for a runtime the process already loaded)
  // and resolves every entry point. Returns an empty string on success, else
  // why it failed. Loading twice is harmless: the first success wins.
  static std::string load(const std::string& path);

  using Err = int;  // cudaError_t; 0 is success
  Err (*set_device)(int) = nullptr;
  Err (*stream_create_with_flags)(void**, unsigned) = nullptr;
  Err (*stream_destroy)(void*) = nullptr;
  Err (*stream_wait_event)(void*, void*, unsigned) = nullptr;
  Err (*stream_synchronize)(void*) = nullptr;
  Err (*memcpy_async)(void*, const void*, size_t, int, void*) = nullptr;
  Err (*event_create_with_flags)(void**, unsigned) = nullptr;
  Err (*event_record)(void*, void*) = nullptr;
  Err (*event_synchronize)(void*) = nullptr;
  Err (*event_destroy)(void*) = nullptr;
  Err (*host_register)(void*, size_t, unsigned) = nullptr;
  Err (*host_unregister)(void*) = nullptr;
  const char* (*get_error_string)(Err) = nullptr;

  std::string path;  // the library file the entry points came from

  // "<what> failed: <cudaGetErrorString> (cudaError <code>)".
  std::string describe(const char* what, Err code) const;

  // Constants of the runtime API (stable across CUDA 11-13).
  static constexpr unsigned kStreamNonBlocking = 0x01;
  static constexpr unsigned kEventDisableTiming = 0x02;
  static constexpr unsigned kHostRegisterPortable = 0x01;
  static constexpr int kMemcpyDeviceToHost = 2;
};

}  // namespace dcpds
