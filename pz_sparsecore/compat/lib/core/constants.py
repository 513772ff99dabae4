"""jax-tpu-embedding's `lib/core/constants`."""

from pz_sparsecore.core.buffer_format import PAD_ID

PADDING_VALUE = PAD_ID
