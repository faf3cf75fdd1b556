"""Turn a validated `TrainConfig` into the engine's objects.

Sites, CI function, loss terms and optimizer settings; no I/O here.
"""

import jax

from decompax.bin import lm_setup
from decompax.bin.train_flags import TrainConfig
from decompax.core import adversary, ci_fns, ci_transformer, optim
from decompax.core import sites as sites_lib
from decompax.core import train_step
from decompax.core.schedules import Schedule
from decompax.losses import adversarial, hidden, locality, recon, terms


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


def parse_groups(text: str) -> tuple[tuple[str, ...], ...]:
  """Return site groups from `a+b;c` (sites by '+', groups by ';')."""
  groups = tuple(tuple(n.strip() for n in g.split("+") if n.strip())
                 for g in text.split(";") if g.strip())
  if not groups or any(not g for g in groups):
    raise ValueError(f"--recon_groups {text!r} is not 'a+b;c' form")
  return groups


def make_plan(config: TrainConfig, sites, kind: str, routing: str,
              subset_size: int) -> recon.Plan:
  """Return the plan of one recon term by kind."""
  n = config.n_mask_samples
  if kind == "all_sites":
    return recon.all_sites_plan(sites, routing, n)
  if kind == "per_site":
    return recon.per_site_plan(sites, n)
  if kind == "subset":
    return recon.subset_chunks_plan(sites, subset_size, routing, n)
  return recon.custom_groups_plan(
    sites, parse_groups(config.recon_groups), routing, n)


def _floats(name: str, values: tuple[str, ...]) -> tuple[float, ...]:
  try:
    return tuple(float(v) for v in values)
  except ValueError:
    raise ValueError(f"--{name} must be numbers, got {','.join(values)}") from None


def rider(config: TrainConfig, sites, term: str) -> hidden.HiddenRider | None:
  """Return the hidden-activation rider of recon term `term`, if it has one."""
  if term not in config.hidden_terms:
    return None
  points = config.hidden_points or tuple(f"{s.name}.out" for s in sites)
  return hidden.HiddenRider(config.hidden_coeff, tuple(points))


def check_rider_points(config: TrainConfig, target, weights, inputs) -> None:
  """Raise ValueError unless the target can tap every rider point."""
  if not config.hidden_terms:
    return
  if target.masked_forward_taps is None:
    raise ValueError(f"target {config.target} returns no masked activations; "
                     "drop --hidden_coeff")
  points = rider(config, target.sites, config.hidden_terms[0]).points
  try:
    jax.eval_shape(lambda w, x: target.clean_forward(w, x, points), weights,
                   inputs)
  except ValueError as e:
    raise ValueError(f"--hidden_points: {e}") from None


def persistent_config(config: TrainConfig) -> adversarial.PersistentConfig:
  """Return the source settings shared by the persistent and merged terms."""
  b1, b2 = _floats("pgd_betas", config.pgd_betas)
  source = adversary.SourceConfig(
    config.pgd_scope, config.pgd_parametrization, config.pgd_step_rule,
    b1, b2, config.pgd_eps)
  lr = Schedule(config.pgd_lr, "constant", 1.0, config.pgd_lr_warmup_pct)
  return adversarial.PersistentConfig(
    source, lr, config.pgd_n_warmup, config.pgd_objective,
    config.pgd_start_frac)


def persistent_term(config: TrainConfig, sites,
                    lead_shape: tuple[int, ...]) -> train_step.LossTerm:
  """Return the persistent PGD term the flags describe."""
  # A scope naming positions fails here for positionless (toy) targets.
  adversary.scope_shape(config.pgd_scope, lead_shape, 1)
  plan = make_plan(config, sites, config.pgd_plan, config.pgd_routing,
                   config.subset_size)
  return adversarial.persistent_pgd_term(
    "persistent_pgd_recon", config.pgd_coeff, plan, persistent_config(config),
    sites, config.use_delta_component,
    rider=rider(config, sites, "persistent_pgd_recon"))


def merged_term(config: TrainConfig, sites,
                lead_shape: tuple[int, ...]) -> train_step.LossTerm:
  """Return the merged stochastic/persistent term the flags describe."""
  adversary.scope_shape(config.pgd_scope, lead_shape, 1)
  plan = make_plan(config, sites, config.merged_plan, config.merged_routing,
                   config.subset_size)
  final = config.merged_adv_fraction_final_frac
  fraction = (config.merged_adv_fraction if final == 1.0 else Schedule(
    config.merged_adv_fraction, "linear", final))
  return adversarial.persistent_pgd_term(
    "merged_recon", config.merged_coeff, plan, persistent_config(config),
    sites, config.use_delta_component,
    rider=rider(config, sites, "merged_recon"),
    merged=adversarial.Merged(fraction, config.sampling))


def fresh_term(config: TrainConfig, sites) -> train_step.LossTerm:
  """Return the fresh PGD term the flags describe."""
  fresh = adversarial.FreshConfig(
    config.fresh_pgd_init, config.fresh_pgd_scope, config.fresh_pgd_steps,
    config.fresh_pgd_step_size)
  plan = recon.all_sites_plan(sites, config.fresh_pgd_routing,
                              config.n_mask_samples)
  return adversarial.fresh_pgd_term(
    "fresh_pgd_recon", config.fresh_pgd_coeff, plan, fresh,
    config.use_delta_component)


def locality_term(config: TrainConfig, units) -> train_step.LossTerm:
  """Return the nonlinearity locality term the flags describe."""
  if not units:
    raise ValueError("this target declares no nonlinear units; drop "
                     "--nonlinearity_coeff")
  weights: dict[str, float | None] = {u.kind: 1.0 for u in units.values()}
  if config.nonlinearity_weights:
    weights = {}
    for item in config.nonlinearity_weights:
      kind, _, value = item.partition(":")
      if not value:
        raise ValueError(f"--nonlinearity_weights entry {item!r} is not "
                         "kind:weight")
      weights[kind] = None if value == "none" else _floats(
        "nonlinearity_weights", (value,))[0]
  final = config.nonlinearity_threshold_final_frac
  threshold = (config.nonlinearity_threshold if final == 1.0 else Schedule(
    config.nonlinearity_threshold, "linear", final))
  return locality.nonlinearity_locality_term(
    config.nonlinearity_coeff, threshold, units, weights)


def loss_terms(
  config: TrainConfig, sites: tuple[sites_lib.SiteSpec, ...],
  tokens_per_batch: int, units=None, lead_shape: tuple[int, ...] = (),
) -> tuple[train_step.LossTerm, ...]:
  """Return the configured loss terms, zero-coefficient terms left out.

  `lead_shape` is the batch's activation lead shape, `(B,)` by default.
  """
  lead_shape = lead_shape or (config.batch_size,)
  p = Schedule(config.p_start, config.p_schedule, config.p_final_frac)
  out = []
  if config.faithfulness_coeff:
    out.append(terms.faithfulness_term(config.faithfulness_coeff))
  if config.importance_coeff:
    out.append(terms.importance_minimality_term(
      config.importance_coeff, p, config.importance_eps))
  a_prime = float(config.reference_token_count or tokens_per_batch)
  if config.frequency_coeff and config.ema_halflife_steps:
    out.append(terms.ema_frequency_minimality_term(
      config.frequency_coeff, p, a_prime, config.ema_halflife_steps, sites,
      config.importance_eps))
  elif config.frequency_coeff:
    out.append(terms.frequency_minimality_term(
      config.frequency_coeff, p, a_prime, config.importance_eps))
  n = config.n_mask_samples
  plans: tuple = (
    ("stochastic_recon", config.stochastic_coeff,
     recon.all_sites_plan(sites, config.stochastic_routing, n)),
    ("stochastic_recon_per_site", config.per_site_coeff,
     recon.per_site_plan(sites, n)),
    ("stochastic_recon_subset", config.subset_coeff,
     recon.subset_chunks_plan(sites, config.subset_size,
                              config.subset_routing, n)),
  )
  if config.groups_coeff:
    plans += (("stochastic_recon_groups", config.groups_coeff,
               make_plan(config, sites, "groups", config.groups_routing, 1)),)
  for name, coeff, plan in plans:
    if coeff:
      out.append(terms.stochastic_recon_term(
        name, coeff, plan, config.use_delta_component, config.sampling,
        rider=rider(config, sites, name)))
  bundles = {}
  if config.pgd_coeff:
    out.append(persistent_term(config, sites, lead_shape))
    bundles["persistent_pgd_recon"] = config.pgd_bundle
  if config.merged_coeff:
    out.append(merged_term(config, sites, lead_shape))
    bundles["merged_recon"] = config.merged_bundle
  adversarial.check_bundles(bundles)
  if config.fresh_pgd_coeff:
    out.append(fresh_term(config, sites))
  if config.nonlinearity_coeff:
    out.append(locality_term(config, units))
  return tuple(out)
