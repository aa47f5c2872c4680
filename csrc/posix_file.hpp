// Thin RAII wrappers over the POSIX calls the engine uses.
//
// Every call is checked; failures throw IoError naming the file and offset.
// Short writes and reads are retried until complete, EINTR is retried, and a
// read that hits end-of-file early is reported as truncation.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "io_error.hpp"

namespace dcpds {

// How a data file is opened for writing: O_DIRECT when the filesystem accepts
// it (kAuto falls back to buffered I/O where it does not), always O_DIRECT
// (kDirect, an error where unsupported) or always buffered (kBuffered).
enum class DirectMode { kAuto = 0, kDirect = 1, kBuffered = 2 };

constexpr uint64_t kAlign = 4096;  // O_DIRECT alignment for buffers, offsets and lengths

inline uint64_t align_up(uint64_t v, uint64_t a = kAlign) { return (v + a - 1) / a * a; }
inline uint64_t align_down(uint64_t v, uint64_t a = kAlign) { return v / a * a; }

class Fd {
 public:
  Fd() = default;
  Fd(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept;
  ~Fd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

  // Opens `path` with `flags`; throws IoError on failure.
  static Fd open(const std::string& path, int flags, int mode = 0644);
  // Like open() but returns an invalid Fd with errno preserved instead of throwing.
  static Fd try_open(const std::string& path, int flags, int mode, int* err);

  void pwrite_all(const void* buf, uint64_t len, uint64_t offset) const;
  // Writes the buffers of `iov` one after the other from `offset` (pwritev,
  // at most IOV_MAX at a time), retrying short writes like pwrite_all().
  void pwritev_all(const std::vector<iovec>& iov, uint64_t offset) const;
  // Returns the number of bytes read; fewer than `len` only at end-of-file.
  uint64_t pread_some(void* buf, uint64_t len, uint64_t offset) const;
  void fsync() const;
  uint64_t size() const;
  void close();  // checked close; the destructor closes silently

 private:
  int fd_ = -1;
  std::string path_;
};

// fsync() on a directory so that file creations and renames in it are durable.
void fsync_directory(const std::string& dir);

}  // namespace dcpds
