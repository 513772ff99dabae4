// nanobind module exposing the XLA FFI handlers as PyCapsules.
//
// `registrations()` maps each FFI target name to {platform: capsule}; the
// Python package registers them with jax.ffi.register_ffi_target at import,
// after checking `abi_version()` and `optimizers()` (the optimizer handlers,
// from optimizer_list.h) against what it expects
// (pz_sparsecore/device/kernels/ffi.py).
#include <nanobind/nanobind.h>

#include "abi_version.h"
#include "optimizer_list.h"
#include "optimizers.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

// The FFI target of the fused backward of the optimizer `name` (a registry
// name, unquoted).
#define PZSC_GRAD_TARGET(name) "pzsc_sparse_dense_matmul_grad_" #name

namespace pzsc {
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CheckCooCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HashedMapResolveCpu);
#define PZSC_DECLARE_GRAD_CPU(Name, name, num_slots, num_hyperparameters, \
                              rule, shape0, shape1)                       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGrad##Name##Cpu);
PZSC_OPTIMIZERS(PZSC_DECLARE_GRAD_CPU)
#undef PZSC_DECLARE_GRAD_CPU
#ifdef PZSC_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HashedMapResolveCuda);
#define PZSC_DECLARE_GRAD_CUDA(Name, name, num_slots, num_hyperparameters, \
                               rule, shape0, shape1)                       \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGrad##Name##Cuda);
PZSC_OPTIMIZERS(PZSC_DECLARE_GRAD_CUDA)
#undef PZSC_DECLARE_GRAD_CUDA
// Copies the CUDA handlers' status word into out[0..5] and clears it;
// returns 6, or 0 if no error was recorded (sparse_dense_matmul_cuda.cu).
int TakeCudaStatus(int64_t* out);
#endif
}  // namespace pzsc

namespace {

// The registry's name of a slot shape (SlotShape in
// pz_sparsecore/core/optimizers.py; upstream's slot_shape.py literals).
const char* SlotShapeName(pzsc::SlotShape shape) {
  switch (shape) {
    case pzsc::SlotShape::kTable:
      return "table";
    case pzsc::SlotShape::kRow:
      return "rowwise_1d";
    case pzsc::SlotShape::kNone:
      break;
  }
  return "none";
}

// The names of the optimizer's slot shapes, one per slot.
nb::tuple SlotShapeNames(pzsc::Optimizer opt) {
  nb::list names;
  for (int s = 0; s < pzsc::NumSlots(opt); ++s) {
    names.append(SlotShapeName(pzsc::SlotShapeOf(opt, s)));
  }
  return nb::tuple(names);
}

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_pzsc_ffi, m) {
  m.def(
      "abi_version", []() { return pzsc::kAbiVersion; },
      "The handlers' ABI version (abi_version.h).");
  m.def(
      "optimizers",
      []() {
        nb::list optimizers;
#define PZSC_DESCRIBE(Name, name, num_slots, num_hyperparameters, rule, \
                      shape0, shape1)                                   \
  optimizers.append(nb::make_tuple(                                     \
      #name, PZSC_GRAD_TARGET(name),                                    \
      pzsc::NumSlots(pzsc::Optimizer::k##Name),                         \
      pzsc::NumHyperparameters(pzsc::Optimizer::k##Name),               \
      SlotShapeNames(pzsc::Optimizer::k##Name)));
        PZSC_OPTIMIZERS(PZSC_DESCRIBE)
#undef PZSC_DESCRIBE
        return optimizers;
      },
      "The optimizer handlers, one (name, target, num_slots, "
      "num_hyperparameters, slot_shapes) tuple each, in optimizer_list.h's "
      "order; slot_shapes has one \"table\" or \"rowwise_1d\" per slot.");
  m.def("registrations", []() {
    nb::dict regs;
    auto add = [&](const char* name, const char* platform, nb::capsule cap) {
      if (!regs.contains(name)) regs[name] = nb::dict();
      nb::dict platforms = nb::borrow<nb::dict>(regs[name]);
      platforms[platform] = cap;
    };
    add("pzsc_sparse_dense_matmul", "cpu",
        Capsule(pzsc::SparseDenseMatmulCpu));
#define PZSC_ADD_GRAD_CPU(Name, name, num_slots, num_hyperparameters, rule, \
                          shape0, shape1)                                   \
  add(PZSC_GRAD_TARGET(name), "cpu",                                        \
      Capsule(pzsc::SparseDenseMatmulGrad##Name##Cpu));
    PZSC_OPTIMIZERS(PZSC_ADD_GRAD_CPU)
#undef PZSC_ADD_GRAD_CPU
    add("pzsc_check_coo", "cpu", Capsule(pzsc::CheckCooCpu));
    add("pzsc_hashed_map_resolve", "cpu",
        Capsule(pzsc::HashedMapResolveCpu));
#ifdef PZSC_WITH_CUDA
    add("pzsc_sparse_dense_matmul", "CUDA",
        Capsule(pzsc::SparseDenseMatmulCuda));
#define PZSC_ADD_GRAD_CUDA(Name, name, num_slots, num_hyperparameters, rule, \
                           shape0, shape1)                                   \
  add(PZSC_GRAD_TARGET(name), "CUDA",                                        \
      Capsule(pzsc::SparseDenseMatmulGrad##Name##Cuda));
    PZSC_OPTIMIZERS(PZSC_ADD_GRAD_CUDA)
#undef PZSC_ADD_GRAD_CUDA
    add("pzsc_hashed_map_resolve", "CUDA",
        Capsule(pzsc::HashedMapResolveCuda));
#endif
    return regs;
  });
  m.def(
      "take_cuda_status",
      []() -> nb::object {
#ifdef PZSC_WITH_CUDA
        int64_t words[6] = {};
        if (pzsc::TakeCudaStatus(words) == 0) return nb::none();
        return nb::make_tuple(words[0], words[1], words[2], words[3],
                              words[4], words[5]);
#else
        return nb::none();
#endif
      },
      "The latest error the CUDA handlers recorded on the device since the "
      "last call (code, segment, partition, next start, rp[partition], "
      "start), cleared; None if none.");
  m.def("has_cuda", []() {
#ifdef PZSC_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
