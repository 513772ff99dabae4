#include "row_kernels.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "optimizer_list.h"
#include "optimizers.h"

// Each exported loop is cloned per ISA and dispatched at load time (ifunc).
// What it calls must be inlined (always_inline): a function left outlined
// is compiled for the baseline ISA only.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(PZSC_NO_MULTIVERSIONING)
#define PZSC_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PZSC_MULTIVERSION
#endif

namespace pzsc {
namespace {

// How many entries ahead the table rows are prefetched. Forward gathers are
// flat from 12 to 32 here (AMD EPYC, 256-byte rows, 1M-8M rows); 8 and below
// lose 5-10%, no prefetch loses ~40%.
constexpr int64_t kPrefetchDistance = 16;

// The forward's row-sorted gather prefetches further ahead, into L2 only
// (prefetcht2; AMD EPYC, 256-byte rows): L1 prefetches at distance 16 keep
// too few misses in flight (the L1 miss buffers fill and stall the loop).
// 1M/8M-row uniform forward: -25-30% vs prefetcht0 at 16; flat from 48 to
// 96 entries (32: +10%, 16: +25%); t1 vs t2 and adding an L1 prefetch at 8
// are within noise.
constexpr int64_t kForwardPrefetchDistance = 48;

PZSC_HOST_DEVICE void PrefetchRow(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(float)); b += 64) {
    __builtin_prefetch(p + b, 0, 3);
  }
}

template <typename T>
PZSC_HOST_DEVICE void PrefetchRowToL2(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) {
    __builtin_prefetch(p + b, 0, 1);
  }
}

PZSC_HOST_DEVICE void PrefetchBytesForWrite(const void* data, int64_t bytes) {
  const char* p = static_cast<const char*>(data);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 1, 3);
}

PZSC_HOST_DEVICE void PrefetchRowForWrite(const float* row, int64_t dim) {
  PrefetchBytesForWrite(row, dim * static_cast<int64_t>(sizeof(float)));
}

// Widens stored row `src` (a 16-bit dtype) into dst[0, dim).
PZSC_HOST_DEVICE void WidenRow(TableDtype dtype, const uint16_t* __restrict src,
                     float* __restrict dst, int64_t dim) {
  if (dtype == TableDtype::kBF16) {
    for (int64_t i = 0; i < dim; ++i) dst[i] = BF16ToF32(src[i]);
  } else {
    for (int64_t i = 0; i < dim; ++i) dst[i] = F16ToF32(src[i]);
  }
}

// Narrows src[0, dim) into stored row `dst` of table row `row` (a 16-bit
// dtype) by stochastic rounding (table_dtype.h): RoundingBits(seed, row, i)
// with the columns' parts precomputed (column_mix[i] = ColumnMix(i)).
PZSC_HOST_DEVICE void NarrowRow(TableDtype dtype, const float* __restrict src,
                      uint16_t* __restrict dst, int64_t dim, uint32_t seed,
                      int64_t row, const uint32_t* __restrict column_mix) {
  const uint32_t row_seed = seed ^ RowMix(row);
  if (dtype == TableDtype::kBF16) {
    for (int64_t i = 0; i < dim; ++i) {
      dst[i] = F32ToBF16Stochastic(src[i], Mix32(row_seed ^ column_mix[i]));
    }
  } else {
    for (int64_t i = 0; i < dim; ++i) {
      dst[i] = F32ToF16Stochastic(src[i], Mix32(row_seed ^ column_mix[i]));
    }
  }
}

PZSC_HOST_DEVICE void Axpy(float a, const float* __restrict x, float* __restrict y,
                 int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) y[i] += a * x[i];
}

// First position in [begin, end) whose id is >= value (ids sorted).
PZSC_HOST_DEVICE int64_t LowerBound(const int32_t* ids, int64_t begin, int64_t end,
                          int64_t value) {
  while (begin < end) {
    const int64_t mid = begin + (end - begin) / 2;
    if (ids[mid] < value) {
      begin = mid + 1;
    } else {
      end = mid;
    }
  }
  return begin;
}

struct Cursor {
  const SortedRun* run;
  int64_t pos;
  int64_t end;
};

// Fixed-width row updates of the forward: 8 floats per vector (one ymm on
// AVX2 and AVX-512, two xmm on the baseline). 64-byte vectors compile to
// stack spills and shuffles on AVX2 (1M Zipf forward ~3x slower there).
typedef float Vec8 __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int64_t kLanes = 8;
constexpr int64_t kMaxVecs = 16;

typedef uint16_t U16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// acc += g * elements [8 v, 8 v + 8) of a stored row, widened (through a
// reference: a vector return value would change the ABI per ISA clone).
template <TableDtype kDtype>
PZSC_HOST_DEVICE void AxpyVec8(
    float g, const Stored<kDtype>* __restrict x, int v, Vec8& acc) {
  if constexpr (kDtype == TableDtype::kF32) {
    acc += g * reinterpret_cast<const Vec8*>(x)[v];
  } else if constexpr (kDtype == TableDtype::kBF16) {
    const U16x8 h = *reinterpret_cast<const U16x8*>(x + kLanes * v);
    acc += g * reinterpret_cast<Vec8>(__builtin_convertvector(h, U32x8) << 16);
  } else {
    Vec8 wide;  // F16ToF32 is branch-free: this loop vectorises.
    for (int i = 0; i < kLanes; ++i) wide[i] = F16ToF32(x[kLanes * v + i]);
    acc += g * wide;
  }
}

typedef uint16_t U16x16
    __attribute__((vector_size(32), aligned(2), may_alias));

// a += g * elements {0-3, 8-11} and b += g * elements {4-7, 12-15} of the
// 16 bfloat16 values at x, widened: interleaving zeros below each value
// within 128-bit halves (vpunpcklwd / vpunpckhwd) widens them in one
// instruction per 8. Each element's arithmetic is AxpyVec8's; the caller
// undoes the permutation once per output row.
PZSC_HOST_DEVICE void AxpyBF16Pair(float g, const uint16_t* __restrict x,
                                   Vec8& a, Vec8& b) {
  const U16x16 h = *reinterpret_cast<const U16x16*>(x);
  const U16x16 z = {};
  a += g * reinterpret_cast<Vec8>(__builtin_shufflevector(
               z, h, 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27));
  b += g * reinterpret_cast<Vec8>(__builtin_shufflevector(
               z, h, 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15,
               31));
}

// out[r, :] = sum over j in [order.Start(r), order.Start(r + 1)) of
// order.entries[j].gain * table row (widened to float32), in j order, for r
// in [row_begin, row_end), skipping (and counting) rows at or past
// order.row_limit; the dim is kVecs * kLanes when kVecs > 0, `dim`
// otherwise. Same per-element arithmetic as Axpy into a zeroed row.
template <int kVecs, TableDtype kDtype>
PZSC_HOST_DEVICE int64_t SumRows(const SampleMajor& order, int64_t row_begin,
                                 int64_t row_end,
                                 const Stored<kDtype>* __restrict table,
                                 float* __restrict out, int64_t dim) {
  if (kVecs > 0) dim = kVecs * kLanes;
  const ForwardEntry* __restrict sorted = order.entries;
  const int64_t last = order.num_entries - 1;
  const int64_t row_limit = order.row_limit;
  int64_t skipped = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* __restrict o = out + r * dim;
    Vec8 acc[kVecs > 0 ? kVecs : 1];
    if (kVecs > 0) {
      for (int v = 0; v < kVecs; ++v) acc[v] = Vec8{};
    } else {
      for (int64_t i = 0; i < dim; ++i) o[i] = 0.0f;
    }
    for (int64_t j = order.Start(r), end = order.Start(r + 1); j < end; ++j) {
      // A prefetch never faults: the row ahead is checked when it is read.
      PrefetchRowToL2(
          table + sorted[std::min(j + kForwardPrefetchDistance, last)].row *
                      dim,
          dim);
      if (sorted[j].row >= row_limit) {
        ++skipped;
        continue;
      }
      const float g = sorted[j].gain;
      const Stored<kDtype>* __restrict x = table + sorted[j].row * dim;
      if constexpr (kVecs > 0 && kDtype == TableDtype::kBF16) {
        // Pairs of vectors widen 16 values with two interleaves (the
        // values land permuted, see AxpyBF16Pair; undone at the store); an
        // odd last vector as AxpyVec8.
        for (int v = 0; v + 1 < kVecs; v += 2) {
          AxpyBF16Pair(g, x + kLanes * v, acc[v], acc[v + 1]);
        }
        if (kVecs % 2 == 1) {
          AxpyVec8<kDtype>(g, x, kVecs - 1, acc[kVecs - 1]);
        }
      } else if constexpr (kVecs > 0) {
        for (int v = 0; v < kVecs; ++v) AxpyVec8<kDtype>(g, x, v, acc[v]);
      } else if constexpr (kDtype == TableDtype::kF32) {
        Axpy(g, x, o, dim);
      } else {
        for (int64_t i = 0; i < dim; ++i) o[i] += g * Widen<kDtype>(x[i]);
      }
    }
    if constexpr (kVecs > 0 && kDtype == TableDtype::kBF16) {
      Vec8* ov = reinterpret_cast<Vec8*>(o);
      for (int v = 0; v + 1 < kVecs; v += 2) {
        ov[v] = __builtin_shufflevector(acc[v], acc[v + 1], 0, 1, 2, 3, 8, 9,
                                        10, 11);
        ov[v + 1] = __builtin_shufflevector(acc[v], acc[v + 1], 4, 5, 6, 7,
                                            12, 13, 14, 15);
      }
      if (kVecs % 2 == 1) ov[kVecs - 1] = acc[kVecs - 1];
    } else if (kVecs > 0) {
      Vec8* ov = reinterpret_cast<Vec8*>(o);
      for (int v = 0; v < kVecs; ++v) ov[v] = acc[v];
    }
  }
  return skipped;
}

// ForwardSumRows for one table dtype.
template <TableDtype kDtype>
PZSC_HOST_DEVICE int64_t SumRowsOf(const SampleMajor& order,
                                const void* table_data, int64_t dim,
                                int64_t row_begin, int64_t row_end,
                                float* out) {
  const auto* table = static_cast<const Stored<kDtype>*>(table_data);
  switch (dim % kLanes == 0 && dim <= kMaxVecs * kLanes ? dim / kLanes : 0) {
#define PZSC_SUM_CASE(k)                                                 \
  case k:                                                                \
    return SumRows<k, kDtype>(order, row_begin, row_end, table, out, dim);
    PZSC_SUM_CASE(1)
    PZSC_SUM_CASE(2)
    PZSC_SUM_CASE(3)
    PZSC_SUM_CASE(4)
    PZSC_SUM_CASE(5)
    PZSC_SUM_CASE(6)
    PZSC_SUM_CASE(7)
    PZSC_SUM_CASE(8)
    PZSC_SUM_CASE(9)
    PZSC_SUM_CASE(10)
    PZSC_SUM_CASE(11)
    PZSC_SUM_CASE(12)
    PZSC_SUM_CASE(13)
    PZSC_SUM_CASE(14)
    PZSC_SUM_CASE(15)
    PZSC_SUM_CASE(16)
#undef PZSC_SUM_CASE
    default:
      return SumRows<0, kDtype>(order, row_begin, row_end, table, out, dim);
  }
}

// ForwardSumQuantizedRows for one table dtype.
template <TableDtype kDtype>
PZSC_HOST_DEVICE int64_t SumQuantizedRowsOf(const SampleMajor& order,
                                            const void* table_data,
                                            int64_t dim, int64_t row_begin,
                                            int64_t row_end, float* out,
                                            const Quantization& q) {
  const auto* table = static_cast<const Stored<kDtype>*>(table_data);
  const ForwardEntry* sorted = order.entries;
  int64_t skipped = 0;
  for (int64_t r = row_begin; r < row_end; ++r) {
    float* __restrict o = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = 0.0f;
    for (int64_t j = order.Start(r), end = order.Start(r + 1); j < end; ++j) {
      if (sorted[j].row >= order.row_limit) {
        ++skipped;
        continue;
      }
      const float g = sorted[j].gain;
      const Stored<kDtype>* __restrict x = table + sorted[j].row * dim;
      for (int64_t i = 0; i < dim; ++i) {
        o[i] += g * Quantize(q, Widen<kDtype>(x[i]));
      }
    }
  }
  return skipped;
}

// Calls fn(j, out_row, table_row) for every valid entry j among entries
// [begin, end) of the slices concatenated in order, in that order.
template <typename Fn>
PZSC_HOST_DEVICE void ForEachValidEntry(const CooView& view,
                                        const std::vector<Slice>& slices,
                                        int64_t begin, int64_t end,
                                        const Fn& fn) {
  const int64_t spp = view.attrs.samples_per_segment;
  const int64_t rpp = view.attrs.rows_per_partition;
  const int32_t* __restrict ids = view.ids;
  const int32_t* __restrict sids = view.sample_ids;
  int64_t at = 0;  // Offset of slice s in the concatenation.
  for (const Slice& s : slices) {
    const int64_t lo = s.begin + std::max<int64_t>(begin - at, 0);
    const int64_t hi = s.begin + std::min<int64_t>(end - at, s.end - s.begin);
    at += s.end - s.begin;
    const int64_t out_base = s.segment * spp;
    const int64_t row_base = s.partition * rpp;
    for (int64_t j = lo; j < hi; ++j) {
      const int32_t id = ids[j];
      const int32_t sid = sids[j];
      // Padding sits at the end of each slice: the branch predicts well.
      if (id != kPadId && static_cast<uint32_t>(id) < rpp &&
          static_cast<uint32_t>(sid) < spp) {
        fn(j, out_base + sid, row_base + id);
      }
    }
  }
}

// Applies the optimizer to BackwardKeys' n <= kBlock summed rows: table
// key keys[k]'s summed gradient is acc[k * dim, (k + 1) * dim), the keys
// distinct; then clips them and (16-bit tables) stores them rounded, widened
// into widened[k * dim, (k + 1) * dim) meanwhile.
template <int kBlock>
PZSC_HOST_DEVICE void ApplyPending(const BackwardPlan& plan,
                                   const int64_t* keys, int n,
                                   const float* acc, float* widened,
                                   const uint32_t* column_mix) {
  const int64_t dim = plan.view->dim;
  const TableDtype dtype = plan.view->table_dtype;
  const bool wide = dtype == TableDtype::kF32;
  const int64_t row_bytes = dim * (wide ? 4 : 2);
  char* const table_bytes = static_cast<char*>(plan.table);
  uint16_t* stored[kBlock];
  float* w[kBlock];
  // Each slot's row at its own width (a Row slot's is one value).
  float* s0[kBlock];
  float* s1[kBlock];
  for (int k = 0; k < n; ++k) {
    const int64_t key = keys[k];
    stored[k] = reinterpret_cast<uint16_t*>(table_bytes + key * row_bytes);
    w[k] = wide ? reinterpret_cast<float*>(stored[k]) : widened + k * dim;
    if (!wide) WidenRow(dtype, stored[k], w[k], dim);
    s0[k] = plan.slots[0] + key * plan.slot_width[0];
    s1[k] = plan.slots[1] + key * plan.slot_width[1];
  }
  const Hyperparameters& h = plan.hyper;
  // The list's `rule` picks the update: Element rules run per element
  // (ApplyRow), row by row; Row rules reduce each row first (ApplyRowRules,
  // all rows at once).
  switch (plan.optimizer) {
#define PZSC_APPLY_Element(Name, num_slots)                                  \
  for (int k = 0; k < n; ++k) {                                              \
    ApplyRow<Name##Element>(h, w[k], PZSC_SLOT_ARGS(num_slots, s0[k], s1[k]) \
                                acc + k * dim,                               \
                            dim);                                            \
  }
#define PZSC_APPLY_Row(Name, num_slots)                                   \
  ApplyRowRules<Name##RowState, Name##RowTerm, Name##Row, Name##Element>( \
      h, w, PZSC_SLOT_ARGS(num_slots, s0, s1) acc, n, dim)
#define PZSC_APPLY_CASE(Name, name, num_slots, num_hyperparameters, rule, \
                        shape0, shape1)                                   \
  case Optimizer::k##Name:                                                \
    PZSC_APPLY_##rule(Name, num_slots);                                   \
    break;
    PZSC_OPTIMIZERS(PZSC_APPLY_CASE)
#undef PZSC_APPLY_CASE
#undef PZSC_APPLY_Row
#undef PZSC_APPLY_Element
  }
  for (int k = 0; k < n; ++k) {
    float* __restrict wk = w[k];
    if (plan.clip) {
      const float lo = plan.clip_min, hi = plan.clip_max;
      for (int64_t i = 0; i < dim; ++i) {
        wk[i] = std::min(std::max(wk[i], lo), hi);
      }
    }
    if (!wide) {
      NarrowRow(dtype, wk, stored[k], dim, plan.rounding_seed,
                plan.row_base + keys[k], column_mix);
    }
  }
}

}  // namespace

int64_t ForwardOrder::Place(int64_t num_chunks, int64_t num_outputs) {
  starts.resize(num_outputs + 1);
  int64_t at = 0;
  for (int64_t r = 0; r < num_outputs; ++r) {
    starts[r] = at;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t n = counts[c * num_outputs + r];
      counts[c * num_outputs + r] = at;
      at += n;
    }
  }
  starts[num_outputs] = at;
  sorted.resize(at);
  return at;
}

PZSC_MULTIVERSION
void ForwardCountChunk(const CooView& view, const std::vector<Slice>& slices,
                       int64_t begin, int64_t end, int64_t* counts) {
  std::fill(counts, counts + view.num_outputs(), 0);
  ForEachValidEntry(view, slices, begin, end,
                    [&](int64_t, int64_t out_row, int64_t) {
                      ++counts[out_row];
                    });
}

PZSC_MULTIVERSION
void ForwardScatterChunk(const CooView& view, const std::vector<Slice>& slices,
                         int64_t begin, int64_t end, int64_t* positions,
                         ForwardEntry* sorted) {
  const float* __restrict gains = view.gains;
  ForEachValidEntry(view, slices, begin, end,
                    [&](int64_t j, int64_t out_row, int64_t row) {
                      sorted[positions[out_row]++] = {
                          static_cast<uint32_t>(row), gains[j]};
                    });
}

PZSC_MULTIVERSION
int64_t ForwardSumRows(const SampleMajor& order, const void* table,
                       TableDtype dtype, int64_t dim, int64_t row_begin,
                       int64_t row_end, float* out) {
  switch (dtype) {
    case TableDtype::kBF16:
      return SumRowsOf<TableDtype::kBF16>(order, table, dim, row_begin,
                                          row_end, out);
    case TableDtype::kF16:
      return SumRowsOf<TableDtype::kF16>(order, table, dim, row_begin,
                                         row_end, out);
    case TableDtype::kF32:
      break;
  }
  return SumRowsOf<TableDtype::kF32>(order, table, dim, row_begin, row_end,
                                     out);
}

int64_t ForwardSumQuantizedRows(const SampleMajor& order, const void* table,
                                TableDtype dtype, int64_t dim,
                                int64_t row_begin, int64_t row_end, float* out,
                                const Quantization& q) {
  switch (dtype) {
    case TableDtype::kBF16:
      return SumQuantizedRowsOf<TableDtype::kBF16>(order, table, dim,
                                                   row_begin, row_end, out, q);
    case TableDtype::kF16:
      return SumQuantizedRowsOf<TableDtype::kF16>(order, table, dim, row_begin,
                                                  row_end, out, q);
    case TableDtype::kF32:
      break;
  }
  return SumQuantizedRowsOf<TableDtype::kF32>(order, table, dim, row_begin,
                                              row_end, out, q);
}

PZSC_MULTIVERSION
bool IdsSorted(const int32_t* ids, int64_t n) {
  // OR-ing the comparisons (no early exit, no carried count) vectorises.
  int32_t descents = 0;
  for (int64_t j = 1; j < n; ++j) descents |= ids[j] < ids[j - 1];
  return descents == 0;
}

namespace {

// BackwardKeys with kBlock summed rows waiting for their update
// (ApplyPending): a row rule's kRowRuleBlock rows (ApplyRowRules), an element
// rule's one (waiting made the SGD step ~5% slower).
template <int kBlock>
PZSC_HOST_DEVICE void UpdateKeys(const BackwardPlan& plan, int64_t key_begin,
                                 int64_t key_end) {
  const CooView& v = *plan.view;
  const int64_t rpp = v.attrs.rows_per_partition;
  const int64_t spp = v.attrs.samples_per_segment;
  const int64_t dim = v.dim;
  const float* __restrict grad = plan.activation_grad;
  const int num_slots = NumSlots(plan.optimizer);
  // The table's and slots' rows are used up to kBlock - 1 rows later than
  // the activation gradient's: prefetched further ahead.
  constexpr int64_t kTableAhead = kPrefetchDistance + kBlock - 1;
  int64_t pending_keys[kBlock];
  int pending = 0;
  std::vector<float> acc_storage(kBlock * dim);
  // A 16-bit table's row is updated in float32 there, then stored rounded.
  const bool wide = v.table_dtype == TableDtype::kF32;
  const int64_t row_bytes = dim * (wide ? 4 : 2);
  char* const table_bytes = static_cast<char*>(plan.table);
  std::vector<float> widened(wide ? 0 : kBlock * dim);
  std::vector<uint32_t> column_mix(wide ? 0 : dim);
  for (int64_t i = 0; i < static_cast<int64_t>(column_mix.size()); ++i) {
    column_mix[i] = ColumnMix(i);
  }
  std::vector<Cursor> cursors;
  if (key_begin >= key_end) return;
  const int64_t p_first = key_begin / rpp;
  const int64_t p_last = (key_end - 1) / rpp;
  const std::vector<SortedRun>& runs = *plan.runs;
  auto r = std::lower_bound(
      runs.begin(), runs.end(), p_first,
      [](const SortedRun& run, int64_t p) { return run.partition < p; });
  while (r != runs.end() && r->partition <= p_last) {
    const int64_t p = r->partition;
    const int64_t row_lo = std::max<int64_t>(key_begin - p * rpp, 0);
    const int64_t row_hi =
        std::min<int64_t>(std::min<int64_t>(key_end - p * rpp, rpp), kPadId);
    cursors.clear();
    for (; r != runs.end() && r->partition == p; ++r) {
      const int64_t lo = LowerBound(r->ids, 0, r->size, row_lo);
      const int64_t hi = LowerBound(r->ids, lo, r->size, row_hi);
      if (lo < hi) cursors.push_back({&*r, lo, hi});
    }
    const int64_t table_base = p * rpp;
    while (true) {
      int64_t row = std::numeric_limits<int64_t>::max();
      for (const Cursor& c : cursors) {
        if (c.pos < c.end) row = std::min<int64_t>(row, c.run->ids[c.pos]);
      }
      if (row == std::numeric_limits<int64_t>::max()) break;
      bool referenced = false;
      float* __restrict acc = acc_storage.data() + pending * dim;
      for (int64_t i = 0; i < dim; ++i) acc[i] = 0.0f;
      for (Cursor& c : cursors) {
        // Locals, so that the stores into `acc` cannot alias them.
        const int32_t* __restrict ids = c.run->ids;
        const int32_t* __restrict sids = c.run->sample_ids;
        const float* __restrict gains = c.run->gains;
        const float* __restrict run_grad = grad + c.run->out_base * dim;
        const int64_t end = c.end;
        int64_t pos = c.pos;
        if (pos + kTableAhead < end) {
          const int64_t ahead_row = table_base + ids[pos + kTableAhead];
          PrefetchBytesForWrite(table_bytes + ahead_row * row_bytes,
                                row_bytes);
          for (int s = 0; s < num_slots; ++s) {
            const int64_t width = plan.slot_width[s];
            PrefetchRowForWrite(plan.slots[s] + ahead_row * width, width);
          }
        }
        // The activation gradient's row that entry will add (the rows of a
        // batch, ~1 MiB, fall out of L2 between the table's misses).
        if (pos + kPrefetchDistance < end) {
          const int32_t ahead_sid = sids[pos + kPrefetchDistance];
          if (static_cast<uint32_t>(ahead_sid) < static_cast<uint64_t>(spp)) {
            PrefetchRow(run_grad + ahead_sid * dim, dim);
          }
        }
        for (; pos < end && ids[pos] == row; ++pos) {
          const int32_t sid = sids[pos];
          if (sid < 0 || sid >= spp) continue;
          referenced = true;
          Axpy(gains[pos], run_grad + sid * dim, acc, dim);
        }
        c.pos = pos;
      }
      if (!referenced) continue;
      pending_keys[pending++] = table_base + row;
      if (pending == kBlock) {
        ApplyPending<kBlock>(plan, pending_keys, pending, acc_storage.data(),
                             widened.data(), column_mix.data());
        pending = 0;
      }
    }
  }
  ApplyPending<kBlock>(plan, pending_keys, pending, acc_storage.data(),
                       widened.data(), column_mix.data());
}

}  // namespace

PZSC_MULTIVERSION
void BackwardKeys(const BackwardPlan& plan, int64_t key_begin,
                  int64_t key_end) {
  if (IsRowRule(plan.optimizer)) {
    UpdateKeys<kRowRuleBlock>(plan, key_begin, key_end);
  } else {
    UpdateKeys<1>(plan, key_begin, key_end);
  }
}

}  // namespace pzsc
