"""The HTML report of a Shakespeare run.

`write_report(directory, result)` writes:

* `index.html`: the run's configuration and results, the loss curves, and
  the Treescope figures, inline (each at its own size: no inner frame
  scrolls, and the page needs nothing but its directory, offline);
* `loss.png`: training loss per step, the held-out loss after the last step
  and the unigram baseline (matplotlib);
* `shards.html`: which rows of which table live on which device / SparseCore;
* `stats.html`: the last batch's per-partition id counts against the limits;
* `model.html`: the trained model as Treescope renders it;
* `shards.json`: what the shard map draws (`viz.shard_map_data`), with the
  run's configuration and vocabulary size, which determine it.

`shards.html`, `stats.html` and `model.html` are each one figure of
`index.html` as a page of its own.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
from typing import Any

import numpy as np

# Treescope writes a line unbroken (`white-space: pre` in its shadow DOM), so
# a collapsed node of the model is one line thousands of pixels long: wrap
# such lines at the page's width (`::part` styles reach the shadow root).
_TREESCOPE_CSS = """
treescope-container::part(treescope_root) {
  white-space: pre-wrap; overflow-wrap: anywhere;
}
"""

_FIGURE_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>{css}</style></head><body>
{figure}
</body></html>
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>pz_sparsecore: Shakespeare run</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 70em;
  padding: 0 1em; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: .2em .6em; text-align: left; }}
img {{ max-width: 100%; height: auto; }}
.figure {{ margin: 1em 0; }}
.good {{ color: #060; }} .bad {{ color: #a00; }}
{css}
</style></head><body>
<h1>Shakespeare next-word model on a SparseCore mesh</h1>
<h2>Result</h2>
{results}
<h2>Loss</h2>
<img id="loss-curve" src="loss.png" width="800" height="400"
  alt="training loss per step, held-out loss after the last step, unigram
  baseline">
<h2>Where the table's rows live</h2>
<div class="figure" id="shards">{shards}</div>
<h2>Ids per partition (last batch) against the limits</h2>
<div class="figure" id="stats">{stats}</div>
<h2>FDO limit refreshes</h2>
{fdo}
<h2>Configuration</h2>
{config}
<h2>Model</h2>
<div class="figure" id="model">{model}</div>
</body></html>
"""

_FIGURE_TITLES = {
  "shards": "Where the table's rows live",
  "stats": "Ids per partition (last batch) against the limits",
  "model": "The trained model",
}


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
  # Both held-out numbers are measured once, after training: the model's is
  # a point at the last step; the unigram baseline does not train, so it is
  # a level to compare with at every step.
  last, heldout = len(losses) - 1, result.heldout["loss"]
  ax.plot(
    [last],
    [heldout],
    "o",
    color="#2ca02c",
    ms=7,
    label=f"held-out loss after the last step: {heldout:.3f}",
  )
  ax.annotate(
    f"held-out {heldout:.3f}",
    (last, heldout),
    xytext=(-9, 0),
    textcoords="offset points",
    ha="right",
    va="center",
    color="#2ca02c",
    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none"},
  )
  baseline = result.baseline["loss"]
  ax.axhline(
    baseline,
    color="#d62728",
    ls=":",
    label=f"unigram baseline (held-out): {baseline:.3f}",
  )
  ax.margins(y=0.08)
  for k, (step, *_) in enumerate(result.fdo_updates):
    label = "FDO limit refresh" if k == 0 else None
    ax.axvline(step, color="#999", lw=0.8, ls="--", label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats)")
  ax.legend(loc="upper right")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def _write_shard_map_data(directory: str, result: Any) -> None:
  """`shards.json`: the shard map's data and what it depends on (the run's
  configuration, the table's vocabulary), so that the same picture can be
  drawn again from them and compared (`docs/readme_figure.py`)."""
  from pz_sparsecore import viz
  from pz_sparsecore.models.shakespeare import TABLE

  embed = result.model.embed
  data = {
    "config": dataclasses.asdict(result.config),
    "vocab_size": embed.config.plan.tables[TABLE].vocabulary_size,
    "shard_map": viz.shard_map_data(embed),
  }
  with open(os.path.join(directory, "shards.json"), "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")


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
    "shards": viz.to_html(viz.shard_map_figure(embed)),
    "stats": viz.to_html(viz.stats_heatmap(result.last_stats, embed)),
    "model": viz.to_html(result.model),
  }
  for name, figure in figures.items():
    with open(os.path.join(directory, f"{name}.html"), "w") as f:
      f.write(
        _FIGURE_PAGE.format(
          title=html.escape(_FIGURE_TITLES[name]),
          css=_TREESCOPE_CSS,
          figure=figure,
        )
      )
  _write_shard_map_data(directory, result)

  h, b = result.heldout, result.baseline
  steady = sorted(result.step_times[1:]) or result.step_times
  results = _table(
    [
      ("held-out loss (nats)", f"{h['loss']:.4f}", f"{b['loss']:.4f}"),
      ("held-out accuracy", f"{h['accuracy']:.4f}", f"{b['accuracy']:.4f}"),
    ],
    ("metric", "model", "unigram baseline"),
  )
  gap = b["loss"] - h["loss"]
  outcome = (
    f"beats the unigram baseline by {gap:.3f} nats"
    if gap > 0
    else f"does not beat the unigram baseline ({-gap:.3f} nats above it)"
  )
  verdict = (
    f'<p class="{"good" if gap > 0 else "bad"}" id="verdict">The model '
    f"{outcome}. Median step {steady[len(steady) // 2] * 1e3:.1f} ms; ids "
    f"dropped by the limits: {result.dropped_ids}.</p>"
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
    f.write(
      _PAGE.format(
        css=_TREESCOPE_CSS,
        results=results + verdict,
        fdo=fdo,
        config=config,
        **figures,
      )
    )
  return path
