"""HighwayHash-64 in numba (the portable, scalar algorithm).

HighwayHash (https://github.com/google/highwayhash) is Google's keyed hash.
jax-tpu-embedding uses its 64-bit variant to put embedding rows into
minibatching buckets: the bucket of a row is the hash of the 4
little-endian bytes of its int32 column id, under a fixed key, masked to the
low bits (`hash & 63` for its 64 buckets). `bucket_ids` reproduces that.

The algorithm, as written here:

- The state is four vectors of four uint64 lanes: `v0`, `v1`, `mul0`,
  `mul1`. `_reset` seeds them from fixed constants and the 256-bit key.
- `_update` mixes one 32-byte packet (four little-endian uint64 lanes) in:
  a 32x32->64 bit multiply per lane, then the `_zipper_merge` byte shuffle
  between neighbouring lanes.
- A message is hashed packet by packet; 1..31 trailing bytes go through
  `_update_remainder`, which folds the remainder's length into `v0` and
  `v1` and packs the bytes into one last, zero-padded packet.
- `_finalize64` runs four rounds of `_permute_and_update` and sums lane 0
  of the four vectors.

The state is a tuple of tuples, so hashing allocates nothing; all arithmetic
is on `np.uint64` (wrapping), with every constant an `np.uint64` so numba
never mixes signed and unsigned integers into float64.
"""

from __future__ import annotations

import numba
import numpy as np

from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES

# The four uint64 lanes of one state vector or packet.
Lanes = tuple[np.uint64, np.uint64, np.uint64, np.uint64]
# (v0, v1, mul0, mul1).
State = tuple[Lanes, Lanes, Lanes, Lanes]

_jit = numba.njit(cache=True, nogil=True)
# The larger steps are inlined at numba's level (LLVM inlines the small
# helpers by itself but leaves `_update` and `_finalize64` as calls). Only a
# call-free loop body lets LLVM vectorize `bucket_ids` over several ids at a
# time: about 12 ms instead of 150 ms for a million ids.
_inline = numba.njit(cache=True, nogil=True, inline="always")

_U8 = np.uint64(8)
_U32 = np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)
_LOW8 = np.uint64(0xFF)

_INIT_MUL0 = (
  np.uint64(0xDBE6D5D5FE4CCE2F),
  np.uint64(0xA4093822299F31D0),
  np.uint64(0x13198A2E03707344),
  np.uint64(0x243F6A8885A308D3),
)
_INIT_MUL1 = (
  np.uint64(0x3BD39E10CB0EF593),
  np.uint64(0xC0ACF169B5F18A8C),
  np.uint64(0xBE5466CF34E90C6C),
  np.uint64(0x452821E638D01377),
)

# jax-tpu-embedding's "arbitrarily chosen, forever-unchanging" bucket key.
BUCKET_KEY = np.array(
  [
    0x4451E30F87DB9609,
    0xCA7358A1FD2737F8,
    0x4B2C991FCEE4FDEA,
    0x0B2658E18326F6BA,
  ],
  dtype=np.uint64,
)
_BUCKET_MASK = np.uint64(MAX_MINIBATCHES - 1)


@_jit
def _swap_halves(x: np.uint64) -> np.uint64:
  """`x` with its two 32-bit halves exchanged."""
  return (x >> _U32) | (x << _U32)


@_inline
def _reset(key: np.ndarray) -> State:
  """The initial state for a 4-lane uint64 `key`."""
  k0, k1, k2, k3 = (
    np.uint64(key[0]),
    np.uint64(key[1]),
    np.uint64(key[2]),
    np.uint64(key[3]),
  )
  m0, m1 = _INIT_MUL0, _INIT_MUL1
  v0 = (m0[0] ^ k0, m0[1] ^ k1, m0[2] ^ k2, m0[3] ^ k3)
  v1 = (
    m1[0] ^ _swap_halves(k0),
    m1[1] ^ _swap_halves(k1),
    m1[2] ^ _swap_halves(k2),
    m1[3] ^ _swap_halves(k3),
  )
  return v0, v1, m0, m1


@_jit
def _byte(x: np.uint64, src: int, dst: int) -> np.uint64:
  """Byte `src` of `x`, moved to byte position `dst` (others zero)."""
  return ((x >> np.uint64(8 * src)) & _LOW8) << np.uint64(8 * dst)


@_jit
def _zipper_merge(v1: np.uint64, v0: np.uint64) -> tuple[np.uint64, np.uint64]:
  """The byte shuffle of two neighbouring lanes: `(to_add1, to_add0)`.

  Seen as 16 bytes `v0 | v1 << 64`, the result `to_add0 | to_add1 << 64`
  takes bytes 3, 12, 2, 5, 14, 1, 15, 0, 11, 4, 10, 13, 9, 6, 8, 7.
  """
  to_add0 = (
    _byte(v0, 3, 0)
    | _byte(v1, 4, 1)
    | _byte(v0, 2, 2)
    | _byte(v0, 5, 3)
    | _byte(v1, 6, 4)
    | _byte(v0, 1, 5)
    | _byte(v1, 7, 6)
    | _byte(v0, 0, 7)
  )
  to_add1 = (
    _byte(v1, 3, 0)
    | _byte(v0, 4, 1)
    | _byte(v1, 2, 2)
    | _byte(v1, 5, 3)
    | _byte(v1, 1, 4)
    | _byte(v0, 6, 5)
    | _byte(v1, 0, 6)
    | _byte(v0, 7, 7)
  )
  return to_add1, to_add0


@_jit
def _mix_lane(
  v0: np.uint64,
  v1: np.uint64,
  mul0: np.uint64,
  mul1: np.uint64,
  lane: np.uint64,
) -> Lanes:
  """One lane of `_update` before the zipper merge: new (v0, v1, mul0, mul1).

  The products are of two 32-bit halves, so they never overflow 64 bits.
  """
  v1 = v1 + mul0 + lane
  mul0 = mul0 ^ ((v1 & _LOW32) * (v0 >> _U32))
  v0 = v0 + mul1
  mul1 = mul1 ^ ((v0 & _LOW32) * (v1 >> _U32))
  return v0, v1, mul0, mul1


@_inline
def _update(state: State, lanes: Lanes) -> State:
  """The state after mixing in one packet of four uint64 lanes."""
  v0, v1, mul0, mul1 = state
  a = _mix_lane(v0[0], v1[0], mul0[0], mul1[0], lanes[0])
  b = _mix_lane(v0[1], v1[1], mul0[1], mul1[1], lanes[1])
  c = _mix_lane(v0[2], v1[2], mul0[2], mul1[2], lanes[2])
  d = _mix_lane(v0[3], v1[3], mul0[3], mul1[3], lanes[3])
  v1 = (a[1], b[1], c[1], d[1])
  mul0 = (a[2], b[2], c[2], d[2])
  mul1 = (a[3], b[3], c[3], d[3])
  # v0 takes the zipper merge of v1, then v1 that of the new v0.
  add01, add00 = _zipper_merge(v1[1], v1[0])
  add03, add02 = _zipper_merge(v1[3], v1[2])
  v0 = (a[0] + add00, b[0] + add01, c[0] + add02, d[0] + add03)
  add11, add10 = _zipper_merge(v0[1], v0[0])
  add13, add12 = _zipper_merge(v0[3], v0[2])
  v1 = (v1[0] + add10, v1[1] + add11, v1[2] + add12, v1[3] + add13)
  return v0, v1, mul0, mul1


@_jit
def _read_le(data: np.ndarray, start: int, count: int) -> np.uint64:
  """Bytes `data[start:start + count]` (count <= 8) as a little-endian int."""
  x = np.uint64(0)
  for k in range(count):
    x |= np.uint64(data[start + k]) << np.uint64(8 * k)
  return x


@_jit
def _rotate32_by(x: np.uint64, count: np.uint64) -> np.uint64:
  """Each 32-bit half of `x` rotated left by `count` (1..31) bits."""
  back = _U32 - count
  low = x & _LOW32
  high = x >> _U32
  low = ((low << count) | (low >> back)) & _LOW32
  high = ((high << count) | (high >> back)) & _LOW32
  return low | (high << _U32)


@_inline
def _absorb_length(state: State, size: np.uint64) -> State:
  """The first half of `_update_remainder`: fold in `size` (1..31).

  Adds `size` to both halves of every `v0` lane and rotates both halves of
  every `v1` lane left by `size` bits.
  """
  v0, v1, mul0, mul1 = state
  inc = (size << _U32) + size
  v0 = (v0[0] + inc, v0[1] + inc, v0[2] + inc, v0[3] + inc)
  v1 = (
    _rotate32_by(v1[0], size),
    _rotate32_by(v1[1], size),
    _rotate32_by(v1[2], size),
    _rotate32_by(v1[3], size),
  )
  return v0, v1, mul0, mul1


@_jit
def _bytes_in_lane(count: int, lane: int) -> int:
  """How many of the first `count` bytes of a packet fall in `lane`."""
  return min(max(count - 8 * lane, 0), 8)


@_inline
def _remainder_packet(data: np.ndarray, start: int, size: int) -> Lanes:
  """The zero-padded last packet of the `size` (1..31) bytes at `start`.

  Its first `size & ~3` bytes are copied as they are. The last `size & 3`
  bytes go elsewhere: when `size & 16`, the final 4 bytes of the data
  (overlapping the copied ones) become packet bytes 28..31; otherwise, if
  any, packet bytes 16, 17, 18 are the first, middle and last of them.
  """
  whole = size & ~3
  lane0 = _read_le(data, start, _bytes_in_lane(whole, 0))
  lane1 = _read_le(data, start + 8, _bytes_in_lane(whole, 1))
  lane2 = _read_le(data, start + 16, _bytes_in_lane(whole, 2))
  lane3 = _read_le(data, start + 24, _bytes_in_lane(whole, 3))
  tail = size & 3
  if size & 16:
    lane3 |= _read_le(data, start + size - 4, 4) << _U32
  elif tail:
    rest = start + whole
    lane2 |= (
      np.uint64(data[rest])
      | np.uint64(data[rest + (tail >> 1)]) << _U8
      | np.uint64(data[rest + tail - 1]) << np.uint64(16)
    )
  return lane0, lane1, lane2, lane3


@_inline
def _permute_and_update(state: State) -> State:
  """One finalization round: update with v0's lanes permuted and swapped."""
  v0 = state[0]
  permuted = (
    _swap_halves(v0[2]),
    _swap_halves(v0[3]),
    _swap_halves(v0[0]),
    _swap_halves(v0[1]),
  )
  return _update(state, permuted)


@_inline
def _finalize64(state: State) -> np.uint64:
  """The 64-bit hash of a state that has absorbed the whole message."""
  # Four rounds, unrolled: a loop here keeps LLVM from vectorizing callers'
  # loops over many hashes.
  state = _permute_and_update(state)
  state = _permute_and_update(state)
  state = _permute_and_update(state)
  state = _permute_and_update(state)
  v0, v1, mul0, mul1 = state
  return v0[0] + v1[0] + mul0[0] + mul1[0]


@_jit
def hash64(data: np.ndarray, key: np.ndarray) -> np.uint64:
  """HighwayHash-64 of the uint8 array `data` under the 4-lane uint64 `key`."""
  size = data.shape[0]
  state = _reset(key)
  start = 0
  while start + 32 <= size:
    packet = (
      _read_le(data, start, 8),
      _read_le(data, start + 8, 8),
      _read_le(data, start + 16, 8),
      _read_le(data, start + 24, 8),
    )
    state = _update(state, packet)
    start += 32
  rest = size - start
  if rest:
    state = _absorb_length(state, np.uint64(rest))
    state = _update(state, _remainder_packet(data, start, rest))
  return _finalize64(state)


@_inline
def _hash_int32_from(state: State, value: int) -> np.uint64:
  """`hash64` of the 4 little-endian bytes of int32 `value`, from `_reset`.

  The remainder path for exactly 4 bytes: they are all copied (`4 & ~3`),
  with no tail to place (`4 & 3 == 0`), so the packet is the bytes in the
  low half of lane 0 and zeros elsewhere. `value` may arrive as any integer
  type; only its low 32 bits count.
  """
  word = np.uint64(np.int64(value)) & _LOW32
  state = _absorb_length(state, np.uint64(4))
  zero = np.uint64(0)
  state = _update(state, (word, zero, zero, zero))
  return _finalize64(state)


@_jit
def hash64_int32(value: int, key: np.ndarray) -> np.uint64:
  """`hash64` of the 4 little-endian bytes of the int32 `value`.

  Equals `hash64(np.array([value], "<i4").view(np.uint8), key)`, without
  allocating.
  """
  return _hash_int32_from(_reset(key), value)


@_jit
def bucket_seed() -> State:
  """The hash state `bucket_of` starts from (keyed with `BUCKET_KEY`)."""
  return _reset(BUCKET_KEY)


@_inline
def bucket_of(seed: State, col_id: int) -> np.int32:
  """The minibatching bucket of int32 `col_id`, from `bucket_seed()`:
  `hash64_int32(col_id, BUCKET_KEY) & 63`, in `[0, MAX_MINIBATCHES)`."""
  return np.int32(_hash_int32_from(seed, col_id) & _BUCKET_MASK)


@_jit
def bucket_ids(col_ids: np.ndarray) -> np.ndarray:
  """`bucket_of` every int32 column id of a 1-D array (int32)."""
  seed = bucket_seed()
  out = np.empty(col_ids.shape[0], dtype=np.int32)
  for i in range(col_ids.shape[0]):
    out[i] = bucket_of(seed, col_ids[i])
  return out
