"""Treescope's device colours, the colours of a stack's tables, padding grey.

Devices are drawn as Treescope draws them in its sharding view
(`treescope.render_array_sharding`): device `d` is the integer `d + 1` in
Treescope's "digitbox" style, a square per decimal digit, nested from the
outside in, each in its digit's colour (`DIGIT_COLORS`: D3's category10 with
white for 0), or in the digit's lighter colour (`DIGIT_COLORS_REPEATED`:
category20's second shades) where a digit repeats the one drawn outside it.
Devices 0 to 8 are one square of `DEVICE_COLORS[d]`; device 9 is "10" (a blue
square around a white one), device 10 is "11" (blue around light blue).
`device_colors(d)` gives the squares of any device. (A shard held by
several devices is drawn as Treescope's sharding view draws it; see
`viz.placement`.)

A shard map colours each row by the table that owns it, so a stack needs as
many colours as it has tables, all different, none like the grey of the
padding rows and none like a device: the DLRM benchmark stacks 26 tables
into one stack. `table_colors(count)` picks, one at a time, the candidate
farthest from every colour to avoid (the 20 digit colours of both shades,
which include white and Treescope's grey, and `PADDING_COLOR`) and from every
table colour chosen so far (a greedy Glasbey palette). Distances are
CIELAB's delta E (Euclidean in L*a*b*); the candidates are the sRGB grid of
step 17 with lightness L* in [35, 85], neither near black (Treescope's
outlines) nor near the white page. Every call gives the same sequence, so a
shorter palette is the start of a longer one. Measured: the 26 colours of
the DLRM stack are each at least 26.9 from every digit colour and
33.7 from the padding grey, and at least 27.0 from one another (8 tables:
37.4 from the digit colours, 38.4 apart; 200 tables: 12.9 and 12.8; a
difference of 2.3 is just noticeable).
"""

from __future__ import annotations

import numpy as np

RGB = tuple[int, int, int]

DIGIT_COLORS: tuple[RGB, ...] = (
  (255, 255, 255),
  (31, 119, 180),
  (255, 127, 14),
  (44, 160, 44),
  (214, 39, 40),
  (148, 103, 189),
  (140, 86, 75),
  (227, 119, 194),
  (188, 189, 34),
  (23, 190, 207),
)
"""Colour of each decimal digit 0-9 in Treescope's digitbox drawing
(`digitColorPrimary` of its `arrayviz.js`)."""

DIGIT_COLORS_REPEATED: tuple[RGB, ...] = (
  (127, 127, 127),
  (174, 199, 232),
  (255, 187, 120),
  (152, 223, 138),
  (255, 152, 150),
  (197, 176, 213),
  (196, 156, 148),
  (247, 182, 210),
  (219, 219, 141),
  (158, 218, 229),
)
"""Colour of a digit that repeats the digit drawn around it
(`digitColorSecondary`)."""

DEVICE_COLORS: tuple[RGB, ...] = DIGIT_COLORS[1:]
"""Colour of devices 0 to 8 (the digits 1 to 9); see `device_colors`."""


PADDING_COLOR: RGB = (210, 210, 210)
"""Colour of padding rows."""


def device_colors(device: int) -> tuple[RGB, ...]:
  """The colours Treescope draws device `device` in, outermost square first.

  Args:
    device: Device index (0 upwards).

  Returns:
    One colour per digit of `device + 1`: device 3 is `(DEVICE_COLORS[3],)`;
    device 10 ("11") is blue around light blue.
  """
  return digit_colors(device + 1)


def digit_colors(value: int) -> tuple[RGB, ...]:
  """The nested squares of Treescope's digitbox of `value` (>= 0),
  outermost first: a digit equal to the one just outside it takes its
  lighter shade, unless that one took the lighter shade itself."""
  colors = []
  previous = None
  for digit in map(int, str(value)):
    if digit == previous:
      colors.append(DIGIT_COLORS_REPEATED[digit])
      previous = None
    else:
      colors.append(DIGIT_COLORS[digit])
      previous = digit
  return tuple(colors)


_GRID_STEP = 17  # 16 levels per channel: 4,096 candidates.
_LIGHTNESS = (35.0, 85.0)  # L* of the candidates.

AVOIDED_COLORS: tuple[RGB, ...] = (
  *DIGIT_COLORS,
  *DIGIT_COLORS_REPEATED,
  PADDING_COLOR,
)
"""Colours no table colour comes near: every colour Treescope draws devices
in (white and its grey among them), and the padding grey."""


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
    The first `count` colours of the palette, each as far (CIELAB delta E)
    from `AVOIDED_COLORS` (Treescope's digit colours, white, the padding
    grey) and from all colours before it as the candidates allow. All
    differ from one another, from every device colour and from the padding
    grey; a shorter palette is the start of a longer one.

  Raises:
    ValueError: For more tables than colours (about 2,000).
  """
  levels = np.arange(0, 256, _GRID_STEP)
  grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1)
  grid = grid.reshape(-1, 3)
  lab = _cielab(grid)
  low, high = _LIGHTNESS
  keep = (lab[:, 0] >= low) & (lab[:, 0] <= high)
  grid, lab = grid[keep], lab[keep]
  if count > len(grid):
    raise ValueError(
      f"{count} tables in one stack; the palette has {len(grid)} colours"
    )
  # Distance of each candidate to the nearest colour taken so far.
  nearest = np.full(len(grid), np.inf)
  for rgb in AVOIDED_COLORS:
    nearest = np.minimum(nearest, np.linalg.norm(lab - _cielab(rgb), axis=1))
  chosen: list[RGB] = []
  while len(chosen) < count:
    i = int(np.argmax(nearest))
    chosen.append(tuple(int(x) for x in grid[i]))
    nearest = np.minimum(nearest, np.linalg.norm(lab - lab[i], axis=1))
  return chosen


TABLE_COLORS: tuple[RGB, ...] = tuple(table_colors(8))
"""The first colours of `table_colors`, for a stack's first member tables."""
