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
  # The Treescope figures draw into shadow DOM from their scripts, so check
  # the pixels: the table bands and the heat map are saturated colours that
  # only appear once the scripts ran.
  for figure in ("shards.html", "stats.html"):
    shot = tmp_path / (figure + ".png")
    subprocess.run(
      [
        chromium,
        *CHROME_FLAGS,
        f"--user-data-dir={tmp_path / ('profile-' + figure)}",
        "--window-size=1200,1200",
        "--virtual-time-budget=10000",
        f"--screenshot={shot}",
        (report / figure).as_uri(),
      ],
      capture_output=True,
      timeout=120,
      check=True,
    )
    rgb = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    saturated = (rgb.max(-1) - rgb.min(-1)) > 60
    assert saturated.sum() > 2000, f"{figure} did not draw"
