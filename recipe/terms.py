"""The loss terms of a run: one table, and the builders it names.

A `Term` says all a run knows of one term: its name (the `LossTerm`'s, and
the `loss/<name>` metric's), its short form on the console line, the
`TrainConfig` field (and `bin/train` flag) of its coefficient (the term is
on when that is above 0), whether it takes the hidden-activation rider
(SPEC §5.9), whether it counts as a reconstruction term, its builder and,
for the non-target stream of a targeted decomposition (SPEC §6.6), its
stream. `TERMS` is in step order: the step folds each term's index into
its keys, so reordering it changes every run; the non-target terms come
last, so their keys follow every target term's.

With dual-role CI (`--ci_roles=output,hidden`) every recon and importance
minimality term a run turns on gets a hidden-role copy, `<name>_hidden`,
built after all the others (so their keys follow every output-role term's):
it runs in its stream's hidden pass, a recon copy at the term's coefficient
times `--hidden_pass_coeff`.
"""

import dataclasses
import fnmatch
from collections.abc import Callable
from typing import Any, NamedTuple

from decompax.core import adversary, ci_fns, schedules, step_records
from decompax.core import sites as sites_lib
from decompax.core.schedules import Schedule
from decompax.losses import (
  adversarial, hidden, locality, loss_terms, minimality, recon)
from decompax.recipe.config import TrainConfig, setting

# The streams of a targeted decomposition (`recipe.streams`).
TARGET, NONTARGET = "target", "nontarget"


class TermInputs(NamedTuple):
  """What the builders take beside the config: the run's sites and shapes.

  `units` are the target's nonlinear units (None or empty: it declares
  none); `lead_shape` is the batch's activation lead shape.
  """

  sites: tuple[sites_lib.SiteSpec, ...]
  tokens_per_batch: int
  units: Any
  lead_shape: tuple[int, ...]


# build(config, inputs, name, coeff) -> the term named `name`.
Builder = Callable[[TrainConfig, TermInputs, str, float],
                   step_records.LossTerm]


class Term(NamedTuple):
  """One loss term of the table (see the module docstring)."""

  name: str
  short: str
  coeff_flag: str
  build: Builder
  rider: bool = False
  recon: bool = False
  stream: str = ""
  minimality: bool = False

  @property
  def hidden_copy(self) -> bool:
    """Whether dual-role CI runs the term again in the hidden pass."""
    return self.recon or self.minimality


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
  n, p = config.n_mask_samples, route_probability(config, routing)
  if kind == "all_sites":
    return recon.all_sites_plan(sites, routing, n, p)
  if kind == "per_site":
    return recon.per_site_plan(sites, n)
  if kind == "subset":
    return recon.subset_chunks_plan(sites, subset_size, routing, n, p)
  return recon.custom_groups_plan(
    sites, parse_groups(config.recon_groups), routing, n, p)


def route_probability(config: TrainConfig, routing: str) -> float | None:
  """Return `--route_probability` for `static_probability` routing (other
  routings take none)."""
  return (config.route_probability if routing == "static_probability"
          else None)


def _floats(name: str, values: tuple[str, ...]) -> tuple[float, ...]:
  try:
    return tuple(float(v) for v in values)
  except ValueError:
    raise ValueError(
      f"--{name} must be numbers, got {','.join(values)}") from None


def rider(config: TrainConfig, sites,
          term: str) -> hidden.HiddenRider | None:
  """Return the hidden-activation rider of recon term `term`, if it has one."""
  if term not in config.hidden_terms:
    return None
  points = config.hidden_points or tuple(f"{s.name}.out" for s in sites)
  return hidden.HiddenRider(config.hidden_coeff, tuple(points))


def _p(config: TrainConfig) -> loss_terms.Sparsity:
  """Return what the minimality terms raise CI to: smooth-L0 on its γ
  schedule, or `p` on its knots or warmup-free decay (SPEC §5.2)."""
  if config.importance_penalty == "smooth_l0":
    with setting("smooth_l0_gamma_final_frac"):
      final = (1.0 if config.smooth_l0_gamma_schedule == "constant"
               else config.smooth_l0_gamma_final_frac)
      gamma = Schedule(config.smooth_l0_gamma,
                       config.smooth_l0_gamma_schedule, final)
      return minimality.SmoothL0(gamma, config.smooth_l0_normalized)
  if config.p_knots:
    with setting("p_knots"):
      return schedules.KnotSchedule(config.p_start,
                                    schedules.parse_knots(config.p_knots))
  with setting("p_final_frac"):
    return Schedule(config.p_start, config.p_schedule, config.p_final_frac)


def _faithfulness(config: TrainConfig, inputs: TermInputs, name: str,
                  coeff: float) -> step_records.LossTerm:
  del inputs, name
  return loss_terms.faithfulness_term(
    coeff, relative=config.faithfulness_form == "relative")


def importance_site_weights(config: TrainConfig, sites
                            ) -> dict[str, float]:
  """Return each site's weight of importance minimality from
  `--importance_site_weights` (`glob:weight`, the last matching entry
  wins; 1 where none matches).

  Raises:
    ValueError: an entry that is not `glob:weight` with a finite weight
      ≥ 0, or whose glob names no site.
  """
  names = [s.name for s in sites]
  weights = {n: 1.0 for n in names}
  for item in config.importance_site_weights:
    pattern, _, value = item.rpartition(":")
    number = _floats("importance_site_weights", (value,))[0] \
      if pattern and value not in ("", "none") else None
    if number is None or not 0.0 <= number < float("inf"):
      raise ValueError(f"--importance_site_weights entry {item!r} is not "
                       "site_glob:weight with a finite weight >= 0")
    matched = fnmatch.filter(names, pattern)
    if not matched:
      raise ValueError(f"--importance_site_weights entry {item!r} names no "
                       f"site; the sites are {', '.join(names)}")
    weights.update({n: number for n in matched})
  return weights


def _importance(config: TrainConfig, inputs: TermInputs, name: str,
                coeff: float) -> step_records.LossTerm:
  del name
  return loss_terms.importance_minimality_term(
    coeff, _p(config), config.importance_eps,
    site_weights=importance_site_weights(config, inputs.sites))


def _frequency(config: TrainConfig, inputs: TermInputs, name: str,
               coeff: float) -> step_records.LossTerm:
  """Return frequency minimality: on a firing EMA with a half-life, else on
  the batch's firing."""
  del name
  a_prime = float(config.reference_token_count or inputs.tokens_per_batch)
  if config.ema_halflife_steps:
    return loss_terms.ema_frequency_minimality_term(
      coeff, _p(config), a_prime, config.ema_halflife_steps, inputs.sites,
      config.importance_eps)
  return loss_terms.frequency_minimality_term(coeff, _p(config), a_prime,
                                              config.importance_eps)


def _stochastic(plan: Callable[[Any, tuple], recon.Plan]) -> Builder:
  """Return the builder of a stochastic recon term over `plan(config,
  sites)`."""

  def build(config: TrainConfig, inputs: TermInputs, name: str,
            coeff: float) -> step_records.LossTerm:
    return loss_terms.stochastic_recon_term(
      name, coeff, plan(config, inputs.sites), config.use_delta_component,
      config.sampling, rider=rider(config, inputs.sites, name))

  return build


def _all_sites_plan(config: TrainConfig, sites) -> recon.Plan:
  routing = config.stochastic_routing
  with setting("route_probability"):
    return recon.all_sites_plan(sites, routing, config.n_mask_samples,
                                route_probability(config, routing))


def _per_site_plan(config: TrainConfig, sites) -> recon.Plan:
  return recon.per_site_plan(sites, config.n_mask_samples)


def _subset_plan(config: TrainConfig, sites) -> recon.Plan:
  routing = config.subset_routing
  with setting("route_probability"):
    return recon.subset_chunks_plan(sites, config.subset_size, routing,
                                    config.n_mask_samples,
                                    route_probability(config, routing))


def _groups_plan(config: TrainConfig, sites) -> recon.Plan:
  # One draw per group, whatever --n_mask_samples says.
  return make_plan(config, sites, "groups", config.groups_routing, 1)


def persistent_config(config: TrainConfig) -> adversarial.PersistentConfig:
  """Return the source settings shared by the persistent and merged terms."""
  b1, b2 = _floats("pgd_betas", config.pgd_betas)
  source = adversary.SourceConfig(
    config.pgd_scope, config.pgd_parametrization, config.pgd_step_rule,
    b1, b2, config.pgd_eps)
  with setting("pgd_lr_warmup_pct"):
    lr = Schedule(config.pgd_lr, "constant", 1.0, config.pgd_lr_warmup_pct)
  with setting("pgd_start_frac"):
    return adversarial.PersistentConfig(
      source, lr, config.pgd_n_warmup, config.pgd_objective,
      config.pgd_start_frac)


def _persistent_term(config: TrainConfig, inputs: TermInputs, name: str,
                     coeff: float, plan_kind: str, routing: str,
                     merged: adversarial.Merged | None = None
                     ) -> step_records.LossTerm:
  """Return a persistent-adversary term over the plan `plan_kind` routed by
  `routing` (the persistent PGD term, or with `merged` the merged one)."""
  # A scope naming positions fails here for positionless (toy) targets.
  adversary.scope_shape(config.pgd_scope, inputs.lead_shape, 1)
  sites = inputs.sites
  plan = make_plan(config, sites, plan_kind, routing, config.subset_size)
  return adversarial.persistent_pgd_term(
    name, coeff, plan, persistent_config(config), sites,
    config.use_delta_component, rider=rider(config, sites, name),
    merged=merged)


def _persistent(config: TrainConfig, inputs: TermInputs, name: str,
                coeff: float) -> step_records.LossTerm:
  """Return the persistent PGD term the flags describe."""
  return _persistent_term(config, inputs, name, coeff, config.pgd_plan,
                          config.pgd_routing)


def merged_mix(config: TrainConfig) -> adversarial.Merged:
  """Return the merged terms' adversarial fraction (on its linear anneal
  when it has a final fraction) and sampling."""
  final = config.merged_adv_fraction_final_frac
  fraction = (config.merged_adv_fraction if final == 1.0 else Schedule(
    config.merged_adv_fraction, "linear", final))
  return adversarial.Merged(fraction, config.sampling)


def _merged(config: TrainConfig, inputs: TermInputs, name: str,
            coeff: float) -> step_records.LossTerm:
  """Return the merged stochastic/persistent term the flags describe."""
  return _persistent_term(config, inputs, name, coeff, config.merged_plan,
                          config.merged_routing, merged_mix(config))


def _fresh(config: TrainConfig, inputs: TermInputs, name: str,
           coeff: float) -> step_records.LossTerm:
  """Return the fresh PGD term the flags describe."""
  fresh = adversarial.FreshConfig(
    config.fresh_pgd_init, config.fresh_pgd_scope, config.fresh_pgd_steps,
    config.fresh_pgd_step_size)
  routing = config.fresh_pgd_routing
  with setting("route_probability"):
    plan = recon.all_sites_plan(inputs.sites, routing, config.n_mask_samples,
                                route_probability(config, routing))
  return adversarial.fresh_pgd_term(
    name, coeff, plan, fresh, config.use_delta_component)


def _nontarget_recon(config: TrainConfig, inputs: TermInputs, name: str,
                     coeff: float) -> step_records.LossTerm:
  """Return the non-target stream's reconstruction: stochastic sources, or
  masks at the stream's own lower CI; the stream pins the delta on."""
  plan = _all_sites_plan(config, inputs.sites)
  if config.nontarget_sources == "constant":
    return loss_terms.constant_recon_term(name, coeff, plan)
  return loss_terms.stochastic_recon_term(name, coeff, plan, False,
                                          config.sampling)


def _nontarget_unmasked(config: TrainConfig, inputs: TermInputs, name: str,
                        coeff: float) -> step_records.LossTerm:
  del config, inputs
  return loss_terms.unmasked_no_delta_term(name, coeff)


def _nontarget_importance(config: TrainConfig, inputs: TermInputs,
                          name: str, coeff: float) -> step_records.LossTerm:
  del inputs
  return loss_terms.importance_minimality_term(coeff, _p(config),
                                               config.importance_eps, name)


def _nontarget_adversary(config: TrainConfig, inputs: TermInputs, name: str,
                         coeff: float, plan_kind: str, routing: str,
                         merged: adversarial.Merged | None = None
                         ) -> step_records.LossTerm:
  """Return a persistent adversary of the non-target stream: its own
  sources over the components only (the stream pins the delta), no
  rider."""
  adversary.scope_shape(config.pgd_scope, inputs.lead_shape, 1)
  plan = make_plan(config, inputs.sites, plan_kind, routing,
                   config.subset_size)
  return adversarial.persistent_pgd_term(
    name, coeff, plan, persistent_config(config), inputs.sites, False,
    merged=merged)


def _nontarget_persistent(config: TrainConfig, inputs: TermInputs,
                          name: str, coeff: float) -> step_records.LossTerm:
  return _nontarget_adversary(config, inputs, name, coeff, config.pgd_plan,
                              config.pgd_routing)


def _nontarget_merged(config: TrainConfig, inputs: TermInputs, name: str,
                      coeff: float) -> step_records.LossTerm:
  return _nontarget_adversary(config, inputs, name, coeff,
                              config.merged_plan, config.merged_routing,
                              merged_mix(config))


def _unit_weights(config: TrainConfig, units) -> dict[str, float | None]:
  """Return the weight of each unit kind (None: that kind is left out)."""
  if not config.nonlinearity_weights:
    return {u.kind: 1.0 for u in units.values()}
  weights: dict[str, float | None] = {}
  for item in config.nonlinearity_weights:
    kind, _, value = item.partition(":")
    if not value:
      raise ValueError(f"--nonlinearity_weights entry {item!r} is not "
                       "kind:weight")
    weights[kind] = None if value == "none" else _floats(
      "nonlinearity_weights", (value,))[0]
  return weights


def _locality(config: TrainConfig, inputs: TermInputs, name: str,
              coeff: float) -> step_records.LossTerm:
  """Return the nonlinearity locality term the flags describe."""
  del name
  if not inputs.units:
    raise ValueError("this target declares no nonlinear units; drop "
                     "--nonlinearity_coeff")
  final = config.nonlinearity_threshold_final_frac
  threshold = (config.nonlinearity_threshold if final == 1.0 else Schedule(
    config.nonlinearity_threshold, "linear", final))
  return locality.nonlinearity_locality_term(
    coeff, threshold, inputs.units,
    _unit_weights(config, inputs.units))


TERMS: tuple[Term, ...] = (
  Term("faithfulness", "faith", "faithfulness_coeff", _faithfulness),
  Term("importance_minimality", "imp", "importance_coeff", _importance,
       minimality=True),
  Term("frequency_minimality", "freq", "frequency_coeff", _frequency),
  Term("stochastic_recon", "recon", "stochastic_coeff",
       _stochastic(_all_sites_plan), rider=True, recon=True),
  Term("stochastic_recon_per_site", "recon_site", "per_site_coeff",
       _stochastic(_per_site_plan), rider=True, recon=True),
  Term("stochastic_recon_subset", "recon_subset", "subset_coeff",
       _stochastic(_subset_plan), rider=True, recon=True),
  Term("stochastic_recon_groups", "recon_groups", "groups_coeff",
       _stochastic(_groups_plan), rider=True, recon=True),
  Term("persistent_pgd_recon", "pgd", "pgd_coeff", _persistent, rider=True,
       recon=True),
  Term("merged_recon", "merged", "merged_coeff", _merged, rider=True,
       recon=True),
  Term("fresh_pgd_recon", "fresh_pgd", "fresh_pgd_coeff", _fresh,
       recon=True),
  Term("nonlinearity_locality", "nl", "nonlinearity_coeff", _locality),
  Term("nontarget_recon", "recon", "nontarget_recon_coeff",
       _nontarget_recon, recon=True, stream=NONTARGET),
  Term("nontarget_unmasked_recon", "unmasked", "nontarget_unmasked_coeff",
       _nontarget_unmasked, stream=NONTARGET),
  Term("nontarget_importance_minimality", "imp",
       "nontarget_importance_coeff", _nontarget_importance,
       stream=NONTARGET, minimality=True),
  Term("nontarget_persistent_pgd_recon", "pgd", "nontarget_pgd_coeff",
       _nontarget_persistent, recon=True, stream=NONTARGET),
  Term("nontarget_merged_recon", "merged", "nontarget_merged_coeff",
       _nontarget_merged, recon=True, stream=NONTARGET),
)

# The terms that take the hidden-activation rider, by name.
RIDER_TERMS: dict[str, Term] = {t.name: t for t in TERMS if t.rider}


def coeff_of(config: TrainConfig, term: Term) -> float:
  """Return the coefficient `config` gives `term` (0: off)."""
  return getattr(config, term.coeff_flag)


def hidden_name(name: str) -> str:
  """Return the name of term `name`'s hidden-role copy."""
  return name + ci_fns.role_suffix(ci_fns.HIDDEN)


def console_losses(metrics: dict, targeted: bool) -> list[str]:
  """Return the console line's `short value` pairs of the terms present in
  `metrics`, each stream's behind its name in a targeted run; a hidden-role
  copy shows as `<short>_h` after the output-role terms."""
  parts = []
  for stream in (TARGET, NONTARGET) if targeted else ("",):
    shown = []
    for suffix in ("", "_h"):
      for t in TERMS:
        if (t.stream or (TARGET if targeted else "")) != stream:
          continue
        name = hidden_name(t.name) if suffix else t.name
        key = step_records.term_metric(name, stream)
        if key in metrics:
          shown.append(f"{t.short}{suffix} {metrics[key]:.3e}")
    if shown and stream:
      shown[0] = f"{stream}: {shown[0]}"
    parts.extend(shown)
  return parts


def build_terms(
  config: TrainConfig, inputs: TermInputs | dict[str, TermInputs],
) -> tuple[step_records.LossTerm, ...]:
  """Return the terms `config` turns on (coefficient above 0), in table
  order, then their hidden-role copies. A targeted run (`inputs` by stream)
  tags the plain terms with the target stream and the rest with their
  own."""
  on = [t for t in TERMS if coeff_of(config, t) > 0]
  built = []
  for t in on:
    stream, own = _stream_of(t, inputs)
    built.append(t.build(config, own, t.name, coeff_of(config, t))._replace(
      stream=stream))
  if ci_fns.HIDDEN in config.ci_roles:
    built += [hidden_copy(config, t, inputs) for t in on if t.hidden_copy]
  return tuple(built)


def _stream_of(t: Term, inputs: TermInputs | dict[str, TermInputs]
               ) -> tuple[str, TermInputs]:
  """Return the stream term `t` scores and that stream's inputs: in a
  targeted run (`inputs` by stream) its own stream, or the target's for a
  plain term; otherwise the one unnamed stream."""
  if not isinstance(inputs, dict):
    return "", inputs
  stream = t.stream or TARGET
  return stream, inputs[stream]


def hidden_copy(config: TrainConfig, t: Term,
                inputs: TermInputs | dict[str, TermInputs]
                ) -> step_records.LossTerm:
  """Return term `t` rebuilt for its stream's hidden pass: hidden role, no
  rider (a hidden pass scores hidden activations alone), recon terms at
  `--hidden_pass_coeff` times their coefficient."""
  stream, own = _stream_of(t, inputs)
  coeff = coeff_of(config, t) * (config.hidden_pass_coeff if t.recon else 1.0)
  riderless = dataclasses.replace(config, hidden_terms=())
  return t.build(riderless, own, hidden_name(t.name), coeff)._replace(
    name=hidden_name(t.name), stream=stream, role=ci_fns.HIDDEN,
    clean_taps=())
