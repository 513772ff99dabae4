"""The HTML report of a Shakespeare run.

`write_report(directory, result)` writes:

* `index.html`: the run's configuration and results, the loss curves, and
  the Treescope figures (each in its own frame);
* `loss.png`: training loss per step against the held-out loss and the
  unigram baseline (matplotlib);
* `shards.html`: which rows of which table live on which device / SparseCore;
* `stats.html`: the last batch's per-partition id counts against the limits;
* `model.html`: the trained model as Treescope renders it.
"""

from __future__ import annotations

import dataclasses
import html
import os
from typing import Any

import numpy as np

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>pz_sparsecore: Shakespeare run</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 70em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: .2em .6em; text-align: left; }}
iframe {{ width: 100%; border: 1px solid #ccc; }}
.good {{ color: #060; }} .bad {{ color: #a00; }}
</style></head><body>
<h1>Shakespeare next-word model on a SparseCore mesh</h1>
<h2>Result</h2>
{results}
<h2>Loss</h2>
<img id="loss-curve" src="loss.png" alt="training loss curve" width="800">
<h2>Where the table's rows live</h2>
<iframe id="shards" src="shards.html" height="520"></iframe>
<h2>Ids per partition (last batch) against the limits</h2>
<iframe id="stats" src="stats.html" height="420"></iframe>
<h2>FDO limit refreshes</h2>
{fdo}
<h2>Configuration</h2>
{config}
<h2>Model</h2>
<iframe id="model" src="model.html" height="420"></iframe>
</body></html>
"""


def _table(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
  head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
  body = "".join(
    "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
    for row in rows
  )
  return f"<table><tr>{head}</tr>{body}</table>"


def _loss_plot(path: str, result: Any) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  losses = np.asarray(result.losses)
  window = max(1, min(25, len(losses) // 10))
  smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
  fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
  ax.plot(losses, color="#bbb", lw=0.8, label="training loss (per step)")
  ax.plot(
    np.arange(window - 1, len(losses)),
    smooth,
    color="#1f77b4",
    lw=2,
    label=f"training loss ({window}-step mean)",
  )
  ax.axhline(
    result.heldout["loss"], color="#2ca02c", ls="--", label="held-out loss"
  )
  ax.axhline(
    result.baseline["loss"],
    color="#d62728",
    ls=":",
    label="unigram baseline (held-out)",
  )
  for step, *_ in result.fdo_updates:
    ax.axvline(step, color="#999", lw=0.5)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats)")
  ax.legend(loc="upper right")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def write_report(directory: str | os.PathLike, result: Any) -> str:
  """Writes the report of a `shakespeare.run` result.

  Args:
    directory: Output directory (created if missing).
    result: A `RunResult`.

  Returns:
    The path of `index.html`.
  """
  from pz_sparsecore import viz

  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  _loss_plot(os.path.join(directory, "loss.png"), result)
  embed = result.model.embed
  figures = {
    "shards.html": viz.shard_map_figure(embed),
    "stats.html": viz.stats_heatmap(result.last_stats, embed),
    "model.html": result.model,
  }
  for name, figure in figures.items():
    with open(os.path.join(directory, name), "w") as f:
      f.write(viz.to_html(figure))

  h, b = result.heldout, result.baseline
  beat = h["loss"] < b["loss"]
  steady = sorted(result.step_times[1:]) or result.step_times
  results = _table(
    [
      ("held-out loss (nats)", f"{h['loss']:.4f}", f"{b['loss']:.4f}"),
      ("held-out accuracy", f"{h['accuracy']:.4f}", f"{b['accuracy']:.4f}"),
    ],
    ("metric", "model", "unigram baseline"),
  )
  verdict = (
    f'<p class="{"good" if beat else "bad"}" id="verdict">The model '
    f"{'beats' if beat else 'does not beat'} the unigram baseline by "
    f"{b['loss'] - h['loss']:.3f} nats. Median step "
    f"{steady[len(steady) // 2] * 1e3:.1f} ms; ids dropped by the limits: "
    f"{result.dropped_ids}.</p>"
  )
  fdo = (
    _table(
      result.fdo_updates,
      ("after step", "max_ids", "max_unique_ids", "buffer / device"),
    )
    if result.fdo_updates
    else "<p>No refresh (FDO off).</p>"
  )
  config = _table(
    list(dataclasses.asdict(result.config).items()), ("setting", "value")
  )
  path = os.path.join(directory, "index.html")
  with open(path, "w") as f:
    f.write(_PAGE.format(results=results + verdict, fdo=fdo, config=config))
  return path
