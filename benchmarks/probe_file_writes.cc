// The raw limit of buffered file writes from several threads, without the engine.
//
//   g++ -O2 -msse4.2 -pthread -o /tmp/probe_file_writes benchmarks/probe_file_writes.cc
//   /tmp/probe_file_writes DIR THREADS FILES CRC WINDOW_KIB [FALLOCATE]
//
// THREADS threads write 1 GiB of prefaulted memory (each its share, in
// WINDOW_KIB pwrite calls) into FILES files in DIR (1: all into one file, at
// their own offsets; THREADS: one file each), then fsync; with CRC=1 each
// thread first computes a CRC-32C (one crc32q chain) of every window, as the
// engine checksums before it writes; with FALLOCATE=1 each file is reserved
// with fallocate(FALLOC_FL_KEEP_SIZE) first. Three repetitions, GB/s each.
// It is measuring equipment for docs/benchmarks.md (issue 15: why a rank is
// striped over one file per I/O thread), not part of the package.
#include <fcntl.h>
#include <nmmintrin.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

std::atomic<uint32_t> sink{0};  // keeps the checksums from being optimized away

uint32_t crc32c(const char* p, size_t n) {
  uint64_t c = ~0u;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    c = _mm_crc32_u64(c, v);
  }
  return ~static_cast<uint32_t>(c);
}

void fail(const char* what) {
  std::perror(what);
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s DIR THREADS FILES(1|THREADS) CRC(0|1) WINDOW_KIB [FALLOCATE(0|1)]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int threads = std::atoi(argv[2]);
  const int files = std::atoi(argv[3]);
  const bool crc = std::atoi(argv[4]) != 0;
  const size_t window = static_cast<size_t>(std::atoi(argv[5])) << 10;
  const bool reserve = argc > 6 && std::atoi(argv[6]) != 0;
  if (threads < 1 || (files != 1 && files != threads) || window == 0) {
    std::fprintf(stderr, "THREADS >= 1, FILES 1 or THREADS, WINDOW_KIB > 0\n");
    return 2;
  }
  const size_t total = size_t{1} << 30, per = total / threads;
  char* src = static_cast<char*>(std::aligned_alloc(4096, total));
  if (src == nullptr) fail("aligned_alloc");
  for (size_t i = 0; i < total; ++i) src[i] = static_cast<char>(i * 131 + 7);
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::string> paths;
    std::vector<int> fds;
    for (int f = 0; f < files; ++f) {
      paths.push_back(dir + "/probe_file_writes_" + std::to_string(f));
      int fd = ::open(paths.back().c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
      if (fd < 0) fail("open");
      fds.push_back(fd);
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const int fd = fds[files == 1 ? 0 : t];
        const size_t base = per * t, file_base = files == 1 ? base : 0;
        if (reserve && (files > 1 || t == 0) &&
            ::fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(files == 1 ? total : per)) < 0)
          fail("fallocate");
        for (size_t done = 0; done < per; done += window) {
          const size_t n = std::min(window, per - done);
          if (crc) sink += crc32c(src + base + done, n);
          if (::pwrite(fd, src + base + done, n, static_cast<off_t>(file_base + done)) != static_cast<ssize_t>(n))
            fail("pwrite");
        }
        if (::fsync(fd) < 0) fail("fsync");
      });
    }
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("threads=%d files=%d crc=%d window=%zu KiB fallocate=%d: %.2f GB/s\n", threads, files, crc ? 1 : 0,
                window >> 10, reserve ? 1 : 0, total / s / 1e9);
    for (size_t f = 0; f < fds.size(); ++f) {
      ::close(fds[f]);
      ::unlink(paths[f].c_str());
    }
  }
  std::free(src);
  return 0;
}
