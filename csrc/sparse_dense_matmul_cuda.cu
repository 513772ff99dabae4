// CUDA handlers (optional build, -DPZSC_CUDA=ON): the forward and the SGD
// fused backward, with the same operands, attributes and results as the CPU
// handlers (sparse_dense_matmul.cc, sparse_dense_matmul_grad.cc).
//
// One thread block per (segment, partition) reads its range from the row
// pointers on the device; one warp per entry adds gain * row into the output
// (forward) or -lr * gain * activation_grad into the table row (SGD) with
// float atomics. SGD is linear, so the per-entry atomic updates equal one
// update with the summed row gradient; clipping runs afterwards, once the
// sums are complete. Unlike the CPU handlers, the summation order (and so
// the last bits of the result) is not deterministic.
//
// Same contract as the CPU handlers (coo_layout.h) for any buffer contents:
// every entry is checked on its own (ids need not be sorted), and row
// pointers whose partition starts decrease are an error. That check reads
// the row pointers on the host: each call copies them (num_segments x
// rp_stride int32) to the host and synchronises the stream before launching
// anything. Every CUDA call's status is checked; a failure is returned as an
// error naming the call.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "coo_layout.h"
#include "xla/ffi/api/ffi.h"

namespace pzsc {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
// The grid's y dimension (segments) is at most this.
constexpr int64_t kMaxGridY = 65535;
// The grid's x dimension (partitions) is at most this.
constexpr int64_t kMaxGridX = 2147483647;

struct DeviceLayout {
  const int32_t* row_pointers;
  const int32_t* ids;
  const int32_t* sample_ids;
  const float* gains;
  int64_t seg_len;
  int64_t rp_stride;
  int64_t num_partitions;
  int64_t samples_per_segment;
  int64_t rows_per_partition;
  int64_t partition_begin;
  int64_t num_table_partitions;
  int64_t dim;
};

DeviceLayout MakeDeviceLayout(const CooView& v) {
  return DeviceLayout{v.row_pointers,      v.ids,
                      v.sample_ids,        v.gains,
                      v.seg_len,           v.rp_stride,
                      v.attrs.num_partitions, v.attrs.samples_per_segment,
                      v.attrs.rows_per_partition, v.attrs.partition_begin,
                      v.num_table_partitions, v.dim};
}

__device__ int64_t Clamp(int64_t v, int64_t hi) {
  return v < 0 ? 0 : (v > hi ? hi : v);
}

// Entry range [*begin, *end) (absolute) of block (segment, partition); false
// if the partition is empty or outside the table window.
__device__ bool PartitionRange(const DeviceLayout& l, int64_t k, int64_t p,
                               int64_t* begin, int64_t* end) {
  const int32_t* rp = l.row_pointers + k * l.rp_stride;
  int64_t b = 0;
  if (p > 0) {
    const int64_t prev = Clamp(rp[p - 1], l.seg_len);
    b = (prev + kPartitionAlignment - 1) / kPartitionAlignment *
        kPartitionAlignment;
  }
  const int64_t e = Clamp(rp[p], l.seg_len);
  const int64_t local = p - l.partition_begin;
  if (b >= e || local < 0 || local >= l.num_table_partitions) return false;
  *begin = k * l.seg_len + b;
  *end = k * l.seg_len + e;
  return true;
}

__device__ bool Valid(const DeviceLayout& l, int64_t j) {
  const int32_t id = l.ids[j];
  const int32_t sid = l.sample_ids[j];
  return id != kPadId && id >= 0 && id < l.rows_per_partition && sid >= 0 &&
         sid < l.samples_per_segment;
}

// Grid: (num_partitions, num_segments); block: kWarpsPerBlock warps.
__global__ void ForwardKernel(DeviceLayout l, const float* table, float* out) {
  const int64_t p = blockIdx.x, k = blockIdx.y;
  int64_t begin, end;
  if (!PartitionRange(l, k, p, &begin, &end)) return;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t row_base = (p - l.partition_begin) * l.rows_per_partition;
  for (int64_t j = begin + warp; j < end; j += kWarpsPerBlock) {
    if (!Valid(l, j)) continue;
    const float g = l.gains[j];
    const float* src = table + (row_base + l.ids[j]) * l.dim;
    float* dst = out + (k * l.samples_per_segment + l.sample_ids[j]) * l.dim;
    for (int64_t d = lane; d < l.dim; d += kWarpSize) {
      atomicAdd(dst + d, g * src[d]);
    }
  }
}

// SGD: table[row] -= lr * gain * activation_grad[k * B + sid] per entry.
__global__ void SgdKernel(DeviceLayout l, const float* grad, const float* hyper,
                          float* table) {
  const int64_t p = blockIdx.x, k = blockIdx.y;
  int64_t begin, end;
  if (!PartitionRange(l, k, p, &begin, &end)) return;
  const float lr = hyper[0];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t row_base = (p - l.partition_begin) * l.rows_per_partition;
  for (int64_t j = begin + warp; j < end; j += kWarpsPerBlock) {
    if (!Valid(l, j)) continue;
    const float scale = -lr * l.gains[j];
    const float* src =
        grad + (k * l.samples_per_segment + l.sample_ids[j]) * l.dim;
    float* dst = table + (row_base + l.ids[j]) * l.dim;
    for (int64_t d = lane; d < l.dim; d += kWarpSize) {
      atomicAdd(dst + d, scale * src[d]);
    }
  }
}

// Clamps every referenced row (idempotent, so repeated rows are harmless).
__global__ void ClipKernel(DeviceLayout l, float lo, float hi, float* table) {
  const int64_t p = blockIdx.x, k = blockIdx.y;
  int64_t begin, end;
  if (!PartitionRange(l, k, p, &begin, &end)) return;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t row_base = (p - l.partition_begin) * l.rows_per_partition;
  for (int64_t j = begin + warp; j < end; j += kWarpsPerBlock) {
    if (!Valid(l, j)) continue;
    float* row = table + (row_base + l.ids[j]) * l.dim;
    for (int64_t d = lane; d < l.dim; d += kWarpSize) {
      row[d] = fminf(fmaxf(row[d], lo), hi);
    }
  }
}

ffi::Error CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " +
                              cudaGetErrorString(err));
}

#define PZSC_CUDA_RETURN_IF_ERROR(call)                           \
  if (ffi::Error err = CudaError((call), #call); err.failure()) { \
    return err;                                                   \
  }

// Checks the row pointers as the CPU handlers do (CollectSlices on a host
// copy): an error if a segment's partition starts decrease.
ffi::Error CheckRowPointers(cudaStream_t stream, const CooView& view) {
  std::vector<int32_t> host(view.attrs.num_segments * view.rp_stride);
  PZSC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), view.row_pointers,
                                            host.size() * sizeof(int32_t),
                                            cudaMemcpyDeviceToHost, stream));
  PZSC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  CooView on_host = view;
  on_host.row_pointers = host.data();
  std::vector<Slice> slices;
  return CollectSlices(on_host, &slices);
}

dim3 Grid(const CooView& v) {
  return dim3(static_cast<unsigned>(v.attrs.num_partitions),
              static_cast<unsigned>(v.attrs.num_segments));
}

// Checks the layout fits one launch grid, then the row pointers.
ffi::Error CheckLaunch(cudaStream_t stream, const CooView& view) {
  if (view.attrs.num_segments > kMaxGridY ||
      view.attrs.num_partitions > kMaxGridX) {
    return ffi::Error::InvalidArgument(
        "the CUDA handlers take at most " + std::to_string(kMaxGridY) +
        " segments and " + std::to_string(kMaxGridX) + " partitions");
  }
  return CheckRowPointers(stream, view);
}

ffi::Error ForwardCudaImpl(cudaStream_t stream, ffi::AnyBuffer row_pointers,
                           ffi::AnyBuffer embedding_ids,
                           ffi::AnyBuffer sample_ids, ffi::AnyBuffer gains,
                           ffi::AnyBuffer table,
                           ffi::Result<ffi::AnyBuffer> out,
                           LayoutAttrs attrs) {
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  if (auto err = CheckMatrix(*out, view.num_outputs(), view.dim, "output");
      err.failure()) {
    return err;
  }
  if (auto err = CheckLaunch(stream, view); err.failure()) return err;
  if (out->size_bytes() == 0) return ffi::Error::Success();
  PZSC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream));
  if (view.dim > 0 && view.seg_len > 0) {
    ForwardKernel<<<Grid(view), kWarpSize * kWarpsPerBlock, 0, stream>>>(
        MakeDeviceLayout(view), table.typed_data<float>(),
        out->typed_data<float>());
    PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return ffi::Error::Success();
}

ffi::Error SgdCudaImpl(cudaStream_t stream, ffi::AnyBuffer activation_grad,
                       ffi::AnyBuffer row_pointers,
                       ffi::AnyBuffer embedding_ids, ffi::AnyBuffer sample_ids,
                       ffi::AnyBuffer gains, ffi::AnyBuffer table,
                       ffi::RemainingArgs rest,
                       ffi::Result<ffi::AnyBuffer> table_out,
                       ffi::RemainingRets slots_out, LayoutAttrs attrs,
                       bool clip, float clip_min, float clip_max,
                       bool /*multiply_linear_by_learning_rate*/) {
  CooView view;
  if (auto err = MakeCooView(attrs, row_pointers, embedding_ids, sample_ids,
                             gains, table, &view);
      err.failure()) {
    return err;
  }
  if (auto err = CheckMatrix(activation_grad, view.num_outputs(), view.dim,
                             "activation_grad");
      err.failure()) {
    return err;
  }
  if (rest.size() != 1 || slots_out.size() != 0) {
    return ffi::Error::InvalidArgument(
        "sgd takes no slots, only the hyperparameters");
  }
  auto hyper = rest.get<ffi::AnyBuffer>(0);
  if (hyper.has_error()) return hyper.error();
  if (auto err = CheckBuffer(*hyper, ffi::DataType::F32, 1, "hyperparameters");
      err.failure()) {
    return err;
  }
  if (hyper->element_count() != 1) {
    return ffi::Error::InvalidArgument("sgd takes 1 hyperparameter");
  }
  if (auto err = CheckRows(*table_out, LeadingRows(table), view.dim,
                             "table result");
      err.failure()) {
    return err;
  }
  if (clip && !(clip_min <= clip_max)) {
    return ffi::Error::InvalidArgument("clip_min must be <= clip_max");
  }
  if (auto err = CheckLaunch(stream, view); err.failure()) return err;
  // Nothing is written before this point.
  if (table.size_bytes() > 0 &&
      table.untyped_data() != table_out->untyped_data()) {
    PZSC_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(table_out->untyped_data(), table.untyped_data(),
                        table.size_bytes(), cudaMemcpyDeviceToDevice, stream));
  }
  if (view.dim > 0 && view.seg_len > 0) {
    const DeviceLayout l = MakeDeviceLayout(view);
    float* w = table_out->typed_data<float>();
    SgdKernel<<<Grid(view), kWarpSize * kWarpsPerBlock, 0, stream>>>(
        l, activation_grad.typed_data<float>(), hyper->typed_data<float>(), w);
    PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (clip) {
      ClipKernel<<<Grid(view), kWarpSize * kWarpsPerBlock, 0, stream>>>(
          l, clip_min, clip_max, w);
      PZSC_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparseDenseMatmulCuda, ForwardCudaImpl,
    BindCooOperands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
        .Ret<ffi::AnyBuffer>()  // out
        .Attr<LayoutAttrs>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SparseDenseMatmulGradSgdCuda, SgdCudaImpl,
    BindCooOperands(ffi::Ffi::Bind()
                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                        .Arg<ffi::AnyBuffer>())  // activation_grad
        .RemainingArgs()                         // hyperparameters
        .Ret<ffi::AnyBuffer>()                   // table (aliased)
        .RemainingRets()                         // no slots
        .Attr<LayoutAttrs>("layout")
        .Attr<bool>("clip")
        .Attr<float>("clip_min")
        .Attr<float>("clip_max")
        .Attr<bool>("multiply_linear_by_learning_rate"));

}  // namespace pzsc
