"""Buffers of raw ids of hashed tables, built on the device.

The device half of what `host.hashed_ids` and the preprocessor do for a
hashed table read by one feature with one id per sample (the table alone
in its stack, as `device.build` takes): inside the traced call, each id
(two uint32 words, `id_words`) is replaced by its *place*, and the places
are written into the usual buffers by `device.build`; the ids' key words
go to `PreprocessedInput.hashed_ids` in the host's format, for
`device.hashed.resolve` to turn the places into rows.

Per SparseCore segment (its `M` consecutive samples of the batch), with
`N` shards and the stack's `rows` per shard:

1. each id's owner `p` and home slot come from `core.hashed`
   (`owners_of_words`, `homes_of_words`: the host's `owners` and `homes`);
2. the distinct `(p, id)` pairs of the segment are ranked within each `p`
   in ascending order of the id as an unsigned word (the host ranks them
   in order of first appearance: the ranks differ, the rows they resolve
   to do not); a pair's rank `r` is its place, and its samples read the id
   `r * N + p` of the stack, partition `p`, local row `r`;
3. the key words `(low, high, home, table 0)` of the pair go to
   `hashed_ids[segment, p, r]` (`[0, 0, -1, 0]` where no pair is);
4. an id whose place is not below `rows` (one segment sending one shard
   more distinct ids than it has rows; the host refuses such a batch) is
   no id: it reads a zero vector, and the ids so skipped are counted.

Example: `N = 2`, 8 rows per shard, one segment of `M = 4` samples with
ids `[11, -4, 11, 7]`, owners `11 -> 1, -4 -> 1, 7 -> 0`: partition 1 has
the distinct ids `11 < -4` (as unsigned words), places 0 and 1; partition
0 has `7` at place 0. The samples read `[0 * 2 + 1, 1 * 2 + 1, 1, 0 * 2 +
0] = [1, 3, 1, 0]`; `hashed_ids[0, 1]` holds `(11, 0, home, 0)` at place 0
and `(-4, -1, home, 0)` at place 1, `hashed_ids[0, 0]` `(7, 0, home, 0)`
at place 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import hashed
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.plan import Plan, StackPlan
from pz_sparsecore.core.preprocessed import PreprocessedInput
from pz_sparsecore.device import build
from pz_sparsecore.device.topology import Topology


class RawIds(NamedTuple):
  """One feature's raw ids, one per sample, in global sample order.

  Attributes:
    lo: uint32 `[samples]`, each id's low word.
    hi: uint32 `[samples]`, each id's high word.
    valid: bool `[samples]`, whether the sample has an id (False for the
      padding samples).
  """

  lo: jax.Array
  hi: jax.Array
  valid: jax.Array


def id_words(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The low and high uint32 words of integer ids read as signed 64-bit
  ids: a signed id sign-extended (int32 -1 is the id -1), an unsigned one
  zero-extended, a 64-bit one (with x64 on) as its two words, as the host
  reads an int64 or uint64 id.

  Args:
    ids: An integer array of any shape.

  Returns:
    `(lo, hi)`, uint32 arrays of `ids`' shape.
  """
  ids = jnp.asarray(ids)
  if ids.dtype.itemsize == 8:
    words = jax.lax.bitcast_convert_type(ids, jnp.uint64)
    return (
      (words & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32),
      (words >> jnp.uint64(32)).astype(jnp.uint32),
    )
  if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
    return ids.astype(jnp.uint32), jnp.zeros(ids.shape, jnp.uint32)
  wide = ids.astype(jnp.int32)
  sign = jnp.where(wide < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
  return jax.lax.bitcast_convert_type(wide, jnp.uint32), sign


def _as_int32(words: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def _segment(
  stack: StackPlan, n: int, cap: int, ids: RawIds
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One segment's `(place ids [M], key words [N * cap * 4], ids without
  room)` (steps 1 to 4 of the module docstring; `cap`:
  `plan.hashed_places`)."""
  (_, rows), *_ = stack.regions(n)
  lo, hi, valid = ids
  m = lo.shape[0]
  owner = jnp.where(valid, hashed.owners_of_words(lo, hi, n), n)
  home = hashed.homes_of_words(lo, hi, rows)
  index = jnp.arange(m, dtype=jnp.int32)
  # Absent ids (owner N) sort last.
  owner, hi, lo, order = jax.lax.sort((owner, hi, lo, index), num_keys=3)
  present = owner < n
  differs = (
    (owner[1:] != owner[:-1]) | (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
  )
  first = present & jnp.concatenate([jnp.ones((1,), bool), differs])
  distinct = jnp.concatenate(
    [jnp.zeros((1,), jnp.int32), jnp.cumsum(first, dtype=jnp.int32)]
  )
  # A pair's place: the distinct pairs before it, less those of the
  # partitions before its own.
  part = jnp.minimum(owner, n - 1)
  starts = jnp.searchsorted(owner, jnp.arange(n, dtype=jnp.int32))
  place = distinct[:-1] + first.astype(jnp.int32) - 1 - distinct[starts][part]
  room = present & (place < rows)
  sorted_ids = jnp.where(room, place * n + part, build.NO_ID)
  place_ids = jnp.zeros((m,), jnp.int32).at[order].set(sorted_ids)
  target = jnp.where(first & room & (place < cap), part * cap + place, n * cap)
  words = jnp.stack(
    [_as_int32(lo), _as_int32(hi), home[order], jnp.zeros_like(index)], axis=1
  )
  keys = jnp.zeros((n * cap, hashed.KEY_WORDS), jnp.int32).at[:, 2].set(-1)
  keys = keys.at[target].set(words, mode="drop")
  no_room = jnp.sum(first & ~room, dtype=jnp.int32)
  return place_ids, keys.reshape(-1), no_room


@functools.lru_cache(maxsize=64)
def _places_plan(plan: Plan) -> Plan:
  """`plan` as `device.build` reads places with: a place id `r * N + p`
  may name any row of the stack (`FeaturePlan.vocabulary_size`), not only
  ids below the table's capacity."""
  stacks = []
  for stack in plan.stacks:
    tables = tuple(
      t.replace(vocabulary_size=stack.spec.stack_vocab_size)
      for t in stack.tables
    )
    stacks.append(dataclasses.replace(stack, tables=tables))
  return dataclasses.replace(plan, stacks=tuple(stacks))


def check_buildable(plan: Plan) -> None:
  """Raises unless every stack of `plan` is one hashed table read by one
  feature (`build.check_buildable`).

  Raises:
    ValueError: Naming the stack.
  """
  build.check_buildable(plan)
  for stack in plan.stacks:
    if not stack.is_hashed:
      raise ValueError(
        f"stack {stack.name!r} takes ids in a range, not raw ids: build its "
        "buffers with device.build"
      )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _places(plan: Plan, topology: Topology, ids: dict[str, RawIds]):
  n, s = plan.num_shards, plan.num_sc_per_device

  def body(ids):
    out = {}
    for stack in plan.stacks:
      mine = jax.tree.map(
        lambda x: x.reshape(s, -1), ids[stack.features[0].name]
      )
      cap = plan_lib.hashed_places(plan, stack)
      place_ids, keys, no_room = jax.vmap(
        functools.partial(_segment, stack, n, cap)
      )(mine)
      out[stack.name] = (
        place_ids.reshape(-1),
        keys.reshape(-1),
        jax.lax.psum(jnp.sum(no_room), topology.axis)[None],
      )
    return out

  axis = P(topology.axis)
  built = jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(jax.tree.map(lambda _: axis, ids),),
    out_specs=axis,
    check_vma=False,
  )(ids)
  names = {stack.name: stack.features[0].name for stack in plan.stacks}
  return (
    {names[k]: v[0] for k, v in built.items()},
    {k: v[1] for k, v in built.items()},
    {k: v[2][0] for k, v in built.items()},
  )


def build_inputs(
  plan: Plan, topology: Topology, ids: dict[str, RawIds]
) -> tuple[PreprocessedInput, dict[str, jax.Array], dict[str, jax.Array]]:
  """The unresolved buffers of one raw id per sample, built on the device.

  Args:
    plan: A plan whose stacks each hold one hashed table read by one
      feature (`check_buildable`), for the batch's padded sample count.
    topology: The mesh and shard axis the tables live on.
    ids: Feature name -> its `RawIds` (`[samples]` each, global sample
      order; `samples` a multiple of N).

  Returns:
    `(inputs, dropped, no_room)`: the buffers as global arrays sharded over
    the shard axis, their places still to be resolved
    (`device.hashed.resolve`) with the key words in `hashed_ids`; per
    stack the ids over the plan's `max_ids_per_partition` that were not
    written (`build.build_inputs`), and the distinct ids that found no
    place (step 4 of the module docstring), both 0 unless the batch
    exceeds the limits or the rows.
  """
  check_buildable(plan)
  place_ids, keys, no_room = _places(plan, topology, ids)
  inputs, dropped = build.build_inputs(_places_plan(plan), topology, place_ids)
  return dataclasses.replace(inputs, hashed_ids=keys), dropped, no_room
