// CRC32C (Castagnoli) checksums for the write and read paths.
//
// The engine checksums every byte region while it is hot in cache, so the
// implementation picks the fastest variant the CPU offers at run time
// (SSE4.2 on x86-64, the CRC extension on AArch64) and falls back to a
// portable slicing-by-8 table otherwise. The result is the standard
// CRC-32C value (e.g. crc32c("123456789") == 0xE3069283).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dcpds {

// Extends `crc` (0 for a fresh checksum) with `len` bytes at `data`.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t len);

// The CRC-32C of A followed by B, from crc(A) = `crc_a`, crc(B) = `crc_b` and B's length:
// blocks checksummed apart (read in parallel) are joined without reading them again.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Name of the implementation chosen at run time ("sse4.2+pclmul", "sse4.2",
// "armv8-crc", "table": on x86 with both hardware kernels, the faster one on
// this CPU, timed once); reported by the Python module for diagnostics.
const char* crc32c_backend();

// Every implementation this CPU can run, by name ("table" always; "sse4.2",
// "sse4.2+pclmul", "armv8-crc"), and one of them run by name: so that tests
// check each against the others, not only the one picked here.
std::vector<std::string> crc32c_kernels();
uint32_t crc32c_with(const std::string& kernel, uint32_t crc, const void* data, size_t len);

}  // namespace dcpds
