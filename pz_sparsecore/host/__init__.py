"""Stage 2, on the host: ids in, `PreprocessedInput` buffers out.

* `ragged_input`, `sparse_coo`: reading the input formats (dense, ragged,
  `(values, row_splits)`, COO / sparse tensors); the compiled reader's
  Python side.
* `preprocess` (+ `_fill_numba`): partitioning, sorting and filling the
  buffers, and the stats, with numba.
* `minibatching` (+ `_minibatch_numba`, `_highwayhash`): the host half of
  minibatching (bucket split, buffers of up to 64 minibatches).
* `fdo`: feedback-directed limits from stats.
* `pipeline`: prefetching preprocessed batches on a thread.

Imports `core` only; never `device`, `nn` or `viz`.
"""
