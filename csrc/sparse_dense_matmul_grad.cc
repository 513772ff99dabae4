// Backward handlers fused with the optimizer update (CPU), one per optimizer
// of the list (optimizer_list.h): SparseDenseMatmulGrad<Name>Cpu, the FFI
// target pzsc_sparse_dense_matmul_grad_<name>.
//
// Operands: activation_grad f32[num_segments * samples_per_segment, D], the
// COO buffers (as in the forward), table f32[R, D], the optimizer's slots
// (each f32[R, D] if the list says Table, f32[R, 1] if it says Row:
// optimizer_list.h) and hyperparameters f32[H] (see optimizers.h).
// Results: the new table and slots, aliased to the table and slot operands
// (input_output_aliases; the handler copies first if XLA gave it distinct
// buffers). For every table row referenced by at least one valid entry, the
// row gradient sum(gain * activation_grad[k * samples_per_segment + sid]) over
// all its entries (all segments) is formed in a fixed order and the optimizer
// is applied once; other rows and slots are not touched. Work and scratch are
// O(entries + threads), independent of R.
//
// The row sums binary-search each (segment, partition) slice by id, so they
// need the slice sorted by id, as the preprocessor writes it. A pass over
// the ids checks that (O(entries), a few microseconds per 100k entries); a
// slice that is not sorted has its valid entries copied into scratch and
// stably sorted by id, so any buffer contents give the reference's result
// (entries of one row still sum in buffer order). Every check and all of
// that preparation run before the first write: a call that returns an error
// leaves the table and slots unchanged.
//
// pzsc_check_coo runs that input pass alone (decoding, row pointer check,
// sortedness scan, sorted copies) and returns the number of slices it had to
// copy; the layer never calls it, the benchmark times it against the
// backward.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "coo_layout.h"
#include "huge_pages.h"
#include "optimizer_list.h"
#include "optimizers.h"
#include "parallel_for.h"
#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace pzsc {
namespace {

// Entries per parallel chunk (at least) and chunks per worker (at most).
constexpr int64_t kMinEntriesPerChunk = 2048;
constexpr int64_t kChunksPerWorker = 4;
// Split keys are quantiles of about this many sampled keys per chunk.
constexpr int64_t kSamplesPerChunk = 16;

// Copies `from` into `to` unless XLA already aliased them, then asks for
// huge pages behind `to` (see huge_pages.h). A fresh `to` is advised before
// the copy, so that the copy faults it in as huge pages directly.
void CopyIfDistinct(const ffi::AnyBuffer& from, ffi::AnyBuffer& to) {
  if (from.size_bytes() == 0) return;
  if (from.untyped_data() != to.untyped_data()) {
    AdviseHugePagesBeforeFirstTouch(to.untyped_data(), to.size_bytes());
    std::memcpy(to.untyped_data(), from.untyped_data(), from.size_bytes());
  }
  AdviseHugePages(to.untyped_data(), to.size_bytes());
}

// The backward's view of the entries: the slices as runs sorted by id, in
// partition then segment order, plus the storage of the sorted copies.
struct PreparedRuns {
  std::vector<SortedRun> runs;
  std::vector<int32_t> ids;
  std::vector<int32_t> sample_ids;
  std::vector<float> gains;
  int64_t copied_slices = 0;
  int64_t total = 0;  // Entries over all runs.
};

// One entry of a sorted copy.
struct CopiedEntry {
  int32_t id;
  int32_t sample_id;
  float gain;
};

// Fills `out` from the view's slices (CollectSlices: an error if the row
// pointers decrease, and nothing filled): sorted slices are used in place;
// the valid entries of the others are copied and stably sorted by id.
ffi::Error PrepareRuns(const CooView& view, PreparedRuns* out) {
  std::vector<Slice> slices;
  if (auto err = CollectSlices(view, &slices); err.failure()) return err;
  std::vector<char> sorted(slices.size());
  int64_t copied = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    sorted[i] = IdsSorted(view.ids + s.begin, s.end - s.begin);
    if (!sorted[i]) copied += s.end - s.begin;
  }
  // Sized once: the runs point into these vectors.
  out->ids.resize(copied);
  out->sample_ids.resize(copied);
  out->gains.resize(copied);
  out->runs.clear();
  out->runs.reserve(slices.size());
  out->copied_slices = 0;
  out->total = 0;
  std::vector<CopiedEntry> entries;
  int64_t at = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    const int64_t out_base = s.segment * view.attrs.samples_per_segment;
    SortedRun run{view.ids + s.begin, view.sample_ids + s.begin,
                  view.gains + s.begin, s.end - s.begin, s.partition,
                  out_base};
    if (!sorted[i]) {
      entries.clear();
      for (int64_t j = s.begin; j < s.end; ++j) {
        if (view.ValidEntry(j)) {
          entries.push_back({view.ids[j], view.sample_ids[j], view.gains[j]});
        }
      }
      std::stable_sort(entries.begin(), entries.end(),
                       [](const CopiedEntry& a, const CopiedEntry& b) {
                         return a.id < b.id;
                       });
      const int64_t n = static_cast<int64_t>(entries.size());
      for (int64_t j = 0; j < n; ++j) {
        out->ids[at + j] = entries[j].id;
        out->sample_ids[at + j] = entries[j].sample_id;
        out->gains[at + j] = entries[j].gain;
      }
      run = SortedRun{out->ids.data() + at, out->sample_ids.data() + at,
                      out->gains.data() + at, n, s.partition, out_base};
      at += n;
      ++out->copied_slices;
    }
    out->total += run.size;
    out->runs.push_back(run);
  }
  // Slices come segment-major: a stable sort keeps segment order.
  std::stable_sort(out->runs.begin(), out->runs.end(),
                   [](const SortedRun& a, const SortedRun& b) {
                     return a.partition < b.partition;
                   });
  return ffi::Error::Success();
}

// Splits the key space [0, num_table_partitions * rpp) into chunks of about
// equal entry counts; returns the chunk boundaries (first 0, last the end).
std::vector<int64_t> SplitKeys(const CooView& view, const PreparedRuns& runs,
                               int64_t num_workers) {
  const int64_t rpp = view.attrs.rows_per_partition;
  const int64_t key_end = view.num_table_partitions * rpp;
  const int64_t chunks = std::max<int64_t>(
      1, std::min(num_workers * kChunksPerWorker,
                  runs.total / kMinEntriesPerChunk));
  std::vector<int64_t> bounds = {0};
  if (chunks > 1) {
    const int64_t stride =
        std::max<int64_t>(1, runs.total / (chunks * kSamplesPerChunk));
    std::vector<int64_t> samples;
    for (const SortedRun& run : runs.runs) {
      for (int64_t j = 0; j < run.size; j += stride) {
        const int64_t id = std::clamp<int64_t>(run.ids[j], 0, rpp);
        samples.push_back(run.partition * rpp + id);
      }
    }
    std::sort(samples.begin(), samples.end());
    const int64_t n = static_cast<int64_t>(samples.size());
    for (int64_t c = 1; c < chunks; ++c) {
      const int64_t key = samples[c * n / chunks];
      if (key > bounds.back() && key < key_end) bounds.push_back(key);
    }
  }
  bounds.push_back(key_end);
  return bounds;
}

template <Optimizer kOpt>
ffi::Error SparseDenseMatmulGradImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer activation_grad,
    ffi::AnyBuffer row_pointers, ffi::AnyBuffer embedding_ids,
    ffi::AnyBuffer sample_ids, ffi::AnyBuffer gains, ffi::AnyBuffer table,
    ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> table_out,
    ffi::RemainingRets slots_out, LayoutAttrs attrs, bool clip,
    float clip_min, float clip_max, bool multiply_linear_by_learning_rate) {
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
  PreparedRuns runs;
  if (auto err = PrepareRuns(view, &runs); err.failure()) return err;

  // Nothing is written before this point.
  CopyIfDistinct(table, *table_out);
  BackwardPlan plan{};
  for (int s = 0; s < kSlots; ++s) {
    ffi::Result<ffi::AnyBuffer> slot_out = *slots_out.get<ffi::AnyBuffer>(s);
    CopyIfDistinct(*rest.get<ffi::AnyBuffer>(s), *slot_out);
    plan.slots[s] = slot_out->typed_data<float>();
    plan.slot_width[s] = SlotWidth(kOpt, s, view.dim);
  }
  if (view.dim == 0) return ffi::Error::Success();
  plan.view = &view;
  plan.runs = &runs.runs;
  plan.activation_grad = activation_grad.typed_data<float>();
  plan.table = table_out->untyped_data();
  if (view.table_dtype != TableDtype::kF32) {
    plan.rounding_seed =
        *rest.get<ffi::AnyBuffer>(kSlots + 1)->typed_data<uint32_t>();
    plan.row_base = attrs.partition_begin * attrs.rows_per_partition;
  }
  plan.optimizer = kOpt;
  std::copy_n(rest.get<ffi::AnyBuffer>(kSlots)->typed_data<float>(),
              NumHyperparameters(kOpt), plan.hyper.v);
  plan.hyper.multiply_linear_by_learning_rate =
      multiply_linear_by_learning_rate;
  plan.clip = clip;
  plan.clip_min = clip_min;
  plan.clip_max = clip_max;

  const std::vector<int64_t> bounds = SplitKeys(view, runs, NumWorkers(pool));
  ParallelFor(pool, static_cast<int64_t>(bounds.size()) - 1, [&](int64_t c) {
    BackwardKeys(plan, bounds[c], bounds[c + 1]);
  });
  return ffi::Error::Success();
}

ffi::Error CheckCooImpl(ffi::AnyBuffer row_pointers,
                        ffi::AnyBuffer embedding_ids,
                        ffi::AnyBuffer sample_ids, ffi::AnyBuffer gains,
                        ffi::AnyBuffer table,
                        ffi::Result<ffi::AnyBuffer> copied_slices,
                        LayoutAttrs attrs) {
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  if (auto err =
          CheckBuffer(*copied_slices, ffi::DataType::S32, 0, "copied_slices");
      err.failure()) {
    return err;
  }
  PreparedRuns runs;
  if (auto err = PrepareRuns(view, &runs); err.failure()) return err;
  *copied_slices->typed_data<int32_t>() =
      static_cast<int32_t>(runs.copied_slices);
  return ffi::Error::Success();
}

}  // namespace

#define PZSC_DEFINE_GRAD_HANDLER(Name, name, num_slots, num_hyperparameters, \
                                 rule, shape0, shape1)                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                             \
      SparseDenseMatmulGrad##Name##Cpu,                                      \
      SparseDenseMatmulGradImpl<Optimizer::k##Name>,                         \
      PZSC_BIND_GRAD_OPERANDS(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

PZSC_OPTIMIZERS(PZSC_DEFINE_GRAD_HANDLER)

#undef PZSC_DEFINE_GRAD_HANDLER

XLA_FFI_DEFINE_HANDLER_SYMBOL(CheckCooCpu, CheckCooImpl,
                              BindCooOperands(ffi::Ffi::Bind())
                                  .Ret<ffi::AnyBuffer>()  // copied_slices
                                  .Attr<LayoutAttrs>("layout"));

}  // namespace pzsc
