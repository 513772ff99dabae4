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
// Forward. Groups of lanes take runs of consecutive entries and add
// gain * table row into each entry's output row with float atomics (16-byte
// vector atomics on sm_90). The preprocessor sorts a partition's entries by
// row, so a run mostly reads one row once. The summation order, and so the last
// bits of an output, is not deterministic.
//
// Backward. Deterministic, and no atomics on the table or slots: each valid
// position gets the key of its table row (invalid ones the key `rows`, past
// every row), a stable radix sort (CUB) orders the positions by key, and a
// run-length encoding gives each referenced row its run of positions, in
// segment order then buffer order, as the CPU handlers sum them. One warp per
// run of at most kChunk positions sums gain * activation_grad over the run
// in that order and applies the optimizer once (optimizers.h, the rules the
// CPU handlers use). Longer runs (hot rows) are cut into chunks of kChunk
// positions: one warp per chunk writes the chunk's sum to scratch, then one
// warp per run adds its chunks' sums in chunk order and applies the update.
// Clipping follows the update, on the table only. Scratch (keys, positions,
// runs, chunk sums; O(entries x dim / kChunk + entries), independent of the
// table's size) comes from XLA's allocator.
//
// Errors. Row pointers whose partition starts decrease are an error, as on
// CPU. Checking them needs the row pointers on the host: each call copies
// them (num_segments x rp_stride int32) to the host and synchronises the
// stream before anything is written. Every CUDA call's status is checked; a
// failure is returned as an error naming the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <optional>
#include <string>
#include <vector>

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
// Positions summed by one warp: runs longer than this are cut into chunks.
constexpr int32_t kChunk = 64;
// Upper bound on the blocks of one launch (the kernels loop over the rest).
constexpr int64_t kMaxBlocks = 1 << 20;

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

// Groups of 2^lane_shift threads (at most a warp), each taking a run of
// kForwardRun consecutive positions. A partition's entries are sorted by
// row, so a run mostly names one row: the group keeps the row's elements in
// registers and reads it again only when the row changes (hot rows are not
// read by every SM at once). kVec4: dim % 4 == 0 and 16-byte aligned rows,
// read and added 4 elements at a time.
constexpr int64_t kForwardRun = 8;

template <bool kVec4>
__global__ void PzscForwardKernel(DeviceLayout l, int lane_shift,
                                  const float* __restrict__ table,
                                  float* __restrict__ out, Quantization q) {
  const int lanes = 1 << lane_shift;
  const int64_t groups =
      (static_cast<int64_t>(gridDim.x) * blockDim.x) >> lane_shift;
  const int lane = threadIdx.x & (lanes - 1);
  constexpr int kWidth = kVec4 ? 4 : 1;
  for (int64_t first =
           ((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >>
            lane_shift) *
           kForwardRun;
       first < l.num_positions; first += groups * kForwardRun) {
    const int64_t last = min(first + kForwardRun, l.num_positions);
    for (int64_t d = kWidth * lane; d < l.dim; d += kWidth * lanes) {
      int64_t cached = -1;
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int64_t j = first; j < last; ++j) {
        int64_t out_row;
        const int64_t row = EntryRow(l, j, &out_row);
        if (row < 0) continue;
        const float* src = table + row * l.dim + d;
        if (row != cached) {
          cached = row;
          if constexpr (kVec4) {
            x = *reinterpret_cast<const float4*>(src);
          } else {
            x.x = *src;
          }
          if (q.num_buckets > 0) {
            x = make_float4(Quantize(q, x.x), Quantize(q, x.y),
                            Quantize(q, x.z), Quantize(q, x.w));
          }
        }
        const float g = l.gains[j];
        float* dst = out + out_row * l.dim + d;
        if constexpr (kVec4) {
          AtomicAdd4(dst, make_float4(g * x.x, g * x.y, g * x.z, g * x.w));
        } else {
          atomicAdd(dst, g * x.x);
        }
      }
    }
  }
}

// keys[j] = the table row of position j, or `rows` if unused; positions[j]
// = j.
template <typename Key>
__global__ void PzscKeysKernel(DeviceLayout l, Key rows, Key* keys,
                               int32_t* positions) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < l.num_positions; j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t out_row;
    const int64_t row = EntryRow(l, j, &out_row);
    keys[j] = row < 0 ? rows : static_cast<Key>(row);
    positions[j] = static_cast<int32_t>(j);
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
  float* table;
  float* slot0;  // The slots PZSC_SLOT_ARGS passes (PZSC_SLOT_ARGS_MAX).
  float* slot1;
  const int32_t* sorted;  // Positions sorted by row (scratch).
};

// Adds gain * activation_grad[d0 + lane + 32 r] over the positions
// a.sorted[begin, end), in order, into acc.
__device__ __forceinline__ void SumRun(const UpdateArgs& a, int64_t begin,
                                       int64_t end, int64_t d0, int lane,
                                       float (&acc)[kRegs]) {
  const DeviceLayout& l = a.l;
#pragma unroll 4
  for (int64_t e = begin; e < end; ++e) {
    const int64_t j = a.sorted[e];
    const int64_t k = Segment(l, j);
    const int64_t out_row = k * l.samples_per_segment + l.sample_ids[j];
    const float g = l.gains[j];
    const float* src = a.grad + out_row * l.dim;
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      const int64_t d = d0 + lane + kWarpSize * r;
      if (d < l.dim) acc[r] += g * src[d];
    }
  }
}

// Applies the optimizer to elements d0 + lane + 32 r of table row `row`.
template <Optimizer kOpt>
__device__ __forceinline__ void ApplyRow(const UpdateArgs& a, int64_t row,
                                         int64_t d0, int lane,
                                         const float (&acc)[kRegs]) {
  constexpr int kHyper = NumHyperparameters(kOpt);
  Hyperparameters h;
#pragma unroll
  for (int i = 0; i < kMaxHyperparameters; ++i) {
    h.v[i] = i < kHyper ? a.hyper[i] : 0.0f;
  }
  h.multiply_linear_by_learning_rate = a.multiply_linear_by_learning_rate;
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    const int64_t d = d0 + lane + kWarpSize * r;
    if (d >= a.l.dim) continue;
    const int64_t off = row * a.l.dim + d;
    float& w = a.table[off];
#define PZSC_APPLY_ELEMENT(Name, name, num_slots, num_hyperparameters) \
  if constexpr (kOpt == Optimizer::k##Name) {                          \
    Name##Element(                                                     \
        h, w, PZSC_SLOT_ARGS(num_slots, a.slot0[off], a.slot1[off])    \
                  acc[r]);                                             \
  }
    PZSC_OPTIMIZERS(PZSC_APPLY_ELEMENT)
#undef PZSC_APPLY_ELEMENT
    // As std::min(std::max(w, lo), hi) on CPU: NaN stays NaN.
    if (a.clip) w = w < a.clip_min ? a.clip_min : (w > a.clip_max ? a.clip_max : w);
  }
}

// Counters in scratch: [runs, chunks, long runs].
constexpr int kNumCounters = 3;

// One warp per run of at most kChunk positions: sums it and applies the
// update. A longer run gets ceil(length / kChunk) consecutive chunk slots
// from the counter chunks (chunk c covers run positions [c kChunk,
// (c + 1) kChunk)) and an entry (run, first slot) in long_runs.
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
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x +
                    threadIdx.x) /
                   kWarpSize;
       r < n; r += warps) {
    const Key key = run_keys[r];
    if (key >= rows) continue;
    const int32_t len = run_lengths[r];
    const int32_t begin = run_offsets[r];
    if (len > kChunk) {
      const int32_t chunks = (len + kChunk - 1) / kChunk;
      int32_t first = 0;
      if (lane == 0) {
        first = atomicAdd(&counters[1], chunks);
        const int32_t at = atomicAdd(&counters[2], 1);
        long_runs[2 * at] = static_cast<int32_t>(r);
        long_runs[2 * at + 1] = first;
      }
      first = __shfl_sync(0xffffffffu, first, 0);
      for (int32_t c = lane; c < chunks; c += kWarpSize) {
        chunk_begin[first + c] = begin + c * kChunk;
        chunk_end[first + c] = min(begin + len, begin + (c + 1) * kChunk);
      }
      continue;
    }
    for (int64_t d0 = 0; d0 < a.l.dim; d0 += kWarpSize * kRegs) {
      float acc[kRegs] = {};
      SumRun(a, begin, begin + len, d0, lane, acc);
      ApplyRow<kOpt>(a, static_cast<int64_t>(key), d0, lane, acc);
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

// One warp per long run: adds its chunk sums in chunk order, then applies
// the update.
template <Optimizer kOpt, typename Key>
__global__ void PzscFinishKernel(UpdateArgs a, const Key* __restrict__ run_keys,
                                 const int32_t* __restrict__ run_lengths,
                                 const int32_t* counters,
                                 const int32_t* __restrict__ long_runs,
                                 const float* __restrict__ partial) {
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
    for (int64_t d0 = 0; d0 < a.l.dim; d0 += kWarpSize * kRegs) {
      float acc[kRegs] = {};
#pragma unroll 4
      for (int64_t c = first; c < first + chunks; ++c) {
#pragma unroll
        for (int q = 0; q < kRegs; ++q) {
          const int64_t d = d0 + lane + kWarpSize * q;
          if (d < a.l.dim) acc[q] += partial[c * a.l.dim + d];
        }
      }
      ApplyRow<kOpt>(a, static_cast<int64_t>(run_keys[r]), d0, lane, acc);
    }
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

// Checks the row pointers as the CPU handlers do (CollectSlices on a host
// copy): an error if a segment's partition starts decrease.
ffi::Error CheckRowPointers(cudaStream_t stream, const CooView& view) {
  std::vector<int32_t> host(view.attrs.num_segments * view.rp_stride);
  if (host.empty()) return ffi::Error::Success();
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), view.row_pointers,
                                            host.size() * sizeof(int32_t),
                                            cudaMemcpyDeviceToHost, stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  CooView on_host = view;
  on_host.row_pointers = host.data();
  std::vector<Slice> slices;
  return CollectSlices(on_host, &slices);
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

int Blocks(int64_t threads) {
  const int64_t blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks
                                                                 : blocks));
}

ffi::Error ForwardCudaImpl(cudaStream_t stream, ffi::AnyBuffer row_pointers,
                           ffi::AnyBuffer embedding_ids,
                           ffi::AnyBuffer sample_ids, ffi::AnyBuffer gains,
                           ffi::AnyBuffer table,
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
  if (auto err = CheckRowPointers(stream, view); err.failure()) return err;
  if (out->size_bytes() == 0) return ffi::Error::Success();
  PZSC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream));
  const DeviceLayout l = MakeDeviceLayout(view);
  if (view.dim == 0 || l.num_positions == 0) return ffi::Error::Success();
  const float* t = table.typed_data<float>();
  float* o = out->typed_data<float>();
  const bool vec4 = view.dim % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(t) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(o) % 16 == 0;
  const int64_t chunks = vec4 ? view.dim / 4 : view.dim;
  int lanes = 1;
  int lane_shift = 0;
  while (lanes < kWarpSize && lanes < chunks) {
    lanes *= 2;
    ++lane_shift;
  }
  const int64_t runs = (l.num_positions + kForwardRun - 1) / kForwardRun;
  const int blocks = Blocks(runs * lanes);
  if (vec4) {
    PzscForwardKernel<true><<<blocks, kThreadsPerBlock, 0, stream>>>(
        l, lane_shift, t, o, quantization);
  } else {
    PzscForwardKernel<false><<<blocks, kThreadsPerBlock, 0, stream>>>(
        l, lane_shift, t, o, quantization);
  }
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// Scratch of the backward, carved from one allocation.
template <typename Key>
struct Scratch {
  Key* keys;
  Key* sorted_keys;
  int32_t* positions;
  int32_t* sorted;
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
      static_cast<Key*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), n, 0, bits));
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
  const size_t chunk_bytes = Align(MaxChunks(n) * sizeof(int32_t));
  const size_t long_bytes = Align(2 * MaxLongRuns(n) * sizeof(int32_t));
  const size_t partial_bytes = Align(MaxChunks(n) * dim * sizeof(float));
  const size_t counter_bytes = Align(kNumCounters * sizeof(int32_t));
  const size_t total = 3 * key_bytes + 4 * int_bytes + 2 * chunk_bytes +
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
  s->positions = reinterpret_cast<int32_t*>(take(int_bytes));
  s->sorted = reinterpret_cast<int32_t*>(take(int_bytes));
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
                       UpdateArgs args, Key rows, int bits) {
  const int64_t n = args.l.num_positions;
  args.sorted = s.sorted;
  PzscKeysKernel<Key><<<Blocks(n), kThreadsPerBlock, 0, stream>>>(
      args.l, rows, s.keys, s.positions);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  size_t bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      s.cub, bytes, s.keys, s.sorted_keys, s.positions, s.sorted, n, 0, bits,
      stream));
  // Lengths past the run count are read by the scan: zero them.
  PZSC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(s.run_lengths, 0, n * sizeof(int32_t), stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      s.counters, 0, kNumCounters * sizeof(int32_t), stream));
  bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRunLengthEncode::Encode(
      s.cub, bytes, s.sorted_keys, s.run_keys, s.run_lengths, s.counters, n,
      stream));
  bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceScan::ExclusiveSum(
      s.cub, bytes, s.run_lengths, s.run_offsets, n, stream));
  PzscUpdateKernel<kOpt, Key>
      <<<Blocks(n * kWarpSize), kThreadsPerBlock, 0, stream>>>(
          args, rows, s.run_keys, s.run_offsets, s.run_lengths, s.counters,
          s.chunk_begin, s.chunk_end, s.long_runs);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  PzscChunkKernel<<<Blocks(MaxChunks(n) * kWarpSize), kThreadsPerBlock, 0,
                    stream>>>(args, s.counters, s.chunk_begin, s.chunk_end,
                              s.partial);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  PzscFinishKernel<kOpt, Key>
      <<<Blocks(MaxLongRuns(n) * kWarpSize), kThreadsPerBlock, 0, stream>>>(
          args, s.run_keys, s.run_lengths, s.counters, s.long_runs,
          s.partial);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
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
  if (auto err = CheckGradOperands(kSlots, NumHyperparameters(kOpt), view,
                                   activation_grad, table, rest, table_out,
                                   slots_out, clip, clip_min, clip_max);
      err.failure()) {
    return err;
  }
  if (auto err = CheckPositions(view); err.failure()) return err;
  if (auto err = CheckRowPointers(stream, view); err.failure()) return err;
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

  // Nothing is written before this point.
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
  args.table = table_out->typed_data<float>();
  float* slots[PZSC_SLOT_ARGS_MAX] = {nullptr, nullptr};  // slot0, slot1
  for (int i = 0; i < kSlots; ++i) {
    ffi::Result<ffi::AnyBuffer> slot_out = *slots_out.get<ffi::AnyBuffer>(i);
    PZSC_CUDA_RETURN_IF_ERROR(copy(*rest.get<ffi::AnyBuffer>(i), *slot_out));
    slots[i] = slot_out->typed_data<float>();
  }
  if (!work) return ffi::Error::Success();
  args.slot0 = slots[0];
  args.slot1 = slots[1];
  args.grad = activation_grad.typed_data<float>();
  args.hyper = rest.get<ffi::AnyBuffer>(kSlots)->typed_data<float>();
  args.multiply_linear_by_learning_rate = multiply_linear_by_learning_rate;
  args.clip = clip;
  args.clip_min = clip_min;
  args.clip_max = clip_max;
  return narrow ? RunBackward<kOpt, uint32_t>(stream, s32, args,
                                               static_cast<uint32_t>(rows), bits)
                : RunBackward<kOpt, uint64_t>(stream, s64, args, rows, bits);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparseDenseMatmulCuda, ForwardCudaImpl,
    BindCooOperands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
        .Ret<ffi::AnyBuffer>()  // out
        .Attr<LayoutAttrs>("layout")
        .Attr<Quantization>("quantization"));

#define PZSC_DEFINE_CUDA_GRAD_HANDLER(Name, name, num_slots, \
                                      num_hyperparameters)   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                             \
      SparseDenseMatmulGrad##Name##Cuda,                     \
      GradCudaImpl<Optimizer::k##Name>,                      \
      PZSC_BIND_GRAD_OPERANDS(                               \
          ffi::Ffi::Bind()                                   \
              .Ctx<ffi::PlatformStream<cudaStream_t>>()      \
              .Ctx<ffi::ScratchAllocator>()));

PZSC_OPTIMIZERS(PZSC_DEFINE_CUDA_GRAD_HANDLER)

#undef PZSC_DEFINE_CUDA_GRAD_HANDLER

}  // namespace pzsc
