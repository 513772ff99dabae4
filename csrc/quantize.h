// Quantized lookups: the forward reads each table value clipped to
// [min_value, max_value] and rounded (half to even) to the nearest of
// num_buckets evenly spaced levels min_value + k * step, step = (max_value -
// min_value) / (num_buckets - 1), in float32 (the rule of
// pz_sparsecore.device.kernels.reference.quantize; a fused multiply-add may make
// the last bit differ). num_buckets == 0: not quantized.
#ifndef PZSC_CSRC_QUANTIZE_H_
#define PZSC_CSRC_QUANTIZE_H_

#include <math.h>

#include <cstdint>

#include "optimizers.h"  // PZSC_HOST_DEVICE
#include "xla/ffi/api/ffi.h"

namespace pzsc {

// The forward handlers' dictionary attribute "quantization".
struct Quantization {
  float min_value;
  float max_value;
  int64_t num_buckets;
};

PZSC_HOST_DEVICE float Quantize(const Quantization& q, float x) {
  const float step =
      (q.max_value - q.min_value) / static_cast<float>(q.num_buckets - 1);
  // NaN stays NaN (as jnp.clip): a diverged table shows through the lookup.
  const float clipped = NanMin(NanMax(x, q.min_value), q.max_value);
  return q.min_value + rintf((clipped - q.min_value) / step) * step;
}

// An error unless q is off (num_buckets 0) or has >= 2 buckets and finite
// min_value < max_value (the Python side checks the same first).
inline xla::ffi::Error CheckQuantization(const Quantization& q) {
  if (q.num_buckets == 0) return xla::ffi::Error::Success();
  if (q.num_buckets < 2 || !(q.min_value < q.max_value) ||
      !isfinite(q.min_value) || !isfinite(q.max_value)) {
    return xla::ffi::Error::InvalidArgument(
        "quantization needs num_buckets >= 2 and finite min_value < "
        "max_value");
  }
  return xla::ffi::Error::Success();
}

}  // namespace pzsc

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    pzsc::Quantization, xla::ffi::StructMember<float>("min_value"),
    xla::ffi::StructMember<float>("max_value"),
    xla::ffi::StructMember<int64_t>("num_buckets"));

#endif  // PZSC_CSRC_QUANTIZE_H_
