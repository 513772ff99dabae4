"""`SparseCoreLookup`: the drop-in for `pz.nn.EmbeddingLookup`.

The layer has `EmbeddingLookup`'s contract: integer token ids with any named
axes in, those axes plus the embedding axes out::

  lookup = pzsc.SparseCoreLookup.from_config(
      "embedder", key, vocab_size=2**20, embedding_axes={"embedding": 64},
      mesh=mesh, optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.05))
  lookup(pz.nx.wrap(tokens).tag("batch", "seq"))  # {batch, seq, embedding}

or, converting every lookup of an existing Penzai model::

  model = pz.select(model).at_instances_of(pz.nn.EmbeddingLookup).apply(
      lambda l: pzsc.SparseCoreLookup.from_lookup(l, mesh=mesh, optimizer=opt))

Its table is one `pz.Parameter` labelled like Penzai's
(`f"{name}.embeddings"`), MOD-sharded over the mesh as `SparseCoreEmbed`'s
stacks are (`[N, V_shard, D]`, axes `("sc_shard", "sc_row",
"sc_embedding")`, `D` the product of the embedding axes' sizes); its
optimizer slots are `pz.StateVariable`s labelled `f"{name}.{slot}"`.

No host step is needed: each call builds its lookup buffers on the device
from the ids (`pz_sparsecore.device.build`), for a plan sized from the
call's static shape (its sample count rounded up to a multiple of the
shard count N; padding samples have no id). One set of variables serves
every shape: a training batch, a prompt, a one-token decoding step. Ids
outside `[0, vocab_size)` are refused with a `ValueError` when the call sees
concrete ids; under `jit`, such an id looks up a zero vector and takes no
gradient.

A call of a few ids (at most `gather_max_samples`, by default the shard
count N: a decoding step's batch) that does not train skips the exchange
and its buffers: the ids go to every device, each reads the rows it holds
and one `psum` sums them (`routing.gather_lookup`). Every row still comes
from its one owner, so the activations are the exchange's; the rule only
applies where the exchange could drop no id (`max_ids_per_partition` None,
or at least the call's samples per SparseCore), and `gather_max_samples=0`
turns it off.

The host path stays for large batches: `lookup.preprocess(ids)` runs the
numba preprocessor (FDO limits, upstream's byte layout) and the call reads
those buffers from the side input named by `host_input`
(`model(tokens, sparsecore_inputs=buffers)`); both paths share the kernels
and the tables.

Raw ids: `from_config(..., ids="hashed", eviction=...)` makes the table a
hashed one (`core.hashed`): any int64 id (or string, on the host) gets a row
of its own on its owner shard while room allows, `vocab_size` rows in all.
Training reads host buffers, `lookup.preprocess(raw_ids)`, whose ids the
trainer inserts before each step (`resolve_ids`); the call then takes a
`NamedArray` of the batch's shape, whose values it does not read. A call on
the ids alone (int32 ids read as sign-extended 64-bit ones) builds their
buffers on the device (`pz_sparsecore.device.hashed_build`) and looks them
up without inserting, as a call on host buffers not resolved yet does:
unseen ids read zeros and are counted. Training on the ids alone is
refused (it could not insert).

A `SparseCoreLookup` is a `SparseCoreEmbed` (one table, one feature), so the
trainer, `pzsc.variable_jit`, checkpoints, FDO, the logical views and
Treescope take it as they take the multi-feature layer. Its buffers' plan
depends on the batch's shape; `config_of` finds it from their shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from penzai import pz

from pz_sparsecore.core import buffer_format, hashed, layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.specs import (
  TABLE_DTYPES,
  FeatureSpec,
  OptimizerSpec,
  TableSpec,
)
from pz_sparsecore.device import build, hashed_build, routing
from pz_sparsecore.host.preprocess import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
)
from pz_sparsecore.nn import embed as embed_lib
from pz_sparsecore.nn.placement import place_tables
from pz_sparsecore.nn.tables import table_arrays

__all__ = ["TABLE_AXIS", "LookupConfig", "SparseCoreLookup"]

TABLE_AXIS = "sc_embedding"
"""The name of the physical table's column axis (the embedding axes
flattened). A model's sharding mapping never names it, so Penzai's placement
of the model's activations cannot split a table's rows."""

_SAMPLE_AXIS = "sc_sample"


@dataclasses.dataclass(frozen=True)
class LookupConfig(embed_lib.EmbedConfig):
  """An `EmbedConfig` of one table looked up by one id per sample.

  `plan` is the table's plan for N samples (one per shard); `plan_for`
  gives the plan of a call's padded sample count, with the same table
  layout.

  Attributes:
    label: The table parameter's label (Penzai's `f"{name}.embeddings"`).
    vocab_size: Rows of the table.
    embedding_axes: `(name, size)` of each embedding axis, in order.
    vocabulary_axis: The vocabulary axis name of the table's
      vocabulary-order view (`EmbeddingTable`'s `vocabulary_axis`).
    host_input: The side input that may carry host-preprocessed buffers.
    max_ids_per_partition: Limit on ids one SparseCore sends one shard, or
      None for the worst case of each shape (nothing can be dropped).
    gather_max_samples: Calls of at most this many samples that do not
      train skip the exchange (`gathers`); None: the shard count N.
  """

  label: str = ""
  vocab_size: int = 0
  embedding_axes: tuple[tuple[str, int], ...] = ()
  vocabulary_axis: str = "vocabulary"
  host_input: str = "sparsecore_inputs"
  max_ids_per_partition: int | None = None
  gather_max_samples: int | None = None

  @property
  def stem(self) -> str:
    """The label without its `.embeddings` suffix (slot labels' prefix)."""
    return _stem(self.label)

  def table_label(self, stack: str) -> str:
    del stack
    return self.label

  def slot_label(self, stack: str, slot: str) -> str:
    del stack
    return f"{self.stem}.{slot}"

  def map_label(self, stack: str, part: str) -> str:
    del stack
    return f"{self.stem}.map_{part}"

  @property
  def is_hashed(self) -> bool:
    """Whether the table takes raw ids (`from_config(..., ids="hashed")`)."""
    return self.plan.stacks[0].is_hashed

  @property
  def feature(self) -> str:
    """The name of the layer's one feature (and of its table and stack)."""
    return self.plan.feature_specs[0].name

  @property
  def dim(self) -> int:
    """`D`, the product of the embedding axes' sizes."""
    return math.prod(size for _, size in self.embedding_axes)

  def padded_samples(self, samples: int) -> int:
    """`samples` rounded up to a multiple of the shard count (at least N)."""
    n = self.topology.num_shards
    return max(n, buffer_format.round_up(samples, n))

  def plan_for(self, samples: int) -> plan_lib.Plan:
    """The plan of a call with `samples` samples (padded to N's multiple)."""
    return _plan_for(self, self.padded_samples(samples))

  def gathers(self, samples: int) -> bool:
    """Whether an inference call of `samples` ids on the device takes
    `routing.gather_lookup` instead of the exchange: a table of ids in a
    range, at most `gather_max_samples` samples (None: N), and no id the
    exchange could drop (one id per sample: none when the samples per
    SparseCore are within `max_ids_per_partition`)."""
    most = self.gather_max_samples
    if most is None:
      most = self.topology.num_shards
    limit = self.max_ids_per_partition
    per_sc = self.padded_samples(samples) // self.topology.num_shards
    return (
      not self.is_hashed
      and samples <= most
      and (limit is None or per_sc <= limit)
    )


def _stem(label: str) -> str:
  """A table label without its `.embeddings` suffix."""
  suffix = ".embeddings"
  return label[: -len(suffix)] if label.endswith(suffix) else label


def _table_spec(
  name: str,
  vocab_size: int,
  dim: int,
  optimizer: OptimizerSpec,
  initializer: Any,
  limit: int,
  dtypes: tuple[Any, Any],
  ids: str = "range",
  eviction: Any = None,
  unique_limit: int | None = None,
) -> TableSpec:
  return TableSpec(
    name=name,
    vocabulary_size=vocab_size,
    embedding_dim=dim,
    initializer=initializer,
    optimizer=optimizer,
    combiner="sum",
    max_ids_per_partition=limit,
    max_unique_ids_per_partition=unique_limit or limit,
    dtype=dtypes[0],
    activation_dtype=dtypes[1],
    ids=ids,
    eviction=eviction,
  )


def _feature_spec(table: TableSpec, samples: int) -> FeatureSpec:
  return FeatureSpec(
    name=table.name,
    table_spec=table,
    input_shape=(samples, 1),
    output_shape=(samples, table.embedding_dim),
  )


@functools.lru_cache(maxsize=256)
def _plan_for(config: LookupConfig, samples: int) -> plan_lib.Plan:
  base = config.plan
  topo = config.topology
  table = base.stacks[0].tables[0]
  per_sc = samples // topo.num_shards
  limit = per_sc
  if config.max_ids_per_partition is not None:
    limit = min(per_sc, config.max_ids_per_partition)
  # A hashed table's distinct ids are not capped: its buffers' shapes then
  # give their batch's samples per SparseCore (to within 8), which resolving
  # its ids reads them with (`_samples_of`).
  unique = per_sc if table.is_hashed else limit
  spec = _feature_spec(
    _table_spec(
      table.name,
      table.vocabulary_size,
      table.embedding_dim,
      table.optimizer,
      table.initializer,
      max(limit, 1),
      (table.dtype, table.activation_dtype),
      ids=table.ids,
      eviction=table.eviction,
      unique_limit=max(unique, 1),
    ),
    samples,
  )
  prepared = layout.prepare_feature_specs_for_training(
    spec, topo.num_devices, topo.num_sc_per_device
  )
  plan = plan_lib.build(prepared, topo.num_devices, topo.num_sc_per_device)
  got, want = plan.stacks[0], base.stacks[0]
  assert (got.name, got.rows_per_shard, got.dim) == (
    want.name,
    want.rows_per_shard,
    want.dim,
  ), (got, want)
  return plan


def _embedding_axes(embedding_axes: Mapping[str, int]) -> tuple:
  if not isinstance(embedding_axes, Mapping) or not embedding_axes:
    raise ValueError(
      "embedding_axes must be a non-empty dict of axis name → size, e.g. "
      f'{{"embedding": 64}}, got {embedding_axes!r}'
    )
  out = []
  for name, size in embedding_axes.items():
    if not isinstance(size, (int, np.integer)) or size <= 0:
      raise ValueError(
        f"embedding axis {name!r} must have a positive integer size, got "
        f"{size!r}"
      )
    out.append((str(name), int(size)))
  return tuple(out)


def _default_initializer(key, shape, dtype=jnp.float32):
  # Penzai's EmbeddingTable default: variance scaling over the embedding
  # axes (fan out), scale 1.
  return jax.nn.initializers.variance_scaling(1.0, "fan_out", "normal")(
    key, shape, dtype
  )


def _check_limits(
  label: str, max_ids_per_partition: Any, gather_max_samples: Any
) -> None:
  """Raises unless the call-size options of `from_config` are valid."""
  if max_ids_per_partition is not None and max_ids_per_partition <= 0:
    raise ValueError(
      f"SparseCoreLookup {label!r}: max_ids_per_partition must be positive "
      f"or None, got {max_ids_per_partition!r}"
    )
  if gather_max_samples is not None and (
    isinstance(gather_max_samples, bool)
    or not isinstance(gather_max_samples, int | np.integer)
    or gather_max_samples < 0
  ):
    raise ValueError(
      f"SparseCoreLookup {label!r}: gather_max_samples must be an integer "
      f">= 0 (0: always exchange) or None (the shard count), got "
      f"{gather_max_samples!r}"
    )


def _make_lookup_config(
  label: str,
  vocab_size: int,
  embedding_axes: Any,
  mesh: Mesh,
  optimizer: OptimizerSpec,
  *,
  initializer: Any,
  vocabulary_axis: str,
  num_sc_per_device: int,
  sharding_axis: Any,
  exchange: str,
  axis_name_to_mesh_name: Mapping[str, Any] | None,
  host_input: str,
  max_ids_per_partition: int | None,
  dtypes: tuple[Any, Any],
  ids: str = "range",
  eviction: Any = None,
  gather_max_samples: int | None = None,
) -> LookupConfig:
  if not isinstance(optimizer, OptimizerSpec):
    raise ValueError(
      f"SparseCoreLookup {label!r}: optimizer must be an optimizer spec "
      f"(e.g. pzsc.AdagradOptimizerSpec(...)), got {optimizer!r}"
    )
  axes = _embedding_axes(embedding_axes)
  if vocabulary_axis in dict(axes):
    raise ValueError(
      f"SparseCoreLookup {label!r}: the vocabulary axis {vocabulary_axis!r}"
      f" is also an embedding axis {dict(axes)}"
    )
  _check_limits(label, max_ids_per_partition, gather_max_samples)
  topology = embed_lib.make_topology(
    mesh, sharding_axis, num_sc_per_device, exchange, axis_name_to_mesh_name
  )
  stem = _stem(label)
  table = _table_spec(
    stem,
    vocab_size,
    math.prod(size for _, size in axes),
    optimizer,
    initializer or _default_initializer,
    1,
    dtypes,
    ids=ids,
    eviction=eviction,
  )
  base = embed_lib.make_config(
    stem,
    _feature_spec(table, topology.num_shards),
    topology,
    (_SAMPLE_AXIS,),  # The sample axes of every feature (here one).
    TABLE_AXIS,
    {
      k: v
      for k, v in (axis_name_to_mesh_name or {}).items()
      if k == embed_lib.SHARD_AXIS
    },
  )
  return LookupConfig(
    **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
    label=label,
    vocab_size=int(vocab_size),
    embedding_axes=axes,
    vocabulary_axis=vocabulary_axis,
    host_input=host_input,
    max_ids_per_partition=max_ids_per_partition,
    gather_max_samples=None
    if gather_max_samples is None
    else int(gather_max_samples),
  )


@functools.partial(jax.jit, static_argnums=1)
def _physical(values: jax.Array, config: LookupConfig):
  """A logical `[V, D]` table as the layer's `[N, V_shard, D]` stack."""
  stack = config.plan.stacks[0]
  setting = stack.tables[0].setting_in_stack
  n = config.topology.num_shards
  rows = setting.padded_vocab_size // n
  padded = jnp.pad(
    values,
    (
      (0, setting.padded_vocab_size - values.shape[0]),
      (0, stack.dim - values.shape[1]),
    ),
  )
  sharded = padded.reshape(rows, n, stack.dim).swapaxes(0, 1)
  sharded = jnp.roll(sharded, setting.shard_rotation, axis=0)
  out = jnp.zeros((n, stack.rows_per_shard, stack.dim), values.dtype)
  out = jax.lax.dynamic_update_slice_in_dim(
    out, sharded, setting.row_offset_in_shard, axis=1
  )
  return jax.lax.with_sharding_constraint(out, config.topology.sharding(3))


def _check_ids(config: LookupConfig, ids: Any) -> None:
  """Refuses out-of-range ids when they are concrete (a hashed table takes
  every id)."""
  if config.is_hashed or isinstance(ids, jax.core.Tracer):
    return
  values = np.asarray(ids)
  if not values.size:
    return
  bad = (values < 0) | (values >= config.vocab_size)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"SparseCoreLookup {config.label!r}: token id {int(values[where])} at "
      f"position {where} is outside [0, {config.vocab_size})"
    )


@pz.pytree_dataclass(
  has_implicitly_inherited_fields=True
)  # pytype: disable=wrong-keyword-args
class SparseCoreLookup(embed_lib.SparseCoreEmbed):
  """Looks token ids up in one MOD-sharded table, like `EmbeddingLookup`.

  Attributes:
    tables: `{feature: pz.Parameter}`, the one table.
    slots: `{feature: {slot: pz.StateVariable}}`, its optimizer slots.
    config: A `LookupConfig`.
    activation_probe: As `SparseCoreEmbed`'s (set by trainers).
    maps: For a hashed table, its map (`SparseCoreEmbed.maps`, labelled
      `f"{name}.map_{part}"`); else empty.
  """

  @classmethod
  def from_config(  # pytype: disable=signature-mismatch
    cls,
    name: str,
    init_base_rng: jax.Array | None,
    vocab_size: int,
    embedding_axes: dict[str, int],
    mesh: Mesh,
    optimizer: OptimizerSpec,
    *,
    vocabulary_axis: str = "vocabulary",
    initializer: Any = None,
    num_sc_per_device: int = 1,
    sharding_axis: str | tuple[str, ...] | None = None,
    exchange: str = "auto",
    axis_name_to_mesh_name: Mapping[str, Any] | None = None,
    host_input: str = "sparsecore_inputs",
    max_ids_per_partition: int | None = None,
    dtype: Any = jnp.float32,
    activation_dtype: Any = jnp.float32,
    ids: str = "range",
    eviction: Any = None,
    gather_max_samples: int | None = None,
  ) -> SparseCoreLookup:
    """Builds the layer and its sharded variables.

    Mirrors `pz.nn.EmbeddingTable.from_config`: the table parameter is
    labelled `f"{name}.embeddings"`.

    Args:
      name: Layer name; labels are `f"{name}.embeddings"` and
        `f"{name}.{slot}"`.
      init_base_rng: Key of the initializer, or None for slots to be filled
        later (e.g. by `restore_checkpoint`).
      vocab_size: Rows of the table.
      embedding_axes: Embedding axis name → size, e.g. `{"embedding": 64}`.
      mesh: A `jax.sharding.Mesh` (Auto axes).
      optimizer: The table's optimizer spec (its fused in-place update).
      vocabulary_axis: The vocabulary axis of the vocabulary-order view.
      initializer: `(key, shape, dtype) -> array`, called once per shard
        with shape `[rows of the shard, D]`; default: Penzai's embedding
        initializer (variance scaling over the embedding axes).
      num_sc_per_device: Virtual SparseCores per device.
      sharding_axis: The mesh axes the table's rows are sharded over
        (default: all).
      exchange: `"auto"`, `"activations"` or `"rows"`
        (`pz_sparsecore.device.exchange`).
      axis_name_to_mesh_name: A Penzai placement mapping; only its
        `"sc_shard"` entry concerns the table (other names are the model's).
      host_input: The side input that may carry host-preprocessed buffers
        (`preprocess`).
      max_ids_per_partition: Window of ids one SparseCore sends one shard;
        None sizes it for the worst case of each call's shape. Smaller
        limits shrink the exchange; ids over them are looked up as zeros,
        with a `ValueError` in an eager call and a warning under `jit`. A
        hashed table's distinct ids are not capped (their keys travel to
        their owners whatever the limit).
      dtype: How the table's rows are stored (`TableSpec.dtype`: float32,
        bfloat16 or float16).
      activation_dtype: The activations' dtype (`TableSpec.activation_dtype`).
      ids: `"range"` (the default): token ids lie in `[0, vocab_size)`.
        `"hashed"`: raw ids (`TableSpec.ids`, `core.hashed`): any int64,
        or strings / bytes given to `preprocess`; `vocab_size` is then the
        rows the table can hold. Training reads host buffers
        (`preprocess`), which insert new ids; a call on the ids alone
        looks them up without inserting.
      eviction: For `ids="hashed"`, what a full window does
        (`TableSpec.eviction`: an `Eviction` or a policy name; None:
        `"lru"`); None for `"range"`.
      gather_max_samples: Inference calls of at most this many ids (of a
        range table, none of which the exchange could drop) read their
        rows with `routing.gather_lookup` (the ids to every device, one
        `psum`) instead of the exchange; the activations are the same.
        None: the shard count N (a decoding step's batch); 0: never.

    Returns:
      The layer.

    Raises:
      ValueError: On a bad argument (`ids` and `eviction` as `TableSpec`
        checks them, naming the table `name`).
    """
    config = _make_lookup_config(
      f"{name}.embeddings",
      vocab_size,
      embedding_axes,
      mesh,
      optimizer,
      initializer=initializer,
      vocabulary_axis=vocabulary_axis,
      num_sc_per_device=num_sc_per_device,
      sharding_axis=sharding_axis,
      exchange=exchange,
      axis_name_to_mesh_name=axis_name_to_mesh_name,
      host_input=host_input,
      max_ids_per_partition=max_ids_per_partition,
      dtypes=(dtype, activation_dtype),
      ids=ids,
      eviction=eviction,
      gather_max_samples=gather_max_samples,
    )
    tables, slots = embed_lib.make_variables(config, init_base_rng)
    return cls(
      tables=tables,
      slots=slots,
      config=config,
      maps=embed_lib.make_maps(config, init_base_rng),
    )

  @classmethod
  def from_lookup(
    cls,
    lookup: pz.nn.EmbeddingLookup,
    *,
    mesh: Mesh,
    optimizer: OptimizerSpec,
    axis_name_to_mesh_name: Mapping[str, Any] | None = None,
    num_sc_per_device: int = 1,
    sharding_axis: str | tuple[str, ...] | None = None,
    exchange: str = "auto",
    host_input: str = "sparsecore_inputs",
    max_ids_per_partition: int | None = None,
    dtype: Any = None,
    activation_dtype: Any = None,
    gather_max_samples: int | None = None,
  ) -> SparseCoreLookup:
    """Converts a `pz.nn.EmbeddingLookup`, keeping its values, label and
    axis names (a table of ids in a range: `from_config` makes hashed ones).

    Args:
      lookup: The lookup, its table parameter bound (a `pz.Parameter`).
      mesh: As `from_config`.
      optimizer: As `from_config`.
      axis_name_to_mesh_name: As `from_config`.
      num_sc_per_device: As `from_config`.
      sharding_axis: As `from_config`.
      exchange: As `from_config`.
      host_input: As `from_config`.
      max_ids_per_partition: As `from_config`.
      dtype: How the rows are stored; None: the lookup's table dtype if it
        is float32, bfloat16 or float16 (its values kept exactly), else
        float32.
      activation_dtype: The activations' dtype; None: the table's storage
        dtype, as `pz.nn.EmbeddingLookup` returns its table's dtype.
      gather_max_samples: As `from_config`.

    Returns:
      A `SparseCoreLookup` whose table holds the lookup's values, sharded.

    Raises:
      ValueError: If `lookup` is not an `EmbeddingLookup` or its table is
        not a bound parameter.
    """
    if not isinstance(lookup, pz.nn.EmbeddingLookup):
      raise ValueError(
        f"from_lookup takes a pz.nn.EmbeddingLookup, got "
        f"{type(lookup).__name__}"
      )
    param = lookup.table.embeddings
    if not isinstance(param, pz.Parameter):
      raise ValueError(
        f"from_lookup: the lookup's table is {type(param).__name__}, not a "
        "bound pz.Parameter (bind its variables first)"
      )
    value = param.value
    vocab_axis = lookup.table.vocabulary_axis
    named = dict(value.named_shape)
    if value.positional_shape or vocab_axis not in named:
      raise ValueError(
        f"from_lookup: table {param.label!r} has axes {named} and "
        f"positional shape {value.positional_shape}; expected the named "
        f"vocabulary axis {vocab_axis!r} and embedding axes"
      )
    emb = {k: v for k, v in named.items() if k != vocab_axis}
    if dtype is None:
      known = jnp.dtype(value.dtype).name in TABLE_DTYPES
      dtype = value.dtype if known else jnp.float32
    if activation_dtype is None:
      activation_dtype = dtype
    config = _make_lookup_config(
      param.label,
      named[vocab_axis],
      emb,
      mesh,
      optimizer,
      initializer=None,
      vocabulary_axis=vocab_axis,
      num_sc_per_device=num_sc_per_device,
      sharding_axis=sharding_axis,
      exchange=exchange,
      axis_name_to_mesh_name=axis_name_to_mesh_name,
      host_input=host_input,
      max_ids_per_partition=max_ids_per_partition,
      dtypes=(dtype, activation_dtype),
      gather_max_samples=gather_max_samples,
    )
    logical = value.unwrap(vocab_axis, *emb).reshape(named[vocab_axis], -1)
    tables, slots = embed_lib.make_variables(config, jax.random.key(0))
    stack = config.plan.stacks[0]
    tables[stack.name].value = embed_lib.named_table(
      config, _physical(logical.astype(stack.dtype), config)
    )
    return cls(tables=tables, slots=slots, config=config)

  def preprocess(  # pytype: disable=signature-mismatch
    self, token_ids: Any, *, allow_id_dropping: bool = False
  ) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Host-preprocesses a batch of token ids into the call's buffers.

    For large batches with FDO limits (`max_ids_per_partition`), and for
    training a hashed table: pass the result as the side input named
    `host_input` with ids of the same shape, e.g.
    `model(tokens, sparsecore_inputs=lookup.preprocess(tokens)[0])`.

    Args:
      token_ids: Integer ids of any shape (a `NamedArray` or an array). A
        hashed table (`ids="hashed"`) takes raw ids: int64 or uint64 of any
        value, or strings / bytes (`pzsc.string_ids`).
      allow_id_dropping: Drop ids over the limits instead of raising.

    Returns:
      `(inputs, stats)`, as `SparseCoreEmbed.preprocess`; a hashed table's
      buffers carry its raw ids (`hashed_ids`), resolved by the trainer
      (inserting) or by the call (looking up).

    Raises:
      ValueError: On ids out of range (a range table) or of another type.
    """
    config = self.config
    if isinstance(token_ids, pz.nx.NamedArray | pz.nx.NamedArrayView):
      token_ids = token_ids.unwrap(*token_ids.named_shape)
    ids = np.asarray(token_ids).reshape(-1)
    _check_ids(config, ids)
    samples = config.padded_samples(ids.size)
    splits = np.concatenate(
      [np.arange(ids.size + 1), np.full(samples - ids.size, ids.size)]
    ).astype(np.int64)
    if not config.is_hashed:
      ids = ids.astype(np.int32)
    return embed_lib.SparseCoreEmbed.preprocess(
      self._for_samples(samples),
      (ids, splits),
      allow_id_dropping=allow_id_dropping,
    )

  def __call__(self, token_index: Any, /, **side_inputs: Any) -> Any:
    """Embeddings of `token_index`: its named axes plus the embedding axes.

    A hashed table (`ids="hashed"`) reads each id as a signed 64-bit id
    (int32 ids sign-extended; int64 and uint64 ones with x64 on) and looks
    it up without inserting: an id the table does not hold reads zeros and
    is counted (its map's `unseen` counter). With host buffers (the side
    input), the buffers' raw ids are looked up and only `token_index`'s
    shape (axis names and sizes) counts: its values, which need not hold
    the raw ids (without x64 a `NamedArray` holds no int64 id), are not
    read.

    Args:
      token_index: A `NamedArray` of integer ids (named axes only, disjoint
        from the embedding axes).
      **side_inputs: Penzai side inputs; the one named `host_input`, if
        given a `PreprocessedInput` from `preprocess`, is used instead of
        building the buffers on the device.

    Returns:
      A `NamedArray` with the ids' axes and the embedding axes, of the
      layer's `activation_dtype`.

    Raises:
      ValueError: On non-integer or out-of-range (concrete) ids, positional
        axes, or host buffers of another shape; for a hashed table, when
        training (a trainer's or `pzsc.value_and_grad`'s call) on ids
        without host buffers, or on host buffers not resolved yet.
    """
    config = self.config
    place_tables(self)
    names, ids = _unwrap_ids(config, token_index)
    flat = ids.reshape(-1)
    _check_ids(config, ids)
    samples = config.padded_samples(flat.size)
    plan = config.plan_for(flat.size)
    host = side_inputs.get(config.host_input)
    if (
      not isinstance(host, PreprocessedInput)
      and self.activation_probe is None
      and config.gathers(flat.size)
    ):
      # A few ids, not training: no buffers, no exchange (`gathers`).
      acts = routing.gather_lookup(
        plan,
        config.topology,
        table_arrays(self)[plan.stacks[0].name],
        flat,
        config.vocab_size,
      )
      return self._named(acts, names, ids.shape)
    if isinstance(host, PreprocessedInput):
      inputs = self._host_inputs(host, samples)
    elif config.is_hashed:
      inputs = self._hashed_inputs(flat, samples)
    else:
      # A pad, not `.at[:n].set`: jaxlib 0.11's SPMD partitioner aborts
      # on that scatter when the ids are sharded (Penzai's sampling loop).
      padded = jnp.pad(
        flat.astype(jnp.int32),
        (0, samples - flat.size),
        constant_values=build.NO_ID,
      )
      inputs, dropped = build.build_inputs(
        plan, config.topology, {config.feature: padded}
      )
      if config.max_ids_per_partition is not None:
        _report_dropped(config, dropped[plan.stacks[0].name])
    acts = routing.lookup(plan, config.topology, table_arrays(self), inputs)
    if self.activation_probe is not None:
      acts = self.activation_probe.observe(acts, inputs)
    return self._named(acts[config.feature], names, ids.shape)

  def _named(self, acts: jax.Array, names: tuple[str, ...], shape: tuple):
    """Flat `[>= samples, >= D]` activations as the call's `NamedArray`."""
    config = self.config
    sizes = [size for _, size in config.embedding_axes]
    value = acts[: math.prod(shape), : config.dim].reshape(*shape, *sizes)
    value = value.astype(
      config.plan.feature_specs[0].table_spec.activation_dtype
    )
    return pz.nx.wrap(value).tag(*names, *(n for n, _ in config.embedding_axes))

  def _for_samples(self, samples: int) -> SparseCoreLookup:
    """The layer with the plain config of `samples` samples (its variables
    shared): what `SparseCoreEmbed`'s methods read buffers of that batch
    with."""
    return dataclasses.replace(self, config=_host_config(self.config, samples))

  def _host_inputs(
    self, inputs: PreprocessedInput, samples: int
  ) -> PreprocessedInput:
    """Host buffers checked for `samples` samples; a hashed table's raw ids
    resolved for inference."""
    host = self._for_samples(samples)
    embed_lib.check_inputs(host.config, inputs)
    if inputs.hashed_ids is None:
      return inputs
    if self.activation_probe is not None:
      raise ValueError(
        f"SparseCoreLookup {self.config.label!r}: training on buffers whose "
        "raw ids are not resolved (they would not be inserted); "
        "SparseCoreTrainer resolves them, a hand-written step calls inputs "
        "= lookup.resolve_ids(inputs, step=step) first"
      )
    return self.resolve_ids(inputs, train=False)

  def _hashed_inputs(self, flat: jax.Array, samples: int) -> PreprocessedInput:
    """Buffers of raw ids built on the device, resolved for inference."""
    config = self.config
    if self.activation_probe is not None:
      raise ValueError(
        f"SparseCoreLookup {config.label!r} has hashed ids: training must "
        "insert new ids, which buffers built on the device from the "
        "NamedArray cannot do. Pass host buffers: model(tokens, "
        f"{config.host_input}=lookup.preprocess(raw_ids)[0])"
      )
    lo, hi = hashed_build.id_words(flat)
    pad = (0, samples - flat.size)
    raw = hashed_build.RawIds(
      jnp.pad(lo, pad),
      jnp.pad(hi, pad),
      jnp.arange(samples, dtype=jnp.int32) < flat.size,
    )
    plan = config.plan_for(flat.size)
    stack = plan.stacks[0]
    inputs, dropped, no_room = hashed_build.build_inputs(
      plan, config.topology, {config.feature: raw}
    )
    if config.max_ids_per_partition is not None:
      _report_dropped(config, dropped[stack.name])
    _report(
      no_room[stack.name],
      f"SparseCoreLookup {config.label!r}: {{n}} ids found no row: one "
      "SparseCore's samples named more distinct ids of one shard than its "
      f"{stack.rows_per_shard} rows; they were looked up as zeros. Raise "
      "vocab_size (the capacity) or split the batch",
    )
    return self.resolve_ids(inputs, train=False)

  def config_of(self, inputs: Any) -> embed_lib.EmbedConfig:
    """The config of the batch these buffers were preprocessed for, found
    from their shapes (`_samples_of`); the layer's own if no batch fits.
    `resolve_ids` (which `SparseCoreTrainer` calls before each step) and
    the trainer's checks read buffers of any batch shape with it."""
    samples = _samples_of(self.config, inputs)
    if samples is None:
      return self.config
    return _host_config(self.config, samples)

  def validate(self, inputs: PreprocessedInput) -> None:
    """`SparseCoreEmbed.validate` of buffers from `preprocess`, of any batch
    shape.

    The buffers' shapes give their batch's plan (`config_of`) but, when
    `max_ids_per_partition` caps a range table's windows, not its samples
    per SparseCore: sample ids are then checked against the most the
    buffers name.

    Raises:
      ValueError: As `SparseCoreEmbed.validate`.
    """
    config = self.config_of(inputs)
    if (
      self.config.max_ids_per_partition is not None
      and not self.config.is_hashed
      and config is not self.config
      and inputs.sample_order is None
    ):
      stack = config.plan.stacks[0]
      named = _largest_sample_id(inputs.lhs_sample_ids[stack.name]) + 1
      wider = _host_config(self.config, self.config.topology.num_shards * named)
      if named > stack.samples_per_sc and _shaped_for(wider, inputs):
        config = wider
    embed_lib.SparseCoreEmbed.validate(
      dataclasses.replace(self, config=config), inputs
    )

  def fixed_probes(self) -> None:
    """None: the activations' shape is the call's."""
    return None

  def plan_of(self, activations: Mapping[str, Any]) -> plan_lib.Plan:
    """The plan of the call that gave these (flat, padded) activations."""
    return self.config.plan_for(activations[self.config.feature].shape[0])


def _report_dropped(config: LookupConfig, dropped: jax.Array) -> None:
  """Refuses (eagerly) or warns (under jit) when ids were over the limit."""
  _report(
    dropped,
    f"SparseCoreLookup {config.label!r}: {{n}} ids over "
    f"max_ids_per_partition={config.max_ids_per_partition} were dropped "
    "(looked up as zeros); raise the limit or leave it None",
  )


def _report(count: jax.Array, message: str) -> None:
  """Raises `ValueError(message.format(n=count))` if `count` is concrete
  and not 0; under jit, warns so when the call runs."""
  if not isinstance(count, jax.core.Tracer):
    if int(count):
      raise ValueError(message.format(n=int(count)))
    return

  def warn(n):
    if int(n):
      warnings.warn(message.format(n=int(n)), stacklevel=1)

  jax.debug.callback(warn, count)


def _shaped_for(config: embed_lib.EmbedConfig, inputs: Any) -> bool:
  """Whether `inputs` have the buffer shapes of `config`'s plan."""
  try:
    embed_lib.check_inputs(config, inputs)
  except ValueError:
    return False
  return True


def _samples_of(config: LookupConfig, inputs: Any) -> int | None:
  """The padded sample count of a batch whose `preprocess` gives buffers of
  `inputs`' shapes, or None if none does.

  A plan of `B` samples per SparseCore has `C_dev = r8(limit) * S * N`
  COO entries per device (`limit = min(B, max_ids_per_partition)`); a
  hashed table's, `N * S * r8(B) * 4` words of `hashed_ids` (its distinct
  ids are not capped); on one device, a sample order of `S * B + 1 + 2 *
  C_dev` values. The largest `B` the shapes admit is taken (`r8(B)`, or
  `r8(limit)` for a range table): it reads every sample of the buffers.
  Example: 8 shards, 16 samples: `B = 2`, read back as `B = 8` (64
  samples), whose plan gives the same shapes.
  """
  if not isinstance(inputs, PreprocessedInput):
    return None
  topo = config.topology
  g, n = topo.num_devices, topo.num_shards
  s = topo.num_sc_per_device
  stack = config.plan.stacks[0].name
  coo = getattr(inputs.lhs_embedding_ids.get(stack), "shape", None)
  keys = getattr((inputs.hashed_ids or {}).get(stack), "shape", None)
  order = (inputs.sample_order or {}).get(stack)
  if not coo:
    return None
  per_device = coo[0] // g
  per_sc = per_device // (s * n)
  if keys:
    per_sc = keys[0] // (g * n * s * hashed.KEY_WORDS)
  if order is not None:
    per_sc = (order.shape[0] // g - 1 - 2 * per_device) // s
  if per_sc <= 0 or not _shaped_for(_host_config(config, per_sc * n), inputs):
    return None
  return per_sc * n


def _largest_sample_id(sample_ids: jax.Array) -> int:
  """The largest sample id of this process's shards of a buffer (-1 if
  none, or traced)."""
  if isinstance(sample_ids, jax.core.Tracer):
    return -1  # `validate` refuses traced buffers.
  blocks = (
    [shard.data for shard in sample_ids.addressable_shards]
    if isinstance(sample_ids, jax.Array)
    else [sample_ids]
  )
  most = -1
  for block in blocks:
    ids = np.asarray(block)
    ids = ids[ids != buffer_format.PAD_ID]
    if ids.size:
      most = max(most, int(ids.max()))
  return most


def _host_config(config: LookupConfig, samples: int) -> embed_lib.EmbedConfig:
  """A plain `EmbedConfig` with the plan of `samples` samples."""
  return embed_lib.EmbedConfig(
    name=config.name,
    plan=config.plan_for(samples),
    topology=config.topology,
    feature_axes=config.feature_axes,
    embedding_axis=config.embedding_axis,
    axis_mapping=config.axis_mapping,
  )


def _unwrap_ids(config: LookupConfig, token_index: Any):
  if not isinstance(token_index, pz.nx.NamedArray | pz.nx.NamedArrayView):
    raise ValueError(
      f"SparseCoreLookup {config.label!r} takes a NamedArray of token ids "
      f"(as pz.nn.EmbeddingLookup), got {type(token_index).__name__}"
    )
  if token_index.positional_shape:
    raise ValueError(
      f"SparseCoreLookup {config.label!r}: token ids with positional shape "
      f"{token_index.positional_shape}; tag every axis with a name"
    )
  names = tuple(token_index.named_shape)
  clash = set(names) & {n for n, _ in config.embedding_axes}
  if clash:
    raise ValueError(
      f"SparseCoreLookup {config.label!r}: token ids have axes "
      f"{sorted(clash)} that are also embedding axes"
    )
  ids = token_index.unwrap(*names)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(
      f"SparseCoreLookup {config.label!r}: token ids must be integers, got "
      f"dtype {ids.dtype}"
    )
  return names, ids
