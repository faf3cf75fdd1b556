"""The function table a target model exposes to the decomposition engine.

A target is described by pure functions over its frozen weights (a pytree the
engine passes as a runtime argument, never a closed-over constant) and a batch
of inputs. Tap keys name activations of the clean forward; the key of a site's
name is that site's input.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

from jaxtyping import Array, Float

from decompax.core.masks import SiteMask
from decompax.core.sites import Components, SiteSpec

Weights = Any
Batch = Any

# (weights, inputs, wanted tap keys) -> (output, {tap key: activation}).
CleanForward = Callable[
  [Weights, Batch, tuple[str, ...]],
  tuple[Float[Array, "..."], dict[str, Float[Array, "..."]]],
]
# (weights, components, inputs, {live site: SiteMask}) -> output. Sites absent
# from the dict run the frozen `x·W`.
MaskedForward = Callable[
  [Weights, Components, Batch, dict[str, SiteMask]], Float[Array, "..."]
]
# (weights, components, inputs, {live site: SiteMask}, clean taps, wanted tap
# keys) -> (output, {tap key: activation of the masked forward}). `clean_taps`
# holds what the clean forward returned for the step (at least `start_taps`),
# so a target may start from a stored boundary instead of the inputs.
MaskedForwardTaps = Callable[
  [Weights, Components, Batch, dict[str, SiteMask],
   dict[str, Float[Array, "..."]], tuple[str, ...]],
  tuple[Float[Array, "..."], dict[str, Float[Array, "..."]]],
]
# (weights, masked forward's taps, clean forward's taps) -> {block label:
# mean KL of the clean forward's attention rows to the masked forward's}.
AttentionDivergence = Callable[
  [Weights, dict[str, Float[Array, "..."]], dict[str, Float[Array, "..."]]],
  dict[str, Float[Array, ""]],
]
# (masked forward's taps, clean forward's taps) -> {layer label: mean KL of
# the clean forward's router distribution to the masked forward's}.
RouterDivergence = Callable[
  [dict[str, Float[Array, "..."]], dict[str, Float[Array, "..."]]],
  dict[str, Float[Array, ""]],
]
# weights -> {kind: W stack [layer, d_in, d_out]} in the orientation y = x·W.
FrozenStacks = Callable[[Weights], dict[str, Float[Array, "layer d_in d_out"]]]
# (masked output, clean output) -> scalar divergence, mean over positions.
Divergence = Callable[
  [Float[Array, "..."], Float[Array, "..."]], Float[Array, ""]
]


# (weights, masked forward's head input, clean forward's) -> the head's
# outputs' `Divergence`, computed without ever holding a whole output.
HeadDivergence = Callable[
  [Weights, Float[Array, "..."], Float[Array, "..."]], Float[Array, ""]
]


class SplitHead(NamedTuple):
  """A target's forwards stopped at the input of its output head, and the
  head fused with the divergence: what a train step runs instead of the
  full outputs when those are large (an LM's `[tokens, vocab]` logits;
  `--output_chunk`). The forwards are `clean_forward` and
  `masked_forward_taps` with the head left out; `divergence` equals
  `TargetFns.divergence` of the head's outputs, values and gradients."""

  clean_forward: CleanForward
  masked_forward_taps: MaskedForwardTaps
  divergence: HeadDivergence


@dataclasses.dataclass(frozen=True)
class UnitSpec:
  """How a site's output axis splits into `n_units` contiguous nonlinear
  units of one kind (`neuron`, `attention_head`), each counted `multiplicity`
  times (SPEC §5.10)."""

  kind: str
  n_units: int
  multiplicity: float = 1.0


@dataclasses.dataclass(frozen=True)
class Expected:
  """The CI pattern a toy site reaches when decomposed well (SPEC §10, §11).

  `identity`: one component per feature, uniquely active on it. `dense`:
  `k` components active on every probe input, all others silent.
  `feature_axis` is the axis of the site's `W: [d_in, d_out]` that features
  index (0: each feature writes row `W[f]`; 1: column `W[:, f]`), for the
  MMCS/ML2R match; None where neither axis is the feature axis.
  """

  pattern: str
  k: int = 0
  feature_axis: Optional[int] = None

  def __post_init__(self):
    if self.pattern not in ("identity", "dense"):
      raise ValueError(f"expected pattern must be identity or dense, got "
                       f"{self.pattern!r}")
    if (self.pattern == "dense") != (self.k > 0):
      raise ValueError("a dense pattern needs its k > 0; identity takes none")
    if self.feature_axis not in (None, 0, 1):
      raise ValueError(f"feature_axis must be 0, 1 or None, got "
                       f"{self.feature_axis}")


class TargetFns(NamedTuple):
  """Everything the engine needs to know about a target model."""

  sites: tuple[SiteSpec, ...]
  clean_forward: CleanForward
  masked_forward: MaskedForward
  frozen_stacks: FrozenStacks
  divergence: Divergence
  # Leading (non-feature) shape of the batch's activations, e.g. (B,) or (B,T).
  batch_lead_shape: Callable[[Batch], tuple[int, ...]]
  # Returns the CI probe batch (one input per feature, SPEC §10: `0.75·e_i`);
  # None for targets without features to probe (language models).
  feature_probe: Optional[Callable[[], Batch]] = None
  # Sites whose outputs feed nonlinear units, for the locality loss.
  nonlinear_units: Optional[dict[str, UnitSpec]] = None
  # Masked forward that also returns activations (hidden-activation
  # reconstruction, SPEC §5.9) and may start from the clean pass's boundaries.
  # Tap key `<site>.out` is a site's output in both forwards.
  masked_forward_taps: Optional[MaskedForwardTaps] = None
  # Tap keys every step requests from the clean forward for masked starts.
  start_taps: tuple[str, ...] = ()
  # Language models: inputs -> int next-token labels over the batch's leading
  # shape, negative where a position has none (a sequence's last). Enables
  # the CE evals (SPEC §5.11); None for targets without token labels.
  token_labels: Optional[Callable[[Batch], Any]] = None
  # Toys: the pattern each site's probe CI should reach, by site name.
  expected: Optional[dict[str, Expected]] = None
  # Targets with attention: the taps both forwards return for
  # `attention_divergence` (the eval's attention-pattern recon, SPEC §11);
  # () where no decomposed site is one the readout covers. None: the
  # target has no attention.
  attention_taps: tuple[str, ...] = ()
  attention_divergence: Optional[AttentionDivergence] = None
  # Mixture-of-experts targets: the taps both forwards return for
  # `router_divergence` (the eval's router recon, design §11); () where
  # masking the sites moves no router. None: the target has no router.
  router_taps: tuple[str, ...] = ()
  router_divergence: Optional[RouterDivergence] = None
  # Dual-role CI: the activations a hidden pass reconstructs by default
  # (() : every site's `<site>.out`), and whether masking the sites can move
  # a given tap at all (None: only the sites' own outputs are known to).
  hidden_pass_points: tuple[str, ...] = ()
  masking_reaches: Optional[Callable[[str], bool]] = None
  # The train step's forwards without the output head, the head fused with
  # the divergence (`SplitHead`); None: the step computes whole outputs.
  # Evaluation always reads whole outputs.
  split_head: Optional[SplitHead] = None
