// Hashed-table map handler: pzsc_hashed_map_resolve (CUDA).
//
// The CPU handler's contract (hashed_map.cc: operands ids s32[S, n, K],
// K = 4 or 3, map_ids and map_seen s32[S, C, 2] aliased to the results
// new_map_ids and new_map_seen, step s32[]; attributes policy, parameter,
// train, regions s64[2 T]; results slots and reset s32[S, n], the new map,
// counts s32[S, 5]; the same checks and errors) and its results bit for
// bit, registered for the platform "CUDA" (module.cc).
//
// Check. Attributes and shapes are checked on the host first, in the CPU
// handler's order and words. The homes need the ids: a kernel finds the
// first present id (shard-major) whose home is at or beyond its region's
// rows, the host waits for that one word (a stream synchronisation per
// call) and returns the CPU handler's error before anything is written.
// Only then are the map arrays copied (when XLA gave distinct buffers) and
// the kernels below launched; they also read such an id as no id, so no
// buffer contents lead outside a buffer.
//
// Sort. Ids are flat positions j = shard * n + i. Two stable CUB radix
// sorts order the positions: by the id's 64-bit word (high word above low
// word, unsigned), then by the class key shard * classes + class (the
// id's table, or classes - 1 for no id). Both being stable, each shard's
// positions come in (table, id as unsigned 64-bit, input index) order, its
// absent ids last, and shard k holds sorted positions [k n, (k + 1) n). A
// group is a run of equal (class key, id words); its head, the group's
// first sorted position, has its smallest input index. An inclusive
// max-scan of (q if q heads a group, else -1) gives every sorted position
// q its group's head.
//
// Hits. One thread per head scans its window (at most kProbeSlots slots,
// from its head's home) in the map before the call and keeps the first
// slot holding the id; in training it also forms the hit's new count from
// the map before the call, and a second kernel writes every hit's (step,
// count): two heads that share a slot (regions that overlap) write the same
// values.
//
// Misses. One warp per shard walks the shard's heads in sorted order, 32
// positions at a time (each lane decoding one), and gives each miss its
// slot one after another, since each may take a slot the next would have
// taken: the lanes read the window's slots (two each), a ballot finds the
// first free one, else a butterfly of shuffles finds the victim with the
// smallest (score, last step, window position), a total order, so every
// lane gets the same one. Lane 0 writes the map, the head's slot and reset
// flag, and keeps the shard's counters. In inference the warp counts the
// misses (unseen) and writes nothing else.
//
// Spread. Every sorted position takes its head's slot (no id: -1).
//
// Scratch (O(S n): keys, positions, heads, slots; the regions) comes from
// XLA's allocator. Every CUDA call's status is checked; a failure is
// returned as an error naming the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace pzsc {

namespace ffi = xla::ffi;

namespace {

// The policies, in the order of hashed.POLICIES.
enum class Policy : int32_t { kLru = 0, kLfu = 1, kTtl = 2, kNone = 3 };

// hashed.EMPTY: the last step of a free slot.
constexpr int32_t kEmpty = -1;
// hashed.REFUSED: the slot of an id the map gives no row.
constexpr int32_t kRefused = -1;
// hashed.PROBE_SLOTS: slots of an id's window.
constexpr int kProbeSlots = 64;
// int32 words per id: hashed.KEY_WORDS (with the table), or one fewer.
constexpr int64_t kKeyWords = 4;
constexpr int64_t kKeyWordsNoTable = 3;
// int32 words per map slot; counters (hashed.COUNTERS: held, inserted,
// evicted, refused, unseen).
constexpr int64_t kSlotWords = 2;
constexpr int64_t kNumCounters = 5;
enum Counter { kHeld = 0, kInserted, kEvicted, kRefusedIds, kUnseen };
// Halvings of a decayed count stop at this many.
constexpr int32_t kMaxHalvings = 31;
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();
// Table indices are int32 words: at most this many tables are reachable.
constexpr int64_t kMaxTables = int64_t{1} << 31;

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreadsPerBlock = 256;
// Upper bound on the blocks of one launch (the kernels loop over the rest).
constexpr int64_t kMaxBlocks = 1 << 20;
// The check's word while no id is refused.
constexpr unsigned long long kNoBadId = ~0ull;

constexpr char kWhere[] = "pzsc_hashed_map_resolve: ";

// ---------------------------------------------------------------------------
// The map's rules (hashed_map.cc, device.hashed).

// a - b with int32 wrap-around (as XLA computes it).
__device__ __forceinline__ int32_t WrapSub(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) -
                              static_cast<uint32_t>(b));
}

// `count` halved once per `decay_steps` steps since `last` (0: never);
// device.hashed.decayed. A step difference <= 0 halves 0 times.
__device__ __forceinline__ int32_t Decayed(int32_t count, int32_t last,
                                           int32_t step,
                                           int32_t decay_steps) {
  if (decay_steps == 0) return count;
  const int32_t since = WrapSub(step, last);
  const int32_t halvings =
      since <= 0 ? 0 : min(since / decay_steps, kMaxHalvings);
  return count >> halvings;  // Arithmetic, as XLA's shift of int32.
}

// What every kernel reads of the call.
struct Params {
  const int32_t* ids;      // [S * n, key_words]
  int32_t* map_ids;        // [S, C, 2] (the result new_map_ids)
  int32_t* map_seen;       // [S, C, 2] (the result new_map_seen)
  const int32_t* step;     // The operand step (device).
  const int64_t* regions;  // [2 num_tables] (device): first row, rows.
  int64_t num_tables;
  int64_t n;         // Ids per shard.
  int64_t capacity;  // C.
  int64_t key_words;
  int64_t num_ids;  // S * n.
  int64_t classes;  // min(num_tables, kMaxTables) + 1: the class keys'.
  Policy policy;
  int32_t ttl_steps;    // ttl only.
  int32_t decay_steps;  // lfu only; 0: no decay.
  bool train;
};

// The slots of an id's window in its table's region.
struct Window {
  int64_t first;  // The region's first row.
  int64_t rows;   // The region's rows.
  int64_t home;   // In [0, rows).
  int width;      // min(rows, kProbeSlots).
};

// The slot of window position i (home < rows, i < width <= rows).
__device__ __forceinline__ int64_t WindowSlot(const Window& w, int i) {
  const int64_t s = w.home + i;
  return w.first + (s >= w.rows ? s - w.rows : s);
}

// The table of the id at flat position j (hashed_map.cc's TableOf), or -1
// for no id (home < 0, or a table outside the regions).
__device__ __forceinline__ int64_t TableOf(const Params& p, int64_t j) {
  const int32_t* id = p.ids + j * p.key_words;
  if (id[2] < 0) return -1;
  const int64_t table = p.key_words == kKeyWords ? id[3] : 0;
  return table < 0 || table >= p.num_tables ? -1 : table;
}

// A decoded id: its words, its table (-1: no id) and its window.
struct Id {
  int32_t lo;
  int32_t hi;
  int64_t table;
  Window window;
};

// The id at flat position j. A home at or beyond its region's rows (which
// the check refuses before any of these kernels runs) reads as no id.
__device__ __forceinline__ Id DecodeId(const Params& p, int64_t j) {
  const int32_t* words = p.ids + j * p.key_words;
  Id id{words[0], words[1], TableOf(p, j), Window{0, 0, 0, 0}};
  if (id.table < 0) return id;
  const int64_t first = p.regions[2 * id.table];
  const int64_t rows = p.regions[2 * id.table + 1];
  const int64_t home = words[2];
  if (home >= rows) {
    id.table = -1;
    return id;
  }
  id.window = Window{first, rows, home,
                     static_cast<int>(min(rows, int64_t{kProbeSlots}))};
  return id;
}

// The id's class: its table, or classes - 1 for no id.
__device__ __forceinline__ uint64_t ClassOf(const Params& p, const Id& id) {
  return id.table < 0 ? static_cast<uint64_t>(p.classes - 1)
                      : static_cast<uint64_t>(id.table);
}

// Whether a sorted class key is that of no id.
__device__ __forceinline__ bool IsAbsent(const Params& p, uint64_t key) {
  const uint64_t classes = static_cast<uint64_t>(p.classes);
  return key % classes == classes - 1;
}

// ---------------------------------------------------------------------------
// Kernels. Grid-stride loops over flat positions j or sorted positions q,
// both in [0, num_ids); every array of scratch is [num_ids] unless said.

// *first_bad = the smallest j of a present id whose home is at or beyond
// its table's rows (kNoBadId: none); *first_bad starts at kNoBadId.
__global__ void PzscHashedCheckKernel(Params p,
                                      unsigned long long* first_bad) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       j < p.num_ids; j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t table = TableOf(p, j);
    if (table >= 0 && p.ids[j * p.key_words + 2] >= p.regions[2 * table + 1]) {
      atomicMin(first_bad, static_cast<unsigned long long>(j));
    }
  }
}

// keys[j] = the id's 64-bit word (high word above low word, unsigned);
// positions[j] = j.
__global__ void PzscHashedWordKeysKernel(Params p, uint64_t* keys,
                                         int32_t* positions) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       j < p.num_ids; j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t* id = p.ids + j * p.key_words;
    keys[j] = static_cast<uint64_t>(static_cast<uint32_t>(id[1])) << 32 |
              static_cast<uint32_t>(id[0]);
    positions[j] = static_cast<int32_t>(j);
  }
}

// keys[q] = the class key (shard * classes + class) of the position by_id[q].
__global__ void PzscHashedClassKeysKernel(Params p,
                                          const int32_t* __restrict__ by_id,
                                          uint64_t* keys) {
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       q < p.num_ids; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = by_id[q];
    const uint64_t shard = static_cast<uint64_t>(j / p.n);
    keys[q] = shard * static_cast<uint64_t>(p.classes) +
              ClassOf(p, DecodeId(p, j));
  }
}

// head_in[q] = q if the sorted position q heads a group (a present id whose
// class key or words differ from position q - 1's), else -1. order: the
// positions sorted; class_keys: their class keys.
__global__ void PzscHashedHeadsKernel(Params p,
                                      const int32_t* __restrict__ order,
                                      const uint64_t* __restrict__ class_keys,
                                      int32_t* head_in) {
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       q < p.num_ids; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t key = class_keys[q];
    bool first = !IsAbsent(p, key);
    if (first && q > 0 && class_keys[q - 1] == key) {
      const int32_t* id = p.ids + order[q] * p.key_words;
      const int32_t* prev = p.ids + order[q - 1] * p.key_words;
      first = id[0] != prev[0] || id[1] != prev[1];
    }
    head_in[q] = first ? static_cast<int32_t>(q) : -1;
  }
}

// The running maximum of the scan of heads.
struct MaxOp {
  __host__ __device__ __forceinline__ int32_t operator()(int32_t a,
                                                         int32_t b) const {
    return a > b ? a : b;
  }
};

// For every head q (head[q] == q): group_slot[q] = the first slot of its
// window holding its id in the map before the call, or kRefused; in
// training, bumped[q] = a hit's new count (decayed + 1, saturating). The
// map is read only.
__global__ void PzscHashedHitsKernel(Params p,
                                     const int32_t* __restrict__ order,
                                     const int32_t* __restrict__ head,
                                     int32_t* group_slot, int32_t* bumped) {
  const int32_t step = *p.step;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       q < p.num_ids; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (head[q] != q) continue;
    const Id id = DecodeId(p, order[q]);
    const int64_t shard = q / p.n;  // Shard k's sorted positions: [k n, ...).
    const int32_t* map_ids = p.map_ids + shard * p.capacity * kSlotWords;
    const int32_t* seen = p.map_seen + shard * p.capacity * kSlotWords;
    int32_t slot = kRefused;
    for (int i = 0; i < id.window.width; ++i) {
      const int64_t s = WindowSlot(id.window, i);
      if (seen[s * kSlotWords] != kEmpty && map_ids[s * kSlotWords] == id.lo &&
          map_ids[s * kSlotWords + 1] == id.hi) {
        slot = static_cast<int32_t>(s);
        break;
      }
    }
    group_slot[q] = slot;
    if (p.train && slot >= 0) {
      const int32_t* old = seen + slot * kSlotWords;
      const int32_t count = Decayed(old[1], old[0], step, p.decay_steps);
      bumped[q] = count < kInt32Max ? count + 1 : count;
    }
  }
}

// Training: every hit's slot gets (step, bumped[q]), for every head q with
// a slot (all of them hits: no miss has one yet).
__global__ void PzscHashedBumpKernel(Params p,
                                     const int32_t* __restrict__ head,
                                     const int32_t* __restrict__ group_slot,
                                     const int32_t* __restrict__ bumped) {
  const int32_t step = *p.step;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       q < p.num_ids; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (head[q] != q || group_slot[q] < 0) continue;
    const int64_t shard = q / p.n;
    int32_t* seen = p.map_seen + (shard * p.capacity + group_slot[q]) *
                                     kSlotWords;
    seen[0] = step;
    seen[1] = bumped[q];
  }
}

// A victim candidate: smaller (score, last, pos) first; pos == kProbeSlots:
// none.
struct Victim {
  int32_t score;
  int32_t last;
  int32_t pos;
};

__device__ __forceinline__ bool Before(const Victim& a, const Victim& b) {
  if (a.pos == kProbeSlots) return false;
  if (b.pos == kProbeSlots) return true;
  if (a.score != b.score) return a.score < b.score;
  if (a.last != b.last) return a.last < b.last;
  return a.pos < b.pos;
}

// The first of the lanes' candidates, in every lane (a butterfly: each step
// keeps the first of two, and the order is total). The whole warp calls it.
__device__ __forceinline__ Victim WarpFirst(Victim v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) {
    const Victim other{__shfl_xor_sync(kFullMask, v.score, o),
                       __shfl_xor_sync(kFullMask, v.last, o),
                       __shfl_xor_sync(kFullMask, v.pos, o)};
    if (Before(other, v)) v = other;
  }
  return v;
}

// A miss's window position (hashed_map.cc's PickSlot, device.hashed._pick):
// the first free slot; else a victim the policy allows (seen before this
// step; ttl: last seen more than ttl_steps steps ago) with the smallest
// score (lfu: the decayed count; lru and ttl: 0), then last step, then
// window position; else -1. *evicts: a victim was taken. Lane l reads
// window positions l and l + 32; the whole warp calls it and gets the same
// answer.
__device__ __forceinline__ int PickPosition(const Params& p,
                                            const int32_t* seen,
                                            const Window& w, int32_t step,
                                            int lane, bool* evicts) {
  int32_t last[2] = {0, 0};
  int32_t count[2] = {0, 0};
  bool in[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = lane + h * kWarpSize;
    in[h] = pos < w.width;
    if (in[h]) {
      const int64_t s = WindowSlot(w, pos);
      last[h] = seen[s * kSlotWords];
      count[h] = seen[s * kSlotWords + 1];
    }
  }
  *evicts = false;
  const unsigned free0 = __ballot_sync(kFullMask, in[0] && last[0] == kEmpty);
  const unsigned free1 = __ballot_sync(kFullMask, in[1] && last[1] == kEmpty);
  if (free0 != 0) return __ffs(free0) - 1;
  if (free1 != 0) return kWarpSize + __ffs(free1) - 1;
  if (p.policy == Policy::kNone) return -1;
  Victim best{0, 0, kProbeSlots};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!in[h] || last[h] >= step) continue;  // Seen in this step or later.
    if (p.policy == Policy::kTtl && WrapSub(step, last[h]) <= p.ttl_steps) {
      continue;
    }
    const int32_t score = p.policy == Policy::kLfu
                              ? Decayed(count[h], last[h], step, p.decay_steps)
                              : 0;
    const Victim mine{score, last[h], lane + h * kWarpSize};
    if (Before(mine, best)) best = mine;
  }
  best = WarpFirst(best);
  if (best.pos == kProbeSlots) return -1;
  *evicts = true;
  return best.pos;
}

// One warp (block of kWarpSize threads) per shard, blockIdx.x: the misses
// (heads without a slot) of its sorted positions, in order. Training: each
// takes PickPosition's slot (the map's words, (step, 1), group_slot[q] and
// reset[order[q]] = 1) or stays refused. counts[shard] = the shard's held,
// inserted, evicted, refused and unseen (inference: the misses) changes.
__global__ void __launch_bounds__(kWarpSize)
    PzscHashedMissKernel(Params p, const int32_t* __restrict__ order,
                         const int32_t* __restrict__ head, int32_t* group_slot,
                         int32_t* reset, int32_t* counts) {
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t shard = blockIdx.x;
  const int32_t step = *p.step;
  int32_t* map_ids = p.map_ids + shard * p.capacity * kSlotWords;
  int32_t* seen = p.map_seen + shard * p.capacity * kSlotWords;
  int64_t tally[kNumCounters] = {};
  const int64_t end = (shard + 1) * p.n;
  for (int64_t base = shard * p.n; base < end; base += kWarpSize) {
    const int64_t q = base + lane;
    const bool miss = q < end && head[q] == q && group_slot[q] < 0;
    unsigned misses = __ballot_sync(kFullMask, miss);
    if (!p.train) {
      tally[kUnseen] += __popc(misses);
      continue;
    }
    int32_t j = 0;
    Id mine{0, 0, -1, Window{0, 0, 0, 0}};
    if (miss) {
      j = order[q];
      mine = DecodeId(p, j);
    }
    while (misses != 0) {
      const int src = __ffs(misses) - 1;
      misses &= misses - 1;
      const int32_t at = __shfl_sync(kFullMask, j, src);
      const int32_t lo = __shfl_sync(kFullMask, mine.lo, src);
      const int32_t hi = __shfl_sync(kFullMask, mine.hi, src);
      const Window w{__shfl_sync(kFullMask, mine.window.first, src),
                     __shfl_sync(kFullMask, mine.window.rows, src),
                     __shfl_sync(kFullMask, mine.window.home, src),
                     __shfl_sync(kFullMask, mine.window.width, src)};
      bool evicts = false;
      const int pos = PickPosition(p, seen, w, step, lane, &evicts);
      if (lane == 0) {
        if (pos < 0) {
          ++tally[kRefusedIds];
        } else {
          const int64_t s = WindowSlot(w, pos);
          map_ids[s * kSlotWords] = lo;
          map_ids[s * kSlotWords + 1] = hi;
          seen[s * kSlotWords] = step;
          seen[s * kSlotWords + 1] = 1;
          group_slot[base + src] = static_cast<int32_t>(s);
          reset[at] = 1;
          // Constant indices keep the tally in registers.
          if (evicts) {
            ++tally[kEvicted];
          } else {
            ++tally[kHeld];
          }
          ++tally[kInserted];
        }
      }
      // The next miss reads the map as lane 0 left it.
      __syncwarp();
    }
  }
  if (lane == 0) {
    for (int64_t c = 0; c < kNumCounters; ++c) {
      counts[shard * kNumCounters + c] = static_cast<int32_t>(tally[c]);
    }
  }
}

// slots[order[q]] = its group's slot, group_slot[head[q]], or kRefused for
// no id.
__global__ void PzscHashedSpreadKernel(Params p,
                                       const int32_t* __restrict__ order,
                                       const uint64_t* __restrict__ class_keys,
                                       const int32_t* __restrict__ head,
                                       const int32_t* __restrict__ group_slot,
                                       int32_t* slots) {
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x +
                   threadIdx.x;
       q < p.num_ids; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    slots[order[q]] =
        IsAbsent(p, class_keys[q]) ? kRefused : group_slot[head[q]];
  }
}

// ---------------------------------------------------------------------------
// Host side.

ffi::Error CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kWhere) + what + ": " +
                              cudaGetErrorString(err));
}

#define PZSC_CUDA_RETURN_IF_ERROR(call)                           \
  if (ffi::Error err = CudaError((call), #call); err.failure()) { \
    return err;                                                   \
  }

int Blocks(int64_t threads) {
  const int64_t blocks = (threads + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<int>(std::clamp<int64_t>(blocks, 1, kMaxBlocks));
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

// An error unless `dims` is `want`; `name` goes into the message.
ffi::Error CheckShape(ffi::Span<const int64_t> dims,
                      std::vector<int64_t> want, const char* name) {
  if (std::equal(dims.begin(), dims.end(), want.begin(), want.end())) {
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument(std::string(kWhere) + name +
                                     " must have shape " + Shape(want) +
                                     ", got " + Shape(dims));
}

// Checks the attributes and the ids' words and map's size, as the CPU
// handler's MakeConfig, and fills what the kernels read of them.
ffi::Error CheckAttributes(int32_t policy, int32_t parameter, int32_t train,
                           ffi::Span<const int64_t> regions,
                           int64_t key_words, int64_t capacity, Params* p) {
  const std::string where = kWhere;
  if (policy < static_cast<int32_t>(Policy::kLru) ||
      policy > static_cast<int32_t>(Policy::kNone)) {
    return ffi::Error::InvalidArgument(
        where + "policy must be 0 (lru), 1 (lfu), 2 (ttl) or 3 (none), got " +
        std::to_string(policy));
  }
  if (parameter < 0) {
    return ffi::Error::InvalidArgument(
        where + "parameter (ttl_steps or decay_steps) must be >= 0, got " +
        std::to_string(parameter));
  }
  if (train != 0 && train != 1) {
    return ffi::Error::InvalidArgument(
        where + "train must be 0 or 1, got " + std::to_string(train));
  }
  if (key_words != kKeyWords && key_words != kKeyWordsNoTable) {
    return ffi::Error::InvalidArgument(
        where +
        "ids must have 4 words per id (low, high, home, table) or 3 (no "
        "table), got " +
        std::to_string(key_words));
  }
  if (capacity > int64_t{kInt32Max}) {
    return ffi::Error::InvalidArgument(
        where +
        "a shard holds at most 2^31 - 1 slots (int32 slot numbers), got " +
        std::to_string(capacity));
  }
  if (regions.size() == 0 || regions.size() % 2 != 0) {
    return ffi::Error::InvalidArgument(
        where +
        "regions must hold (first row, rows) for each table (at least "
        "one), got " +
        std::to_string(regions.size()) + " values");
  }
  for (size_t t = 0; t < regions.size() / 2; ++t) {
    const int64_t first = regions[2 * t];
    const int64_t rows = regions[2 * t + 1];
    if (first < 0 || rows < 0 || first > capacity - rows) {
      return ffi::Error::InvalidArgument(
          where + "table " + std::to_string(t) + "'s region (first row " +
          std::to_string(first) + ", " + std::to_string(rows) +
          " rows) is not within the shard's " + std::to_string(capacity) +
          " rows");
    }
  }
  const Policy pol = static_cast<Policy>(policy);
  p->policy = pol;
  p->ttl_steps = pol == Policy::kTtl ? parameter : 0;
  p->decay_steps = pol == Policy::kLfu ? parameter : 0;
  p->train = train == 1;
  p->key_words = key_words;
  p->capacity = capacity;
  p->num_tables = static_cast<int64_t>(regions.size() / 2);
  p->classes = std::min(p->num_tables, kMaxTables) + 1;
  return ffi::Error::Success();
}

// Scratch of a call, carved from one allocation.
struct Scratch {
  int64_t* regions;               // [2 num_tables]
  unsigned long long* first_bad;  // PzscHashedCheckKernel's word.
  uint64_t* keys;                 // Word keys, then class keys.
  uint64_t* sorted_keys;          // Sorted word keys, then class keys.
  int32_t* positions;             // Flat positions, then `order`.
  int32_t* by_id;                 // Positions sorted by word key.
  int32_t* head_in;               // PzscHashedHeadsKernel's.
  int32_t* head;                  // Each sorted position's head.
  int32_t* group_slot;            // Per head: its slot.
  int32_t* bumped;                // Per hit head: its new count.
  void* cub;
  size_t cub_bytes;
};

size_t Align(size_t v) { return (v + 255) / 256 * 256; }

ffi::Error AllocateScratch(ffi::ScratchAllocator& allocator, int64_t num_ids,
                           int64_t num_tables, Scratch* s) {
  const int items = static_cast<int>(num_ids);
  size_t sort_bytes = 0, scan_bytes = 0;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const uint64_t*>(nullptr),
      static_cast<uint64_t*>(nullptr), static_cast<const int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), items));
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceScan::InclusiveScan(
      nullptr, scan_bytes, static_cast<const int32_t*>(nullptr),
      static_cast<int32_t*>(nullptr), MaxOp{}, items));
  s->cub_bytes = std::max(sort_bytes, scan_bytes);
  const size_t region_bytes = Align(2 * num_tables * sizeof(int64_t));
  const size_t word_bytes = Align(sizeof(unsigned long long));
  const size_t key_bytes = Align(num_ids * sizeof(uint64_t));
  const size_t int_bytes = Align(num_ids * sizeof(int32_t));
  const size_t total = region_bytes + word_bytes + 2 * key_bytes +
                       6 * int_bytes + Align(s->cub_bytes);
  // XLA's allocator takes alignments up to 16: ask for 256 bytes more and
  // align the start here.
  std::optional<void*> base = allocator.Allocate(total + 256, 16);
  if (!base.has_value() || *base == nullptr) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(kWhere) + "could not allocate " +
                          std::to_string(total) + " bytes of scratch");
  }
  char* at = reinterpret_cast<char*>(
      Align(reinterpret_cast<uintptr_t>(*base)));
  auto take = [&at](size_t bytes) {
    char* p = at;
    at += bytes;
    return p;
  };
  s->regions = reinterpret_cast<int64_t*>(take(region_bytes));
  s->first_bad = reinterpret_cast<unsigned long long*>(take(word_bytes));
  s->keys = reinterpret_cast<uint64_t*>(take(key_bytes));
  s->sorted_keys = reinterpret_cast<uint64_t*>(take(key_bytes));
  s->positions = reinterpret_cast<int32_t*>(take(int_bytes));
  s->by_id = reinterpret_cast<int32_t*>(take(int_bytes));
  s->head_in = reinterpret_cast<int32_t*>(take(int_bytes));
  s->head = reinterpret_cast<int32_t*>(take(int_bytes));
  s->group_slot = reinterpret_cast<int32_t*>(take(int_bytes));
  s->bumped = reinterpret_cast<int32_t*>(take(int_bytes));
  s->cub = take(Align(s->cub_bytes));
  return ffi::Error::Success();
}

// Uploads the regions and runs PzscHashedCheckKernel; waits for its word
// and returns the CPU handler's error for the first present id whose home
// is at or beyond its table's rows.
ffi::Error CheckHomes(cudaStream_t stream, const Params& p,
                      ffi::Span<const int64_t> regions, const Scratch& s) {
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      s.regions, regions.begin(), regions.size() * sizeof(int64_t),
      cudaMemcpyHostToDevice, stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      s.first_bad, 0xff, sizeof(unsigned long long), stream));
  PzscHashedCheckKernel<<<Blocks(p.num_ids), kThreadsPerBlock, 0, stream>>>(
      p, s.first_bad);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  unsigned long long first_bad = kNoBadId;
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&first_bad, s.first_bad,
                                            sizeof(first_bad),
                                            cudaMemcpyDeviceToHost, stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (first_bad == kNoBadId) return ffi::Error::Success();
  const int64_t j = static_cast<int64_t>(first_bad);
  int32_t id[kKeyWords] = {0, 0, 0, 0};
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      id, p.ids + j * p.key_words, p.key_words * sizeof(int32_t),
      cudaMemcpyDeviceToHost, stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  const int64_t table = p.key_words == kKeyWords ? id[3] : 0;
  return ffi::Error::InvalidArgument(
      std::string(kWhere) + "id " + std::to_string(j % p.n) + " of shard " +
      std::to_string(j / p.n) + " (table " + std::to_string(table) +
      ") has home " + std::to_string(id[2]) + ", outside its table's " +
      std::to_string(regions[2 * table + 1]) +
      " rows (homes are in [0, rows); < 0 for no id)");
}

// Sorts, finds hits, bumps them (training), places the misses and spreads
// the slots (see the top of the file); the map is in p's result buffers.
ffi::Error Resolve(cudaStream_t stream, const Params& p, const Scratch& s,
                   int32_t* slots, int32_t* reset, int32_t* counts) {
  const int blocks = Blocks(p.num_ids);
  const int items = static_cast<int>(p.num_ids);
  PzscHashedWordKeysKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      p, s.keys, s.positions);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  size_t bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      s.cub, bytes, s.keys, s.sorted_keys, s.positions, s.by_id, items, 0,
      64, stream));
  PzscHashedClassKeysKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      p, s.by_id, s.keys);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  // Class keys are below S * classes.
  const uint64_t max_key =
      static_cast<uint64_t>(p.num_ids / p.n) *
          static_cast<uint64_t>(p.classes) -
      1;
  int bits = 1;
  while (bits < 64 && (max_key >> bits) != 0) ++bits;
  int32_t* order = s.positions;
  bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
      s.cub, bytes, s.keys, s.sorted_keys, s.by_id, order, items, 0, bits,
      stream));
  PzscHashedHeadsKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      p, order, s.sorted_keys, s.head_in);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  bytes = s.cub_bytes;
  PZSC_CUDA_RETURN_IF_ERROR(cub::DeviceScan::InclusiveScan(
      s.cub, bytes, s.head_in, s.head, MaxOp{}, items, stream));
  PzscHashedHitsKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      p, order, s.head, s.group_slot, s.bumped);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (p.train) {
    PzscHashedBumpKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
        p, s.head, s.group_slot, s.bumped);
    PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  const unsigned num_shards = static_cast<unsigned>(p.num_ids / p.n);
  PzscHashedMissKernel<<<num_shards, kWarpSize, 0, stream>>>(
      p, order, s.head, s.group_slot, reset, counts);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  PzscHashedSpreadKernel<<<blocks, kThreadsPerBlock, 0, stream>>>(
      p, order, s.sorted_keys, s.head, s.group_slot, slots);
  PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error HashedMapResolveCudaImpl(
    cudaStream_t stream, ffi::ScratchAllocator scratch,
    ffi::BufferR3<ffi::S32> ids, ffi::BufferR3<ffi::S32> map_ids,
    ffi::BufferR3<ffi::S32> map_seen, ffi::BufferR0<ffi::S32> step,
    ffi::ResultBufferR2<ffi::S32> slots, ffi::ResultBufferR2<ffi::S32> reset,
    ffi::ResultBufferR3<ffi::S32> new_map_ids,
    ffi::ResultBufferR3<ffi::S32> new_map_seen,
    ffi::ResultBufferR2<ffi::S32> counts, int32_t policy, int32_t parameter,
    int32_t train, ffi::Span<const int64_t> regions) {
  const int64_t num_shards = ids.dimensions()[0];
  const int64_t n = ids.dimensions()[1];
  const int64_t key_words = ids.dimensions()[2];
  const int64_t capacity = map_ids.dimensions()[1];
  Params p{};
  if (auto err = CheckAttributes(policy, parameter, train, regions,
                                 key_words, capacity, &p);
      err.failure()) {
    return err;
  }
  for (auto [dims, name] :
       {std::pair{map_ids.dimensions(), "map_ids"},
        std::pair{map_seen.dimensions(), "map_seen"},
        std::pair{new_map_ids->dimensions(), "new_map_ids"},
        std::pair{new_map_seen->dimensions(), "new_map_seen"}}) {
    if (auto err = CheckShape(dims, {num_shards, capacity, kSlotWords}, name);
        err.failure()) {
      return err;
    }
  }
  for (auto [dims, name] : {std::pair{slots->dimensions(), "slots"},
                            std::pair{reset->dimensions(), "reset"}}) {
    if (auto err = CheckShape(dims, {num_shards, n}, name); err.failure()) {
      return err;
    }
  }
  if (auto err = CheckShape(counts->dimensions(),
                            {num_shards, kNumCounters}, "counts");
      err.failure()) {
    return err;
  }
  const int64_t num_ids = num_shards * n;
  // Sorted positions and heads are int32 (and CUB's item counts int).
  if (num_ids > int64_t{kInt32Max}) {
    return ffi::Error::InvalidArgument(
        std::string(kWhere) +
        "the CUDA handler takes at most 2147483647 ids (shards x ids per "
        "shard), got " +
        std::to_string(num_ids));
  }
  p.ids = ids.typed_data();
  p.map_ids = new_map_ids->typed_data();
  p.map_seen = new_map_seen->typed_data();
  p.step = step.typed_data();
  p.n = n;
  p.num_ids = num_ids;
  Scratch s{};
  if (num_ids > 0) {
    if (auto err = AllocateScratch(scratch, num_ids, p.num_tables, &s);
        err.failure()) {
      return err;
    }
    p.regions = s.regions;
    // Nothing is written before this check passes.
    if (auto err = CheckHomes(stream, p, regions, s); err.failure()) {
      return err;
    }
  }

  auto copy = [&](const ffi::BufferR3<ffi::S32>& from, auto& to) {
    if (from.size_bytes() == 0 || from.untyped_data() == to->untyped_data()) {
      return cudaSuccess;
    }
    return cudaMemcpyAsync(to->untyped_data(), from.untyped_data(),
                           from.size_bytes(), cudaMemcpyDeviceToDevice,
                           stream);
  };
  PZSC_CUDA_RETURN_IF_ERROR(copy(map_ids, new_map_ids));
  PZSC_CUDA_RETURN_IF_ERROR(copy(map_seen, new_map_seen));
  if (counts->size_bytes() > 0) {
    PZSC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts->untyped_data(), 0,
                                              counts->size_bytes(), stream));
  }
  if (num_ids == 0) return ffi::Error::Success();
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(reset->untyped_data(), 0,
                                            reset->size_bytes(), stream));
  return Resolve(stream, p, s, slots->typed_data(), reset->typed_data(),
                 counts->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HashedMapResolveCuda, HashedMapResolveCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Ctx<ffi::ScratchAllocator>()
        .Arg<ffi::BufferR3<ffi::S32>>()  // ids
        .Arg<ffi::BufferR3<ffi::S32>>()  // map_ids
        .Arg<ffi::BufferR3<ffi::S32>>()  // map_seen
        .Arg<ffi::BufferR0<ffi::S32>>()  // step
        .Ret<ffi::BufferR2<ffi::S32>>()  // slots
        .Ret<ffi::BufferR2<ffi::S32>>()  // reset
        .Ret<ffi::BufferR3<ffi::S32>>()  // new_map_ids
        .Ret<ffi::BufferR3<ffi::S32>>()  // new_map_seen
        .Ret<ffi::BufferR2<ffi::S32>>()  // counts
        .Attr<int32_t>("policy")
        .Attr<int32_t>("parameter")
        .Attr<int32_t>("train")
        .Attr<ffi::Span<const int64_t>>("regions"));

}  // namespace pzsc
