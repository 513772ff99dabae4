// Forward handler: pzsc_sparse_dense_matmul (CPU).
//
// Operands: row_pointers s32[num_segments * rp_stride], embedding_ids,
// sample_ids s32[num_segments * seg_len], gains f32[num_segments * seg_len],
// table f32[num_table_partitions * rows_per_partition, D].
// Result: out f32[num_segments * samples_per_segment, D] with
//   out[k * samples_per_segment + sid] = sum gain * table[(p - begin) * rpp + e]
// over the valid entries (see coo_layout.h); every output row is written.
// Deterministic: each output row sums its entries in buffer order (slices in
// segment, then partition order), whatever the number of threads.
//
// Three parallel passes. The entries (slices concatenated in order) are cut
// into one chunk of consecutive entries per worker (fewer for small
// batches, see kMinEntriesPerChunk). (1) Each chunk counts its valid
// entries per output row; the counts become positions (chunk 0's entries
// of a row first, then chunk 1's, ...). (2) Each chunk writes its valid
// entries (8 bytes: table row, gain) to their positions: one sample-major
// array for the whole call, buffer order kept within each output row (a
// stable counting sort, O(entries + rows x chunks)). (3) The output rows are
// cut into blocks of about kEntriesPerBlock entries, claimed dynamically (a
// worker the OS schedules late just takes fewer): each row sums its
// entries in vector registers, gathering the table rows with an L2
// prefetch 48 entries ahead, and is stored once (no zero fill, no
// read-modify-write of the output). Each entry is read once whatever the
// number of workers, and results are bit-identical to an accumulation in
// buffer order into zeroed rows.
// With a sample_order operand (the sample-major order the host wrote,
// pz_sparsecore/host/sample_order.py: int32 starts[num_outputs + 1], then
// (table row, gain bits) pairs), passes 1 and 2 are skipped: pass 3 reads
// that order, checking every starts value and skipping (then refusing the
// call for) any row outside the table. An empty operand, or a first start
// of -1: sorted here.
// Sorting per chunk instead (each chunk its own sample-major array, which
// pass 3 visited chunk after chunk for every row) cost 0.5-0.8 ms for the
// sort and ~0.4 ms more in the sums than this on 1M-row tables, 4096 x 32
// ids, dim 64, 2 workers (AMD EPYC); adding into the output entry by entry
// in buffer order (row-major, no sort) cost 2-3x more on Zipf ids.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "coo_layout.h"
#include "huge_pages.h"
#include "parallel_for.h"
#include "quantize.h"
#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace pzsc {
namespace {

// Entries per chunk of passes 1 and 2 (at least). One chunk per worker at
// most: the positions take chunks x output rows steps.
constexpr int64_t kMinEntriesPerChunk = 16384;
// Entries per block of pass 3 (about).
constexpr int64_t kEntriesPerBlock = 4096;
// Scratch above this many bytes is released after the call.
constexpr size_t kMaxKeptScratchBytes = size_t{64} << 20;

// The forward's valid entries sorted by output row into `order` (passes 1
// and 2 above); returns how many there are.
int64_t SortBySample(ffi::ThreadPool& pool, const CooView& view,
                     const std::vector<Slice>& slices, ForwardOrder& order) {
  const int64_t num_out = view.num_outputs();
  int64_t total = 0;
  for (const Slice& s : slices) total += s.end - s.begin;
  // Each chunk also counts over all output rows: chunks hold at least as
  // many entries as there are output rows.
  const int64_t num_chunks = std::clamp<int64_t>(
      total / std::max(kMinEntriesPerChunk, num_out), 1, NumWorkers(pool));
  order.counts.resize(num_chunks * num_out);
  const auto chunk_begin = [&](int64_t c) { return total * c / num_chunks; };
  ParallelFor(pool, num_chunks, [&](int64_t c) {
    ForwardCountChunk(view, slices, chunk_begin(c), chunk_begin(c + 1),
                      order.counts.data() + c * num_out);
  });
  const int64_t valid = order.Place(num_chunks, num_out);
  ParallelFor(pool, num_chunks, [&](int64_t c) {
    ForwardScatterChunk(view, slices, chunk_begin(c), chunk_begin(c + 1),
                        order.counts.data() + c * num_out,
                        order.sorted.data());
  });
  return valid;
}

// Reads the sample_order operand (see above) into `order`, or sets
// `*present` false for an empty one or one whose first start is -1 (the
// host wrote none for this batch): int32, rank 1, num_outputs + 1 starts
// from 0, non-decreasing, the last at most the number of (row, gain) pairs
// that follow.
ffi::Error ReadSampleOrder(const ffi::AnyBuffer& buffer, int64_t num_out,
                           int64_t row_limit, SampleMajor* order,
                           bool* present) {
  if (auto err = CheckBuffer(buffer, ffi::DataType::S32, 1, "sample_order");
      err.failure()) {
    return err;
  }
  const int64_t size = static_cast<int64_t>(buffer.element_count());
  *present = size > 0 && buffer.typed_data<int32_t>()[0] != -1;
  if (!*present) return ffi::Error::Success();
  const int64_t pairs = (size - num_out - 1) / 2;
  if (size < num_out + 1 || (size - num_out - 1) % 2 != 0) {
    return ffi::Error::InvalidArgument(
        "pzsc_sparse_dense_matmul: sample_order has " + std::to_string(size) +
        " values; expected " + std::to_string(num_out + 1) +
        " starts and then (row, gain) pairs");
  }
  const int32_t* starts = buffer.typed_data<int32_t>();
  int64_t bad = starts[0] != 0 ? 0 : -1;
  for (int64_t r = 0; r < num_out && bad < 0; ++r) {
    if (starts[r + 1] < starts[r] || starts[r + 1] > pairs) bad = r + 1;
  }
  if (bad >= 0) {
    return ffi::Error::InvalidArgument(
        "pzsc_sparse_dense_matmul: sample_order's start " +
        std::to_string(bad) + " is " + std::to_string(starts[bad]) +
        "; starts run from 0, never decrease and stay within the " +
        std::to_string(pairs) + " entries");
  }
  *order = {reinterpret_cast<const ForwardEntry*>(starts + num_out + 1),
            pairs, nullptr, starts, row_limit};
  return ffi::Error::Success();
}

ffi::Error SparseDenseMatmulImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer row_pointers,
    ffi::AnyBuffer embedding_ids, ffi::AnyBuffer sample_ids,
    ffi::AnyBuffer gains, ffi::AnyBuffer table, ffi::AnyBuffer sample_order,
    ffi::Result<ffi::AnyBuffer> out, LayoutAttrs attrs,
    Quantization quantization) {
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  const int64_t num_out = view.num_outputs();
  if (auto err = CheckMatrix(*out, num_out, view.dim, "output");
      err.failure()) {
    return err;
  }
  std::vector<Slice> slices;
  if (auto err = CollectSlices(view, &slices); err.failure()) return err;
  const void* table_data = table.untyped_data();
  float* out_data = out->typed_data<float>();
  if (auto err = CheckQuantization(quantization); err.failure()) return err;
  if (view.dim == 0 || num_out == 0) return ffi::Error::Success();
  AdviseHugePages(table_data, table.size_bytes());

  // Entries name their table row in 32 bits.
  const int64_t table_rows =
      view.num_table_partitions * view.attrs.rows_per_partition;
  if (table_rows > int64_t{std::numeric_limits<uint32_t>::max()} + 1) {
    return ffi::Error::InvalidArgument(
        "pzsc_sparse_dense_matmul: the CPU forward takes tables of at most "
        "2^32 rows per device (got " +
        std::to_string(table_rows) + ")");
  }

  // The calling thread's scratch, reused across calls (the workers reach it
  // through this reference: a thread_local named in the lambda would be
  // theirs).
  thread_local ForwardOrder scratch;
  ForwardOrder& sorted = scratch;
  SampleMajor order;
  bool present = false;
  if (auto err = ReadSampleOrder(sample_order, num_out, table_rows, &order,
                                 &present);
      err.failure()) {
    return err;
  }
  if (!present) {
    SortBySample(pool, view, slices, sorted);
    order = sorted.View(table_rows);
  }
  const int64_t valid = order.Start(num_out);
  const int64_t rows_per_block = std::max<int64_t>(
      1, num_out * kEntriesPerBlock / std::max<int64_t>(valid, 1));
  std::atomic<int64_t> skipped{0};
  ParallelFor(pool, (num_out + rows_per_block - 1) / rows_per_block,
              [&](int64_t b) {
                const int64_t begin = b * rows_per_block;
                const int64_t end = std::min(begin + rows_per_block, num_out);
                skipped += quantization.num_buckets > 0
                               ? ForwardSumQuantizedRows(
                                     order, table_data, view.table_dtype,
                                     view.dim, begin, end, out_data,
                                     quantization)
                               : ForwardSumRows(order, table_data,
                                                view.table_dtype, view.dim,
                                                begin, end, out_data);
              });
  if (sorted.bytes() > kMaxKeptScratchBytes) sorted = ForwardOrder();
  if (skipped.load() > 0) {
    return ffi::Error::InvalidArgument(
        "pzsc_sparse_dense_matmul: sample_order names " +
        std::to_string(skipped.load()) + " rows outside the table's " +
        std::to_string(table_rows) + " rows");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparseDenseMatmulCpu, SparseDenseMatmulImpl,
    BindCooOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
        .Arg<ffi::AnyBuffer>()  // sample_order (may be empty)
        .Ret<ffi::AnyBuffer>()  // out
        .Attr<LayoutAttrs>("layout")
        .Attr<Quantization>("quantization"));

}  // namespace pzsc
