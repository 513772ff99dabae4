"""Device-side kernels: sparse-dense matmul and fused optimizer backward.

The buffers are one device's CSR-wrapped COO arrays, as written by the host
preprocessor (``pz_sparsecore.host.preprocess``). Per segment ``k`` (SparseCore)
the arrays ``embedding_ids``, ``sample_ids`` and ``gains`` hold ``seg_len``
entries and ``row_pointers`` holds ``rp_stride`` values; partition ``p`` of
the segment spans entries ``[r8(rp[p - 1]), rp[p])`` (``r8`` rounds up to a
multiple of ``buffer_format.ALIGNMENT``; the first partition starts at 0),
sorted by (row, sample). Gaps hold ``buffer_format.PAD_ID`` and NaN gains.

The kernels accept any contents of these buffers: entries whose id is
outside ``[0, rows_per_partition)`` (or ``PAD_ID``) or whose sample id is
outside ``[0, samples_per_segment)`` are skipped, ends are clamped to the
segment, ids need not be sorted (the C++ backward sorts a copy of a slice
that is not), and NaN or infinite gains propagate into the rows they touch,
as in the reference. Row pointers whose partition starts decrease (so that
partitions would overlap) make the CPU handlers raise; the CUDA handlers
change nothing and record the error on the device, without a host
synchronisation (:func:`raise_device_errors`).

Example, one segment, two partitions of 4 rows, two samples::

  row_pointers  = [2, 11]            # p0: [0, 2), p1: [8, 11)
  embedding_ids = [1, 3, PAD x 6, 0, 0, 2, PAD x 5]
  sample_ids    = [0, 1, PAD x 6, 0, 1, 1, PAD x 5]
  gains         = [1, 1, NaN x 6, .5, 1, 1, NaN x 5]
  # out[0] = table[1] + .5 * table[4]; out[1] = table[3] + table[4] + table[6]

:func:`sparse_dense_matmul` computes the activations and
:func:`sparse_dense_matmul_grad` applies the backward fused with an optimizer
update (an entry of ``pz_sparsecore.core.optimizers``), in place, to the
referenced rows only. The C++ handlers run on CPU (and on CUDA when built with
it); ``reference`` is the pure-JAX oracle and fallback. ``contract`` checks
every call's operands before either runs. :func:`backend_info` reports which
implementation runs on which platform; a fallback to the reference always warns
(:class:`KernelFallbackWarning`).

On Linux the CPU handlers ask for transparent huge pages behind table and slot
buffers of at least 32 MiB: the first time a buffer's address range is seen,
they ``madvise`` it ``MADV_HUGEPAGE`` and ``MADV_COLLAPSE`` (Linux >= 6.1), a
one-time cost of about 0.3-0.5 s per GiB (more if memory must be compacted)
that makes random row gathers from multi-GiB tables markedly faster (TLB
misses). Contents are unchanged and failures are ignored; set
``PZSC_HUGE_PAGES=0`` to turn it off.
"""

from __future__ import annotations

from pz_sparsecore.device.kernels import reference
from pz_sparsecore.device.kernels.backend import BackendInfo, backend_info
from pz_sparsecore.device.kernels.ffi import (
  ExtensionMismatchError,
  KernelFallbackWarning,
  raise_device_errors,
)
from pz_sparsecore.device.kernels.ffi import available as ffi_available
from pz_sparsecore.device.kernels.ops import (
  sparse_dense_matmul,
  sparse_dense_matmul_grad,
)

__all__ = [
  "BackendInfo",
  "ExtensionMismatchError",
  "KernelFallbackWarning",
  "backend_info",
  "ffi_available",
  "raise_device_errors",
  "reference",
  "sparse_dense_matmul",
  "sparse_dense_matmul_grad",
]
