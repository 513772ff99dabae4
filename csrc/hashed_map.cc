// Hashed-table map handler: pzsc_hashed_map_resolve (CPU).
//
// One call of the per-shard map of a hashed stack for S shards (the rules:
// pz_sparsecore/core/hashed.py; the reference, which this matches bit for
// bit: pz_sparsecore/device/hashed.py::resolve_shard).
//
// Operands: ids s32[S, n, K] with K = 4 (low word, high word, home, table)
// or K = 3 (no table word: every id of table 0); home < 0, or a table
// outside the regions, means no id. map_ids s32[S, C, 2] (each slot's id,
// low then high word), map_seen s32[S, C, 2] (each slot's last step, -1 if
// free, and count), step s32[].
// Attributes: policy (s32, the index in hashed.POLICIES: 0 lru, 1 lfu,
// 2 ttl, 3 none), parameter (s32 >= 0: ttl_steps for ttl, decay_steps for
// lfu, 0 = no decay; unused by the others), train (s32, 0 or 1), regions
// (s64[2 T], T >= 1: per table of the stack, its first row and rows in every
// shard, within [0, C)).
// Results: slots s32[S, n] (each id's slot in the shard, -1 for a refused or
// unseen id and for no id), reset s32[S, n] (1 at the smallest input index
// of each id given a slot in this call), new_map_ids s32[S, C, 2] and
// new_map_seen s32[S, C, 2] (aliased to map_ids and map_seen; copied first
// if XLA gave distinct buffers), counts s32[S, 5] (this call's changes of
// held, inserted, evicted, refused, unseen).
//
// Per shard: each distinct (table, id) among the present ids (found with a
// hash set, in order of first occurrence) is looked up in its window (W =
// min(rows, 64) slots first + (home + i) % rows of its table's region, from
// its first occurrence's home) against the map before the call. In training
// every hit's seen becomes (step, decayed(count) + 1, saturating; only lfu
// counts decay); then the misses, sorted by table, then by id as an unsigned
// 64-bit word, take the first free slot of their window or a policy victim,
// one after another. Every occurrence of an id gets the slot of its first
// one. Shards run in parallel, each on its own rows of every array.
//
// Every operand is checked before the first write: a present id's home at
// or beyond its region's rows, shapes that disagree, regions outside the
// shard, an unknown policy, a negative parameter or a train flag other than
// 0/1 return an error and leave the map unchanged. n = 0 or S = 0 does
// nothing; C = 0 takes only absent ids.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "parallel_for.h"
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
constexpr int64_t kProbeSlots = 64;
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

// a - b with int32 wrap-around (as XLA computes it).
int32_t WrapSub(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) -
                              static_cast<uint32_t>(b));
}

// `count` halved once per `decay_steps` steps since `last` (0: never);
// device.hashed.decayed. A step difference <= 0 halves 0 times.
int32_t Decayed(int32_t count, int32_t last, int32_t step,
                int32_t decay_steps) {
  if (decay_steps == 0) return count;
  const int32_t since = WrapSub(step, last);
  const int32_t halvings =
      since <= 0 ? 0 : std::min(since / decay_steps, kMaxHalvings);
  return count >> halvings;  // Arithmetic, as XLA's shift of int32.
}

// A table's rows in every shard.
struct Region {
  int64_t first;
  int64_t rows;
};

struct Config {
  Policy policy;
  int32_t ttl_steps;    // ttl only.
  int32_t decay_steps;  // lfu only; 0: no decay.
  bool train;
  int32_t step;
  int64_t n;          // Ids per shard.
  int64_t key_words;  // kKeyWords or kKeyWordsNoTable.
  std::vector<Region> regions;
};

// The table of the id at `id` (its key_words words), or -1 for no id (home
// < 0, or a table outside the regions).
int64_t TableOf(const Config& cfg, const int32_t* id) {
  if (id[2] < 0) return -1;
  const int64_t table = cfg.key_words == kKeyWords ? id[3] : 0;
  if (table < 0 || table >= static_cast<int64_t>(cfg.regions.size())) {
    return -1;
  }
  return table;
}

// One shard's arrays (rows of the call's buffers).
struct Shard {
  const int32_t* ids;  // [n, key_words]
  int32_t* map_ids;    // [C, 2]
  int32_t* map_seen;   // [C, 2]
  int32_t* slots;      // [n]
  int32_t* reset;      // [n]
  int32_t* counts;     // [kNumCounters]
};

// A distinct (table, id) of the shard: its table, its words as an unsigned
// 64-bit value, and its first input index.
struct Entry {
  int64_t table;
  uint64_t key;
  int64_t index;
};

// A distinct (table, id): its first occurrence's words, its window, and its
// slot (-1 while it has none).
struct Group {
  const int32_t* id;
  Region region;
  int64_t home;
  int64_t window;  // min(region.rows, kProbeSlots).
  int32_t slot;
};

// The slot of window position i (home < rows, i < W <= rows).
int64_t WindowSlot(const Group& g, int64_t i) {
  const int64_t s = g.home + i;
  return g.region.first + (s >= g.region.rows ? s - g.region.rows : s);
}

// The first slot of the window holding the id, or -1.
int32_t FindHit(const Shard& shard, const Group& g) {
  for (int64_t i = 0; i < g.window; ++i) {
    const int64_t s = WindowSlot(g, i);
    const int32_t* held = shard.map_ids + s * kSlotWords;
    if (shard.map_seen[s * kSlotWords] != kEmpty && held[0] == g.id[0] &&
        held[1] == g.id[1]) {
      return static_cast<int32_t>(s);
    }
  }
  return -1;
}

// A miss's slot (device.hashed._pick): the first free slot of the window;
// else a victim the policy allows (not seen in this step; ttl: last seen
// more than ttl_steps steps ago) with the smallest score (lfu: the decayed
// count, then the last step; lru and ttl: the last step), ties to the
// earlier window position; else -1. `*evicts`: a victim was taken.
int64_t PickSlot(const Config& cfg, const Shard& shard, const Group& g,
                 bool* evicts) {
  *evicts = false;
  for (int64_t i = 0; i < g.window; ++i) {
    const int64_t s = WindowSlot(g, i);
    if (shard.map_seen[s * kSlotWords] == kEmpty) return s;
  }
  if (cfg.policy == Policy::kNone) return -1;
  int64_t victim = -1;
  int32_t best_score = 0;
  int32_t best_last = 0;
  for (int64_t i = 0; i < g.window; ++i) {
    const int64_t s = WindowSlot(g, i);
    const int32_t last = shard.map_seen[s * kSlotWords];
    const int32_t count = shard.map_seen[s * kSlotWords + 1];
    if (last >= cfg.step) continue;  // Seen in this step (or later).
    if (cfg.policy == Policy::kTtl &&
        WrapSub(cfg.step, last) <= cfg.ttl_steps) {
      continue;
    }
    const int32_t score = cfg.policy == Policy::kLfu
                              ? Decayed(count, last, cfg.step, cfg.decay_steps)
                              : 0;
    if (victim < 0 || score < best_score ||
        (score == best_score && last < best_last)) {
      victim = s;
      best_score = score;
      best_last = last;
    }
  }
  *evicts = victim >= 0;
  return victim;
}

// A 64-bit mix of an id's words and its table (the SplitMix64 finalizer).
uint64_t Mix(uint64_t key, int64_t table) {
  uint64_t z = key ^ (static_cast<uint64_t>(table) * 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// One call of one shard's map.
void ResolveShard(const Config& cfg, const Shard& shard) {
  // The distinct (table, id)s in order of first occurrence (an open
  // addressing set of group numbers), and each input's group (-1: no id).
  std::vector<Entry> firsts;  // Each group's table, key and first index.
  std::vector<int32_t> group_of(cfg.n, -1);
  int64_t size = 1;
  while (size < 2 * cfg.n + 2) size *= 2;
  std::vector<int32_t> set(size, -1);
  for (int64_t j = 0; j < cfg.n; ++j) {
    const int32_t* id = shard.ids + j * cfg.key_words;
    shard.slots[j] = kRefused;
    shard.reset[j] = 0;
    const int64_t table = TableOf(cfg, id);
    if (table < 0) continue;
    const uint64_t key = (uint64_t{static_cast<uint32_t>(id[1])} << 32) |
                         uint64_t{static_cast<uint32_t>(id[0])};
    uint64_t probe = Mix(key, table) & static_cast<uint64_t>(size - 1);
    while (true) {
      const int32_t g = set[probe];
      if (g < 0) {
        set[probe] = static_cast<int32_t>(firsts.size());
        group_of[j] = static_cast<int32_t>(firsts.size());
        firsts.push_back({table, key, j});
        break;
      }
      if (firsts[g].table == table && firsts[g].key == key) {
        group_of[j] = g;
        break;
      }
      probe = (probe + 1) & static_cast<uint64_t>(size - 1);
    }
  }
  std::vector<Group> groups;
  groups.reserve(firsts.size());
  for (const Entry& first : firsts) {
    const int32_t* id = shard.ids + first.index * cfg.key_words;
    const Region region = cfg.regions[first.table];
    groups.push_back({id, region, id[2], std::min(region.rows, kProbeSlots),
                      kRefused});
  }

  // Hits, all against the map before the call.
  for (Group& g : groups) g.slot = FindHit(shard, g);

  int64_t counts[kNumCounters] = {};
  if (!cfg.train) {
    for (const Group& g : groups) counts[kUnseen] += g.slot < 0;
  } else {
    // Every hit's new seen, from the map before the call (regions that
    // overlap may give two groups one slot: both write the same values).
    std::vector<int32_t> bumped(groups.size());
    std::vector<int32_t> misses;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].slot < 0) {
        misses.push_back(static_cast<int32_t>(g));
        continue;
      }
      const int32_t* seen = shard.map_seen + groups[g].slot * kSlotWords;
      const int32_t count =
          Decayed(seen[1], seen[0], cfg.step, cfg.decay_steps);
      bumped[g] = count < kInt32Max ? count + 1 : count;
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].slot < 0) continue;
      int32_t* seen = shard.map_seen + groups[g].slot * kSlotWords;
      seen[0] = cfg.step;
      seen[1] = bumped[g];
    }
    // Misses, one after another in ascending order of table, then id as an
    // unsigned word (the groups are distinct: a total order).
    std::sort(misses.begin(), misses.end(), [&](int32_t a, int32_t b) {
      if (firsts[a].table != firsts[b].table) {
        return firsts[a].table < firsts[b].table;
      }
      return firsts[a].key < firsts[b].key;
    });
    for (const int32_t g : misses) {
      Group& group = groups[g];
      bool evicts = false;
      const int64_t chosen = PickSlot(cfg, shard, group, &evicts);
      if (chosen < 0) {
        ++counts[kRefusedIds];
        continue;
      }
      shard.map_ids[chosen * kSlotWords] = group.id[0];
      shard.map_ids[chosen * kSlotWords + 1] = group.id[1];
      shard.map_seen[chosen * kSlotWords] = cfg.step;
      shard.map_seen[chosen * kSlotWords + 1] = 1;
      group.slot = static_cast<int32_t>(chosen);
      shard.reset[firsts[g].index] = 1;
      ++counts[evicts ? kEvicted : kHeld];
      ++counts[kInserted];
    }
  }

  for (int64_t j = 0; j < cfg.n; ++j) {
    if (group_of[j] >= 0) shard.slots[j] = groups[group_of[j]].slot;
  }
  for (int64_t c = 0; c < kNumCounters; ++c) {
    shard.counts[c] = static_cast<int32_t>(counts[c]);
  }
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

constexpr char kWhere[] = "pzsc_hashed_map_resolve: ";

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

// Fills `cfg` from the attributes and the operands' shapes, checking them.
ffi::Error MakeConfig(int32_t policy, int32_t parameter, int32_t train,
                      ffi::Span<const int64_t> regions, int64_t key_words,
                      int64_t n, int64_t capacity, int32_t step,
                      Config* cfg) {
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
  const Policy p = static_cast<Policy>(policy);
  cfg->policy = p;
  cfg->ttl_steps = p == Policy::kTtl ? parameter : 0;
  cfg->decay_steps = p == Policy::kLfu ? parameter : 0;
  cfg->train = train == 1;
  cfg->step = step;
  cfg->n = n;
  cfg->key_words = key_words;
  cfg->regions.clear();
  for (size_t t = 0; t < regions.size() / 2; ++t) {
    const Region r{regions[2 * t], regions[2 * t + 1]};
    if (r.first < 0 || r.rows < 0 || r.first > capacity - r.rows) {
      return ffi::Error::InvalidArgument(
          where + "table " + std::to_string(t) + "'s region (first row " +
          std::to_string(r.first) + ", " + std::to_string(r.rows) +
          " rows) is not within the shard's " + std::to_string(capacity) +
          " rows");
    }
    cfg->regions.push_back(r);
  }
  return ffi::Error::Success();
}

// Copies `from` into `to` unless XLA already aliased them.
template <typename In, typename Out>
void CopyIfDistinct(const In& from, Out& to) {
  if (from.size_bytes() == 0 || from.untyped_data() == to.untyped_data()) {
    return;
  }
  std::memcpy(to.untyped_data(), from.untyped_data(), from.size_bytes());
}

ffi::Error HashedMapResolveImpl(
    ffi::ThreadPool pool, ffi::BufferR3<ffi::S32> ids,
    ffi::BufferR3<ffi::S32> map_ids, ffi::BufferR3<ffi::S32> map_seen,
    ffi::BufferR0<ffi::S32> step, ffi::ResultBufferR2<ffi::S32> slots,
    ffi::ResultBufferR2<ffi::S32> reset,
    ffi::ResultBufferR3<ffi::S32> new_map_ids,
    ffi::ResultBufferR3<ffi::S32> new_map_seen,
    ffi::ResultBufferR2<ffi::S32> counts, int32_t policy, int32_t parameter,
    int32_t train, ffi::Span<const int64_t> regions) {
  const int64_t num_shards = ids.dimensions()[0];
  const int64_t n = ids.dimensions()[1];
  const int64_t key_words = ids.dimensions()[2];
  const int64_t capacity = map_ids.dimensions()[1];
  Config cfg;
  if (auto err = MakeConfig(policy, parameter, train, regions, key_words, n,
                            capacity, *step.typed_data(), &cfg);
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
  const int32_t* id_data = ids.typed_data();
  for (int64_t j = 0; j < num_shards * n; ++j) {
    const int32_t* id = id_data + j * key_words;
    const int64_t table = TableOf(cfg, id);
    if (table >= 0 && id[2] >= cfg.regions[table].rows) {
      return ffi::Error::InvalidArgument(
          std::string(kWhere) + "id " + std::to_string(j % n) +
          " of shard " + std::to_string(j / n) + " (table " +
          std::to_string(table) + ") has home " + std::to_string(id[2]) +
          ", outside its table's " + std::to_string(cfg.regions[table].rows) +
          " rows (homes are in [0, rows); < 0 for no id)");
    }
  }

  CopyIfDistinct(map_ids, *new_map_ids);
  CopyIfDistinct(map_seen, *new_map_seen);
  ParallelFor(pool, num_shards, [&](int64_t k) {
    const Shard shard{id_data + k * n * key_words,
                      new_map_ids->typed_data() + k * capacity * kSlotWords,
                      new_map_seen->typed_data() + k * capacity * kSlotWords,
                      slots->typed_data() + k * n,
                      reset->typed_data() + k * n,
                      counts->typed_data() + k * kNumCounters};
    ResolveShard(cfg, shard);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HashedMapResolveCpu, HashedMapResolveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR3<ffi::S32>>()  // ids
                                  .Arg<ffi::BufferR3<ffi::S32>>()  // map_ids
                                  .Arg<ffi::BufferR3<ffi::S32>>()  // map_seen
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // step
                                  .Ret<ffi::BufferR2<ffi::S32>>()  // slots
                                  .Ret<ffi::BufferR2<ffi::S32>>()  // reset
                                  .Ret<ffi::BufferR3<ffi::S32>>()  // map_ids
                                  .Ret<ffi::BufferR3<ffi::S32>>()  // map_seen
                                  .Ret<ffi::BufferR2<ffi::S32>>()  // counts
                                  .Attr<int32_t>("policy")
                                  .Attr<int32_t>("parameter")
                                  .Attr<int32_t>("train")
                                  .Attr<ffi::Span<const int64_t>>("regions"));

}  // namespace pzsc
