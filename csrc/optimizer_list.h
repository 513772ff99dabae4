// The optimizers with a compiled fused update: the one list of them in the
// C++ and CUDA sources. One line per optimizer,
//
//   X(Name, name, num_slots, num_hyperparameters)
//
// Name: the C++ spelling: enumerator Optimizer::k<Name>, element rule
//   <Name>Element (optimizers.h), handlers SparseDenseMatmulGrad<Name>Cpu
//   and SparseDenseMatmulGrad<Name>Cuda;
// name: the registry's name (pz_sparsecore/core/optimizers.py), which names
//   the FFI target pzsc_sparse_dense_matmul_grad_<name>;
// num_slots: the number of slot operands (0, 1 or 2: PZSC_SLOT_ARGS);
// num_hyperparameters: the length of the hyper-parameter vector.
//
// Generated from it: the Optimizer enum with NumSlots / NumHyperparameters
// (optimizers.h), the CPU row-update dispatch (row_kernels.cc), the CPU and
// CUDA handlers (sparse_dense_matmul_grad.cc, sparse_dense_matmul_cuda.cu),
// and the extension's registrations and optimizers() (module.cc), which the
// Python package checks against its registry when it loads the extension.
//
// Adding an optimizer here: one line, its <Name>Element in optimizers.h (the
// slot elements in the registry's slot order, then the gradient), and its
// registry entry and spec in Python (the recipe: the docstring of
// pz_sparsecore/core/optimizers.py).
#ifndef PZSC_CSRC_OPTIMIZER_LIST_H_
#define PZSC_CSRC_OPTIMIZER_LIST_H_

#define PZSC_OPTIMIZERS(X)                   \
  X(Sgd, sgd, 0, 1)                          \
  X(Adagrad, adagrad, 1, 1)                  \
  X(AdagradMomentum, adagrad_momentum, 2, 6) \
  X(Adam, adam, 2, 4)                        \
  X(Ftrl, ftrl, 2, 5)                        \
  X(LaProp, laprop, 2, 4)                    \
  X(F2A, f2a, 2, 6)

// The first `slots` of (s0, s1), each followed by a comma: the slot
// arguments of an element rule, from the list's slot count, e.g.
// Name##Element(h, w, PZSC_SLOT_ARGS(num_slots, a[i], b[i]) g[i]).
#define PZSC_SLOT_ARGS(num_slots, s0, s1) PZSC_SLOT_ARGS_##num_slots(s0, s1)
#define PZSC_SLOT_ARGS_0(s0, s1)
#define PZSC_SLOT_ARGS_1(s0, s1) s0,
#define PZSC_SLOT_ARGS_2(s0, s1) s0, s1,
// The most slots PZSC_SLOT_ARGS (and the CUDA handlers' UpdateArgs) pass.
#define PZSC_SLOT_ARGS_MAX 2

#endif  // PZSC_CSRC_OPTIMIZER_LIST_H_
