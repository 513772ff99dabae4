"""The plan: every static fact about prepared feature specs on a topology.

`build(feature_specs, global_device_count, num_sc_per_device)` validates
prepared specs once and returns a frozen, hashable `Plan`: the topology
counts, the specs in pytree-leaf order, and per stack (in first-appearance
order) its member tables in row order, its features in sample order with
their offsets, and the sizes of its shards, buffers and routing windows.
Preprocessing, the shard_map routing, the layer, the figures, FDO and
checkpoints read these facts from the plan instead of re-deriving them from
the specs; the plan is `jit`-static.

Example: `G = 2` devices, `S = 1`, so `N = 2`; table `words` (vocab 100,
dim 16) prepared alone, feature `w` of 64 samples, `max_ids_per_partition`
32. Its stack `words` has `rows_per_shard = r(100, 16) / 2 = 56`,
`samples_per_sc = 32`, `row_pointers_per_sc = max(2, 8) = 8`,
`coo_per_device = r8(32) * 1 * 2 = 64` (one segment of 64 entries) and a
routing window of `S * r8(32) = 32` entries; feature `w` starts at sample 0
of each SparseCore's 32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from pz_sparsecore.core import buffer_format, hashed, layout
from pz_sparsecore.core.specs import (
  FeatureIdTransformation,
  FeatureSpec,
  OptimizerSpec,
  StackedTableSpec,
  TableSpec,
  not_a_feature_spec,
)

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class FeaturePlan:
  """Where one feature's ids and samples go in its stack.

  Attributes:
    spec: The prepared `FeatureSpec`.
    sample_offset: First SparseCore-local sample (`row_offset / N`).
    samples_per_sc: `n_f`, the feature's samples per SparseCore.
    row_offset_in_shard: First row of the feature's table in every shard.
    shard_rotation: The table's rotation (`col_shift % N`).
  """

  spec: FeatureSpec
  sample_offset: int
  samples_per_sc: int
  row_offset_in_shard: int
  shard_rotation: int

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def dim(self) -> int:
    """The feature's output width."""
    return self.spec.output_shape[-1]

  @property
  def output_shape(self) -> tuple[int, ...]:
    return tuple(self.spec.output_shape)

  @property
  def vocabulary_size(self) -> int:
    """The ids the preprocessor admits: the table's, or for a hashed
    table every place of its stack's rows (`host.hashed_ids`)."""
    table = self.spec.table_spec
    if table.is_hashed:
      return table.stacked_table_spec.stack_vocab_size
    return table.vocabulary_size


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """Static shapes of one stack on a topology.

  Attributes:
    spec: The stack's `StackedTableSpec` (limits, optimizer, combiner).
    tables: Member tables in row order inside the shards.
    features: Features in sample order (`row_offset`).
    rows_per_shard: `V_shard`, rows of one shard.
    samples_per_sc: Samples of one SparseCore (all features).
    row_pointers_per_sc: Row pointers of one SparseCore segment.
    coo_per_device: COO entries per device (`C_dev`).
    coo_per_sc: COO entries of one SparseCore segment (`C_dev / S`).
    window: Entries one source SparseCore can send one device,
      `S * r8(max_ids_per_partition)` (the activation exchange).
    unique_window: Distinct rows one source SparseCore can ask of one
      device, `S * r8(max_unique_ids_per_partition)` (the row exchange).
  """

  spec: StackedTableSpec
  tables: tuple[TableSpec, ...]
  features: tuple[FeaturePlan, ...]
  rows_per_shard: int
  samples_per_sc: int
  row_pointers_per_sc: int
  coo_per_device: int
  coo_per_sc: int
  window: int
  unique_window: int

  @property
  def name(self) -> str:
    return self.spec.stack_name

  @property
  def dim(self) -> int:
    return self.spec.stack_embedding_dim

  @property
  def optimizer(self) -> OptimizerSpec:
    return self.spec.optimizer

  @property
  def dtype(self) -> Any:
    """How the stack's rows are stored (`specs.TABLE_DTYPES`)."""
    return self.spec.dtype

  @property
  def logical_dim(self) -> int:
    """The members' own width (a row-wise optimizer's mean divides by it;
    `_check_stack` makes it one value for such a stack)."""
    return self.tables[0].embedding_dim

  @property
  def is_hashed(self) -> bool:
    """Whether the stack's tables take raw ids (a hashed stack holds hashed
    tables only, all with one eviction policy)."""
    return self.tables[0].is_hashed

  @property
  def eviction(self) -> Any:
    """A hashed stack's `hashed.Eviction` (None for other stacks)."""
    return self.tables[0].eviction

  def regions(self, num_shards: int) -> tuple[tuple[int, int], ...]:
    """Per member table, its rows in every shard: `(first row, rows)` (a
    hashed table's ids live in its own rows of each shard)."""
    return tuple(
      (
        t.setting_in_stack.row_offset_in_shard,
        t.setting_in_stack.padded_vocab_size // num_shards,
      )
      for t in self.tables
    )

  @property
  def quantization(self) -> tuple[float, float, int] | None:
    """`(min_value, max_value, num_buckets)` lookups read through, or None."""
    config = self.spec.quantization_config
    return None if config is None else config.as_tuple()


@dataclasses.dataclass(frozen=True)
class Plan:
  """Prepared feature specs laid out on `num_devices x num_sc_per_device`.

  Attributes:
    feature_specs: The prepared specs, in pytree-leaf order.
    treedef: The structure of the user's feature spec tree.
    num_devices: G, devices the tables are sharded over.
    num_sc_per_device: S, (virtual) SparseCores per device.
    stacks: Per stack, in first-appearance order.
    for_tables: Whether the plan sizes tables (see `build`). Preprocessing
      with a plan that does not takes each feature's samples from the
      input's rows, as upstream does, instead of from its `output_shape`.
    minibatches: The minibatches its COO buffers are sized for.
  """

  feature_specs: tuple[FeatureSpec, ...]
  treedef: Any
  num_devices: int
  num_sc_per_device: int
  stacks: tuple[StackPlan, ...]
  for_tables: bool = True
  minibatches: int = 1

  def __hash__(self) -> int:
    # jit hashes its static arguments on every call: hash the specs once.
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    return hash(
      (
        self.feature_specs,
        self.treedef,
        self.num_devices,
        self.num_sc_per_device,
      )
    )

  @property
  def num_shards(self) -> int:
    """N = G x S."""
    return self.num_devices * self.num_sc_per_device

  @property
  def specs_tree(self) -> Any:
    """The prepared feature specs in the user's structure."""
    return jax.tree.unflatten(self.treedef, self.feature_specs)

  @functools.cached_property
  def stack_by_name(self) -> dict[str, StackPlan]:
    return {stack.name: stack for stack in self.stacks}

  @functools.cached_property
  def tables(self) -> dict[str, TableSpec]:
    """Every table by name, stack by stack in row order."""
    return {t.name: t for stack in self.stacks for t in stack.tables}

  @functools.cached_property
  def stack_of_table(self) -> dict[str, StackPlan]:
    return {t.name: stack for stack in self.stacks for t in stack.tables}

  @functools.cached_property
  def features(self) -> dict[str, FeaturePlan]:
    """Every feature by name, in pytree-leaf order."""
    plans = {f.name: f for stack in self.stacks for f in stack.features}
    return {spec.name: plans[spec.name] for spec in self.feature_specs}

  def stack(self, name: str) -> StackPlan:
    """The plan of stack `name`.

    Raises:
      ValueError: If there is no such stack.
    """
    if name not in self.stack_by_name:
      raise ValueError(
        f"unknown stack {name!r}; the stacks are {list(self.stack_by_name)}"
      )
    return self.stack_by_name[name]


def _flatten_specs(feature_specs: Any) -> tuple[list[FeatureSpec], Any]:
  """The prepared `FeatureSpec` leaves and the tree's structure."""
  leaves, treedef = jax.tree.flatten(
    feature_specs, is_leaf=lambda x: isinstance(x, FeatureSpec)
  )
  if not leaves:
    raise ValueError("feature_specs holds no FeatureSpec")
  for leaf in leaves:
    if not isinstance(leaf, FeatureSpec):
      raise not_a_feature_spec(leaf)
    if leaf.table_spec.stacked_table_spec is None:
      raise ValueError(
        f"feature {leaf.name!r} is not prepared (its table "
        f"{leaf.table_spec.name!r} is in no stack); call "
        "prepare_feature_specs_for_training first"
      )
  return leaves, treedef


def id_transformation(spec: FeatureSpec) -> FeatureIdTransformation:
  """The feature's id transformation; (0, 0, 0) where it has none.

  A feature of an already stacked table without a transformation reads the
  stack from its first row and sample, as upstream's does.
  """
  return spec.id_transformation or FeatureIdTransformation()


def _check_stack(
  features: list[FeatureSpec], stacked: StackedTableSpec, g: int, s: int
) -> None:
  """Checks that a stack's table was laid out for `g x s` shards."""
  name, n = stacked.stack_name, g * s
  if stacked.stack_vocab_size % n:
    raise ValueError(
      f"stack {name!r}: stack_vocab_size {stacked.stack_vocab_size} does not"
      f" split over {n} shards; were the specs prepared for {g} devices x "
      f"{s} SparseCores?"
    )
  if stacked.stack_vocab_size // n > _INT32_MAX:
    raise ValueError(f"stack {name!r}: too many rows per shard")
  for spec in features:
    padded = spec.table_spec.setting_in_stack.padded_vocab_size
    if padded % (buffer_format.ALIGNMENT * n):
      raise ValueError(
        f"feature {spec.name!r}: table {spec.table_spec.name!r} was prepared "
        f"for another topology: its padded vocabulary {padded} does not "
        f"split over {n} shards (of a multiple of {buffer_format.ALIGNMENT} "
        "rows)"
      )
    # The layer reads a table's rows where its setting says; the kernels
    # where its id transformation says (`_feature_plan`).
    setting = spec.table_spec.setting_in_stack
    transform = id_transformation(spec)
    start, rotation = transform.col_offset // n, transform.col_shift % n
    if (setting.row_offset_in_shard, setting.shard_rotation) != (
      start,
      rotation,
    ):
      raise ValueError(
        f"feature {spec.name!r}: table {spec.table_spec.name!r} was prepared "
        f"for another topology: it starts at row "
        f"{setting.row_offset_in_shard} of each shard with rotation "
        f"{setting.shard_rotation}, which on {n} shards are row {start} and "
        f"rotation {rotation}; prepare the specs for {g} devices x {s} "
        "SparseCores"
      )
  layout.check_logical_dims(
    name, stacked.optimizer, [f.table_spec for f in features]
  )
  samples = sum(f.sample_count for f in features)
  if stacked.total_sample_count != samples:
    raise ValueError(
      f"stack {name!r}: total_sample_count {stacked.total_sample_count} is "
      f"not the sum {samples} of its features' sample counts"
    )


def _check_rows_fit(
  features: list[FeatureSpec], stacked: StackedTableSpec, n: int
) -> None:
  """Checks that every table's rows land inside its stack on `n` shards."""
  rows_per_shard = stacked.stack_vocab_size // n
  for spec in features:
    vocab = spec.table_spec.vocabulary_size
    offset = id_transformation(spec).col_offset // n
    if (vocab - 1) // n + offset >= rows_per_shard:
      raise ValueError(
        f"feature {spec.name!r}: table {spec.table_spec.name!r} "
        f"(vocabulary {vocab}, from row {offset} of each shard) does not "
        f"fit in stack {stacked.stack_name!r} of {stacked.stack_vocab_size} "
        f"rows on {n} shards"
      )


def _feature_plan(spec: FeatureSpec, n: int) -> FeaturePlan:
  transform = id_transformation(spec)
  if spec.table_spec.is_hashed:
    # Its ids reach the preprocessor as places in their owner's partition
    # of the whole stack (`host.hashed_ids`): no offset, no rotation.
    return FeaturePlan(
      spec, transform.row_offset // n, spec.sample_count // n, 0, 0
    )
  return FeaturePlan(
    spec=spec,
    sample_offset=transform.row_offset // n,
    samples_per_sc=spec.sample_count // n,
    row_offset_in_shard=transform.col_offset // n,
    shard_rotation=transform.col_shift % n,
  )


def _stack_plan(
  features: list[FeatureSpec],
  g: int,
  s: int,
  for_tables: bool,
  minibatches: int,
) -> StackPlan:
  stacked = features[0].table_spec.stacked_table_spec
  n = g * s
  if for_tables:
    _check_stack(features, stacked, g, s)
  else:
    _check_rows_fit(features, stacked, n)
  samples = sum(f.sample_count for f in features)
  coo = buffer_format.coo_buffer_size_per_device(
    stacked.stack_name,
    stacked.max_ids_per_partition,
    stacked.suggested_coo_buffer_size_per_device,
    g,
    s,
    minibatches,
  )
  features = sorted(features, key=lambda f: id_transformation(f).row_offset)
  return StackPlan(
    spec=stacked,
    tables=tuple(layout.get_table_stacks(features)[stacked.stack_name]),
    features=tuple(_feature_plan(f, n) for f in features),
    rows_per_shard=stacked.stack_vocab_size // n,
    samples_per_sc=samples // n,
    row_pointers_per_sc=buffer_format.row_pointers_per_sc(n),
    coo_per_device=coo,
    coo_per_sc=coo // s,
    window=buffer_format.routing_window(s, stacked.max_ids_per_partition),
    unique_window=buffer_format.routing_window(
      s, stacked.max_unique_ids_per_partition
    ),
  )


def _build(
  leaves: tuple[FeatureSpec, ...],
  treedef: Any,
  g: int,
  s: int,
  for_tables: bool = True,
  minibatches: int = 1,
) -> Plan:
  by_stack: dict[str, list[FeatureSpec]] = {}
  for spec in leaves:
    stack = spec.table_spec.stacked_table_spec.stack_name
    by_stack.setdefault(stack, []).append(spec)
  return Plan(
    feature_specs=leaves,
    treedef=treedef,
    num_devices=g,
    num_sc_per_device=s,
    stacks=tuple(
      _stack_plan(group, g, s, for_tables, minibatches)
      for group in by_stack.values()
    ),
    for_tables=for_tables,
    minibatches=minibatches,
  )


def build(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int,
  *,
  for_tables: bool = True,
  minibatches: int = 1,
) -> Plan:
  """The plan of prepared `feature_specs` on `G x S` SparseCores.

  Plans are cached: the same specs on the same topology give the same plan.

  Args:
    feature_specs: A pytree of `FeatureSpec`s prepared with
      `layout.prepare_feature_specs_for_training`.
    global_device_count: G, devices the tables are sharded over.
    num_sc_per_device: S, (virtual) SparseCores per device.
    for_tables: Whether the plan sizes tables (the layer, the kernels): then
      every stack's vocabulary must split over the shards as prepared for
      this topology and `total_sample_count` must add up. Preprocessing
      needs neither (as upstream's), and passes False.
    minibatches: Size COO buffers for this many minibatches
      (`buffer_format.MAX_MINIBATCHES` with minibatching, else 1).

  Returns:
    The frozen, hashable plan.

  Raises:
    ValueError: On a bad topology, specs that are not prepared (or, with
      `for_tables`, were prepared for another topology), or a suggested
      buffer size above the theoretical maximum.
  """
  buffer_format.num_shards(global_device_count, num_sc_per_device)
  g, s = int(global_device_count), int(num_sc_per_device)
  leaves, treedef = _flatten_specs(feature_specs)
  try:
    return _cached_build(tuple(leaves), treedef, g, s, for_tables, minibatches)
  except TypeError:  # A spec holds something unhashable: plan afresh.
    return _build(tuple(leaves), treedef, g, s, for_tables, minibatches)


_cached_build = functools.lru_cache(maxsize=64)(_build)


def hashed_places(plan: Plan, stack: StackPlan) -> int:
  """Places of a hashed stack's ids (`host.hashed_ids`) per local
  SparseCore and partition: `r8(max_unique_ids_per_partition)`; for
  minibatched buffers, those of every minibatch (`plan.minibatches` times
  as many), never more than a SparseCore segment's entries."""
  places = stack.unique_window // plan.num_sc_per_device
  if plan.minibatches > 1:
    places = min(
      places * plan.minibatches, buffer_format.round_up(stack.coo_per_sc)
    )
  return places


def hashed_ids_per_device(plan: Plan, stack: StackPlan) -> int:
  """int32 words per device of a hashed stack's ids sent to their owners:
  per local SparseCore, per partition, `hashed_places` ids of
  `hashed.KEY_WORDS` words (`host.hashed_ids` writes them)."""
  return (
    plan.num_shards
    * plan.num_sc_per_device
    * hashed_places(plan, stack)
    * hashed.KEY_WORDS
  )


def with_minibatch_buffers(plan: Plan) -> Plan:
  """`plan` with its COO buffers sized for minibatched preprocessing: up to
  `buffer_format.MAX_MINIBATCHES` minibatches in one device's buffers (see
  `single_minibatch` for the format of one of them)."""
  if plan.minibatches == buffer_format.MAX_MINIBATCHES:
    return plan
  return build(
    plan.specs_tree,
    plan.num_devices,
    plan.num_sc_per_device,
    for_tables=plan.for_tables,
    minibatches=buffer_format.MAX_MINIBATCHES,
  )


@functools.lru_cache(maxsize=64)
def single_minibatch(plan: Plan) -> Plan:
  """The plan of ONE minibatch of `plan`'s minibatched buffers: every
  stack's SparseCore segment is `r8(max_ids) * N`, so one minibatch's
  segment always fits (each partition keeps the limit). The device side
  looks up and updates minibatch after minibatch in this format (the
  opposite direction of `with_minibatch_buffers`, which sizes the whole
  buffers for up to `MAX_MINIBATCHES` minibatches)."""
  stacks = []
  for stack in plan.stacks:
    per_sc = (
      buffer_format.compute_theoretical_max_coo_buffer_size(
        stack.spec.max_ids_per_partition,
        plan.num_devices,
        plan.num_sc_per_device,
      )
      // plan.num_sc_per_device
    )
    stacks.append(
      dataclasses.replace(
        stack,
        coo_per_sc=per_sc,
        coo_per_device=per_sc * plan.num_sc_per_device,
      )
    )
  return dataclasses.replace(plan, stacks=tuple(stacks), minibatches=1)
