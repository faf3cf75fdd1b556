"""The units a harvest sets beside the components: the neurons of every MLP
with a decomposed site (`BASELINES`; of a mixture of experts, every expert
with one, its neurons weighted by its routing weight), the heads of every
attention with one (`HEADS`), their taps, weights and random rotations,
each unit's activity on a batch, and the per-site baselines calibrated to
the components' density (`calibrate`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from decompax.analysis import explore, harvest_batches, harvest_settings
from decompax.measures import unit_activity
from decompax.recipe import assembly
from decompax.targets import glu_block, glu_norms, glu_weights


class MlpForm(NamedTuple):
  """How a model's MLP neurons are formed: `act(gate)·up` when `gated`,
  else `act(up)`; a mixture of experts' `routing` gives each expert's
  weights from the router logits (`glu_block.routing_weights`)."""

  gated: bool = True
  act: Callable[[jax.Array], jax.Array] = jax.nn.silu
  routing: Optional[Callable[[jax.Array], jax.Array]] = None


def mlp_form(run: explore.LoadedRun) -> MlpForm:
  """Return the MLP form of a run's model (a GLU model's; the default for
  targets without one, which have no baseline layers)."""
  model = assembly.resolve_target(run.config).record.token_model
  if model is None:
    return MlpForm()
  routing = (lambda logits: glu_block.routing_weights(logits, model)
             ) if model.moe else None
  return MlpForm(model.gated, glu_norms.activation(model), routing)


# An MLP with baselines: a layer's (its index), or one expert's of a
# mixture-of-experts layer (`(layer, expert)`).
MlpUnit = int | tuple[int, int]


def mlp_prefix(unit: MlpUnit) -> str:
  """Return the name an MLP's taps and baseline keys start with."""
  if isinstance(unit, tuple):
    return f"layers.{unit[0]}.mlp.experts.{unit[1]}"
  return f"layers.{unit}.mlp"


def mlp_kinds(mlp: MlpForm) -> tuple[str, ...]:
  """Return the `BASELINES` kinds an MLP of form `mlp` has."""
  return harvest_settings.BASELINES if mlp.gated else tuple(
    k for k in harvest_settings.BASELINES if k != "gates")


def baseline_layers(run: explore.LoadedRun) -> tuple[MlpUnit, ...]:
  """Return the MLPs with a decomposed site (a GLU model's; none for other
  targets): layers, or a mixture of experts' `(layer, expert)`."""
  units = set()
  for s in run.target.sites:
    parsed = glu_weights.parse_site(s.name)
    if parsed is not None and parsed[1] in ("gate", "up", "down"):
      units.add(parsed[0])
    elif parsed is not None and parsed[1] in glu_weights.EXPERT_ROLES:
      units.add((parsed[0], glu_weights.site_expert(s.name)))
  return tuple(sorted(units))


def site_mlps(run: explore.LoadedRun) -> tuple[tuple[str, MlpUnit], ...]:
  """Return each MLP site (a GLU model's) with the MLP whose neurons its
  matched baselines (`SITE_BASELINES`) take: its layer's, or its
  expert's."""
  out = []
  for s in run.target.sites:
    parsed = glu_weights.parse_site(s.name)
    if parsed is not None and parsed[1] in ("gate", "up", "down"):
      out.append((s.name, parsed[0]))
    elif parsed is not None and parsed[1] in glu_weights.EXPERT_ROLES:
      out.append((s.name, (parsed[0], glu_weights.site_expert(s.name))))
  return tuple(out)


def head_layers(run: explore.LoadedRun) -> tuple[int, ...]:
  """Return the layers with a decomposed attention site (a GLU model's)."""
  parsed = (glu_weights.parse_site(s.name) for s in run.target.sites)
  return tuple(sorted({p[0] for p in parsed
                       if p is not None and p[1] in ("q", "k", "v", "o")}))


def baseline_keys(layers: tuple[MlpUnit, ...],
                  heads: tuple[int, ...] = (),
                  mlp: MlpForm = MlpForm(),
                  sites: tuple[tuple[str, MlpUnit], ...] = ()
                  ) -> tuple[str, ...]:
  """Return the store keys of the baselines of `layers` (MLPs of form
  `mlp`), `heads` (attention) and `sites` (`site_mlps`)."""
  return tuple(f"{mlp_prefix(i)}.{kind}" for i in layers
               for kind in mlp_kinds(mlp)) + tuple(
    f"layers.{i}.self_attn.{harvest_settings.HEADS}" for i in heads) + tuple(
    f"{site}.{kind}" for site, _ in sites
    for kind in harvest_settings.SITE_BASELINES)


def _layer_o(weights: glu_weights.GluWeights, layer: int) -> jax.Array:
  """Return `o_proj` of a layer from whichever stored stack holds it."""
  at = 0
  for stack in (weights.prefix, weights.span, weights.tail):
    if stack is None:
      continue
    if layer < at + stack.o.shape[0]:
      return stack.o[layer - at]
    at += stack.o.shape[0]
  raise ValueError(f"layer {layer} is past the model's {at} layers")


def n_heads(run: explore.LoadedRun) -> int:
  """Return the attention heads of a GLU run's model."""
  return assembly.resolve_target(run.config).record.token_model.n_heads


def mlp_taps(layers: tuple[MlpUnit, ...], mlp: MlpForm = MlpForm()
              ) -> tuple[str, ...]:
  roles = ("gate", "up") if mlp.gated else ("up",)
  routers = tuple(dict.fromkeys(
    glu_weights.router_tap(i[0]) for i in layers if isinstance(i, tuple)))
  return tuple(f"{mlp_prefix(i)}.{role}_proj.out" for i in layers
               for role in roles) + routers


def baseline_weights(run: explore.LoadedRun,
                     settings: harvest_settings.Settings,
                     layers: tuple[MlpUnit, ...], heads: tuple[int, ...]
                     ) -> dict[str, jax.Array]:
  """Return what the baselines' activities read besides the forward: the
  rotations of `layers` (`rotations`) and `o_proj` of `heads`, stacked."""
  out = {}
  if layers:
    out["rotation"] = rotations(run, settings, layers)
  if heads:
    out["w_o"] = jnp.stack([_layer_o(run.weights, i) for i in heads])
  return out


def rotations(run: explore.LoadedRun, settings: harvest_settings.Settings,
              layers: tuple[MlpUnit, ...]) -> jax.Array:
  """Return the random rotation of each MLP's neurons (Haar, from the
  harvest's seed folded with the layer, then an expert's index):
  `[layers, d_ff, d_ff]`."""
  up = tuple(f"{mlp_prefix(i)}.up_proj.out" for i in layers)
  taps = jax.eval_shape(
    lambda w, x: run.target.clean_forward(w, x, up)[1],
    run.weights, harvest_batches.batch_shape(run, settings))
  d_ff = taps[up[0]].shape[-1]
  key = jax.random.key(settings.seed)

  def folded(unit):
    if isinstance(unit, tuple):
      return jax.random.fold_in(jax.random.fold_in(key, unit[0]), unit[1])
    return jax.random.fold_in(key, unit)

  return jnp.stack([unit_activity.random_rotation(folded(i), d_ff)
                    for i in layers])


def _o_taps(heads: tuple[int, ...]) -> tuple[str, ...]:
  return tuple(f"layers.{i}.self_attn.o_proj" for i in heads)


def baseline_taps(layers: tuple[MlpUnit, ...], heads: tuple[int, ...],
                  mlp: MlpForm = MlpForm()) -> tuple[str, ...]:
  """Return the clean forward's taps the baselines' activities read."""
  return mlp_taps(layers, mlp) + _o_taps(heads)


def mlp_activity(taps: dict[str, jax.Array], unit: MlpUnit,
                  rotation: jax.Array, mlp: MlpForm) -> dict[str, jax.Array]:
  prefix = mlp_prefix(unit)
  up = taps[f"{prefix}.up_proj.out"]
  gate = taps[f"{prefix}.gate_proj.out"] if mlp.gated else None
  hidden = unit_activity.mlp_hidden(up, gate, mlp.act)
  gates = {} if gate is None else {
    "gates": unit_activity.gate_activity(gate, mlp.act)}
  out = {"neurons": unit_activity.neuron_activity(hidden), **gates,
         "rotated": unit_activity.rotated_activity(hidden, rotation)}
  if not isinstance(unit, tuple):
    return out
  # An expert's units count where its output does: by its routing weight
  # (≥ 0, so each stays a positive part).
  routing = mlp.routing(taps[glu_weights.router_tap(unit[0])])
  weight = routing[..., unit[1], None]
  return {k: a * weight.astype(a.dtype) for k, a in out.items()}


def baseline_activity(taps: dict[str, jax.Array],
                      layers: tuple[MlpUnit, ...],
                      heads: tuple[int, ...], n_head: int,
                      extra: dict[str, Any],
                      mlp: MlpForm = MlpForm()) -> dict[str, jax.Array]:
  """Return every baseline's activity, by store key, from the clean
  forward's `baseline_taps` (traceable; `extra` from `baseline_weights`;
  the MLPs of form `mlp`)."""
  out = {}
  for j, i in enumerate(layers):
    for kind, a in mlp_activity(taps, i, extra["rotation"][j],
                                 mlp).items():
      out[f"{mlp_prefix(i)}.{kind}"] = a
  for j, (i, key) in enumerate(zip(heads, _o_taps(heads))):
    out[f"layers.{i}.self_attn.{harvest_settings.HEADS}"] = (
      unit_activity.head_activity(taps[key], extra["w_o"][j], n_head))
  return out


def site_activity(activity: dict[str, jax.Array],
                  sites: tuple[tuple[str, MlpUnit], ...],
                  calibration: Optional[dict[str, dict[str, jax.Array]]]
                  ) -> dict[str, jax.Array]:
  """Return the matched baselines' activity of each site of `sites`
  (`SITE_BASELINES`, by store key) from its MLP's neurons in `activity`
  (`baseline_activity`), with the settings `calibrate` found (None only
  for no sites)."""
  out = {}
  for site, unit in sites:
    neurons = activity[f"{mlp_prefix(unit)}.neurons"]
    c = calibration[site]
    out[f"{site}.density_matched"] = unit_activity.density_matched_activity(
      neurons, c["threshold"])
    out[f"{site}.top_k"] = unit_activity.top_k_activity(neurons, c["k"])
  return out
