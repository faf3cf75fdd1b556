"""The jitted evaluation passes over held-out batches (SPEC §11).

`make_eval_step` returns two jitted pure functions, each compiled once: the
fast tier `(state, weights, key, batches)` and the slow tier, which takes the
fast tier's batches back instead of reading data again. Held-out batches
come from the host (`batches` stacked `[n_batches, ...]`, e.g. windows of a
token file read once) or, without them, batch `i` is
`sample_inputs(fold_in(fold_in(key, i), 0))`; either way a fixed `key`
gives the same held-out set at every eval. Every per-batch value is returned stacked
on a leading `batch` axis and reduced on the host by `summarize`, which
keeps counts exact (int64) over any number of batches.

Fast tier, per batch: CI-L0 and firing counts per site, the output divergence
of every mask variant (`core.masks.VARIANTS`) and at the fresh-PGD probe's
sources (`recon/pgd`, SPEC §5.7), CE differences for targets with
token labels, optionally the attention-pattern recon (`attn_kl/`) and, for
a mixture-of-experts target, the router recon (`router_kl/`), both from the
CI-masked and stochastic forwards themselves, and every training term
(plus their coefficiented total) on the eval batch with the state's term
states. Toys add their probe CI and,
for sites whose expected pattern names a feature axis, the site's target
weight and factors, matched on the host (MMCS/ML2R, SPEC §10).
Slow tier adds: histograms of `lower` and `pre` CI, per-component CI sums and
log-band density counts, hidden-activation errors at `<site>.out` (SPEC
§5.9) and, for positioned targets, the batch-mean `[T, C]` CI; token targets
add each component's top-CI positions and the batch's tokens. Sites feeding
nonlinear units add each component's soft unit count and participation
ratio (SPEC §5.10): weight space, so computed once per eval, not per batch.

A dual-role CI function (`CIFn.roles`: output and hidden, SPEC §6.6) has
both tiers read out both roles from one trunk: every stat above is the
output role's. In the fast tier the hidden role adds its CI-L0
(`ci_l0_hidden/<site>`) and, given `EvalConfig.hidden_points`, the relative
error of those activations under its CI masks (`recon/hidden_ci_masked`);
each hidden-role term is scored on the hidden pass, as the train step scores
it. In the slow tier it adds its CI distributions beside the output role's,
the same stats under `<stat>_hidden/<site>` (`CI_DISTRIBUTIONS`). The
per-position CI, the top contexts and the hidden-activation errors stay the
output role's: they describe what a forward keeps, which the output masks
decide.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Key

from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.core import slots, squash
from decompax.core.ci_fns import HIDDEN, OUTPUT, CIFn, role_suffix
from decompax.core.masks import SiteMask
from decompax.core.sites import Components
from decompax.core.target import Batch, Expected, TargetFns, Weights
from decompax.core.step_objective import (
  objective, prepare, prepare_roles, prepared_of, with_prepared)
from decompax.core.step_records import (
  Constrain, LossTerm, StepContext, StreamSpec, TrainState, no_constraint)
from decompax.core.step_streams import clean_tap_keys, role_index
from decompax.core.train_step import ci_l0
from decompax.evals import eval_metrics
from decompax.losses import adversarial, hidden, locality, recon
from decompax.measures import ci_counts, probe


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Static settings of the eval pass."""

  n_batches: int
  total_steps: int
  ci_alive_threshold: float = 0.1
  with_delta: bool = False
  n_mask_samples: int = 1
  top_contexts: int = 8
  # The fresh-PGD probe (SPEC §5.7): sign ascents and their step (0: off).
  pgd_steps: int = 20
  pgd_lr: float = 0.1
  # The train step's `StepConfig.compute_dtype` (N4; None: the masters).
  compute_dtype: str | None = None
  # The attention-pattern recon (SPEC §11): per block the target reports,
  # the KL of its clean attention rows to the CI-masked and stochastic
  # forwards' (`TargetFns.attention_divergence`).
  attention_kl: bool = False
  # A dual-role CI function's hidden pass reconstructs these activations
  # (the train step's `StepConfig.hidden_points`); a one-role one reads
  # none, so they are ignored there.
  hidden_points: tuple[str, ...] = ()

  def __post_init__(self):
    if self.pgd_steps < 0:
      raise ValueError(f"eval PGD steps must be >= 0, got {self.pgd_steps}")
    if self.pgd_lr <= 0:
      raise ValueError(f"eval PGD step size must be positive, got "
                       f"{self.pgd_lr}")


class FeatureFactors(NamedTuple):
  """One site's target weight and its factors, for the MMCS/ML2R match."""

  weight: Float[Array, "d_in d_out"]
  v: Float[Array, "d_in c"]
  u: Float[Array, "c d_out"]


class EvalOutput(NamedTuple):
  """Device results of one eval pass; every leaf has a leading batch axis
  except `probe` (one `[n_features, C]` CI per site, toys only),
  `features` (toys) and the slow tier's weight-space `unit_count/` and
  `unit_ratio/` stats (one `[C]` per site)."""

  scalars: dict[str, Array]
  stats: dict[str, Array]
  probe: dict[str, Array]
  features: dict[str, FeatureFactors] = {}


def feature_factors(target: TargetFns, weights: Weights,
                    components: Components) -> dict[str, FeatureFactors]:
  """Return `W`, `V`, `U` of every site whose expected pattern names a
  feature axis ({} for targets without one). Indexing only: the fast pass
  runs it under jit, the end-of-run summary eagerly."""
  expected = target.expected or {}
  matched = [s for s in target.sites if s.name in expected
             and expected[s.name].feature_axis is not None]
  if not matched:
    return {}
  stacks = target.frozen_stacks(weights)
  return {s.name: FeatureFactors(stacks[s.kind][s.row],
                                 *sites_lib.site_factors(components, s))
          for s in matched}


def _site_out_keys(target: TargetFns) -> tuple[str, ...]:
  return tuple(f"{s.name}.out" for s in target.sites)


# The mask variants whose forwards also return attention and router taps:
# the ones the attention-pattern and router recons score (SPEC §11).
ATTENTION_VARIANTS = ("ci_masked", "stochastic")


def _check_attention(target: TargetFns) -> None:
  """Raise ValueError unless the target can score attention patterns."""
  if (target.attention_divergence is None
      or target.masked_forward_taps is None):
    raise ValueError("the attention-pattern eval compares attention "
                     "patterns, and this target has no attention; turn it "
                     "off or decompose a language model")
  if not target.attention_taps:
    raise ValueError("the attention-pattern eval scores blocks with a "
                     "decomposed q_proj or k_proj, and no site is one; add "
                     "one to the sites or turn the eval off")


def _scored_taps(target: TargetFns, config: EvalConfig) -> tuple[str, ...]:
  """Return the taps the CI-masked and stochastic forwards return: the
  attention recon's when it is on, and a mixture-of-experts target's
  router logits wherever masking moves them (always scored: `[b, t, E]`
  per layer costs next to nothing)."""
  attention = target.attention_taps if config.attention_kl else ()
  return tuple(dict.fromkeys((*attention, *target.router_taps)))


def _divergence_scalars(
  ctx: StepContext, config: EvalConfig, variant: str,
  taps: dict[str, Array],
) -> dict[str, Array]:
  """Return one variant's `attn_kl/<variant>/<block>` (attention recon on)
  and `router_kl/<variant>/<layer>` scalars, each family with `/all`, its
  mean (every block, every layer, has as many rows)."""
  target = ctx.target
  found = {}
  if config.attention_kl:
    found["attn_kl"] = target.attention_divergence(ctx.weights, taps,
                                                   ctx.clean_taps)
  if target.router_taps:
    found["router_kl"] = target.router_divergence(taps, ctx.clean_taps)
  scalars = {}
  for name, kl in found.items():
    for label, value in kl.items():
      scalars[f"{name}/{variant}/{label}"] = value
    scalars[f"{name}/{variant}/all"] = jnp.mean(jnp.stack(list(kl.values())))
  return scalars


def _variant_outputs(
  ctx: StepContext, key: Key[Array, ""], config: EvalConfig
) -> tuple[dict[str, Array], dict[str, Array]]:
  """Return every mask variant's output and the attention and router
  recons' scalars (`_divergence_scalars`) from the same forwards."""
  wanted = _scored_taps(ctx.target, config)

  def forward(variant, site_masks):
    # A delta-pinned stream's `unmasked` forward is the components alone.
    own = ctx._replace(delta_pin=False) if variant == "unmasked" else ctx
    if variant not in ATTENTION_VARIANTS or not wanted:
      return own.masked_forward(site_masks), {}
    return own.masked_forward_with_taps(site_masks, wanted)

  runs = eval_metrics.variant_forwards(
    forward, key, ctx.ci.lower, ctx.target.sites, config.with_delta,
    config.ci_alive_threshold)
  scalars = {}
  for variant in ATTENTION_VARIANTS if wanted else ():
    scalars.update(_divergence_scalars(ctx, config, variant,
                                       runs[variant][1]))
  return {v: out for v, (out, _) in runs.items()}, scalars


def _term_values(ctxs: tuple[StepContext, ...], terms: tuple[LossTerm, ...],
                 passes: tuple[int, ...], term_states: dict[str, Any],
                 key: Key[Array, ""]) -> dict[str, Array]:
  """Return every term's value and their coefficiented total, term `j`
  scored on `ctxs[passes[j]]` (its CI role's pass), as the train step's
  objective scores it."""
  keys = [jax.random.fold_in(key, 1 + j) for j in range(len(terms))]
  inputs = tuple(
    None if t.prepare is None
    else t.prepare(ctxs[i], k, term_states.get(t.name))[1]
    for t, k, i in zip(terms, keys, passes))
  _, (values, total, _) = objective(
    tuple(prepared_of(c) for c in ctxs), inputs, ctxs, terms, keys, passes)
  out = {f"loss/{name}": v for name, v in values.items()}
  out["loss/total"] = total
  return out


def _hidden_role_scalars(ctx: StepContext, threshold: float
                         ) -> dict[str, Array]:
  """Return the hidden role's `ci_l0_hidden/<site>` and, where `ctx` names
  hidden points, their relative error under its CI masks
  (`recon/hidden_ci_masked`): what a hidden pass optimizes, without the
  stochastic draws."""
  lower = ctx.ci.lower
  scalars = {f"ci_l0{role_suffix(HIDDEN)}/{k}": v
             for k, v in ci_l0(lower, threshold).items()}
  if ctx.hidden_points:
    _, taps = ctx.masked_forward_with_taps(
      {s: SiteMask(ci) for s, ci in lower.items()}, ctx.hidden_points)
    scalars["recon/hidden_ci_masked"] = hidden.relative_error(
      taps, ctx.clean_taps, ctx.hidden_points)
  return scalars


def _hidden_act_stats(ctx: StepContext, key: Key[Array, ""],
                      config: EvalConfig) -> dict[str, Array]:
  """Return per site `Σ(masked − clean)²` and its element count at the
  site's output: CI-masked forward, and summed over stochastic draws."""
  wanted = _site_out_keys(ctx.target)
  ci_masks = masks_lib.variant_site_masks(
    "ci_masked", key, ctx.ci.lower, ctx.target.sites, False, 0.0)
  draws = {"ci_masked": [ci_masks]}
  entry = recon.all_sites_plan(ctx.target.sites)[0]
  index = sites_lib.draw_paths(ctx.target.sites)
  draws["stochastic"] = [
    masks_lib.stochastic_site_masks(
      jax.random.fold_in(key, 1 + d), entry.live_sites, ctx.ci.lower, index,
      config.with_delta, "continuous", None)
    for d in range(config.n_mask_samples)]
  stats = {}
  for variant, site_masks_list in draws.items():
    for site_masks in site_masks_list:
      _, taps = ctx.masked_forward_with_taps(site_masks, wanted)
      errors = hidden.site_squared_errors(taps, ctx.clean_taps, wanted)
      for tap, (err, numel) in errors.items():
        site = tap[:-len(".out")]
        err_key = f"hidden_err/{variant}/{site}"
        n_key = f"hidden_n/{variant}/{site}"
        stats[err_key] = stats.get(err_key, 0.0) + err
        stats[n_key] = stats.get(n_key, 0) + jnp.asarray(numel, jnp.int32)
  return stats


# The slow tier's per-site CI distributions, stat names as keyed for the
# output role; a dual-role CI function's hidden role adds each as
# `<stat>_hidden/<site>`.
CI_DISTRIBUTIONS = ("hist_lower", "hist_pre", "ci_sum", "log_density")
# The key suffix of each CI role's distributions.
ROLE_SUFFIXES = {role: role_suffix(role) for role in (OUTPUT, HIDDEN)}


def _ci_distributions(
  ci: squash.CIOutput, sites: tuple[sites_lib.SiteSpec, ...], suffix: str,
) -> dict[str, Array]:
  """Return per site the `CI_DISTRIBUTIONS` of one role's CI, keyed
  `<stat><suffix>/<site>`: counts and sums, so batches add up exactly."""
  stats = {}
  for site in sites:
    lower, pre = ci.lower[site.name], ci.pre[site.name]
    stats[f"hist_lower{suffix}/{site.name}"] = ci_counts.histogram_counts(
      lower, ci_counts.LOWER_EDGES)
    stats[f"hist_pre{suffix}/{site.name}"] = ci_counts.histogram_counts(
      pre, ci_counts.PRE_EDGES)
    stats[f"ci_sum{suffix}/{site.name}"] = jnp.sum(
      lower.reshape(-1, site.c).astype(jnp.float32), axis=0)
    stats[f"log_density{suffix}/{site.name}"] = ci_counts.log_density_counts(
      lower)
  return stats


def _slow_stats(ctxs: tuple[StepContext, ...], roles: tuple[str, ...],
                key: Key[Array, ""], config: EvalConfig) -> dict[str, Array]:
  """Return one batch's slow stats: every role's CI distributions, and the
  output role's (`ctxs[0]`) per-position stats and hidden-activation
  errors."""
  ctx = ctxs[0]
  stats = {}
  for role, own in zip(roles, ctxs):
    stats.update(_ci_distributions(own.ci, ctx.target.sites,
                                   ROLE_SUFFIXES[role]))
  for site in ctx.target.sites:
    lower = ctx.ci.lower[site.name]
    if lower.ndim == 3:
      stats[f"position_ci/{site.name}"] = jnp.mean(lower, axis=0)
    if ctx.target.token_labels is not None:
      values, index = ci_counts.top_positions(lower, config.top_contexts)
      stats[f"top_ci/{site.name}"] = values
      stats[f"top_index/{site.name}"] = index
  if ctx.target.token_labels is not None:
    stats["tokens"] = ctx.inputs
  if ctx.target.masked_forward_taps is not None:
    stats.update(_hidden_act_stats(ctx, key, config))
  return stats


def _unit_stats(target: TargetFns, components: Components
                ) -> dict[str, Array]:
  """Return per site feeding nonlinear units each component's soft unit
  count at the eval threshold and its participation ratio (SPEC §5.10),
  keyed `unit_count/<unit kind>/<site>` and `unit_ratio/<kind>/<site>`."""
  stats = {}
  for site in target.sites:
    spec = (target.nonlinear_units or {}).get(site.name)
    if spec is None:
      continue
    _, u = sites_lib.site_factors(components, site)
    stats[f"unit_count/{spec.kind}/{site.name}"] = locality.site_soft_counts(
      u, spec, locality.EVAL_THRESHOLD)
    stats[f"unit_ratio/{spec.kind}/{site.name}"] = (
      locality.site_participation_ratios(u, spec))
  return stats


class EvalFns(NamedTuple):
  """The two jitted eval passes.

  `fast(state, weights, key, batches=None) -> (EvalOutput, batches)`: the
  fast tier over the held-out batches (given, or sampled from `key`), which
  it also returns (left on device) so that
  `slow(state, weights, key, batches) -> stats` can reuse them without a
  second data read.
  """

  fast: Callable[..., tuple[EvalOutput, Batch]]
  slow: Callable[..., dict[str, Array]]


class EvalPlan(NamedTuple):
  """What an eval pass derives once from its settings, before any array.

  `passes[j]` is the CI role's pass term `j` is scored on; `fast_taps` and
  `slow_taps` the taps each tier's clean forward keeps; `hidden_points`
  the activations a hidden pass reconstructs (none for a one-role CI).
  """

  target: TargetFns
  ci_fn: CIFn
  terms: tuple[LossTerm, ...]
  config: EvalConfig
  sample_inputs: Callable[[Key[Array, ""]], Batch] | None
  constrain: Constrain
  stream: StreamSpec
  hidden_points: tuple[str, ...]
  passes: tuple[int, ...]
  fast_taps: tuple[str, ...]
  slow_taps: tuple[str, ...]

  @property
  def roles(self) -> tuple[str, ...]:
    return self.ci_fn.roles


def eval_plan(
  target: TargetFns, ci_fn: CIFn, terms: tuple[LossTerm, ...],
  config: EvalConfig, sample_inputs: Callable[[Key[Array, ""]], Batch] | None,
  constrain: Constrain = no_constraint, stream: StreamSpec = StreamSpec(""),
) -> EvalPlan:
  """Return the eval's `EvalPlan`; ValueError for no batches, a term's
  unknown role, or an attention eval the target cannot score."""
  if config.n_batches < 1:
    raise ValueError(f"eval needs at least one batch, got {config.n_batches}")
  roles = ci_fn.roles
  hidden_points = config.hidden_points if HIDDEN in roles else ()
  passes = tuple(role_index(t, roles, hidden_points) for t in terms)
  fast_taps = clean_tap_keys(ci_fn, target, terms)
  # The hidden pass compares its masked activations with the clean ones.
  fast_taps = tuple(dict.fromkeys((*fast_taps, *hidden_points)))
  if config.attention_kl:
    _check_attention(target)
  fast_taps = tuple(dict.fromkeys((*fast_taps, *_scored_taps(target,
                                                              config))))
  slow_taps = (*ci_fn.input_taps, *target.start_taps)
  if target.masked_forward_taps is not None:
    slow_taps += _site_out_keys(target)
  return EvalPlan(target, ci_fn, terms, config, sample_inputs, constrain,
                  stream, hidden_points, passes, fast_taps,
                  tuple(dict.fromkeys(slow_taps)))


def real_state(sites: tuple[sites_lib.SiteSpec, ...],
               state: TrainState) -> TrainState:
  """Return `state` without the owner preset's pad slots (`core.slots`),
  which metrics never see."""
  return state._replace(
    components=slots.real_components(state.components, sites))


def eval_contexts(
  plan: EvalPlan, state: TrainState, weights: Weights, inputs: Batch,
  wanted: tuple[str, ...], every_role: bool,
) -> tuple[StepContext, ...]:
  """Return one context per CI role (`every_role`), or the output role's
  alone; a hidden role's is a hidden pass."""
  target, config, constrain = plan.target, plan.config, plan.constrain
  clean_out, taps = constrain("activations", jax.lax.stop_gradient(
    target.clean_forward(weights, inputs, wanted)))
  # The same V/U and CI as the train step computes with (N4).
  args = (state.components, state.ci_params, taps, plan.ci_fn,
          config.compute_dtype, constrain)
  prepared = prepare_roles(*args) if every_role else (prepare(*args),)
  return tuple(with_prepared(
    StepContext(state.step, config.total_steps, target, weights, inputs,
                clean_out, *own[:2], clean_taps=taps,
                constrain=constrain, delta_pin=plan.stream.delta_pin,
                loss_positions=plan.stream.loss_positions,
                hidden_points=() if role == OUTPUT else plan.hidden_points),
    own) for role, own in zip(plan.roles, prepared))


def _fast_ctx_scalars(ctxs: tuple[StepContext, ...], key: Key[Array, ""],
                      mask_key: Key[Array, ""], config: EvalConfig
                      ) -> dict[str, Array]:
  """Return one batch's CI-L0 of every role, each mask variant's
  divergence, the attention and router recons, the PGD probe and the CE
  metrics."""
  ctx = ctxs[0]
  scalars = {f"ci_l0/{k}": v
             for k, v in ci_l0(ctx.ci.lower, config.ci_alive_threshold).items()}
  for own in ctxs[1:]:
    scalars.update(_hidden_role_scalars(own, config.ci_alive_threshold))
  outputs, recons = _variant_outputs(ctx, mask_key, config)
  scalars.update(recons)
  for variant, out in outputs.items():
    scalars[f"recon/{variant}"] = ctx.output_divergence(out)
  if config.pgd_steps:
    # Index 4: disjoint from the data, mask and term keys (and slow's 3).
    scalars["recon/pgd"] = adversarial.pgd_probe(
      ctx, jax.random.fold_in(key, 4), config.pgd_steps, config.pgd_lr)
  if ctx.target.token_labels is not None:
    scalars.update(eval_metrics.ce_metrics(
      outputs, ctx.clean_output, ctx.target.token_labels(ctx.inputs)))
  return scalars


def fast_batch(
  plan: EvalPlan, state: TrainState, weights: Weights, key: Key[Array, ""],
  inputs: Batch | None,
) -> tuple[dict[str, Array], dict[str, Array], Batch]:
  """Return one held-out batch's fast-tier scalars and stats, and the
  batch (drawn from `key` when `inputs` is None)."""
  config, target = plan.config, plan.target
  data_key, mask_key, term_key = (jax.random.fold_in(key, j)
                                  for j in range(3))
  if inputs is None:
    inputs = plan.sample_inputs(data_key)
  else:
    inputs = plan.constrain("inputs", inputs)
  ctxs = eval_contexts(plan, state, weights, inputs, plan.fast_taps, True)
  scalars = _fast_ctx_scalars(ctxs, key, mask_key, config)
  scalars.update(_term_values(ctxs, plan.terms, plan.passes,
                              state.term_states, term_key))
  lead = tuple(target.batch_lead_shape(inputs))
  lower = ctxs[0].ci.lower
  stats = {f"fired/{s.name}": ci_counts.firing_counts(
    lower[s.name], config.ci_alive_threshold) for s in target.sites}
  stats["positions"] = jnp.asarray(int(np.prod(lead)), jnp.int32)
  return scalars, stats, inputs


def fast_pass(plan: EvalPlan, state: TrainState, weights: Weights,
              key: Key[Array, ""], batches: Batch | None = None
              ) -> tuple[EvalOutput, Batch]:
  """Return the fast tier over the held-out batches and the batches."""
  target = plan.target
  state = real_state(target.sites, state)
  if batches is None and plan.sample_inputs is None:
    raise ValueError("this eval step reads no data: pass its batches")
  if batches is not None:
    _check_batch_count(batches, plan.config.n_batches)
  scalars, stats, batches = jax.lax.map(
    lambda args: fast_batch(plan, state, weights,
                            jax.random.fold_in(key, args[0]), args[1]),
    (jnp.arange(plan.config.n_batches), batches))
  ci_probe = {}
  if target.feature_probe is not None:
    ci_probe = probe.probe_ci(target, plan.ci_fn, weights, state.components,
                              state.ci_params)
  features = feature_factors(target, weights, state.components)
  return EvalOutput(scalars, stats, ci_probe, features), batches


def slow_pass(plan: EvalPlan, state: TrainState, weights: Weights,
              key: Key[Array, ""], batches: Batch) -> dict[str, Array]:
  """Return the slow tier's stats over the fast tier's batches."""
  state = real_state(plan.target.sites, state)
  roles = plan.roles

  def one(args):
    i, inputs = args
    ctxs = eval_contexts(plan, state, weights, inputs, plan.slow_taps,
                         len(roles) > 1)
    hidden_key = jax.random.fold_in(jax.random.fold_in(key, i), 3)
    return _slow_stats(ctxs, roles, hidden_key, plan.config)

  per_batch = jax.lax.map(one, (jnp.arange(plan.config.n_batches), batches))
  return {**per_batch, **_unit_stats(plan.target, state.components)}


def make_eval_step(
  target: TargetFns,
  ci_fn: CIFn,
  terms: tuple[LossTerm, ...],
  config: EvalConfig,
  sample_inputs: Callable[[Key[Array, ""]], Batch] | None,
  constrain: Constrain = no_constraint,
  stream: StreamSpec = StreamSpec(""),
) -> EvalFns:
  """Return the jitted fast and slow eval passes (see `EvalFns`).

  Without `sample_inputs`, `fast` must be given the held-out batches.
  `constrain` pins intermediates to a placement as in the train step.
  `stream` is the stream the batches come from: on a delta-pinned one
  every masked forward runs `δ ≡ 1` except the `unmasked` variant's, which
  runs with the delta path off (SPEC §6.6), and divergences average over
  its loss positions.
  """
  plan = eval_plan(target, ci_fn, terms, config, sample_inputs, constrain,
                   stream)

  def fast(state: TrainState, weights: Weights, key: Key[Array, ""],
           batches: Batch | None = None):
    return fast_pass(plan, state, weights, key, batches)

  def slow(state: TrainState, weights: Weights, key: Key[Array, ""],
           batches: Batch) -> dict[str, Array]:
    return slow_pass(plan, state, weights, key, batches)

  return EvalFns(jax.jit(fast), jax.jit(slow))


def _check_batch_count(batches: Batch, n_batches: int) -> None:
  counts = {leaf.shape[0] for leaf in jax.tree.leaves(batches)}
  if counts != {n_batches}:
    raise ValueError(f"eval batches stack {sorted(counts)} batches; the eval "
                     f"step was built for {n_batches}")


def merge_slow(output: EvalOutput, slow_stats: dict[str, Array]) -> EvalOutput:
  """Return `output` with the slow tier's per-batch stats added."""
  return output._replace(stats={**output.stats, **slow_stats})


class EvalSummary(NamedTuple):
  """Host reduction of an `EvalOutput`.

  `scalars` are the `eval/`-less metric names with float values: means over
  batches (a dual-role CI's `ci_l0_hidden/<site>` and
  `recon/hidden_ci_masked` reduce as `ci_l0/<site>` and the `recon/`
  variants do; `attn_kl/{ci_masked,stochastic}/{layers.<b>,all}` among them
  when the attention-pattern recon is on, and a mixture-of-experts
  target's `router_kl/{ci_masked,stochastic}/{layers.<i>,all}` wherever
  masking moves a router), `alive/<site>` (components
  firing anywhere in the eval set),
  toys' probe CI error against each site's expected pattern
  (`identity_ci_error/<site>` or `dense_ci_error/<site>`, SPEC §11) and
  `mmcs/<site>`, `ml2r/<site>` where a feature axis is declared (SPEC §10);
  the slow tier's `hidden_acts/{ci_masked,stochastic}/<site|all>`
  (`Σe/Σn`) and, per unit kind, `nonlinearity/{soft_count,participation}
  /<kind>` with their `_active` means over the components whose mean CI is
  positive (SPEC §5.10). `arrays` holds
  the slow tier's per-site arrays summed over batches: `density` and
  `mean_ci` `[C]`, `hist_lower`/`hist_pre` counts, `log_density` `[C, n+1]`
  and `position_ci` `[T, C]`, and for a dual-role CI function the hidden
  role's `mean_ci_hidden`, `hist_lower_hidden`, `hist_pre_hidden` and
  `log_density_hidden` (no `density`: the fast tier counts firing for the
  output role only); `probe` the toys' probe CI.
  """

  scalars: dict[str, float]
  arrays: dict[str, dict[str, np.ndarray]]
  probe: dict[str, np.ndarray]


def _sum_batches(stats: dict[str, np.ndarray], prefix: str) -> dict:
  return {k[len(prefix):]: np.sum(v.astype(
    np.int64 if v.dtype.kind in "iu" else np.float64), axis=0)
    for k, v in stats.items() if k.startswith(prefix)}


def _hidden_scalars(stats: dict[str, np.ndarray]) -> dict[str, float]:
  out = {}
  for variant in ("ci_masked", "stochastic"):
    errors = _sum_batches(stats, f"hidden_err/{variant}/")
    counts = _sum_batches(stats, f"hidden_n/{variant}/")
    if not errors:
      continue
    for site, err in errors.items():
      out[f"hidden_acts/{variant}/{site}"] = float(err / counts[site])
    out[f"hidden_acts/{variant}/all"] = float(
      sum(errors.values()) / sum(counts.values()))
  return out


def _unit_scalars(stats: dict[str, np.ndarray]) -> dict[str, float]:
  """Return per unit kind the mean soft count and participation ratio over
  every component of its sites and over those with positive mean CI on the
  eval set (SPEC §5.10), the latter only where there are any."""
  ci_sum = _sum_batches(stats, "ci_sum/")
  out = {}
  for stat, name in (("unit_count", "soft_count"),
                     ("unit_ratio", "participation")):
    values, active = {}, {}
    for key, per_component in stats.items():
      if not key.startswith(f"{stat}/"):
        continue
      _, kind, site = key.split("/", 2)
      values.setdefault(kind, []).append(
        np.asarray(per_component, np.float64))
      active.setdefault(kind, []).append(ci_sum[site] > 0)
    for kind in values:
      kind_values = np.concatenate(values[kind])
      kind_active = np.concatenate(active[kind])
      out[f"nonlinearity/{name}/{kind}"] = float(np.mean(kind_values))
      if kind_active.any():
        out[f"nonlinearity/{name}_active/{kind}"] = float(
          np.mean(kind_values[kind_active]))
  return out


def probe_scalars(
  ci_probe: dict[str, np.ndarray], features: dict[str, FeatureFactors],
  expected: dict[str, Expected] | None = None,
) -> dict[str, float]:
  """Return the toys' recovery scalars from host arrays.

  Per probed site its CI error against its expected pattern, named by the
  pattern (`identity_ci_error/<site>`, `dense_ci_error/<site>`; identity
  where `expected` names none, SPEC §11), and per site in `features` whose
  expected pattern names a feature axis its `mmcs/<site>` and
  `ml2r/<site>` (SPEC §10).
  """
  expected = expected or {}
  out = {}
  for site, ci in ci_probe.items():
    pattern = expected.get(site, Expected("identity"))
    out[f"{pattern.pattern}_ci_error/{site}"] = float(
      probe.pattern_error(np.asarray(ci), pattern))
  for site, factors in features.items():
    if site not in expected or expected[site].feature_axis is None:
      continue
    match = probe.feature_match(*(np.asarray(a) for a in factors),
                                expected[site].feature_axis)
    out[f"mmcs/{site}"] = match.mmcs
    out[f"ml2r/{site}"] = match.ml2r
  return out


def _ci_arrays(stats: dict[str, np.ndarray], suffix: str, positions: float
               ) -> dict[str, dict[str, np.ndarray]]:
  """Return one role's `mean_ci<suffix>` and summed CI distributions, or {}
  where the slow tier holds none of that role (a one-role CI function's
  hidden one)."""
  if not any(k.startswith(f"hist_lower{suffix}/") for k in stats):
    return {}
  ci_sum = _sum_batches(stats, f"ci_sum{suffix}/")
  arrays = {f"mean_ci{suffix}": {s: c / positions for s, c in ci_sum.items()}}
  for name in ("hist_lower", "hist_pre", "log_density"):
    arrays[f"{name}{suffix}"] = _sum_batches(stats, f"{name}{suffix}/")
  return arrays


def summarize(output: EvalOutput,
              expected: dict[str, Expected] | None = None) -> EvalSummary:
  """Return the host reduction of a fetched (numpy) `EvalOutput`;
  `expected` is the target's (`TargetFns.expected`)."""
  scalars = {k: float(np.mean(v)) for k, v in output.scalars.items()}
  stats = {k: np.asarray(v) for k, v in output.stats.items()}
  positions = float(np.sum(stats["positions"]))
  fired = _sum_batches(stats, "fired/")
  for site, counts in fired.items():
    scalars[f"alive/{site}"] = float(np.sum(counts > 0))
  ci_probe = {k: np.asarray(v) for k, v in output.probe.items()}
  scalars.update(probe_scalars(ci_probe, output.features, expected))
  scalars.update(_hidden_scalars(stats))
  scalars.update(_unit_scalars(stats))
  arrays: dict[str, dict[str, np.ndarray]] = {}
  if any(k.startswith("hist_lower/") for k in stats):
    arrays["density"] = {s: c / positions for s, c in fired.items()}
    for suffix in ROLE_SUFFIXES.values():
      arrays.update(_ci_arrays(stats, suffix, positions))
    position_ci = _sum_batches(stats, "position_ci/")
    if position_ci:
      n_batches = len(stats["positions"])
      arrays["position_ci"] = {s: v / n_batches for s, v in position_ci.items()}
  return EvalSummary(scalars, arrays, ci_probe)


def top_contexts(
  stats: dict[str, np.ndarray], site: str, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Return per component its `k` top CI values over every eval batch, with
  their batch and flat position, each `[C, k]` (from the slow tier's
  per-batch top positions)."""
  values = np.asarray(stats[f"top_ci/{site}"])    # [n_batches, C, k_b]
  index = np.asarray(stats[f"top_index/{site}"])
  n_batches, c, k_b = values.shape
  values = values.transpose(1, 0, 2).reshape(c, -1)
  index = index.transpose(1, 0, 2).reshape(c, -1)
  batch = np.repeat(np.arange(n_batches), k_b)[None].repeat(c, axis=0)
  order = np.argsort(-values, axis=1, kind="stable")[:, :k]
  return tuple(np.take_along_axis(a, order, axis=1)
               for a in (values, batch, index))


def eval_data_key(seed: int) -> Key[Array, ""]:
  """Return the held-out stream's key: disjoint from training draws."""
  return jax.random.fold_in(jax.random.key(seed), 0xE7A1)

