// The compiled ragged-id reader: id batches of several features to one flat,
// range-checked id array and one row-splits array (no Python-level loop).
//
// read_ids(leaves, vocab, wide) reads, per feature, one batch in any of the
// forms of pz_sparsecore/ragged_input.py:
//   * a list or a 1-D object ndarray of 1-D integer ndarrays (ragged rows;
//     an empty row may have any dtype),
//   * a 2-D integer ndarray [batch, k],
//   * a (values, row_splits) tuple of 1-D integer ndarrays.
// Integer arrays may have any native-endian integer dtype and any strides.
// It returns (values, row_splits, num_rows): values int32 (int64 when `wide`)
// holding every feature's rows end to end, row_splits int64 [rows + 1] with
// row r = values[row_splits[r]:row_splits[r + 1]], num_rows int64 [features].
// Feature f's ids must lie in [0, vocab[f]); vocab[f] = -1 takes any id
// (a hashed table's raw ids; with `wide`, a uint64 id keeps its 64 bits).
//
// Anything else (another container, a non-array row, a float row, a bad
// row_splits, an id out of range) returns the index of the first such
// feature (in order) instead: the Python reader then converts that feature
// and raises the error that names it. The reader never raises for bad input.
// It holds the GIL and keeps the garbage collector off throughout, so no
// Python code runs and the objects it reads cannot change under it.
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <nanobind/nanobind.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

namespace nb = nanobind;

namespace {

// One feature's batch, classified by the first pass.
struct Leaf {
  enum Kind { kRows, kDense, kSplits } kind = kRows;
  PyObject* const* rows = nullptr;  // kRows: the row objects
  npy_intp row_stride = 1;          // kRows: in PyObject* units
  PyArrayObject* array = nullptr;   // kDense: [B, k]; kSplits: values
  PyArrayObject* splits = nullptr;  // kSplits: row_splits
  npy_intp num_rows = 0;
  npy_intp num_values = 0;
};

PyObject* Row(const Leaf& leaf, npy_intp i) {
  return leaf.rows[i * leaf.row_stride];
}

bool IsIntegerArray(PyArrayObject* a) {
  const char kind = PyArray_DESCR(a)->kind;
  const npy_intp size = PyArray_ITEMSIZE(a);
  return (kind == 'i' || kind == 'u') && PyArray_ISNOTSWAPPED(a) &&
         (size == 1 || size == 2 || size == 4 || size == 8);
}

// Calls fn(T{}) with T the C type of integer array `a`'s elements.
template <typename Fn>
auto WithIntType(PyArrayObject* a, const Fn& fn) {
  const bool is_signed = PyArray_DESCR(a)->kind == 'i';
  switch (PyArray_ITEMSIZE(a)) {
    case 1:
      return is_signed ? fn(int8_t{}) : fn(uint8_t{});
    case 2:
      return is_signed ? fn(int16_t{}) : fn(uint16_t{});
    case 4:
      return is_signed ? fn(int32_t{}) : fn(uint32_t{});
    default:
      return is_signed ? fn(int64_t{}) : fn(uint64_t{});
  }
}

// `vocab` of a feature that takes any id (vocab[f] = -1).
constexpr uint64_t kAnyId = ~uint64_t{0};

// The id as an unsigned number; negative ids become huge, so one comparison
// with the vocabulary checks both ends of the range.
template <typename T>
uint64_t AsUnsigned(T v) {
  using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  return static_cast<uint64_t>(static_cast<Wide>(v));
}

// Copies n ids spaced `stride` bytes apart; returns whether all are in range
// (always, for kAnyId).
template <typename T, typename Out>
bool CopyIds(const char* src, npy_intp n, npy_intp stride, Out* dst,
             uint64_t vocab) {
  bool ok = true;
  if (stride == static_cast<npy_intp>(sizeof(T))) {
    T tmp;
    for (npy_intp j = 0; j < n; ++j) {
      std::memcpy(&tmp, src + j * sizeof(T), sizeof(T));  // any alignment
      ok &= (AsUnsigned(tmp) < vocab) | (vocab == kAnyId);
      dst[j] = static_cast<Out>(tmp);
    }
    return ok;
  }
  for (npy_intp j = 0; j < n; ++j) {
    T v;
    std::memcpy(&v, src + j * stride, sizeof(T));
    ok &= (AsUnsigned(v) < vocab) | (vocab == kAnyId);
    dst[j] = static_cast<Out>(v);
  }
  return ok;
}

// A row of ragged rows: a 1-D ndarray, of integers unless it is empty.
bool RowLength(PyObject* row, npy_intp* length) {
  if (row == nullptr || !PyArray_Check(row)) return false;
  auto* a = reinterpret_cast<PyArrayObject*>(row);
  if (PyArray_NDIM(a) != 1) return false;
  *length = PyArray_DIM(a, 0);
  return *length == 0 || IsIntegerArray(a);
}

bool ClassifyRows(PyObject* obj, Leaf* leaf) {
  leaf->kind = Leaf::kRows;
  if (PyList_Check(obj)) {
    leaf->rows = PySequence_Fast_ITEMS(obj);
    leaf->num_rows = PyList_GET_SIZE(obj);
  } else {
    auto* a = reinterpret_cast<PyArrayObject*>(obj);
    const npy_intp stride = PyArray_STRIDE(a, 0);
    if (stride % static_cast<npy_intp>(sizeof(PyObject*)) != 0) return false;
    leaf->rows = static_cast<PyObject* const*>(PyArray_DATA(a));
    leaf->row_stride = stride / static_cast<npy_intp>(sizeof(PyObject*));
    leaf->num_rows = PyArray_DIM(a, 0);
  }
  for (npy_intp i = 0; i < leaf->num_rows; ++i) {
    npy_intp length;
    if (!RowLength(Row(*leaf, i), &length)) return false;
    leaf->num_values += length;
  }
  return true;
}

// Row splits must rise from 0 to the number of values.
bool CheckSplits(PyArrayObject* splits, npy_intp num_values) {
  const char* p = PyArray_BYTES(splits);
  const npy_intp stride = PyArray_STRIDE(splits, 0);
  const npy_intp n = PyArray_DIM(splits, 0);
  return WithIntType(splits, [&](auto zero) {
    using T = decltype(zero);
    uint64_t prev = 0;
    for (npy_intp i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, p + i * stride, sizeof(T));
      const uint64_t u = AsUnsigned(v);
      if ((i == 0 && u != 0) || u < prev) return false;
      prev = u;
    }
    return prev == static_cast<uint64_t>(num_values);
  });
}

bool ClassifySplits(PyObject* obj, Leaf* leaf) {
  if (PyTuple_GET_SIZE(obj) != 2) return false;
  PyObject* values = PyTuple_GET_ITEM(obj, 0);
  PyObject* splits = PyTuple_GET_ITEM(obj, 1);
  if (!PyArray_Check(values) || !PyArray_Check(splits)) return false;
  leaf->kind = Leaf::kSplits;
  leaf->array = reinterpret_cast<PyArrayObject*>(values);
  leaf->splits = reinterpret_cast<PyArrayObject*>(splits);
  if (PyArray_NDIM(leaf->array) != 1 || !IsIntegerArray(leaf->array) ||
      PyArray_NDIM(leaf->splits) != 1 || !IsIntegerArray(leaf->splits) ||
      PyArray_DIM(leaf->splits, 0) < 1) {
    return false;
  }
  leaf->num_values = PyArray_DIM(leaf->array, 0);
  leaf->num_rows = PyArray_DIM(leaf->splits, 0) - 1;
  return CheckSplits(leaf->splits, leaf->num_values);
}

bool Classify(PyObject* obj, Leaf* leaf) {
  if (PyTuple_Check(obj)) return ClassifySplits(obj, leaf);
  if (PyList_Check(obj)) return ClassifyRows(obj, leaf);
  if (!PyArray_Check(obj)) return false;
  auto* a = reinterpret_cast<PyArrayObject*>(obj);
  if (PyArray_TYPE(a) == NPY_OBJECT) {
    return PyArray_NDIM(a) == 1 && ClassifyRows(obj, leaf);
  }
  if (PyArray_NDIM(a) != 2 || !IsIntegerArray(a)) return false;
  leaf->kind = Leaf::kDense;
  leaf->array = a;
  leaf->num_rows = PyArray_DIM(a, 0);
  leaf->num_values = PyArray_DIM(a, 0) * PyArray_DIM(a, 1);
  return true;
}

// Copies 1-D integer array `a` to dst; returns whether all ids are in range.
template <typename Out>
bool CopyArray(PyArrayObject* a, Out* dst, uint64_t vocab) {
  return WithIntType(a, [&](auto zero) {
    return CopyIds<decltype(zero)>(PyArray_BYTES(a), PyArray_DIM(a, 0),
                                   PyArray_STRIDE(a, 0), dst, vocab);
  });
}

// Writes one feature's ids at dst and its row splits (shifted by `base`)
// at splits[0 .. num_rows - 1]; returns whether all ids are in range.
template <typename Out>
bool CopyLeaf(const Leaf& leaf, uint64_t vocab, int64_t base, Out* dst,
              int64_t* splits) {
  bool ok = true;
  switch (leaf.kind) {
    case Leaf::kRows: {
      int64_t pos = 0;
      for (npy_intp i = 0; i < leaf.num_rows; ++i) {
        auto* row = reinterpret_cast<PyArrayObject*>(Row(leaf, i));
        splits[i] = base + pos;
        const npy_intp n = PyArray_DIM(row, 0);
        if (n > 0) ok &= CopyArray(row, dst + pos, vocab);
        pos += n;
      }
      return ok;
    }
    case Leaf::kDense: {
      const npy_intp k = PyArray_DIM(leaf.array, 1);
      const npy_intp row_stride = PyArray_STRIDE(leaf.array, 0);
      const npy_intp col_stride = PyArray_STRIDE(leaf.array, 1);
      WithIntType(leaf.array, [&](auto zero) {
        for (npy_intp i = 0; i < leaf.num_rows; ++i) {
          splits[i] = base + i * k;
          ok &= CopyIds<decltype(zero)>(PyArray_BYTES(leaf.array) +
                                            i * row_stride,
                                        k, col_stride, dst + i * k, vocab);
        }
        return 0;
      });
      return ok;
    }
    case Leaf::kSplits: {
      const char* p = PyArray_BYTES(leaf.splits);
      const npy_intp stride = PyArray_STRIDE(leaf.splits, 0);
      WithIntType(leaf.splits, [&](auto zero) {
        for (npy_intp i = 0; i < leaf.num_rows; ++i) {
          decltype(zero) v;
          std::memcpy(&v, p + i * stride, sizeof(v));
          splits[i] = base + static_cast<int64_t>(v);
        }
        return 0;
      });
      return CopyArray(leaf.array, dst, vocab);
    }
  }
  return false;
}

nb::object NewArray(npy_intp size, int type) {
  PyObject* a = PyArray_EMPTY(1, &size, type, 0);
  if (a == nullptr) throw nb::python_error();
  return nb::steal(a);
}

template <typename Out>
nb::object Fill(const std::vector<Leaf>& leaves, const int64_t* vocab,
                npy_intp total_values, npy_intp total_rows, int type) {
  nb::object values = NewArray(total_values, type);
  nb::object splits = NewArray(total_rows + 1, NPY_INT64);
  nb::object num_rows = NewArray(static_cast<npy_intp>(leaves.size()),
                                 NPY_INT64);
  auto* out = static_cast<Out*>(
      PyArray_DATA(reinterpret_cast<PyArrayObject*>(values.ptr())));
  auto* split = static_cast<int64_t*>(
      PyArray_DATA(reinterpret_cast<PyArrayObject*>(splits.ptr())));
  auto* rows = static_cast<int64_t*>(
      PyArray_DATA(reinterpret_cast<PyArrayObject*>(num_rows.ptr())));
  int64_t value_pos = 0, row_pos = 0;
  for (size_t f = 0; f < leaves.size(); ++f) {
    const Leaf& leaf = leaves[f];
    if (!CopyLeaf(leaf, static_cast<uint64_t>(vocab[f]), value_pos,
                  out + value_pos, split + row_pos)) {
      return nb::int_(f);
    }
    rows[f] = leaf.num_rows;
    value_pos += leaf.num_values;
    row_pos += leaf.num_rows;
  }
  split[row_pos] = value_pos;
  return nb::make_tuple(values, splits, num_rows);
}

// The first feature that cannot be read, given that feature `k` cannot: the
// first of features [0, k) with an id out of range, else k.
size_t FirstUnreadable(const std::vector<Leaf>& leaves, const int64_t* vocab,
                       size_t k) {
  for (size_t f = 0; f < k; ++f) {
    std::vector<int64_t> values(leaves[f].num_values);
    std::vector<int64_t> splits(leaves[f].num_rows);
    if (!CopyLeaf(leaves[f], static_cast<uint64_t>(vocab[f]), 0,
                  values.data(), splits.data())) {
      return f;
    }
  }
  return k;
}

nb::object Read(nb::list leaf_list, const int64_t* vocab, bool wide) {
  const size_t n = nb::len(leaf_list);
  std::vector<Leaf> leaves(n);
  npy_intp total_values = 0, total_rows = 0;
  for (size_t f = 0; f < n; ++f) {
    if (vocab[f] < -1 || !Classify(leaf_list[f].ptr(), &leaves[f])) {
      return nb::int_(FirstUnreadable(leaves, vocab, f));
    }
    total_values += leaves[f].num_values;
    total_rows += leaves[f].num_rows;
  }
  if (wide) {
    return Fill<int64_t>(leaves, vocab, total_values, total_rows, NPY_INT64);
  }
  return Fill<int32_t>(leaves, vocab, total_values, total_rows, NPY_INT32);
}

nb::object ReadIds(nb::list leaf_list, nb::object vocab_array, bool wide) {
  if (!PyArray_Check(vocab_array.ptr())) {
    throw nb::type_error("vocab must be an int64 ndarray");
  }
  auto* vocab = reinterpret_cast<PyArrayObject*>(vocab_array.ptr());
  if (PyArray_TYPE(vocab) != NPY_INT64 || PyArray_NDIM(vocab) != 1 ||
      !PyArray_IS_C_CONTIGUOUS(vocab) ||
      static_cast<size_t>(PyArray_DIM(vocab, 0)) != nb::len(leaf_list)) {
    throw nb::type_error("vocab must be a contiguous int64 [features] array");
  }
  // No collection (and so no finalizer that could edit a batch) runs
  // between reading the batches' shapes and copying them.
  const int gc_was_enabled = PyGC_Disable();
  nb::object result;
  try {
    result = Read(leaf_list, static_cast<const int64_t*>(PyArray_DATA(vocab)),
                  wide);
  } catch (...) {
    if (gc_was_enabled) PyGC_Enable();
    throw;
  }
  if (gc_was_enabled) PyGC_Enable();
  return result;
}

}  // namespace

NB_MODULE(_pzsc_ragged, m) {
  if (PyArray_ImportNumPyAPI() < 0) throw nb::python_error();
  m.def("read_ids", &ReadIds, nb::arg("leaves"), nb::arg("vocab"),
        nb::arg("wide"),
        "Every feature's ids end to end: (values, row_splits, num_rows), or "
        "the index of the first feature it cannot read.");
}
