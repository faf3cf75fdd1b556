"""Graded interventions: traceable masked forwards at chosen mask values.

`explore` jits these per loaded run and checks their arguments
(`explore.mask_sweep`, `explore.intervened_forward`). Two kinds:

- A *sweep* sets one component's mask to each of N values in [0, 2] and
  runs the N forwards as one batch: the prompt repeated N times, each row
  with its own mask (no Python loop of forwards). Every other component
  stays at 1 and the delta path `W − V·U` stays on, so value 1 is the
  target exactly, value 0 the component's ablation (`explore.
  ablated_forward`) and values past 1 amplify it.
- A *mode* masks every component at once the way the evaluation does
  (SPEC §5.11, §5.7): `ci_masked` (m = CI, no delta), `stochastic`
  (m = CI + (1 − CI)·U[0, 1], δ ~ U[0, 1] where the run has the delta
  component, from a seed) and `adversarial` (m = CI + (1 − CI)·S with
  sources S at scope `c`, one `[C]` vector per site shared by every
  position, started at U[0, 1] and moved by sign-PGD ascents of the
  output divergence, as the eval's fresh-PGD probe does).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key

from decompax.core import masks as masks_lib
from decompax.core.masks import SiteMask
from decompax.core.sites import SiteSpec
from decompax.core.target import TargetFns
from decompax.losses import adversarial

# A mask value is a component's scale: 0 removes it, 1 is the target's, 2
# doubles it.
MASK_RANGE = (0.0, 2.0)
MODES = ("ci_masked", "stochastic", "adversarial")


def graded_site_masks(sites: tuple[SiteSpec, ...], site_index: Int[Array, ""],
                      component: Int[Array, ""], values: Float[Array, " n"],
                      lead: tuple[int, ...]) -> dict[str, SiteMask]:
  """Return every site's masks for a batch of `lead = (n, …)` rows: row
  `i` has component `component` of `sites[site_index]` at `values[i]` at
  every position, every other component at 1 and the delta path on.
  Traceable in `site_index` and `component`, so one compiled sweep serves
  every component."""
  column = values.astype(jnp.float32).reshape(
    (lead[0],) + (1,) * (len(lead) - 1))
  out = {}
  for i, site in enumerate(sites):
    # `where`, not `1 + hot·(v − 1)`: the chosen mask is the value exactly.
    hot = (site_index == i) & (jnp.arange(site.c) == component)
    mask = jnp.where(hot, column[..., None], 1.0)
    out[site.name] = SiteMask(
      jnp.broadcast_to(mask, (*lead, site.c)).astype(jnp.float32),
      jnp.ones(lead, jnp.float32))
  return out


def sweep_outputs(target: TargetFns, weights, components,
                  inputs: Any, site_index: Int[Array, ""],
                  component: Int[Array, ""], values: Float[Array, " n"]
                  ) -> Float[Array, "n ..."]:
  """Return the model's output on one example `inputs` (no batch axis)
  with the chosen component at each of `values`, as one batch of
  `len(values)` rows."""
  n = values.shape[0]
  tiled = jnp.broadcast_to(inputs[None], (n, *inputs.shape))
  lead = tuple(target.batch_lead_shape(tiled))
  masks = graded_site_masks(target.sites, site_index, component, values, lead)
  return target.masked_forward(weights, components, tiled, masks)


def sweep_log_probs(target: TargetFns, weights, components,
                    tokens: Int[Array, " t"], site_index: Int[Array, ""],
                    component: Int[Array, ""], values: Float[Array, " n"],
                    position: Int[Array, ""], token: Int[Array, ""]
                    ) -> tuple[Float[Array, " n"], Int[Array, ""],
                               Int[Array, ""]]:
  """Return, per value, the log-probability of `token` at `position` (the
  next-token prediction after `tokens[: position + 1]`), with the token
  (a negative `token` picks the clean model's top prediction there) and
  the vocabulary size, for the caller to check the token against."""
  clean, _ = target.clean_forward(weights, tokens[None], ())
  chosen = jnp.where(token < 0, jnp.argmax(clean[0, position]), token)
  logits = sweep_outputs(target, weights, components, tokens, site_index,
                         component, values)
  rows = jax.nn.log_softmax(logits[:, position].astype(jnp.float32), axis=-1)
  return rows[:, chosen], chosen, jnp.int32(clean.shape[-1])


def adversarial_site_masks(target: TargetFns, weights, components,
                           ci: dict[str, Float[Array, "*l c"]], inputs: Any,
                           clean: Float[Array, "..."], key: Key[Array, ""],
                           n_steps: Int[Array, ""], step_size: float
                           ) -> dict[str, SiteMask]:
  """Return the masks at the eval probe's sign-PGD sources
  (`adversarial.probe_sources`, SPEC §5.7) against the divergence of the
  masked output from `clean`."""
  names = tuple(s.name for s in target.sites)

  def divergence(s):
    masks = masks_lib.source_site_masks(ci, s, names, None)
    return target.divergence(
      target.masked_forward(weights, components, inputs, masks), clean)

  sources = adversarial.probe_sources(
    target.sites, tuple(target.batch_lead_shape(inputs)), key, divergence,
    n_steps, step_size)
  return masks_lib.source_site_masks(ci, sources, names, None)


def mode_site_masks(target: TargetFns, weights, components,
                    ci: dict[str, Float[Array, "*l c"]], inputs: Any,
                    clean: Float[Array, "..."], mode: str, key: Key[Array, ""],
                    with_delta: bool, n_steps: Int[Array, ""],
                    step_size: float) -> dict[str, SiteMask]:
  """Return every site's masks under intervention `mode` (one of MODES)."""
  if mode == "adversarial":
    return adversarial_site_masks(target, weights, components, ci, inputs,
                                  clean, key, n_steps, step_size)
  if mode not in MODES:
    raise ValueError(f"unknown intervention mode {mode!r}; use one of "
                     f"{MODES}")
  # The rounding threshold is the `rounded` variant's, which no mode is.
  return masks_lib.variant_site_masks(mode, key, ci, target.sites,
                                      with_delta, 0.5)
