#include "disk_probe.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "posix_file.hpp"

namespace dcpds {
namespace {

struct Mapping {
  void* p;
  size_t n;
  explicit Mapping(size_t bytes) : n(bytes) {
    p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
               -1, 0);
    if (p == MAP_FAILED) throw IoError(errno, "<memory>", -1, "cannot map a probe buffer");
  }
  ~Mapping() { ::munmap(p, n); }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double probe_sequential_write(const std::string& path, uint64_t total, uint64_t block, bool direct) {
  block = align_up(block);
  Mapping buf(block);
  std::memset(buf.p, 0x5A, block);
  auto t0 = std::chrono::steady_clock::now();
  Fd fd = Fd::open(path, O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0));
  for (uint64_t off = 0; off < total; off += block) fd.pwrite_all(buf.p, block, off);
  fd.fsync();
  fd.close();
  return seconds_since(t0);
}

double probe_sequential_read(const std::string& path, uint64_t block, uint64_t* nbytes) {
  Mapping buf(align_up(block));
  auto t0 = std::chrono::steady_clock::now();
  Fd fd = Fd::open(path, O_RDONLY);
  uint64_t off = 0;
  for (;;) {
    uint64_t got = fd.pread_some(buf.p, block, off);
    off += got;
    if (got < block) break;
  }
  fd.close();
  *nbytes = off;
  return seconds_since(t0);
}

void drop_page_cache(const std::string& path) {
  Fd fd = Fd::open(path, O_RDONLY);
  if (::fdatasync(fd.get()) < 0) {
    int err = errno;
    // fdatasync on a read-only descriptor is allowed on Linux; report anything else.
    if (err != EBADF && err != EINVAL)
      throw IoError(err, path, -1, describe_errno("fdatasync", err, -1, 0));
  }
  int rc = ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  if (rc != 0) throw IoError(rc, path, -1, describe_errno("posix_fadvise", rc, -1, 0));
  fd.close();
}

double probe_memcpy(uint64_t total, uint64_t block, unsigned reps) {
  if (block == 0) throw std::invalid_argument("probe_memcpy: block must be positive");
  Mapping src(total), dst(total);  // MAP_POPULATE: faulted in before the clock starts
  std::memset(src.p, 0x5a, total);
  std::memset(dst.p, 0, total);
  double best = 0;
  for (unsigned r = 0; r < std::max(reps, 1u); ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (uint64_t off = 0; off < total; off += block)
      std::memcpy(static_cast<char*>(dst.p) + off, static_cast<const char*>(src.p) + off,
                  std::min(block, total - off));
    const double s = seconds_since(t0);
    if (r == 0 || s < best) best = s;
  }
  return best;
}

}  // namespace dcpds
