"""Feedback-directed optimisation (FDO) of the preprocessing limits.

The preprocessor measures, for every batch, how many ids each SparseCore
sends to each partition (`SparseDenseMatmulInputStats`). The limits in the
`StackedTableSpec`s size the device buffers; too small and ids are dropped,
too large and memory and bandwidth are wasted. FDO closes the loop:

1. `client.record(stats)` after every preprocessing call (local, cheap);
2. every k steps `client.publish()` persists this process's records;
3. after a barrier, `client.load()` aggregates every process's latest
   publication (element-wise max);
4. `update_preprocessing_parameters(feature_specs, stats, S)` returns new
   specs whose limits and buffer size match the observed maxima; `jit` then
   recompiles for the new buffer shapes.

`NPZFileFDOClient` publishes one `fdo_stats_<process>_<time_ns>.npz` file per
call, written to a temporary name and renamed, so a reader never sees a
partial file. Files that cannot be read (truncated, corrupt) or that belong
to another run (a different `run_id`) are reported with a warning and
skipped.
"""

from __future__ import annotations

import abc
import collections
import glob
import os
import re
import tempfile
import time
import warnings
import zipfile
from typing import Any

import jax
import numpy as np

from pz_sparsecore import buffer_format, layout
from pz_sparsecore.preprocess import SparseDenseMatmulInputStats

_FIELDS = {
  "_max_ids": "max_ids_per_partition",
  "_max_unique_ids": "max_unique_ids_per_partition",
  "_required_buffer_size": "required_buffer_size_per_sc",
  "_id_drop_counters": "id_drop_counters",
}
_RUN_ID_KEY = "__run_id__"
_FILE_PATTERN = re.compile(r"fdo_stats_(\d+)_(\d+)\.npz$")


class FDOClient(abc.ABC):
  """Collects preprocessing statistics and shares them between processes."""

  @abc.abstractmethod
  def record(self, stats: SparseDenseMatmulInputStats) -> None:
    """Accumulates one batch's statistics locally."""

  @abc.abstractmethod
  def publish(self) -> None:
    """Persists this process's accumulated statistics."""

  @abc.abstractmethod
  def load(self) -> SparseDenseMatmulInputStats:
    """The aggregate of every process's latest publication."""


def _split_key(key: str) -> tuple[str, str]:
  for suffix, field in _FIELDS.items():
    if key.endswith(suffix):
      return key[: -len(suffix)], field
  raise ValueError(f"FDO file key {key!r} has no known statistic suffix")


class NPZFileFDOClient(FDOClient):
  """FDO client storing statistics as NPZ files in a shared directory.

  Args:
    base_dir: Directory shared by all processes (created if missing).
    run_id: Optional run identifier written into every file; files with a
      different identifier are skipped by `load`.
  """

  def __init__(self, base_dir: str | os.PathLike, run_id: str | None = None):
    self.base_dir = os.fspath(base_dir)
    self.run_id = run_id
    os.makedirs(self.base_dir, exist_ok=True)
    self._records: dict[str, list[np.ndarray]] = collections.defaultdict(list)

  def record(self, stats: SparseDenseMatmulInputStats) -> None:
    """Appends one batch's statistics (as int64 rows) to the local record."""
    for suffix, field in _FIELDS.items():
      for stack, value in getattr(stats, field).items():
        row = np.atleast_1d(np.asarray(value, dtype=np.int64))
        self._records[stack + suffix].append(row)

  def publish(self) -> None:
    """Writes the local record to `fdo_stats_<process>_<time_ns>.npz`.

    Raises:
      ValueError: If nothing was recorded.
    """
    if not self._records:
      raise ValueError("FDO publish: nothing recorded yet")
    data = {key: np.vstack(rows) for key, rows in self._records.items()}
    if self.run_id is not None:
      data[_RUN_ID_KEY] = np.asarray(self.run_id)
    name = f"fdo_stats_{jax.process_index()}_{time.time_ns()}.npz"
    fd, tmp = tempfile.mkstemp(dir=self.base_dir, prefix=".tmp_fdo_")
    try:
      with os.fdopen(fd, "wb") as f:
        np.savez(f, **data)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, os.path.join(self.base_dir, name))
    except BaseException:
      if os.path.exists(tmp):
        os.unlink(tmp)
      raise

  def _latest_files(self) -> list[str]:
    newest: dict[int, tuple[int, str]] = {}
    for path in glob.glob(os.path.join(self.base_dir, "fdo_stats*.npz")):
      match = _FILE_PATTERN.search(os.path.basename(path))
      if match is None:
        warnings.warn(f"FDO: skipping unrecognised file {path}", stacklevel=3)
        continue
      process, stamp = int(match.group(1)), int(match.group(2))
      if process not in newest or stamp > newest[process][0]:
        newest[process] = (stamp, path)
    return [path for _, path in sorted(newest.values(), key=lambda x: x[1])]

  def _read(self, path: str) -> dict[str, np.ndarray] | None:
    try:
      with np.load(path, allow_pickle=False) as npz:
        data = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
      warnings.warn(f"FDO: skipping unreadable file {path}: {e}", stacklevel=3)
      return None
    run_id = data.pop(_RUN_ID_KEY, None)
    if self.run_id is not None and (
      run_id is None or str(run_id) != self.run_id
    ):
      warnings.warn(
        f"FDO: skipping {path}: it belongs to run "
        f"{None if run_id is None else str(run_id)!r}, not {self.run_id!r}",
        stacklevel=3,
      )
      return None
    return data

  def load(self) -> SparseDenseMatmulInputStats:
    """Element-wise max over every record of each process's newest file.

    Raises:
      FileNotFoundError: If no readable file exists.
      ValueError: If a file holds a key with an unknown suffix.
    """
    fields: dict[str, dict[str, Any]] = {f: {} for f in _FIELDS.values()}
    found = False
    for path in self._latest_files():
      data = self._read(path)
      if data is None:
        continue
      found = True
      for key, value in data.items():
        stack, field = _split_key(key)
        reduced = np.max(np.atleast_2d(value), axis=0)
        previous = fields[field].get(stack)
        if previous is not None:
          if previous.shape != reduced.shape:
            raise ValueError(
              f"FDO: {path} has {key} of shape {reduced.shape}, other "
              f"processes {previous.shape}; files from different topologies"
            )
          reduced = np.maximum(previous, reduced)
        fields[field][stack] = reduced
    if not found:
      raise FileNotFoundError(
        f"FDO: no readable stats files in {self.base_dir}"
      )
    fields["id_drop_counters"] = {
      stack: int(value.max())
      for stack, value in fields["id_drop_counters"].items()
    }
    return SparseDenseMatmulInputStats(**fields)


def update_preprocessing_parameters(
  feature_specs: Any,
  stats: SparseDenseMatmulInputStats,
  num_sc_per_device: int,
  *,
  global_device_count: int | None = None,
) -> Any:
  """New feature specs whose stack limits match the observed statistics.

  For every stack present in `stats`: `max_ids_per_partition` and
  `max_unique_ids_per_partition` become the observed maxima (at least 1),
  and `suggested_coo_buffer_size_per_device` the largest required buffer
  per SparseCore times `num_sc_per_device`. Stacks missing from `stats` keep
  their values.

  Args:
    feature_specs: Prepared feature specs.
    stats: Observed statistics (e.g. `FDOClient.load()`).
    num_sc_per_device: SparseCores per device.
    global_device_count: If given, the suggested buffer is capped at the
      theoretical maximum `r8(max_ids) * S * N` the new limits allow
      (`buffer_format.compute_theoretical_max_coo_buffer_size`; a buffer
      above it would be rejected by the preprocessor).

  Returns:
    New feature specs; the arguments are unchanged.

  Raises:
    ValueError: If the specs are not prepared.
  """
  stacks = layout.get_stacked_table_specs(feature_specs)

  def observed(field: str, stack: str, default: int | None) -> int | None:
    values = getattr(stats, field).get(stack)
    if values is None or np.size(values) == 0:
      return default
    return max(int(np.max(values)), 1)

  new_stacks = {}
  for name, spec in stacks.items():
    required = observed("required_buffer_size_per_sc", name, None)
    max_ids = observed(
      "max_ids_per_partition", name, spec.max_ids_per_partition
    )
    suggested = spec.suggested_coo_buffer_size_per_device
    if required is not None:
      suggested = required * num_sc_per_device
      if global_device_count is not None:
        suggested = min(
          suggested,
          buffer_format.compute_theoretical_max_coo_buffer_size(
            max_ids, global_device_count, num_sc_per_device
          ),
        )
    new_stacks[name] = spec.replace(
      max_ids_per_partition=max_ids,
      max_unique_ids_per_partition=observed(
        "max_unique_ids_per_partition", name, spec.max_unique_ids_per_partition
      ),
      suggested_coo_buffer_size_per_device=suggested,
    )

  def update(feature):
    table = feature.table_spec
    stack = table.stacked_table_spec.stack_name
    return feature.replace(
      table_spec=table.replace(stacked_table_spec=new_stacks[stack])
    )

  return jax.tree.map(update, feature_specs)


def scale_stats(
  stats: SparseDenseMatmulInputStats, factor: float
) -> SparseDenseMatmulInputStats:
  """Statistics with every count scaled by `factor` (rounded up): headroom.

  `update_preprocessing_parameters` sets the limits to exactly the observed
  maxima, so the next batch with a slightly busier partition would exceed
  them; scaling first (e.g. by 1.25) leaves room.

  Raises:
    ValueError: If `factor` is below 1.
  """
  if not factor >= 1.0:
    raise ValueError(f"headroom factor must be >= 1, got {factor}")

  def scale(values: dict[str, Any]) -> dict[str, Any]:
    return {
      k: np.ceil(np.asarray(v, np.float64) * factor).astype(np.int64)
      for k, v in values.items()
    }

  return SparseDenseMatmulInputStats(
    max_ids_per_partition=scale(stats.max_ids_per_partition),
    max_unique_ids_per_partition=scale(stats.max_unique_ids_per_partition),
    required_buffer_size_per_sc=scale(stats.required_buffer_size_per_sc),
    id_drop_counters=dict(stats.id_drop_counters),
  )
