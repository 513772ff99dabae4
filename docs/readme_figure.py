"""Draws the README's picture from a real Shakespeare run (`make
readme-figure`).

Usage: python docs/readme_figure.py REPORT_DIR OUT_PNG

REPORT_DIR is a report written by `python -m pz_sparsecore shakespeare
--report REPORT_DIR`. Its shard map (`shards.html`) and its heat map of ids
per partition (`stats.html`) are opened in headless Chromium, drawn, cut to
their figures and stacked, one above the other, into OUT_PNG. Beside it goes
the report's `shards.json` (OUT_PNG with the suffix `.json`): what the shard
map draws, as `viz.shard_map_data` computed it, with the run's configuration.
`tests/test_viz.py` draws the shard map again from that configuration with
the current code and compares: a change to the drawing code fails it until
the picture is drawn again.
"""

from __future__ import annotations

import base64
import io
import pathlib
import shutil
import sys
import tempfile

from PIL import Image

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parent.parent / "tests")
)
import chromium  # noqa: E402

# The bounding box of the page's Treescope output, in CSS pixels.
_BOX = """(() => {
  const host = document.querySelector("treescope-container");
  const root = host.shadowRoot.querySelector(".treescope_root") || host;
  const box = root.getBoundingClientRect();
  return [box.x, box.y, box.width, box.height];
})()"""


def _figure(browser: str, page: pathlib.Path, profile) -> Image.Image:
  with chromium.devtools(browser, profile, 1280, 1400) as call:
    call("Page.navigate", url=page.as_uri())
    chromium.wait_for(call, "document.readyState === 'complete'")
    drawn = chromium.evaluate(call, chromium.DRAW_ALL)
    if drawn["undrawn"] or not drawn["outputs"]:
      raise SystemExit(f"{page.name} did not draw: {drawn}")
    x, y, width, height = chromium.evaluate(call, _BOX)
    shot = call(
      "Page.captureScreenshot",
      format="png",
      captureBeyondViewport=True,
      clip={"x": x, "y": y, "width": width, "height": height, "scale": 1},
    )
  return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")


def main() -> None:
  report = pathlib.Path(sys.argv[1]).resolve()
  out = pathlib.Path(sys.argv[2])
  browser = chromium.find()
  if browser is None:
    raise SystemExit("readme_figure needs chromium")
  with tempfile.TemporaryDirectory() as tmp:
    parts = [
      _figure(browser, report / name, pathlib.Path(tmp) / name)
      for name in ("shards.html", "stats.html")
    ]
  gap = 16
  width = max(p.width for p in parts)
  height = sum(p.height for p in parts) + gap * (len(parts) - 1)
  picture = Image.new("RGB", (width, height), "white")
  top = 0
  for part in parts:
    picture.paste(part, (0, top))
    top += part.height + gap
  out.parent.mkdir(parents=True, exist_ok=True)
  picture.save(out, optimize=True)
  shutil.copyfile(report / "shards.json", out.with_suffix(".json"))
  print(f"{out}: {width} x {height}")


if __name__ == "__main__":
  main()
