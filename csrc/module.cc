// nanobind module exposing the XLA FFI handlers as PyCapsules.
//
// `registrations()` maps each FFI target name to {platform: capsule}; the
// Python package registers them with jax.ffi.register_ffi_target at import.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace pzsc {
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradSgdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradAdagradCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradAdagradMomentumCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradAdamCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradFtrlCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradLaPropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradF2ACpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CheckCooCpu);
#ifdef PZSC_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradSgdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradAdagradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradAdagradMomentumCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradAdamCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradFtrlCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradLaPropCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SparseDenseMatmulGradF2ACuda);
#endif

// Bumped whenever a handler's operands, attributes or contract change, or a
// target is added or removed (pz_sparsecore/kernels/ffi.py: ABI_VERSION).
constexpr int kAbiVersion = 6;
}  // namespace pzsc

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_pzsc_ffi, m) {
  m.def("abi_version", []() { return pzsc::kAbiVersion; });
  m.def("registrations", []() {
    nb::dict regs;
    auto add = [&](const char* name, const char* platform, nb::capsule cap) {
      if (!regs.contains(name)) regs[name] = nb::dict();
      nb::dict platforms = nb::borrow<nb::dict>(regs[name]);
      platforms[platform] = cap;
    };
    add("pzsc_sparse_dense_matmul", "cpu",
        Capsule(pzsc::SparseDenseMatmulCpu));
    add("pzsc_sparse_dense_matmul_grad_sgd", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradSgdCpu));
    add("pzsc_sparse_dense_matmul_grad_adagrad", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradAdagradCpu));
    add("pzsc_sparse_dense_matmul_grad_adagrad_momentum", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradAdagradMomentumCpu));
    add("pzsc_sparse_dense_matmul_grad_adam", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradAdamCpu));
    add("pzsc_sparse_dense_matmul_grad_ftrl", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradFtrlCpu));
    add("pzsc_sparse_dense_matmul_grad_laprop", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradLaPropCpu));
    add("pzsc_sparse_dense_matmul_grad_f2a", "cpu",
        Capsule(pzsc::SparseDenseMatmulGradF2ACpu));
    add("pzsc_check_coo", "cpu", Capsule(pzsc::CheckCooCpu));
#ifdef PZSC_WITH_CUDA
    add("pzsc_sparse_dense_matmul", "CUDA",
        Capsule(pzsc::SparseDenseMatmulCuda));
    add("pzsc_sparse_dense_matmul_grad_sgd", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradSgdCuda));
    add("pzsc_sparse_dense_matmul_grad_adagrad", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradAdagradCuda));
    add("pzsc_sparse_dense_matmul_grad_adagrad_momentum", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradAdagradMomentumCuda));
    add("pzsc_sparse_dense_matmul_grad_adam", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradAdamCuda));
    add("pzsc_sparse_dense_matmul_grad_ftrl", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradFtrlCuda));
    add("pzsc_sparse_dense_matmul_grad_laprop", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradLaPropCuda));
    add("pzsc_sparse_dense_matmul_grad_f2a", "CUDA",
        Capsule(pzsc::SparseDenseMatmulGradF2ACuda));
#endif
    return regs;
  });
  m.def("has_cuda", []() {
#ifdef PZSC_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}
