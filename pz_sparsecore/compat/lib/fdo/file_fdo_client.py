"""jax-tpu-embedding's `lib/fdo/file_fdo_client`: statistics in NPZ files."""

from pz_sparsecore.host.fdo import NPZFileFDOClient

__all__ = ["NPZFileFDOClient"]
