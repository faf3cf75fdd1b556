"""Trained transcoders judged beside the decomposition, on the harvest's
held-out positions (`docs/transcoder.md`).

Positions: a finished harvest's windows (`harvest_batches.window_starts`,
read back from its manifest's settings), so the latents are measured
where the components and the neurons were; a run without a harvest gets
the windows a harvest of the request would read. Per batch:
- cross entropy of the clean model, of the model with one layer's
  transcoder spliced in place of its MLP (each layer alone), with every
  layer's at once, and, where asked, of the decomposition under its CI
  masks (`explore.intervened_forward`, mode `ci_masked`: every site
  masked by its CI, the all-layers counterpart);
- every layer's latent L0 and its prediction's error sums (`tc.Fit`);
- on a tagged token file, the latents' unit statistics: each latent a
  unit whose activity is its value, exactly as a neuron's or a
  component's (`unit_statistics`): its part-of-speech statistics and its
  context statistics (token-implied purity, `measures/tag_context.py`),
  with the token mix counted over the same positions as the harvest's.

Every batch has `b·(t−1)` labelled positions, so the batches' mean CE is
the CE over all positions.
"""

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.analysis import (
  explore, harvest_batches, harvest_settings, harvesting, tag_comparison,
  tag_summary, transcoder_lm)
from decompax.analysis import transcoder as tc
from decompax.evals import eval_metrics
from decompax.io import harvest_store
from decompax.measures import tag_context, tag_metrics, tag_profile
from decompax.recipe import assembly
from decompax.targets import brown_tags, glu_target

# Seconds between the evaluation's progress lines.
PROGRESS_S = 5.0


class UnitStats(NamedTuple):
  """What a set of units' activity gives over a batch, summed over
  batches: its part-of-speech statistics (`measures/tag_profile.py`) and
  its context statistics (`measures/tag_context.py`; None for a harvest
  that has none)."""

  tags: tag_profile.TagStats
  context: Optional[tag_context.ContextStats]


def unit_statistics(activity: Float[Array, "*l u"],
                    positions: tuple[Array, Array, Array],
                    coarse_of: Int[Array, " f"], n_groups: int,
                    token_ids: Int[Array, "*l"], mix: Float[Array, "v k"]
                    ) -> UnitStats:
  """Return one batch's `UnitStats` of units with `activity` at positions
  of `(tags, previous tags, document groups)` holding `token_ids`, whose
  class mix over the judged positions is `mix`."""
  return UnitStats(
    tag_profile.batch_tag_stats(activity, *positions, coarse_of,
                                len(brown_tags.COARSE), n_groups),
    tag_context.batch_context_stats(activity, token_ids, mix))


def zero_units(n_units: int, n_tags: int, n_groups: int) -> UnitStats:
  """Return empty host totals of `UnitStats`."""
  n_classes = len(brown_tags.COARSE)
  return UnitStats(
    tag_profile.zero_tag_stats(n_units, n_tags, n_classes, n_groups),
    tag_context.zero_context_stats(n_units, n_classes))


def add_units(total: UnitStats, batch: UnitStats) -> UnitStats:
  """Return host totals with one more batch added."""
  return UnitStats(tag_profile.add_tag_stats(total.tags, batch.tags),
                   tag_context.add_context_stats(total.context,
                                                 batch.context))


def unit_summary(stats: UnitStats) -> dict[str, Any]:
  """Return a unit set's purity summaries, weighted and unweighted
  (`tag_metrics.summarize`), of its units that fired, as the report's
  records hold them (`tag_summary.summary_record`)."""
  counts = tag_profile.class_counts(stats.tags)
  base = np.asarray(stats.tags.base_coarse).sum(axis=0)
  return {kind: tag_summary.summary_record(
    tag_metrics.summarize(counts, base, kind == "weighted"))
          for kind in tag_summary.WEIGHTINGS}


def context_summary(name: str, stats: UnitStats, seed: int
                    ) -> Optional[dict[str, Any]]:
  """Return a unit set's context measure as the report stores a site's
  (`tag_summary.context_row`: activity-weighted purity, token-implied
  purity and excess, robust summaries, always-on units apart); None
  without context statistics."""
  if stats.context is None:
    return None
  return tag_summary.context_row(
    tag_comparison.UnitSet(name, stats.tags, stats.context), seed)


def eval_settings(run_path: str, run: explore.LoadedRun,
                  request: harvest_settings.Request
                  ) -> tuple[harvest_settings.Settings, bool]:
  """Return the positions to judge on and whether they are a finished
  harvest's (else `request`'s, resolved on the run)."""
  try:
    manifest = harvest_store.read_manifest(run_path)
  except (OSError, ValueError):
    return harvest_settings.resolve(run, request), False
  return harvest_settings.Settings(**manifest["settings"]), True


def _ce(logits: Array, tokens: Int[Array, "b t"]) -> Float[Array, ""]:
  return eval_metrics.cross_entropy(logits, glu_target.token_labels(tokens))


def make_batch_metrics(run: explore.LoadedRun, ks: dict[int, int],
                       coarse_of: Optional[np.ndarray], n_groups: int,
                       mix: Optional[np.ndarray] = None) -> Callable:
  """Return the jitted `metrics(weights, params, tokens, positions) ->
  (scalars, fits, units)` of one batch (see the module docstring; units
  empty without `coarse_of`, whose tags' token mix `mix` is)."""
  layers = tuple(ks)
  config = assembly.resolve_target(run.config).record.token_model
  attention = run.config.attention
  taps = tuple(f"resid.{i}" for i in layers) + tuple(
    f(i) for i in layers for f in (transcoder_lm.mlp_input_tap,
                                   transcoder_lm.mlp_output_tap))

  def metrics(weights, params, tokens, positions):
    logits, values = run.target.clean_forward(weights, tokens, taps)
    stand_in = {i: (lambda x, i=i: tc.apply(params[i], x, ks[i]))
                for i in layers}
    spliced = lambda first, replace: _ce(  # noqa: E731
      transcoder_lm.spliced_logits(weights, config, attention,
                                   values[f"resid.{first}"], first,
                                   replace), tokens)
    scalars = {"ce/clean": _ce(logits, tokens),
               "ce/all": spliced(layers[0], stand_in)}
    fits, units = {}, {}
    for i in layers:
      scalars[f"ce/layer.{i}"] = spliced(i, {i: stand_in[i]})
      z = tc.encode(params[i], values[transcoder_lm.mlp_input_tap(i)], ks[i])
      scalars[f"l0/layer.{i}"] = tc.latent_l0(z)
      fits[i] = tc.fit_sums(tc.decode(params[i], z),
                            values[transcoder_lm.mlp_output_tap(i)])
      if coarse_of is not None:
        units[i] = unit_statistics(z, positions, jnp.asarray(coarse_of),
                                   n_groups, tokens, jnp.asarray(mix))
    return scalars, fits, units

  return jax.jit(metrics)


class Evaluation(NamedTuple):
  """Means over the positions judged, every layer's fit, and every
  layer's latents' unit statistics (None without tags)."""

  scalars: dict[str, float]
  fits: dict[int, tc.Fit]
  units: Optional[dict[int, UnitStats]]


def _added(total: Any, batch: Any) -> Any:
  if total is None:
    return jax.tree.map(lambda b: np.asarray(b, np.float64), batch)
  return jax.tree.map(lambda a, b: a + np.asarray(b, np.float64), total,
                      batch)


def _masked_ce(run: explore.LoadedRun, tokens: Array) -> float:
  out = explore.intervened_forward(run, tokens, "ci_masked")
  return float(_ce(out.output, tokens))


def evaluate(run: explore.LoadedRun, params: dict[int, tc.Transcoder],
             ks: dict[int, int], settings: harvest_settings.Settings,
             say: Callable[[str], None], decomposition_ce: bool = True
             ) -> Evaluation:
  """Return the transcoders' evaluation over the positions of `settings`
  (`decomposition_ce`: the decomposition's CE under its CI masks too),
  with a progress line every `PROGRESS_S` seconds."""
  batches = harvest_batches.batch_source(run, settings)
  tags = harvest_batches.tag_source(settings)
  coarse_of = None if tags is None else tags.coarse_of
  metrics = make_batch_metrics(run, ks, coarse_of, settings.tag_groups,
                               None if tags is None else tags.mix)
  scalars = fits = None
  units = None if tags is None else {
    i: zero_units(p.w_enc.shape[1], len(coarse_of), settings.tag_groups)
    for i, p in params.items()}
  started = last = time.time()
  for b in range(settings.n_batches):
    tokens = batches(b)
    s, f, u = metrics(run.weights, params, tokens,
                      None if tags is None else tags.read(b))
    if decomposition_ce:
      s = {**s, "ce/ci_masked": _masked_ce(run, tokens)}
    scalars, fits = _added(scalars, s), _added(fits, f)
    if units is not None:
      units = {i: add_units(units[i], u[i]) for i in units}
    if time.time() - last > PROGRESS_S or b + 1 == settings.n_batches:
      last = time.time()
      say(f"[transcoder] eval batch {b + 1}/{settings.n_batches}  "
          f"{(b + 1) / max(last - started, 1e-9):.2f} batches/s")
  means = {k: float(v) / settings.n_batches for k, v in scalars.items()}
  return Evaluation(means, fits, units)


def harvest_units(run_path: str, sites: dict[int, tuple[str, ...]]
                  ) -> dict[int, dict[str, UnitStats]]:
  """Return, per layer, the harvest's unit statistics of its alive
  components (every MLP site of it together) and of its neurons."""
  found = harvesting.load_harvest(run_path)
  out = {}
  for i, names in sites.items():
    # Each site's unit sets: its components first, then its baselines.
    sets = [tag_comparison.unit_sets(found, s) for s in names]
    parts = [site_sets[0] for site_sets in sets]
    contexts = [p.context for p in parts]
    out[i] = {"components": UnitStats(
      tag_profile.concat_units([p.stats for p in parts]),
      None if any(c is None for c in contexts) else tag_context.ContextStats(
        *(np.concatenate(field) for field in zip(*contexts))))}
    neurons = [u for u in sets[0] if u.name == "neurons"]
    if neurons:
      out[i]["neurons"] = UnitStats(neurons[0].stats, neurons[0].context)
  return out


def _compared(latents: UnitStats, others: dict[str, UnitStats], seed: int
              ) -> dict[str, Any]:
  """Return the latents' purity summaries beside each other unit set's,
  and the bootstrap of each difference latents − other (weighted)."""
  out = {"latents": unit_summary(latents)}
  contexts = {name: context_summary(name, units, seed) for name, units in
              {"latents": latents, **others}.items()}
  if any(c is not None for c in contexts.values()):
    out["context"] = contexts
  for name, other in others.items():
    c = tag_metrics.compare(latents.tags, other.tags, seed)
    # The comparison has summarised both sets already.
    out[name] = {w: tag_summary.summary_record(c.b[w])
                 for w in tag_summary.WEIGHTINGS}
    out[f"latents_minus_{name}"] = {
      k: v._asdict() for k, v in c.difference["weighted"].items()}
  return out


def layer_record(i: int, evaluation: Evaluation, k: int, ci_l0: float,
                 n_latents: int, others: Optional[dict[str, UnitStats]],
                 seed: int) -> dict[str, Any]:
  """Return one layer's results: its sparsity beside the decomposition's,
  its fit, the CE with it spliced, and its latents' purity (beside the
  harvest's components and neurons where `others` gives them)."""
  s = evaluation.scalars
  record = {"k": k, "ci_l0": ci_l0, "n_latents": n_latents,
            "latent_l0": s[f"l0/layer.{i}"],
            "fvu": tc.fvu(evaluation.fits[i]),
            "ce_spliced": s[f"ce/layer.{i}"],
            "ce_diff": s[f"ce/layer.{i}"] - s["ce/clean"]}
  if evaluation.units is not None:
    record["purity"] = _compared(evaluation.units[i], others or {}, seed)
  return record


def _cell(value: Optional[float], digits: int = 3, sign: str = "") -> str:
  if value is None or np.isnan(value):
    return "—"
  return f"{value:{sign}.{digits}f}"


def _purity_cell(purity: dict, name: str) -> str:
  found = purity.get(name)
  return "—" if found is None else _cell(
    found["weighted"]["median_purity"])


def _excess_cell(purity: dict, name: str) -> str:
  found = purity.get("context", {}).get(name)
  return "—" if found is None else _cell(found["excess"], 3, "+")


UNIT_SETS = ("latents", "components", "neurons")


def results_table(record: dict[str, Any]) -> str:
  """Return the results as a Markdown table: one row per layer, then the
  model with every layer's transcoder at once."""
  lines = [
    "| layer | k | CI-L0 | latent L0 | FVU | CE spliced | CE − clean | "
    "purity: latents / components / neurons (weighted median) | "
    "excess over token-implied purity (activity-weighted) |",
    "|---|---|---|---|---|---|---|---|---|"]
  for i, r in record["layers"].items():
    p = r.get("purity", {})
    lines.append(
      f"| {i} | {r['k']} | {_cell(r['ci_l0'], 2)} | "
      f"{_cell(r['latent_l0'], 2)} | {_cell(r['fvu'])} | "
      f"{_cell(r['ce_spliced'], 4)} | {_cell(r['ce_diff'], 4, '+')} | "
      + " / ".join(_purity_cell(p, n) for n in UNIT_SETS) + " | "
      + " / ".join(_excess_cell(p, n) for n in UNIT_SETS) + " |")
  ce = record["ce"]
  masked = ce.get("ci_masked")
  lines += ["", f"Clean CE {_cell(ce['clean'], 4)}; every layer's "
            f"transcoder at once {_cell(ce['all'], 4)} "
            f"({_cell(ce['all'] - ce['clean'], 4, '+')}); the decomposition "
            "under its CI masks "
            + ("not measured" if masked is None else
               f"{_cell(masked, 4)} ({_cell(masked - ce['clean'], 4, '+')})")
            + f", over {record['positions']} positions."]
  return "\n".join(lines) + "\n"
