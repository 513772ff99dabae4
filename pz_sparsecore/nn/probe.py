"""Activation probes: how a trainer reads a layer's activation gradients.

Tables are never differentiated, so a training step needs two things from
every `SparseCoreEmbed` the loss calls: the gradient of the loss with respect
to its activations, and the `PreprocessedInput` the activations came from
(the fused update routes that gradient back along the same buffers).

The trainer gets both through the layer's `activation_probe` field, the
way Penzai's `toolshed/save_intermediates.py` captures values: it sets the
field, inside the function it differentiates, to an `ActivationProbe` that
holds

* `probes`: one zero array per feature, shaped like the feature's flat
  activations `[samples, dim]`, which `__call__` adds to the activations.
  The loss does not change, and its gradient with respect to a probe is its
  gradient with respect to that feature's activations;
* `record`: a `pz.StateVariable`, initially `()`, to which `__call__`
  appends its `PreprocessedInput`; the trainer reads it after the loss
  function returns.

Example: a feature of 64 samples and output width 16 gets a `[64, 16]` zero
probe; a loss that calls the layer once leaves `record.value ==
(inputs,)`, and `jax.grad` with respect to the probe gives `dL/d acts`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz

from pz_sparsecore.core.plan import Plan


@pz.pytree_dataclass
class ActivationProbe(pz.Struct):
  """Zero probes for a layer's activations, and a record of its inputs.

  Attributes:
    probes: Feature name → zero `[samples, dim]` array added to the
      feature's flat activations.
    record: `pz.StateVariable` holding the tuple of `PreprocessedInput`s the
      layer was called with.
  """

  probes: dict[str, jax.Array] | None
  record: pz.StateVariable

  @classmethod
  def attach(cls, probes: dict[str, jax.Array], label: str) -> ActivationProbe:
    """A probe with an empty record.

    Args:
      probes: The arrays to add (from `zero_probes`, as differentiated),
        or None to record the call only.
      label: Label of the record variable.

    Returns:
      The probe.
    """
    return cls(probes=probes, record=pz.StateVariable(value=(), label=label))

  def observe(
    self, activations: dict[str, jax.Array], inputs: Any
  ) -> dict[str, jax.Array]:
    """Records `inputs` and returns the activations plus the probes.

    Args:
      activations: Feature name → flat `[samples, dim]` activations.
      inputs: The `PreprocessedInput` they were looked up from.

    Returns:
      The activations with the probes added (unchanged, recording
      `(inputs, activations)`, for a probe of None, which only learns the
      call's shapes).
    """
    if self.probes is None:
      self.record.value = (*self.record.value, (inputs, activations))
      return activations
    self.record.value = (*self.record.value, inputs)
    return {
      name: value + self.probes[name] for name, value in activations.items()
    }


def zero_probes(plan: Plan) -> dict[str, jax.Array]:
  """Feature name → zeros shaped like its flat activations `[samples, dim]`.

  Args:
    plan: The layer's plan.

  Returns:
    One float32 zero array per feature, in pytree-leaf order.
  """
  return {
    name: jnp.zeros((feature.spec.sample_count, feature.dim), jnp.float32)
    for name, feature in plan.features.items()
  }
