"""Any batch size for `SparseCoreEmbed`: buckets, padding, the real samples.

A layer's feature specs fix the batch its buffers are planned for (each
feature's `output_shape[0]`, the size of its first sample axis). Its
`preprocess` also takes a batch of any other size: the batch is padded with
empty samples (they look nothing up) to a *bucket*, the buffers are those
of the specs' plan resized to the bucket (`layout.with_batch_sizes`: same
tables and stacks; the limits of a smaller bucket, and `k` times them for
a bucket `k` times larger), and the call returns the real samples only.

The rule, per feature and per process, with `L` the specs' local batch
(`output_shape[0]` over the processes) and `u` the fewest samples whose
rows divide over the process's SparseCores (1 for a one-axis feature on a
power-of-two device count):

* `n == L`: the specs' own plan; the buffers are exactly as before.
* otherwise the bucket is `u * 2**k`, the smallest such size `>= n`, except
  that a batch smaller than `L` never gets a bucket larger than `L`.

So a layer specified for 4,096 samples on 8 shards takes a last batch of
1,000 in the 1,024 bucket, one sample in the 8 bucket and 5,000 in 8,192;
the buckets are powers of two (times `u`), at most `log2(max / u) + 2` of
them. Each bucket has its own buffer shapes, so its call compiles once.

The call's outputs hold the real samples (`BatchShape.samples`), so a loss
or metric needs no mask. That makes the real sample count part of the
compiled program: every distinct count compiles once (a training loop's
full and last batches: twice, whatever the number of epochs). A server that
sees many sizes passes `keep_padding=True`: the outputs then hold the
bucket's samples (padding samples read zeros) and it compiles once per
bucket; it reads the first `n` rows.

With several processes each passes the same number of samples (as for the
specs' batch); process `p`'s samples are the `p`-th block of the global
batch, so the outputs hold each process's real samples in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.preprocessed import BatchShape, PreprocessedInput
from pz_sparsecore.host import ragged_input

__all__ = ["BatchShape", "bucket_size", "buckets"]


def _rest(spec: Any) -> int:
  """Samples of one first-axis entry: the other sample axes' product."""
  return math.prod(spec.output_shape[1:-1])


def _unit(rest: int, sparsecores: int) -> int:
  """The fewest first-axis entries whose rows divide over `sparsecores`."""
  return sparsecores // math.gcd(sparsecores, rest)


def bucket_size(samples: int, specs_batch: int, unit: int = 1) -> int:
  """The bucket of a batch of `samples` (module docstring's rule).

  Args:
    samples: The batch's size (first sample axis, one process).
    specs_batch: The specs' local batch `L`.
    unit: `u`, the bucket sizes' factor.

  Returns:
    The size the batch is padded to.

  Example: `bucket_size(1000, 4096, 1) == 1024`, `bucket_size(3000, 4096)
  == 4096`, `bucket_size(3, 96, 6) == 6`, `bucket_size(80, 96, 6) == 96`.
  """
  if samples == specs_batch:
    return specs_batch
  size = unit * (1 << max(0, -(-samples // unit) - 1).bit_length())
  return min(size, specs_batch) if samples <= specs_batch else size


def buckets(embed: Any, max_samples: int) -> list[int]:
  """Every bucket of `embed`'s first feature for batches of 1 to
  `max_samples` samples (global), in order: the sizes its call compiles
  for (with `keep_padding`).

  Args:
    embed: A `SparseCoreEmbed`.
    max_samples: The largest batch.
  """
  config = embed.config
  spec = config.plan.feature_specs[0]
  p = jax.process_count()
  local = config.topology.num_shards // p
  unit = _unit(_rest(spec), local)
  return sorted(
    {
      p * bucket_size(n, spec.output_shape[0] // p, unit)
      for n in range(1, max_samples // p + 1)
    }
  )


def pad_batch(
  config: Any,
  features: Any,
  weights: Any,
  local_devices: int,
  keep_padding: bool,
) -> tuple[Any, Any, BatchShape | None]:
  """A local batch padded to its buckets, for `preprocess`.

  Args:
    config: The layer's `EmbedConfig`.
    features: The flattened features (`_flatten_samples`'s).
    weights: Their weights, or None.
    local_devices: This process's devices along the shard axis.
    keep_padding: Whether the call returns the buckets' samples.

  Returns:
    `(features, weights, batch)`: unchanged with a batch of None when every
    feature has the specs' batch, else padded, with their `BatchShape`.

  Raises:
    ValueError: Naming the feature, for an empty batch, rows that do not
      fill its other sample axes, or features of one batch axis given
      different sample counts.
  """
  plan = config.plan
  specs = plan.feature_specs
  p = jax.process_count()
  ids = plan.treedef.flatten_up_to(features)
  w = (
    [None] * len(ids)
    if weights is None
    else plan.treedef.flatten_up_to(weights)
  )
  counts = []
  for spec, leaf in zip(specs, ids, strict=True):
    rows, rest = ragged_input.count_rows(spec.name, leaf), _rest(spec)
    if rows == 0:
      raise ValueError(f"feature {spec.name!r}: empty batch (no samples)")
    if rows % rest:
      raise ValueError(
        f"feature {spec.name!r}: {rows} rows do not fill its sample axes "
        f"{tuple(spec.output_shape[:-1])} (a multiple of {rest} rows)"
      )
    counts.append(rows // rest)
  local = [spec.output_shape[0] // p for spec in specs]
  if counts == local:
    return features, weights, None
  seen: dict[tuple[str, int], tuple[str, int]] = {}
  for spec, axes, n in zip(specs, config.feature_axes, counts, strict=True):
    key = (axes[0], spec.output_shape[0])
    first = seen.setdefault(key, (spec.name, n))
    if first[1] != n:
      raise ValueError(
        f"feature {spec.name!r}: {n} samples along {axes[0]!r}, but feature "
        f"{first[0]!r} of the same batch axis has {first[1]}"
      )
  sparsecores = local_devices * config.topology.num_sc_per_device
  padded = [
    bucket_size(n, size, _unit(_rest(spec), sparsecores))
    for spec, n, size in zip(specs, counts, local, strict=True)
  ]
  out_ids, out_w = [], []
  for spec, leaf, weight, size in zip(specs, ids, w, padded, strict=True):
    leaf, weight = ragged_input.pad_rows(
      spec.name, leaf, weight, size * _rest(spec)
    )
    out_ids.append(leaf)
    out_w.append(weight)
  batch = BatchShape(
    samples=tuple(p * n for n in (padded if keep_padding else counts)),
    padded=tuple(p * n for n in padded),
  )
  features = jax.tree.unflatten(plan.treedef, out_ids)
  if weights is not None:
    weights = jax.tree.unflatten(plan.treedef, out_w)
  return features, weights, batch


@functools.lru_cache(maxsize=64)
def _resized(config: Any, sizes: tuple[int, ...]) -> Any:
  topo = config.topology
  specs = layout.with_batch_sizes(
    config.plan.specs_tree, sizes, topo.num_devices, topo.num_sc_per_device
  )
  plan = plan_lib.build(specs, topo.num_devices, topo.num_sc_per_device)
  return dataclasses.replace(config, plan=plan)


def _config_of_sizes(config: Any, sizes: tuple[int, ...]) -> Any:
  """The config of buffers whose features' first axes are `sizes`."""
  if sizes == tuple(spec.output_shape[0] for spec in config.plan.feature_specs):
    return config
  return _resized(config, sizes)


def config_for(config: Any, batch: BatchShape | None) -> Any:
  """The config of buffers of `batch` (the layer's own for None)."""
  return config if batch is None else _config_of_sizes(config, batch.padded)


def config_of_inputs(config: Any, inputs: Any) -> Any:
  """The config of `inputs`' batch: the layer's own unless they are
  `PreprocessedInput`s of another batch size."""
  if isinstance(inputs, PreprocessedInput):
    return config_for(config, inputs.batch)
  return config


def config_of_activations(config: Any, activations: Any) -> Any:
  """The config of the call that gave these flat `[samples, dim]`
  activations (or their gradients), by feature name."""
  return _config_of_sizes(
    config,
    tuple(
      activations[spec.name].shape[0] // _rest(spec)
      for spec in config.plan.feature_specs
    ),
  )


def real_samples(
  value: jax.Array, batch: BatchShape | None, index: int
) -> jax.Array:
  """Feature `index`'s activations `[padded, ...]` cut to the samples its
  call returns (each process's first ones)."""
  if batch is None or batch.samples[index] == batch.padded[index]:
    return value
  padded, samples = batch.padded[index], batch.samples[index]
  p = jax.process_count()
  blocks = value.reshape(p, padded // p, *value.shape[1:])
  return blocks[:, : samples // p].reshape(samples, *value.shape[1:])


def padded_gradient(
  grad: jax.Array, batch: BatchShape | None, index: int
) -> jax.Array:
  """The inverse of `real_samples` for a gradient: zeros for the padding."""
  if batch is None or batch.samples[index] == batch.padded[index]:
    return grad
  padded, samples = batch.padded[index], batch.samples[index]
  p = jax.process_count()
  blocks = grad.reshape(p, samples // p, *grad.shape[1:])
  widths = [(0, 0), (0, (padded - samples) // p)]
  widths += [(0, 0)] * (grad.ndim - 1)
  return jnp.pad(blocks, widths).reshape(padded, *grad.shape[1:])


def has_batch(tree: Any) -> bool:
  """Whether some `PreprocessedInput` in `tree` has another batch size."""
  leaves = jax.tree.leaves(
    tree, is_leaf=lambda x: isinstance(x, PreprocessedInput)
  )
  return any(
    isinstance(x, PreprocessedInput) and x.batch is not None for x in leaves
  )
