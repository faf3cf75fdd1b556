"""A finished run's decomposition, opened for questions about its components.

Each function stands alone, for notebooks and research code:

    run = explore.load_run("runs/tms")
    ci = explore.component_ci(run, inputs)             # {site: [*lead, C]}
    out = explore.ablated_forward(run, inputs, ablate={"linear1": [3]})
    effects = explore.ablation_effects(run, tokens)    # LM targets
    curve = explore.mask_sweep(run, tokens, "linear1", 3, [0, 0.5, 1, 2])
    out = explore.intervened_forward(run, inputs, "adversarial", seed=0)
    graph = explore.attribution_graph(run, tokens, share=0.9)

A masked forward here is the decomposed model with every component at mask 1
and the delta path `W − V·U` on, which equals the target exactly; ablating a
component sets its mask to 0, keeping only some sets the others' to 0. The
divergence is the target's own (KL for language models, MSE for toys),
mean over positions. Graded interventions (a component's mask at any
value in [0, 2], the evaluation's mask variants as modes) are described in
`analysis/interventions.py`.
"""

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.analysis import attribution, interventions
from decompax.core import ci_fns, sites as sites_lib, squash
from decompax.core import masks as masks_lib
from decompax.core.masks import SiteMask
from decompax.core.target import TargetFns
from decompax.io import decomposition as decomposition_lib
from decompax.io import run_dir
from decompax.measures import component_stats as harvest_stats
from decompax.recipe import assembly, lm
from decompax.recipe.config import TrainConfig
from decompax.recipe.flagfiles import read_args
from decompax.targets import registry

# Component choices per site: {site name: component indices}.
Choice = Mapping[str, Sequence[int]]
# Mask values of a sweep: a list or a one-dimensional array.
MaskValues = Sequence[float] | np.ndarray | Array


class Jitted(NamedTuple):
  """A run's functions, jitted once per loaded run; the weights and the
  decomposition stay runtime arguments."""

  lower_ci: Any
  masked_and_clean: Any
  ablated_log_probs: Any
  sweep_outputs: Any
  sweep_log_probs: Any
  intervened: Any
  attribution_pullback: Any
  attribution_edges: Any


class LoadedRun(NamedTuple):
  """What a run directory holds, ready to apply: the target's function
  table and frozen weights, the decomposition and its CI function."""

  config: TrainConfig
  target: TargetFns
  weights: Any
  decomposition: decomposition_lib.Decomposition
  ci_fn: ci_fns.CIFn
  jitted: Jitted
  # A token model's positions (its max_position_embeddings): the longest
  # prompt it takes. None: no token model, or no known bound.
  positions: Optional[int] = None


class AblatedOutput(NamedTuple):
  """A masked forward's output beside the clean one, and their divergence
  (the target's own, mean over positions)."""

  output: Float[Array, "..."]
  clean: Float[Array, "..."]
  divergence: Float[Array, ""]


def run_config(path: str) -> TrainConfig:
  """Return the settings a run recorded in its `flags.txt`.

  The file also holds process-level flags (placement, compiler), which are
  not settings of the decomposition and are skipped.
  """
  flags_path = os.path.join(path, "flags.txt")
  if not os.path.isfile(flags_path):
    raise FileNotFoundError(f"{path} has no flags.txt: pass the output "
                            "directory of a bin/train run")
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  with open(flags_path) as f:
    args = [line.strip() for line in f if line.startswith("--")]
  return read_args([a for a in args
                    if a.removeprefix("--").partition("=")[0] in fields])


def _decomposition(path: str) -> decomposition_lib.Decomposition:
  npz = os.path.join(path, "decomposition.npz")
  if os.path.isfile(npz):
    return decomposition_lib.load_npz(npz)
  # A run stopped before its end has checkpoints but no final file.
  return decomposition_lib.load_decomposition(path)


def load_run(path: str,
             decomposition: Optional[decomposition_lib.Decomposition] = None
             ) -> LoadedRun:
  """Return the run at `path`: its target (a toy from the run's cached
  `target.npz`, or the language model in its `--model_dir`), the frozen
  weights and the latest decomposition (the final one, else the newest
  checkpoint), or `decomposition` where the caller read one itself (a
  chosen checkpoint). A `--restarts` run is its chosen candidate.

  Raises FileNotFoundError when `path` is not a run directory, and
  CheckpointError when it holds no readable decomposition.
  """
  path = run_dir.chosen_run(path)
  config = run_config(path)
  if decomposition is None:
    decomposition = _decomposition(path)
  sites = decomposition.sites
  if lm.is_lm(config):
    record, target, load = assembly.resolve_target(config)
    weights = load()
  else:
    record = toy = registry.get(config.target)
    target_path = config.target_path or os.path.join(path, "target.npz")
    arrays, _ = run_dir.load_arrays(target_path)
    target = registry.fns_for(toy, {s.name: s.c for s in sites}, sites)
    weights = registry.weights_for(toy, toy.weights_from_arrays(arrays), sites)
  ci_fn = ci_fns.make_ci_fn(decomposition.ci_config, sites)
  model = record.token_model
  return LoadedRun(config, target, weights, decomposition, ci_fn,
                   jit_functions(target, ci_fn),
                   None if model is None else model.max_position)


def check_prompt_length(run: LoadedRun, length: int) -> None:
  """Raise ValueError for a prompt of `length` tokens longer than the
  run's model takes: a learned position table has no row past it, and a
  rotary model answers without any sign that it never saw such a
  context."""
  if run.positions is not None and length > run.positions:
    raise ValueError(f"the prompt has {length} tokens, more than the "
                     f"model's {run.positions} positions; give at most "
                     f"{run.positions}")


def lower_ci(target: TargetFns, ci_fn: ci_fns.CIFn, weights, components,
             ci_params, inputs) -> dict[str, Float[Array, "*lead c"]]:
  """Return every site's lower CI on `inputs` (traceable: jit it, or call
  it inside a jitted function)."""
  return lower_ci_and_taps(target, ci_fn, weights, components, ci_params,
                           inputs, ())[0]


def lower_ci_and_taps(target: TargetFns, ci_fn: ci_fns.CIFn, weights,
                      components, ci_params, inputs,
                      wanted: tuple[str, ...]) -> tuple[dict, dict]:
  """Return every site's lower CI on `inputs` and the clean forward's
  `wanted` taps, from the one forward the CI reads (a tap does not depend
  on which others are asked for, SPEC I29)."""
  keys = tuple(dict.fromkeys(ci_fn.input_taps + tuple(wanted)))
  _, taps = target.clean_forward(weights, inputs, keys)
  ci = squash.squash(ci_fn.apply(
    ci_params, {k: taps[k] for k in ci_fn.input_taps}, components)).lower
  return ci, {k: taps[k] for k in wanted}


def vocab_size(run: LoadedRun) -> int:
  """Return a token model's vocabulary size: its logits' width."""
  tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  logits = jax.eval_shape(
    lambda w, x: run.target.clean_forward(w, x, ())[0], run.weights, tokens)
  return int(logits.shape[-1])


def jit_functions(target: TargetFns, ci_fn: ci_fns.CIFn) -> Jitted:
  """Return the jitted functions of a run with this target and CI."""

  def masked_and_clean(weights, components, inputs, masks):
    clean, _ = target.clean_forward(weights, inputs, ())
    output = target.masked_forward(weights, components, inputs, masks)
    return AblatedOutput(output, clean, target.divergence(output, clean))

  def intervened(mode, with_delta, step_size, weights, components, ci_params,
                 inputs, key, n_steps):
    ci, _ = lower_ci_and_taps(target, ci_fn, weights, components, ci_params,
                              inputs, ())
    clean, _ = target.clean_forward(weights, inputs, ())
    masks = interventions.mode_site_masks(
      target, weights, components, ci, inputs, clean, mode, key, with_delta,
      n_steps, step_size)
    output = target.masked_forward(weights, components, inputs, masks)
    return AblatedOutput(output, clean, target.divergence(output, clean))

  return Jitted(jax.jit(functools.partial(lower_ci, target, ci_fn)),
                jax.jit(masked_and_clean),
                jax.jit(functools.partial(_ablated_log_probs, target),
                        static_argnums=0),
                jax.jit(functools.partial(interventions.sweep_outputs,
                                          target)),
                jax.jit(functools.partial(interventions.sweep_log_probs,
                                          target)),
                jax.jit(intervened, static_argnums=(0, 1, 2)),
                jax.jit(functools.partial(attribution.pullback, target,
                                          ci_fn)),
                jax.jit(functools.partial(attribution.batch_edges,
                                          target.sites), static_argnums=0))


def component_ci(run: LoadedRun, inputs: Any
                 ) -> dict[str, Float[Array, "*lead c"]]:
  """Return every site's (lower) CI of each component on `inputs`: token
  ids `[B, T]` for language models, the toy's input batch otherwise."""
  d = run.decomposition
  return run.jitted.lower_ci(run.weights, d.components, d.ci_params, inputs)


def _site_masks(run: LoadedRun, lead: tuple[int, ...],
                ablate: Optional[Choice], keep: Optional[Choice]
                ) -> dict[str, SiteMask]:
  """Return each site's masks: 1 but for `ablate`'s 0s, or 0 but for
  `keep`'s 1s on the sites `keep` names; the delta path stays on."""
  names = {s.name for s in run.target.sites}
  for choice in (ablate or {}, keep or {}):
    unknown = set(choice) - names
    if unknown:
      raise ValueError(f"no decomposed site {sorted(unknown)[0]!r}; the "
                       f"run's sites are {sorted(names)}")
  kept = {}
  for site in run.target.sites:
    vector = jnp.ones((site.c,), jnp.float32)
    if keep is not None and site.name in keep:
      vector = jnp.zeros_like(vector).at[jnp.asarray(keep[site.name],
                                                     jnp.int32)].set(1.0)
    if ablate and site.name in ablate:
      vector = vector.at[jnp.asarray(ablate[site.name], jnp.int32)].set(0.0)
    kept[site.name] = vector
  return masks_lib.component_site_masks(run.target.sites, kept, lead)


def ablated_forward(run: LoadedRun, inputs: Any,
                    ablate: Optional[Choice] = None,
                    keep: Optional[Choice] = None) -> AblatedOutput:
  """Return the decomposed model's output on `inputs` with the components
  in `ablate` removed (mask 0), or with only those in `keep` kept on the
  sites it names, beside the clean output and their divergence.

  With neither, the output equals the clean one (the delta path carries
  what the components miss).
  """
  lead = tuple(run.target.batch_lead_shape(inputs))
  masks = _site_masks(run, lead, ablate, keep)
  return run.jitted.masked_and_clean(run.weights, run.decomposition.components,
                                    inputs, masks)


class AblationEffects(NamedTuple):
  """Per alive component of one prompt, the drop of the next-token
  log-probability when that component alone is ablated at every position."""

  site: tuple[str, ...]
  component: Int[Array, "n"]
  effect: Float[Array, "n"]
  token: int
  log_prob: float


def _alive(run: LoadedRun, tokens: Int[Array, "t"], threshold: float
           ) -> list[tuple[str, int]]:
  ci = component_ci(run, tokens[None])
  return [(site, int(c)) for site, values in ci.items()
          for c in jnp.flatnonzero(values.max(axis=(0, 1)) > threshold)]


def _ablated_log_probs(target: TargetFns, chunk: int, weights, components,
                      tokens: Int[Array, "t"], sites_index: Int[Array, "n"],
                      comps: Int[Array, "n"], token: Int[Array, ""]
                      ) -> Float[Array, "n"]:
  """Return the next-token log-probability of `token` after `tokens` with
  component `comps[i]` of site `sites_index[i]` alone ablated, per i."""
  t = tokens.shape[0]

  def log_prob(masks):
    logits = target.masked_forward(weights, components, tokens[None], masks)
    return jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))[token]

  def one(pair):
    return log_prob(masks_lib.one_ablated_site_masks(target.sites, *pair,
                                                     (1, t)))

  # Components in batches of `chunk`, so memory stays bounded however many
  # are alive, with no Python loop over them.
  return jax.lax.map(one, (sites_index, comps), batch_size=chunk)


def ablation_effects(run: LoadedRun, tokens: Int[Array, "t"],
                     token: Optional[int] = None, threshold: float = 0.0,
                     chunk: int = 64) -> AblationEffects:
  """Return the ablation effect of every component alive on a prompt.

  `tokens` is one prompt `[T]` of a language-model run; `token` the next
  token whose log-probability is attributed (default: the clean model's
  top prediction after the prompt). A component is alive when its CI
  exceeds `threshold` at some position. The effect of component `c` is the
  clean log-probability minus the log-probability with `c` alone ablated
  (positive: the component supports the token).
  """
  if run.target.token_labels is None:
    raise ValueError("ablation effects attribute a next-token "
                     "log-probability; this run's target is not a language "
                     "model (use ablated_forward)")
  tokens = jnp.asarray(tokens, jnp.int32)
  clean, _ = run.target.clean_forward(run.weights, tokens[None], ())
  clean_log_probs = jax.nn.log_softmax(clean[0, -1].astype(jnp.float32))
  token = int(jnp.argmax(clean_log_probs)) if token is None else int(token)
  alive = _alive(run, tokens, threshold)
  index = {s.name: i for i, s in enumerate(run.target.sites)}
  sites_index = jnp.asarray([index[s] for s, _ in alive], jnp.int32)
  comps = jnp.asarray([c for _, c in alive], jnp.int32)
  ablated = run.jitted.ablated_log_probs(
    chunk, run.weights, run.decomposition.components, tokens, sites_index,
    comps, jnp.asarray(token))
  base = clean_log_probs[token]
  return AblationEffects(tuple(s for s, _ in alive), comps, base - ablated,
                         token, float(base))


def component_rows(run: LoadedRun, stats: Mapping[str, Mapping[str, Any]],
                   positions: int) -> list[dict]:
  """Return one row per component for a component table, from a harvest's
  per-site statistics over `positions` positions: firing density, mean CI,
  mean ablation divergence where it fires (None where never measured), the
  norms of its V column and U row, and the token ids at its top contexts'
  centres (for search by token)."""
  rows = []
  for site in run.target.sites:
    s = stats[site.name]
    v, u = (np.asarray(a) for a in sites_lib.site_factors(
      run.decomposition.components, site))
    v_norm, u_norm = np.linalg.norm(v, axis=0), np.linalg.norm(u, axis=1)
    centre = _centre_tokens(s)
    for c in range(site.c):
      count = int(s["ablation_count"][c])
      rows.append({
        "site": site.name, "component": c,
        "density": float(s["fired"][c]) / positions,
        "mean_ci": float(s["ci_sum"][c]) / positions,
        "ablation": (float(s["ablation_sum"][c]) / count) if count else None,
        "v_norm": float(v_norm[c]), "u_norm": float(u_norm[c]),
        "top_tokens": centre[c],
      })
  return rows


def _centre_tokens(stats: Mapping[str, Any]) -> list[list[int]]:
  """Return per component the distinct token ids at its top contexts'
  centres ([] for toys, whose contexts are input rows)."""
  context = np.asarray(stats["top_context"])
  window = np.asarray(stats["top_context_ci"])
  if not np.issubdtype(context.dtype, np.integer):
    return [[] for _ in range(context.shape[0])]
  # The centre is where the window's CI is the top CI.
  centre = np.argmax(window, axis=-1)
  picked = np.take_along_axis(context, centre[..., None], axis=-1)[..., 0]
  return [sorted({int(t) for t in row if t >= 0}) for row in picked]


def correlated(stats: Mapping[str, Any], component: int, top: int = 10
               ) -> list[dict]:
  """Return the components of the same site that fire most often together
  with `component`, by Jaccard index of their firing positions."""
  together = np.asarray(stats["coactive"], np.float64)
  fired = np.diag(together)
  union = fired[component] + fired - together[component]
  jaccard = np.where(union > 0, together[component] / np.maximum(union, 1),
                     0.0)
  jaccard[component] = -1.0
  order = [int(j) for j in np.argsort(-jaccard, kind="stable")[:top]
           if jaccard[j] > 0]
  return [{"component": j, "jaccard": float(jaccard[j]),
           "together": int(together[component, j])} for j in order]


class Prediction(NamedTuple):
  """Per position of a prompt, the top next tokens with their probabilities
  of the clean and the ablated model, and the KL between the two."""

  clean_tokens: Int[Array, "t k"]
  clean_probs: Float[Array, "t k"]
  ablated_tokens: Int[Array, "t k"]
  ablated_probs: Float[Array, "t k"]
  kl: Float[Array, " t"]


def predict(run: LoadedRun, tokens: Int[Array, " t"], ablate: Optional[Choice],
            top: int = 5, keep: Optional[Choice] = None) -> Prediction:
  """Return the clean and ablated models' top-`top` next-token predictions
  at every position of one prompt, and their KL per position (`ablate` and
  `keep` as in `ablated_forward`).

  Positions past the prompt's real length (a caller's padding to a fixed
  length, so new prompts reuse one compiled forward) do not change the
  earlier ones: the model is causal.
  """
  check_prompt_length(run, len(tokens))
  out = ablated_forward(run, jnp.asarray(tokens, jnp.int32)[None], ablate,
                        keep)
  return _prediction(run, out, top)


def _prediction(run: LoadedRun, out: AblatedOutput, top: int) -> Prediction:
  """Return the top-`top` predictions of one prompt's clean and masked
  outputs, and their KL per position."""
  clean = jax.nn.log_softmax(out.clean[0].astype(jnp.float32), axis=-1)
  ablated = jax.nn.log_softmax(out.output[0].astype(jnp.float32), axis=-1)
  kl = harvest_stats.position_divergence(
    run.target.divergence, out.output, out.clean, out.clean.shape[:2])[0]
  clean_top, clean_ids = jax.lax.top_k(clean, top)
  ablated_top, ablated_ids = jax.lax.top_k(ablated, top)
  return Prediction(clean_ids, jnp.exp(clean_top), ablated_ids,
                    jnp.exp(ablated_top), kl)


def intervened_prediction(run: LoadedRun, tokens: Int[Array, " t"],
                          mode: str, top: int = 5, seed: int = 0,
                          pgd_steps: Optional[int] = None,
                          pgd_step_size: Optional[float] = None
                          ) -> Prediction:
  """Return `predict`'s comparison with the masked model under an
  intervention mode (`intervened_forward`) in place of an ablation."""
  check_prompt_length(run, len(tokens))
  out = intervened_forward(run, jnp.asarray(tokens, jnp.int32)[None], mode,
                           seed, pgd_steps, pgd_step_size)
  return _prediction(run, out, top)


def intervened_forward(run: LoadedRun, inputs: Any, mode: str, seed: int = 0,
                       pgd_steps: Optional[int] = None,
                       pgd_step_size: Optional[float] = None
                       ) -> AblatedOutput:
  """Return the model's output on `inputs` with every component masked as
  the evaluation masks it under `mode` (`interventions.MODES`: CI-masked,
  stochastic, adversarial; see `analysis/interventions.py`), beside the
  clean output and their divergence.

  `seed` draws the stochastic masks and the adversary's start; the
  adversary takes `pgd_steps` sign-PGD ascents of `pgd_step_size`
  (default: the run's `--eval_pgd_steps` and `--eval_pgd_lr`).
  """
  if mode not in interventions.MODES:
    raise ValueError(f"unknown intervention mode {mode!r}; use one of "
                     f"{interventions.MODES}")
  config = run.config
  steps = config.eval_pgd_steps if pgd_steps is None else pgd_steps
  size = config.eval_pgd_lr if pgd_step_size is None else pgd_step_size
  if type(steps) is not int or steps < 0:
    raise ValueError(f"pgd_steps must be an integer >= 0, got {steps!r}")
  if not size > 0:
    raise ValueError(f"pgd_step_size must be > 0, got {size!r}")
  d = run.decomposition
  return run.jitted.intervened(
    mode, bool(config.use_delta_component), float(size), run.weights,
    d.components, d.ci_params, inputs, jax.random.key(seed),
    jnp.int32(steps))


class Sweep(NamedTuple):
  """One component's mask swept over `values`. For a language model,
  `output` is the log-probability of `token` at `position` per value; for
  a toy, the model's output for the one input per value (`token` and
  `position` None)."""

  values: Float[Array, " n"]
  output: Float[Array, "n ..."]
  token: Optional[int]
  position: Optional[int]


def _site_index(run: LoadedRun, site: str, component: int) -> int:
  """Return the index of `site` among the run's sites, refusing an unknown
  site or a component it does not have."""
  names = [s.name for s in run.target.sites]
  if site not in names:
    raise ValueError(f"no decomposed site {site!r}; the run's sites are "
                     f"{names}")
  c = run.target.sites[names.index(site)].c
  if (isinstance(component, bool)
      or not isinstance(component, (int, np.integer))
      or not 0 <= component < c):
    raise ValueError(f"site {site!r} has components 0..{c - 1}; got "
                     f"{component!r}")
  return names.index(site)


def mask_values(values: MaskValues) -> Float[Array, " n"]:
  """Return `values` as mask values, refusing an empty list or a value
  outside [0, 2] (NaN included)."""
  array = np.asarray(values, np.float64)
  if array.ndim != 1 or array.size == 0:
    raise ValueError("mask values must be a non-empty list of numbers")
  low, high = interventions.MASK_RANGE
  outside = array[~((array >= low) & (array <= high))]
  if outside.size:
    raise ValueError(f"mask value {outside[0]} is outside [{low:g}, "
                     f"{high:g}]; a mask scales a component from off (0) "
                     "through the target's (1) to doubled (2)")
  return jnp.asarray(array, jnp.float32)


def _sweep_position(tokens: Int[Array, " t"], position: int) -> int:
  """Return a sweep's checked position on `tokens`, a negative one counted
  from the end."""
  if tokens.ndim != 1 or tokens.shape[0] == 0:
    raise ValueError("a language model's sweep takes one prompt of token "
                     f"ids [T], got shape {tokens.shape}")
  t = tokens.shape[0]
  if not -t <= position < t:
    raise ValueError(f"position {position} is outside a prompt of {t} "
                     "tokens")
  return position % t


def mask_sweep(run: LoadedRun, inputs: Any, site: str, component: int,
               values: MaskValues, position: int = -1,
               token: Optional[int] = None) -> Sweep:
  """Return the model's response to component `component` of `site` at
  each mask value of `values` (in [0, 2]), every other component at 1 with
  the delta path on: value 1 is the target, 0 the component's ablation.

  `inputs` is one example without a batch axis: a prompt's token ids `[T]`
  for a language model, whose sweep is the log-probability of `token`
  (default: the clean top prediction) at `position` (the prediction after
  `inputs[: position + 1]`; default the last); a toy's input vector
  otherwise, whose sweep is its output. The values run as one batch
  through one compiled forward, whatever the component.
  """
  index = _site_index(run, site, component)
  values = mask_values(values)
  args = (run.weights, run.decomposition.components)
  if run.target.token_labels is None:
    output = run.jitted.sweep_outputs(*args, jnp.asarray(inputs),
                                      jnp.int32(index), jnp.int32(component),
                                      values)
    return Sweep(values, output, None, None)
  tokens = jnp.asarray(inputs, jnp.int32)
  position = _sweep_position(tokens, position)
  check_prompt_length(run, tokens.shape[0])
  if token is not None and not 0 <= token < 2 ** 31:
    raise ValueError(f"token {token} is outside the vocabulary")
  log_probs, chosen, vocab = run.jitted.sweep_log_probs(
    *args, tokens, jnp.int32(index), jnp.int32(component), values,
    jnp.int32(position), jnp.int32(-1 if token is None else token))
  if token is not None and token >= int(vocab):
    raise ValueError(f"token {token} is outside the vocabulary "
                     f"[0, {int(vocab)})")
  return Sweep(values, log_probs, int(chosen), position)


def _count(name: str, value: Any) -> int:
  """Return `value` checked as a positive integer named `name`."""
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < 1):
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  return int(value)


def _graph_arguments(run: LoadedRun, tokens: Any, position: int,
                     share: float, threshold: float
                     ) -> tuple[Int[Array, " t"], int]:
  """Return the prompt of an attribution graph and its checked position,
  refusing what the graph cannot be built for."""
  if run.target.token_labels is None:
    raise ValueError("an attribution graph attributes a token's logit; "
                     "this run's target is not a language model")
  if run.target.masked_forward_taps is None:
    raise ValueError("this run's target returns no taps from its masked "
                     "forward, which the later components' CI reads")
  tokens = jnp.asarray(tokens, jnp.int32)
  position = _sweep_position(tokens, position)
  check_prompt_length(run, tokens.shape[0])
  if not 0.0 < share <= 1.0:
    raise ValueError(f"share must be in (0, 1], got {share!r}")
  if not 0.0 <= threshold < 1.0:
    raise ValueError(f"threshold must be in [0, 1), got {threshold!r}")
  return tokens, position


def check_token_ids(tokens: Sequence[int], vocab: int) -> None:
  """Raise ValueError naming the first of `tokens` outside [0, vocab): an
  embedding gather would clamp it to a real row without a word, or read
  none (NaN)."""
  bad = [int(t) for t in tokens if not 0 <= t < vocab]
  if bad:
    raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                     f"[0, {vocab})")


def attribution_graph(run: LoadedRun, tokens: Any, token: Optional[int] = None,
                      position: int = -1, share: float = 0.9,
                      threshold: Optional[float] = None,
                      max_targets: int = 64, chunk: int = 16,
                      max_edges: int = 64) -> attribution.AttributionGraph:
  """Return the attribution graph of one prompt (`analysis/attribution.py`,
  design §15.2): the components alive on `tokens` (lower CI above
  `threshold`, default the run's `--ci_alive_threshold`) and the output
  logit of `token` (default the clean top prediction) at `position` (the
  prediction after `tokens[: position + 1]`; default the last), joined by
  gradient × mask edges pruned to `share` of each target's incoming
  |attribution|.

  At most `max_targets` nodes are expanded (the output first, then by
  influence), `chunk` per batched backward pass, each keeping at most
  `max_edges` incoming edges.
  """
  threshold = (run.config.ci_alive_threshold if threshold is None
               else threshold)
  tokens, position = _graph_arguments(run, tokens, position, share,
                                      threshold)
  sizes = [_count(n, v) for n, v in (("max_targets", max_targets),
                                     ("chunk", chunk),
                                     ("max_edges", max_edges))]
  clean = ablated_forward(run, tokens[None]).clean[0, position]
  check_token_ids(np.asarray(tokens).tolist(), clean.shape[-1])
  if token is None:
    token = int(jnp.argmax(clean))
  if not 0 <= token < clean.shape[-1]:
    raise ValueError(f"token {token} is outside the vocabulary "
                     f"[0, {clean.shape[-1]})")
  ci = component_ci(run, tokens[None])
  ci = np.concatenate([np.asarray(ci[s.name][0]) for s in run.target.sites],
                      axis=-1)
  d = run.decomposition
  values, pull = run.jitted.attribution_pullback(
    run.weights, d.components, d.ci_params, tokens, jnp.int32(position),
    jnp.int32(token))
  edges = functools.partial(run.jitted.attribution_edges, sizes[2], pull,
                            values, jnp.asarray(ci > threshold))
  return attribution.grow_graph(edges, run.target.sites, ci, position,
                                int(token), float(share), sizes[0], sizes[1])
