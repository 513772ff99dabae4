// CUDA handlers: the forward and the fused backward of every optimizer of
// optimizer_list.h (SparseDenseMatmulGrad<Name>Cuda), with the same
// operands, attributes and results as the CPU handlers
// (sparse_dense_matmul.cc, sparse_dense_matmul_grad.cc), registered for the
// platform "CUDA" (module.cc).
//
// Entries. Every handler works on the flat list of buffer positions
// j in [0, num_segments * seg_len). Position j of segment k = j / seg_len
// belongs to the partition p whose range [start(p), end(p)) holds
// o = j - k * seg_len (coo_layout.h); since the partition starts never
// decrease (checked first, below), p is the last partition with
// start(p) <= o, found by a binary search over the segment's row pointers.
// The entry is used when o < end(p), p lies in the table's window and the
// id and sample id are valid; it then names table row
// (p - partition_begin) * rows_per_partition + id, which is inside the
// table. Any buffer contents keep every access inside its buffer.
//
// Forward. Each warp takes tiles of 32 consecutive entries: every lane
// decodes one entry (its row, output row and gain: one binary search per
// entry), then groups of lanes (as many as a row has 4-float chunks, at most
// 32) walk the tile's entries, the decoded values broadcast by shuffles, and
// add gain * table row into the entry's output row with float atomics
// (16-byte vector atomics on sm_90), four entries' rows loaded before their
// adds. The summation order, and so the last bits of an output, is not
// deterministic.
//
// Backward. Deterministic, and no atomics on the table or slots: each valid
// position gets the key of its table row (invalid ones the key `rows`, past
// every row) and a packed entry (its output row and gain: all the update
// reads of it), a stable radix sort (CUB) orders the entries by key, and a
// run-length encoding gives each referenced row its run of entries, in
// segment order then buffer order, as the CPU handlers sum them. Each warp
// takes 32 runs at a time (their rows asked for in L2 at once); a run of at
// most kChunk entries is summed (gain * activation_grad, in that order, the
// warp loading 32 entries at a time) and the optimizer applied once
// (optimizers.h, the rules the CPU handlers use). Longer runs (hot rows) are
// cut into chunks of kChunk positions: one warp per chunk writes the
// chunk's sum to scratch, then one warp per run adds its chunks' sums in
// chunk order and applies the update, or, for a run of more than kBigChunks
// chunks, a block of 32 warps adds them (warp w the chunks w, w + 32, ...,
// then the warps' sums in warp order) and one warp applies it.
// The number of runs is known on the device only: these kernels are
// launched with a grid that fills the GPU once (kBlocksPerSm blocks per
// multiprocessor, fewer for small batches) and loop over the runs.
// Row rules (optimizer_list.h: an update that needs a sum over the whole
// row, e.g. row-wise Adagrad) run on the same warp: a first pass over the
// row's 128-column tiles (kWarpSize * kRegs) forms each lane's share of the
// row's terms in a fixed order, a butterfly of shuffles adds the shares (so
// every lane holds the same sum, bit for bit), lane 0 updates the row's slot
// values once and broadcasts the rule's row state, and a second pass applies
// the elements; a row wider than one tile has its tile sums formed again
// then, in the same order as in the first pass. The update stays
// deterministic. Slot rows have their own widths (a Row slot's row r is the
// one value at r).
// Tables may be stored as float32, bfloat16 or float16 (table_dtype.h): the
// forward widens the rows it reads; the update reads each element widened
// (LoadTable), applies the rule in float32, clips, and stores it back by
// stochastic rounding with the CPU handlers' random bits (StoreTable, the
// seed read from its device operand).
// Clipping follows the update, on the table only. Scratch (keys, positions,
// runs, chunk sums; O(entries x dim / kChunk + entries), independent of the
// table's size) comes from XLA's allocator.
//
// Errors. Row pointers whose partition starts decrease are an error, as on
// CPU, found without a host synchronisation: a one-block kernel checks them
// first and, on the first decrease (segment-major, as CollectSlices reports
// it), sets the call's skip flag (scratch: every later kernel of the call
// then does nothing, so the output is zero and the table and slots are
// unchanged) and records the error in the status word, pinned host memory
// mapped into the device (PzscTakeCudaStatus reads and clears it; the
// Python side raises it once the call's results are ready:
// pz_sparsecore.device.kernels.raise_device_errors). Every other check
// (shapes, attributes, sizes) happens on the host before any launch and is
// returned as an error. Every CUDA call's status is checked; a failure is
// returned as an error naming the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "coo_layout.h"
#include "optimizer_list.h"
#include "optimizers.h"
#include "quantize.h"
#include "xla/ffi/api/ffi.h"

namespace pzsc {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 256;
// Output elements each lane keeps in registers while it walks a run.
constexpr int kRegs = 4;
// Columns a warp holds in registers (kRegs per lane).
constexpr int64_t kTileWidth = kWarpSize * kRegs;
// Positions summed by one warp: runs longer than this are cut into chunks.
constexpr int32_t kChunk = 64;
// Upper bound on the blocks of one launch (the kernels loop over the rest).
constexpr int64_t kMaxBlocks = 1 << 20;
// Blocks per multiprocessor of a grid that fills the GPU once (8 blocks of
// 256 threads: 2048 threads, an sm_80/sm_90 multiprocessor's limit).
constexpr int kBlocksPerSm = 8;

struct DeviceLayout {
  const int32_t* row_pointers;
  const int32_t* ids;
  const int32_t* sample_ids;
  const float* gains;
  int64_t num_positions;  // num_segments * seg_len
  int64_t seg_len;
  int64_t rp_stride;
  int64_t num_partitions;
  int64_t samples_per_segment;
  int64_t rows_per_partition;
  int64_t partition_begin;
  int64_t num_table_partitions;
  int64_t dim;
};

DeviceLayout MakeDeviceLayout(const CooView& v) {
  return DeviceLayout{v.row_pointers,
                      v.ids,
                      v.sample_ids,
                      v.gains,
                      v.attrs.num_segments * v.seg_len,
                      v.seg_len,
                      v.rp_stride,
                      v.attrs.num_partitions,
                      v.attrs.samples_per_segment,
                      v.attrs.rows_per_partition,
                      v.attrs.partition_begin,
                      v.num_table_partitions,
                      v.dim};
}

__device__ __forceinline__ int64_t ClampToSegment(int32_t v, int64_t seg_len) {
  return v < 0 ? 0 : (v > seg_len ? seg_len : v);
}

// Start of partition p (coo_layout.h): 0, else r8(end(p - 1)).
__device__ __forceinline__ int64_t PartitionStart(const int32_t* rp, int64_t p,
                                                  int64_t seg_len) {
  if (p == 0) return 0;
  const int64_t prev = ClampToSegment(rp[p - 1], seg_len);
  return (prev + kPartitionAlignment - 1) / kPartitionAlignment *
         kPartitionAlignment;
}

// The segment of position j (positions are below 2^31: 32-bit division).
__device__ __forceinline__ int64_t Segment(const DeviceLayout& l, int64_t j) {
  return l.num_positions == l.seg_len
             ? 0
             : static_cast<uint32_t>(j) / static_cast<uint32_t>(l.seg_len);
}

// The table row of the entry at position j, or -1 if it is not used; sets
// *out_row to its output row (segment * samples_per_segment + sample).
__device__ int64_t EntryRow(const DeviceLayout& l, int64_t j,
                            int64_t* out_row) {
  const int32_t id = l.ids[j];
  const int32_t sid = l.sample_ids[j];
  if (id == kPadId || id < 0 || id >= l.rows_per_partition || sid < 0 ||
      sid >= l.samples_per_segment) {
    return -1;
  }
  const int64_t k = Segment(l, j);
  const int64_t o = j - k * l.seg_len;
  const int32_t* rp = l.row_pointers + k * l.rp_stride;
  int64_t lo = 0, hi = l.num_partitions - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (PartitionStart(rp, mid, l.seg_len) <= o) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (o >= ClampToSegment(rp[lo], l.seg_len)) return -1;
  const int64_t local = lo - l.partition_begin;
  if (local < 0 || local >= l.num_table_partitions) return -1;
  *out_row = k * l.samples_per_segment + sid;
  return local * l.rows_per_partition + id;
}

__device__ __forceinline__ void AtomicAdd4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

// Entries per warp tile: one decoded by each lane.
constexpr int kTile = kWarpSize;
// Entries whose rows a group loads before adding them.
constexpr int kForwardBatch = 4;

// The decoded entry at position j: its table row (-1 if unused), output row
// and gain.
struct Decoded {
  int64_t row;
  int64_t out_row;
  float gain;
};

__device__ __forceinline__ Decoded Decode(const DeviceLayout& l, int64_t j) {
  Decoded e{-1, 0, 0.0f};
  if (j < l.num_positions) {
    e.row = EntryRow(l, j, &e.out_row);
    if (e.row >= 0) e.gain = l.gains[j];
  }
  return e;
}

// Elements [0, 4) (kVec4: 16-byte aligned f32 or 8-byte aligned 16-bit
// rows) or [0, 1) of a table row at `src`, widened to float32 and read
// through the quantisation if any.
template <TableDtype kDtype>
__device__ __forceinline__ float4 LoadRow(const Stored<kDtype>* src,
                                          Quantization q, bool vec4) {
  float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (kDtype == TableDtype::kF32) {
    if (vec4) {
      x = __ldg(reinterpret_cast<const float4*>(src));
    } else {
      x.x = __ldg(src);
    }
  } else {
    if (vec4) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
      x = make_float4(Widen<kDtype>(static_cast<uint16_t>(v.x & 0xffffu)),
                      Widen<kDtype>(static_cast<uint16_t>(v.x >> 16)),
                      Widen<kDtype>(static_cast<uint16_t>(v.y & 0xffffu)),
                      Widen<kDtype>(static_cast<uint16_t>(v.y >> 16)));
    } else {
      x.x = Widen<kDtype>(__ldg(src));
    }
  }
  if (q.num_buckets > 0) {
    x = make_float4(Quantize(q, x.x), Quantize(q, x.y), Quantize(q, x.z),
                    Quantize(q, x.w));
  }
  return x;
}

// Warps take tiles of kTile consecutive positions (grid-stride). Lane i
// decodes position tile + i; the warp's 32 / 2^lane_shift groups of
// 2^lane_shift lanes then each walk a contiguous share of the tile, every
// lane adding kWidth columns (kVec4: dim % 4 == 0 and 16-byte aligned rows,
// 4 columns at a time) of each entry's gain * row into its output row.
template <bool kVec4, TableDtype kDtype>
__global__ void __launch_bounds__(kThreadsPerBlock, 4) PzscForwardKernel(DeviceLayout l, int lane_shift,
                                  const Stored<kDtype>* __restrict__ table,
                                  float* __restrict__ out, Quantization q,
                                  const int32_t* __restrict__ skip) {
  if (*skip) return;
  constexpr int kWidth = kVec4 ? 4 : 1;
  const int lane = threadIdx.x % kWarpSize;
  const int lanes = 1 << lane_shift;
  const int group = lane >> lane_shift;
  const int group_lane = lane & (lanes - 1);
  const int per_group = lanes;  // kTile / (kWarpSize / lanes)
  const int64_t warps =
      static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t tile = (static_cast<int64_t>(blockIdx.x) * blockDim.x +
                       threadIdx.x) / kWarpSize * kTile;
       tile < l.num_positions; tile += warps * kTile) {
    const Decoded mine = Decode(l, tile + lane);
    // Whole warp: skip tiles without a used entry (padding).
    if (__ballot_sync(0xffffffffu, mine.row >= 0) == 0) continue;
    const int first = group * per_group;
    for (int i = 0; i < per_group; i += kForwardBatch) {
      int64_t rows[kForwardBatch], outs[kForwardBatch];
      float gains[kForwardBatch];
#pragma unroll
      for (int b = 0; b < kForwardBatch; ++b) {
        // Every lane takes part in the shuffles (per_group is a multiple
        // of kForwardBatch for every lane_shift >= 2; smaller groups of a
        // non-vector row take i + b past the share only as a no-op).
        const int src = first + min(i + b, per_group - 1);
        rows[b] = __shfl_sync(0xffffffffu, mine.row, src);
        outs[b] = __shfl_sync(0xffffffffu, mine.out_row, src);
        gains[b] = __shfl_sync(0xffffffffu, mine.gain, src);
        if (i + b >= per_group) rows[b] = -1;
      }
      for (int64_t d = kWidth * group_lane; d < l.dim; d += kWidth * lanes) {
        float4 x[kForwardBatch];
#pragma unroll
        for (int b = 0; b < kForwardBatch; ++b) {
          x[b] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (rows[b] >= 0) {
            x[b] = LoadRow<kDtype>(table + rows[b] * l.dim + d, q, kVec4);
          }
        }
#pragma unroll
        for (int b = 0; b < kForwardBatch; ++b) {
          if (rows[b] < 0) continue;
          const float g = gains[b];
          float* dst = out + outs[b] * l.dim + d;
          if constexpr (kVec4) {
            AtomicAdd4(dst, make_float4(g * x[b].x, g * x[b].y, g * x[b].z,
                                        g * x[b].w));
          } else {
            atomicAdd(dst, g * x[b].x);
          }
        }
      }
    }
  }
}

// The status word's fields (PzscTakeCudaStatus): [0] the error code
// (kStatusRowPointers, or 0), then the segment, the partition p whose
// successor would start early, that start, rp[p] and p's start.
constexpr int kStatusWords = 6;
constexpr int64_t kStatusRowPointers = 1;

// One block: *skip = whether the partition starts of some segment decrease
// (CollectSlices' rule); the first decrease, in segment-major order, goes
// to the status word.
__global__ void PzscCheckKernel(const int32_t* __restrict__ rp,
                                int64_t num_segments, int64_t rp_stride,
                                int64_t num_partitions, int64_t seg_len,
                                int32_t* skip,
                                volatile int64_t* status) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = ~0ull;
  __syncthreads();
  const int64_t pairs = num_segments * (num_partitions - 1);
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int64_t k = i / (num_partitions - 1);
    const int64_t p = i - k * (num_partitions - 1);
    const int32_t* seg = rp + k * rp_stride;
    if (PartitionStart(seg, p + 1, seg_len) < PartitionStart(seg, p, seg_len)) {
      atomicMin(&first, static_cast<unsigned long long>(i));
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  *skip = first != ~0ull;
  if (first == ~0ull) return;
  const int64_t k = static_cast<int64_t>(first) / (num_partitions - 1);
  const int64_t p = static_cast<int64_t>(first) - k * (num_partitions - 1);
  const int32_t* seg = rp + k * rp_stride;
  status[1] = k;
  status[2] = p;
  status[3] = PartitionStart(seg, p + 1, seg_len);
  status[4] = seg[p];
  status[5] = PartitionStart(seg, p, seg_len);
  __threadfence_system();
  status[0] = kStatusRowPointers;
}

// keys[j] = the table row of position j, or `rows` if unused; entries[j] =
// the position's output row (high 32 bits; below 2^32, CheckOutputs) and
// the bits of its gain (low 32 bits), what the update reads of a position,
// so that the sort carries it along.
template <typename Key>
__global__ void PzscKeysKernel(DeviceLayout l, Key rows, Key* keys,
                               uint64_t* entries,
                               const int32_t* __restrict__ skip) {
  const bool none = *skip != 0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < l.num_positions; j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t out_row = 0;
    const int64_t row = none ? -1 : EntryRow(l, j, &out_row);
    keys[j] = row < 0 ? rows : static_cast<Key>(row);
    entries[j] = row < 0 ? 0
                         : static_cast<uint64_t>(out_row) << 32 |
                               __float_as_uint(l.gains[j]);
  }
}

struct UpdateArgs {
  DeviceLayout l;
  const float* grad;
  const float* hyper;
  bool multiply_linear_by_learning_rate;
  bool clip;
  float clip_min;
  float clip_max;
  void* table;  // Stored as table_dtype: LoadTable / StoreTable.
  TableDtype table_dtype;
  // A 16-bit table's: the rounding seed (u32[1] on the device) and the
  // table's first row in the whole stacked table (RoundingBits' rows).
  const uint32_t* rounding_seed;
  int64_t row_base;
  float* slot0;  // The slots PZSC_SLOT_ARGS passes (PZSC_SLOT_ARGS_MAX).
  float* slot1;
  // Elements per row of each slot (SlotWidth: the table's dim for a Table
  // slot, 1 for a Row slot, 0 for none): slot s's row r starts at
  // r * width.
  int64_t slot0_width;
  int64_t slot1_width;
  // Packed entries (PzscKeysKernel) sorted by row, stably (scratch).
  const uint64_t* sorted;
};

// Adds gain * activation_grad[d0 + lane + 32 r] over the sorted entries
// [begin, end), in order, into acc. The warp loads 32 entries at a time
// (one per lane) and broadcasts them; the whole warp must call it.
__device__ __forceinline__ void SumRun(const UpdateArgs& a, int64_t begin,
                                       int64_t end, int64_t d0, int lane,
                                       float (&acc)[kRegs]) {
  const int64_t dim = a.l.dim;
  for (int64_t e0 = begin; e0 < end; e0 += kWarpSize) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarpSize), end - e0));
    const unsigned long long mine =
        lane < count ? a.sorted[e0 + lane] : 0ull;
#pragma unroll 4
    for (int t = 0; t < count; ++t) {
      const unsigned long long v = __shfl_sync(0xffffffffu, mine, t);
      const float g = __uint_as_float(static_cast<uint32_t>(v));
      const float* src = a.grad + static_cast<int64_t>(v >> 32) * dim;
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int64_t d = d0 + lane + kWarpSize * r;
        if (d < dim) acc[r] += g * src[d];
      }
    }
  }
}

// Element (row, col) of the table, widened to float32.
__device__ __forceinline__ float LoadTable(const UpdateArgs& a, int64_t row,
                                           int64_t col) {
  const int64_t i = row * a.l.dim + col;
  switch (a.table_dtype) {
    case TableDtype::kBF16:
      return BF16ToF32(static_cast<const uint16_t*>(a.table)[i]);
    case TableDtype::kF16:
      return F16ToF32(static_cast<const uint16_t*>(a.table)[i]);
    case TableDtype::kF32:
      break;
  }
  return static_cast<const float*>(a.table)[i];
}

// Stores w at element (row, col) of the table (a 16-bit table's by
// stochastic rounding, table_dtype.h).
__device__ __forceinline__ void StoreTable(const UpdateArgs& a, int64_t row,
                                           int64_t col, float w) {
  const int64_t i = row * a.l.dim + col;
  if (a.table_dtype == TableDtype::kF32) {
    static_cast<float*>(a.table)[i] = w;
    return;
  }
  const uint32_t bits = RoundingBits(*a.rounding_seed, a.row_base + row, col);
  static_cast<uint16_t*>(a.table)[i] =
      a.table_dtype == TableDtype::kBF16 ? F32ToBF16Stochastic(w, bits)
                                         : F32ToF16Stochastic(w, bits);
}

// Asks for the table row `row` and its slot rows in L2 (no wait): the
// update reads them after summing the row's gradient.
__device__ __forceinline__ void PrefetchRow(const UpdateArgs& a, int64_t row) {
  auto prefetch = [](const float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) {  // 128-byte lines
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
    }
  };
  // In floats: a 16-bit row's half as many.
  const int64_t table_floats =
      a.table_dtype == TableDtype::kF32 ? a.l.dim : (a.l.dim + 1) / 2;
  prefetch(static_cast<const float*>(a.table) + row * table_floats,
           table_floats);
  if (a.slot0 != nullptr) {
    prefetch(a.slot0 + row * a.slot0_width, a.slot0_width);
  }
  if (a.slot1 != nullptr) {
    prefetch(a.slot1 + row * a.slot1_width, a.slot1_width);
  }
}

// The call's hyper-parameters as the rules take them.
template <Optimizer kOpt>
__device__ __forceinline__ Hyperparameters LoadHyperparameters(
    const UpdateArgs& a) {
  constexpr int kHyper = NumHyperparameters(kOpt);
  Hyperparameters h;
#pragma unroll
  for (int i = 0; i < kMaxHyperparameters; ++i) {
    h.v[i] = i < kHyper ? a.hyper[i] : 0.0f;
  }
  h.multiply_linear_by_learning_rate = a.multiply_linear_by_learning_rate;
  return h;
}

// Clips an updated table element: as std::min(std::max(w, lo), hi) on CPU
// (NaN stays NaN).
__device__ __forceinline__ void Clip(const UpdateArgs& a, float& w) {
  if (a.clip) {
    w = w < a.clip_min ? a.clip_min : (w > a.clip_max ? a.clip_max : w);
  }
}

// Applies an element rule to elements d0 + lane + 32 r of table row `row`
// (each slot element at the same column of the slot's row).
template <Optimizer kOpt>
__device__ __forceinline__ void ApplyRow(const UpdateArgs& a, int64_t row,
                                         int64_t d0, int lane,
                                         const float (&acc)[kRegs]) {
  const Hyperparameters h = LoadHyperparameters<kOpt>(a);
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    const int64_t d = d0 + lane + kWarpSize * r;
    if (d >= a.l.dim) continue;
    float w = LoadTable(a, row, d);
// Row rules take ApplyRowRule instead: nothing here (the discarded branch
// of an `if constexpr` would still have to compile).
#define PZSC_APPLY_ELEMENT_Row(Name, num_slots)
#define PZSC_APPLY_ELEMENT_Element(Name, num_slots)                 \
  if constexpr (kOpt == Optimizer::k##Name) {                       \
    Name##Element(h, w,                                             \
                  PZSC_SLOT_ARGS(num_slots,                         \
                                 a.slot0[row * a.slot0_width + d],  \
                                 a.slot1[row * a.slot1_width + d])  \
                      acc[r]);                                      \
  }
#define PZSC_APPLY_ELEMENT(Name, name, num_slots, num_hyperparameters, rule, \
                           shape0, shape1)                                   \
  PZSC_APPLY_ELEMENT_##rule(Name, num_slots)
    PZSC_OPTIMIZERS(PZSC_APPLY_ELEMENT)
#undef PZSC_APPLY_ELEMENT
#undef PZSC_APPLY_ELEMENT_Element
#undef PZSC_APPLY_ELEMENT_Row
    Clip(a, w);
    StoreTable(a, row, d, w);
  }
}

// The row rule of a Row optimizer of the list: its state type and three
// parts (optimizers.h), the Row part reading the slot values of table row
// `row` (a Row slot's row is one value).
template <Optimizer kOpt>
struct RowRule;
#define PZSC_ROW_RULE_Element(Name, num_slots)
#define PZSC_ROW_RULE_Row(Name, num_slots)                                 \
  template <>                                                              \
  struct RowRule<Optimizer::k##Name> {                                     \
    using State = Name##RowState;                                          \
    static __device__ __forceinline__ float Term(                          \
        const Hyperparameters& h, float col, float w, float g) {           \
      return Name##RowTerm(h, col, w, g);                                  \
    }                                                                      \
    static __device__ __forceinline__ State Row(const Hyperparameters& h,  \
                                                const UpdateArgs& a,       \
                                                int64_t row, float sum) {  \
      return Name##Row(h,                                                  \
                       PZSC_SLOT_ARGS(num_slots,                           \
                                      a.slot0[row * a.slot0_width],        \
                                      a.slot1[row * a.slot1_width]) sum);  \
    }                                                                      \
    static __device__ __forceinline__ void Element(                        \
        const Hyperparameters& h, const State& st, float& w, float g) {    \
      Name##Element(h, st, w, g);                                          \
    }                                                                      \
  };
#define PZSC_ROW_RULE(Name, name, num_slots, num_hyperparameters, rule, \
                      shape0, shape1)                                   \
  PZSC_ROW_RULE_##rule(Name, num_slots)
PZSC_OPTIMIZERS(PZSC_ROW_RULE)
#undef PZSC_ROW_RULE
#undef PZSC_ROW_RULE_Row
#undef PZSC_ROW_RULE_Element

// The sum of `v` over the warp's lanes, the same bits in every lane: a
// butterfly (lane i adds lane i ^ o's value for o = 16, 8, ..., 1) adds the
// same two values in both lanes of each pair (addition commutes), so the
// lanes agree after every step, and the order is fixed. The whole warp must
// call it.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Lane 0's `value` in every lane, word by word (a rule's row state: plain
// floats). The whole warp must call it.
template <typename T>
__device__ __forceinline__ T BroadcastFromLane0(const T& value) {
  static_assert(std::is_trivially_copyable_v<T> &&
                    sizeof(T) % sizeof(float) == 0,
                "a row state is a struct of 32-bit words");
  constexpr int kWords = sizeof(T) / sizeof(float);
  float words[kWords];
  memcpy(words, &value, sizeof(T));
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    words[i] = __shfl_sync(0xffffffffu, words[i], 0);
  }
  T out;
  memcpy(&out, words, sizeof(T));
  return out;
}

// Applies a row rule to table row `row`; the whole warp calls it.
// tile_sum(d0, acc) adds the row's summed gradient at elements
// d0 + lane + 32 r into acc (the same values at every call for a d0). Pass
// 1: each lane adds the Term of its elements, tile by tile then r by r;
// WarpSum gives the row's sum; lane 0 runs Row (the slot values, once) and
// broadcasts the state. Pass 2: Element and the clip on each element, with
// the tile sums of pass 1 when the row is one tile, formed again otherwise.
template <Optimizer kOpt, typename TileSum>
__device__ __forceinline__ void ApplyRowRule(const UpdateArgs& a, int64_t row,
                                             int lane, TileSum tile_sum) {
  using Parts = RowRule<kOpt>;
  const Hyperparameters h = LoadHyperparameters<kOpt>(a);
  const int64_t dim = a.l.dim;
  float acc[kRegs];
  // The tile's summed gradient at d0 + lane + 32 r, into acc.
  auto load_tile = [&](int64_t d0) {
#pragma unroll
    for (int r = 0; r < kRegs; ++r) acc[r] = 0.0f;
    tile_sum(d0, acc);
  };
  float term = 0.0f;
  for (int64_t d0 = 0; d0 < dim; d0 += kTileWidth) {
    load_tile(d0);
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int64_t d = d0 + lane + kWarpSize * r;
      if (d < dim) {
        term += Parts::Term(h, static_cast<float>(d), LoadTable(a, row, d),
                            acc[r]);
      }
    }
  }
  const float sum = WarpSum(term);
  typename Parts::State state{};
  if (lane == 0) state = Parts::Row(h, a, row, sum);
  state = BroadcastFromLane0(state);
  const bool one_tile = dim <= kTileWidth;
  for (int64_t d0 = 0; d0 < dim; d0 += kTileWidth) {
    if (!one_tile) load_tile(d0);
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int64_t d = d0 + lane + kWarpSize * r;
      if (d >= dim) continue;
      float w = LoadTable(a, row, d);
      Parts::Element(h, state, w, acc[r]);
      Clip(a, w);
      StoreTable(a, row, d, w);
    }
  }
}

// Counters in scratch: [runs, chunks, long runs].
constexpr int kNumCounters = 3;

// Each warp takes tiles of 32 consecutive runs: lane i reads run i's key,
// offset and length (and asks for its rows in L2), then the warp walks the
// tile's runs, each of at most kChunk positions summed and updated at once.
// A longer run gets ceil(length / kChunk) consecutive chunk slots from the
// counter chunks (chunk c covers run positions [c kChunk, (c + 1) kChunk))
// and an entry (run, first slot) in long_runs.
template <Optimizer kOpt, typename Key>
__global__ void PzscUpdateKernel(UpdateArgs a, Key rows,
                                 const Key* __restrict__ run_keys,
                                 const int32_t* __restrict__ run_offsets,
                                 const int32_t* __restrict__ run_lengths,
                                 int32_t* counters, int32_t* chunk_begin,
                                 int32_t* chunk_end, int32_t* long_runs) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps =
      static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t n = counters[0];
  for (int64_t tile = (static_cast<int64_t>(blockIdx.x) * blockDim.x +
                       threadIdx.x) /
                      kWarpSize * kWarpSize;
       tile < n; tile += warps * kWarpSize) {
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarpSize), n - tile));
    Key my_key = rows;
    int32_t my_len = 0, my_begin = 0;
    if (lane < count) {
      my_key = run_keys[tile + lane];
      my_len = run_lengths[tile + lane];
      my_begin = run_offsets[tile + lane];
      if (my_key < rows && my_len <= kChunk) {
        PrefetchRow(a, static_cast<int64_t>(my_key));
      }
    }
    for (int q = 0; q < count; ++q) {
      const Key key = __shfl_sync(0xffffffffu, my_key, q);
      if (key >= rows) continue;
      const int32_t len = __shfl_sync(0xffffffffu, my_len, q);
      const int32_t begin = __shfl_sync(0xffffffffu, my_begin, q);
      if (len > kChunk) {
        const int32_t chunks = (len + kChunk - 1) / kChunk;
        int32_t first = 0;
        if (lane == 0) {
          first = atomicAdd(&counters[1], chunks);
          const int32_t at = atomicAdd(&counters[2], 1);
          long_runs[2 * at] = static_cast<int32_t>(tile + q);
          long_runs[2 * at + 1] = first;
        }
        first = __shfl_sync(0xffffffffu, first, 0);
        // In int64: begin + (c + 1) kChunk can pass 2^31 when the run ends
        // within kChunk of it; the bounds themselves fit (<= begin + len).
        for (int32_t c = lane; c < chunks; c += kWarpSize) {
          const int64_t lo = static_cast<int64_t>(begin) +
                             static_cast<int64_t>(c) * kChunk;
          chunk_begin[first + c] = static_cast<int32_t>(lo);
          chunk_end[first + c] = static_cast<int32_t>(
              min(static_cast<int64_t>(begin) + len, lo + kChunk));
        }
        continue;
      }
      if constexpr (IsRowRule(kOpt)) {
        ApplyRowRule<kOpt>(a, static_cast<int64_t>(key), lane,
                           [&](int64_t d0, float (&acc)[kRegs]) {
                             SumRun(a, begin, begin + len, d0, lane, acc);
                           });
      } else {
        for (int64_t d0 = 0; d0 < a.l.dim; d0 += kWarpSize * kRegs) {
          float acc[kRegs] = {};
          SumRun(a, begin, begin + len, d0, lane, acc);
          ApplyRow<kOpt>(a, static_cast<int64_t>(key), d0, lane, acc);
        }
      }
    }
  }
}

// One warp per chunk slot: partial[slot] = the chunk's sum.
__global__ void PzscChunkKernel(UpdateArgs a, const int32_t* counters,
                                const int32_t* __restrict__ chunk_begin,
                                const int32_t* __restrict__ chunk_end,
                                float* __restrict__ partial) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps =
      static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t n = counters[1];
  for (int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x) /
                   kWarpSize;
       c < n; c += warps) {
    for (int64_t d0 = 0; d0 < a.l.dim; d0 += kWarpSize * kRegs) {
      float acc[kRegs] = {};
      SumRun(a, chunk_begin[c], chunk_end[c], d0, lane, acc);
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int64_t d = d0 + lane + kWarpSize * r;
        if (d < a.l.dim) partial[c * a.l.dim + d] = acc[r];
      }
    }
  }
}

// One warp per long run of at most big_chunks chunks: adds its chunk sums
// in chunk order, then applies the update.
template <Optimizer kOpt, typename Key>
__global__ void PzscFinishKernel(UpdateArgs a, const Key* __restrict__ run_keys,
                                 const int32_t* __restrict__ run_lengths,
                                 const int32_t* counters,
                                 const int32_t* __restrict__ long_runs,
                                 const float* __restrict__ partial,
                                 int64_t big_chunks) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps =
      static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t n = counters[2];
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x) /
                   kWarpSize;
       i < n; i += warps) {
    const int32_t r = long_runs[2 * i];
    const int64_t first = long_runs[2 * i + 1];
    const int64_t chunks = (run_lengths[r] + kChunk - 1) / kChunk;
    if (chunks > big_chunks) continue;  // PzscFinishBigKernel's
    // Adds the chunk sums of elements d0 + lane + 32 q, in chunk order.
    auto sum_chunks = [&](int64_t d0, float (&acc)[kRegs]) {
#pragma unroll 4
      for (int64_t c = first; c < first + chunks; ++c) {
#pragma unroll
        for (int q = 0; q < kRegs; ++q) {
          const int64_t d = d0 + lane + kWarpSize * q;
          if (d < a.l.dim) acc[q] += partial[c * a.l.dim + d];
        }
      }
    };
    const int64_t row = static_cast<int64_t>(run_keys[r]);
    if constexpr (IsRowRule(kOpt)) {
      ApplyRowRule<kOpt>(a, row, lane, sum_chunks);
    } else {
      for (int64_t d0 = 0; d0 < a.l.dim; d0 += kWarpSize * kRegs) {
        float acc[kRegs] = {};
        sum_chunks(d0, acc);
        ApplyRow<kOpt>(a, row, d0, lane, acc);
      }
    }
  }
}

// Threads of a block of PzscFinishBigKernel, and the long runs it takes:
// more than kBigChunks chunks (the hottest rows).
constexpr int kBigWarps = 32;
constexpr int64_t kBigChunks = 32;

// Shared memory of PzscFinishBigKernel for rows of `dim` elements.
size_t FinishBigSharedBytes(int64_t dim) {
  return (kBigWarps * kTileWidth + dim) * sizeof(float);
}

// One block per long run of more than big_chunks chunks. For each tile of
// kTileWidth columns, warp w adds the sums of chunks w, w + kBigWarps, ...
// in chunk order, then thread c adds the warps' sums of column c in warp
// order into the row's summed gradient (shared memory); warp 0 then applies
// the update from it. The order is fixed: deterministic.
template <Optimizer kOpt, typename Key>
__global__ void __launch_bounds__(kBigWarps* kWarpSize)
    PzscFinishBigKernel(UpdateArgs a, const Key* __restrict__ run_keys,
                        const int32_t* __restrict__ run_lengths,
                        const int32_t* counters,
                        const int32_t* __restrict__ long_runs,
                        const float* __restrict__ partial,
                        int64_t big_chunks) {
  extern __shared__ float shared[];
  float* part = shared;                             // [kBigWarps, kTileWidth]
  float* row_sum = shared + kBigWarps * kTileWidth;  // [dim]
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t dim = a.l.dim;
  const int64_t n = counters[2];
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int32_t r = long_runs[2 * i];
    const int64_t first = long_runs[2 * i + 1];
    const int64_t chunks = (run_lengths[r] + kChunk - 1) / kChunk;
    if (chunks <= big_chunks) continue;  // The same in the whole block.
    for (int64_t d0 = 0; d0 < dim; d0 += kTileWidth) {
      float acc[kRegs] = {};
#pragma unroll 4
      for (int64_t c = first + warp; c < first + chunks; c += kBigWarps) {
#pragma unroll
        for (int q = 0; q < kRegs; ++q) {
          const int64_t d = d0 + lane + kWarpSize * q;
          if (d < dim) acc[q] += partial[c * dim + d];
        }
      }
#pragma unroll
      for (int q = 0; q < kRegs; ++q) {
        part[warp * kTileWidth + lane + kWarpSize * q] = acc[q];
      }
      __syncthreads();
      if (threadIdx.x < kTileWidth && d0 + threadIdx.x < dim) {
        float sum = 0.0f;
        for (int w = 0; w < kBigWarps; ++w) {
          sum += part[w * kTileWidth + threadIdx.x];
        }
        row_sum[d0 + threadIdx.x] = sum;
      }
      __syncthreads();
    }
    if (warp == 0) {
      const int64_t row = static_cast<int64_t>(run_keys[r]);
      auto from_shared = [&](int64_t d0, float (&acc)[kRegs]) {
#pragma unroll
        for (int q = 0; q < kRegs; ++q) {
          const int64_t d = d0 + lane + kWarpSize * q;
          if (d < dim) acc[q] += row_sum[d];
        }
      };
      if constexpr (IsRowRule(kOpt)) {
        ApplyRowRule<kOpt>(a, row, lane, from_shared);
      } else {
        for (int64_t d0 = 0; d0 < dim; d0 += kTileWidth) {
          float acc[kRegs] = {};
          from_shared(d0, acc);
          ApplyRow<kOpt>(a, row, d0, lane, acc);
        }
      }
    }
    __syncthreads();  // row_sum is the next run's.
  }
}

ffi::Error CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " +
                              cudaGetErrorString(err));
}

#define PZSC_CUDA_RETURN_IF_ERROR(call)                           \
  if (ffi::Error err = CudaError((call), #call); err.failure()) { \
    return err;                                                   \
  }

// The status word: pinned host memory mapped into every device's address
// space (UVA: one pointer for host and devices), allocated once.
struct StatusWord {
  int64_t* words = nullptr;
  cudaError_t error = cudaSuccess;
};

const StatusWord& Status() {
  static const StatusWord status = [] {
    StatusWord s;
    void* p = nullptr;
    s.error = cudaHostAlloc(&p, kStatusWords * sizeof(int64_t),
                            cudaHostAllocMapped | cudaHostAllocPortable);
    if (s.error == cudaSuccess) {
      s.words = static_cast<int64_t*>(p);
      for (int i = 0; i < kStatusWords; ++i) s.words[i] = 0;
    }
    return s;
  }();
  return status;
}

// Launches the row-pointer check of a call (PzscCheckKernel) into *skip,
// a 4-byte scratch word; the call's later kernels read it.
ffi::Error CheckRowPointers(cudaStream_t stream, const CooView& view,
                            int32_t* skip) {
  const StatusWord& status = Status();
  if (status.words == nullptr) {
    return CudaError(status.error, "cudaHostAlloc (status word)");
  }
  PZSC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(skip, 0, sizeof(int32_t), stream));
  if (view.attrs.num_segments == 0 || view.attrs.num_partitions < 2) {
    return ffi::Error::Success();
  }
  PzscCheckKernel<<<1, 1024, 0, stream>>>(
      view.row_pointers, view.attrs.num_segments, view.rp_stride,
      view.attrs.num_partitions, view.seg_len, skip, status.words);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// A 4-byte skip word from XLA's scratch allocator.
ffi::Error AllocateSkip(ffi::ScratchAllocator& allocator, int32_t** skip) {
  std::optional<void*> p = allocator.Allocate(sizeof(int32_t), 16);
  if (!p.has_value() || *p == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "could not allocate the row-pointer check's flag");
  }
  *skip = static_cast<int32_t*>(*p);
  return ffi::Error::Success();
}

// Positions are int32 in the backward's scratch.
ffi::Error CheckPositions(const CooView& view) {
  const int64_t n = view.attrs.num_segments * view.seg_len;
  if (n > 2147483647) {
    return ffi::Error::InvalidArgument(
        "the CUDA handlers take at most 2147483647 COO entries, got " +
        std::to_string(n));
  }
  return ffi::Error::Success();
}

// The backward packs an entry's output row into 32 bits (PzscKeysKernel).
ffi::Error CheckOutputs(const CooView& view) {
  if (view.num_outputs() > 4294967295) {
    return ffi::Error::InvalidArgument(
        "the CUDA backward takes activations of at most 4294967295 rows, "
        "got " +
        std::to_string(view.num_outputs()));
  }
  return ffi::Error::Success();
}

int Blocks(int64_t threads) {
  const int64_t blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks
                                                                 : blocks));
}

// The current device's multiprocessors.
int Multiprocessors() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess ||
      sms <= 0) {
    sms = 132;  // An H100's; only grid sizes depend on it.
  }
  return sms;
}

// Blocks for `threads` threads capped at a grid that fills the current
// device once (kBlocksPerSm per multiprocessor); kernels loop over the
// rest.
int ResidentBlocks(int64_t threads) {
  return std::min(Blocks(threads), kBlocksPerSm * Multiprocessors());
}

ffi::Error ForwardCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                           ffi::AnyBuffer row_pointers,
                           ffi::AnyBuffer embedding_ids,
                           ffi::AnyBuffer sample_ids, ffi::AnyBuffer gains,
                           ffi::AnyBuffer table,
                           ffi::AnyBuffer /*sample_order*/,
                           ffi::Result<ffi::AnyBuffer> out,
                           LayoutAttrs attrs, Quantization quantization) {
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  if (auto err = CheckMatrix(*out, view.num_outputs(), view.dim, "output");
      err.failure()) {
    return err;
  }
  if (auto err = CheckQuantization(quantization); err.failure()) return err;
  if (auto err = CheckPositions(view); err.failure()) return err;
  if (out->size_bytes() == 0) return ffi::Error::Success();
  int32_t* skip = nullptr;
  if (auto err = AllocateSkip(scratch, &skip); err.failure()) return err;
  if (auto err = CheckRowPointers(stream, view, skip); err.failure()) {
    return err;
  }
  PZSC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream));
  const DeviceLayout l = MakeDeviceLayout(view);
  if (view.dim == 0 || l.num_positions == 0) return ffi::Error::Success();
  const void* t = table.untyped_data();
  float* o = out->typed_data<float>();
  const uintptr_t row_align =
      view.table_dtype == TableDtype::kF32 ? 16 : 8;  // 4 elements
  const bool vec4 = view.dim % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(t) % row_align == 0 &&
                    reinterpret_cast<uintptr_t>(o) % 16 == 0;
  const int64_t chunks = vec4 ? view.dim / 4 : view.dim;
  int lanes = 1;
  int lane_shift = 0;
  while (lanes < kWarpSize && lanes < chunks) {
    lanes *= 2;
    ++lane_shift;
  }
  // One warp per tile of kTile positions.
  const int64_t tiles = (l.num_positions + kTile - 1) / kTile;
  const int blocks = ResidentBlocks(tiles * kWarpSize);
  auto launch = [&](auto dtype) {
    constexpr TableDtype kDtype = decltype(dtype)::value;
    const auto* typed = static_cast<const Stored<kDtype>*>(t);
    if (vec4) {
      PzscForwardKernel<true, kDtype><<<blocks, kThreadsPerBlock, 0, stream>>>(
          l, lane_shift, typed, o, quantization, skip);
    } else {
      PzscForwardKernel<false, kDtype>
          <<<blocks, kThreadsPerBlock, 0, stream>>>(l, lane_shift, typed, o,
                                                    quantization, skip);
    }
  };
  switch (view.table_dtype) {
    case TableDtype::kBF16:
      launch(std::integral_constant<TableDtype, TableDtype::kBF16>());
      break;
    case TableDtype::kF16:
      launch(std::integral_constant<TableDtype, TableDtype::kF16>());
      break;
    case TableDtype::kF32:
      launch(std::integral_constant<TableDtype, TableDtype::kF32>());
      break;
  }
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// Scratch of the backward, carved from one allocation.
template <typename Key>
struct Scratch {
  Key* keys;
  Key* sorted_keys;
  uint64_t* entries;  // PzscKeysKernel's packed entries
  uint64_t* sorted;   // sorted by key
  Key* run_keys;
  int32_t* run_lengths;
  int32_t* run_offsets;
  int32_t* chunk_begin;
  int32_t* chunk_end;
  int32_t* long_runs;  // Pairs (run, first chunk slot).
  float* partial;      // Chunk sums, [chunk slots, dim].
  int32_t* counters;   // kNumCounters
  void* cub;
  size_t cub_bytes;
};

size_t Align(size_t v) { return (v + 255) / 256 * 256; }

// Chunk slots and long runs a backward of n positions can need: a run of
// len > kChunk positions takes ceil(len / kChunk) <= 2 len / kChunk slots.
int64_t MaxChunks(int64_t n) { return 2 * n / kChunk + 1; }
int64_t MaxLongRuns(int64_t n) { return n / (kChunk + 1) + 1; }

template <typename Key>
ffi::Error AllocateScratch(ffi::ScratchAllocator& allocator, int64_t n,
                           int64_t dim, int bits, Scratch<Key>* s) {
  size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<Key*>(nullptr),
      static_cast<Key*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<uint64_t*>(nullptr), n, 0, bits));
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRunLengthEncode::Encode(
      nullptr, rle_bytes, static_cast<Key*>(nullptr),
      static_cast<Key*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), n));
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(
      nullptr, scan_bytes, static_cast<int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), n));
  s->cub_bytes = std::max(sort_bytes, std::max(rle_bytes, scan_bytes));
  const size_t key_bytes = Align(n * sizeof(Key));
  const size_t int_bytes = Align(n * sizeof(int32_t));
  const size_t entry_bytes = Align(n * sizeof(uint64_t));
  const size_t chunk_bytes = Align(MaxChunks(n) * sizeof(int32_t));
  const size_t long_bytes = Align(2 * MaxLongRuns(n) * sizeof(int32_t));
  const size_t partial_bytes = Align(MaxChunks(n) * dim * sizeof(float));
  const size_t counter_bytes = Align(kNumCounters * sizeof(int32_t));
  const size_t total = 3 * key_bytes + 2 * entry_bytes + 2 * int_bytes +
                       2 * chunk_bytes +
                       long_bytes + partial_bytes + counter_bytes +
                       Align(s->cub_bytes);
  // XLA's allocator takes alignments up to 16: ask for 256 bytes more and
  // align the start here.
  std::optional<void*> base = allocator.Allocate(total + 256, 16);
  if (!base.has_value() || *base == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "could not allocate " + std::to_string(total) +
                          " bytes of scratch for the backward");
  }
  char* p = reinterpret_cast<char*>(
      Align(reinterpret_cast<uintptr_t>(*base)));
  auto take = [&p](size_t bytes) {
    char* at = p;
    p += bytes;
    return at;
  };
  s->keys = reinterpret_cast<Key*>(take(key_bytes));
  s->sorted_keys = reinterpret_cast<Key*>(take(key_bytes));
  s->run_keys = reinterpret_cast<Key*>(take(key_bytes));
  s->entries = reinterpret_cast<uint64_t*>(take(entry_bytes));
  s->sorted = reinterpret_cast<uint64_t*>(take(entry_bytes));
  s->run_lengths = reinterpret_cast<int32_t*>(take(int_bytes));
  s->run_offsets = reinterpret_cast<int32_t*>(take(int_bytes));
  s->chunk_begin = reinterpret_cast<int32_t*>(take(chunk_bytes));
  s->chunk_end = reinterpret_cast<int32_t*>(take(chunk_bytes));
  s->long_runs = reinterpret_cast<int32_t*>(take(long_bytes));
  s->partial = reinterpret_cast<float*>(take(partial_bytes));
  s->counters = reinterpret_cast<int32_t*>(take(counter_bytes));
  s->cub = take(Align(s->cub_bytes));
  return ffi::Error::Success();
}

// Sorts the positions by row, finds the runs and updates each referenced
// row once (see the top of the file).
template <Optimizer kOpt, typename Key>
ffi::Error RunBackward(cudaStream_t stream, const Scratch<Key>& s,
                       const int32_t* skip, UpdateArgs args, Key rows,
                       int bits) {
  const int64_t n = args.l.num_positions;
  args.sorted = s.sorted;
  PzscKeysKernel<Key><<<Blocks(n), kThreadsPerBlock, 0, stream>>>(
      args.l, rows, s.keys, s.entries, skip);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  size_t bytes = s.cub_bytes;
  // n < 2^31 (CheckPositions): CUB's item counts are int.
  const int items = static_cast<int>(n);
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      s.cub, bytes, s.keys, s.sorted_keys, s.entries, s.sorted, items, 0,
      bits, stream));
  // Lengths past the run count are read by the scan: zero them.
  PZSC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(s.run_lengths, 0, n * sizeof(int32_t), stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      s.counters, 0, kNumCounters * sizeof(int32_t), stream));
  bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRunLengthEncode::Encode(
      s.cub, bytes, s.sorted_keys, s.run_keys, s.run_lengths, s.counters,
      items, stream));
  bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(
      s.cub, bytes, s.run_lengths, s.run_offsets, items, stream));
  PzscUpdateKernel<kOpt, Key>
      <<<ResidentBlocks(n), kThreadsPerBlock, 0, stream>>>(
          args, rows, s.run_keys, s.run_offsets, s.run_lengths, s.counters,
          s.chunk_begin, s.chunk_end, s.long_runs);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  PzscChunkKernel<<<ResidentBlocks(MaxChunks(n) * kWarpSize), kThreadsPerBlock, 0,
                    stream>>>(args, s.counters, s.chunk_begin, s.chunk_end,
                              s.partial);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // Runs of more than kBigChunks chunks take a block each, if its shared
  // memory fits in the default 48 KiB; all long runs take a warp otherwise.
  const size_t big_bytes = FinishBigSharedBytes(args.l.dim);
  const bool big = big_bytes <= 48 * 1024;
  const int64_t big_chunks =
      big ? kBigChunks : std::numeric_limits<int64_t>::max();
  PzscFinishKernel<kOpt, Key>
      <<<ResidentBlocks(MaxLongRuns(n) * kWarpSize), kThreadsPerBlock, 0,
         stream>>>(args, s.run_keys, s.run_lengths, s.counters, s.long_runs,
                   s.partial, big_chunks);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (big) {
    const int64_t max_big = n / (kBigChunks * kChunk + 1) + 1;
    const int blocks = static_cast<int>(
        std::min<int64_t>(max_big, 2 * static_cast<int64_t>(Multiprocessors())));
    PzscFinishBigKernel<kOpt, Key>
        <<<blocks, kBigWarps * kWarpSize, big_bytes, stream>>>(
            args, s.run_keys, s.run_lengths, s.counters, s.long_runs,
            s.partial, big_chunks);
    PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return ffi::Error::Success();
}

int BitsFor(uint64_t v) {
  int bits = 1;
  while (bits < 64 && (v >> bits) != 0) ++bits;
  return bits;
}

template <Optimizer kOpt>
ffi::Error GradCudaImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer activation_grad,
                        ffi::AnyBuffer row_pointers,
                        ffi::AnyBuffer embedding_ids, ffi::AnyBuffer sample_ids,
                        ffi::AnyBuffer gains, ffi::AnyBuffer table,
                        ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> table_out,
                        ffi::RemainingRets slots_out, LayoutAttrs attrs,
                        bool clip, float clip_min, float clip_max,
                        bool multiply_linear_by_learning_rate) {
  constexpr int kSlots = NumSlots(kOpt);
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  if (auto err = CheckGradOperands(kOpt, view, activation_grad, table, rest,
                                   table_out, slots_out, clip, clip_min,
                                   clip_max);
      err.failure()) {
    return err;
  }
  if (auto err = CheckOutputs(view); err.failure()) return err;
  if (auto err = CheckPositions(view); err.failure()) return err;
  int32_t* skip = nullptr;
  if (auto err = AllocateSkip(scratch, &skip); err.failure()) return err;
  const DeviceLayout l = MakeDeviceLayout(view);
  const bool work = view.dim > 0 && l.num_positions > 0;
  const uint64_t rows =
      static_cast<uint64_t>(view.num_table_partitions * view.attrs.rows_per_partition);
  const int bits = BitsFor(rows);
  const bool narrow = rows < 0xffffffffu;
  Scratch<uint32_t> s32{};
  Scratch<uint64_t> s64{};
  if (work) {
    auto err = narrow ? AllocateScratch(scratch, l.num_positions, view.dim, bits, &s32)
                      : AllocateScratch(scratch, l.num_positions, view.dim,
                                        bits, &s64);
    if (err.failure()) return err;
  }

  // Nothing is written before this point; the check runs first in the
  // stream (on a decrease, the later kernels do nothing).
  if (auto err = CheckRowPointers(stream, view, skip); err.failure()) {
    return err;
  }
  auto copy = [&](const ffi::AnyBuffer& from, ffi::AnyBuffer& to) {
    if (from.size_bytes() == 0 || from.untyped_data() == to.untyped_data()) {
      return cudaSuccess;
    }
    return cudaMemcpyAsync(to.untyped_data(), from.untyped_data(),
                           from.size_bytes(), cudaMemcpyDeviceToDevice,
                           stream);
  };
  PZSC_CUDA_RETURN_IF_ERROR(copy(table, *table_out));
  UpdateArgs args{};
  args.l = l;
  args.table = table_out->untyped_data();
  args.table_dtype = view.table_dtype;
  if (view.table_dtype != TableDtype::kF32) {
    args.rounding_seed = static_cast<const uint32_t*>(
        rest.get<ffi::AnyBuffer>(kSlots + 1)->untyped_data());
    args.row_base = attrs.partition_begin * attrs.rows_per_partition;
  }
  float* slots[PZSC_SLOT_ARGS_MAX] = {nullptr, nullptr};  // slot0, slot1
  for (int i = 0; i < kSlots; ++i) {
    ffi::Result<ffi::AnyBuffer> slot_out = *slots_out.get<ffi::AnyBuffer>(i);
    PZSC_CUDA_RETURN_IF_ERROR(copy(*rest.get<ffi::AnyBuffer>(i), *slot_out));
    slots[i] = slot_out->typed_data<float>();
  }
  if (!work) return ffi::Error::Success();
  args.slot0 = slots[0];
  args.slot1 = slots[1];
  args.slot0_width = SlotWidth(kOpt, 0, view.dim);
  args.slot1_width = SlotWidth(kOpt, 1, view.dim);
  args.grad = activation_grad.typed_data<float>();
  args.hyper = rest.get<ffi::AnyBuffer>(kSlots)->typed_data<float>();
  args.multiply_linear_by_learning_rate = multiply_linear_by_learning_rate;
  args.clip = clip;
  args.clip_min = clip_min;
  args.clip_max = clip_max;
  return narrow ? RunBackward<kOpt, uint32_t>(stream, s32, skip, args,
                                               static_cast<uint32_t>(rows), bits)
                : RunBackward<kOpt, uint64_t>(stream, s64, skip, args, rows,
                                              bits);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparseDenseMatmulCuda, ForwardCudaImpl,
    BindCooOperands(ffi::Ffi::Bind()
                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                        .Ctx<ffi::ScratchAllocator>())
        // The CPU forward's sample_order: this handler sorts on the device.
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()  // out
        .Attr<LayoutAttrs>("layout")
        .Attr<Quantization>("quantization"));

#define PZSC_DEFINE_CUDA_GRAD_HANDLER(Name, name, num_slots,              \
                                      num_hyperparameters, rule, shape0, \
                                      shape1)                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                         \
      SparseDenseMatmulGrad##Name##Cuda,                                 \
      GradCudaImpl<Optimizer::k##Name>,                                  \
      PZSC_BIND_GRAD_OPERANDS(                                           \
          ffi::Ffi::Bind()                                               \
              .Ctx<ffi::PlatformStream<cudaStream_t>>()                  \
              .Ctx<ffi::ScratchAllocator>()));

PZSC_OPTIMIZERS(PZSC_DEFINE_CUDA_GRAD_HANDLER)

#undef PZSC_DEFINE_CUDA_GRAD_HANDLER

int TakeCudaStatus(int64_t* out) {
  const StatusWord& status = Status();
  if (status.words == nullptr) return 0;
  volatile int64_t* w = status.words;
  const int64_t code = w[0];
  if (code == 0) return 0;
  for (int i = 0; i < kStatusWords; ++i) out[i] = w[i];
  w[0] = 0;
  return kStatusWords;
}

}  // namespace pzsc
