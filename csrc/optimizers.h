// Per-row optimizer updates of the fused backward (equations: research notes
// section 4.3; the pure-JAX twin is pz_sparsecore/kernels/reference.py).
//
// Each Apply updates one table row `w` and its slot rows in place from the
// summed row gradient `g`; all rows have `dim` float32 elements and never
// alias each other.
#ifndef PZSC_CSRC_OPTIMIZERS_H_
#define PZSC_CSRC_OPTIMIZERS_H_

#include <cmath>
#include <cstdint>

namespace pzsc {

enum class Optimizer : int {
  kSgd = 0,
  kAdagrad = 1,
  kAdagradMomentum = 2,
  kAdam = 3,
  kFtrl = 4,
};

inline constexpr int kMaxSlots = 2;
inline constexpr int kMaxHyperparameters = 6;

inline constexpr int NumSlots(Optimizer opt) {
  switch (opt) {
    case Optimizer::kSgd:
      return 0;
    case Optimizer::kAdagrad:
      return 1;
    default:
      return 2;
  }
}

inline constexpr int NumHyperparameters(Optimizer opt) {
  switch (opt) {
    case Optimizer::kSgd:
    case Optimizer::kAdagrad:
      return 1;
    case Optimizer::kAdagradMomentum:
      return 6;
    case Optimizer::kAdam:
      return 4;
    case Optimizer::kFtrl:
      return 5;
  }
  return 0;
}

// Hyper-parameters in the upstream order (see NumHyperparameters).
struct Hyperparameters {
  float v[kMaxHyperparameters];
  bool multiply_linear_by_learning_rate;
};

// w <- w - lr * g.
inline void ApplySgd(const Hyperparameters& h, float* __restrict w,
                     const float* __restrict g, int64_t dim) {
  const float lr = h.v[0];
  for (int64_t i = 0; i < dim; ++i) w[i] -= lr * g[i];
}

// a <- a + g^2; w <- w - lr * g / sqrt(a).
inline void ApplyAdagrad(const Hyperparameters& h, float* __restrict w,
                         float* __restrict a, const float* __restrict g,
                         int64_t dim) {
  const float lr = h.v[0];
  for (int64_t i = 0; i < dim; ++i) {
    const float acc = a[i] + g[i] * g[i];
    a[i] = acc;
    w[i] -= lr * g[i] / std::sqrt(acc);
  }
}

// a <- a + g^2 (beta2 == 1) or beta2 a + (1 - beta2) g^2;
// gh = (a + eps)^(-1/exponent) g; m <- momentum m + gh;
// w <- w - lr (nesterov ? momentum m + gh : m).
inline void ApplyAdagradMomentum(const Hyperparameters& h, float* __restrict w,
                                 float* __restrict a, float* __restrict m,
                                 const float* __restrict g, int64_t dim) {
  const float lr = h.v[0], momentum = h.v[1], beta2 = h.v[2];
  const float eps = h.v[3], exponent = h.v[4];
  const bool nesterov = h.v[5] != 0.0f;
  const float neg_inv_exp = -1.0f / exponent;
  for (int64_t i = 0; i < dim; ++i) {
    const float gi = g[i];
    const float acc =
        beta2 == 1.0f ? a[i] + gi * gi : beta2 * a[i] + (1.0f - beta2) * gi * gi;
    a[i] = acc;
    const float scaled = std::pow(acc + eps, neg_inv_exp) * gi;
    const float mom = momentum * m[i] + scaled;
    m[i] = mom;
    w[i] -= lr * (nesterov ? momentum * mom + scaled : mom);
  }
}

// m <- m + (1 - b1)(g - m); v <- v + (1 - b2)(g^2 - v);
// w <- w - alpha_t m / (sqrt(v) + eps_hat)   (hyper-parameters bias-corrected).
inline void ApplyAdam(const Hyperparameters& h, float* __restrict w,
                      float* __restrict m, float* __restrict v,
                      const float* __restrict g, int64_t dim) {
  const float alpha = h.v[0], b1 = h.v[1], b2 = h.v[2], eps = h.v[3];
  for (int64_t i = 0; i < dim; ++i) {
    const float gi = g[i];
    const float mi = m[i] + (1.0f - b1) * (gi - m[i]);
    const float vi = v[i] + (1.0f - b2) * (gi * gi - v[i]);
    m[i] = mi;
    v[i] = vi;
    w[i] -= alpha * mi / (std::sqrt(vi) + eps);
  }
}

// FTRL with k = lr_power: a' = a + g^2; dp = a'^-k - a^-k;
// l <- l + g - (dp / lr) w   (mlr: l + lr g - dp w);
// w <- (l1 == 0 ? -l : clip(l, -l1s, l1s) - l) / denominator, with
// l1s = l1 (mlr: lr l1) and denominator (a'^-k + beta) / lr + 2 l2
// (mlr: a'^-k + 2 lr l2 + beta); a <- a'.
inline void ApplyFtrl(const Hyperparameters& h, float* __restrict w,
                      float* __restrict a, float* __restrict l,
                      const float* __restrict g, int64_t dim) {
  const float lr = h.v[0], k = h.v[1], l1 = h.v[2], l2 = h.v[3];
  const float beta = h.v[4];
  const bool mlr = h.multiply_linear_by_learning_rate;
  const float l1s = mlr ? l1 * lr : l1;
  for (int64_t i = 0; i < dim; ++i) {
    const float gi = g[i];
    const float acc_new = a[i] + gi * gi;
    const float p_new = std::pow(acc_new, -k);
    const float dp = p_new - std::pow(a[i], -k);
    const float lin =
        mlr ? l[i] + lr * gi - dp * w[i] : l[i] + gi - (dp / lr) * w[i];
    const float num =
        l1 == 0.0f ? -lin : std::fmin(std::fmax(lin, -l1s), l1s) - lin;
    const float den =
        mlr ? p_new + 2.0f * lr * l2 + beta : (p_new + beta) / lr + 2.0f * l2;
    l[i] = lin;
    a[i] = acc_new;
    w[i] = num / den;
  }
}

}  // namespace pzsc

#endif  // PZSC_CSRC_OPTIMIZERS_H_
