"""Turn a `TrainConfig` into the engine's objects.

Sites, CI function config, loss terms (built from `terms`) and optimizer
settings; no I/O here. A library config that refuses a value raises a
ValueError naming the setting at fault (`config.setting`).
"""

import jax

from decompax.core import ci_fns, ci_transformer, optim, schedules, step_records
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.recipe import lm, streams, terms
from decompax.recipe.config import TrainConfig, setting
from decompax.targets import glu_config, glu_sites


def select_sites(
  all_sites: tuple[sites_lib.SiteSpec, ...], wanted: tuple[str, ...],
  target_name: str,
) -> tuple[sites_lib.SiteSpec, ...]:
  """Return the wanted sites in canonical order (all when none are named)."""
  if not wanted:
    return all_sites
  known = {s.name for s in all_sites}
  unknown = [w for w in wanted if w not in known]
  if unknown:
    raise ValueError(
      f"unknown site {unknown[0]!r} for target {target_name}; its sites are "
      f"{', '.join(s.name for s in all_sites)}"
    )
  return tuple(s for s in all_sites if s.name in wanted)


def lr_schedule(config: TrainConfig, peak: float
                ) -> Schedule | schedules.KnotSchedule:
  """Return the learning-rate schedule of one optimizer: the knot form
  scaled to `peak` when `--lr_knots` is set, else warmup-then-decay."""
  if config.lr_knots:
    with setting("lr_knots"):
      return schedules.KnotSchedule(peak,
                                    schedules.parse_knots(config.lr_knots))
  final = 1.0 if config.lr_schedule == "constant" else config.lr_final_frac
  with setting("lr_warmup_pct"):
    return Schedule(peak, config.lr_schedule, final, config.lr_warmup_pct)


def step_config(config: TrainConfig, hidden_points: tuple[str, ...] = ()
                ) -> step_records.StepConfig:
  """Return the optimizers' settings and the step's static values;
  `hidden_points` are the hidden passes' (`hidden_pass_points`)."""
  clip = config.clip_max_norm or None
  optimizer = (optim.MuonConfig if config.components_optimizer == "muon"
               else optim.AdamWConfig)
  return step_records.StepConfig(
    total_steps=config.num_steps,
    components_opt=optimizer(
      lr_schedule(config, config.lr), weight_decay=config.weight_decay,
      clip_max_norm=clip),
    ci_opt=optim.AdamWConfig(
      lr_schedule(config, config.ci_lr or config.lr),
      weight_decay=config.weight_decay),
    ci_alive_threshold=config.ci_alive_threshold,
    compute_dtype=compute_dtype(config),
    on_nonfinite=config.on_nonfinite,
    streams=streams.specs(config) if streams.is_targeted(config) else (),
    ci_scaled_decay=config.ci_scaled_decay,
    hidden_points=hidden_points,
    sequential_passes=config.sequential_passes,
  )


def hidden_pass_points(config: TrainConfig, target) -> tuple[str, ...]:
  """Return what the hidden passes reconstruct: `--hidden_pass_points`, or
  the target's default (() without a hidden role). Raises ValueError for a
  point that masking the decomposed sites cannot move: its relative error
  would be 0 whatever the masks, a pass that trains nothing."""
  if ci_fns.HIDDEN not in config.ci_roles:
    return ()
  if target.masked_forward_taps is None:
    raise ValueError(f"--target={config.target} returns no masked "
                     "activations for a hidden pass to reconstruct; use "
                     "--ci_roles=output")
  site_outs = tuple(f"{s.name}.out" for s in target.sites)
  points = (config.hidden_pass_points or target.hidden_pass_points
            or site_outs)
  reaches = target.masking_reaches or (lambda point: point in site_outs)
  # The target's tap check names no flag; a point it does not know is
  # this flag's (or the target default's) to fix.
  with setting("hidden_pass_points"):
    for point in points:
      if not reaches(point):
        raise ValueError(
          f"masking the decomposed sites cannot reach {point!r} (it is "
          "computed before, or beside, every one of them); name "
          f"activations downstream of a site, e.g. {site_outs[-1]!r}")
  return tuple(points)


def compute_dtype(config: TrainConfig) -> str | None:
  """Return the step's compute dtype (N4): a language model's
  --compute_dtype below fp32, else None (toys and fp32 LMs use the masters)."""
  if lm.is_lm(config) and config.compute_dtype != "float32":
    return config.compute_dtype
  return None


def ci_config(
  config: TrainConfig, sites: tuple[sites_lib.SiteSpec, ...] = (),
  model: glu_config.GluConfig | None = None,
) -> ci_fns.CIConfig:
  """Return the CI function's config.

  For a language model (`model`), the transformer CI has one chunk per
  decomposed block reading `resid.<block>` (SPEC §4.3,
  `glu_sites.ci_chunks`); without one, one chunk per site reading that
  site's input.
  """
  with setting("ci_roles"):
    ci_fns.parse_roles(config.ci_roles)
  if config.ci_fn != "transformer":
    # The roles are checked: what the constructor refuses now is the
    # hidden widths (or a dual-role trunk that has none).
    with setting("ci_hidden"):
      return ci_fns.CIConfig(config.ci_fn, config.ci_hidden,
                             roles=config.ci_roles)
  chunks, widths = (), ()
  if model is not None:
    chunks, widths = glu_sites.ci_chunks(model, tuple(sites))
  return ci_fns.CIConfig("transformer", config.ci_hidden,
                         ci_transformer.TransformerCIConfig(
    chunks=chunks, tap_widths=widths, d_model=config.ci_d_model,
    n_blocks=config.ci_n_blocks, n_heads=config.ci_n_heads,
    n_kv_heads=config.ci_n_kv_heads, d_mlp=config.ci_d_mlp,
    attention=config.ci_attention, remat=config.ci_remat),
    roles=config.ci_roles)


def check_rider_points(config: TrainConfig, target, weights, inputs) -> None:
  """Raise ValueError unless the target can tap every rider point."""
  if not config.hidden_terms:
    return
  if target.masked_forward_taps is None:
    raise ValueError(f"target {config.target} returns no masked activations; "
                     "drop --hidden_coeff")
  points = terms.rider(config, target.sites, config.hidden_terms[0]).points
  with setting("hidden_points"):
    jax.eval_shape(lambda w, x: target.clean_forward(w, x, points), weights,
                   inputs)


def loss_terms(
  config: TrainConfig, sites: tuple[sites_lib.SiteSpec, ...],
  tokens_per_batch: int, units=None,
  lead_shape: tuple[int, ...] | dict[str, tuple[int, ...]] = (),
) -> tuple[step_records.LossTerm, ...]:
  """Return the configured loss terms, zero-coefficient terms left out.

  `lead_shape` is the batch's activation lead shape, `(B,)` by default; a
  targeted run's is a dict by stream, and each stream's terms are built
  for its own (`tokens_per_batch` is then unused: each stream counts its
  own).
  """
  if isinstance(lead_shape, dict):
    return terms.build_terms(config, {
      stream: terms.TermInputs(sites, lm.tokens_per_batch(lead), units, lead)
      for stream, lead in lead_shape.items()})
  return terms.build_terms(config, terms.TermInputs(
    sites, tokens_per_batch, units, lead_shape or (config.batch_size,)))
