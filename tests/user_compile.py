"""XLA options that compile a program as users' programs are compiled.

The suite compiles with XLA's classic CPU emitters where jaxlib has them
(`conftest.py` adds `FLAG` to `XLA_FLAGS`, for speed). Tests that read the
compiled program (which instructions touch a whole table) or compare the
last bits of two compiled programs pass `OPTIONS` to `jax.jit` or
`Lowered.compile`: the fusion emitters, XLA's default, which users get.
"""

import importlib.metadata

# jaxlib 0.10's XLA has both emitters; newer ones refuse the flag.
_CLASSIC = importlib.metadata.version("jaxlib").startswith("0.10.")

FLAG = "--xla_cpu_use_fusion_emitters=false" if _CLASSIC else ""
OPTIONS = {"xla_cpu_use_fusion_emitters": True} if _CLASSIC else None
