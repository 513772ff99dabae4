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
// Sorting per chunk instead (each chunk its own sample-major array, which
// pass 3 visited chunk after chunk for every row) cost 0.5-0.8 ms for the
// sort and ~0.4 ms more in the sums than this on 1M-row tables, 4096 x 32
// ids, dim 64, 2 workers (AMD EPYC); adding into the output entry by entry
// in buffer order (row-major, no sort) cost 2-3x more on Zipf ids.
#include <algorithm>
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

ffi::Error SparseDenseMatmulImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer row_pointers,
    ffi::AnyBuffer embedding_ids, ffi::AnyBuffer sample_ids,
    ffi::AnyBuffer gains, ffi::AnyBuffer table, ffi::Result<ffi::AnyBuffer> out,
    LayoutAttrs attrs, Quantization quantization) {
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
  if (view.num_table_partitions * view.attrs.rows_per_partition >
      int64_t{std::numeric_limits<uint32_t>::max()} + 1) {
    return ffi::Error::InvalidArgument(
        "pzsc_sparse_dense_matmul: the CPU forward takes tables of at most "
        "2^32 rows per device (got " +
        std::to_string(view.num_table_partitions *
                       view.attrs.rows_per_partition) +
        ")");
  }

  int64_t total = 0;
  for (const Slice& s : slices) total += s.end - s.begin;
  // Each chunk also counts over all output rows: chunks hold at least as
  // many entries as there are output rows.
  const int64_t num_chunks = std::clamp<int64_t>(
      total / std::max(kMinEntriesPerChunk, num_out), 1, NumWorkers(pool));
  // The calling thread's scratch, reused across calls (the workers reach it
  // through this reference: a thread_local named in the lambda would be
  // theirs).
  thread_local ForwardOrder scratch;
  ForwardOrder& order = scratch;
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
  const int64_t rows_per_block = std::max<int64_t>(
      1, num_out * kEntriesPerBlock / std::max<int64_t>(valid, 1));
  ParallelFor(pool, (num_out + rows_per_block - 1) / rows_per_block,
              [&](int64_t b) {
                const int64_t begin = b * rows_per_block;
                const int64_t end = std::min(begin + rows_per_block, num_out);
                if (quantization.num_buckets > 0) {
                  ForwardSumQuantizedRows(order, table_data, view.table_dtype,
                                          view.dim, begin, end, out_data,
                                          quantization);
                } else {
                  ForwardSumRows(order, table_data, view.table_dtype,
                                 view.dim, begin, end, out_data);
                }
              });
  if (order.bytes() > kMaxKeptScratchBytes) order = ForwardOrder();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparseDenseMatmulCpu, SparseDenseMatmulImpl,
    BindCooOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
        .Ret<ffi::AnyBuffer>()  // out
        .Attr<LayoutAttrs>("layout")
        .Attr<Quantization>("quantization"));

}  // namespace pzsc
