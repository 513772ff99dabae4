"""jax-tpu-embedding's `lib/fdo/fdo_client`: the FDO client interface."""

from pz_sparsecore.host.fdo import FDOClient

__all__ = ["FDOClient"]
