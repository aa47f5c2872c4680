// Raw disk and memory bandwidth probes for the benchmarks.
//
// The benchmarks report our throughput as a ratio of what the same disk does
// for the simplest possible sequential I/O, measured in the same run with the
// same syscalls: one thread, large aligned blocks, one fsync at the end.
#pragma once

#include <cstdint>
#include <string>

namespace dcpds {

// Writes `total` bytes sequentially to a new file in `block`-byte writes from
// one aligned buffer, then fsyncs. Returns seconds including the fsync.
double probe_sequential_write(const std::string& path, uint64_t total, uint64_t block, bool direct);

// Reads the whole file sequentially in `block`-byte reads (buffered). Returns
// seconds; `*nbytes` receives the bytes read.
double probe_sequential_read(const std::string& path, uint64_t block, uint64_t* nbytes);

// Copies `total` bytes between two buffers mapped and touched beforehand (no
// page faults in the timed part), in `block`-byte memcpy calls on one thread,
// `reps` times. Returns the seconds of the fastest repetition: the limit any
// save that must move each byte once through this CPU's memory cannot beat.
double probe_memcpy(uint64_t total, uint64_t block, unsigned reps);

// Flushes the file's dirty pages and asks the kernel to drop it from the page
// cache, so the next read of it comes from the disk.
void drop_page_cache(const std::string& path);

}  // namespace dcpds
