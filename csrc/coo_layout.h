// Decoding and validation of the CSR-wrapped COO buffers shared by the
// forward and backward handlers.
//
// Per segment k (0 <= k < num_segments) the COO arrays hold `seg_len` entries
// at [k * seg_len, (k + 1) * seg_len) and the row pointers `rp_stride` int32
// values at [k * rp_stride, ...). Partition p of segment k spans the entries
// [start(p), end(p)) relative to the segment start, with
// end(p) = clamp(rp[p], 0, seg_len), start(0) = 0 and
// start(p) = r8(end(p - 1)), r8 rounding up to a multiple of 8;
// start >= end means empty. Starts that decrease (start(p) < start(p - 1),
// which would make partitions overlap) are an error: no buffer the
// preprocessor writes has them. An entry is valid when its id is in
// [0, rows_per_partition) (and not the padding id) and its sample id is in
// [0, samples_per_segment); other entries are skipped. Only partitions in
// the table's window [partition_begin, partition_begin +
// num_table_partitions) are used. Ids need not be sorted for the handlers to
// stay inside their buffers (the backward sorts a copy of a slice that is
// not; see sparse_dense_matmul_grad.cc).
//
// Example, seg_len 24, rp = [3, 1, 20]: partition 0 is [0, 3), partition 1
// [8, 1) is empty, partition 2 is [8, 20); rp = [12, 3, 20] is an error
// (partition 2 would start at 8, inside partition 0).
#ifndef PZSC_CSRC_COO_LAYOUT_H_
#define PZSC_CSRC_COO_LAYOUT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "optimizers.h"
#include "table_dtype.h"
#include "xla/ffi/api/ffi.h"

namespace pzsc {

namespace ffi = xla::ffi;

// Id written into alignment gaps and unused tails of the COO buffers.
inline constexpr int32_t kPadId = 2147483647;
// Every partition of a segment starts at a multiple of this many entries.
inline constexpr int64_t kPartitionAlignment = 8;

// Static layout attributes: every handler's dictionary attribute "layout",
// as passed by the Python wrappers (pz_sparsecore/kernels/ffi.py).
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
  TableDtype table_dtype;  // The table's storage (table_dtype.h).

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

// Adds every handler's COO operands to `binding`: row_pointers,
// embedding_ids, sample_ids, gains and the table.
template <typename Binding>
auto BindCooOperands(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()  // row_pointers
      .template Arg<ffi::AnyBuffer>()  // embedding_ids
      .template Arg<ffi::AnyBuffer>()  // sample_ids
      .template Arg<ffi::AnyBuffer>()  // gains
      .template Arg<ffi::AnyBuffer>();  // table
}

// A fused backward's binding (CPU and CUDA, every optimizer): `binding` (the
// handler's context) followed by its operands, results and attributes:
// activation_grad, the COO operands, the slots and hyperparameters, the
// table and slot results (aliased), the layout, the clip range and every
// optimizer's static attributes (the registry's; a call passes the others'
// defaults). A macro, not a function like BindCooOperands: the handlers then
// compile exactly as when the chain was written out in each.
#define PZSC_BIND_GRAD_OPERANDS(binding)                                 \
  BindCooOperands((binding).Arg<ffi::AnyBuffer>() /* activation_grad */) \
      .RemainingArgs()       /* slots..., hyperparameters */             \
      .Ret<ffi::AnyBuffer>() /* table (aliased) */                       \
      .RemainingRets()       /* slots (aliased) */                       \
      .Attr<LayoutAttrs>("layout")                                       \
      .Attr<bool>("clip")                                                \
      .Attr<float>("clip_min")                                           \
      .Attr<float>("clip_max")                                           \
      .Attr<bool>("multiply_linear_by_learning_rate")

// Checks that `buffer` has the given dtype and rank; `name` goes into errors.
ffi::Error CheckBuffer(const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                       int64_t rank, const char* name);

// Output rows of a call (num_segments * samples_per_segment) may not exceed
// this (the forward indexes them with int32).
inline constexpr int64_t kMaxOutputs = 2147483647;

// Validates the COO buffers and the table against `attrs` and fills `view`.
ffi::Error MakeCooView(const LayoutAttrs& attrs,
                       const ffi::AnyBuffer& row_pointers,
                       const ffi::AnyBuffer& embedding_ids,
                       const ffi::AnyBuffer& sample_ids,
                       const ffi::AnyBuffer& gains,
                       const ffi::AnyBuffer& table, CooView* view);

// Fills `slices` with the non-empty slices of partitions inside the table
// window, segment-major; an error (and nothing filled) if the partition
// starts of a segment decrease. Reads only the row pointers.
ffi::Error CollectSlices(const CooView& view, std::vector<Slice>* slices);

// Rows of a table-like buffer of rank >= 2: the product of all but the last
// dimension (tables may be passed as [shards, rows, dim] without a reshape,
// which would make XLA copy around the in-place update).
int64_t LeadingRows(const ffi::AnyBuffer& buffer);

// Checks that `buffer` is f32 (or `dtype`) of rank >= 2 holding `rows` rows
// of `cols`.
ffi::Error CheckRows(const ffi::AnyBuffer& buffer, int64_t rows, int64_t cols,
                     const char* name,
                     ffi::DataType dtype = ffi::DataType::F32);

// The FFI data type of a table dtype, and its name in errors.
ffi::DataType FfiType(TableDtype dtype);
const char* DtypeName(TableDtype dtype);

// Checks that `buffer` is f32 with exactly `rows` x `cols` elements.
ffi::Error CheckMatrix(const ffi::AnyBuffer& buffer, int64_t rows,
                       int64_t cols, const char* name);

// Checks a fused backward's operands beyond the COO buffers (CPU and CUDA):
// the activation gradient, the table result, the optimizer's slots and their
// results (each as its list shape says: a Table slot has the table's rows
// and width, a Row slot the table's rows and width 1; SlotWidth), its
// hyperparameters, the rounding seed (u32[1], after the hyperparameters,
// for a 16-bit table only) and the clip range.
ffi::Error CheckGradOperands(Optimizer optimizer, const CooView& view,
                             const ffi::AnyBuffer& activation_grad,
                             const ffi::AnyBuffer& table,
                             ffi::RemainingArgs rest,
                             ffi::Result<ffi::AnyBuffer> table_out,
                             ffi::RemainingRets slots_out, bool clip,
                             float clip_min, float clip_max);

}  // namespace pzsc

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    pzsc::LayoutAttrs, xla::ffi::StructMember<int64_t>("num_segments"),
    xla::ffi::StructMember<int64_t>("samples_per_segment"),
    xla::ffi::StructMember<int64_t>("num_partitions"),
    xla::ffi::StructMember<int64_t>("rows_per_partition"),
    xla::ffi::StructMember<int64_t>("partition_begin"));

#endif  // PZSC_CSRC_COO_LAYOUT_H_
