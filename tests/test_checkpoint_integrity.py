"""Damaged checkpoints: an error that names the damage, an unchanged target,
and the previous checkpoint still restores bit-exact.

Each case saves two checkpoints (keep=2), damages the newest as a disk or
a careless copy would, restores it (the error type, and a message naming
the table and the file), checks the target kept its values, then does what
the user does next: restores the previous checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from penzai import pz

sys.path.insert(0, os.path.dirname(__file__))
import checkpoint_writer  # noqa: E402

import pz_sparsecore as pzsc  # noqa: E402
from pz_sparsecore.nn.tables import slot_arrays, table_arrays  # noqa: E402

VOCAB, DIM = checkpoint_writer.VOCAB, checkpoint_writer.DIM


def set_values(embed, seed: int) -> dict[str, np.ndarray]:
  """Random table and accumulator values; returns them."""
  rng = np.random.default_rng(seed)
  values = {
    "table": rng.standard_normal((VOCAB, DIM), np.float32),
    "slot": rng.uniform(0.1, 1.0, (VOCAB, DIM)).astype(np.float32),
  }
  pzsc.set_logical_tables(embed, {"t": values["table"]})
  pzsc.set_logical_slots(embed, {"t": {"accumulator": values["slot"]}})
  return values


def values_of(embed) -> dict[str, np.ndarray]:
  return {
    "table": np.asarray(pzsc.logical_tables(embed)["t"]),
    "slot": np.asarray(pzsc.logical_slots(embed)["t"]["accumulator"]),
  }


def assert_bit_exact(got, want) -> None:
  for name in want:
    np.testing.assert_array_equal(
      got[name].view(np.uint32), want[name].view(np.uint32), err_msg=name
    )


def data_file(checkpoint: str) -> str:
  """The file of the table's first chunk."""
  with open(manifest_file(checkpoint)) as f:
    (stack,) = json.load(f)["embeds"]["emb"].values()
  key = stack["arrays"]["embeddings"]
  return os.path.join(checkpoint, "tables", key, "0.0.0")


def manifest_file(checkpoint: str) -> str:
  return os.path.join(checkpoint, "manifest", "metadata")


def flip_bytes(checkpoint: str) -> str:
  """64 bytes of the table's chunk (the file's first quarter) inverted."""
  path = data_file(checkpoint)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 4)
    data = f.read(64)
    f.seek(-64, os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))
  return path


def truncate(checkpoint: str) -> str:
  path = data_file(checkpoint)
  os.truncate(path, os.path.getsize(path) // 4)
  return path


def remove_data(checkpoint: str) -> str:
  path = data_file(checkpoint)
  os.unlink(path)
  return path


def garble_manifest(checkpoint: str) -> str:
  path = manifest_file(checkpoint)
  with open(path, "r+b") as f:
    f.seek(40)
    f.write(b"\x00#\xff")
  return path


def edit_manifest(checkpoint: str) -> str:
  """Still JSON, one number changed: only its checksum tells."""
  path = manifest_file(checkpoint)
  with open(path) as f:
    text = f.read()
  with open(path, "w") as f:
    f.write(
      text.replace(
        '"max_ids_per_partition": 256', '"max_ids_per_partition": 257'
      )
    )
  return path


def remove_manifest(checkpoint: str) -> str:
  path = manifest_file(checkpoint)
  os.unlink(path)
  return path


# Damage → (error type, what the message names besides the file).
CASES = {
  "flipped-bytes": (flip_bytes, ValueError, "table 't'"),
  "truncated-data": (truncate, ValueError, "table 't'"),
  "missing-data": (remove_data, FileNotFoundError, "table 't'"),
  "garbled-manifest": (garble_manifest, ValueError, "manifest"),
  "edited-manifest": (edit_manifest, ValueError, "manifest"),
  "missing-manifest": (remove_manifest, FileNotFoundError, "manifest"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damage_raises_and_the_previous_checkpoint_restores(tmp_path, case):
  damage, error, names = CASES[case]
  embed = checkpoint_writer.build(jax.random.key(0))
  saved, paths = {}, {}
  for seed in (1, 2):
    saved[seed] = set_values(embed, seed)
    paths[seed] = pzsc.save_checkpoint(tmp_path, embed, keep=2)
  newest = paths[2]
  file = damage(newest)

  target = checkpoint_writer.build(jax.random.key(0))
  before = set_values(target, 9)
  with pytest.raises(error) as raised:
    pzsc.restore_checkpoint(tmp_path, target)
  message = str(raised.value)
  assert names in message and file in message, message
  assert len(message.splitlines()) <= 3, message
  assert raised.value.__cause__ is None
  assert_bit_exact(values_of(target), before)

  # The user's next action: the checkpoint before it.
  previous = int(os.path.basename(paths[1]))
  restored = pzsc.restore_checkpoint(tmp_path, target, step=previous)
  assert_bit_exact(values_of(restored), saved[1])


def test_digests_are_the_stored_chunks_crc32(tmp_path):
  """The manifest holds the CRC-32 of every stored chunk, by chunk: the
  tables' zarr v2 chunk files (which TensorStore reads back as the layer's
  shards) and orbax's chunks of the other arrays."""
  embed = checkpoint_writer.build(jax.random.key(0), devices=2)
  set_values(embed, 1)
  bias = pz.nn.AddBias.from_config("bias", jax.random.key(0), {"dim": DIM})
  path = pzsc.save_checkpoint(tmp_path, pz.nn.Sequential([embed, bias]))
  with open(manifest_file(path)) as f:
    manifest = json.load(f)
  digests, tables = manifest["digests"], manifest["tables"]
  (stack,) = manifest["embeds"]["emb"].values()
  assert sorted(tables) == sorted(stack["arrays"].values())
  (name,) = table_arrays(embed)
  held = {"embeddings": np.asarray(table_arrays(embed)[name])}
  held["accumulator"] = np.asarray(slot_arrays(embed)[name][0])
  for array, key in stack["arrays"].items():
    folder = os.path.join(path, "tables", key)
    store = ts.open(
      {"driver": "zarr", "kvstore": {"driver": "file", "path": folder}}
    ).result()
    entry = digests[key]
    assert store.chunk_layout.read_chunk.shape == tuple(entry["block"])
    np.testing.assert_array_equal(store.read().result(), held[array])
    files = sorted(f for f in os.listdir(folder) if not f.startswith("."))
    assert files == sorted(entry["crc32"]), key
    for name in files:
      index = [int(i) for i in name.split(".")]
      valid = tuple(
        slice(0, min(b, n - i * b))
        for i, b, n in zip(index, entry["block"], entry["shape"], strict=True)
      )
      chunk = np.fromfile(os.path.join(folder, name), store.dtype.numpy_dtype)
      chunk = chunk.reshape(entry["block"])[valid]
      assert zlib.crc32(chunk.tobytes()) == entry["crc32"][name], (key, name)
  arrays = ts.KvStore.open(
    {
      "driver": "ocdbt",
      "base": {"driver": "file", "path": os.path.join(path, "arrays/")},
    }
  ).result()
  keys = [k.decode() for k in arrays.list().result()]
  stored = sorted({k.split("/")[0] for k in keys})
  assert stored == sorted(set(digests) - set(tables))
  for key in stored:
    entry = digests[key]
    zarray = json.loads(arrays.read(f"{key}/.zarray").result().value)
    assert zarray["chunks"] == entry["block"], key
    chunks = {
      k.split("/")[1]: zlib.crc32(arrays.read(k).result().value)
      for k in keys
      if k.startswith(key + "/") and not k.endswith(".zarray")
    }
    assert chunks == entry["crc32"], key


def test_damage_is_found_on_another_topology(tmp_path):
  """Saved on 1 device, read onto 2 (other pieces of each chunk)."""
  embed = checkpoint_writer.build(jax.random.key(0))
  saved = set_values(embed, 1)
  path = pzsc.save_checkpoint(tmp_path, embed, keep=2)
  restored = pzsc.restore_checkpoint(
    tmp_path, checkpoint_writer.build(jax.random.key(0), devices=2)
  )
  assert_bit_exact(values_of(restored), saved)

  file = flip_bytes(path)
  target = checkpoint_writer.build(jax.random.key(0), devices=2)
  before = set_values(target, 9)
  with pytest.raises(ValueError) as raised:
    pzsc.restore_checkpoint(tmp_path, target)
  message = str(raised.value)
  assert "table 't'" in message and file in message, message
  assert "checksum mismatch" in message, message
  assert_bit_exact(values_of(target), before)


OLD = os.path.join(os.path.dirname(__file__), "data", "checkpoint_f427531")


def old_model():
  """The layer of the checkpoints of f427531: checkpoint_writer's with a 16 x
  8 table, and a bias."""
  embed = checkpoint_writer.build(jax.random.key(0), vocab=16, dim=8)
  bias = pz.nn.AddBias.from_config("bias", jax.random.key(0), {"dim": 8})
  return pz.nn.Sequential([embed, bias])


def test_checkpoints_of_f427531_restore_and_are_checked(tmp_path):
  """Checkpoints in the format of f427531 (zarr v3, a crc32c codec per
  chunk, no digests in the manifest), written by the code of 052108f,
  restore, and TensorStore checks their chunks: steps 0 and 1 hold the
  table rows + k and the bias k for k = 1, 2."""
  shutil.copytree(OLD, tmp_path, dirs_exist_ok=True)
  rows = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
  for step, k in ((0, 1), (1, 2)):
    restored = pzsc.restore_checkpoint(tmp_path, old_model(), step=step)
    embed, bias = restored.sublayers
    got = pzsc.logical_tables(embed)["t"]
    np.testing.assert_array_equal(np.asarray(got), rows + k)
    np.testing.assert_array_equal(bias.bias.value.unwrap("dim"), k)
  # Values this small are kept in the B+tree's nodes, merged into one file.
  (file,) = glob.glob(os.path.join(tmp_path, "1", "arrays", "d", "*"))
  with open(file, "r+b") as f:
    f.seek(os.path.getsize(file) // 4)
    f.write(b"\xff" * 16)
  with pytest.raises(ValueError) as raised:
    pzsc.restore_checkpoint(tmp_path, old_model())
  # The damaged node holds every array's metadata: the first read names it.
  message = str(raised.value)
  assert file in message and "unreadable" in message, message


def test_damage_is_found_in_a_cast_table(tmp_path):
  """A float32 table read into bfloat16 (`cast_tables`): its blocks are
  checked as stored, read again by themselves."""
  embed = checkpoint_writer.build(jax.random.key(0))
  set_values(embed, 1)
  path = pzsc.save_checkpoint(tmp_path, embed)

  def bf16_model():
    return checkpoint_writer.build(jax.random.key(0), dtype="bfloat16")

  pzsc.restore_checkpoint(tmp_path, bf16_model(), cast_tables=True)
  file = flip_bytes(path)
  with pytest.raises(ValueError) as raised:
    pzsc.restore_checkpoint(tmp_path, bf16_model(), cast_tables=True)
  message = str(raised.value)
  assert "table 't'" in message and file in message, message
  assert "checksum mismatch" in message, message


def test_chunks_of_the_tables_item_are_not_cut_to_divisors():
  """orbax's chunks divide the written shape: a delta of a prime number of
  touched rows (999,983) would be stored row by row, a chunk file each.
  The `tables` item cuts rows to fit 32 MiB and pads the last chunk; a
  sharded stack's chunks stay inside its devices' pieces."""
  from pz_sparsecore.nn._ckpt_integrity import block_shape

  rows = np.zeros((999_983, 64), jnp.bfloat16)
  chunk = 32 * 2**20
  assert block_shape(rows, chunk) == [1, 64]  # orbax's choice.
  assert block_shape(rows, chunk, edges=True) == [262_144, 64]
  embed = checkpoint_writer.build(jax.random.key(0), devices=2)
  (table,) = table_arrays(embed).values()
  assert block_shape(table, 1024, edges=True) == [1, 16, DIM]
  assert block_shape(table, 2**30, edges=True) == [1, *table.shape[1:]]
