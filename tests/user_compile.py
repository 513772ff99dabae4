"""XLA options that compile a program as users' programs are compiled.

The suite compiles with XLA's classic CPU emitters where jaxlib has them
(`conftest.py`, for speed). Tests that read the compiled program (which
instructions touch a whole table) or compare the last bits of two compiled
programs pass `OPTIONS` to `jax.jit` or `Lowered.compile`: the fusion
emitters, XLA's default, which users get.
"""

import os

OPTIONS = (
  {"xla_cpu_use_fusion_emitters": True}
  if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
  else None
)
