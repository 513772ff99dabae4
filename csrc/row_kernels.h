// Hot loops of the handlers, compiled at -O3 with per-ISA clones
// (row_kernels.cc). The handlers plan the work; these functions only run it.
#ifndef PZSC_CSRC_ROW_KERNELS_H_
#define PZSC_CSRC_ROW_KERNELS_H_

#include <cstdint>
#include <vector>

#include "coo_layout.h"
#include "optimizers.h"
#include "quantize.h"

namespace pzsc {

// One (segment, partition) slice's entries as the backward reads them,
// sorted by id: the buffers themselves when the slice is sorted, else a
// sorted copy of its valid entries (sparse_dense_matmul_grad.cc).
struct SortedRun {
  const int32_t* ids;
  const int32_t* sample_ids;
  const float* gains;
  int64_t size;
  int64_t partition;  // Relative to partition_begin (table shard index).
  int64_t out_base;   // segment * samples_per_segment
};

// Everything BackwardKeys needs; `runs` are ordered by partition, then
// segment (only partitions with entries have runs, so the plan's size does
// not depend on the table's).
struct BackwardPlan {
  const CooView* view;
  const std::vector<SortedRun>* runs;
  const float* activation_grad;
  void* table;  // Stored as view->table_dtype (table_dtype.h).
  float* slots[kMaxSlots];
  // Elements per row of each slot (SlotWidth): the table's dim for a Table
  // slot, 1 for a Row slot; slot s's row r starts at r * slot_width[s].
  int64_t slot_width[kMaxSlots];
  Optimizer optimizer;
  Hyperparameters hyper;
  bool clip;
  float clip_min;
  float clip_max;
  // A 16-bit table's update: the stochastic rounding's seed, and the
  // table's first row in the whole stacked table (partition_begin *
  // rows_per_partition), with which RoundingBits numbers the rows.
  uint32_t rounding_seed;
  int64_t row_base;
};

// One valid entry of the forward: its table row (partition relative to
// partition_begin times rows_per_partition, plus the id; the handler checks
// that the table's rows fit 32 bits) and its gain.
struct ForwardEntry {
  uint32_t row;
  float gain;
};

// Entries in sample-major order as the sums read them: output row r's
// entries are entries[Start(r), Start(r + 1)), Start non-decreasing from 0
// to at most num_entries; each entry's row is below row_limit (the sums skip
// and count those that are not). From ForwardOrder::View(), or a caller's
// buffer (the forward's sample_order operand: int32 starts).
struct SampleMajor {
  const ForwardEntry* entries;
  int64_t num_entries;
  const int64_t* starts64;  // Exactly one of the two is set.
  const int32_t* starts32;
  int64_t row_limit;

  int64_t Start(int64_t r) const {
    return starts64 != nullptr ? starts64[r] : starts32[r];
  }
};

// The forward's valid entries in sample-major order, one array for the
// whole call: output row r's entries are sorted[starts[r], starts[r + 1]),
// in buffer order. Built by a parallel stable counting sort over chunks of
// consecutive entries: ForwardCountChunk per chunk, prefix sums
// (ForwardOrder::Place), then ForwardScatterChunk per chunk.
struct ForwardOrder {
  std::vector<ForwardEntry> sorted;
  std::vector<int64_t> starts;  // num_outputs + 1
  // Chunk c's counts of entries per output row (ForwardCountChunk), then
  // its next position per output row: counts[c * num_outputs + r].
  std::vector<int64_t> counts;

  // Turns the counts into positions and fills `starts` (serial: num_chunks
  // x num_outputs steps); returns the number of valid entries and sizes
  // `sorted` for them.
  int64_t Place(int64_t num_chunks, int64_t num_outputs);

  SampleMajor View(int64_t row_limit) const {
    return {sorted.data(), static_cast<int64_t>(sorted.size()), starts.data(),
            nullptr, row_limit};
  }

  size_t bytes() const {
    return sorted.capacity() * sizeof(ForwardEntry) +
           (starts.capacity() + counts.capacity()) * sizeof(int64_t);
  }
};

// Counts the valid entries among entries [begin, end) of the slices
// concatenated in order per output row: counts[r] (num_outputs values,
// zeroed here).
void ForwardCountChunk(const CooView& view, const std::vector<Slice>& slices,
                       int64_t begin, int64_t end, int64_t* counts);

// Writes the valid entries among entries [begin, end) (as counted by
// ForwardCountChunk) to sorted[positions[r]++] for their output row r.
void ForwardScatterChunk(const CooView& view, const std::vector<Slice>& slices,
                         int64_t begin, int64_t end, int64_t* positions,
                         ForwardEntry* sorted);

// Writes out[r, :] for r in [row_begin, row_end): the sum of gain * table
// row (stored as `dtype`, widened to float32) over the row's entries of
// `order` (in order), starting from 0 (zeros without entries). Vector
// registers for dim = 8k <= 128, a generic loop otherwise; table rows
// prefetched into L2 ahead. Returns the number of entries skipped for a row
// at or past order.row_limit.
int64_t ForwardSumRows(const SampleMajor& order, const void* table,
                       TableDtype dtype, int64_t dim, int64_t row_begin,
                       int64_t row_end, float* out);

// ForwardSumRows reading each table value through Quantize(q, .) (generic
// loop; same summation order).
int64_t ForwardSumQuantizedRows(const SampleMajor& order, const void* table,
                                TableDtype dtype, int64_t dim,
                                int64_t row_begin, int64_t row_end, float* out,
                                const Quantization& q);

// Whether ids[0, n) is non-decreasing (one vectorised pass, no early exit).
bool IdsSorted(const int32_t* ids, int64_t n);

// Updates every referenced table row whose key p * rows_per_partition + row
// lies in [key_begin, key_end): sums gain * activation_grad over all its
// entries (segment order, then run order), then applies the optimizer.
// Binary-searches the key range in each run, so the runs must be sorted by
// id; ids outside [0, rows_per_partition) and invalid sample ids are then
// never used as offsets.
void BackwardKeys(const BackwardPlan& plan, int64_t key_begin,
                  int64_t key_end);

}  // namespace pzsc

#endif  // PZSC_CSRC_ROW_KERNELS_H_
