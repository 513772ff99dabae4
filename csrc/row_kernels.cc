#include "row_kernels.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "optimizers.h"

// Each exported loop is cloned per ISA and dispatched at load time (ifunc).
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

inline void PrefetchRow(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(float)); b += 64) {
    __builtin_prefetch(p + b, 0, 3);
  }
}

inline void PrefetchRowToL2(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(float)); b += 64) {
    __builtin_prefetch(p + b, 0, 1);
  }
}

inline void PrefetchRowForWrite(const float* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(float)); b += 64) {
    __builtin_prefetch(p + b, 1, 3);
  }
}

inline void Axpy(float a, const float* __restrict x, float* __restrict y,
                 int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) y[i] += a * x[i];
}

// First position in [begin, end) whose id is >= value (ids sorted).
inline int64_t LowerBound(const int32_t* ids, int64_t begin, int64_t end,
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

// Fixed-width row sums of the forward: 16 floats per vector (one zmm on
// AVX-512, two ymm on AVX2), up to kMaxVecs vectors kept in registers.
typedef float Vec16 __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxVecs = 8;

// out[r, :] = sum over j in [starts[r - 1], starts[r]) of
// sorted[j].gain * table row, in j order, for r in [0, rows); dim is
// kVecs * kLanes. Same per-element arithmetic as Axpy into a zeroed row.
template <int kVecs>
__attribute__((always_inline)) inline void SumRows(
    const ForwardEntry* __restrict sorted, const int64_t* __restrict ends,
    int64_t rows, int64_t n, const float* __restrict table,
    float* __restrict out) {
  constexpr int64_t dim = kVecs * kLanes;
  int64_t j = 0;
  for (int64_t r = 0; r < rows; ++r) {
    Vec16 acc[kVecs];
    for (int v = 0; v < kVecs; ++v) acc[v] = Vec16{};
    for (const int64_t end = ends[r]; j < end; ++j) {
      PrefetchRowToL2(
          table +
              sorted[std::min(j + kForwardPrefetchDistance, n - 1)].table_offset,
          dim);
      const Vec16* x =
          reinterpret_cast<const Vec16*>(table + sorted[j].table_offset);
      const float g = sorted[j].gain;
      for (int v = 0; v < kVecs; ++v) acc[v] += g * x[v];
    }
    Vec16* o = reinterpret_cast<Vec16*>(out + r * dim);
    for (int v = 0; v < kVecs; ++v) o[v] = acc[v];
  }
}

}  // namespace

PZSC_MULTIVERSION
void ForwardOutputRange(const CooView& view, const std::vector<Slice>& slices,
                        const float* table, int64_t out_begin, int64_t out_end,
                        float* out, ForwardScratch* scratch) {
  const int64_t dim = view.dim;
  const int64_t spp = view.attrs.samples_per_segment;
  const int64_t rpp = view.attrs.rows_per_partition;
  const int64_t width = out_end - out_begin;
  int64_t total = 0;
  for (const Slice& s : slices) total += s.end - s.begin;
  scratch->entries.resize(total);
  ForwardEntry* __restrict entries = scratch->entries.data();
  const int32_t* __restrict ids = view.ids;
  const int32_t* __restrict sids = view.sample_ids;
  const float* __restrict gains = view.gains;
  // 1. Branch-free compaction: every entry is written, kept ones advance n.
  int64_t n = 0;
  for (const Slice& s : slices) {
    const int64_t base = s.segment * spp - out_begin;
    if (base >= width || base + spp <= 0) continue;
    const int64_t row_base = s.partition * rpp;
    for (int64_t j = s.begin; j < s.end; ++j) {
      const int32_t id = ids[j];
      const int32_t sid = sids[j];
      const int64_t r = base + sid;
      const bool keep = id != kPadId && static_cast<uint32_t>(id) < rpp &&
                        static_cast<uint32_t>(sid) < spp &&
                        static_cast<uint64_t>(r) < static_cast<uint64_t>(width);
      // Offsets of skipped entries are never formed (they could overflow).
      entries[n] = {keep ? (row_base + id) * dim : 0, gains[j],
                    static_cast<int32_t>(keep ? r : 0)};
      n += keep;
    }
  }
  // 2. Stable counting sort by output row: starts[r] .. starts[r + 1] are
  // row r's entries in `sorted`, in compaction (= buffer) order.
  scratch->starts.assign(width + 1, 0);
  int64_t* __restrict starts = scratch->starts.data();
  for (int64_t j = 0; j < n; ++j) ++starts[entries[j].out_row + 1];
  for (int64_t r = 0; r < width; ++r) starts[r + 1] += starts[r];
  scratch->sorted.resize(n);
  ForwardEntry* __restrict sorted = scratch->sorted.data();
  for (int64_t j = 0; j < n; ++j) {
    sorted[starts[entries[j].out_row]++] = entries[j];
  }
  // starts[r] is now row r's end; row r begins at starts[r - 1] (0 for r=0).
  // 3. Sum each output row in registers and store it once (empty rows: 0).
  float* out_rows = out + out_begin * dim;
  if (dim % kLanes == 0 && dim <= kMaxVecs * kLanes) {
    switch (dim / kLanes) {
#define PZSC_SUM_CASE(k) \
  case k:                \
    return SumRows<k>(sorted, starts, width, n, table, out_rows);
      PZSC_SUM_CASE(1)
      PZSC_SUM_CASE(2)
      PZSC_SUM_CASE(3)
      PZSC_SUM_CASE(4)
      PZSC_SUM_CASE(5)
      PZSC_SUM_CASE(6)
      PZSC_SUM_CASE(7)
      PZSC_SUM_CASE(8)
#undef PZSC_SUM_CASE
    }
  }
  int64_t j = 0;
  for (int64_t r = 0; r < width; ++r) {
    float* __restrict o = out_rows + r * dim;
    for (int64_t i = 0; i < dim; ++i) o[i] = 0.0f;
    for (const int64_t end = starts[r]; j < end; ++j) {
      PrefetchRowToL2(
          table +
              sorted[std::min(j + kForwardPrefetchDistance, n - 1)].table_offset,
          dim);
      Axpy(sorted[j].gain, table + sorted[j].table_offset, o, dim);
    }
  }
}

PZSC_MULTIVERSION
bool IdsSorted(const int32_t* ids, int64_t n) {
  // OR-ing the comparisons (no early exit, no carried count) vectorises.
  int32_t descents = 0;
  for (int64_t j = 1; j < n; ++j) descents |= ids[j] < ids[j - 1];
  return descents == 0;
}

PZSC_MULTIVERSION
void BackwardKeys(const BackwardPlan& plan, int64_t key_begin,
                  int64_t key_end) {
  const CooView& v = *plan.view;
  const int64_t rpp = v.attrs.rows_per_partition;
  const int64_t spp = v.attrs.samples_per_segment;
  const int64_t dim = v.dim;
  const float* __restrict grad = plan.activation_grad;
  const int num_slots = NumSlots(plan.optimizer);
  std::vector<float> acc_storage(dim);
  float* __restrict acc = acc_storage.data();
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
      for (int64_t i = 0; i < dim; ++i) acc[i] = 0.0f;
      for (Cursor& c : cursors) {
        // Locals, so that the stores into `acc` cannot alias them.
        const int32_t* __restrict ids = c.run->ids;
        const int32_t* __restrict sids = c.run->sample_ids;
        const float* __restrict gains = c.run->gains;
        const float* __restrict run_grad = grad + c.run->out_base * dim;
        const int64_t end = c.end;
        int64_t pos = c.pos;
        if (pos + kPrefetchDistance < end) {
          const int64_t ahead =
              (table_base + ids[pos + kPrefetchDistance]) * dim;
          PrefetchRowForWrite(plan.table + ahead, dim);
          for (int s = 0; s < num_slots; ++s) {
            PrefetchRowForWrite(plan.slots[s] + ahead, dim);
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
      const int64_t off = (table_base + row) * dim;
      float* __restrict w = plan.table + off;
      const Hyperparameters& h = plan.hyper;
      switch (plan.optimizer) {
        case Optimizer::kSgd:
          ApplySgd(h, w, acc, dim);
          break;
        case Optimizer::kAdagrad:
          ApplyAdagrad(h, w, plan.slots[0] + off, acc, dim);
          break;
        case Optimizer::kAdagradMomentum:
          ApplyAdagradMomentum(h, w, plan.slots[0] + off, plan.slots[1] + off,
                               acc, dim);
          break;
        case Optimizer::kAdam:
          ApplyAdam(h, w, plan.slots[0] + off, plan.slots[1] + off, acc, dim);
          break;
        case Optimizer::kFtrl:
          ApplyFtrl(h, w, plan.slots[0] + off, plan.slots[1] + off, acc, dim);
          break;
      }
      if (plan.clip) {
        const float lo = plan.clip_min, hi = plan.clip_max;
        for (int64_t i = 0; i < dim; ++i) {
          w[i] = std::min(std::max(w[i], lo), hi);
        }
      }
    }
  }
}

}  // namespace pzsc
