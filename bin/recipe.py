"""Turn a validated `TrainConfig` into the engine's objects.

Sites, CI function, loss terms and optimizer settings; no I/O here.
"""

from decompax.bin.train_flags import TrainConfig
from decompax.core import ci_fns, optim, sites as sites_lib, train_step
from decompax.core.schedules import Schedule
from decompax.losses import recon, terms


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
  return train_step.StepConfig(
    total_steps=config.num_steps,
    components_opt=optim.AdamWConfig(
      lr_schedule(config, config.lr), weight_decay=config.weight_decay,
      clip_max_norm=clip),
    ci_opt=optim.AdamWConfig(
      lr_schedule(config, config.ci_lr or config.lr),
      weight_decay=config.weight_decay),
    ci_alive_threshold=config.ci_alive_threshold,
  )


def ci_config(config: TrainConfig) -> ci_fns.CIConfig:
  """Return the CI function's config."""
  return ci_fns.CIConfig(config.ci_fn, config.ci_hidden)


def loss_terms(
  config: TrainConfig, sites: tuple[sites_lib.SiteSpec, ...],
  tokens_per_batch: int,
) -> tuple[train_step.LossTerm, ...]:
  """Return the configured loss terms, zero-coefficient terms left out."""
  p = Schedule(config.p_start, config.p_schedule, config.p_final_frac)
  out = []
  if config.faithfulness_coeff:
    out.append(terms.faithfulness_term(config.faithfulness_coeff))
  if config.importance_coeff:
    out.append(terms.importance_minimality_term(
      config.importance_coeff, p, config.importance_eps))
  if config.frequency_coeff:
    out.append(terms.frequency_minimality_term(
      config.frequency_coeff, p,
      config.reference_token_count or tokens_per_batch, config.importance_eps))
  n = config.n_mask_samples
  plans = (
    ("stochastic_recon", config.stochastic_coeff,
     recon.all_sites_plan(sites, config.stochastic_routing, n)),
    ("stochastic_recon_per_site", config.per_site_coeff,
     recon.per_site_plan(sites, n)),
    ("stochastic_recon_subset", config.subset_coeff,
     recon.subset_chunks_plan(sites, config.subset_size,
                              config.subset_routing, n)),
  )
  for name, coeff, plan in plans:
    if coeff:
      out.append(terms.stochastic_recon_term(
        name, coeff, plan, config.use_delta_component, config.sampling))
  return tuple(out)
