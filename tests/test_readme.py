"""Every Python block of the README and of the docs' Markdown runs, as the
page says it does, and gives what the page says.

The blocks of a page run in order in one namespace (a page continues its
own earlier blocks); `concepts.md` continues `getting_started.md`'s model,
data and trainer; `multihost.md`'s blocks form one program, run as 2
processes of 4 CPU devices. `test_every_python_block_is_run` fails on a page
with Python blocks that no test here runs.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GETTING_STARTED = DOCS / "getting_started.md"
CONCEPTS = DOCS / "concepts.md"
MULTIHOST = DOCS / "multihost.md"
GPU = DOCS / "gpu.md"
COMPAT = DOCS / "compat.md"
ANY_MODEL = DOCS / "any_model.md"
HASHED = DOCS / "hashed_tables.md"

# Pages with Python blocks -> how many; each is run by a test below.
RUN_HERE = {
  README: 1,
  GETTING_STARTED: 4,
  CONCEPTS: 5,
  MULTIHOST: 2,
  GPU: 1,
  COMPAT: 2,
  ANY_MODEL: 7,
  HASHED: 5,
}


def _blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def _run(path: pathlib.Path, namespace: dict) -> None:
  for block in _blocks(path):
    exec(compile(block, str(path), "exec"), namespace)


def _example() -> str:
  text = README.read_text()
  section = text[text.index("## A minimal example") :]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_every_python_block_is_run():
  pages = [README, *sorted(DOCS.rglob("*.md"))]
  found = {
    p: len(_blocks(p)) for p in pages if "_build" not in p.parts and _blocks(p)
  }
  assert found == RUN_HERE


def test_getting_started_then_concepts_run_top_to_bottom():
  """Every Python block of the guide, in order, in one namespace; then the
  concepts page's FDO loop and checkpoint on the guide's trainer."""
  namespace: dict = {}
  _run(GETTING_STARTED, namespace)
  trainer, auxes = namespace["trainer"], namespace["auxes"]
  assert len(auxes) == len(namespace["data"]) == 60
  assert int(trainer.state.value.step) == 120
  losses = [float(a["loss"]) for a in auxes]
  # The second pass over the data (fit) learns the clicked rows.
  assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.1, losses
  # The interactions: each pair's dot product, in triu_indices order.
  vectors, pairs = map(np.asarray, (namespace["vectors"], namespace["pairs"]))
  iu, ju = np.triu_indices(4, 1)
  want = np.einsum("bkd,bkd->bk", vectors[:, iu], vectors[:, ju])
  np.testing.assert_allclose(pairs, want, rtol=1e-5, atol=1e-6)

  limits_before = trainer.model.embed.config.plan.stacks[0]
  _run(CONCEPTS, namespace)
  trainer, resumed = namespace["trainer"], namespace["resumed"]
  # The row-wise example: one accumulator value per row.
  slot = namespace["big_table"].optimizer.definition.slots[0]
  assert slot.logical_shape(10_000_000, 64) == (10_000_000,)
  assert int(trainer.state.value.step) == 180
  # update_limits replaced the trainer's layer: FDO set its limits.
  assert trainer.model.embed.config.plan.stacks[0] != limits_before
  # The resumed trainer holds the saved step and tables; the checkpoint's
  # folder is named by that step.
  assert int(resumed.state.value.step) == 180
  pzsc = namespace["pzsc"]
  infos = pzsc.list_checkpoints(namespace["ckpt_dir"])
  assert [(i.step, os.path.basename(i.path)) for i in infos] == [(180, "180")]
  saved = pzsc.logical_tables(trainer.model.embed)["items"]
  np.testing.assert_array_equal(
    pzsc.logical_tables(resumed.model.embed)["items"], saved
  )


def test_hashed_tables_page_runs_top_to_bottom(capsys):
  """Raw string and int64 ids train a two-tower model whose loss falls;
  the users' table fills and evicts; the restored model serves without
  inserting, counting the new users it does not know."""
  namespace: dict = {}
  _run(HASHED, namespace)
  out = capsys.readouterr().out
  losses = namespace["losses"]
  assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.03, out
  pzsc = namespace["pzsc"]
  trained = namespace["trainer"].model.embed
  counters = np.asarray(trained.maps["users"]["counters"].value).sum(0)
  assert counters[0] == 1024 and counters[2] > 0  # full, evicting
  served = namespace["serving"].embed
  for name in ("users", "items"):
    a = pzsc.logical_tables(trained)[name]
    b = pzsc.logical_tables(served)[name]
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.rows, b.rows)
  after = np.asarray(served.maps["users"]["counters"].value).sum(0)
  np.testing.assert_array_equal(after[:4], counters[:4])
  assert after[4] >= 4  # the four new users, unseen
  assert namespace["scores"].shape == (namespace["BATCH"],)


def test_any_model_page_runs_top_to_bottom(capsys):
  """The conversion guide, in order in one namespace: the converted
  transformer gives the dense logits, host buffers give the device path's,
  the trainer and the hand-written step train alike, `complete_mapping`
  keeps the table sharded, a tied model is refused, and an id out of range
  raises eagerly and looks up zeros under jit."""
  namespace: dict = {}
  _run(ANY_MODEL, namespace)
  out = capsys.readouterr().out
  found = re.search(r"largest logit difference: (\S+)", out)
  assert float(found.group(1)) < 1e-5, out
  assert "host path against device path: 0.0" in out
  pz = namespace["pz"]
  trained = {
    v.label: v.value for v in pz.unbind_variables(namespace["by_hand"])[1]
  }
  for var in pz.unbind_variables(namespace["trainer"].model)[1]:
    axes = tuple(var.value.named_shape)
    np.testing.assert_allclose(
      np.asarray(trained[var.label].unwrap(*axes)),
      np.asarray(var.value.unwrap(*axes)),
      atol=1e-5,
      err_msg=var.label,
    )
  table = namespace["table"].value.data_array
  assert table.sharding.spec[0] == ("data", "model")
  assert "pz.nn.EmbeddingDecode at .body.sublayers" in out
  assert "outside [0, 1000)" in out
  embedded = np.asarray(
    namespace["embedded"].unwrap("batch", "seq", "embedding")
  )
  assert np.all(embedded[0, 1] == 0) and np.any(embedded[0, 0] != 0)


def test_gpu_page_snippet_runs(capsys):
  _run(GPU, {})
  assert "forward" in capsys.readouterr().out


def test_compat_page_program_runs(capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  block = _blocks(COMPAT)[0]
  block = block.replace("/tmp/pzsc_compat_fdo", str(tmp_path / "fdo"))
  exec(compile(block, str(COMPAT), "exec"), {})
  limit, num_sparsecores = capsys.readouterr().out.split()
  assert 1 <= int(limit) < 256  # FDO lowered the default limit
  assert int(num_sparsecores) == 32


def test_compat_page_pipelining_recipe_runs(capsys):
  """The "Pipelining" recipe: a SparseCoreEmbed trained through the
  pipelined step, one loss per batch."""
  namespace: dict = {}
  exec(compile(_blocks(COMPAT)[1], str(COMPAT), "exec"), namespace)
  assert capsys.readouterr().out.split() == ["6"]
  assert all(np.isfinite(namespace["losses"]))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_multihost_program_runs_in_two_processes(tmp_path):
  program = tmp_path / "train.py"
  program.write_text("\n".join(_blocks(MULTIHOST)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(COORDINATOR=f"localhost:{_free_port()}", NUM_PROCESSES="2")
  procs = [
    subprocess.Popen(
      [sys.executable, str(program)],
      env=dict(env, PROCESS_ID=str(i)),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=240)[0])
  finally:
    for proc in procs:
      proc.kill()
  for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
    assert proc.returncode == 0, out[-3000:]
    assert f"process {i}: loss" in out, out[-3000:]
  # One global loss: both processes print the same value.
  losses = [re.search(r"loss ([\d.]+)", out).group(1) for out in outputs]
  assert losses[0] == losses[1], outputs


def test_minimal_example_runs_without_copying_the_table():
  namespace: dict = {}
  exec(compile(_example(), str(README), "exec"), namespace)
  acts, embed = namespace["acts"], namespace["embed"]
  assert dict(acts["history"].named_shape) == {"batch": 1024, "embedding": 32}
  # Activations on "data"; every device holds an eighth of the table.
  assert acts["history"].data_array.sharding.spec[0] == "data"
  table_array = embed.tables["items"].value.data_array
  assert len({s.device for s in table_array.addressable_shards}) == 8
  assert table_array.addressable_shards[0].data.nbytes * 8 == table_array.nbytes
  # The forward wrote nothing, so the table kept its buffer object.
  table = embed.tables["items"].value
  again = namespace["pzsc"].variable_jit(lambda e, x: e(x))(
    embed, namespace["inputs"]
  )
  assert embed.tables["items"].value is table
  np.testing.assert_array_equal(
    again["history"].unwrap("batch", "embedding"),
    acts["history"].unwrap("batch", "embedding"),
  )
  # Each row is the mean of its 20 ids' rows of the logical table.
  logical = namespace["pzsc"].logical_tables(embed)["items"]
  ids = namespace["ids"]
  np.testing.assert_allclose(
    acts["history"].unwrap("batch", "embedding")[:4],
    logical[ids[:4]].mean(axis=1),
    rtol=1e-5,
    atol=1e-7,
  )
