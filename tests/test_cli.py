"""The command line and the report it writes, end to end."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "pz_sparsecore", *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=ENV,
  )


@pytest.mark.parametrize(
  "args, message",
  [
    (["shakespeare", "--devices", "3"], "power of two"),
    (["shakespeare", "--steps", "0"], "--steps must be at least 1"),
    (["shakespeare", "--vocab", "1"], "--vocab must be at least 2"),
    (["shakespeare", "--optimizer", "lamb"], "invalid choice"),
    (["shakespeare", "--batch-size", "12"], "must divide"),
    (["shakespeare", "--fdo-every", "-1"], "--fdo-every"),
    (["shakespeare", "--devices", "abc"], "invalid int value"),
    ([], "required"),
  ],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
  result = _cli(*args, timeout=60)
  assert result.returncode == 2
  assert message in result.stderr


def test_too_many_devices_is_a_clear_error():
  env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run(
    [sys.executable, "-m", "pz_sparsecore", "shakespeare", "--devices", "4"],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  assert result.returncode == 1
  assert "exceeds the 2 devices" in result.stderr


def _chromium() -> str | None:
  for name in ("chromium", "chromium-browser", "google-chrome"):
    path = shutil.which(name)
    if path:
      return path
  return None


CHROME_FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--allow-file-access-from-files",
]

# True once every Treescope output on the page has drawn: Treescope renders
# into shadow DOM from animation frames once an output is visible, and drops
# its loading markers when done.
_DRAWN = """(() => {
  const hosts = document.querySelectorAll("treescope-container");
  if (hosts.length === 0) return false;
  for (const host of hosts) {
    const root = host.shadowRoot;
    if (!root || root.childElementCount === 0) return false;
    if (root.querySelector(".loading_message")) return false;
    if (root.textContent.includes("(Loading...)")) return false;
  }
  return true;
})()"""


def _screenshot_when_drawn(chromium: str, url: str, profile) -> bytes:
  """Loads `url` in headless Chromium, waits for Treescope, screenshots."""
  import base64
  import json
  import time
  import urllib.request

  import websocket

  proc = subprocess.Popen(
    [
      chromium,
      *CHROME_FLAGS,
      f"--user-data-dir={profile}",
      "--remote-debugging-port=0",
      "--window-size=1200,1200",
      "about:blank",
    ],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
      assert time.monotonic() < deadline, "chromium did not start"
      time.sleep(0.1)
    port = port_file.read_text().split()[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
      pages = [t for t in json.load(r) if t["type"] == "page"]
    ws = websocket.create_connection(
      pages[0]["webSocketDebuggerUrl"], timeout=60
    )
    ids = iter(range(1, 10**6))

    def call(method, **params):
      message_id = next(ids)
      ws.send(
        json.dumps({"id": message_id, "method": method, "params": params})
      )
      while True:
        reply = json.loads(ws.recv())
        if reply.get("id") == message_id:
          return reply.get("result", {})

    call("Page.navigate", url=url)
    while True:
      result = call("Runtime.evaluate", expression=_DRAWN, returnByValue=True)
      if result.get("result", {}).get("value") is True:
        break
      assert time.monotonic() < deadline, f"{url} did not finish drawing"
      time.sleep(0.2)
    shot = call("Page.captureScreenshot", format="png")["data"]
    ws.close()
    return base64.b64decode(shot)
  finally:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
  report = tmp_path_factory.mktemp("report")
  result = _cli("shakespeare", "--report", str(report), "--no-progress")
  assert result.returncode == 0, result.stderr[-3000:]
  return report, result.stdout


def test_default_run_beats_the_unigram_baseline(default_run):
  _, stdout = default_run
  model = float(re.search(r"held-out loss ([\d.]+)", stdout).group(1))
  baseline = float(
    re.search(r"unigram baseline loss ([\d.]+)", stdout).group(1)
  )
  assert model < baseline - 0.2, stdout


def test_report_files(default_run):
  report, _ = default_run
  for name in ("index.html", "loss.png", "shards.html", "stats.html"):
    assert (report / name).stat().st_size > 0, name
  index = (report / "index.html").read_text()
  for element in ('id="loss-curve"', 'id="shards"', 'id="stats"', "verdict"):
    assert element in index
  assert "beats" in index


def test_report_renders_in_chromium(default_run, tmp_path):
  chromium = _chromium()
  if chromium is None:
    pytest.skip("chromium is not installed")
  report, _ = default_run
  shot = tmp_path / "index.png"
  subprocess.run(
    [
      chromium,
      *CHROME_FLAGS,
      f"--user-data-dir={tmp_path / 'profile'}",
      "--window-size=1200,3000",
      "--virtual-time-budget=10000",
      f"--screenshot={shot}",
      (report / "index.html").as_uri(),
    ],
    capture_output=True,
    timeout=120,
    check=True,
  )
  from PIL import Image

  pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
  assert pixels.std() > 10, "screenshot is blank"
  # The Treescope figures draw into shadow DOM from their scripts: wait until
  # they finished, then check the pixels (the table bands and the heat map
  # are saturated colours that only appear once drawn).
  for figure in ("shards.html", "stats.html"):
    shot = tmp_path / (figure + ".png")
    shot.write_bytes(
      _screenshot_when_drawn(
        chromium, (report / figure).as_uri(), tmp_path / ("p-" + figure)
      )
    )
    rgb = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    saturated = (rgb.max(-1) - rgb.min(-1)) > 60
    assert saturated.sum() > 2000, f"{figure} did not draw"
