// Table storage dtypes: float32, bfloat16 and float16 rows. Arithmetic is
// float32 everywhere; a 16-bit value is widened exactly when read and
// narrowed by stochastic rounding when an update writes it.
//
// Stochastic rounding of a float32 x to a 16-bit format picks one of the
// two representable neighbours of x, the upper one with probability
// (x - lower) / (upper - lower) (in magnitude), so that the rounded value's
// expectation is x. The random bits come from RoundingBits(seed, row, col):
// a hash of the update's seed (the optimizer step), the element's row in
// the whole stacked table and its column, so that a run is reproducible and
// the pure-JAX reference (pz_sparsecore.device.kernels.reference) gives the
// same bits. bfloat16: 16 random bits added to the float32 bits below the
// bfloat16 mantissa, then truncated. float16: 13 random bits likewise in the
// normal range; below it (units of 2^-24) the fraction of a unit is compared
// with 24 random bits. NaN stays NaN (quiet), +-inf stays; a value that
// rounds past the largest finite one becomes inf.
#ifndef PZSC_CSRC_TABLE_DTYPE_H_
#define PZSC_CSRC_TABLE_DTYPE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "optimizers.h"  // PZSC_HOST_DEVICE, FloatBits, Select

namespace pzsc {

enum class TableDtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

PZSC_HOST_DEVICE float BF16ToF32(uint16_t h) {
  return BitsFloat(static_cast<uint32_t>(h) << 16);
}

// The exponent rebiased, twice for inf and NaN; zero and subnormals (m
// units of 2^-24) from integers. Branch-free.
PZSC_HOST_DEVICE float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const uint32_t normal =
      (em << 13) + (112u << 23) + (MaskIf(em >= 0x7c00u) & (112u << 23));
  // (Signed conversions: unsigned ones branch on x86 without AVX-512.)
  const uint32_t small = FloatBits(
      static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-08f);
  return BitsFloat(Select(MaskIf(em < 0x400u), small, normal) | sign);
}

// The storage type of a table dtype's elements.
template <TableDtype kDtype>
using Stored = std::conditional_t<kDtype == TableDtype::kF32, float, uint16_t>;

// One stored element widened to float32 (exact).
template <TableDtype kDtype>
PZSC_HOST_DEVICE float Widen(Stored<kDtype> x) {
  if constexpr (kDtype == TableDtype::kF32) {
    return x;
  } else if constexpr (kDtype == TableDtype::kBF16) {
    return BF16ToF32(x);
  } else {
    return F16ToF32(x);
  }
}

// murmur3's 32-bit finaliser.
PZSC_HOST_DEVICE uint32_t Mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// RoundingBits' parts of a row and of a column (loops hoist them).
PZSC_HOST_DEVICE uint32_t RowMix(int64_t row) {
  return Mix32(static_cast<uint32_t>(row) ^
               Mix32(static_cast<uint32_t>(row >> 32) + 0x9e3779b9u));
}

PZSC_HOST_DEVICE uint32_t ColumnMix(int64_t col) {
  return Mix32(static_cast<uint32_t>(col) + 0x632be59bu);
}

// The random bits of element (row, col) for an update seeded with `seed`.
PZSC_HOST_DEVICE uint32_t RoundingBits(uint32_t seed, int64_t row,
                                       int64_t col) {
  return Mix32(seed ^ RowMix(row) ^ ColumnMix(col));
}

PZSC_HOST_DEVICE uint16_t F32ToBF16Stochastic(float x, uint32_t bits) {
  uint32_t b = FloatBits(x);
  if ((b & 0x7f800000u) == 0x7f800000u) {  // inf, NaN (kept quiet)
    return static_cast<uint16_t>((b >> 16) | ((b & 0x7fffffu) ? 0x40u : 0u));
  }
  b += bits >> 16;  // May carry into the exponent: rounded up.
  return static_cast<uint16_t>(b >> 16);
}

// Every case is formed, one kept (branch-free).
PZSC_HOST_DEVICE uint16_t F32ToF16Stochastic(float x, uint32_t bits) {
  const uint32_t b = FloatBits(x);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7fffffffu;
  // inf, NaN (kept quiet).
  const uint32_t special =
      0x7c00u | (static_cast<uint32_t>(a > 0x7f800000u) << 9);
  // |x| >= 2^-14, the normal range: 13 random bits added below float16's
  // last mantissa bit, then truncated; past the largest finite: inf.
  const uint32_t up = (a + (bits & 0x1fffu)) & ~0x1fffu;
  const uint32_t normal =
      Select(MaskIf(up >= 0x47800000u), 0x7c00u, (up - 0x38000000u) >> 13);
  // Below: units of 2^-24 (|x| * 2^24 < 1024 is exact, and so is its
  // fraction), rounded up if the fraction exceeds 24 random bits; 1024 is
  // the least normal.
  const float scaled =
      BitsFloat(Select(MaskIf(a < 0x38800000u), a, 0x38800000u)) *
      16777216.0f;
  const int32_t whole = static_cast<int32_t>(scaled);  // floor: >= 0
  const float u = static_cast<float>(static_cast<int32_t>(bits >> 8)) *
                  5.9604644775390625e-08f;
  const uint32_t small =
      static_cast<uint32_t>(whole) +
      static_cast<uint32_t>((scaled - static_cast<float>(whole)) > u);
  const uint32_t out =
      Select(MaskIf(a >= 0x7f800000u), special,
             Select(MaskIf(a >= 0x38800000u), normal, small));
  return static_cast<uint16_t>(sign | out);
}

}  // namespace pzsc

#endif  // PZSC_CSRC_TABLE_DTYPE_H_
