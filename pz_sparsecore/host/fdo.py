"""Feedback-directed optimisation (FDO) of the preprocessing limits.

The preprocessor measures, for every batch, how many ids each SparseCore
sends to each partition (`SparseDenseMatmulInputStats`). The limits in the
`StackedTableSpec`s size the device buffers; too small and ids are dropped,
too large and memory and bandwidth are wasted. FDO closes the loop:

1. `client.record(stats)` after every preprocessing call (local, cheap);
2. every k steps `client.publish()` persists this process's records;
3. after a barrier, `client.load()` aggregates every process's latest
   publication;
4. `update_preprocessing_parameters(feature_specs, stats, S)` returns new
   specs whose limits and buffer size match the observed maxima; `jit` then
   recompiles for the new buffer shapes.

Two file clients share one directory layout and differ only in the format:
`NPZFileFDOClient` (`.npz`) and `CSVFileFDOClient` (`.csv`). Both follow
jax-tpu-embedding's clients, so files pass between the libraries.

**Keys.** A statistic of stack `s` is stored under `s` plus a suffix:
`_max_ids`, `_max_unique_ids`, `_required_buffer_size` or `_id_drop_counters`.

**Records.** Each key keeps the recorded values in order; one record is kept
as given (1-D for per-partition counts), several are stacked to one row per
record. With `retain_history=False` they are folded after every record into
one row, their element-wise max. A publication writes the current values to
`fdo_stats_<process>_<time_ns>.<ext>`, through a temporary name and a rename,
so a reader never sees a partial file. Records are never cleared: each
publication holds everything recorded so far.

**Load.** The newest file of each process is read. A key published by one
process only comes back as that process wrote it (the history, one row per
record); a key published by several processes comes back as the element-wise
max over all their rows. `load` also makes the result this client's record,
so a client created after a restart continues from the published state.
Files that cannot be read (truncated, corrupt) or that belong to another run
(a different `run_id`) are reported with a warning and skipped.

Worked example, stack `s` with two partitions: process 0 records max ids
`[1, 5]` and then `[4, 2]`; process 1 records `[3, 3]`. If only process 0
has published, `load` returns `max_ids_per_partition["s"]` as the rows
`[[1, 5], [4, 2]]`; once both have, it returns `[4, 5]`. Either shape suits
`update_preprocessing_parameters` and `scale_stats`, which reduce with max.

The CSV format has a header and then one line per row of a key (a single
value, such as a drop counter, is a row of one)::

  key,values
  s_max_ids,1 5
  s_max_ids,4 2
  s_id_drop_counters,0
"""

from __future__ import annotations

import abc
import csv
import functools
import glob
import io
import os
import re
import tempfile
import time
import warnings
import zipfile
from typing import IO, Any, ClassVar

import jax
import numpy as np

from pz_sparsecore.core import buffer_format, layout
from pz_sparsecore.host.preprocess import SparseDenseMatmulInputStats

# Key suffix of each statistic in the stored files.
_FIELDS = {
  "_max_ids": "max_ids_per_partition",
  "_max_unique_ids": "max_unique_ids_per_partition",
  "_required_buffer_size": "required_buffer_size_per_sc",
  "_id_drop_counters": "id_drop_counters",
}
_FILE_STEM = "fdo_stats"
_TMP_PREFIX = ".tmp_fdo_"
_RUN_ID_KEY = "__run_id__"
_CSV_HEADER = ["key", "values"]


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
  """`(stack, field)` of a stored key."""
  for suffix, field in _FIELDS.items():
    if key.endswith(suffix):
      return key[: -len(suffix)], field
  raise ValueError(
    f"FDO file key {key!r} ends in none of the statistic suffixes "
    f"{list(_FIELDS)}"
  )


def _row_shape(value: np.ndarray) -> tuple[int, ...]:
  """The shape of one row once `value` is stacked with others."""
  return np.atleast_2d(value).shape[1:]


def _stack(values: list[np.ndarray]) -> np.ndarray:
  """One value as given; several as rows of one array."""
  return values[0] if len(values) == 1 else np.vstack(values)


def _as_counts(value: Any) -> np.ndarray:
  """A recorded statistic as int64; fractional sizes round up."""
  array = np.asarray(value)
  if np.issubdtype(array.dtype, np.floating):
    array = np.ceil(array)
  return array.astype(np.int64)


@functools.cache
def _file_pattern(extension: str) -> re.Pattern[str]:
  return re.compile(rf"{_FILE_STEM}_(\d+)_(\d+)\.{re.escape(extension)}")


class _FileFDOClient(FDOClient):
  """Record, publish and load of the file clients; subclasses own the format.

  Args:
    base_dir: Directory shared by all processes (created if missing).
    run_id: Optional run identifier written into every file; files with a
      different identifier (or none) are skipped by `load`.
    retain_history: Keep one row per record (True) or only their
      element-wise max (False).
  """

  _EXTENSION: ClassVar[str]
  _READ_ERRORS: ClassVar[tuple[type[Exception], ...]]

  def __init__(
    self,
    base_dir: str | os.PathLike,
    *,
    run_id: str | None,
    retain_history: bool,
  ):
    self.base_dir = os.fspath(base_dir)
    self.run_id = run_id
    self.retain_history = retain_history
    os.makedirs(self.base_dir, exist_ok=True)
    # Stored key -> recorded values in order (`_stack` gives the value).
    self._records: dict[str, list[np.ndarray]] = {}
    self._last_stamp = 0

  @abc.abstractmethod
  def _write(self, f: IO[bytes], data: dict[str, np.ndarray]) -> None:
    """Writes `data` (and `self.run_id`, if set) to the open file `f`."""

  @abc.abstractmethod
  def _read(self, path: str) -> tuple[dict[str, np.ndarray], str | None]:
    """The stored values of `path` and its run id (raises `_READ_ERRORS`)."""

  def _keep(self, key: str, values: list[np.ndarray]) -> None:
    if not self.retain_history:
      stacked = _stack(values)
      if stacked.ndim > 1:
        values = [np.max(stacked, axis=0)]
    self._records[key] = values

  def record(self, stats: SparseDenseMatmulInputStats) -> None:
    """Appends one batch's statistics (as int64) to the local record.

    Raises:
      ValueError: If a statistic's shape differs from the earlier records
        of its stack.
    """
    for suffix, field in _FIELDS.items():
      for stack, value in getattr(stats, field).items():
        key = stack + suffix
        value = _as_counts(value)
        values = self._records.get(key, [])
        if values and _row_shape(value) != _row_shape(values[0]):
          raise ValueError(
            f"FDO record: {field} of stack {stack!r} has shape "
            f"{value.shape}, earlier records {values[0].shape}; record the "
            "statistics of one topology per client"
          )
        self._keep(key, [*values, value])

  def publish(self) -> None:
    """Writes the local record to `fdo_stats_<process>_<time_ns>.<ext>`.

    Raises:
      ValueError: If nothing was recorded (or loaded).
    """
    if not self._records:
      raise ValueError("FDO publish: nothing recorded yet")
    # Grouped by statistic, as upstream writes them.
    fields = list(_FIELDS.values())
    keys = sorted(self._records, key=lambda k: fields.index(_split_key(k)[1]))
    data = {key: _stack(self._records[key]) for key in keys}
    # Two publications of one client never share a name.
    stamp = max(time.time_ns(), self._last_stamp + 1)
    self._last_stamp = stamp
    name = f"{_FILE_STEM}_{jax.process_index()}_{stamp}.{self._EXTENSION}"
    fd, tmp = tempfile.mkstemp(dir=self.base_dir, prefix=_TMP_PREFIX)
    try:
      with os.fdopen(fd, "wb") as f:
        self._write(f, data)
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, os.path.join(self.base_dir, name))
    except BaseException:
      if os.path.exists(tmp):
        os.unlink(tmp)
      raise

  def _get_latest_files_by_process(self, files: list[str]) -> list[str]:
    """The newest of `files` for each process, highest process first."""
    pattern = _file_pattern(self._EXTENSION)
    newest: dict[int, tuple[int, str]] = {}
    for path in files:
      match = pattern.fullmatch(os.path.basename(path))
      if match is None:
        warnings.warn(f"FDO: skipping unrecognised file {path}", stacklevel=3)
        continue
      process, stamp = int(match.group(1)), int(match.group(2))
      if process not in newest or (stamp, path) > newest[process]:
        newest[process] = (stamp, path)
    return [newest[process][1] for process in sorted(newest, reverse=True)]

  def _read_checked(self, path: str) -> dict[str, np.ndarray] | None:
    """The values of `path`, or None (with a warning) if it is skipped."""
    try:
      data, run_id = self._read(path)
    except self._READ_ERRORS as e:
      warnings.warn(f"FDO: skipping unreadable file {path}: {e}", stacklevel=3)
      return None
    if self.run_id is not None and run_id != self.run_id:
      warnings.warn(
        f"FDO: skipping {path}: it belongs to run {run_id!r}, not "
        f"{self.run_id!r}",
        stacklevel=3,
      )
      return None
    return data

  def load(self) -> SparseDenseMatmulInputStats:
    """Every process's newest publication, merged (see the module notes).

    A key from one process is returned as published; a key from several is
    the element-wise max over all their rows. The result becomes this
    client's record.

    Raises:
      FileNotFoundError: If no readable file exists.
      ValueError: If a file holds a key with an unknown suffix, or processes
        published rows of different shapes.
    """
    pattern = os.path.join(
      glob.escape(self.base_dir), f"{_FILE_STEM}*.{self._EXTENSION}"
    )
    published: dict[str, list[tuple[str, np.ndarray]]] = {}
    found = False
    for path in self._get_latest_files_by_process(glob.glob(pattern)):
      data = self._read_checked(path)
      if data is None:
        continue
      found = True
      for key, value in data.items():
        _split_key(key)
        published.setdefault(key, []).append((path, value))
    if not found:
      raise FileNotFoundError(
        f"FDO: no readable {_FILE_STEM}_*.{self._EXTENSION} files in "
        f"{self.base_dir}"
      )
    merged = {
      key: _merge_processes(key, values) for key, values in published.items()
    }
    fields: dict[str, dict[str, Any]] = {f: {} for f in _FIELDS.values()}
    for key, value in merged.items():
      stack, field = _split_key(key)
      fields[field][stack] = value
    self._records = {}
    for key, value in merged.items():
      self._keep(key, [value.copy()])
    return SparseDenseMatmulInputStats(**fields)


def _merge_processes(
  key: str, published: list[tuple[str, np.ndarray]]
) -> np.ndarray:
  """One process's value as is; several processes' as the max over rows."""
  if len(published) == 1:
    return published[0][1]
  first_path, first = published[0]
  for path, value in published[1:]:
    if _row_shape(value) != _row_shape(first):
      raise ValueError(
        f"FDO: {path} has {key} rows of shape {_row_shape(value)}, "
        f"{first_path} {_row_shape(first)}; files from different topologies"
      )
  return np.max(np.vstack([value for _, value in published]), axis=0)


class NPZFileFDOClient(_FileFDOClient):
  """FDO client storing statistics as NPZ files in a shared directory.

  Each file holds one array per key (and `__run_id__` when a run id is set).

  Args:
    base_dir: Directory shared by all processes (created if missing).
    run_id: Optional run identifier written into every file; files with a
      different identifier (or none) are skipped by `load`.
    retain_history: Keep one row per record (True) or only their
      element-wise max (False).
  """

  _EXTENSION = "npz"
  _READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)

  def __init__(
    self,
    base_dir: str | os.PathLike,
    run_id: str | None = None,
    *,
    retain_history: bool = True,
  ):
    super().__init__(base_dir, run_id=run_id, retain_history=retain_history)

  def _write(self, f: IO[bytes], data: dict[str, np.ndarray]) -> None:
    if self.run_id is not None:
      data = {**data, _RUN_ID_KEY: np.asarray(self.run_id)}
    np.savez(f, **data)

  def _read(self, path: str) -> tuple[dict[str, np.ndarray], str | None]:
    with np.load(path, allow_pickle=False) as npz:
      data = {key: npz[key] for key in npz.files}
    run_id = data.pop(_RUN_ID_KEY, None)
    return data, None if run_id is None else str(run_id)


class CSVFileFDOClient(_FileFDOClient):
  """FDO client storing statistics as CSV files in a shared directory.

  The format (module notes) is jax-tpu-embedding's; a run id, when set, is a
  `__run_id__` line. A file that does not end with a line break was cut
  short and is skipped; a file cut exactly at a line end cannot be told
  apart from a shorter history (files this client writes are never partial).

  Args:
    base_dir: Directory shared by all processes (created if missing).
    retain_history: Keep one row per record (True) or only their
      element-wise max (False).
    run_id: Optional run identifier written into every file; files with a
      different identifier (or none) are skipped by `load`.
  """

  _EXTENSION = "csv"
  _READ_ERRORS = (OSError, ValueError, csv.Error)

  def __init__(
    self,
    base_dir: str | os.PathLike,
    retain_history: bool = True,
    *,
    run_id: str | None = None,
  ):
    super().__init__(base_dir, run_id=run_id, retain_history=retain_history)

  def _write(self, f: IO[bytes], data: dict[str, np.ndarray]) -> None:
    text = io.TextIOWrapper(f, encoding="utf-8", newline="")
    writer = csv.writer(text)
    writer.writerow(_CSV_HEADER)
    if self.run_id is not None:
      writer.writerow([_RUN_ID_KEY, self.run_id])
    for key, value in data.items():
      if value.ndim > 2:
        raise ValueError(
          f"FDO CSV publish: {key} has {value.ndim} dimensions; a CSV file "
          "holds rows of counts (at most 2)"
        )
      for row in np.atleast_2d(value):
        writer.writerow([key, " ".join(str(int(v)) for v in row)])
    text.flush()
    text.detach()

  def _read(self, path: str) -> tuple[dict[str, np.ndarray], str | None]:
    with open(path, encoding="utf-8", newline="") as f:
      content = f.read()
    if not content.endswith("\n"):
      raise ValueError("the last line is incomplete (truncated file)")
    lines = list(csv.reader(io.StringIO(content)))
    if lines[0] != _CSV_HEADER:
      raise ValueError(f"the header is {lines[0]}, not {_CSV_HEADER}")
    run_id = None
    rows: dict[str, list[np.ndarray]] = {}
    for number, line in enumerate(lines[1:], start=2):
      if not line:
        continue
      if len(line) != 2:
        raise ValueError(f"line {number} has {len(line)} fields, not 2")
      key, values = line
      if key == _RUN_ID_KEY:
        run_id = values
        continue
      try:
        row = np.array([int(v) for v in values.split()], dtype=np.int64)
      except ValueError as e:
        raise ValueError(f"line {number}: {e}") from None
      rows.setdefault(key, []).append(row)
    return {key: _stack(values) for key, values in rows.items()}, run_id


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
    if suggested is not None and global_device_count is not None:
      # A buffer the new limit cannot fill (e.g. a kept size set for a
      # larger limit) is capped at the most it can hold.
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


def merge_stats(
  first: SparseDenseMatmulInputStats, second: SparseDenseMatmulInputStats
) -> SparseDenseMatmulInputStats:
  """The statistics of two batches together: per stack, the larger count
  of each partition and SparseCore, and the dropped ids added.

  Raises:
    ValueError: If a stack's counts have different sizes in the two (they
      were measured on different topologies).
  """

  def larger(a: dict[str, Any], b: dict[str, Any], field: str):
    out = {k: np.asarray(v) for k, v in a.items()}
    for k, v in b.items():
      v = np.asarray(v)
      if k not in out:
        out[k] = v
        continue
      if out[k].shape != v.shape:
        raise ValueError(
          f"stack {k!r}: {field} of shapes {out[k].shape} and {v.shape} "
          "cannot be merged (measured on different topologies)"
        )
      out[k] = np.maximum(out[k], v)
    return out

  drops = dict(first.id_drop_counters)
  for k, v in second.id_drop_counters.items():
    drops[k] = int(drops.get(k, 0)) + int(v)
  return SparseDenseMatmulInputStats(
    max_ids_per_partition=larger(
      first.max_ids_per_partition,
      second.max_ids_per_partition,
      "max_ids_per_partition",
    ),
    max_unique_ids_per_partition=larger(
      first.max_unique_ids_per_partition,
      second.max_unique_ids_per_partition,
      "max_unique_ids_per_partition",
    ),
    required_buffer_size_per_sc=larger(
      first.required_buffer_size_per_sc,
      second.required_buffer_size_per_sc,
      "required_buffer_size_per_sc",
    ),
    id_drop_counters=drops,
  )


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
