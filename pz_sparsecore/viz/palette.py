"""Colours that tell a stack's member tables apart, and the padding grey.

A shard map colours each row by the table that owns it, so a stack needs as
many colours as it has tables, all different and none like the grey of the
padding rows: the DLRM benchmark stacks 26 tables into one stack.
`table_colors(count)` starts with `TABLE_COLORS` (Matplotlib's tab10 without
its grey, kept for padding, and its red, which the stats heat map uses for
"over the limit") and adds, one at a time, the candidate farthest from every
colour chosen so far and from `PADDING_COLOR` (a greedy Glasbey palette).
Distances are CIELAB's delta E (Euclidean in L*a*b*); the candidates are the
sRGB grid of step 17 with lightness L* in [35, 85], neither near black nor
near the white page. Every call gives the same sequence, so a shorter palette
is the start of a longer one: 26 tables take the 8 seeds and 18 more, the
closest two of them about 28 apart and each at least 37 from the padding grey
(a difference of 2.3 is just noticeable).
"""

from __future__ import annotations

import numpy as np

RGB = tuple[int, int, int]

TABLE_COLORS: tuple[RGB, ...] = (
  (31, 119, 180),
  (255, 127, 14),
  (44, 160, 44),
  (148, 103, 189),
  (23, 190, 207),
  (227, 119, 194),
  (188, 189, 34),
  (140, 86, 75),
)
"""The first colours of `table_colors`, for a stack's first member tables."""

PADDING_COLOR: RGB = (210, 210, 210)
"""Colour of padding rows."""

_GRID_STEP = 17  # 16 levels per channel: 4,096 candidates.
_LIGHTNESS = (35.0, 85.0)  # L* of the candidates.


def _cielab(rgb: np.ndarray) -> np.ndarray:
  """`[..., 3]` sRGB in 0-255 to CIELAB (D65 white)."""
  c = np.asarray(rgb, np.float64) / 255
  linear = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
  to_xyz = np.array(
    [
      [0.4124, 0.3576, 0.1805],
      [0.2126, 0.7152, 0.0722],
      [0.0193, 0.1192, 0.9505],
    ]
  )
  xyz = linear @ to_xyz.T / np.array([0.95047, 1.0, 1.08883])
  delta = 6 / 29
  f = np.where(xyz > delta**3, np.cbrt(xyz), xyz / (3 * delta**2) + 4 / 29)
  return np.stack(
    [
      116 * f[..., 1] - 16,
      500 * (f[..., 0] - f[..., 1]),
      200 * (f[..., 1] - f[..., 2]),
    ],
    axis=-1,
  )


def table_colors(count: int) -> list[RGB]:
  """`count` distinct colours for a stack's member tables, in row order.

  Args:
    count: Number of tables.

  Returns:
    The first `count` colours of the palette: `TABLE_COLORS`, then each
    next colour as far (CIELAB delta E) from all before it and from
    `PADDING_COLOR` as the candidates allow. All differ from one another
    and from the padding grey.

  Raises:
    ValueError: For more tables than colours (about 3,000).
  """
  chosen = list(TABLE_COLORS[:count])
  if count <= len(chosen):
    return chosen
  levels = np.arange(0, 256, _GRID_STEP)
  grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1)
  grid = grid.reshape(-1, 3)
  lab = _cielab(grid)
  low, high = _LIGHTNESS
  keep = (lab[:, 0] >= low) & (lab[:, 0] <= high)
  grid, lab = grid[keep], lab[keep]
  if count > len(chosen) + len(grid):
    raise ValueError(
      f"{count} tables in one stack; the palette has "
      f"{len(chosen) + len(grid)} colours"
    )
  # Distance of each candidate to the nearest colour taken so far.
  nearest = np.full(len(grid), np.inf)
  for rgb in (PADDING_COLOR, *chosen):
    nearest = np.minimum(nearest, np.linalg.norm(lab - _cielab(rgb), axis=1))
  while len(chosen) < count:
    i = int(np.argmax(nearest))
    chosen.append(tuple(int(x) for x in grid[i]))
    nearest = np.minimum(nearest, np.linalg.norm(lab - lab[i], axis=1))
  return chosen
