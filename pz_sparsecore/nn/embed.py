"""`SparseCoreEmbed`: a Penzai layer over row-sharded, stacked tables.

The layer owns one `pz.Parameter` per stack, labelled
`f"{name}/{stack}.embeddings"`, whose value is a `NamedArray` with axes
`("sc_shard", "sc_row", embedding_axis)` and shape `[N, V_shard, D]`,
sharded over the mesh's sharding axis (device `d` holds shards
`d*S .. d*S+S-1`). The optimizer's slots sit beside it as `pz.StateVariable`s
labelled `f"{name}/{stack}.{slot}"`, shaped like the table (a row-wise
slot: `[N, V_shard, 1]`, last axis `sc_slot`).

Calling the layer on a `PreprocessedInput` (from `layer.preprocess`) returns
one `NamedArray` per feature, with the feature's sample axes (default
`("batch",)`) and the embedding axis, sharded over the batch.

Tables are never differentiated. Training takes the gradient of the loss
with respect to the activations and hands it to `apply_gradients` (or lets
`SparseCoreTrainer` do so, through the layer's `activation_probe`; see
`probe.py`), which runs each stack's optimizer in place on the rows the batch
referenced. Differentiating with respect to a table raises
`TableGradientError`.

The layer is deliberately small. Its static facts live in its `EmbedConfig`,
whose `plan` (`plan.Plan`) owns the stacks, their members and buffer sizes;
the positional and logical views of its variables are functions in
`tables.py`, host transfer in `host.py`, and the FDO re-spec in `respec.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from penzai import pz

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.specs import FeatureSpec, initializer_draw_key
from pz_sparsecore.device import hashed as hashed_lib
from pz_sparsecore.device import input_check, replication, routing
from pz_sparsecore.device import topology as topology_lib
from pz_sparsecore.host.fill import LimitsExceededError
from pz_sparsecore.host.preprocess import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
  input_shapes,
  preprocess_for_plan,
)
from pz_sparsecore.nn import axis_mapping as axis_mapping_lib
from pz_sparsecore.nn import batching
from pz_sparsecore.nn.probe import ActivationProbe, zero_probes
from pz_sparsecore.nn.tables import (
  ROW_AXIS,
  SHARD_AXIS,
  assign_arrays,
  named_table,
  slot_arrays,
  slot_axis,
  table_arrays,
)

__all__ = [
  "ROW_AXIS",
  "SHARD_AXIS",
  "EmbedConfig",
  "SparseCoreEmbed",
  "find_embeds",
  "named_table",
  "variable_labels",
]


@dataclasses.dataclass(frozen=True)
class EmbedConfig:
  """Static description of a `SparseCoreEmbed` (hashable, jit-static).

  Attributes:
    name: The layer's name (prefix of its variable labels).
    plan: The prepared feature specs laid out on the topology.
    topology: Mesh, the shard axis's mesh axes, SparseCores per device.
    feature_axes: Per feature (the plan's leaf order), the names of its
      sample axes.
    embedding_axis: Name of the embedding axis.
    axis_mapping: Where each named axis of the layer lives on the mesh.
  """

  name: str
  plan: plan_lib.Plan
  topology: topology_lib.Topology
  feature_axes: tuple[tuple[str, ...], ...]
  embedding_axis: str
  axis_mapping: axis_mapping_lib.AxisMapping

  def axes_of(self, feature: str) -> tuple[str, ...]:
    """The sample axes of `feature`."""
    specs = self.plan.feature_specs
    for spec, axes in zip(specs, self.feature_axes, strict=True):
      if spec.name == feature:
        return axes
    raise KeyError(feature)

  def table_label(self, stack: str) -> str:
    """The label of `stack`'s table parameter."""
    return f"{self.name}/{stack}.embeddings"

  def slot_label(self, stack: str, slot: str) -> str:
    """The label of one optimizer slot of `stack`."""
    return f"{self.name}/{stack}.{slot}"

  def map_label(self, stack: str, part: str) -> str:
    """The label of one part of a hashed stack's map (`MAP_PARTS`)."""
    return f"{self.name}/{stack}.map_{part}"


MAP_PARTS = hashed_lib.StackMap._fields
"""The parts of a hashed stack's map, each a `pz.StateVariable`."""


def _feature_axes(
  specs: tuple[FeatureSpec, ...], feature_axes: Any
) -> tuple[tuple[str, ...], ...]:
  out = []
  for spec in specs:
    if feature_axes is None:
      axes = ("batch",)
    elif isinstance(feature_axes, Mapping):
      axes = tuple(feature_axes.get(spec.name, ("batch",)))
    else:
      axes = tuple(feature_axes)
    if len(axes) != len(spec.output_shape) - 1:
      raise ValueError(
        f"feature {spec.name!r}: {len(axes)} sample axes {axes} for "
        f"output_shape {spec.output_shape} (expected "
        f"{len(spec.output_shape) - 1})"
      )
    out.append(axes)
  return tuple(out)


def make_topology(
  mesh: Mesh,
  sharding_axis: Any,
  num_sc_per_device: int,
  exchange: str,
  axis_name_to_mesh_name: Mapping[str, Any] | None,
) -> topology_lib.Topology:
  """The layer's topology from its `from_config` arguments.

  Raises:
    ValueError: If `mesh` is not a `jax.sharding.Mesh` with Auto axes, or
      the axes or counts are bad.
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
  topology_lib.check_mesh(mesh)
  return topology_lib.Topology(
    mesh,
    axis_mapping_lib.shard_axes(mesh, axis_name_to_mesh_name, sharding_axis),
    num_sc_per_device,
    exchange,
  )


#: `from_config`'s stacking choices: `"auto"` stacks compatible tables
#: (`layout.stack_compatible_tables`), None keeps one stack per table unless
#: the specs were stacked already.
STACKING = ("auto", None)
LIMITS = ("auto", "specs")


def _replicated_tables(
  feature_specs: Any, g: int, s: int, placement: Any, max_bytes: int
) -> frozenset[str]:
  """The tables `placement` replicates (`replication.replicated_tables` on
  the tables planned before stacking)."""
  if placement == replication.SHARDED:
    return frozenset()
  alone = layout.prepare_feature_specs_for_training(feature_specs, g, s)
  return replication.replicated_tables(
    plan_lib.build(alone, g, s), placement, max_bytes
  )


def _without_hashed(
  feature_specs: Any, replicated: frozenset[str], placement: Any
) -> frozenset[str]:
  """`replicated` less the hashed tables (their shards hold their maps);
  raises if `placement` names one "replicated"."""
  hashed = {
    spec.table_spec.name
    for spec in jax.tree.leaves(feature_specs)
    if spec.table_spec.is_hashed
  }
  if isinstance(placement, Mapping):
    named = sorted(
      t for t in hashed if placement.get(t) == replication.REPLICATED
    )
    if named:
      raise ValueError(
        f"table {named[0]!r} is hashed: its shards hold its map of ids, "
        "so it cannot be replicated; place it 'sharded'"
      )
  return frozenset(t for t in replicated if t not in hashed)


def make_config(
  name: str,
  feature_specs: Any,
  topology: topology_lib.Topology,
  feature_axes: Any,
  embedding_axis: str,
  axis_name_to_mesh_name: Mapping[str, Any] | None = None,
  stacking: str | None = None,
  limits: str = "specs",
  placement: Any = replication.SHARDED,
  max_replicated_bytes: int = replication.DEFAULT_MAX_BYTES,
) -> EmbedConfig:
  """Prepares the specs for the topology (worst-case limits for tables left
  at the default ones if `limits="auto"`, the tables' placement
  (`device.replication`), then stacking compatible tables alike placed if
  `stacking="auto"`) and plans them; the topology records the replicated
  stacks."""
  g, s = topology.num_devices, topology.num_sc_per_device
  layout.check_feature_names(feature_specs)
  if stacking not in STACKING:
    raise ValueError(f"stacking must be one of {STACKING}, got {stacking!r}")
  if limits not in LIMITS:
    raise ValueError(f"limits must be one of {LIMITS}, got {limits!r}")
  if limits == "auto":
    feature_specs = layout.worst_case_limits(feature_specs, g, s)
  replicated = _replicated_tables(
    feature_specs, g, s, placement, max_replicated_bytes
  )
  replicated = _without_hashed(feature_specs, replicated, placement)
  if stacking == "auto":
    feature_specs = layout.stack_compatible_tables(
      feature_specs, g, s, apart=replicated
    )
  prepared = layout.prepare_feature_specs_for_training(feature_specs, g, s)
  for spec in jax.tree.leaves(prepared):
    if spec.output_shape[-1] > spec.table_spec.embedding_dim:
      raise ValueError(
        f"feature {spec.name!r}: output_shape[-1]={spec.output_shape[-1]} "
        f"exceeds the embedding_dim {spec.table_spec.embedding_dim} of table "
        f"{spec.table_spec.name!r}"
      )
    table = spec.table_spec
    if (
      table.quantization_config != table.stacked_table_spec.quantization_config
    ):
      raise ValueError(
        f"feature {spec.name!r}: table {table.name!r} has quantization_config"
        f" {table.quantization_config}, its stack "
        f"{table.setting_in_stack.stack_name!r} has "
        f"{table.stacked_table_spec.quantization_config} (tables in a stack "
        "share one)"
      )
    if spec.sample_count % topology.num_shards:
      raise ValueError(
        f"feature {spec.name!r}: {spec.sample_count} samples do not divide "
        f"over {topology.num_shards} shards "
        f"({g} devices x {s} SparseCores)"
      )
  plan = plan_lib.build(prepared, g, s)
  topology = dataclasses.replace(
    topology,
    replicated=frozenset(
      stack.name
      for stack in plan.stacks
      if all(t.name in replicated for t in stack.tables)
    ),
  )
  axes = _feature_axes(plan.feature_specs, feature_axes)
  return EmbedConfig(
    name=name,
    plan=plan,
    topology=topology,
    feature_axes=axes,
    embedding_axis=embedding_axis,
    axis_mapping=axis_mapping_lib.resolve(
      topology,
      axis_name_to_mesh_name,
      [
        (spec.name, a, tuple(spec.output_shape))
        for spec, a in zip(plan.feature_specs, axes, strict=True)
      ],
      embedding_axis,
    ),
  )


def _call_initializer(init, key, shape):
  try:
    return init(key, shape, jnp.float32)
  except TypeError:
    return jnp.asarray(init(key, shape), jnp.float32)


def _fill_stack(
  config: EmbedConfig,
  stack: plan_lib.StackPlan,
  keys: jax.Array,
  table: jax.Array,
) -> jax.Array:
  """One stack's `[N, V_shard, D]` table, initialised shard by shard in place.

  `table` is the zero table, allocated once, sharded; each device fills its
  local shards one at a time into the donated buffer, so the initialisation
  needs one shard of scratch, not a second table (one program filling every
  shard in place still held three shards' copies per device). Every member
  table of shard `g` is drawn from `keys[g]` with shape `[V_member / N, D]`.
  """
  topo = config.topology

  rows = [
    t.setting_in_stack.padded_vocab_size // topo.num_shards
    for t in stack.tables
  ]
  groups: dict[Any, list[int]] = {}
  for i, t in enumerate(stack.tables):
    key_of_draw = initializer_draw_key(t.initializer)
    groups.setdefault(
      ("member", i) if key_of_draw is None else key_of_draw, []
    ).append(i)

  # Members drawing the same values share one draw of the longest shape
  # (each takes its first rows): the program's size, and its compile time,
  # then grow with the distinct initializers, not the tables. The draws go
  # one after another into a pool; shard row `r` of member `i` is pool row
  # `pool_start[i] + r - start[i]`, one gather (26 slices and a concatenate
  # compiled 0.3 s slower for the DLRM's stack).
  draws = [
    (members, max(rows[i] for i in members)) for members in groups.values()
  ]
  pool_start = [0] * len(stack.tables)
  at = 0
  for members, length in draws:
    for i in members:
      pool_start[i] = at
    at += length
  starts = np.cumsum([0, *rows[:-1]])

  def fill(local_table, local_keys, k):
    pool = jnp.concatenate(
      [
        _call_initializer(
          stack.tables[members[0]].initializer,
          local_keys[k],
          (length, stack.dim),
        )
        for members, length in draws
      ],
      axis=0,
    )
    row = jnp.arange(sum(rows), dtype=jnp.int32)
    shift = jnp.zeros_like(row)
    for i in range(len(stack.tables)):
      shift = jnp.where(row >= starts[i], pool_start[i] - starts[i], shift)
    # A 16-bit stack's shard is drawn in float32 and rounded to nearest
    # (one SparseCore shard at a time: never a float32 copy of the table).
    shard = jnp.take(pool, row + shift, axis=0)[None].astype(local_table.dtype)
    return jax.lax.dynamic_update_slice_in_dim(local_table, shard, k, axis=0)

  if max(rows) * stack.dim * 4 > _FILL_BLOCK_BYTES:
    table = _fill_stack_by_blocks(config, stack, keys, table, rows)
  else:
    fill_shard = _on_shards(topo, fill, 1)
    for k in range(topo.num_sc_per_device):
      table = fill_shard(table, keys, np.int32(k))
  if topo.is_replicated(stack.name):
    # Drawn as the sharded stack is, then copied to every device: the same
    # values whichever the placement.
    table = jax.device_put(table, topo.table_sharding(stack.name))
  return table


# A member table whose float32 rows in one shard exceed this many bytes is
# drawn in blocks of this many bytes: XLA materialises a whole draw (and
# its intermediates) before any slice of it, and a 100M-row stack's shard
# drawn at once took several times the table's bytes.
_FILL_BLOCK_BYTES = 256 << 20


def _on_shards(topo: Any, fn: Callable, num_args: int) -> Callable:
  """`fn(local_table, local_keys, *num_args replicated scalars)` run on
  every device's shards, jitted, the table donated."""
  axis = jax.sharding.PartitionSpec(topo.axis)
  return jax.jit(
    jax.shard_map(
      fn,
      mesh=topo.mesh,
      in_specs=(axis, axis) + (jax.sharding.PartitionSpec(),) * num_args,
      out_specs=axis,
      check_vma=False,
    ),
    donate_argnums=0,
  )


def _fill_stack_by_blocks(config, stack, keys, table, rows):
  """`_fill_stack`'s fill of a stack with a member too large to draw at
  once (`_fill_stack` then copies a replicated stack to every device).

  Member `i`'s rows of shard `g` are drawn in blocks of at most
  `_FILL_BLOCK_BYTES` of float32, block `b` (rows `[b * B, (b + 1) * B)`,
  the last block ending at the member's last row) from
  `fold_in(fold_in(keys[g], i), b)` with shape `[B, D]`, and written into
  the donated table one block at a time: one block of scratch.
  """
  topo = config.topology
  dim = stack.dim
  starts = np.cumsum([0, *rows[:-1]])
  block_rows = max(1, _FILL_BLOCK_BYTES // (4 * dim))

  def fill_block(local_table, local_keys, k, lo, *, member, block):
    key = jax.random.fold_in(
      jax.random.fold_in(local_keys[k], member), lo // block
    )
    values = _call_initializer(
      stack.tables[member].initializer, key, (block, dim)
    )
    # The last block is written at the member's end (it may overlap the
    # one before: its rows then take this block's values).
    at = starts[member] + jnp.minimum(lo, rows[member] - block)
    return jax.lax.dynamic_update_slice(
      local_table, values[None].astype(local_table.dtype), (k, at, 0)
    )

  # One program per member (a stack this large rarely has many).
  for member, count in enumerate(rows):
    block = min(count, block_rows)
    if block == 0:
      continue
    program = _on_shards(
      topo, functools.partial(fill_block, member=member, block=block), 2
    )
    for k in range(topo.num_sc_per_device):
      for lo in range(0, count, block):
        table = program(table, keys, np.int32(k), np.int32(lo))
  return table


def _init_values(
  config: EmbedConfig, init_base_rng: jax.Array
) -> tuple[dict[str, jax.Array], dict[str, tuple[jax.Array, ...]]]:
  """Every stack's table and slots, in three programs whatever the stacks'
  number (a program per key derivation, table and slot took seven for one
  stack).

  The first derives every stack's keys (`split(pz.nn.derive_param_key(
  init_base_rng, table label), N)`) and makes the zero tables; each stack's
  table is then filled in place (`_fill_stack`); the last makes the slots
  (their optimizer's initializers), once the fills' scratch is free.
  """
  topo = config.topology
  stacks = config.plan.stacks
  n = topo.num_shards

  def shape(stack):
    return (n, stack.rows_per_shard, stack.dim)

  def prepare(base):
    keys = {
      s.name: jax.random.split(
        pz.nn.derive_param_key(base, config.table_label(s.name)), n
      )
      for s in stacks
    }
    return keys, {s.name: jnp.zeros(shape(s), s.dtype) for s in stacks}

  def make_slots():
    # Each slot `[N, V_shard, width]`: the table's width for a "table"
    # slot, 1 for a row-wise one.
    return {
      s.name: tuple(
        _call_initializer(
          init, jax.random.key(0), (*shape(s)[:2], slot.width(s.dim))
        )
        for init, slot in zip(
          s.optimizer.slot_variables_initializers(),
          s.optimizer.definition.slots,
          strict=True,
        )
      )
      for s in stacks
    }

  keys, tables = jax.jit(
    prepare,
    out_shardings=(
      {s.name: topo.sharding(1) for s in stacks},
      {s.name: topo.sharding(3) for s in stacks},
    ),
  )(init_base_rng)
  tables = {
    s.name: _fill_stack(config, s, keys[s.name], tables[s.name]) for s in stacks
  }
  slots = jax.jit(
    make_slots,
    out_shardings={
      s.name: tuple(
        topo.table_sharding(s.name)
        for _ in s.optimizer.slot_variables_initializers()
      )
      for s in stacks
    },
  )()
  return tables, slots


def make_variables(
  config: EmbedConfig, init_base_rng: jax.Array | None
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
  """Each stack's table and slots (variable slots if no key is given)."""
  tables, slots = {}, {}
  if init_base_rng is not None:
    values, slot_values = _init_values(config, init_base_rng)
  for stack in config.plan.stacks:
    label = config.table_label(stack.name)
    names = stack.optimizer.slot_names()
    if init_base_rng is None:
      tables[stack.name] = pz.ParameterSlot(label)
      slots[stack.name] = {
        slot: pz.StateVariableSlot(config.slot_label(stack.name, slot))
        for slot in names
      }
      continue
    tables[stack.name] = pz.Parameter(
      value=named_table(config, values[stack.name]), label=label
    )
    slots[stack.name] = {
      slot.name: pz.StateVariable(
        value=named_table(config, value, slot_axis(config, slot)),
        label=config.slot_label(stack.name, slot.name),
      )
      for slot, value in zip(
        stack.optimizer.definition.slots,
        slot_values[stack.name],
        strict=True,
      )
    }
  return tables, slots


def make_maps(
  config: EmbedConfig, init_base_rng: jax.Array | None
) -> dict[str, dict[str, Any]]:
  """Each hashed stack's map, empty (variable slots if no key is given):
  stack name -> part (`MAP_PARTS`) -> `pz.StateVariable`."""
  maps = {}
  topo = config.topology
  for stack in hashed_lib.hashed_stacks(config.plan):
    labels = {p: config.map_label(stack.name, p) for p in MAP_PARTS}
    if init_base_rng is None:
      maps[stack.name] = {
        p: pz.StateVariableSlot(label) for p, label in labels.items()
      }
      continue
    # One seed for the layer's hashed rows (each folds in its table's name
    # and id): the rows do not depend on how the tables are stacked.
    key = pz.nn.derive_param_key(init_base_rng, f"{config.name}/hashed_rows")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.key_data(key)
    empty = hashed_lib.empty_map(
      topo.num_shards, stack.rows_per_shard, jnp.asarray(key, jnp.uint32)
    )
    placed = hashed_lib.StackMap(
      *(
        jax.device_put(x, topo.sharding(x.ndim))
        for x in (empty.ids, empty.seen, empty.counters)
      ),
      jax.device_put(
        empty.seed,
        jax.sharding.NamedSharding(topo.mesh, jax.sharding.PartitionSpec()),
      ),
    )
    maps[stack.name] = {
      p: pz.StateVariable(value=v, label=labels[p])
      for p, v in zip(MAP_PARTS, placed, strict=True)
    }
  return maps


def map_arrays(embed: Any) -> dict[str, hashed_lib.StackMap]:
  """Hashed stack name -> its map's current arrays."""
  return {
    name: hashed_lib.StackMap(*(parts[p].value for p in MAP_PARTS))
    for name, parts in embed.maps.items()
  }


# Whoever records the statistics of every batch a layer preprocesses (in any
# thread): `SparseCoreTrainer.fit(refresh_limits_every=...)`.
StatsRecorder = Callable[[EmbedConfig, SparseDenseMatmulInputStats], None]
_RECORDERS: list[StatsRecorder] = []
_RECORDERS_LOCK = threading.Lock()


@contextlib.contextmanager
def recording_stats(record: StatsRecorder) -> Iterator[None]:
  """Within the block, `record(config, stats)` is called with the layer's
  config and the statistics of every batch any `SparseCoreEmbed.preprocess`
  measures (also of a batch refused for its limits), from whichever thread
  preprocesses it."""
  with _RECORDERS_LOCK:
    _RECORDERS.append(record)
  try:
    yield
  finally:
    with _RECORDERS_LOCK:
      _RECORDERS.remove(record)


def _report_stats(
  config: EmbedConfig, stats: SparseDenseMatmulInputStats
) -> None:
  with _RECORDERS_LOCK:
    recorders = list(_RECORDERS)
  for record in recorders:
    record(config, stats)


@pz.pytree_dataclass
class SparseCoreEmbed(pz.nn.Layer):
  """Looks up features in row-sharded, stacked tables.

  Attributes:
    tables: Stack name → the stack's table variable (`pz.Parameter`).
    slots: Stack name → slot name → optimizer slot (`pz.StateVariable`).
    config: Static description: name, plan, topology, axis names.
    activation_probe: None, except inside a trainer's differentiated loss,
      where it adds zero probes to the activations and records the inputs.
    maps: Hashed stack name → part (`MAP_PARTS`) → `pz.StateVariable`: the
      map of ids to rows of each hashed table (`core.hashed`).
  """

  tables: dict[str, Any]
  slots: dict[str, dict[str, Any]]
  config: EmbedConfig = dataclasses.field(metadata={"pytree_node": False})
  activation_probe: ActivationProbe | None = None
  maps: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(
    cls,
    name: str,
    init_base_rng: jax.Array | None,
    feature_specs: Any,
    mesh: Mesh,
    *,
    sharding_axis: str | tuple[str, ...] | None = None,
    num_sc_per_device: int = 1,
    feature_axes: Any = None,
    embedding_axis: str = "embedding",
    exchange: str = "auto",
    axis_name_to_mesh_name: Mapping[str, Any] | None = None,
    stacking: str | None = "auto",
    limits: str = "auto",
    placement: str | Mapping[str, str] = "sharded",
    max_replicated_bytes: int = replication.DEFAULT_MAX_BYTES,
  ) -> SparseCoreEmbed:
    """Builds the layer and its (sharded) variables.

    The arguments after `mesh` are keyword-only.

    Args:
      name: Layer name; variable labels are `f"{name}/{stack}.embeddings"`
        and `f"{name}/{stack}.{slot}"`.
      init_base_rng: Key for the tables' initializers, or None for slots to
        be filled later (e.g. by `restore_checkpoint`).
      feature_specs: A pytree of `FeatureSpec`s (prepared or not; stacking
        from `stack_tables` / `auto_stack_tables` is kept).
      mesh: A `jax.sharding.Mesh` (Auto axes).
      sharding_axis: The mesh axis, or tuple of axes, tables and batches
        are sharded over: shorthand for `axis_name_to_mesh_name=
        {"sc_shard": ...}`. Default: every axis of the mesh.
      num_sc_per_device: Virtual SparseCores per device.
      feature_axes: Sample axis names: None (`("batch",)` for every
        feature), one tuple for all features, or a dict feature → tuple.
      embedding_axis: Name of the embedding axis.
      exchange: How lookups cross devices: `"auto"` (per stack, the mode
        with fewer predicted bytes per device), `"activations"` or `"rows"`
        (see `pz_sparsecore.device.exchange`).
      axis_name_to_mesh_name: Penzai-style placement
        (`pz.toolshed.sharding_util`): the layer's axis names (`"sc_shard"`,
        the tables' shard axis; each feature's sample axes; the embedding
        axis) → a mesh axis, a tuple of mesh axes, or None (replicated).
        Names left out keep their defaults (the shard axis over every mesh
        axis, each feature's first sample axis over the same axes less
        those other names took, the rest replicated); names the layer lacks
        are ignored. See
        `pz_sparsecore.nn.axis_mapping`.
      stacking: `"auto"` (the default): tables not stacked yet that can
        share a stack (same padded width, optimizer, combiner and
        quantization config, as upstream's `auto_stack_tables`) share one,
        one lookup and one fused update for all of them; each keeps its own
        limits (the stack's are their sums) and the stack is named after
        its tables (`"a_b_c"`, or `"a_and_25_more"`). None: one stack per
        table (specs stacked by hand are kept either way).
      limits: `"auto"` (the default): a table whose preprocessing limits
        are still upstream's defaults (256 ids and 256 distinct ids per
        partition, no buffer size) gets the worst case of its features'
        declared shapes instead (`layout.worst_case_limits`: every id of a
        SparseCore in one partition), so no batch of those shapes is
        refused; FDO (`pzsc.update_limits`, or `fit`'s
        `refresh_limits_every`) then tightens them to the data. `"specs"`:
        every limit as the specs give it.
      placement: Where each table lives. `"sharded"` (the default): every
        table MOD-sharded over the devices. `"auto"`: a small table whose
        copy on every device moves fewer bytes per step than sharding it
        is replicated (every device holds it whole and looks it up
        locally; its row gradients are all-reduced and every copy gets the
        same update), the rest sharded; the cost model is
        `pz_sparsecore.device.replication` (tables of at most
        `max_replicated_bytes` with their slots, priced with
        `exchange.predict_bytes` from the limits; it counts bytes, which
        suits devices that run apart, and on virtual CPU devices sharing
        cores replication measured slower). A dict table name ->
        `"replicated"` or `"sharded"` overrides the choice for those
        tables (the rest auto). Replicated and sharded tables never share
        a stack; `viz.describe(layer)` and Treescope show each stack's
        placement.
      max_replicated_bytes: The cost model's memory bound per table (rows
        and slots, one device).

    Returns:
      A new `SparseCoreEmbed`.

    Raises:
      ValueError: On a bad topology, specs or axis names, a mesh axis the
        mesh lacks, or a mesh without Auto axes.
    """
    topology = make_topology(
      mesh, sharding_axis, num_sc_per_device, exchange, axis_name_to_mesh_name
    )
    config = make_config(
      name,
      feature_specs,
      topology,
      feature_axes,
      embedding_axis,
      axis_name_to_mesh_name,
      stacking,
      limits,
      placement,
      max_replicated_bytes,
    )
    tables, slots = make_variables(config, init_base_rng)
    return cls(
      tables=tables,
      slots=slots,
      config=config,
      maps=make_maps(config, init_base_rng),
    )

  def preprocess(
    self,
    features: Any,
    weights: Any = None,
    *,
    batch_number: int = 0,
    allow_id_dropping: bool = False,
    enable_minibatching: bool = False,
    all_reduce: Any = None,
    keep_padding: bool = False,
  ) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Preprocesses this process's local batch into device arrays.

    A feature with several sample axes (e.g. `("batch", "seq")`) takes a
    dense array of shape `[*sample_dims]` (one id per sample) or
    `[*sample_dims, k]`; it is flattened to `[prod(sample_dims), k]`.

    The batch may have any number of samples: another size than the
    specs' is padded to its bucket (powers of two; `nn.batching` gives the
    rule) and the call on the buffers returns the real samples only. Each
    bucket's buffers have their own shapes, and each distinct sample count
    compiles the call once (with `keep_padding`, once per bucket).

    Args:
      features: Pytree of id arrays, structured like the feature specs.
      weights: None or a matching pytree of float weights.
      batch_number: The batch's index (unused; kept for compatibility).
      allow_id_dropping: Drop ids over the limits instead of raising.
      enable_minibatching: Split a batch over the limits into minibatches
        that each keep them (`pz_sparsecore.host.minibatching`); the layer and
        the trainer loop over them. The buffers are 64 times larger.
      all_reduce: With minibatching over several processes, how they agree
        on the split (`minibatching.AllReduce`); None uses JAX's
        collectives.
      keep_padding: For a batch of another size than the specs', the call
        returns its bucket's samples (padding samples read zeros) instead
        of the real ones: one compilation per bucket, e.g. for serving.

    Returns:
      `(inputs, stats)`: buffers as global arrays laid out for the mesh, and
      the batch's statistics (for FDO; with minibatching, those of the whole
      batch).

    Raises:
      ValueError: On bad input (naming the feature and the value).
    """
    del batch_number
    topo = self.config.topology
    features = _flatten_samples(self.config, features, "features")
    if weights is not None:
      weights = _flatten_samples(self.config, weights, "weights")
    local = local_device_count(topo)
    features, weights, batch = batching.pad_batch(
      self.config, features, weights, local, keep_padding
    )
    try:
      inputs, stats = preprocess_for_plan(
        batching.config_for(self.config, batch).plan,
        features,
        weights,
        local,
        has_leading_dimension=False,
        allow_id_dropping=allow_id_dropping,
        enable_minibatching=enable_minibatching,
        all_reduce=all_reduce,
      )
    except LimitsExceededError as e:
      _report_stats(self.config, e.stats)
      raise
    _report_stats(self.config, stats)
    if batch is not None:
      inputs = dataclasses.replace(inputs, batch=batch)
    sharding = topo.sharding(1)
    if jax.process_count() == 1:
      # The local batch is the global one: one batched transfer of every
      # buffer (one per buffer costs about 1 ms each).
      return jax.device_put(inputs, sharding), stats

    def to_global(x):
      size = x.shape[0] // local * topo.num_devices
      return jax.make_array_from_process_local_data(sharding, x, (size,))

    return jax.tree.map(to_global, inputs), stats

  def __call__(
    self, inputs: PreprocessedInput, /, **side_inputs: Any
  ) -> dict[str, pz.nx.NamedArray]:
    """Feature name → activations `NamedArray` (sample axes + embedding),
    in the dtype of the feature's table's `activation_dtype` (float32
    unless set).

    Args:
      inputs: The buffers from `preprocess` (or built by hand in the same
        format).
      **side_inputs: Penzai side inputs (ignored), and `validate=True` to
        check the buffers' contents first (see `validate`).
    """
    config = self.config_of(inputs)
    check_inputs(config, inputs)
    if side_inputs.get("validate", False):
      self.validate(inputs)
    if inputs.hashed_ids is not None:
      inputs = self.resolve_ids(inputs, train=False)
    acts = routing.lookup(
      config.plan, config.topology, table_arrays(self), inputs
    )
    if self.activation_probe is not None:
      acts = self.activation_probe.observe(acts, inputs)
    out = {}
    mesh = config.topology.mesh
    for i, (feature, axes) in enumerate(
      zip(config.plan.features.values(), config.feature_axes, strict=True)
    ):
      value = acts[feature.name].reshape(feature.output_shape)
      value = value.astype(feature.spec.table_spec.activation_dtype)
      names = (*axes, config.embedding_axis)
      value = jax.lax.with_sharding_constraint(
        value, config.axis_mapping.sharding(mesh, names)
      )
      # The bucket's samples are laid out as the specs' batch; the real
      # ones (their count need not divide over the mesh) are cut after.
      value = batching.real_samples(value, inputs.batch, i)
      out[feature.name] = pz.nx.wrap(value).tag(*names)
    return out

  def resolve_ids(
    self,
    inputs: PreprocessedInput,
    *,
    step: jax.Array | int = 0,
    train: bool = True,
  ) -> PreprocessedInput:
    """The buffers with every hashed table's raw ids resolved to rows.

    In training, ids not held yet get rows (evicting by the table's policy
    when their window is full; their rows drawn from the initializer for
    the id, their optimizer slots reset), and the map records `step`; in
    inference (`train=False`) unseen ids read a zero row and are counted.
    Writes the maps (and in training the reset rows) into the layer's
    variables. `SparseCoreTrainer` calls it before each step; a
    hand-written step calls it before the forward and passes the result to
    both the forward and `apply_gradients`. A call of the layer on
    unresolved buffers resolves them for inference.

    Args:
      inputs: Buffers from `preprocess`.
      step: The training step (the map's clock).
      train: Insert new ids (training) or only look up (inference).

    Returns:
      The buffers, resolved (without `hashed_ids`); buffers without hashed
      tables as they are.
    """
    config = self.config_of(inputs)
    check_inputs(config, inputs)
    if inputs.hashed_ids is None or not self.maps:
      return inputs
    stacks = list(self.maps)
    tables = table_arrays(self)
    slots = slot_arrays(self)
    maps, new_tables, new_slots, resolved = hashed_lib.resolve(
      config.plan,
      config.topology,
      map_arrays(self),
      {k: tables[k] for k in stacks} if train else {},
      {k: slots[k] for k in stacks} if train else {},
      inputs,
      step,
      train=train,
    )
    for name, value in maps.items():
      for part, array in zip(MAP_PARTS, value, strict=True):
        self.maps[name][part].value = array
    if train:
      assign_arrays(self, new_tables, new_slots)
    return resolved

  def validate(self, inputs: PreprocessedInput) -> None:
    """Checks hand-built buffers' contents before they are used.

    `preprocess` always writes valid buffers; buffers built otherwise may
    hold entries the kernels skip (see `pz_sparsecore.device.input_check`).
    `SparseCoreTrainer` runs this on its first step.

    Args:
      inputs: Concrete buffers (not traced: call it outside `jit`).

    Raises:
      ValueError: Naming the feature, device, partition, buffer, position
        and value of the first bad entry, or if `inputs` are traced.
    """
    config = batching.config_of_inputs(self.config, inputs)
    check_inputs(config, inputs)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(inputs)):
      raise ValueError(
        f"SparseCoreEmbed {config.name!r}: validate needs concrete buffers; "
        "call embed.validate(inputs) outside jit, before the jitted call"
      )
    modes = {
      stack.name: config.topology.exchange_of(stack).mode
      for stack in config.plan.stacks
    }
    input_check.validate_input(config.plan, inputs, modes)

  def apply_gradients(
    self,
    inputs: PreprocessedInput,
    activation_grads: Mapping[str, Any],
    step: jax.Array | int,
  ) -> None:
    """Runs each stack's optimizer on the referenced rows, in place.

    Writes the new values into the layer's variables; use it inside
    `pzsc.variable_jit(..., donate_variables=True)` (or Penzai's
    `pz.variable_jit` with donation) so the update happens in the donated
    buffers.

    Args:
      inputs: The buffers the activations were computed from.
      activation_grads: Feature name → gradient with respect to its
        activations (`NamedArray` as returned by `__call__`, or an array).
      step: The training step, for step-dependent optimizers.
    """
    config = batching.config_of_inputs(self.config, inputs)
    check_inputs(config, inputs)
    if inputs.hashed_ids is not None:
      raise ValueError(
        f"SparseCoreEmbed {config.name!r}: these buffers hold raw ids of "
        "hashed tables; resolve them first (inputs = "
        "embed.resolve_ids(inputs, step=step)) and pass the result to the "
        "forward and to apply_gradients"
      )
    tables, slots = routing.apply_gradients(
      config.plan,
      config.topology,
      table_arrays(self),
      slot_arrays(self),
      inputs,
      _flat_grads(config, activation_grads, inputs.batch),
      step,
    )
    assign_arrays(self, tables, slots)

  def fixed_probes(self) -> dict[str, jax.Array] | None:
    """Zero probes shaped like the activations, or None if the shapes are
    the call's (see `nn.probe`)."""
    return zero_probes(self.config.plan)

  def plan_of(self, activations: Mapping[str, Any]) -> plan_lib.Plan:
    """The plan of the call that gave these (flat) activations."""
    return batching.config_of_activations(self.config, activations).plan

  def config_of(self, inputs: Any) -> EmbedConfig:
    """The config of the call these buffers are for (`fits` checks them
    against it): the layer's own, or for buffers of another batch size
    (`PreprocessedInput.batch`) its plan resized to their bucket."""
    return batching.config_of_inputs(self.config, inputs)

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore.viz import treescope as _treescope

    return _treescope.render_embed(self, path, subtree_renderer)

  def treescope_summary(self) -> str:
    """The one-line summary Treescope shows for the collapsed layer."""
    from pz_sparsecore.viz import treescope as _treescope

    return _treescope.embed_summary(self)


def find_embeds(model: Any) -> list[SparseCoreEmbed]:
  """The `SparseCoreEmbed` layers of a model, in tree order.

  Args:
    model: Any Penzai model (or pytree).

  Returns:
    Its `SparseCoreEmbed` layers.
  """
  return pz.select(model).at_instances_of(SparseCoreEmbed).get_sequence()


def variable_labels(model: Any) -> tuple[set[str], set[str]]:
  """The labels of the tables and of the slots of every layer in `model`.

  Args:
    model: Any Penzai model (or pytree).

  Returns:
    `(table labels, slot labels)`.
  """
  tables, slots = set(), set()
  for embed in find_embeds(model):
    config = embed.config
    for stack in config.plan.stacks:
      tables.add(config.table_label(stack.name))
      for slot in stack.optimizer.slot_names():
        slots.add(config.slot_label(stack.name, slot))
  return tables, slots


# ---------------------------------------------------------------------------
# Host side: the local batch.


def _flatten_samples(config: EmbedConfig, tree: Any, what: str) -> Any:
  """Flattens the sample axes of multi-axis features to one."""
  treedef = config.plan.treedef
  try:
    leaves = treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    expected = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    if (
      isinstance(expected, Mapping)
      and isinstance(tree, Mapping)
      and set(expected) != set(tree)
    ):
      missing = sorted(set(expected) - set(tree), key=str)
      unknown = sorted(set(tree) - set(expected), key=str)
      raise ValueError(
        f"{what}: expected the keys {sorted(expected, key=str)}, got "
        f"{sorted(tree, key=str)} (missing {missing}, unknown {unknown})"
      ) from None
    raise ValueError(
      f"{what} do not match the feature specs' structure {treedef}: {e}"
    ) from e
  out = []
  for spec, axes, leaf in zip(
    config.plan.feature_specs, config.feature_axes, leaves, strict=True
  ):
    if len(axes) > 1 and isinstance(leaf, (np.ndarray, jax.Array)):
      leaf = np.asarray(leaf)
      if leaf.ndim not in (len(axes), len(axes) + 1):
        raise ValueError(
          f"feature {spec.name!r}: {what} of shape {leaf.shape} for sample "
          f"axes {axes}"
        )
      lead = int(np.prod(leaf.shape[: len(axes)]))
      leaf = leaf.reshape(lead, int(np.prod(leaf.shape[len(axes) :])))
    out.append(leaf)
  return jax.tree.unflatten(treedef, out)


def local_device_count(topo: topology_lib.Topology) -> int:
  """Positions along the shard axis whose devices this process owns."""
  names = list(topo.mesh.axis_names)
  devices = np.moveaxis(
    topo.mesh.devices,
    [names.index(a) for a in topo.axes],
    list(range(len(topo.axes))),
  ).reshape(topo.num_devices, -1)
  me = jax.process_index()
  owned = [
    i for i in range(topo.num_devices) if devices[i, 0].process_index == me
  ]
  if not owned or owned != list(range(owned[0], owned[0] + len(owned))):
    raise ValueError(
      f"process {me} must own a contiguous block of the shard axis's mesh "
      f"axes {topo.axes}; it owns positions {owned}"
    )
  return len(owned)


# ---------------------------------------------------------------------------
# Device side: what the layer accepts.


def _input_shapes(config: EmbedConfig, minibatched: bool) -> PreprocessedInput:
  """Global `jax.ShapeDtypeStruct`s of `preprocess`'s buffers (with
  `enable_minibatching` when `minibatched`)."""
  topo = config.topology
  plan = (
    plan_lib.with_minibatch_buffers(config.plan) if minibatched else config.plan
  )
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      (x.shape[0] * topo.num_devices,), x.dtype, sharding=topo.sharding(1)
    ),
    input_shapes(plan, 1),
  )


def check_inputs(config: EmbedConfig, inputs: Any) -> None:
  """Raises unless `inputs` are buffers of this layer's `preprocess`."""
  if not isinstance(inputs, PreprocessedInput):
    raise ValueError(
      f"SparseCoreEmbed {config.name!r} takes the PreprocessedInput "
      f"from its preprocess(), got {type(inputs).__name__}"
    )
  minibatched = inputs.num_minibatches is not None
  expected = _input_shapes(config, minibatched)
  for field in dataclasses.fields(PreprocessedInput):
    want, got = getattr(expected, field.name), getattr(inputs, field.name)
    if field.name == "num_minibatches":
      if minibatched and not _same_struct(got, want):
        raise ValueError(
          f"SparseCoreEmbed {config.name!r}: num_minibatches is "
          f"{_struct_text(got)}, expected {_struct_text(want)} (one count "
          "per device)"
        )
      continue
    if field.name == "batch":
      continue  # Static: it chose `config`.
    if field.name == "hashed_ids" and got is None:
      continue  # Resolved (or no hashed table).
    if field.name == "sample_order":
      if got is None:
        continue  # Optional: the forward then sorts by sample itself.
      if want is None:
        raise ValueError(
          f"SparseCoreEmbed {config.name!r}: the buffers carry a "
          "sample_order, which only one-device layers read; preprocess "
          "with this layer's preprocess()"
        )
    if set(got) != set(want):
      raise ValueError(
        f"{field.name}: stacks {sorted(got)} do not match the layer's "
        f"{sorted(want)}"
      )
    for stack, w in want.items():
      g = got[stack]
      if not _same_struct(g, w):
        features = [f.name for f in config.plan.stack(stack).features]
        layout_text = "minibatched " if minibatched else ""
        raise ValueError(
          f"stack {stack!r}: {field.name} is {_struct_text(g)}, expected "
          f"{_struct_text(w)} for {layout_text}buffers (features "
          f"{features}); preprocess with this layer's preprocess(). If "
          "the limits changed, refresh the layer where it is used (in the "
          "model or trainer) with pzsc.update_limits(trainer, stats), and "
          "preprocess with that layer (trainer.model...preprocess)"
        )


def _same_struct(got: Any, want: jax.ShapeDtypeStruct) -> bool:
  shape = getattr(got, "shape", None)
  return shape is not None and (
    tuple(shape) == tuple(want.shape) and got.dtype == want.dtype
  )


def _struct_text(x: Any) -> str:
  if not hasattr(x, "shape"):
    return type(x).__name__
  return f"{x.dtype}{list(x.shape)}"


def fits(embed: SparseCoreEmbed, inputs: Any) -> bool:
  """Whether `inputs` have the stacks and buffer shapes `embed` takes."""
  try:
    check_inputs(embed.config_of(inputs), inputs)
  except ValueError:
    return False
  return True


def _flat_grads(
  config: EmbedConfig, grads: Mapping[str, Any], batch: Any = None
) -> dict[str, jax.Array]:
  """Activation gradients as flat `[samples, dim]` float32 arrays.

  Raises:
    ValueError: Naming the feature, for a missing or unknown feature, or a
      gradient whose axes, shape or dtype differ from its activations'.
  """
  features = config.plan.features
  unknown = sorted(set(grads) - set(features))
  if unknown:
    raise ValueError(
      f"SparseCoreEmbed {config.name!r}: activation gradients for unknown "
      f"features {unknown}; its features are {list(features)}"
    )
  out = {}
  for i, (feature, axes) in enumerate(
    zip(features.values(), config.feature_axes, strict=True)
  ):
    if feature.name not in grads:
      raise ValueError(f"no activation gradient for feature {feature.name!r}")
    g = _activation_grad(
      feature.name, grads[feature.name], (*axes, config.embedding_axis)
    )
    shape = tuple(feature.output_shape)
    if batch is not None:
      shape = (batch.samples[i], *shape[1:])
    if tuple(g.shape) != shape:
      raise ValueError(
        f"feature {feature.name!r}: activation gradient of shape "
        f"{tuple(g.shape)}, expected {shape} (the shape of its activations)"
      )
    g = batching.padded_gradient(g, batch, i)
    out[feature.name] = g.astype(jnp.float32).reshape(
      feature.spec.sample_count, feature.dim
    )
  return out


def _activation_grad(feature: str, g: Any, axes: tuple[str, ...]) -> Any:
  """`g` as a positional array in the order `axes`, checked by name."""
  if isinstance(g, pz.nx.NamedArray | pz.nx.NamedArrayView):
    named = dict(g.named_shape)
    if g.positional_shape or set(named) != set(axes):
      raise ValueError(
        f"feature {feature!r}: activation gradient with axes {named} and "
        f"positional shape {g.positional_shape}, expected the named axes "
        f"{axes} of its activations"
      )
    g = g.unwrap(*axes)
  if not hasattr(g, "dtype"):
    g = jnp.asarray(g)
  if not jnp.issubdtype(g.dtype, jnp.floating):
    raise ValueError(
      f"feature {feature!r}: activation gradient of dtype {g.dtype}, "
      "expected a floating dtype"
    )
  return g
