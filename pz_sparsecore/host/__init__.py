"""Stage 2, on the host: ids in, `PreprocessedInput` buffers out.

* `ragged_input`: reading the id formats (dense, ragged,
  `(values, row_splits)`; the compiled reader's Python side); `coo_input`:
  reading COO triples and BCOO (a leaf format of `ragged_input`);
  `sparse_coo`: upstream's COO preprocessing entry points.
* `preprocess`: the public entry point, by the plan; `fill` (+
  `_fill_numba`): partitioning, sorting and filling one batch's buffers,
  and the stats, with numba.
* `minibatching` (+ `_minibatch_numba`, `_highwayhash`): the host half of
  minibatching (bucket split, buffers of up to 64 minibatches).
* `fdo`: feedback-directed limits from stats.
* `pipeline`: prefetching preprocessed batches on a thread.

Imports `core` only; never `device`, `nn` or `viz`.
"""
