// Backward handlers fused with the optimizer update (CPU), one per optimizer:
// pzsc_sparse_dense_matmul_grad_{sgd,adagrad,adagrad_momentum,adam,ftrl}.
//
// Operands: activation_grad f32[num_segments * samples_per_segment, D], the
// COO buffers (as in the forward), table f32[R, D], the optimizer's slots
// (each f32[R, D]) and hyperparameters f32[H] (see optimizers.h).
// Results: the new table and slots, aliased to the table and slot operands
// (input_output_aliases; the handler copies first if XLA gave it distinct
// buffers). For every table row referenced by at least one valid entry, the
// row gradient sum(gain * activation_grad[k * samples_per_segment + sid]) over
// all its entries (all segments) is formed in a fixed order and the optimizer
// is applied once; other rows and slots are not touched. Work and scratch are
// O(entries + threads), independent of R. Requires each (segment, partition)
// slice to be sorted by row, as the preprocessor writes it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "coo_layout.h"
#include "huge_pages.h"
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
  if (from.untyped_data() != to.untyped_data()) {
    AdviseHugePagesBeforeFirstTouch(to.untyped_data(), to.size_bytes());
    std::memcpy(to.untyped_data(), from.untyped_data(), from.size_bytes());
  }
  AdviseHugePages(to.untyped_data(), to.size_bytes());
}

// Splits the key space [0, num_table_partitions * rpp) into chunks of about
// equal entry counts; returns the chunk boundaries (first 0, last the end).
std::vector<int64_t> SplitKeys(const CooView& view,
                               const std::vector<Slice>& slices,
                               int64_t num_workers) {
  const int64_t rpp = view.attrs.rows_per_partition;
  const int64_t key_end = view.num_table_partitions * rpp;
  int64_t total = 0;
  for (const Slice& s : slices) total += s.end - s.begin;
  const int64_t chunks = std::max<int64_t>(
      1, std::min(num_workers * kChunksPerWorker, total / kMinEntriesPerChunk));
  std::vector<int64_t> bounds = {0};
  if (chunks > 1) {
    const int64_t stride =
        std::max<int64_t>(1, total / (chunks * kSamplesPerChunk));
    std::vector<int64_t> samples;
    for (const Slice& s : slices) {
      for (int64_t j = s.begin; j < s.end; j += stride) {
        const int64_t id = std::clamp<int64_t>(view.ids[j], 0, rpp);
        samples.push_back(s.partition * rpp + id);
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
    ffi::RemainingRets slots_out, int64_t num_segments,
    int64_t samples_per_segment, int64_t num_partitions,
    int64_t rows_per_partition, int64_t partition_begin, bool clip,
    float clip_min, float clip_max, bool multiply_linear_by_learning_rate) {
  constexpr int kSlots = NumSlots(kOpt);
  const LayoutAttrs attrs{num_segments, samples_per_segment, num_partitions,
                          rows_per_partition, partition_begin};
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  const int64_t num_rows = LeadingRows(table);
  if (auto err = CheckMatrix(activation_grad, view.num_outputs(), view.dim,
                             "activation_grad");
      err.failure()) {
    return err;
  }
  if (rest.size() != kSlots + 1 || slots_out.size() != kSlots) {
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(kSlots) +
        " slot operands and results plus the hyperparameters");
  }
  if (auto err = CheckRows(*table_out, num_rows, view.dim, "table result");
      err.failure()) {
    return err;
  }
  CopyIfDistinct(table, *table_out);
  BackwardPlan plan{};
  for (int s = 0; s < kSlots; ++s) {
    auto slot = rest.get<ffi::AnyBuffer>(s);
    auto slot_out = slots_out.get<ffi::AnyBuffer>(s);
    if (slot.has_error()) return slot.error();
    if (slot_out.has_error()) return slot_out.error();
    if (auto err = CheckRows(*slot, num_rows, view.dim, "slot");
        err.failure()) {
      return err;
    }
    if (auto err = CheckRows(**slot_out, num_rows, view.dim, "slot result");
        err.failure()) {
      return err;
    }
    CopyIfDistinct(*slot, **slot_out);
    plan.slots[s] = (*slot_out)->typed_data<float>();
  }
  auto hyper = rest.get<ffi::AnyBuffer>(kSlots);
  if (hyper.has_error()) return hyper.error();
  if (auto err = CheckBuffer(*hyper, ffi::DataType::F32, 1, "hyperparameters");
      err.failure()) {
    return err;
  }
  if (static_cast<int64_t>(hyper->element_count()) != NumHyperparameters(kOpt)) {
    return ffi::Error::InvalidArgument(
        "hyperparameters must have " +
        std::to_string(NumHyperparameters(kOpt)) + " elements, got " +
        std::to_string(hyper->element_count()));
  }
  if (clip && !(clip_min <= clip_max)) {
    return ffi::Error::InvalidArgument("clip_min must be <= clip_max");
  }
  if (view.dim == 0) return ffi::Error::Success();

  const std::vector<Slice> slices = CollectSlices(view);
  std::vector<std::vector<Slice>> parts(view.num_table_partitions);
  for (const Slice& s : slices) parts[s.partition].push_back(s);

  plan.view = &view;
  plan.parts = &parts;
  plan.activation_grad = activation_grad.typed_data<float>();
  plan.table = table_out->typed_data<float>();
  plan.optimizer = kOpt;
  std::copy_n(hyper->typed_data<float>(), NumHyperparameters(kOpt),
              plan.hyper.v);
  plan.hyper.multiply_linear_by_learning_rate =
      multiply_linear_by_learning_rate;
  plan.clip = clip;
  plan.clip_min = clip_min;
  plan.clip_max = clip_max;

  const std::vector<int64_t> bounds = SplitKeys(view, slices, NumWorkers(pool));
  ParallelFor(pool, static_cast<int64_t>(bounds.size()) - 1, [&](int64_t c) {
    BackwardKeys(plan, bounds[c], bounds[c + 1]);
  });
  return ffi::Error::Success();
}

}  // namespace

#define PZSC_DEFINE_GRAD_HANDLER(name, opt)                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                 \
      name, SparseDenseMatmulGradImpl<opt>,                      \
      ffi::Ffi::Bind()                                           \
          .Ctx<ffi::ThreadPool>()                                \
          .Arg<ffi::AnyBuffer>() /* activation_grad */           \
          .Arg<ffi::AnyBuffer>() /* row_pointers */              \
          .Arg<ffi::AnyBuffer>() /* embedding_ids */             \
          .Arg<ffi::AnyBuffer>() /* sample_ids */                \
          .Arg<ffi::AnyBuffer>() /* gains */                     \
          .Arg<ffi::AnyBuffer>() /* table */                     \
          .RemainingArgs()       /* slots..., hyperparameters */ \
          .Ret<ffi::AnyBuffer>() /* table (aliased) */           \
          .RemainingRets()       /* slots (aliased) */           \
          .Attr<int64_t>("num_segments")                         \
          .Attr<int64_t>("samples_per_segment")                  \
          .Attr<int64_t>("num_partitions")                       \
          .Attr<int64_t>("rows_per_partition")                   \
          .Attr<int64_t>("partition_begin")                      \
          .Attr<bool>("clip")                                    \
          .Attr<float>("clip_min")                               \
          .Attr<float>("clip_max")                               \
          .Attr<bool>("multiply_linear_by_learning_rate"))

PZSC_DEFINE_GRAD_HANDLER(SparseDenseMatmulGradSgdCpu, Optimizer::kSgd);
PZSC_DEFINE_GRAD_HANDLER(SparseDenseMatmulGradAdagradCpu, Optimizer::kAdagrad);
PZSC_DEFINE_GRAD_HANDLER(SparseDenseMatmulGradAdagradMomentumCpu,
                         Optimizer::kAdagradMomentum);
PZSC_DEFINE_GRAD_HANDLER(SparseDenseMatmulGradAdamCpu, Optimizer::kAdam);
PZSC_DEFINE_GRAD_HANDLER(SparseDenseMatmulGradFtrlCpu, Optimizer::kFtrl);

#undef PZSC_DEFINE_GRAD_HANDLER

}  // namespace pzsc
