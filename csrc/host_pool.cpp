#include "host_pool.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "posix_file.hpp"

namespace dcpds {

HostPool::HostPool(uint64_t capacity, uint64_t slot_bytes) : slot_bytes_(slot_bytes) {
  if (slot_bytes == 0 || slot_bytes % kAlign != 0)
    throw std::invalid_argument("window_bytes must be a positive multiple of 4096, got " +
                                std::to_string(slot_bytes));
  uint64_t n = capacity / slot_bytes;
  if (n < 2)
    throw std::invalid_argument("host pool of " + std::to_string(capacity) +
                                " bytes holds fewer than two windows of " +
                                std::to_string(slot_bytes) + " bytes");
  if (n > 1u << 20) throw std::invalid_argument("host pool has too many windows");
  nslots_ = static_cast<uint32_t>(n);
  map_bytes_ = n * slot_bytes;
  void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    throw std::runtime_error("cannot map a host pool of " + std::to_string(map_bytes_) +
                             " bytes: " + std::strerror(err));
  }
  base_ = static_cast<uint8_t*>(p);
  // Transparent huge pages cut TLB misses on the copy path; advisory only.
  (void)::madvise(base_, map_bytes_, MADV_HUGEPAGE);
  free_.reserve(nslots_);
  for (uint32_t i = nslots_; i-- > 0;) free_.push_back(i);
}

HostPool::~HostPool() {
  if (base_) ::munmap(base_, map_bytes_);
}

void HostPool::release(uint8_t* slot) {
  uint64_t off = static_cast<uint64_t>(slot - base_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(static_cast<uint32_t>(off / slot_bytes_));
  }
  cv_.notify_one();
}

void HostPool::wake_all() {
  { std::lock_guard<std::mutex> lk(mu_); }
  cv_.notify_all();
}

uint32_t HostPool::free_slots() {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<uint32_t>(free_.size());
}

}  // namespace dcpds
