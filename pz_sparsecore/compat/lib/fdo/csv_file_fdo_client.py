"""jax-tpu-embedding's `lib/fdo/csv_file_fdo_client`: CSV statistics files."""

from pz_sparsecore.host.fdo import CSVFileFDOClient

__all__ = ["CSVFileFDOClient"]
