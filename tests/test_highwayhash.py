"""Tests of the numba HighwayHash-64 (pz_sparsecore.host._highwayhash).

The golden values are the published `kExpected64` table of
google/highwayhash (highwayhash_test.cc, c/highwayhash_test.c): key bytes
00..1F, input `data[i] = i` of every length 0..64.
"""

from __future__ import annotations

import numpy as np
import pytest

from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES
from pz_sparsecore.host import _highwayhash as hh

TEST_KEY = np.array(
  [
    0x0706050403020100,
    0x0F0E0D0C0B0A0908,
    0x1716151413121110,
    0x1F1E1D1C1B1A1918,
  ],
  dtype=np.uint64,
)

# HighwayHash is frozen: these must never change.
EXPECTED_64 = [
  0x907A56DE22C26E53, 0x7EAB43AAC7CDDD78, 0xB8D0569AB0B53D62,
  0x5C6BEFAB8A463D80, 0xF205A46893007EDA, 0x2B8A1668E4A94541,
  0xBD4CCC325BEFCA6F, 0x4D02AE1738F59482, 0xE1205108E55F3171,
  0x32D2644EC77A1584, 0xF6E10ACDB103A90B, 0xC3BBF4615B415C15,
  0x243CC2040063FA9C, 0xA89A58CE65E641FF, 0x24B031A348455A23,
  0x40793F86A449F33B, 0xCFAB3489F97EB832, 0x19FE67D2C8C5C0E2,
  0x04DD90A69C565CC2, 0x75D9518E2371C504, 0x38AD9B1141D3DD16,
  0x0264432CCD8A70E0, 0xA9DB5A6288683390, 0xD7B05492003F028C,
  0x205F615AEA59E51E, 0xEEE0C89621052884, 0x1BFC1A93A7284F4F,
  0x512175B5B70DA91D, 0xF71F8976A0A2C639, 0xAE093FEF1F84E3E7,
  0x22CA92B01161860F, 0x9FC7007CCF035A68, 0xA0C964D9ECD580FC,
  0x2C90F73CA03181FC, 0x185CF84E5691EB9E, 0x4FC1F5EF2752AA9B,
  0xF5B7391A5E0A33EB, 0xB9B84B83B4E96C9C, 0x5E42FE712A5CD9B4,
  0xA150F2F90C3F97DC, 0x7FA522D75E2D637D, 0x181AD0CC0DFFD32B,
  0x3889ED981E854028, 0xFB4297E8C586EE2D, 0x6D064A45BB28059C,
  0x90563609B3EC860C, 0x7AA4FCE94097C666, 0x1326BAC06B911E08,
  0xB926168D2B154F34, 0x9919848945B1948D, 0xA2A98FC534825EBE,
  0xE9809095213EF0B6, 0x582E5483707BC0E9, 0x086E9414A88A6AF5,
  0xEE86B98D20F6743D, 0xF89B7FF609B1C0A7, 0x4C7D9CC19E22C3E8,
  0x9A97005024562A6F, 0x5DD41CF423E6EBEF, 0xDF13609C0468E227,
  0x6E0DA4F64188155A, 0xB755BA4B50D7D4A1, 0x887A3484647479BD,
  0xAB8EEBE9BF2139A0, 0x75542C5D4CD2A6FF,
]  # fmt: skip


def _int32_bytes(value: int) -> np.ndarray:
  """The 4 little-endian bytes of an int32."""
  return np.array([value], dtype="<i4").view(np.uint8)


def _random_int32(count: int) -> np.ndarray:
  """`count` random int32 values (fixed seed), the extremes first."""
  rng = np.random.default_rng(20240611)
  edges = np.array([0, -1, 1, 2**31 - 1, -(2**31)], dtype=np.int32)
  values = rng.integers(-(2**31), 2**31, size=count, dtype=np.int32)
  return np.concatenate([edges, values])


def test_expected_table_is_complete() -> None:
  assert len(EXPECTED_64) == 65


@pytest.mark.parametrize("size", range(65))
def test_hash64_matches_published_vectors(size: int) -> None:
  data = np.arange(size, dtype=np.uint8)
  # Called from Python, numba boxes the uint64 result as a Python int.
  got = hh.hash64(data, TEST_KEY)
  assert 0 <= got < 2**64
  assert int(got) == EXPECTED_64[size], f"{int(got):#018x}"


def test_hash64_second_c_vector() -> None:
  """c/highwayhash_test.c: key {1, 2, 3, 4}, 33 bytes 128..160."""
  key = np.array([1, 2, 3, 4], dtype=np.uint64)
  data = np.arange(128, 128 + 33, dtype=np.uint8)
  assert int(hh.hash64(data, key)) == 0x53C516CCE478CAD7


def test_hash64_reads_only_its_slice() -> None:
  data = np.arange(100, dtype=np.uint8)
  for start, stop in [(0, 5), (3, 40), (7, 100), (31, 63)]:
    view = data[start:stop]
    assert hh.hash64(view, TEST_KEY) == hh.hash64(view.copy(), TEST_KEY)


@pytest.mark.parametrize("key", [TEST_KEY, hh.BUCKET_KEY])
def test_hash64_int32_matches_bytes(key: np.ndarray) -> None:
  for value in _random_int32(3000):
    expected = hh.hash64(_int32_bytes(int(value)), key)
    assert hh.hash64_int32(value, key) == expected, int(value)


def test_hash64_int32_python_ints() -> None:
  """Python ints (int64 in numba) hash as their int32 bytes."""
  for value in [0, -1, 5, 2**31 - 1, -(2**31)]:
    expected = hh.hash64(_int32_bytes(value), hh.BUCKET_KEY)
    assert hh.hash64_int32(value, hh.BUCKET_KEY) == expected


def test_bucket_key() -> None:
  assert hh.BUCKET_KEY.dtype == np.uint64
  assert [int(k) for k in hh.BUCKET_KEY] == [
    0x4451E30F87DB9609,
    0xCA7358A1FD2737F8,
    0x4B2C991FCEE4FDEA,
    0x0B2658E18326F6BA,
  ]
  assert MAX_MINIBATCHES == 64


def test_bucket_ids_match_scalar_path() -> None:
  col_ids = _random_int32(5000)
  buckets = hh.bucket_ids(col_ids)
  assert buckets.dtype == np.int32
  assert buckets.shape == col_ids.shape
  assert buckets.min() >= 0
  assert buckets.max() < MAX_MINIBATCHES
  expected = [
    int(hh.hash64_int32(v, hh.BUCKET_KEY)) & (MAX_MINIBATCHES - 1)
    for v in col_ids
  ]
  np.testing.assert_array_equal(buckets, expected)


def test_bucket_ids_empty() -> None:
  buckets = hh.bucket_ids(np.zeros(0, dtype=np.int32))
  assert buckets.dtype == np.int32
  assert buckets.shape == (0,)


def test_bucket_ids_roughly_uniform() -> None:
  col_ids = np.arange(100_000, dtype=np.int32)
  counts = np.bincount(hh.bucket_ids(col_ids), minlength=MAX_MINIBATCHES)
  assert counts.shape == (MAX_MINIBATCHES,)
  assert counts.min() >= 1300, counts
  assert counts.max() <= 1830, counts
