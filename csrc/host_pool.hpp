// The bounded, reused host staging memory of the engine.
//
// One page-aligned region of `capacity` bytes is mapped and pre-faulted once,
// then carved into fixed slots of `slot_bytes` (one write window each).
// Copying into memory that is already mapped runs at memcpy speed; copying
// into fresh allocations pays a page fault per 4 KiB, which is what makes
// allocate-per-save staging slow. Slots are released in any order (windows
// finish out of order), and acquire() blocks while the pool is full: that
// is the back-pressure that bounds host memory whatever the state size.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace dcpds {

class HostPool {
 public:
  HostPool(uint64_t capacity, uint64_t slot_bytes);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Blocks until a slot is free or `cancelled()` returns true (then returns
  // nullptr). Returns the slot's base address.
  template <typename Cancelled>
  uint8_t* acquire(Cancelled cancelled) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !free_.empty() || cancelled(); });
    if (free_.empty()) return nullptr;
    uint32_t idx = free_.back();
    free_.pop_back();
    return base_ + static_cast<uint64_t>(idx) * slot_bytes_;
  }
  void release(uint8_t* slot);
  // Wakes blocked acquire() calls so they can re-check their cancel condition.
  void wake_all();

  uint64_t capacity() const { return slot_bytes_ * nslots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint32_t slots() const { return nslots_; }
  uint32_t free_slots();
  uint8_t* base() const { return base_; }

 private:
  uint8_t* base_ = nullptr;
  uint64_t map_bytes_ = 0;
  uint64_t slot_bytes_;
  uint32_t nslots_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> free_;
};

}  // namespace dcpds
