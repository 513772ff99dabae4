// Decoding and validation of the CSR-wrapped COO buffers shared by the
// forward and backward handlers.
//
// Per segment k (0 <= k < num_segments) the COO arrays hold `seg_len` entries
// at [k * seg_len, (k + 1) * seg_len) and the row pointers `rp_stride` int32
// values at [k * rp_stride, ...). Partition p of segment k spans the entries
// [r8(rp[p - 1]), rp[p]) relative to the segment start, with r8(rp[-1]) := 0
// and r8 rounding up to a multiple of 8; ends are clamped to seg_len and
// begin >= end means empty. An entry is valid when its id is in
// [0, rows_per_partition) (and not the padding id) and its sample id is in
// [0, samples_per_segment). Only partitions in the table's window
// [partition_begin, partition_begin + num_table_partitions) are used.
#ifndef PZSC_CSRC_COO_LAYOUT_H_
#define PZSC_CSRC_COO_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace pzsc {

namespace ffi = xla::ffi;

// Id written into alignment gaps and unused tails of the COO buffers.
inline constexpr int32_t kPadId = 2147483647;
// Every partition of a segment starts at a multiple of this many entries.
inline constexpr int64_t kPartitionAlignment = 8;

// Static layout attributes, as passed by the Python wrappers.
struct LayoutAttrs {
  int64_t num_segments;
  int64_t samples_per_segment;
  int64_t num_partitions;
  int64_t rows_per_partition;
  int64_t partition_begin;
};

// Validated raw views of the buffers plus the derived sizes.
struct CooView {
  const int32_t* row_pointers;
  const int32_t* ids;
  const int32_t* sample_ids;
  const float* gains;
  LayoutAttrs attrs;
  int64_t seg_len;
  int64_t rp_stride;
  int64_t num_table_partitions;
  int64_t dim;

  int64_t num_outputs() const {
    return attrs.num_segments * attrs.samples_per_segment;
  }
  bool ValidEntry(int64_t j) const {
    const int32_t id = ids[j];
    const int32_t sid = sample_ids[j];
    return id != kPadId && id >= 0 && id < attrs.rows_per_partition &&
           sid >= 0 && sid < attrs.samples_per_segment;
  }
};

// One non-empty (segment, partition) run of entries, absolute positions.
struct Slice {
  int64_t segment;
  int64_t partition;  // Relative to partition_begin (table shard index).
  int64_t begin;
  int64_t end;
};

// Checks that `buffer` has the given dtype and rank; `name` goes into errors.
ffi::Error CheckBuffer(const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                       int64_t rank, const char* name);

// Validates the COO buffers and the table against `attrs` and fills `view`.
ffi::Error MakeCooView(const LayoutAttrs& attrs,
                       const ffi::AnyBuffer& row_pointers,
                       const ffi::AnyBuffer& embedding_ids,
                       const ffi::AnyBuffer& sample_ids,
                       const ffi::AnyBuffer& gains,
                       const ffi::AnyBuffer& table, CooView* view);

// Non-empty slices of partitions inside the table window, segment-major.
std::vector<Slice> CollectSlices(const CooView& view);

// Rows of a table-like buffer of rank >= 2: the product of all but the last
// dimension (tables may be passed as [shards, rows, dim] without a reshape,
// which would make XLA copy around the in-place update).
int64_t LeadingRows(const ffi::AnyBuffer& buffer);

// Checks that `buffer` is f32 of rank >= 2 holding `rows` rows of `cols`.
ffi::Error CheckRows(const ffi::AnyBuffer& buffer, int64_t rows, int64_t cols,
                     const char* name);

// Checks that `buffer` is f32 with exactly `rows` x `cols` elements.
ffi::Error CheckMatrix(const ffi::AnyBuffer& buffer, int64_t rows,
                       int64_t cols, const char* name);

}  // namespace pzsc

#endif  // PZSC_CSRC_COO_LAYOUT_H_
