"""Tests of the FDO client and limit updates (pz_sparsecore.host.fdo).

Expected statistics are written out by hand or recomputed with numpy
(`np.maximum.reduce` over the recorded rows of several processes, `np.stack`
of the records of a single one); the expected limits follow upstream's rule
(`update_preprocessing_parameters`: the largest observed count, per stack).
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pz_sparsecore.core import layout
from pz_sparsecore.core.specs import FeatureSpec, SGDOptimizerSpec, TableSpec
from pz_sparsecore.host import fdo
from pz_sparsecore.host.preprocess import SparseDenseMatmulInputStats


def _stats(scale: int, drops: int = 0, stacks=("s1", "s2")):
  """Stats whose values depend on `scale` (one row per stack)."""
  base = {
    "s1": np.array([1, 5, 2, 0], np.int32),
    "s2": np.array([3, 3], np.int32),
  }
  return SparseDenseMatmulInputStats(
    max_ids_per_partition={s: base[s] * scale for s in stacks},
    max_unique_ids_per_partition={s: base[s] * scale // 2 for s in stacks},
    required_buffer_size_per_sc={
      s: np.array([8, 16], np.int32) * scale for s in stacks
    },
    id_drop_counters={s: drops for s in stacks},
  )


def _rows(records, field, stack):
  return np.stack([np.asarray(getattr(r, field)[stack]) for r in records])


def _assert_stats_equal(got, records):
  """`got` equals the element-wise max over all `records`."""
  for field in (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
  ):
    stacks = set(getattr(records[0], field))
    assert set(getattr(got, field)) == stacks
    for stack in stacks:
      expected = np.maximum.reduce(_rows(records, field, stack), axis=0)
      np.testing.assert_array_equal(getattr(got, field)[stack], expected)
  for stack in records[0].id_drop_counters:
    expected = max(int(r.id_drop_counters[stack]) for r in records)
    assert int(got.id_drop_counters[stack]) == expected


def _assert_history_equal(got, records):
  """`got` holds every one of `records` as a row (one process published)."""
  for field in (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
    "id_drop_counters",
  ):
    stacks = set(getattr(records[0], field))
    assert set(getattr(got, field)) == stacks
    for stack in stacks:
      expected = _rows(records, field, stack).reshape(len(records), -1)
      np.testing.assert_array_equal(getattr(got, field)[stack], expected)


def _stats_files(path):
  return sorted(p for p in os.listdir(path) if p.startswith("fdo_stats"))


@pytest.fixture
def process(monkeypatch):
  """Sets the value `jax.process_index()` returns inside fdo."""
  state = {"index": 0}
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: state["index"])

  def set_index(i):
    state["index"] = i

  return set_index


def test_record_publish_load_round_trip(tmp_path, process):
  client = fdo.NPZFileFDOClient(tmp_path)
  records = [_stats(1, drops=3), _stats(2, drops=1), _stats(1, drops=0)]
  for r in records:
    client.record(r)
  client.publish()
  assert len(_stats_files(tmp_path)) == 1
  assert _stats_files(tmp_path)[0].startswith("fdo_stats_0_")
  got = fdo.NPZFileFDOClient(tmp_path).load()
  assert isinstance(got, SparseDenseMatmulInputStats)
  # One process published: its records come back as rows, in order.
  _assert_history_equal(got, records)
  np.testing.assert_array_equal(
    got.max_ids_per_partition["s1"],
    [[1, 5, 2, 0], [2, 10, 4, 0], [1, 5, 2, 0]],
  )
  np.testing.assert_array_equal(
    got.required_buffer_size_per_sc["s2"], [[8, 16], [16, 32], [8, 16]]
  )
  np.testing.assert_array_equal(got.id_drop_counters["s1"], [[3], [1], [0]])
  # Limits come from the largest row: scale 2 dominates.
  np.testing.assert_array_equal(
    np.max(got.max_ids_per_partition["s1"], axis=0), [2, 10, 4, 0]
  )


def test_two_processes_element_wise_max(tmp_path, process):
  process(0)
  first = fdo.NPZFileFDOClient(tmp_path)
  a = SparseDenseMatmulInputStats(
    max_ids_per_partition={"s": np.array([9, 1, 4], np.int32)},
    max_unique_ids_per_partition={"s": np.array([2, 2, 7], np.int32)},
    required_buffer_size_per_sc={"s": np.array([8, 40], np.int32)},
    id_drop_counters={"s": 5},
  )
  first.record(a)
  first.publish()
  process(1)
  second = fdo.NPZFileFDOClient(tmp_path)
  b = SparseDenseMatmulInputStats(
    max_ids_per_partition={"s": np.array([3, 6, 4], np.int32)},
    max_unique_ids_per_partition={"s": np.array([1, 8, 0], np.int32)},
    required_buffer_size_per_sc={"s": np.array([24, 16], np.int32)},
    id_drop_counters={"s": 2},
  )
  second.record(b)
  second.publish()
  names = _stats_files(tmp_path)
  assert [n.split("_")[2] for n in names] == ["0", "1"]
  for client in (first, second):
    got = client.load()
    np.testing.assert_array_equal(got.max_ids_per_partition["s"], [9, 6, 4])
    np.testing.assert_array_equal(
      got.max_unique_ids_per_partition["s"], [2, 8, 7]
    )
    np.testing.assert_array_equal(
      got.required_buffer_size_per_sc["s"], [24, 40]
    )
    assert got.id_drop_counters == {"s": 5}


def test_newest_file_per_process_wins(tmp_path, process, monkeypatch):
  clock = iter([100, 200, 300])
  monkeypatch.setattr(fdo.time, "time_ns", lambda: next(clock))
  big, small, other = _stats(5), _stats(1), _stats(2, stacks=("s1",))
  process(0)
  old = fdo.NPZFileFDOClient(tmp_path)
  old.record(big)
  old.publish()  # fdo_stats_0_100
  new = fdo.NPZFileFDOClient(tmp_path)
  new.record(small)
  new.publish()  # fdo_stats_0_200: newer, supersedes the larger values
  process(3)
  third = fdo.NPZFileFDOClient(tmp_path)
  third.record(other)
  third.publish()  # fdo_stats_3_300
  assert _stats_files(tmp_path) == [
    "fdo_stats_0_100.npz",
    "fdo_stats_0_200.npz",
    "fdo_stats_3_300.npz",
  ]
  got = fdo.NPZFileFDOClient(tmp_path).load()
  np.testing.assert_array_equal(got.max_ids_per_partition["s1"], [2, 10, 4, 0])
  np.testing.assert_array_equal(got.max_ids_per_partition["s2"], [3, 3])


def test_repeated_publish_accumulates_records(tmp_path, process):
  client = fdo.NPZFileFDOClient(tmp_path)
  client.record(_stats(3))
  client.publish()
  client.record(_stats(1))
  client.publish()
  got = client.load()
  _assert_history_equal(got, [_stats(3), _stats(1)])


@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_unreadable_file_is_skipped(tmp_path, process, kind):
  client = fdo.NPZFileFDOClient(tmp_path)
  client.record(_stats(1))
  client.publish()
  (good,) = _stats_files(tmp_path)
  if kind == "garbage":
    content = b"\x00not an npz file\xff" * 7
  else:
    content = (tmp_path / good).read_bytes()
    content = content[: len(content) // 2]
  (tmp_path / "fdo_stats_7_123.npz").write_bytes(content)
  with pytest.warns(UserWarning, match="fdo_stats_7_123"):
    got = client.load()
  _assert_stats_equal(got, [_stats(1)])


def test_only_unreadable_files_raise(tmp_path):
  (tmp_path / "fdo_stats_7_123.npz").write_bytes(b"garbage")
  with pytest.warns(UserWarning):
    with pytest.raises(FileNotFoundError):
      fdo.NPZFileFDOClient(tmp_path).load()


def test_run_id_mismatch_is_skipped(tmp_path, process):
  process(0)
  stale = fdo.NPZFileFDOClient(tmp_path, run_id="old-run")
  stale.record(_stats(9))
  stale.publish()
  process(1)
  current = fdo.NPZFileFDOClient(tmp_path, run_id="new-run")
  current.record(_stats(1))
  current.publish()
  with pytest.warns(UserWarning, match="old-run"):
    got = current.load()
  _assert_stats_equal(got, [_stats(1)])
  # A file without a run id is also foreign to a client that has one.
  process(2)
  anonymous = fdo.NPZFileFDOClient(tmp_path)
  anonymous.record(_stats(4))
  anonymous.publish()
  with pytest.warns(UserWarning):
    got = current.load()
  _assert_stats_equal(got, [_stats(1)])


def test_no_files(tmp_path):
  with pytest.raises(FileNotFoundError):
    fdo.NPZFileFDOClient(tmp_path / "fresh").load()
  assert (tmp_path / "fresh").is_dir()


def test_unknown_key_suffix(tmp_path):
  np.savez(
    tmp_path / "fdo_stats_0_1.npz",
    s_max_ids=np.array([[1, 2]]),
    s_bogus=np.array([[1]]),
  )
  with pytest.raises(ValueError, match="s_bogus"):
    fdo.NPZFileFDOClient(tmp_path).load()


def test_publish_without_records(tmp_path):
  with pytest.raises(ValueError, match="nothing recorded"):
    fdo.NPZFileFDOClient(tmp_path).publish()
  assert os.listdir(tmp_path) == []


def test_publish_is_atomic(tmp_path, process, monkeypatch):
  client = fdo.NPZFileFDOClient(tmp_path)
  client.record(_stats(1))
  real_savez = np.savez

  def failing_savez(file, **arrays):
    file.write(b"PK\x03\x04 partial")
    raise OSError("disk full")

  monkeypatch.setattr(np, "savez", failing_savez)
  with pytest.raises(OSError, match="disk full"):
    client.publish()
  assert os.listdir(tmp_path) == []

  monkeypatch.setattr(np, "savez", real_savez)
  client.publish()
  names = os.listdir(tmp_path)
  assert len(names) == 1
  assert names[0].startswith("fdo_stats_0_") and names[0].endswith(".npz")
  assert not any("tmp" in n for n in names)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _assert_stats_equal(client.load(), [_stats(1)])


# ---------------------------------------------------------------------------
# update_preprocessing_parameters.


def _prepared_features():
  def table(name, **kw):
    return TableSpec(
      name=name,
      vocabulary_size=64,
      embedding_dim=8,
      initializer=jax.nn.initializers.zeros,
      optimizer=SGDOptimizerSpec(),
      combiner="sum",
      **kw,
    )

  t1 = table("s1", max_ids_per_partition=100, max_unique_ids_per_partition=50)
  t2 = table("s2", suggested_coo_buffer_size_per_device=4096)
  t3 = table("s3", max_ids_per_partition=7)

  def feature(name, t):
    return FeatureSpec(
      name=name, table_spec=t, input_shape=[16, 2], output_shape=[16, 8]
    )

  features = {
    "a": feature("a", t1),
    "b": [feature("b", t1), feature("c", t2)],
    "d": feature("d", t3),
  }
  return layout.prepare_feature_specs_for_training(features, 2, 2)


def test_update_preprocessing_parameters():
  features = _prepared_features()
  before = layout.get_stacked_table_specs(features)
  stats = SparseDenseMatmulInputStats(
    max_ids_per_partition={
      "s1": np.array([3, 17, 5, 0], np.int32),
      "s2": np.array([0, 0], np.int32),
    },
    max_unique_ids_per_partition={
      "s1": np.array([2, 9, 1, 1], np.int32),
      "s2": np.array([0, 0], np.int32),
    },
    required_buffer_size_per_sc={
      "s1": np.array([24, 40], np.int32),
      "s2": np.array([8, 16], np.int32),
    },
    id_drop_counters={"s1": 0, "s2": 0},
  )
  out = fdo.update_preprocessing_parameters(features, stats, 2)
  after = layout.get_stacked_table_specs(out)

  assert after["s1"].max_ids_per_partition == 17
  assert after["s1"].max_unique_ids_per_partition == 9
  assert after["s1"].suggested_coo_buffer_size_per_device == 80
  # Observed zeros clamp to 1.
  assert after["s2"].max_ids_per_partition == 1
  assert after["s2"].max_unique_ids_per_partition == 1
  assert after["s2"].suggested_coo_buffer_size_per_device == 32
  # A stack without stats keeps its values.
  assert after["s3"] == before["s3"]
  assert after["s3"].max_ids_per_partition == 7
  # Everything else about the stacks is unchanged.
  for name in ("s1", "s2"):
    assert (
      after[name].replace(
        max_ids_per_partition=before[name].max_ids_per_partition,
        max_unique_ids_per_partition=before[name].max_unique_ids_per_partition,
        suggested_coo_buffer_size_per_device=(
          before[name].suggested_coo_buffer_size_per_device
        ),
      )
      == before[name]
    )

  # Every feature of a stack sees the new spec; the structure is kept.
  assert jax.tree.structure(out) == jax.tree.structure(features)
  assert out["a"].table_spec.stacked_table_spec == after["s1"]
  assert out["b"][0].table_spec.stacked_table_spec == after["s1"]
  assert out["a"].id_transformation == features["a"].id_transformation
  assert out["b"][0].id_transformation == features["b"][0].id_transformation

  # The inputs are unchanged.
  assert layout.get_stacked_table_specs(features) == before
  assert before["s1"].max_ids_per_partition == 100
  assert before["s1"].max_unique_ids_per_partition == 50
  assert before["s2"].suggested_coo_buffer_size_per_device == 4096


def test_update_from_loaded_stats(tmp_path, process):
  client = fdo.NPZFileFDOClient(tmp_path)
  client.record(_stats(1, stacks=("s1",)))
  client.record(_stats(3, stacks=("s1",)))
  client.publish()
  features = _prepared_features()
  out = fdo.update_preprocessing_parameters(features, client.load(), 4)
  s1 = layout.get_stacked_table_specs(out)["s1"]
  assert s1.max_ids_per_partition == 15
  assert s1.max_unique_ids_per_partition == 7
  assert s1.suggested_coo_buffer_size_per_device == 48 * 4


def test_update_requires_prepared_specs():
  t = TableSpec(
    name="t",
    vocabulary_size=8,
    embedding_dim=8,
    initializer=jax.nn.initializers.zeros,
    optimizer=SGDOptimizerSpec(),
    combiner="sum",
  )
  features = [
    FeatureSpec(name="f", table_spec=t, input_shape=[8], output_shape=[8, 8])
  ]
  with pytest.raises(ValueError, match="prepare"):
    fdo.update_preprocessing_parameters(features, _stats(1), 2)


def test_record_accepts_jax_arrays(tmp_path, process):
  client = fdo.NPZFileFDOClient(tmp_path)
  client.record(
    SparseDenseMatmulInputStats(
      max_ids_per_partition={"s": jnp.array([4, 2], jnp.int32)},
      max_unique_ids_per_partition={"s": jnp.array([1, 2], jnp.int32)},
      required_buffer_size_per_sc={"s": jnp.array([8], jnp.int32)},
      id_drop_counters={"s": jnp.int32(6)},
    )
  )
  client.publish()
  got = client.load()
  np.testing.assert_array_equal(got.max_ids_per_partition["s"], [4, 2])
  assert got.id_drop_counters == {"s": 6}
