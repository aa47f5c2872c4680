#include "crc32c.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#include <wmmintrin.h>
#define DCPDS_X86 1
#elif defined(__aarch64__)
#include <sys/auxv.h>
#if __has_include(<asm/hwcap.h>)
#include <asm/hwcap.h>
#endif
#define DCPDS_ARM64 1
#endif

namespace dcpds {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& tables() {
  static const Tables tb;
  return tb;
}

uint32_t crc_table(uint32_t crc, const uint8_t* p, size_t n) {
  const Tables& tb = tables();
  crc = ~crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;  // little-endian host assumed (x86-64, AArch64 Linux)
    crc = tb.t[7][w & 0xFF] ^ tb.t[6][(w >> 8) & 0xFF] ^ tb.t[5][(w >> 16) & 0xFF] ^
          tb.t[4][(w >> 24) & 0xFF] ^ tb.t[3][(w >> 32) & 0xFF] ^ tb.t[2][(w >> 40) & 0xFF] ^
          tb.t[1][(w >> 48) & 0xFF] ^ tb.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

// Appending `n` zero bytes to a message maps its CRC register linearly; these
// tables apply that map for one fixed `n` a byte of the register at a time.
// They let three independent CRC streams over consecutive blocks be combined:
// crc(A|B) = shift_|B|(crc(A)) ^ crc_from_zero(B).
struct Shift {
  uint32_t t[4][256];
  explicit Shift(size_t n) {
    // The operator as a 32x32 matrix over GF(2) (column k: the image of bit k),
    // for one zero bit, then squared up to n zero bytes (zlib's crc32_combine method).
    uint32_t op[32], sq[32], tmp[32];
    auto times = [](const uint32_t* m, uint32_t v) {
      uint32_t r = 0;
      for (int k = 0; v; ++k, v >>= 1)
        if (v & 1) r ^= m[k];
      return r;
    };
    auto square = [&](uint32_t* out, const uint32_t* m) {
      for (int k = 0; k < 32; ++k) out[k] = times(m, m[k]);
    };
    op[0] = kPoly;  // one zero bit: shift right, feed back the polynomial
    for (int k = 1; k < 32; ++k) op[k] = 1u << (k - 1);
    square(sq, op);   // 2 bits
    square(op, sq);   // 4 bits
    square(sq, op);   // 8 bits: one byte, in sq
    uint32_t acc[32];  // identity, then multiplied by sq^(2^i) for each set bit of n
    for (int k = 0; k < 32; ++k) acc[k] = 1u << k;
    for (size_t m = n; m; m >>= 1) {
      if (m & 1) {
        for (int k = 0; k < 32; ++k) tmp[k] = times(sq, acc[k]);
        std::memcpy(acc, tmp, sizeof acc);
      }
      square(tmp, sq);
      std::memcpy(sq, tmp, sizeof sq);
    }
    for (int b = 0; b < 4; ++b)
      for (uint32_t v = 0; v < 256; ++v) t[b][v] = times(acc, v << (8 * b));
  }
  uint32_t apply(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
  }
};

#if defined(DCPDS_X86)
// crc32q has a latency of three cycles and a throughput of one per cycle: a
// single chain runs at a third of what the unit can do (about 8 GB/s). Three
// chains over three consecutive blocks, combined with Shift, run at nearly
// the full rate, which matters where the checksum, not the storage, is the
// limit (tmpfs, fast NVMe arrays).
constexpr size_t kLane = 8192;   // bytes per chain for long inputs
constexpr size_t kShortLane = 256;  // for the rest of at least 3 * kShortLane bytes

__attribute__((target("sse4.2"))) inline uint64_t chain(uint64_t c, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    c = _mm_crc32_u64(c, w);
  }
  return c;
}

__attribute__((target("sse4.2"))) uint64_t three_lanes(uint64_t c, const uint8_t*& p, size_t& n,
                                                       size_t lane, const Shift& shift) {
  while (n >= 3 * lane) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < lane; i += 8) {
      uint64_t a, b, d;
      std::memcpy(&a, p + i, 8);
      std::memcpy(&b, p + lane + i, 8);
      std::memcpy(&d, p + 2 * lane + i, 8);
      c = _mm_crc32_u64(c, a);
      c1 = _mm_crc32_u64(c1, b);
      c2 = _mm_crc32_u64(c2, d);
    }
    c = shift.apply(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1);
    c = shift.apply(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c2);
    p += 3 * lane;
    n -= 3 * lane;
  }
  return c;
}

__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t n) {
  static const Shift long_shift(kLane);
  static const Shift short_shift(kShortLane);
  uint64_t c = ~crc;
  c = three_lanes(c, p, n, kLane, long_shift);
  c = three_lanes(c, p, n, kShortLane, short_shift);
  const size_t whole = n & ~size_t{7};
  c = chain(c, p, whole);
  p += whole;
  n -= whole;
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

// Folding with carry-less multiplication (PCLMULQDQ): four 16-byte
// accumulators, each multiplied forward by x^512 (mod P) and XORed with the
// next 64 bytes, then folded into one by x^128, whose 16 bytes are finished
// with crc32q. It runs on another unit than crc32q: faster than the three
// crc32q chains on some CPUs, half as fast on others (docs/benchmarks.md), so
// pick() times both. The constants are
// x^(D+32) and x^(D-32) mod P for a fold over D bits, bit-reflected and
// shifted left by one (the reflected product carries one factor x too many);
// tests/test_engine.py checks the kernel against the byte-wise CRC.
__attribute__((target("sse4.2,pclmul"))) inline __m128i fold16(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

__attribute__((target("sse4.2,pclmul"))) uint32_t crc_fold(uint32_t crc, const uint8_t* p, size_t n) {
  uint32_t c = ~crc;
  if (n >= 128) {
    auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
    // The register enters as the first four message bytes XORed with it.
    __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
    __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
    p += 64;
    n -= 64;
    const __m128i by512 = _mm_set_epi64x(0x9e4addf8LL, 0x740eef02LL);
    while (n >= 64) {
      x0 = _mm_xor_si128(fold16(x0, by512), load(p));
      x1 = _mm_xor_si128(fold16(x1, by512), load(p + 16));
      x2 = _mm_xor_si128(fold16(x2, by512), load(p + 32));
      x3 = _mm_xor_si128(fold16(x3, by512), load(p + 48));
      p += 64;
      n -= 64;
    }
    const __m128i by128 = _mm_set_epi64x(0x14cd00bd6LL, 0xf20c0dfeLL);
    __m128i x = _mm_xor_si128(fold16(x0, by128), x1);
    x = _mm_xor_si128(fold16(x, by128), x2);
    x = _mm_xor_si128(fold16(x, by128), x3);
    for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold16(x, by128), load(p));
    // x has the message's residue at its last 16 bytes: their CRC from a zero register.
    uint64_t r = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
    r = _mm_crc32_u64(r, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
    c = static_cast<uint32_t>(r);
  }
  const size_t whole = n & ~size_t{7};
  c = static_cast<uint32_t>(chain(c, p, whole));
  p += whole;
  n -= whole;
  while (n--) c = _mm_crc32_u8(c, *p++);
  return ~c;
}
bool hw_available() { return __builtin_cpu_supports("sse4.2"); }
bool fold_available() { return hw_available() && __builtin_cpu_supports("pclmul"); }
#elif defined(DCPDS_ARM64) && defined(HWCAP_CRC32)
__attribute__((target("+crc"))) uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t n) {
  uint32_t c = ~crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = __builtin_aarch64_crc32cx(c, w);
    p += 8;
    n -= 8;
  }
  while (n--) c = __builtin_aarch64_crc32cb(c, *p++);
  return ~c;
}
bool hw_available() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
const char* hw_name() { return "armv8-crc"; }
#else
uint32_t crc_hw(uint32_t crc, const uint8_t* p, size_t n) { return crc_table(crc, p, n); }
bool hw_available() { return false; }
const char* hw_name() { return "table"; }
#endif

using CrcFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);

struct Kernel {
  CrcFn fn;
  const char* name;
};

#if defined(DCPDS_X86)
// Best of a few timed passes over a buffer in cache (about a millisecond in all).
double best_seconds(CrcFn fn, const uint8_t* buf, size_t n) {
  double best = 1e9;
  volatile uint32_t sink = 0;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    uint32_t c = 0;
    for (int pass = 0; pass < 4; ++pass) c = fn(c, buf, n);
    sink = sink ^ c;
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// Which of the two hardware kernels is faster differs by CPU: the folding one
// runs on the carry-less multiplier, whose throughput some cores halve (then the
// three crc32q chains are twice as fast). Both give the same CRC, so the faster
// one, timed here once per process, is the engine's.
Kernel pick() {
  if (!hw_available()) return {&crc_table, "table"};
  if (!fold_available()) return {&crc_hw, "sse4.2"};
  std::vector<uint8_t> buf(64 << 10);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + 7);
  (void)crc_hw(0, buf.data(), buf.size());  // warm both up: caches, frequency
  (void)crc_fold(0, buf.data(), buf.size());
  const double chains = best_seconds(&crc_hw, buf.data(), buf.size());
  const double fold = best_seconds(&crc_fold, buf.data(), buf.size());
  return fold < chains ? Kernel{&crc_fold, "sse4.2+pclmul"} : Kernel{&crc_hw, "sse4.2"};
}
#else
Kernel pick() { return hw_available() ? Kernel{&crc_hw, hw_name()} : Kernel{&crc_table, "table"}; }
#endif

const Kernel& picked() {
  static const Kernel k = pick();
  return k;
}

// Polynomials over GF(2) modulo the Castagnoli polynomial, in the reflected bit order of the
// CRC (bit 31 is x^0). The CRC of A|B is crc(A) times x^(8 len(B)), plus crc(B): the standard
// CRC's pre- and post-inversions cancel in that sum.
uint32_t mul_mod_poly(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {  // a's terms, x^0 first
    if (a & bit) product ^= b;
    b = (b >> 1) ^ (kPoly & (0u - (b & 1u)));  // b times x
  }
  return product;
}

// x^(2^k) modulo the polynomial, for k = 0 .. 63.
const uint32_t* x_to_two_to_the() {
  static const auto table = [] {
    std::vector<uint32_t> t(64);
    t[0] = 1u << 30;  // x^1
    for (size_t k = 1; k < t.size(); ++k) t[k] = mul_mod_poly(t[k - 1], t[k - 1]);
    return t;
  }();
  return table.data();
}

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // x^(8 len_b) = the product of x^(2^k) over the bits k of 8 len_b (len_b < 2^61).
  const uint32_t* pow2 = x_to_two_to_the();
  uint32_t shift = 1u << 31;  // x^0
  uint64_t bits = len_b;
  for (size_t k = 3; bits != 0 && k < 64; ++k, bits >>= 1)
    if (bits & 1u) shift = mul_mod_poly(pow2[k], shift);
  return mul_mod_poly(shift, crc_a) ^ crc_b;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t len) {
  static const CrcFn fn = picked().fn;
  return fn(crc, static_cast<const uint8_t*>(data), len);
}

const char* crc32c_backend() { return picked().name; }

std::vector<std::string> crc32c_kernels() {
  std::vector<std::string> out{"table"};
#if defined(DCPDS_X86)
  if (hw_available()) out.push_back("sse4.2");
  if (fold_available()) out.push_back("sse4.2+pclmul");
#else
  if (hw_available()) out.push_back(hw_name());
#endif
  return out;
}

uint32_t crc32c_with(const std::string& kernel, uint32_t crc, const void* data, size_t len) {
  const auto* p = static_cast<const uint8_t*>(data);
  if (kernel == "table") return crc_table(crc, p, len);
#if defined(DCPDS_X86)
  if (kernel == "sse4.2" && hw_available()) return crc_hw(crc, p, len);
  if (kernel == "sse4.2+pclmul" && fold_available()) return crc_fold(crc, p, len);
#else
  if (hw_available() && kernel == hw_name()) return crc_hw(crc, p, len);
#endif
  throw std::invalid_argument("CRC-32C kernel '" + kernel + "' is not available on this CPU");
}

}  // namespace dcpds
