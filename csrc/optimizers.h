// Per-row optimizer updates of the fused backward: one rule per optimizer of
// the list (optimizer_list.h), with the equations of upstream's primitives
// (sparse_dense_matmul_grad_with_<name>.py, or FBGEMM's for row-wise
// Adagrad); the pure-JAX twins are the registry's row updates
// (pz_sparsecore/core/optimizers.py).
//
// An element rule updates one table element `w` and its slot elements in
// place from the summed row gradient `g`; the CPU handlers run it over a row
// (ApplyRow), the CUDA handlers over a warp's elements. A row rule first
// reduces a term of every element over the row, updates the row's slot
// values once from that sum, then updates each element from the result
// (ApplyRowRules on CPU; the CUDA handlers reduce across the warp). Table
// rows and Table slot rows have `dim` float32 elements, Row slot rows one;
// no two of them alias.
#ifndef PZSC_CSRC_OPTIMIZERS_H_
#define PZSC_CSRC_OPTIMIZERS_H_

#include <math.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "optimizer_list.h"

// Host and device code (the CUDA handlers, sparse_dense_matmul_cuda.cu) share
// everything here.
#ifdef __CUDACC__
#define PZSC_HOST_DEVICE __host__ __device__ __forceinline__
#else
// Inlined into its callers always: the CPU row loops are cloned per ISA
// (target_clones), and a helper left outlined is compiled for the baseline
// ISA only (or, called from a clone, may be dropped with its prefetches).
#define PZSC_HOST_DEVICE __attribute__((always_inline)) inline
#endif

namespace pzsc {

// Optimizer::k<Name>, in the list's order.
enum class Optimizer : int {
#define PZSC_ENUMERATOR(Name, name, num_slots, num_hyperparameters, rule, \
                        shape0, shape1)                                   \
  k##Name,
  PZSC_OPTIMIZERS(PZSC_ENUMERATOR)
#undef PZSC_ENUMERATOR
};

// The list's `rule` column: how an optimizer's update is written.
enum class Rule : int { kElement, kRow };

// The list's shape columns: a slot operand's shape. kTable: the table's,
// [..., V, D]; kRow: [..., V, 1], one value per table row; kNone: no such
// slot.
enum class SlotShape : int { kTable, kRow, kNone };

#define PZSC_SLOTS_OF(Name, name, num_slots, num_hyperparameters, rule, \
                      shape0, shape1)                                   \
  num_slots,
#define PZSC_HYPERPARAMETERS_OF(Name, name, num_slots, num_hyperparameters, \
                                rule, shape0, shape1)                       \
  num_hyperparameters,
inline constexpr int kMaxSlots = std::max({PZSC_OPTIMIZERS(PZSC_SLOTS_OF)});
inline constexpr int kMaxHyperparameters =
    std::max({PZSC_OPTIMIZERS(PZSC_HYPERPARAMETERS_OF)});
#undef PZSC_SLOTS_OF
#undef PZSC_HYPERPARAMETERS_OF
static_assert(kMaxSlots <= PZSC_SLOT_ARGS_MAX,
              "PZSC_SLOT_ARGS passes at most PZSC_SLOT_ARGS_MAX slots");

PZSC_HOST_DEVICE uint32_t FloatBits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof(b));
  return b;
}

PZSC_HOST_DEVICE float BitsFloat(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof(x));
  return x;
}

// All ones where `c`, else zero: selects by masks, so that loops over rows
// vectorise (a select of values computed by float operations would stay a
// branch under -ftrapping-math).
PZSC_HOST_DEVICE uint32_t MaskIf(bool c) { return 0u - static_cast<uint32_t>(c); }

PZSC_HOST_DEVICE uint32_t Select(uint32_t mask, uint32_t yes, uint32_t no) {
  return (yes & mask) | (no & ~mask);
}

// c ? yes : no, both computed, chosen by masks (see MaskIf).
PZSC_HOST_DEVICE float SelectFloat(bool c, float yes, float no) {
  return BitsFloat(Select(MaskIf(c), FloatBits(yes), FloatBits(no)));
}

// max(x, y) and min(x, y) as jnp.maximum and jnp.minimum: NaN if either is
// NaN (fmaxf and fminf return the other operand).
PZSC_HOST_DEVICE float NanMax(float x, float y) {
  return x != x ? x : (y != y ? y : fmaxf(x, y));
}
PZSC_HOST_DEVICE float NanMin(float x, float y) {
  return x != x ? x : (y != y ? y : fminf(x, y));
}

PZSC_HOST_DEVICE constexpr int NumSlots(Optimizer opt) {
  switch (opt) {
#define PZSC_NUM_SLOTS_CASE(Name, name, num_slots, num_hyperparameters, rule, \
                            shape0, shape1)                                   \
  case Optimizer::k##Name:                                                    \
    return num_slots;
    PZSC_OPTIMIZERS(PZSC_NUM_SLOTS_CASE)
#undef PZSC_NUM_SLOTS_CASE
  }
  return kMaxSlots;  // Not an optimizer: the most any has.
}

PZSC_HOST_DEVICE constexpr int NumHyperparameters(Optimizer opt) {
  switch (opt) {
#define PZSC_NUM_HYPERPARAMETERS_CASE(Name, name, num_slots,              \
                                      num_hyperparameters, rule, shape0, \
                                      shape1)                            \
  case Optimizer::k##Name:                                               \
    return num_hyperparameters;
    PZSC_OPTIMIZERS(PZSC_NUM_HYPERPARAMETERS_CASE)
#undef PZSC_NUM_HYPERPARAMETERS_CASE
  }
  return 0;
}

// Whether the optimizer's update is a row rule (the list's `rule` is Row).
PZSC_HOST_DEVICE constexpr bool IsRowRule(Optimizer opt) {
  switch (opt) {
#define PZSC_IS_ROW_RULE_CASE(Name, name, num_slots, num_hyperparameters, \
                              rule, shape0, shape1)                       \
  case Optimizer::k##Name:                                                \
    return Rule::k##rule == Rule::kRow;
    PZSC_OPTIMIZERS(PZSC_IS_ROW_RULE_CASE)
#undef PZSC_IS_ROW_RULE_CASE
  }
  return false;
}

// The shape of slot `s` of the optimizer (kNone past its slots).
PZSC_HOST_DEVICE constexpr SlotShape SlotShapeOf(Optimizer opt, int s) {
  switch (opt) {
#define PZSC_SLOT_SHAPE_CASE(Name, name, num_slots, num_hyperparameters, \
                             rule, shape0, shape1)                       \
  case Optimizer::k##Name:                                               \
    return s == 0   ? SlotShape::k##shape0                               \
           : s == 1 ? SlotShape::k##shape1                               \
                    : SlotShape::kNone;
    PZSC_OPTIMIZERS(PZSC_SLOT_SHAPE_CASE)
#undef PZSC_SLOT_SHAPE_CASE
  }
  return SlotShape::kNone;
}

// The last dimension of slot `s`'s operand for a table of width `dim`: `dim`
// for a Table slot, 1 for a Row slot (0 for none). A slot's row r starts at
// element r * SlotWidth(opt, s, dim).
PZSC_HOST_DEVICE constexpr int64_t SlotWidth(Optimizer opt, int s,
                                             int64_t dim) {
  switch (SlotShapeOf(opt, s)) {
    case SlotShape::kTable:
      return dim;
    case SlotShape::kRow:
      return 1;
    case SlotShape::kNone:
      return 0;
  }
  return 0;
}

// The list's columns agree: the first num_slots shapes are slots, the rest
// None; an Element rule's slots are all Table (each element's slot elements
// sit at the element's offset) and a Row rule's all Row (its Row part takes
// the slot values, its Element part none). Mixed rules (e.g. Table momentum
// with a Row second moment) need a wider protocol and dispatch.
PZSC_HOST_DEVICE constexpr bool ListColumnsAgree(Optimizer opt) {
  for (int s = 0; s < PZSC_SLOT_ARGS_MAX; ++s) {
    const SlotShape shape = SlotShapeOf(opt, s);
    if ((s < NumSlots(opt)) != (shape != SlotShape::kNone)) return false;
    if (s < NumSlots(opt) &&
        shape != (IsRowRule(opt) ? SlotShape::kRow : SlotShape::kTable)) {
      return false;
    }
  }
  return true;
}
#define PZSC_CHECK_COLUMNS(Name, name, num_slots, num_hyperparameters, rule, \
                           shape0, shape1)                                   \
  static_assert(ListColumnsAgree(Optimizer::k##Name),                        \
                "optimizer_list.h: " #Name                                   \
                "'s slot count, rule and slot shapes disagree");
PZSC_OPTIMIZERS(PZSC_CHECK_COLUMNS)
#undef PZSC_CHECK_COLUMNS

// Hyper-parameters in the upstream order (see NumHyperparameters).
struct Hyperparameters {
  float v[kMaxHyperparameters];
  bool multiply_linear_by_learning_rate;
};

// The element rules, one element at a time: <Name>Element for every Element
// optimizer of the list. `w` is the table element, `a`/`m`/`v`/`l` its slot
// elements (in the registry's slot order), `g` the summed row gradient. The
// row rules follow them.

// w <- w - lr * g.
PZSC_HOST_DEVICE void SgdElement(const Hyperparameters& h, float& w, float g) {
  w -= h.v[0] * g;
}

// a <- a + g^2; w <- w - lr * g / sqrt(a), where a component with a == 0
// (initial accumulator 0, gradient always 0) is left as it is (the update's
// limit; upstream would write 0 / 0 = NaN).
PZSC_HOST_DEVICE void AdagradElement(const Hyperparameters& h, float& w,
                                     float& a, float g) {
  const float acc = a + g * g;
  a = acc;
  // Computed for every element, kept by a mask (SelectFloat): a division
  // under a condition stays a branch, and the row's loop scalar.
  const bool positive = acc > 0.0f;
  const float step = h.v[0] * g / sqrtf(SelectFloat(positive, acc, 1.0f));
  w = SelectFloat(positive, w - step, w);
}

// a <- a + g^2 (beta2 == 1) or beta2 a + (1 - beta2) g^2;
// gh = (a + eps)^(-1/exponent) g; m <- momentum m + gh;
// w <- w - lr (nesterov ? momentum m + gh : m).
PZSC_HOST_DEVICE void AdagradMomentumElement(const Hyperparameters& h,
                                             float& w, float& a, float& m,
                                             float g) {
  const float lr = h.v[0], momentum = h.v[1], beta2 = h.v[2];
  const float eps = h.v[3], exponent = h.v[4];
  const bool nesterov = h.v[5] != 0.0f;
  const float acc =
      beta2 == 1.0f ? a + g * g : beta2 * a + (1.0f - beta2) * g * g;
  a = acc;
  const float scaled = powf(acc + eps, -1.0f / exponent) * g;
  const float mom = momentum * m + scaled;
  m = mom;
  w -= lr * (nesterov ? momentum * mom + scaled : mom);
}

// m <- m + (1 - b1)(g - m); v <- v + (1 - b2)(g^2 - v);
// w <- w - alpha_t m / (sqrt(v) + eps_hat)   (hyper-parameters bias-corrected).
PZSC_HOST_DEVICE void AdamElement(const Hyperparameters& h, float& w, float& m,
                                  float& v, float g) {
  const float alpha = h.v[0], b1 = h.v[1], b2 = h.v[2], eps = h.v[3];
  const float mi = m + (1.0f - b1) * (g - m);
  const float vi = v + (1.0f - b2) * (g * g - v);
  m = mi;
  v = vi;
  w -= alpha * mi / (sqrtf(vi) + eps);
}

// FTRL with k = lr_power: a' = a + g^2; dp = a'^-k - a^-k;
// l <- l + g - (dp / lr) w   (mlr: l + lr g - dp w);
// w <- (l1 == 0 ? -l : clip(l, -l1s, l1s) - l) / denominator, with
// l1s = l1 (mlr: lr l1) and denominator (a'^-k + beta) / lr + 2 l2
// (mlr: a'^-k + 2 lr l2 + beta); a <- a'.
PZSC_HOST_DEVICE void FtrlElement(const Hyperparameters& h, float& w, float& a,
                                  float& l, float g) {
  const float lr = h.v[0], k = h.v[1], l1 = h.v[2], l2 = h.v[3];
  const float beta = h.v[4];
  const bool mlr = h.multiply_linear_by_learning_rate;
  const float l1s = mlr ? l1 * lr : l1;
  const float acc_new = a + g * g;
  const float p_new = powf(acc_new, -k);
  const float dp = p_new - powf(a, -k);
  const float lin = mlr ? l + lr * g - dp * w : l + g - (dp / lr) * w;
  const float num = l1 == 0.0f ? -lin : NanMin(NanMax(lin, -l1s), l1s) - lin;
  const float den =
      mlr ? p_new + 2.0f * lr * l2 + beta : (p_new + beta) / lr + 2.0f * l2;
  l = lin;
  a = acc_new;
  w = num / den;
}

// LaProp, with decay = the step-corrected b2 (the spec's get_decay_rate):
// nu <- decay nu + (1 - decay)(g^2 + eps);
// mu <- b1 mu + sqrt(1 - b1^2) g / sqrt(nu); w <- w - lr mu.
PZSC_HOST_DEVICE void LaPropElement(const Hyperparameters& h, float& w,
                                    float& mu, float& nu, float g) {
  const float lr = h.v[0], b1 = h.v[1], decay = h.v[2], eps = h.v[3];
  const float nu_new = decay * nu + (1.0f - decay) * (g * g + eps);
  const float mu_new = b1 * mu + sqrtf(1.0f - b1 * b1) * (g / sqrtf(nu_new));
  nu = nu_new;
  mu = mu_new;
  w -= lr * mu_new;
}

// sign(x) as jnp.sign: -1, 0 or 1, and NaN for NaN (and -0 for -0).
PZSC_HOST_DEVICE float SignOf(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
}

// F2A (frequency-aware Adagrad) at global step t: n <- n + 1;
// f = min((max(t, 1) / n)^rho, max_lr_multiplier); a <- a + g^2;
// w <- w - lr (f g / sqrt(a) + l1 sign(w) + l2 w).
PZSC_HOST_DEVICE void F2AElement(const Hyperparameters& h, float& w, float& a,
                                 float& n, float g) {
  const float lr = h.v[0], rho = h.v[1], l1 = h.v[2], l2 = h.v[3];
  const float max_multiplier = h.v[4], step = h.v[5];
  const float local_step = n + 1.0f;
  const float ratio = NanMax(step, 1.0f) / local_step;
  const float multiplier = NanMin(powf(ratio, rho), max_multiplier);
  const float acc = a + g * g;
  const float update =
      multiplier * g / sqrtf(acc) + (l1 * SignOf(w) + l2 * w);
  n = local_step;
  a = acc;
  w -= lr * update;
}

// Row-wise Adagrad, FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator `a` per
// row. Hyper-parameters [lr, eps, embedding_dim, l2, decoupled]; over the
// row's summed gradient g[0, D):
//   sum = sum_{d < embedding_dim} (g[d] + l2 w[d])^2;
//   a <- a + sum / embedding_dim;
//   m = lr / (sqrt(a) + eps);  corr = 1 - m l2 - lr decoupled;
//   w[d] <- corr w[d] - m g[d]   (the raw g: l2 enters the sum only).
// embedding_dim is the table's own width: the operand's D may be larger by
// a stack's padding columns (no gradient; the initializer's values), which
// the sum leaves out, so the mean stays FBGEMM's over the table's D.
// Weight decay "none" passes l2 = decoupled = 0, "l2" only l2, "decoupled"
// only decoupled.
struct RowwiseAdagradRowState {
  float m;     // lr / (sqrt(a) + eps), the row's step size.
  float corr;  // The factor on w: 1 - m l2 - lr decoupled.
};

// One element's term of the row sum: (g + l2 w)^2 for column `col` (as a
// float: exact below 2^24 columns) below embedding_dim, 0 past it.
PZSC_HOST_DEVICE float RowwiseAdagradRowTerm(const Hyperparameters& h,
                                             float col, float w, float g) {
  // Computed for every column, chosen by a mask (as in AdagradElement).
  const float gd = g + h.v[3] * w;
  return SelectFloat(col >= h.v[2], 0.0f, gd * gd);
}

// a <- a + sum / embedding_dim, once per row; the row's m and corr.
PZSC_HOST_DEVICE RowwiseAdagradRowState
RowwiseAdagradRow(const Hyperparameters& h, float& a, float sum) {
  const float lr = h.v[0], eps = h.v[1], dim = h.v[2];
  const float l2 = h.v[3], decoupled = h.v[4];
  const float acc = a + sum / dim;
  a = acc;
  const float m = lr / (sqrtf(acc) + eps);
  return {m, 1.0f - m * l2 - lr * decoupled};
}

// w <- corr w - m g.
PZSC_HOST_DEVICE void RowwiseAdagradElement(const Hyperparameters&,
                                            const RowwiseAdagradRowState& st,
                                            float& w, float g) {
  w = st.corr * w - st.m * g;
}

#ifndef __CUDACC__
// The CPU handlers' row updates: ApplyRow<Name##Element>(h, w, slot rows...,
// g, dim) runs the element rule over `dim` elements (one overload per slot
// count).
template <void (*Element)(const Hyperparameters&, float&, float)>
PZSC_HOST_DEVICE void ApplyRow(const Hyperparameters& h, float* __restrict w,
                     const float* __restrict g, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) Element(h, w[i], g[i]);
}

template <void (*Element)(const Hyperparameters&, float&, float&, float)>
PZSC_HOST_DEVICE void ApplyRow(const Hyperparameters& h, float* __restrict w,
                     float* __restrict s0, const float* __restrict g,
                     int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) Element(h, w[i], s0[i], g[i]);
}

template <void (*Element)(const Hyperparameters&, float&, float&, float&,
                          float)>
PZSC_HOST_DEVICE void ApplyRow(const Hyperparameters& h, float* __restrict w,
                     float* __restrict s0, float* __restrict s1,
                     const float* __restrict g, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) Element(h, w[i], s0[i], s1[i], g[i]);
}

// A row rule's sum of its terms over one row: (float32) in kRowSumLanes
// partial sums, column c into partial c % kRowSumLanes, then the partials
// pairwise (a fixed order whatever the ISA: the loop vectorises, where one
// running sum made each row wait on `dim` dependent additions, ~250 cycles
// at dim 64).
inline constexpr int kRowSumLanes = 8;

template <float (*Term)(const Hyperparameters&, float, float, float)>
PZSC_HOST_DEVICE float RowRuleSum(const Hyperparameters& h,
                                  const float* __restrict w,
                                  const float* __restrict g, int64_t dim) {
  // The partials in one vector: left to the auto-vectoriser, the loop over
  // i was vectorised across iterations (transposes; row-wise step 1.5x
  // slower).
  typedef float Lanes __attribute__((vector_size(4 * kRowSumLanes)));
  Lanes part = {};
  // The lanes' columns, counted in float (converting each index cost a
  // vector insert per lane).
  Lanes col;
  for (int k = 0; k < kRowSumLanes; ++k) col[k] = static_cast<float>(k);
  int64_t i = 0;
  for (; i + kRowSumLanes <= dim; i += kRowSumLanes) {
    Lanes wv, gv, terms;
    memcpy(&wv, w + i, sizeof(wv));
    memcpy(&gv, g + i, sizeof(gv));
    for (int k = 0; k < kRowSumLanes; ++k) {
      terms[k] = Term(h, col[k], wv[k], gv[k]);
    }
    part += terms;
    col += static_cast<float>(kRowSumLanes);
  }
  for (int k = 0; i < dim; ++i, ++k) {
    part[k] += Term(h, static_cast<float>(i), w[i], g[i]);
  }
  for (int width = kRowSumLanes / 2; width > 0; width /= 2) {
    for (int k = 0; k < width; ++k) part[k] += part[k + width];
  }
  return part[0];
}

// The most rows ApplyRowRules updates at once.
inline constexpr int kRowRuleBlock = 8;

// A row rule's update of n <= kRowRuleBlock distinct rows:
// ApplyRowRules<Name##RowState, Name##RowTerm, Name##Row, Name##Element>(h,
// w, slot values..., g, n, dim) updates row k (table row w[k], slot values
// *s0[k], gradient g[k * dim, (k + 1) * dim)) by RowRuleSum, then Row once on
// its slot values, then Element over its `dim` elements. Each stage runs
// over all n rows before the next: a row's sum -> divide -> root -> divide
// chain then overlaps with the other rows' (one row at a time, each row
// waited on its own chain: row-wise Adagrad step of 4,096 x 32 ids, 1M-row
// table, 11.9-12.4 -> 10.7 ms; 8M rows 15.5-15.9 -> 14.6-15.3 ms). The
// results are the one-row rule's, bit for bit. One overload per slot count
// (a Row rule's slots are Row slots: one value each); add one for another
// count.
template <typename State,
          float (*Term)(const Hyperparameters&, float, float, float),
          State (*Row)(const Hyperparameters&, float&, float),
          void (*Element)(const Hyperparameters&, const State&, float&,
                          float)>
PZSC_HOST_DEVICE void ApplyRowRules(const Hyperparameters& h,
                                    float* const* w, float* const* s0,
                                    const float* __restrict g, int n,
                                    int64_t dim) {
  float sums[kRowRuleBlock];
  State states[kRowRuleBlock];
  for (int k = 0; k < n; ++k) {
    sums[k] = RowRuleSum<Term>(h, w[k], g + k * dim, dim);
  }
  for (int k = 0; k < n; ++k) states[k] = Row(h, *s0[k], sums[k]);
  for (int k = 0; k < n; ++k) {
    float* __restrict wk = w[k];
    const float* __restrict gk = g + k * dim;
    for (int64_t i = 0; i < dim; ++i) Element(h, states[k], wk[i], gk[i]);
  }
}
#endif  // __CUDACC__

}  // namespace pzsc

#endif  // PZSC_CSRC_OPTIMIZERS_H_
