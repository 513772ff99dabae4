"""The rows a trainer's steps touch, tracked on device for delta checkpoints.

A `SparseCoreTrainer` built with `track_touched=True` holds a `Touched`:
per stack of every `SparseCoreEmbed`, a `[N, V_shard]` bool bitmap sharded
like the stack's table (one byte per row: 1/128 of a 64-wide bfloat16
table), and the checkpoint it counts from (`since`: the directory and step
of the trainer's last save or restore). Every step sets the rows its batch
references (`mark`); a save writes the rows set since `since` (a delta,
`_ckpt_delta.py`) and clears them (`Touched.clear`).

The rows the fused update writes are the valid entries of the preprocessed
buffers: per device and SparseCore segment, entry `j` of partition `p`
(its range given by the row pointers, `buffer_format`) with an embedding id
other than `PAD_ID` is row `id` of shard `p`. `mark` decodes them as the
kernels do, all `N` partitions at once (flat row `p * V_shard + id`),
gathers every device's over the sharding axis (O(global batch)) and sets,
on each device, those of its own shards: a scatter of O(batch) entries,
never O(vocabulary). Entries with an id but an invalid sample id are
counted too: a superset of the written rows only adds unchanged rows to a
delta.

Example: N = 2 shards of 8 rows, one device, one segment with row pointers
`[3, 10, 16, ...]` and ids `[5, 1, 5, PAD, PAD, PAD, PAD, PAD, 0, 7, ...]`:
partition 0 holds entries 0-2 (rows 5, 1, 5 of shard 0), partition 1
entries 8-9 (rows 0, 7 of shard 1); the bitmap gets `[0, 1]`, `[0, 5]`,
`[1, 0]` and `[1, 7]`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core.plan import Plan, StackPlan, single_minibatch
from pz_sparsecore.device import minibatching
from pz_sparsecore.device.topology import Topology
from pz_sparsecore.nn.embed import SparseCoreEmbed, find_embeds

_COMPARE_ALL = 64
"""Most shards for which `_flat_rows` compares every entry with every
partition start."""
_MAX_ROWS = 2**31 - 2
"""Most rows (`N * V_shard`) of a tracked stack: flat rows and the
out-of-range marker `N * V_shard` fit in int32."""
_FIELDS = (
  "lhs_row_pointers",
  "lhs_embedding_ids",
  "lhs_sample_ids",
  "lhs_gains",
)


class Touched:
  """A trainer's touched-row bitmaps and the checkpoint they count from.

  Attributes:
    bitmaps: Table variable label → `[N, V_shard]` bool, sharded like the
      table: the rows the steps touched since `since`.
    since: `(directory, step)` of the checkpoint the bitmaps count from
      (the trainer's last save or restore), or None (none yet).
  """

  def __init__(self, model: Any):
    self.bitmaps = _zeros(model)
    self.since: tuple[str, int] | None = None

  def clear(self, model: Any, directory: str, step: int) -> None:
    """Clears the bitmaps: they count from checkpoint `step` of
    `directory` on (`model` gives their layout, perhaps a new one)."""
    self.bitmaps = _zeros(model)
    self.since = (directory, step)


def _zeros(model: Any) -> dict[str, jax.Array]:
  out = {}
  for embed in find_embeds(model):
    config = embed.config
    for stack in config.plan.stacks:
      rows = config.plan.num_shards * stack.rows_per_shard
      if rows > _MAX_ROWS:
        # Flat rows are int32 in the step (JAX's default).
        raise ValueError(
          f"track_touched: stack {stack.name!r} of SparseCoreEmbed "
          f"{config.name!r} has {rows} rows, more than the {_MAX_ROWS} a "
          "touched-row bitmap addresses; build the trainer without "
          "track_touched (full checkpoints only)"
        )
      sharding = config.topology.table_sharding(stack.name, ndim=2)
      out[config.table_label(stack.name)] = jnp.zeros(
        (config.plan.num_shards, stack.rows_per_shard),
        jnp.bool_,
        device=sharding,
      )
  return out


def _flat_rows(stack: StackPlan, topo: Topology, buffers) -> jax.Array:
  """Per local entry, its flat row `p * V_shard + id` of the whole stack
  (`N * V_shard` for entries that update nothing)."""
  s, n = topo.num_sc_per_device, topo.num_shards
  rp, ids = (jnp.reshape(b, -1) for b in buffers[:2])
  seg_len = ids.size // s
  ends = jnp.clip(rp.reshape(s, -1)[:, :n], 0, seg_len)
  starts = buffer_format.partition_starts(ends, xp=jnp)
  offsets = jnp.arange(seg_len, dtype=jnp.int32)
  # The partition of each offset: the last one starting at or before it.
  # Comparing the offsets with every start (N per entry) is 4x faster on
  # CPU than `reference.decode_entries`' binary search at N = 8; a binary
  # search wins past `_COMPARE_ALL`.
  method = "compare_all" if n <= _COMPARE_ALL else "scan"
  part = (
    jax.vmap(
      lambda starts: jnp.searchsorted(
        starts, offsets, side="right", method=method
      )
    )(starts)
    - 1
  )
  end = jnp.take_along_axis(ends, part, axis=1)
  ids = ids.reshape(s, seg_len)
  # Ids, not sample ids, decide (see the module docstring); PAD_ID is past
  # every shard's rows.
  valid = (offsets < end) & (ids >= 0) & (ids < stack.rows_per_shard)
  rows = jnp.where(
    valid, part * stack.rows_per_shard + ids, n * stack.rows_per_shard
  )
  return rows.reshape(-1)


def _set(
  bitmap: jax.Array, rows: jax.Array, topo: Topology, replicated: bool
) -> jax.Array:
  """The local bitmap with every device's `rows` of its shards set."""
  rows = jax.lax.all_gather(rows, topo.axis, tiled=True)
  local, width = bitmap.shape
  if not replicated:
    rows = rows - jax.lax.axis_index(topo.axis) * (local * width)
  # Rows of other devices' shards (and invalid entries) fall outside and are
  # dropped.
  inside = (rows >= 0) & (rows < local * width)
  rows = jnp.where(inside, rows, local * width)
  flat = bitmap.reshape(-1).at[rows].set(True, mode="drop")
  return flat.reshape(local, width)


def _mark_layer(plan: Plan, topo: Topology, bitmaps, inputs):
  """`bitmaps` (stack name → local bitmap) with the batch's rows set;
  per device, inside `shard_map`."""
  out = dict(bitmaps)
  if inputs.num_minibatches is None:
    for stack in plan.stacks:
      buffers = [getattr(inputs, f)[stack.name] for f in _FIELDS]
      out[stack.name] = _set(
        out[stack.name],
        _flat_rows(stack, topo, buffers),
        topo,
        topo.is_replicated(stack.name),
      )
    return out
  small = single_minibatch(plan)

  def body(m, out):
    part = minibatching.minibatch_inputs(plan, inputs, m)
    return _mark_layer(small, topo, out, part)

  count = minibatching.num_minibatches(inputs, topo.axis)
  return jax.lax.fori_loop(0, count, body, out)


def mark(
  active: Iterable[tuple[SparseCoreEmbed, Any, Any]],
  bitmaps: Mapping[str, jax.Array],
) -> dict[str, jax.Array]:
  """The bitmaps with the rows of this step's batches set (in the step).

  Args:
    active: `(layer, its PreprocessedInput, its activation gradients)` of
      every layer the step updates.
    bitmaps: `Touched.bitmaps` as the step received them.

  Returns:
    The new bitmaps, by label.
  """
  out = dict(bitmaps)
  for embed, inputs, act_grads in active:
    config = embed.config
    plan, topo = embed.plan_of(act_grads), config.topology
    labels = {s.name: config.table_label(s.name) for s in plan.stacks}
    specs = {name: topo.table_spec(name) for name in labels}
    batch = P(topo.axis)
    new = jax.shard_map(
      functools.partial(_mark_layer, plan, topo),
      mesh=topo.mesh,
      in_specs=(specs, jax.tree.map(lambda _, b=batch: b, inputs)),
      out_specs=specs,
      check_vma=False,
    )({name: out[label] for name, label in labels.items()}, inputs)
    for name, label in labels.items():
      out[label] = new[name]
  return out


# ---------------------------------------------------------------------------
# Reading the touched rows at a save.


def _bucket(count: int) -> int:
  """`count` rounded up to a power of two (at least 8): saves with similar
  counts share one compiled gather."""
  return max(8, 1 << max(count - 1, 0).bit_length())


@jax.jit(static_argnames=("size",))
def _nonzero(bitmap: jax.Array, size: int) -> jax.Array:
  flat = bitmap.reshape(-1)
  return jnp.nonzero(flat, size=size, fill_value=flat.size)[0]


@jax.jit
def _gather(value: jax.Array, rows: jax.Array) -> jax.Array:
  flat = value.reshape(-1, value.shape[-1])
  return flat.at[rows].get(mode="fill", fill_value=0)


def _host(value: jax.Array) -> np.ndarray:
  """A replicated array's value on this process."""
  if value.is_fully_addressable:
    return np.asarray(value)
  return np.asarray(value.addressable_data(0))


def touched_rows(
  bitmap: jax.Array, values: Iterable[jax.Array]
) -> tuple[np.ndarray, list[np.ndarray]]:
  """The set rows of a bitmap and those rows of each value.

  Reads the bitmap once (O(vocabulary) bytes of one byte per row, at a
  save: on the host when this process holds it whole, else on device) and
  gathers O(touched rows) of each `[N, V_shard, W]` value.

  Args:
    bitmap: `[N, V_shard]` bool.
    values: Arrays laid out like the bitmap, with a last axis.

  Returns:
    The flat rows `shard * V_shard + row` (int64, ascending) and, per value,
    its `[K, W]` rows.
  """
  replicated = NamedSharding(bitmap.sharding.mesh, P())
  if bitmap.is_fully_addressable:
    rows = np.flatnonzero(np.asarray(bitmap))
  else:  # Every process writes every row: found on device.
    count = int(jnp.sum(bitmap, dtype=jnp.int32))
    found = _nonzero(bitmap, size=_bucket(count))
    rows = _host(jax.device_put(found, replicated))[:count]
  index = np.full(_bucket(rows.size), bitmap.size, np.int32)
  index[: rows.size] = rows
  index = jax.device_put(index, replicated)
  out = [
    _host(jax.device_put(_gather(v, index), replicated))[: rows.size]
    for v in values
  ]
  return rows.astype(np.int64), out
