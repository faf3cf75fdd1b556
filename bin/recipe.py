"""Turn a validated `TrainConfig` into the engine's objects.

Sites, CI function, loss terms (built from `term_table`) and optimizer
settings; no I/O here.
"""

import jax

from decompax.bin import lm_setup, term_table
from decompax.bin.train_flags import TrainConfig
from decompax.core import ci_fns, ci_transformer, optim
from decompax.core import sites as sites_lib
from decompax.core import train_step
from decompax.core.schedules import Schedule


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


def lr_schedule(config: TrainConfig, peak: float) -> Schedule:
  """Return the learning-rate schedule of one optimizer."""
  final = 1.0 if config.lr_schedule == "constant" else config.lr_final_frac
  return Schedule(peak, config.lr_schedule, final, config.lr_warmup_pct)


def step_config(config: TrainConfig) -> train_step.StepConfig:
  """Return the optimizers' settings and the step's static values."""
  clip = config.clip_max_norm or None
  optimizer = (optim.MuonConfig if config.components_optimizer == "muon"
               else optim.AdamWConfig)
  return train_step.StepConfig(
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
  )


def compute_dtype(config: TrainConfig) -> str | None:
  """Return the step's compute dtype (N4): a language model's
  --compute_dtype below fp32, else None (toys and fp32 LMs use the masters)."""
  if lm_setup.is_lm(config) and config.compute_dtype != "float32":
    return config.compute_dtype
  return None


def ci_config(config: TrainConfig, sites=(), resid_width: int = 0
              ) -> ci_fns.CIConfig:
  """Return the CI function's config.

  With `resid_width` (a language model's d_model), the transformer CI has
  one chunk per decomposed block reading `resid.<block>` (SPEC §4.3);
  without it, one chunk per site reading that site's input.
  """
  if config.ci_fn != "transformer":
    return ci_fns.CIConfig(config.ci_fn, config.ci_hidden)
  chunks, widths = (), ()
  if resid_width:
    chunks = ci_transformer.chunks_by_tap(
      tuple(sites), lambda s: f"resid.{block_of(s.name)}")
    widths = tuple((c.input_taps[0], resid_width) for c in chunks)
  return ci_fns.CIConfig("transformer", config.ci_hidden,
                         ci_transformer.TransformerCIConfig(
    chunks=chunks, tap_widths=widths, d_model=config.ci_d_model,
    n_blocks=config.ci_n_blocks, n_heads=config.ci_n_heads,
    n_kv_heads=config.ci_n_kv_heads, d_mlp=config.ci_d_mlp,
    attention=config.ci_attention, remat=config.ci_remat))


def block_of(site_name: str) -> int:
  """Return the block index of an LM site name `layers.<i>.<...>`."""
  parts = site_name.split(".")
  if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
    raise ValueError(f"site {site_name!r} is not layers.<i>.<module>; the "
                     "transformer CI chunks language-model sites by block")
  return int(parts[1])


def check_rider_points(config: TrainConfig, target, weights, inputs) -> None:
  """Raise ValueError unless the target can tap every rider point."""
  if not config.hidden_terms:
    return
  if target.masked_forward_taps is None:
    raise ValueError(f"target {config.target} returns no masked activations; "
                     "drop --hidden_coeff")
  points = term_table.rider(config, target.sites,
                            config.hidden_terms[0]).points
  try:
    jax.eval_shape(lambda w, x: target.clean_forward(w, x, points), weights,
                   inputs)
  except ValueError as e:
    raise ValueError(f"--hidden_points: {e}") from None


def loss_terms(
  config: TrainConfig, sites: tuple[sites_lib.SiteSpec, ...],
  tokens_per_batch: int, units=None, lead_shape: tuple[int, ...] = (),
) -> tuple[train_step.LossTerm, ...]:
  """Return the configured loss terms, zero-coefficient terms left out.

  `lead_shape` is the batch's activation lead shape, `(B,)` by default.
  """
  return term_table.build_terms(config, term_table.TermInputs(
    sites, tokens_per_batch, units, lead_shape or (config.batch_size,)))
