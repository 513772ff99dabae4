#include "coo_layout.h"

#include <algorithm>
#include <string>

namespace pzsc {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

ffi::Error CheckBuffer(const ffi::AnyBuffer& buffer, ffi::DataType dtype,
                       int64_t rank, const char* name) {
  if (buffer.element_type() != dtype) {
    return ffi::Error::InvalidArgument(
        std::string(name) + " has the wrong dtype (expected " +
        (dtype == ffi::DataType::S32 ? "int32" : "float32") + ")");
  }
  if (static_cast<int64_t>(buffer.dimensions().size()) != rank) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have rank " +
                                       Str(rank) + ", got rank " +
                                       Str(buffer.dimensions().size()));
  }
  return ffi::Error::Success();
}

ffi::Error CheckMatrix(const ffi::AnyBuffer& buffer, int64_t rows,
                       int64_t cols, const char* name) {
  if (auto err = CheckBuffer(buffer, ffi::DataType::F32, 2, name);
      err.failure()) {
    return err;
  }
  const auto dims = buffer.dimensions();
  if (dims[0] != rows || dims[1] != cols) {
    return ffi::Error::InvalidArgument(
        std::string(name) + " must have shape [" + Str(rows) + ", " +
        Str(cols) + "], got [" + Str(dims[0]) + ", " + Str(dims[1]) + "]");
  }
  return ffi::Error::Success();
}

int64_t LeadingRows(const ffi::AnyBuffer& buffer) {
  const auto dims = buffer.dimensions();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) rows *= dims[i];
  return rows;
}

ffi::DataType FfiType(TableDtype dtype) {
  switch (dtype) {
    case TableDtype::kBF16:
      return ffi::DataType::BF16;
    case TableDtype::kF16:
      return ffi::DataType::F16;
    case TableDtype::kF32:
      break;
  }
  return ffi::DataType::F32;
}

const char* DtypeName(TableDtype dtype) {
  switch (dtype) {
    case TableDtype::kBF16:
      return "bfloat16";
    case TableDtype::kF16:
      return "float16";
    case TableDtype::kF32:
      break;
  }
  return "float32";
}

ffi::Error CheckRows(const ffi::AnyBuffer& buffer, int64_t rows, int64_t cols,
                     const char* name, ffi::DataType dtype) {
  if (buffer.element_type() != dtype || buffer.dimensions().size() < 2) {
    const char* type = dtype == ffi::DataType::BF16  ? "bfloat16"
                       : dtype == ffi::DataType::F16 ? "float16"
                                                     : "float32";
    return ffi::Error::InvalidArgument(std::string(name) + " must be " + type +
                                       " of rank >= 2");
  }
  if (LeadingRows(buffer) != rows || buffer.dimensions().back() != cols) {
    return ffi::Error::InvalidArgument(
        std::string(name) + " must hold " + Str(rows) + " rows of " +
        Str(cols) + ", got " + Str(LeadingRows(buffer)) + " rows of " +
        Str(buffer.dimensions().back()));
  }
  return ffi::Error::Success();
}

ffi::Error MakeCooView(const LayoutAttrs& attrs,
                       const ffi::AnyBuffer& row_pointers,
                       const ffi::AnyBuffer& embedding_ids,
                       const ffi::AnyBuffer& sample_ids,
                       const ffi::AnyBuffer& gains,
                       const ffi::AnyBuffer& table, CooView* view) {
  using ffi::DataType;
  if (attrs.num_segments <= 0 || attrs.samples_per_segment <= 0 ||
      attrs.num_partitions <= 0 || attrs.rows_per_partition <= 0 ||
      attrs.partition_begin < 0) {
    return ffi::Error::InvalidArgument(
        "num_segments, samples_per_segment, num_partitions and "
        "rows_per_partition must be positive and partition_begin >= 0");
  }
  if (auto e = CheckBuffer(row_pointers, DataType::S32, 1, "row_pointers");
      e.failure()) {
    return e;
  }
  if (auto e = CheckBuffer(embedding_ids, DataType::S32, 1, "embedding_ids");
      e.failure()) {
    return e;
  }
  if (auto e = CheckBuffer(sample_ids, DataType::S32, 1, "sample_ids");
      e.failure()) {
    return e;
  }
  if (auto e = CheckBuffer(gains, DataType::F32, 1, "gains"); e.failure()) {
    return e;
  }
  const DataType table_type = table.element_type();
  if ((table_type != DataType::F32 && table_type != DataType::BF16 &&
       table_type != DataType::F16) ||
      table.dimensions().size() < 2) {
    return ffi::Error::InvalidArgument(
        "table must be float32, bfloat16 or float16 of rank >= 2 (rows..., "
        "dim)");
  }
  const int64_t n = static_cast<int64_t>(embedding_ids.element_count());
  if (static_cast<int64_t>(sample_ids.element_count()) != n ||
      static_cast<int64_t>(gains.element_count()) != n) {
    return ffi::Error::InvalidArgument(
        "embedding_ids, sample_ids and gains must have the same length");
  }
  if (n % attrs.num_segments != 0) {
    return ffi::Error::InvalidArgument(
        "COO buffer length " + Str(n) + " is not a multiple of num_segments " +
        Str(attrs.num_segments));
  }
  const int64_t nrp = static_cast<int64_t>(row_pointers.element_count());
  if (nrp % attrs.num_segments != 0 ||
      nrp / attrs.num_segments < attrs.num_partitions) {
    return ffi::Error::InvalidArgument(
        "row_pointers length " + Str(nrp) + " must be num_segments (" +
        Str(attrs.num_segments) + ") times a stride >= num_partitions (" +
        Str(attrs.num_partitions) + ")");
  }
  if (attrs.samples_per_segment > kMaxOutputs / attrs.num_segments) {
    return ffi::Error::InvalidArgument(
        "num_segments * samples_per_segment (" + Str(attrs.num_segments) +
        " * " + Str(attrs.samples_per_segment) + ") exceeds " +
        Str(kMaxOutputs) + " output rows");
  }
  const int64_t table_rows = LeadingRows(table);
  if (table_rows % attrs.rows_per_partition != 0) {
    return ffi::Error::InvalidArgument(
        "table rows " + Str(table_rows) +
        " are not a multiple of rows_per_partition " +
        Str(attrs.rows_per_partition));
  }
  view->row_pointers = row_pointers.typed_data<int32_t>();
  view->ids = embedding_ids.typed_data<int32_t>();
  view->sample_ids = sample_ids.typed_data<int32_t>();
  view->gains = gains.typed_data<float>();
  view->attrs = attrs;
  view->seg_len = n / attrs.num_segments;
  view->rp_stride = nrp / attrs.num_segments;
  view->num_table_partitions = table_rows / attrs.rows_per_partition;
  view->dim = table.dimensions().back();
  view->table_dtype = table_type == DataType::BF16  ? TableDtype::kBF16
                      : table_type == DataType::F16 ? TableDtype::kF16
                                                    : TableDtype::kF32;
  return ffi::Error::Success();
}

ffi::Error CollectSlices(const CooView& v, std::vector<Slice>* slices) {
  const LayoutAttrs& a = v.attrs;
  slices->clear();
  for (int64_t k = 0; k < a.num_segments; ++k) {
    const int32_t* rp = v.row_pointers + k * v.rp_stride;
    int64_t begin = 0;
    for (int64_t p = 0; p < a.num_partitions; ++p) {
      const int64_t end = std::clamp<int64_t>(rp[p], 0, v.seg_len);
      const int64_t local = p - a.partition_begin;
      if (begin < end && local >= 0 && local < v.num_table_partitions) {
        slices->push_back(
            Slice{k, local, k * v.seg_len + begin, k * v.seg_len + end});
      }
      const int64_t next = RoundUp(end, kPartitionAlignment);
      if (p + 1 < a.num_partitions && next < begin) {
        slices->clear();
        return ffi::Error::InvalidArgument(
            "row_pointers of segment " + Str(k) + " decrease: partition " +
            Str(p + 1) + " would start at " + Str(next) + " (rp[" + Str(p) +
            "] = " + Str(rp[p]) + "), before partition " + Str(p) +
            " (start " + Str(begin) + ")");
      }
      begin = next;
    }
  }
  return ffi::Error::Success();
}

namespace {

// Checks that slot operand or result `buffer` is f32 of rank >= 2 holding
// `rows` rows of the width its list shape gives (SlotWidth); `name` (e.g.
// "slot 0") goes into errors, with what the shape means.
ffi::Error CheckSlotRows(const ffi::AnyBuffer& buffer, int64_t rows,
                         SlotShape shape, int64_t dim,
                         const std::string& name) {
  if (buffer.element_type() != ffi::DataType::F32 ||
      buffer.dimensions().size() < 2) {
    return ffi::Error::InvalidArgument(name + " must be float32 of rank >= 2");
  }
  const int64_t cols = shape == SlotShape::kRow ? 1 : dim;
  if (LeadingRows(buffer) == rows && buffer.dimensions().back() == cols) {
    return ffi::Error::Success();
  }
  const std::string got = ", got " + Str(LeadingRows(buffer)) + " rows of " +
                          Str(buffer.dimensions().back());
  if (shape == SlotShape::kRow) {
    return ffi::Error::InvalidArgument(name + " must hold " + Str(rows) +
                                       " rows of 1 (one value per row)" +
                                       got);
  }
  return ffi::Error::InvalidArgument(name + " must have the table's shape (" +
                                     Str(rows) + " rows of " + Str(cols) +
                                     ")" + got);
}

}  // namespace

// Checks the operands beyond the COO buffers: the activation gradient, the
// table result, the slots and their results (each with its own width), the
// hyperparameters and the clip range.
ffi::Error CheckGradOperands(Optimizer optimizer, const CooView& view,
                             const ffi::AnyBuffer& activation_grad,
                             const ffi::AnyBuffer& table,
                             ffi::RemainingArgs rest,
                             ffi::Result<ffi::AnyBuffer> table_out,
                             ffi::RemainingRets slots_out, bool clip,
                             float clip_min, float clip_max) {
  const int num_slots = NumSlots(optimizer);
  const int num_hyperparameters = NumHyperparameters(optimizer);
  const int64_t num_rows = LeadingRows(table);
  if (auto err = CheckMatrix(activation_grad, view.num_outputs(), view.dim,
                             "activation_grad");
      err.failure()) {
    return err;
  }
  const bool seeded = view.table_dtype != TableDtype::kF32;
  if (rest.size() != static_cast<size_t>(num_slots) + 1 + seeded ||
      slots_out.size() != static_cast<size_t>(num_slots)) {
    return ffi::Error::InvalidArgument(
        "expected " + std::to_string(num_slots) +
        " slot operands and results plus the hyperparameters" +
        (seeded ? std::string(" and the rounding seed (a ") +
                      DtypeName(view.table_dtype) + " table)"
                : std::string()));
  }
  if (auto err = CheckRows(*table_out, num_rows, view.dim, "table result",
                           FfiType(view.table_dtype));
      err.failure()) {
    return err;
  }
  if (seeded) {
    auto seed = rest.get<ffi::AnyBuffer>(num_slots + 1);
    if (seed.has_error()) return seed.error();
    if (seed->element_type() != ffi::DataType::U32 ||
        seed->element_count() != 1) {
      return ffi::Error::InvalidArgument(
          "the rounding seed must be one uint32");
    }
  }
  for (int s = 0; s < num_slots; ++s) {
    auto slot = rest.get<ffi::AnyBuffer>(s);
    auto slot_out = slots_out.get<ffi::AnyBuffer>(s);
    if (slot.has_error()) return slot.error();
    if (slot_out.has_error()) return slot_out.error();
    const SlotShape shape = SlotShapeOf(optimizer, s);
    if (auto err = CheckSlotRows(*slot, num_rows, shape, view.dim,
                                 "slot " + Str(s));
        err.failure()) {
      return err;
    }
    if (auto err = CheckSlotRows(**slot_out, num_rows, shape, view.dim,
                                 "slot result " + Str(s));
        err.failure()) {
      return err;
    }
  }
  auto hyper = rest.get<ffi::AnyBuffer>(num_slots);
  if (hyper.has_error()) return hyper.error();
  if (auto err = CheckBuffer(*hyper, ffi::DataType::F32, 1, "hyperparameters");
      err.failure()) {
    return err;
  }
  if (static_cast<int64_t>(hyper->element_count()) != num_hyperparameters) {
    return ffi::Error::InvalidArgument(
        "hyperparameters must have " +
        std::to_string(num_hyperparameters) + " elements, got " +
        std::to_string(hyper->element_count()));
  }
  if (clip && !(clip_min <= clip_max)) {
    return ffi::Error::InvalidArgument("clip_min must be <= clip_max");
  }
  return ffi::Error::Success();
}

}  // namespace pzsc
