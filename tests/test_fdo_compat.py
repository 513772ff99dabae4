"""The FDO file clients against jax-tpu-embedding's documented behaviour.

Upstream's `NPZFileFDOClient` and `CSVFileFDOClient` (lib/fdo) store each
key `<stack><suffix>` as given for one record and as one row per record for
several; `load` returns a key published by one process as written and the
element-wise max over all rows for a key published by several. Expected
values here are written out by hand; the files of "other processes" are
written by hand in upstream's formats.
"""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import pytest

import pz_sparsecore as pzsc
from pz_sparsecore.compat.lib.fdo import (
  csv_file_fdo_client,
  fdo_client,
  file_fdo_client,
)
from pz_sparsecore.host import fdo
from pz_sparsecore.host.preprocess import SparseDenseMatmulInputStats

CLIENTS = {"npz": fdo.NPZFileFDOClient, "csv": fdo.CSVFileFDOClient}


@pytest.fixture
def process(monkeypatch):
  """Sets the value `jax.process_index()` returns inside fdo."""
  state = {"index": 0}
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: state["index"])

  def set_index(i):
    state["index"] = i

  return set_index


def _stats(max_ids, unique, required=None, drops=None, stack="tab"):
  return SparseDenseMatmulInputStats(
    max_ids_per_partition={stack: np.array(max_ids)},
    max_unique_ids_per_partition={stack: np.array(unique)},
    required_buffer_size_per_sc={}
    if required is None
    else {stack: np.array(required)},
    id_drop_counters={} if drops is None else {stack: drops},
  )


def _write_csv(path, lines):
  """A CSV file as upstream's writer makes it (rows end with CRLF)."""
  path.write_bytes("".join(f"{line}\r\n" for line in lines).encode())


def _assert_field(got, expected):
  assert set(got) == set(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(got[key], value, strict=True)


def _files(path):
  return sorted(p for p in os.listdir(path) if p.startswith("fdo_stats"))


def test_compat_paths_re_export_ours():
  assert fdo_client.FDOClient is fdo.FDOClient
  assert file_fdo_client.NPZFileFDOClient is fdo.NPZFileFDOClient
  assert csv_file_fdo_client.CSVFileFDOClient is fdo.CSVFileFDOClient
  assert pzsc.CSVFileFDOClient is fdo.CSVFileFDOClient
  assert issubclass(fdo.CSVFileFDOClient, fdo_client.FDOClient)


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_one_record_comes_back_as_recorded(tmp_path, process, kind):
  client = CLIENTS[kind](tmp_path)
  client.record(_stats([10, 20, 30, 40], [1, 2, 3, 4]))
  client.publish()
  (name,) = _files(tmp_path)
  assert name.startswith("fdo_stats_0_") and name.endswith(f".{kind}")
  got = client.load()
  _assert_field(got.max_ids_per_partition, {"tab": np.array([10, 20, 30, 40])})
  _assert_field(
    got.max_unique_ids_per_partition, {"tab": np.array([1, 2, 3, 4])}
  )
  _assert_field(got.required_buffer_size_per_sc, {})
  _assert_field(got.id_drop_counters, {})


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_records_of_one_process_come_back_as_rows(tmp_path, process, kind):
  client = CLIENTS[kind](tmp_path)
  client.record(_stats([10, 20, 30, 40], [1, 2, 3, 4], [256]))
  client.record(_stats([5, 25, 15, 45], [0, 3, 2, 5], [512]))
  client.publish()
  got = client.load()
  _assert_field(
    got.max_ids_per_partition,
    {"tab": np.array([[10, 20, 30, 40], [5, 25, 15, 45]])},
  )
  _assert_field(
    got.max_unique_ids_per_partition,
    {"tab": np.array([[1, 2, 3, 4], [0, 3, 2, 5]])},
  )
  _assert_field(
    got.required_buffer_size_per_sc, {"tab": np.array([[256], [512]])}
  )


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_without_history_records_fold_to_their_max(tmp_path, process, kind):
  client = CLIENTS[kind](tmp_path, retain_history=False)
  client.record(_stats([10, 20, 30, 40], [1, 2, 3, 4], [256], drops=2))
  client.record(_stats([5, 25, 15, 45], [0, 3, 2, 5], [512], drops=7))
  client.record(_stats([1, 1, 1, 50], [9, 0, 0, 0], [128], drops=1))
  client.publish()
  got = client.load()
  _assert_field(got.max_ids_per_partition, {"tab": np.array([10, 25, 30, 50])})
  _assert_field(
    got.max_unique_ids_per_partition, {"tab": np.array([9, 3, 3, 5])}
  )
  _assert_field(got.required_buffer_size_per_sc, {"tab": np.array([512])})
  _assert_field(got.id_drop_counters, {"tab": np.array([7])})


def test_csv_file_format(tmp_path, process, monkeypatch):
  monkeypatch.setattr(fdo.time, "time_ns", lambda: 1234)
  process(3)
  client = fdo.CSVFileFDOClient(tmp_path)
  client.record(_stats([10, 20], [1, 2], [64, 64], drops=0))
  client.record(_stats([30, 5], [3, 1], [72, 80], drops=4))
  client.record(
    SparseDenseMatmulInputStats(
      max_ids_per_partition={"other": np.array([7])},
      max_unique_ids_per_partition={"other": np.array([7])},
    )
  )
  client.publish()
  assert _files(tmp_path) == ["fdo_stats_3_1234.csv"]
  text = (tmp_path / "fdo_stats_3_1234.csv").read_bytes().decode()
  assert text.split("\r\n") == [
    "key,values",
    "tab_max_ids,10 20",
    "tab_max_ids,30 5",
    "other_max_ids,7",
    "tab_max_unique_ids,1 2",
    "tab_max_unique_ids,3 1",
    "other_max_unique_ids,7",
    "tab_required_buffer_size,64 64",
    "tab_required_buffer_size,72 80",
    "tab_id_drop_counters,0",
    "tab_id_drop_counters,4",
    "",
  ]


def test_npz_file_format(tmp_path, process, monkeypatch):
  monkeypatch.setattr(fdo.time, "time_ns", lambda: 99)
  client = fdo.NPZFileFDOClient(tmp_path)
  client.record(_stats([4, 2], [1, 1], drops=3))
  client.publish()
  with np.load(tmp_path / "fdo_stats_0_99.npz") as npz:
    assert sorted(npz.files) == [
      "tab_id_drop_counters",
      "tab_max_ids",
      "tab_max_unique_ids",
    ]
    np.testing.assert_array_equal(npz["tab_max_ids"], [4, 2], strict=True)
    assert npz["tab_id_drop_counters"].shape == ()
    assert int(npz["tab_id_drop_counters"]) == 3
  client.record(_stats([1, 9], [1, 3], drops=0))
  client.publish()
  with np.load(tmp_path / "fdo_stats_0_100.npz") as npz:
    np.testing.assert_array_equal(npz["tab_max_ids"], [[4, 2], [1, 9]])
    np.testing.assert_array_equal(npz["tab_id_drop_counters"], [[3], [0]])


def test_several_processes_merge_to_the_max_over_all_rows(tmp_path):
  # Process 0 published two records of t_one and a stack of its own; process
  # 1 one record of t_one. Upstream's test files use the same layout.
  _write_csv(
    tmp_path / "fdo_stats_0_10.csv",
    [
      "key,values",
      "t_one_max_ids,10 20 30 40",
      "t_one_max_ids,1 25 2 3",
      "t_one_max_unique_ids,1 2 3 4",
      "t_one_max_unique_ids,1 5 1 1",
      "t_two_max_ids,50 60",
      "t_two_max_ids,70 10",
    ],
  )
  _write_csv(
    tmp_path / "fdo_stats_1_11.csv",
    [
      "key,values",
      "t_one_max_ids,20 10 40 30",
      "t_one_max_unique_ids,2 1 4 3",
      "t_one_required_buffer_size,128",
    ],
  )
  got = fdo.CSVFileFDOClient(tmp_path).load()
  _assert_field(
    got.max_ids_per_partition,
    {
      "t_one": np.array([20, 25, 40, 40]),
      "t_two": np.array([[50, 60], [70, 10]]),
    },
  )
  _assert_field(
    got.max_unique_ids_per_partition, {"t_one": np.array([2, 5, 4, 4])}
  )
  _assert_field(got.required_buffer_size_per_sc, {"t_one": np.array([128])})


def test_npz_files_of_several_processes(tmp_path):
  np.savez(
    tmp_path / "fdo_stats_0_10.npz",
    t_max_ids=np.array([10, 20, 30, 40], np.int32),
    t_max_unique_ids=np.array([1, 2, 3, 4], np.int32),
  )
  np.savez(
    tmp_path / "fdo_stats_1_11.npz",
    t_max_ids=np.array([[20, 10, 40, 30], [0, 0, 50, 0]], np.int32),
    t_max_unique_ids=np.array([[2, 1, 4, 3], [0, 0, 5, 0]], np.int32),
  )
  # An older file of process 1 with larger values is superseded.
  np.savez(
    tmp_path / "fdo_stats_1_9.npz",
    t_max_ids=np.array([99, 99, 99, 99], np.int32),
    t_max_unique_ids=np.array([99, 99, 99, 99], np.int32),
  )
  got = fdo.NPZFileFDOClient(tmp_path).load()
  np.testing.assert_array_equal(
    got.max_ids_per_partition["t"], [20, 20, 50, 40]
  )
  np.testing.assert_array_equal(
    got.max_unique_ids_per_partition["t"], [2, 2, 5, 4]
  )


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_newest_file_per_process(tmp_path, kind):
  names = [
    f"d/fdo_stats_0_10.{kind}",
    f"d/fdo_stats_0_40.{kind}",
    f"d/fdo_stats_10_5.{kind}",
    f"d/fdo_stats_2_10.{kind}",
    f"d/fdo_stats_0_30.{kind}",
    f"d/fdo_stats_2_09.{kind}",
  ]
  client = CLIENTS[kind](tmp_path)
  assert client._get_latest_files_by_process(names) == [
    f"d/fdo_stats_10_5.{kind}",
    f"d/fdo_stats_2_10.{kind}",
    f"d/fdo_stats_0_40.{kind}",
  ]
  assert client._get_latest_files_by_process([]) == []


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_no_files_raise_file_not_found(tmp_path, kind):
  with pytest.raises(FileNotFoundError, match="no readable"):
    CLIENTS[kind](tmp_path / "new").load()
  assert (tmp_path / "new").is_dir()
  # A directory removed after the client was made is just as empty.
  client = CLIENTS[kind](tmp_path / "gone")
  os.rmdir(tmp_path / "gone")
  with pytest.raises(FileNotFoundError):
    client.load()
  # Files of the other format do not count.
  other = "csv" if kind == "npz" else "npz"
  (tmp_path / "new" / f"fdo_stats_0_1.{other}").write_text("x")
  with pytest.raises(FileNotFoundError):
    CLIENTS[kind](tmp_path / "new").load()


@pytest.mark.parametrize(
  "content",
  [
    pytest.param("key,values\r\ntab_max_ids,10 2", id="cut-mid-line"),
    pytest.param("", id="empty"),
    pytest.param("k,v\r\ntab_max_ids,1 2\r\n", id="bad-header"),
    pytest.param("key,values\r\ntab_max_ids,1 x\r\n", id="not-integers"),
    pytest.param("key,values\r\ntab_max_ids\r\n", id="one-field"),
    pytest.param(
      "key,values\r\ntab_max_ids,1 2\r\ntab_max_ids,1 2 3\r\n",
      id="ragged-rows",
    ),
  ],
)
def test_unreadable_csv_is_skipped_then_load_works(tmp_path, process, content):
  process(0)
  client = fdo.CSVFileFDOClient(tmp_path)
  client.record(_stats([1, 2], [1, 1]))
  client.publish()
  (tmp_path / "fdo_stats_1_5.csv").write_bytes(content.encode())
  with pytest.warns(UserWarning, match="fdo_stats_1_5.csv"):
    got = client.load()
  np.testing.assert_array_equal(got.max_ids_per_partition["tab"], [1, 2])
  # Process 1 publishes a good file later: it supersedes the broken one.
  process(1)
  other = fdo.CSVFileFDOClient(tmp_path)
  other.record(_stats([5, 0], [2, 0]))
  other.publish()
  with warnings.catch_warnings(action="error"):
    got = client.load()
  np.testing.assert_array_equal(got.max_ids_per_partition["tab"], [5, 2])
  np.testing.assert_array_equal(got.max_unique_ids_per_partition["tab"], [2, 1])


def test_csv_unknown_key_suffix(tmp_path):
  _write_csv(
    tmp_path / "fdo_stats_0_1.csv",
    ["key,values", "tab_max_ids,1 2", "tab_bogus,3"],
  )
  with pytest.raises(ValueError, match="tab_bogus"):
    fdo.CSVFileFDOClient(tmp_path).load()


def test_csv_run_id(tmp_path, process):
  process(0)
  stale = fdo.CSVFileFDOClient(tmp_path, run_id="old")
  stale.record(_stats([9, 9], [9, 9]))
  stale.publish()
  process(1)
  current = fdo.CSVFileFDOClient(tmp_path, run_id="new, run")
  current.record(_stats([1, 2], [1, 1]))
  current.publish()
  with pytest.warns(UserWarning, match="'old'"):
    got = current.load()
  np.testing.assert_array_equal(got.max_ids_per_partition["tab"], [1, 2])
  # A client without a run id reads every file.
  got = fdo.CSVFileFDOClient(tmp_path).load()
  np.testing.assert_array_equal(got.max_ids_per_partition["tab"], [9, 9])


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_load_continues_from_the_published_state(tmp_path, process, kind):
  first = CLIENTS[kind](tmp_path)
  first.record(_stats([3, 1], [1, 1]))
  first.record(_stats([1, 4], [1, 2]))
  first.publish()
  # After a restart a new client of process 0 loads, records and publishes.
  restarted = CLIENTS[kind](tmp_path)
  restarted.load()
  restarted.record(_stats([2, 2], [2, 0]))
  restarted.publish()
  got = CLIENTS[kind](tmp_path).load()
  np.testing.assert_array_equal(
    got.max_ids_per_partition["tab"], [[3, 1], [1, 4], [2, 2]]
  )
  np.testing.assert_array_equal(
    got.max_unique_ids_per_partition["tab"], [[1, 1], [1, 2], [2, 0]]
  )


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_shape_mismatch_is_refused_and_the_record_kept(tmp_path, process, kind):
  client = CLIENTS[kind](tmp_path)
  client.record(_stats([3, 1], [1, 1]))
  with pytest.raises(ValueError, match="shape"):
    client.record(_stats([3, 1, 5], [1, 1, 1]))
  client.publish()
  got = client.load()
  np.testing.assert_array_equal(got.max_ids_per_partition["tab"], [3, 1])


def test_processes_of_different_topologies_are_refused(tmp_path):
  _write_csv(tmp_path / "fdo_stats_0_1.csv", ["key,values", "t_max_ids,1 2"])
  _write_csv(tmp_path / "fdo_stats_1_1.csv", ["key,values", "t_max_ids,1 2 3"])
  with pytest.raises(ValueError, match="different topologies"):
    fdo.CSVFileFDOClient(tmp_path).load()


def test_csv_publish_is_atomic(tmp_path, process, monkeypatch):
  client = fdo.CSVFileFDOClient(tmp_path)
  client.record(_stats([3, 1], [1, 1]))
  real_write = fdo.CSVFileFDOClient._write

  def failing_write(self, f, data):
    f.write(b"key,values\r\ntab_max")
    raise OSError("disk full")

  monkeypatch.setattr(fdo.CSVFileFDOClient, "_write", failing_write)
  with pytest.raises(OSError, match="disk full"):
    client.publish()
  assert os.listdir(tmp_path) == []
  monkeypatch.setattr(fdo.CSVFileFDOClient, "_write", real_write)
  client.publish()
  assert len(_files(tmp_path)) == 1
  np.testing.assert_array_equal(
    client.load().max_ids_per_partition["tab"], [3, 1]
  )


@pytest.mark.parametrize("kind", list(CLIENTS))
def test_counts_are_integers(tmp_path, process, kind):
  client = CLIENTS[kind](tmp_path)
  stats = _stats([3, 1], [1, 1], required=[10, 10])
  # Spread over SparseCores, a device size can become fractional: round up.
  stats.set_required_buffer_size_per_device("tab", 21, num_sc_per_device=2)
  client.record(stats)
  client.publish()
  got = client.load()
  np.testing.assert_array_equal(
    got.required_buffer_size_per_sc["tab"], [11, 11]
  )
  assert np.issubdtype(got.max_ids_per_partition["tab"].dtype, np.integer)


def test_two_publications_in_one_clock_tick(tmp_path, process, monkeypatch):
  monkeypatch.setattr(fdo.time, "time_ns", lambda: 500)
  client = fdo.CSVFileFDOClient(tmp_path)
  client.record(_stats([3, 1], [1, 1]))
  client.publish()
  client.record(_stats([0, 8], [0, 1]))
  client.publish()
  assert _files(tmp_path) == ["fdo_stats_0_500.csv", "fdo_stats_0_501.csv"]
  got = client.load()
  np.testing.assert_array_equal(
    got.max_ids_per_partition["tab"], [[3, 1], [0, 8]]
  )
