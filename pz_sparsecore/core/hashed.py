"""Hashed tables: raw ids, a map per shard, and eviction.

A table declared with `TableSpec(..., ids="hashed", eviction=...)` takes raw
ids instead of ids in `[0, vocabulary_size)`: any int64 (negative ones
included), or strings / bytes, which become int64 ids by `string_ids`. Its
`vocabulary_size` is then the number of rows it can hold (its capacity).
This module holds the facts every stage shares: the eviction policies, the
stable hashes, and the map's semantics, which the device implementations
(`device.hashed`, the pure-JAX one, and the C++ handler) and the tests'
NumPy model each follow.

Ids, owners and homes. A raw id `x` (int64) is mixed by `mix64` (the
SplitMix64 finalizer: a bijection of 64-bit words, so distinct ids stay
distinct) into `h`. Its owner is shard `h % N` (N shards), the same for
every process. Hashed tables stack like other tables (with hashed tables of
the same eviction policy only): each member table has its own rows in every
shard, `C` of them from row `o` (its *region*), and its ids live there
alone. On its owner an id of a table may live in the `W = min(C,
PROBE_SLOTS)` slots `o + (home + i) % C`, `i = 0 .. W-1` (its *window*),
where `home = (h >> 32) % C`. The owner keeps, per slot, the id (two int32
words, low then high), the last step it was seen (`EMPTY` for a free slot)
and a count. Tables of one stack never compete for a slot, so a map call
is, for each table, the call below on its region.

One call of the map on one shard (a training step or an inference lookup)
takes the distinct ids sent to the shard and returns each one's slot:

1. *Hits.* An id held by a slot of its window is found there (at most one
   slot holds it). In training its slot's count becomes
   `decayed(count) + 1` (saturating at 2**31 - 1) and its last step the
   current step. Inference changes nothing.
2. *Misses*, in training, one after another in ascending order of the id as
   an unsigned 64-bit word: the first free slot of the window, in window
   order; else, if the policy allows, a *victim*: a slot of the window not
   seen in this step (its last step below the current one), the one with
   the smallest score, ties to the earlier slot in window order. The id
   takes the slot: last step = current step, count 1, and the slot's row is
   reset (the table's initializer, drawn for this id; the optimizer's slots
   their initial values), so nothing of a previous holder reaches it. An id
   with no slot (policy `none`, or `ttl` with no expired slot) is
   *refused*: it reads a zero row and gets no update in this step.
   In inference, a miss is *unseen*: a zero row, nothing changes.

Scores (smaller is evicted first): `lru`: the last step; `ttl`: the last
step, and only slots whose id was last seen more than `ttl_steps` steps ago
may be taken; `lfu`: the decayed count, then the last step; `none`: nothing
is ever evicted. Counts decay by halving once per `decay_steps` steps since
the id was last seen (`decayed(count) = count >> ((step - last) //
decay_steps)`; without `decay_steps`, never). Everything is integer
arithmetic, so every implementation gives the same map bit for bit, and
the same stream of batches gives the same map and tables.

Two distinct ids never share a slot: an id gets a slot only when free or
taken from its holder. A full window evicts (or refuses) while other slots
of the shard may be free; with windows of 64 slots that is rare until the
shard is nearly full (`viz.describe` and the per-shard counters show it).

Example: C = 8 (W = 8), policy `lru`, step 5. The shard holds ids 11
(slot 2, last step 3) and 7 (slot 5, last step 4); all other slots free.
The call gets ids 7, 20 and 3 with homes 1, 2 and 5. 7 is a hit (slot 5,
last step 5). Then 3 (smaller first): slots 5, 6, 7 from home 5: slot 6 is
the first free one. Then 20: from home 2, slot 2 holds 11, slot 3 is free:
20 takes slot 3. Slots 3 and 6 are reset.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PROBE_SLOTS = 64
"""Slots of an id's window on its owner (fewer if the shard is smaller)."""

EMPTY = -1
"""The last step of a free slot."""

REFUSED = -1
"""The slot of an id the map does not give a row (refused or unseen)."""

POLICIES = ("lru", "lfu", "ttl", "none")

KEY_WORDS = 4
"""int32 words per id sent to its owner: low word, high word, home (-1 for
no id) and the index of its table in the stack."""

COUNTERS = ("held", "inserted", "evicted", "refused", "unseen")
"""Per-shard int32 counters of a hashed stack (saturating): ids held now,
and since the table was built the ids inserted, evicted, refused (training)
and unseen (inference lookups)."""


@dataclasses.dataclass(frozen=True)
class Eviction:
  """What a hashed table does when an id finds no free slot.

  Attributes:
    policy: `"lru"` (the least recently seen id of the window leaves),
      `"lfu"` (the least frequently seen, counts halving every
      `decay_steps` steps without a sighting; ties to the least recent),
      `"ttl"` (the least recently seen among ids unseen for more than
      `ttl_steps` steps; none such: the new id is refused), or `"none"`
      (a full window refuses new ids: they read a zero row and get no
      update, and are counted).
    ttl_steps: For `"ttl"`: steps without a sighting after which an id may
      be evicted.
    decay_steps: For `"lfu"`: counts halve once per this many steps without
      a sighting; None: they never decay.
  """

  policy: str = "lru"
  ttl_steps: int | None = None
  decay_steps: int | None = None

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(
        f"eviction policy must be one of {POLICIES}, got {self.policy!r}"
      )
    if self.policy == "ttl":
      if not _positive_int(self.ttl_steps):
        raise ValueError(
          f"eviction 'ttl' needs ttl_steps, a positive int, got "
          f"{self.ttl_steps!r}"
        )
    elif self.ttl_steps is not None:
      raise ValueError(
        f"ttl_steps is only for the 'ttl' policy, not {self.policy!r}"
      )
    if self.decay_steps is not None:
      if self.policy != "lfu":
        raise ValueError(
          f"decay_steps is only for the 'lfu' policy, not {self.policy!r}"
        )
      if not _positive_int(self.decay_steps):
        raise ValueError(
          f"decay_steps must be a positive int or None, got "
          f"{self.decay_steps!r}"
        )

  @property
  def code(self) -> int:
    """The policy's index in `POLICIES` (what the kernels read)."""
    return POLICIES.index(self.policy)

  @property
  def parameter(self) -> int:
    """`ttl_steps` for `ttl`, `decay_steps` for `lfu` (0: no decay), else
    0: the one integer the kernels read beside the code."""
    if self.policy == "ttl":
      return int(self.ttl_steps)
    if self.policy == "lfu":
      return int(self.decay_steps or 0)
    return 0


def _positive_int(value: Any) -> bool:
  return (
    isinstance(value, (int, np.integer))
    and not isinstance(value, bool)
    and 0 < value < 2**31
  )


def as_eviction(table: str, value: Any) -> Eviction:
  """`value` (an `Eviction`, a policy name, or None for `"lru"`) as an
  `Eviction`; raises naming the table."""
  if value is None:
    return Eviction()
  if isinstance(value, Eviction):
    return value
  if isinstance(value, str):
    try:
      return Eviction(value)
    except ValueError as e:
      raise ValueError(f"table {table!r}: {e}") from None
  raise ValueError(
    f"table {table!r}: eviction must be an Eviction, a policy name "
    f"{POLICIES} or None, got {value!r}"
  )


# ---------------------------------------------------------------------------
# Stable hashes (host side, NumPy uint64 arithmetic).

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(ids: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer of int64 ids as uint64 words (a bijection)."""
  z = np.asarray(ids).astype(np.int64, copy=False).view(np.uint64)
  with np.errstate(over="ignore"):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
  return z ^ (z >> np.uint64(31))


def string_ids(values: Iterable[Any]) -> np.ndarray:
  """int64 ids of strings or bytes: the first 8 bytes, little-endian, of
  BLAKE2b (digest size 8) of the UTF-8 bytes. The same on every machine and
  in every version of this library."""
  out = []
  for v in values:
    data = v.encode("utf-8") if isinstance(v, str) else bytes(v)
    digest = hashlib.blake2b(data, digest_size=8).digest()
    out.append(int.from_bytes(digest, "little", signed=True))
  return np.array(out, np.int64)


def owners(ids: np.ndarray, num_shards: int) -> np.ndarray:
  """The owner shard of each int64 id (int64)."""
  return (mix64(ids) % np.uint64(num_shards)).astype(np.int64)


def homes(ids: np.ndarray, rows_per_shard: int) -> np.ndarray:
  """The first slot of each id's window on its owner (int64)."""
  h = mix64(ids) >> np.uint64(32)
  return (h % np.uint64(rows_per_shard)).astype(np.int64)


def window(rows_per_shard: int) -> int:
  """Slots of an id's window on a shard of `rows_per_shard` rows."""
  return min(rows_per_shard, PROBE_SLOTS)


def key_words(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The low and high int32 words of int64 ids."""
  words = np.asarray(ids, np.int64).view(np.int32).reshape(-1, 2)
  return words[:, 0], words[:, 1]


def ids_of_words(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  """The int64 ids of low and high int32 words."""
  words = np.stack([np.asarray(lo, np.int32), np.asarray(hi, np.int32)], -1)
  return np.ascontiguousarray(words).view(np.int64).reshape(-1)


# ---------------------------------------------------------------------------
# The same hashes on the devices: JAX uint32 words (low, high), since JAX
# has no 64-bit integers unless x64 is on. A 64-bit product is assembled
# from 16-bit halves; every step wraps modulo 2**64 as NumPy's does.

_WORD = 0xFFFFFFFF
_HALF = 0xFFFF


def _wide_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The full 64-bit product of uint32 words as (low, high) words."""
  a0, a1 = a & _HALF, a >> 16
  b0, b1 = b & _HALF, b >> 16
  p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
  mid = (p00 >> 16) + (p01 & _HALF) + (p10 & _HALF)  # below 3 * 2**16
  low = (mid << 16) | (p00 & _HALF)
  return low, p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)


def _times(lo: jax.Array, hi: jax.Array, m: int) -> tuple[jax.Array, ...]:
  """`(hi, lo) * m` modulo 2**64, as (low, high) words."""
  m_lo, m_hi = jnp.uint32(m & _WORD), jnp.uint32(m >> 32)
  low, carry = _wide_product(lo, m_lo)
  return low, carry + hi * m_lo + lo * m_hi


def _xor_shift(lo: jax.Array, hi: jax.Array, k: int) -> tuple[jax.Array, ...]:
  """`z ^ (z >> k)` of a 64-bit word `z` (0 < k < 32) as (low, high)."""
  return lo ^ ((lo >> k) | (hi << (32 - k))), hi ^ (hi >> k)


def mix64_words(lo: Any, hi: Any) -> tuple[jax.Array, jax.Array]:
  """`mix64` of ids given as their low and high uint32 words (JAX arrays),
  as the low and high uint32 words of the mixed value."""
  z = jnp.asarray(lo, jnp.uint32), jnp.asarray(hi, jnp.uint32)
  z = _times(*_xor_shift(*z, 30), int(_M1))
  z = _times(*_xor_shift(*z, 27), int(_M2))
  return _xor_shift(*z, 31)


def owners_of_words(lo: Any, hi: Any, num_shards: int) -> jax.Array:
  """`owners` of ids given as uint32 words (JAX arrays), int32.

  Raises:
    ValueError: If `num_shards` is not a power of two (as shard counts
      are), the one case the low word alone decides.
  """
  if num_shards <= 0 or num_shards & (num_shards - 1):
    raise ValueError(f"num_shards must be a power of two, got {num_shards}")
  mixed_lo, _ = mix64_words(lo, hi)
  return (mixed_lo & jnp.uint32(num_shards - 1)).astype(jnp.int32)


def homes_of_words(lo: Any, hi: Any, rows_per_shard: int) -> jax.Array:
  """`homes` of ids given as uint32 words (JAX arrays), int32."""
  _, mixed_hi = mix64_words(lo, hi)
  return (mixed_hi % jnp.uint32(rows_per_shard)).astype(jnp.int32)
