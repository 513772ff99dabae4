// The optimizers with a compiled fused update: the one list of them in the
// C++ and CUDA sources. One line per optimizer,
//
//   X(Name, name, num_slots, num_hyperparameters, rule, shape0, shape1)
//
// Name: the C++ spelling: enumerator Optimizer::k<Name>, its rule in
//   optimizers.h (below), handlers SparseDenseMatmulGrad<Name>Cpu and
//   SparseDenseMatmulGrad<Name>Cuda;
// name: the registry's name (pz_sparsecore/core/optimizers.py), which names
//   the FFI target pzsc_sparse_dense_matmul_grad_<name>;
// num_slots: the number of slot operands (0, 1 or 2: PZSC_SLOT_ARGS);
// num_hyperparameters: the length of the hyper-parameter vector;
// rule: Element or Row, how the update is written (optimizers.h):
//   Element: <Name>Element(h, w, slot elements..., g), one element at a
//     time, independent of the rest of the row; every slot is Table;
//   Row: the update needs a reduction over the whole row first, in three
//     parts: <Name>RowTerm(h, col, w, g) -> float, one element's term of
//     the row's sum (col: its column, an int); <Name>Row(h, slot
//     values..., sum) -> <Name>RowState, which updates the row's slot
//     values once; <Name>Element(h, state, w, g), one element from that
//     state; every slot is Row;
// shape0, shape1: each slot's operand shape, Table, Row or None (no such
//   slot; exactly num_slots of them are not None, first):
//   Table: the table's shape [..., V, D], one value per table element;
//   Row: the table's leading dims and last dim 1, [..., V, 1], one float32
//     per table row (the registry's "rowwise_1d").
//
// Generated from it: the Optimizer enum with NumSlots / NumHyperparameters /
// IsRowRule / SlotShapeOf (optimizers.h), the CPU row-update dispatch
// (row_kernels.cc), the CPU and CUDA handlers (sparse_dense_matmul_grad.cc,
// sparse_dense_matmul_cuda.cu), and the extension's registrations and
// optimizers() (module.cc), which the Python package checks against its
// registry when it loads the extension.
//
// Adding an optimizer here: one line, its rule in optimizers.h (an Element
// rule: <Name>Element with the slot elements in the registry's slot order,
// then the gradient; a Row rule: the three functions above and its
// <Name>RowState), and its registry entry and spec in Python (the recipe:
// the docstring of pz_sparsecore/core/optimizers.py).
#ifndef PZSC_CSRC_OPTIMIZER_LIST_H_
#define PZSC_CSRC_OPTIMIZER_LIST_H_

#define PZSC_OPTIMIZERS(X)                                          \
  X(Sgd, sgd, 0, 1, Element, None, None)                            \
  X(Adagrad, adagrad, 1, 1, Element, Table, None)                   \
  X(AdagradMomentum, adagrad_momentum, 2, 6, Element, Table, Table) \
  X(Adam, adam, 2, 4, Element, Table, Table)                        \
  X(Ftrl, ftrl, 2, 5, Element, Table, Table)                        \
  X(LaProp, laprop, 2, 4, Element, Table, Table)                    \
  X(F2A, f2a, 2, 6, Element, Table, Table)                          \
  X(RowwiseAdagrad, rowwise_adagrad, 1, 5, Row, Row, None)

// The first `slots` of (s0, s1), each followed by a comma: the slot
// arguments of a rule, from the list's slot count, e.g.
// Name##Element(h, w, PZSC_SLOT_ARGS(num_slots, a[i], b[i]) g[i]) (an
// Element rule's slot elements) or
// Name##Row(h, PZSC_SLOT_ARGS(num_slots, a[row], b[row]) sum) (a Row
// rule's slot values).
#define PZSC_SLOT_ARGS(num_slots, s0, s1) PZSC_SLOT_ARGS_##num_slots(s0, s1)
#define PZSC_SLOT_ARGS_0(s0, s1)
#define PZSC_SLOT_ARGS_1(s0, s1) s0,
#define PZSC_SLOT_ARGS_2(s0, s1) s0, s1,
// The most slots PZSC_SLOT_ARGS (and the CUDA handlers' UpdateArgs) pass.
#define PZSC_SLOT_ARGS_MAX 2

#endif  // PZSC_CSRC_OPTIMIZER_LIST_H_
