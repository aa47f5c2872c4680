#include "cuda_runtime.hpp"

#include <dlfcn.h>

#include <atomic>
#include <memory>
#include <mutex>

namespace dcpds {

namespace {

std::mutex g_mu;
std::atomic<CudaRuntime*> g_rt{nullptr};

template <typename Fn>
bool resolve(void* lib, const char* name, Fn& out, std::string& missing) {
  void* sym = ::dlsym(lib, name);
  if (sym == nullptr) {
    if (!missing.empty()) missing += ", ";
    missing += name;
    return false;
  }
  out = reinterpret_cast<Fn>(sym);
  return true;
}

std::string try_library(void* lib, const std::string& path) {
  auto rt = std::make_unique<CudaRuntime>();
  std::string missing;
  resolve(lib, "cudaSetDevice", rt->set_device, missing);
  resolve(lib, "cudaStreamCreateWithFlags", rt->stream_create_with_flags, missing);
  resolve(lib, "cudaStreamDestroy", rt->stream_destroy, missing);
  resolve(lib, "cudaStreamWaitEvent", rt->stream_wait_event, missing);
  resolve(lib, "cudaStreamSynchronize", rt->stream_synchronize, missing);
  resolve(lib, "cudaMemcpyAsync", rt->memcpy_async, missing);
  resolve(lib, "cudaEventCreateWithFlags", rt->event_create_with_flags, missing);
  resolve(lib, "cudaEventRecord", rt->event_record, missing);
  resolve(lib, "cudaEventSynchronize", rt->event_synchronize, missing);
  resolve(lib, "cudaEventDestroy", rt->event_destroy, missing);
  resolve(lib, "cudaHostRegister", rt->host_register, missing);
  resolve(lib, "cudaHostUnregister", rt->host_unregister, missing);
  resolve(lib, "cudaGetErrorString", rt->get_error_string, missing);
  if (!missing.empty()) return path + " lacks CUDA runtime entry points: " + missing;
  rt->path = path;
  // Never unloaded: streams, events and host registrations outlive any caller.
  g_rt.store(rt.release());
  return "";
}

}  // namespace

CudaRuntime* CudaRuntime::get() { return g_rt.load(); }

std::string CudaRuntime::load(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_rt.load() != nullptr) return "";
  if (!path.empty()) {
    void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = ::dlerror();
      return "cannot load the CUDA runtime " + path + ": " + (why ? why : "unknown error");
    }
    return try_library(lib, path);
  }
  // A runtime the process already loaded (torch's), found by soname without
  // loading anything new.
  static const char* kNames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                 "libcudart.so"};
  for (const char* name : kNames) {
    void* lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib != nullptr) return try_library(lib, name);
  }
  return "no CUDA runtime library is loaded in this process";
}

std::string CudaRuntime::describe(const char* what, Err code) const {
  const char* s = get_error_string ? get_error_string(code) : nullptr;
  return std::string(what) + " failed: " + (s ? s : "unknown CUDA error") + " (cudaError " +
         std::to_string(code) + ")";
}

}  // namespace dcpds
