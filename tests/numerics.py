"""Values for the kernel tests and the comparison of their outputs.

`draw_slot` draws an optimizer slot's values from its registry domain
(`optimizers.SlotDomain`), never from the optimizer's name, so a new
optimizer's slots get values its update is defined on. `assert_close` is
`np.testing.assert_allclose` with NaN and infinities counted as
mismatches: `assert_allclose` counts NaN equal to NaN, so two
implementations that both fill a table with NaN (a slot drawn outside its
domain, a broken update) would compare equal. A case about NaN says so with
`allow_nan=True` (NaN and infinities then match where both sides have them).

Example: Adam's velocity is `NONNEGATIVE`, so `draw_slot` gives it values
in [0.1, 1); drawn from `normal()` instead, a third of its entries go below
0, `sqrt(v)` is NaN, and the compiled update and the reference both return
a NaN table, which `assert_close` refuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pz_sparsecore.core import optimizers

Domain = optimizers.SlotDomain

DOMAIN_TESTS = {
  Domain.REAL: lambda x: np.isfinite(x),
  Domain.NONNEGATIVE: lambda x: np.isfinite(x) & (x >= 0),
  Domain.POSITIVE: lambda x: np.isfinite(x) & (x > 0),
  Domain.COUNT: lambda x: np.isfinite(x) & (x >= 0) & (x == np.round(x)),
}
"""Whether each value of an array lies in a domain."""


def draw_slot(
  slot: optimizers.Slot, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
  """float32 values of `slot` in its domain, shaped `shape`.

  Accumulators (`NONNEGATIVE`, `POSITIVE`) are drawn in [0.1, 1): away
  from 0, where the updates' guards for a zero accumulator have tests of
  their own; counts in {0, ..., 4}; any real near 0 (`normal() * 0.1`).
  """
  domain = slot.domain
  if domain in (Domain.NONNEGATIVE, Domain.POSITIVE):
    values = rng.uniform(0.1, 1.0, shape)
  elif domain is Domain.COUNT:
    values = rng.integers(0, 5, shape)
  else:
    values = rng.normal(size=shape) * 0.1
  return values.astype(np.float32)


def _float(x: Any) -> np.ndarray:
  """`x` as a numpy array, 16-bit floats widened to float32."""
  x = np.asarray(x)
  if x.dtype.kind not in "biuf" or x.dtype.itemsize < 4:
    x = x.astype(np.float32)
  return x


def assert_close(
  actual: Any,
  desired: Any,
  rtol: float = 1e-7,
  atol: float = 0.0,
  *,
  err_msg: str = "",
  allow_nan: bool = False,
) -> None:
  """`np.testing.assert_allclose`, with a NaN or an infinity on either side
  a failure unless `allow_nan` (then they must sit in the same places).

  Raises:
    AssertionError: If the arrays differ, or one holds a non-finite value
      and `allow_nan` is False.
  """
  actual, desired = _float(actual), _float(desired)
  if not allow_nan:
    for side, x in (("actual", actual), ("desired", desired)):
      bad = ~np.isfinite(x)
      if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
          f"{err_msg}: {side} holds {int(bad.sum())} non-finite values of "
          f"{x.size} (the first at {first}); a case about NaN passes "
          "allow_nan=True"
        )
  np.testing.assert_allclose(
    actual, desired, rtol, atol, equal_nan=allow_nan, err_msg=err_msg
  )
