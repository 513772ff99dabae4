// Forward handler: pzsc_sparse_dense_matmul (CPU).
//
// Operands: row_pointers s32[num_segments * rp_stride], embedding_ids,
// sample_ids s32[num_segments * seg_len], gains f32[num_segments * seg_len],
// table f32[num_table_partitions * rows_per_partition, D].
// Result: out f32[num_segments * samples_per_segment, D] with
//   out[k * samples_per_segment + sid] = sum gain * table[(p - begin) * rpp + e]
// over the valid entries (see coo_layout.h); every output row is written.
// Deterministic: each output row sums its entries in buffer order, whatever
// the number of threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "coo_layout.h"
#include "huge_pages.h"
#include "parallel_for.h"
#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace pzsc {
namespace {

// Output rows per parallel chunk of the accumulation.
constexpr int64_t kRowsPerChunk = 64;
// Entries per parallel chunk of the counting sort (at least).
constexpr int64_t kMinEntriesPerSortChunk = 16384;

ffi::Error SparseDenseMatmulImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer row_pointers,
    ffi::AnyBuffer embedding_ids, ffi::AnyBuffer sample_ids,
    ffi::AnyBuffer gains, ffi::AnyBuffer table, ffi::Result<ffi::AnyBuffer> out,
    int64_t num_segments, int64_t samples_per_segment, int64_t num_partitions,
    int64_t rows_per_partition, int64_t partition_begin) {
  const LayoutAttrs attrs{num_segments, samples_per_segment, num_partitions,
                          rows_per_partition, partition_begin};
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
  const float* table_data = table.typed_data<float>();
  float* out_data = out->typed_data<float>();
  if (view.dim == 0 || num_out == 0) return ffi::Error::Success();
  static const bool trace = std::getenv("PZSC_TRACE") != nullptr;
  auto now = [] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  const double t0 = now();
  AdviseHugePages(table_data, table.size_bytes());
  const double t1 = now();

  // Group the valid entries by output row with a parallel stable counting
  // sort: chunk c counts its entries per output row, an exclusive scan over
  // (row, chunk) gives each chunk its write positions, chunk c fills them.
  const std::vector<Slice> slices = CollectSlices(view);
  static const bool use_sort = std::getenv("PZSC_FWD_SORT") != nullptr;
  if (!use_sort) {
    int64_t tot = 0;
    for (const Slice& s : slices) tot += s.end - s.begin;
    static const int64_t cpw = std::getenv("PZSC_CPW") ? std::atoll(std::getenv("PZSC_CPW")) : 2;
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(
        {NumWorkers(pool) * cpw, tot / 8192, num_out}));
    const double t2 = now();
    ParallelFor(pool, chunks, [&](int64_t c) {
      thread_local std::vector<ForwardEntry> scratch;
      ForwardOutputRange(view, slices, table_data, num_out * c / chunks,
                         num_out * (c + 1) / chunks, out_data, &scratch);
    });
    if (trace) fprintf(stderr, "advise %.3f direct %.3f chunks %ld\n", t1 - t0, now() - t2, (long)chunks);
    return ffi::Error::Success();
  }
  std::vector<int64_t> slice_start(slices.size() + 1, 0);
  for (size_t i = 0; i < slices.size(); ++i) {
    slice_start[i + 1] = slice_start[i] + slices[i].end - slices[i].begin;
  }
  const int64_t total = slice_start.back();
  const int64_t num_chunks = std::max<int64_t>(
      1, std::min(NumWorkers(pool), total / kMinEntriesPerSortChunk));
  // Calls fn(j, out_base, row_base) for the entries of chunk c, in order.
  auto for_each_entry = [&](int64_t c, auto&& fn) {
    const int64_t lo = total * c / num_chunks;
    const int64_t hi = total * (c + 1) / num_chunks;
    auto it = std::upper_bound(slice_start.begin(), slice_start.end(), lo);
    for (size_t i = (it - slice_start.begin()) - 1;
         i < slices.size() && slice_start[i] < hi; ++i) {
      const Slice& s = slices[i];
      const int64_t b = s.begin + std::max<int64_t>(lo - slice_start[i], 0);
      const int64_t e = s.begin + std::min(hi, slice_start[i + 1]) -
                        slice_start[i];
      const int64_t out_base = s.segment * samples_per_segment;
      const int64_t row_base = s.partition * rows_per_partition;
      for (int64_t j = b; j < e; ++j) {
        if (view.ValidEntry(j)) fn(j, out_base, row_base);
      }
    }
  };
  std::vector<int64_t> counts(num_chunks * num_out, 0);
  ParallelFor(pool, num_chunks, [&](int64_t c) {
    int64_t* cnt = counts.data() + c * num_out;
    for_each_entry(c, [&](int64_t j, int64_t out_base, int64_t) {
      ++cnt[out_base + view.sample_ids[j]];
    });
  });
  std::vector<int64_t> offsets(num_out + 1, 0);
  int64_t running = 0;
  for (int64_t r = 0; r < num_out; ++r) {
    offsets[r] = running;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t n = counts[c * num_out + r];
      counts[c * num_out + r] = running;
      running += n;
    }
  }
  offsets[num_out] = running;
  const int64_t num_entries = running;
  std::vector<int64_t> rows(num_entries);
  std::vector<float> entry_gains(num_entries);
  ParallelFor(pool, num_chunks, [&](int64_t c) {
    int64_t* fill = counts.data() + c * num_out;
    for_each_entry(c, [&](int64_t j, int64_t out_base, int64_t row_base) {
      const int64_t at = fill[out_base + view.sample_ids[j]]++;
      rows[at] = row_base + view.ids[j];
      entry_gains[at] = view.gains[j];
    });
  });

  const double t2 = now();
  const ForwardPlan plan{offsets.data(), rows.data(), entry_gains.data(),
                         num_entries};
  const int64_t num_row_chunks = (num_out + kRowsPerChunk - 1) / kRowsPerChunk;
  const int64_t dim = view.dim;
  ParallelFor(pool, num_row_chunks, [&](int64_t c) {
    const int64_t r0 = c * kRowsPerChunk;
    const int64_t r1 = std::min(num_out, r0 + kRowsPerChunk);
    ForwardRows(plan, table_data, dim, r0, r1, out_data);
  });
  if (trace) fprintf(stderr, "advise %.3f sort %.3f gather %.3f workers %ld\n", t1 - t0, t2 - t1, now() - t2, (long)NumWorkers(pool));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseDenseMatmulCpu, SparseDenseMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // row_pointers
                                  .Arg<ffi::AnyBuffer>()  // embedding_ids
                                  .Arg<ffi::AnyBuffer>()  // sample_ids
                                  .Arg<ffi::AnyBuffer>()  // gains
                                  .Arg<ffi::AnyBuffer>()  // table
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int64_t>("num_segments")
                                  .Attr<int64_t>("samples_per_segment")
                                  .Attr<int64_t>("num_partitions")
                                  .Attr<int64_t>("rows_per_partition")
                                  .Attr<int64_t>("partition_begin"));

}  // namespace pzsc
