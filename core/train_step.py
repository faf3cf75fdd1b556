"""The training step factory (SPEC §6.1, §6.3).

`make_train_step` builds ONE jitted pure step `(state, weights, inputs) →
(state, metrics)` from a target's function table, a CI function, a static
tuple of loss terms and optimizer settings. Frozen target weights are a
runtime argument. Everything the step changes lives in `TrainState`; keys are
derived from `(state.rng, state.step)`, never carried forward.

Order inside a step (SPEC §6.1): one stop-gradient clean pass; `prep(θ)`
(components and CI) evaluated once, its VJP kept; each term's `prepare` runs
on stop-gradient copies (adversary warmup ascents, fresh PGD); ONE backward of
the coefficiented objective with respect to the prepared values and the
terms' inputs; the VJP pulls the prepared cotangents back to θ; each term's
`finish` consumes its input gradients (the final ascent); then the updates.
Each stage is a top-level function over the step's `StepPlan` (what
`make_train_step` derives once from its settings), composed by `run_step`,
so each can be run and tested alone.

Targeted decomposition (SPEC §6.6) runs several named *streams* in the one
step: each has its own batch, clean pass, CI and terms (`LossTerm.stream`),
all summed into the one objective whose single backward updates the shared
components and CI parameters. A stream may pin the delta path on
(`StreamSpec.delta_pin`) and average its output divergence over chosen
positions only (`StreamSpec.loss_positions`, a task's answer positions).

A dual-role CI function (`CIFn.roles`: output and hidden) reads out two CIs
per stream from one trunk. A *pass* is one (stream, role): its terms see
that role's CI (`LossTerm.role`), and a hidden pass scores the relative
error of `StepConfig.hidden_points` instead of the output divergence
(`StepContext.hidden_points`). Two streams and two roles make four passes,
each stream's clean forward still run once. The passes are scored in one
backward, or with `StepConfig.sequential_passes` one after another behind
an optimization barrier, their gradients added: the same objective with one
pass's masked forwards alive at a time.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from decompax.core import health as health_lib, optim, schedules, slots, squash
from decompax.core.ci_fns import OUTPUT, CIFn, role_pre, role_suffix
from decompax.core.sites import Components
from decompax.core.target import Batch, TargetFns, Weights


class TrainState(NamedTuple):
  """Everything a training step reads and writes.

  `term_states` maps the name of each stateful loss term (one with
  `init_state`) to its state record: persistent adversary sources and
  moments, frequency EMAs; stateless terms have no entry. `health` counts
  the non-finite steps and names the first (`core.health`).
  """

  components: Components
  ci_params: Any
  components_opt: optax.OptState
  ci_opt: optax.OptState
  term_states: dict[str, Any]
  step: Int[Array, ""]
  rng: Key[Array, ""]
  health: health_lib.Health


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  """One data stream of a multi-stream (targeted) step.

  `delta_pin`: every masked forward of the stream runs the delta path at
  `δ ≡ 1` (the non-target stream, SPEC §6.6), whatever its masks carry; a
  term opts out by clearing `StepContext.delta_pin`. `loss_positions`: the
  output divergence averages over these positions of the sequence axis only
  (None: every position).
  """

  name: str
  delta_pin: bool = False
  loss_positions: Optional[tuple[int, ...]] = None

  def __post_init__(self):
    if "/" in self.name:
      raise ValueError(f"a stream's name is a metric prefix and takes no "
                       f"'/', got {self.name!r}")
    if self.loss_positions is not None and not self.loss_positions:
      raise ValueError(f"stream {self.name}: loss_positions names no "
                       "position; give None for every position")


# (placement category, pytree) -> the pytree pinned to that category's layout
# (`jax.lax.with_sharding_constraint`); built by `decompax.placement`.
Constrain = Callable[[str, Any], Any]


def no_constraint(role: str, tree: Any) -> Any:
  """Return `tree` unchanged: the single-device placement."""
  del role
  return tree


class StepContext(NamedTuple):
  """What a loss term sees inside one step (a plain container, not a leaf)."""

  step: Int[Array, ""]
  total_steps: int
  target: TargetFns
  weights: Weights
  inputs: Batch
  clean_output: Float[Array, "..."]
  components: Components
  ci: squash.CIOutput
  # Everything the clean forward tapped: CI inputs, the target's start taps
  # and the taps terms asked for.
  clean_taps: Optional[dict] = None
  # Pins intermediates to the placement table (SPEC §8); identity by default.
  constrain: Constrain = no_constraint
  # V/U in the step's compute dtype, cast once per step (N4); masked
  # forwards read these. None: they read `components`.
  compute_components: Optional[Components] = None
  # The stream's delta pin and loss positions (`StreamSpec`).
  delta_pin: bool = False
  loss_positions: Optional[tuple[int, ...]] = None
  # A hidden pass: its recon terms score the relative error of these
  # activations, never the output (`losses.hidden.forward_loss`).
  hidden_points: tuple[str, ...] = ()
  # The forwards stop at the target's output head (`TargetFns.split_head`):
  # `clean_output` and masked outputs are the head's input, and
  # `output_divergence` runs the head fused with the divergence.
  split_head: bool = False

  def operands(self) -> Components:
    """Return V/U as a masked forward consumes them."""
    components = (self.components if self.compute_components is None
                  else self.compute_components)
    return self.constrain("operands", components)

  def pinned(self, site_masks: dict) -> dict:
    """Return `site_masks` with the delta path at 1 when the stream pins it."""
    if not self.delta_pin:
      return site_masks
    return {name: m._replace(delta=jnp.ones(m.mask.shape[:-1], m.mask.dtype))
            for name, m in site_masks.items()}

  def masked_forward(self, site_masks) -> Float[Array, "..."]:
    """Run the target with `site_masks` on the step's inputs and components."""
    if self.split_head or self.target.masked_forward_taps is not None:
      return self.masked_forward_with_taps(site_masks, ())[0]
    return self.target.masked_forward(
      self.weights, self.operands(), self.inputs, self.pinned(site_masks)
    )

  def output_divergence(self, output: Float[Array, "..."]) -> Float[Array, ""]:
    """Return the target's divergence of `output` from the clean output,
    over the stream's loss positions."""
    clean = self.clean_output
    if self.loss_positions is not None:
      picked = jnp.asarray(self.loss_positions)
      output, clean = output[:, picked], clean[:, picked]
    if self.split_head:
      return self.target.split_head.divergence(self.weights, output, clean)
    return self.target.divergence(output, clean)

  def masked_forward_with_taps(
    self, site_masks, wanted: tuple[str, ...]
  ) -> tuple[Float[Array, "..."], dict[str, Float[Array, "..."]]]:
    """Run the masked forward and return the `wanted` activations too."""
    forward = (self.target.split_head.masked_forward_taps if self.split_head
               else self.target.masked_forward_taps)
    if forward is None:
      raise ValueError("this target's masked forward returns no activations; "
                       "drop the hidden-activation terms")
    return forward(
      self.weights, self.operands(), self.inputs,
      self.pinned(site_masks), self.clean_taps or {}, wanted)

  def lead_shape(self) -> tuple[int, ...]:
    """Return the leading (non-feature) shape of the step's activations."""
    return tuple(self.target.batch_lead_shape(self.inputs))


TermFn = Callable[[StepContext, Key[Array, ""], Any], tuple[Array, Any]]


class LossTerm(NamedTuple):
  """One coefficiented term of the objective, with optional state hooks.

  `fn(ctx, key, inputs) -> (value, aux)` runs inside the differentiated
  objective; `inputs` come from `prepare` and are differentiated too.
  `init_state(key, lead_shape)` builds the term's persistent state (kept in
  `TrainState.term_states[name]`); `prepare(ctx, key, state) -> (state,
  inputs)` runs before the backward on a stop-gradient context (`state` is
  None for a stateless term); `finish(ctx, key, state, inputs, input_grads,
  aux) -> state` runs after it, and only a stateful term has one. The three
  hooks of a step receive the same `key`. With `coeff_on_model_side`, the
  coefficient scales only the cotangents reaching components and CI, so the
  inputs' gradient is that of the unscaled term (SPEC §5.6: valid at
  coefficient 0).
  `report(aux)` adds scalars to the step's metrics under `loss/`.
  `clean_taps` names activations the term reads from the step's clean
  forward (`ctx.clean_taps`). `stream` names the stream the term scores
  (`StepConfig.streams`; "" in a one-stream step); its metrics then read
  `<stream>/loss/<name without the "<stream>_" prefix>`. `role` names the
  CI role whose masks it reads (`CIFn.roles`); a `hidden` term runs in its
  stream's hidden pass.
  """

  name: str
  coeff: schedules.Coefficient
  fn: TermFn
  init_state: Optional[Callable[[Key[Array, ""], tuple[int, ...]], Any]] = None
  prepare: Optional[Callable[..., tuple[Any, Any]]] = None
  finish: Optional[Callable[..., Any]] = None
  coeff_on_model_side: bool = False
  report: Optional[Callable[[Any], dict[str, Array]]] = None
  clean_taps: tuple[str, ...] = ()
  stream: str = ""
  role: str = OUTPUT

  def metric(self, key: Optional[str] = None) -> str:
    """Return the metric name of the term's value (or of its reported
    `key`), as `term_metric` names it."""
    return term_metric(key or self.name, self.stream)


def term_metric(name: str, stream: str = "") -> str:
  """Return the metric name of term value `name`: `loss/<name>`, or on a
  stream `<stream>/loss/<name>` without a leading `<stream>_`."""
  if not stream:
    return f"loss/{name}"
  return f"{stream}/loss/{name.removeprefix(stream + '_')}"


def simple_term(
  name: str, coeff: schedules.Coefficient,
  value_fn: Callable[[StepContext, Key[Array, ""]], Float[Array, ""]],
) -> LossTerm:
  """Return a stateless term whose value is `value_fn(ctx, key)`."""

  def fn(ctx, key, inputs):
    del inputs
    return value_fn(ctx, key), None

  return LossTerm(name, coeff, fn)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of the step."""

  total_steps: int
  components_opt: optim.AdamWConfig | optim.MuonConfig
  ci_opt: optim.AdamWConfig
  ci_alive_threshold: float = 0.0
  # SPEC N4 (LMs: "bfloat16"): V/U are cast to this dtype once per step
  # before any gather, CI parameters and taps before the CI call. None (toys)
  # computes with the fp32 masters as they are.
  compute_dtype: Optional[str] = None
  # What a non-finite step does to the state: "stop" applies it (the host
  # stops the run at its next look at `health`), "skip" drops the update
  # and keeps the previous state (only the step counter moves on).
  on_nonfinite: str = "stop"
  # Targeted decomposition: the streams, in the order their batches and
  # terms come (empty: one unnamed stream taking a plain batch).
  streams: tuple[StreamSpec, ...] = ()
  # CI-scaled decay after the update (SPEC §6.6): each component's V column
  # and U row shrink by `1 − lr(s)·wd·(1 − max CI)`; 0 turns it off.
  ci_scaled_decay: float = 0.0
  # The activations a hidden pass reconstructs (dual-role CI).
  hidden_points: tuple[str, ...] = ()
  # Score one pass at a time behind an optimization barrier and add the
  # gradients: one pass's masked forwards alive at a time, same objective.
  sequential_passes: bool = False


class TrainStep(NamedTuple):
  """The jitted step and the function that builds its initial state.

  `steps(state, weights, data_key, n)` runs `n` steps (a traced count, 1 to
  any) in one call and returns the last one's metrics (`repeated_steps`);
  None where the step takes its batch from the host, one per step.
  """

  init: Callable[..., TrainState]
  step: Callable[..., tuple[TrainState, dict[str, Array]]]
  steps: Optional[Callable[..., tuple[TrainState, dict[str, Array]]]] = None


class StepShardings(NamedTuple):
  """The jitted step's argument and result shardings (SPEC §8): trees (or
  prefixes) of `jax.sharding.Sharding` for the state, the frozen weights,
  the inputs (or data key) and the metrics."""

  state: Any
  weights: Any
  inputs: Any
  metrics: Any


def ci_l0(
  ci_lower: dict[str, Float[Array, "*l c"]], threshold: float
) -> dict[str, Float[Array, ""]]:
  """Return per site the position-mean count of components above threshold."""
  return {
    site: jnp.mean(jnp.sum(ci > threshold, axis=-1, dtype=jnp.float32))
    for site, ci in ci_lower.items()
  }


@jax.custom_vjp
def scale_cotangent(x: Any, scale: Float[Array, ""]) -> Any:
  """Return `x` unchanged; its cotangent is multiplied by `scale`."""
  del scale
  return x


def _scale_fwd(x, scale):
  return x, scale


def _scale_bwd(scale, g):
  return jax.tree.map(lambda t: t * scale.astype(t.dtype), g), jnp.zeros_like(
    scale)


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


# The run key's fold-ins below 2**31 are step keys; term states take the top
# of the uint32 range, which a step counter (int32) never reaches.
TERM_STATE_STREAM = 2**32 - 1


def _term_keys(step_key, n):
  return [jax.random.fold_in(step_key, 1 + j) for j in range(n)]


def with_prepared(ctx: StepContext, prepared: tuple) -> StepContext:
  """Return `ctx` reading `prepared`: `(components, ci)`, then the
  compute-dtype V/U when the step casts them (N4)."""
  components, ci, *compute = prepared
  return ctx._replace(components=components, ci=ci,
                      compute_components=compute[0] if compute else None)


def prepared_of(ctx: StepContext) -> tuple:
  """Return what `with_prepared` read into `ctx` (its inverse)."""
  if ctx.compute_components is None:
    return ctx.components, ctx.ci
  return ctx.components, ctx.ci, ctx.compute_components


def cast_floats(tree: Any, dtype: Any) -> Any:
  """Return `tree` with its floating-point leaves cast to `dtype`."""
  return jax.tree.map(
    lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
    else a, tree)


def prepare(
  components: Components, ci_params: Any, taps: dict, ci_fn: CIFn,
  compute_dtype: Optional[str], constrain: Constrain = no_constraint,
) -> tuple:
  """Return `(components, ci)`, plus the compute-dtype V/U when
  `compute_dtype` is set, as `with_prepared` reads them: the output role's.

  With a compute dtype (N4) V/U are cast once, before the gather to the
  compute layout, and so are the CI parameters and taps before the CI call;
  the fp32 masters stay for faithfulness (N2) and the CI is squashed in
  fp32 (N3).
  """
  components, compute, pre = _run_ci(components, ci_params, taps,
                                     ci_fn.apply, compute_dtype, constrain)
  return _packed(components, _squash(pre, constrain), compute)


def prepare_roles(
  components: Components, ci_params: Any, taps: dict, ci_fn: CIFn,
  compute_dtype: Optional[str], constrain: Constrain = no_constraint,
) -> tuple[tuple, ...]:
  """Return `prepare`'s tuple for every role of `ci_fn`, in its order, the
  CI trunk run once."""
  components, compute, by_role = _run_ci(
    components, ci_params, taps,
    lambda *args: role_pre(ci_fn, *args), compute_dtype, constrain)
  return tuple(_packed(components, _squash(by_role[r], constrain), compute)
               for r in ci_fn.roles)


def _run_ci(components, ci_params, taps, apply, compute_dtype, constrain):
  """Return `(components, compute-dtype V/U or None, apply(...))`."""
  if compute_dtype is None:
    components = constrain("compute", components)
    return components, None, apply(ci_params, taps, components)
  compute = constrain("compute", cast_floats(components, compute_dtype))
  return components, compute, apply(cast_floats(ci_params, compute_dtype),
                                    cast_floats(taps, compute_dtype), compute)


def _packed(components, ci, compute) -> tuple:
  return (components, ci) if compute is None else (components, ci, compute)


def _squash(pre: dict, constrain: Constrain) -> squash.CIOutput:
  return squash.squash(constrain("ci_activations",
                                 cast_floats(pre, jnp.float32)))


def objective(
  prepared: tuple,
  term_inputs: tuple,
  ctxs: tuple[StepContext, ...],
  terms: tuple[LossTerm, ...],
  keys: list,
  term_passes: tuple[int, ...],
) -> tuple[Float[Array, ""], tuple[dict[str, Array], Float[Array, ""], tuple]]:
  """Return the differentiated sum, the raw term values, the coefficiented
  total and each term's aux. `prepared[i]` is pass `i`'s, as
  `with_prepared` reads it into `ctxs[i]`; term `j` scores pass
  `term_passes[j]`."""
  differentiated = jnp.zeros((), jnp.float32)
  reported = jnp.zeros((), jnp.float32)
  values, auxes = {}, []
  for term, key, inputs, i in zip(terms, keys, term_inputs, term_passes):
    ctx, own = ctxs[i], prepared[i]
    coeff = schedules.schedule_value(term.coeff, ctx.step, ctx.total_steps)
    if term.coeff_on_model_side:
      term_ctx = with_prepared(
        ctx, tuple(scale_cotangent(p, coeff) for p in own))
      value, aux = term.fn(term_ctx, key, inputs)
      differentiated = differentiated + value
    else:
      value, aux = term.fn(with_prepared(ctx, own), key, inputs)
      differentiated = differentiated + coeff * value
    reported = reported + coeff * value
    values[term.name] = value
    auxes.append(aux)
  return differentiated, (values, reported, tuple(auxes))


def reported_total(terms: tuple[LossTerm, ...], values: dict[str, Array],
                   step: Int[Array, ""], total_steps: int) -> Float[Array, ""]:
  """Return `Σ coeff·value` in the terms' order (as `objective` sums it)."""
  total = jnp.zeros((), jnp.float32)
  for term in terms:
    total = total + schedules.schedule_value(
      term.coeff, step, total_steps) * values[term.name]
  return total


def sequential_objective_grads(
  prepared: tuple, term_inputs: tuple, ctxs: tuple[StepContext, ...],
  terms: tuple[LossTerm, ...], keys: list, term_passes: tuple[int, ...],
) -> tuple[dict[str, Array], tuple, tuple, tuple]:
  """Return `(values, auxes, g_prepared, g_inputs)` as one backward of
  `objective` would, scoring one pass at a time.

  Each pass's inputs go through an optimization barrier together with the
  previous pass's gradients, so XLA cannot start a pass's masked forwards
  before the previous pass's backward is done.
  """
  g_prepared = [jax.tree.map(jnp.zeros_like, own) for own in prepared]
  g_inputs, auxes, values = [None] * len(terms), [None] * len(terms), {}
  done = None
  for p in sorted(set(term_passes)):
    picked = [j for j, q in enumerate(term_passes) if q == p]
    own, inputs = prepared[p], tuple(term_inputs[j] for j in picked)
    if done is not None:
      done, own, inputs = jax.lax.optimization_barrier((done, own, inputs))

    def one_pass(own, inputs, p=p, picked=picked):
      return objective((own,), inputs, (ctxs[p],),
                       tuple(terms[j] for j in picked),
                       [keys[j] for j in picked], (0,) * len(picked))

    (_, (pass_values, _, pass_auxes)), (g_own, g_in) = jax.value_and_grad(
      one_pass, argnums=(0, 1), has_aux=True, allow_int=True)(own, inputs)
    g_prepared[p] = g_own
    values.update(pass_values)
    for j, aux, g in zip(picked, pass_auxes, g_in):
      auxes[j], g_inputs[j] = aux, g
    done = g_own
  return values, tuple(auxes), tuple(g_prepared), tuple(g_inputs)


def clean_tap_keys(
  ci_fn: CIFn, target: TargetFns, terms: tuple[LossTerm, ...]
) -> tuple[str, ...]:
  """Return, in first-seen order, every tap the step's clean forward keeps."""
  keys = [*ci_fn.input_taps, *target.start_taps]
  for term in terms:
    keys.extend(term.clean_taps)
  return tuple(dict.fromkeys(keys))


def stream_specs(config: StepConfig) -> tuple[StreamSpec, ...]:
  """Return the step's streams: the configured ones, or the one unnamed."""
  return config.streams or (StreamSpec(""),)


def check_streams(config: StepConfig) -> None:
  """Raise ValueError unless a multi-stream step's streams have distinct,
  non-empty names."""
  names = [s.name for s in config.streams]
  if any(not n for n in names) or len(set(names)) != len(names):
    raise ValueError(f"a multi-stream step needs distinct non-empty stream "
                     f"names, got {names}")


def term_streams(terms: tuple[LossTerm, ...],
                 config: StepConfig) -> tuple[int, ...]:
  """Return the index of the stream each term scores; raise ValueError for a
  term naming a stream the step does not have."""
  names = [s.name for s in config.streams] or [""]
  out = []
  for term in terms:
    if term.stream not in names:
      raise ValueError(f"loss term {term.name} scores stream "
                       f"{term.stream!r}, but the step's streams are "
                       f"{names}")
    out.append(names.index(term.stream))
  return tuple(out)


def role_index(term: LossTerm, roles: tuple[str, ...],
               hidden_points: tuple[str, ...]) -> int:
  """Return the index in `roles` of the CI role `term` reads; raise
  ValueError for a role the CI function does not read out, or a hidden
  role without hidden points to reconstruct."""
  if term.role not in roles:
    raise ValueError(f"loss term {term.name} reads the {term.role!r} CI "
                     f"role, but the CI function's roles are {roles}")
  if term.role != OUTPUT and not hidden_points:
    raise ValueError(f"loss term {term.name} runs in a hidden pass, and "
                     "the step names no hidden points to reconstruct")
  return roles.index(term.role)


def term_passes(terms: tuple[LossTerm, ...], config: StepConfig,
                roles: tuple[str, ...]) -> tuple[int, ...]:
  """Return the pass each term scores: `stream · len(roles) + role`, its
  stream's index and its role's (`role_index`)."""
  return tuple(
    k * len(roles) + role_index(term, roles, config.hidden_points)
    for term, k in zip(terms, term_streams(terms, config)))


def by_stream(config: StepConfig, value: Any) -> dict[str, Any]:
  """Return a per-stream value keyed by stream name: a multi-stream step's
  dict as it is, a one-stream step's value under the name ""."""
  return value if config.streams else {"": value}


def make_init(
  terms: tuple[LossTerm, ...], config: StepConfig
) -> Callable[..., TrainState]:
  """Return `init(components, ci_params, run_key, lead_shape=())`, the
  builder of the step's initial state (see `make_train_step`).

  Apart from the step, so that a run can take the state's shapes
  (`jax.eval_shape`), and from them its shardings, before it builds the
  step those shardings place. A multi-stream step's `lead_shape` is a dict
  by stream name; each term's state takes its stream's.
  """
  # Optimizer states depend on no placement: `constrain` acts in updates.
  components_tx = optim.make_optimizer(config.components_opt,
                                       config.total_steps)
  ci_tx = optim.adamw(config.ci_opt, config.total_steps)
  term_streams(terms, config)

  def init(components, ci_params, run_key, lead_shape=()):
    state_key = jax.random.fold_in(run_key, TERM_STATE_STREAM)
    leads = by_stream(config, lead_shape)
    term_states = {
      t.name: t.init_state(jax.random.fold_in(state_key, j),
                           tuple(leads[t.stream]))
      for j, t in enumerate(terms) if t.init_state is not None
    }
    return TrainState(
      components=components,
      ci_params=ci_params,
      components_opt=components_tx.init(components),
      ci_opt=ci_tx.init(ci_params),
      term_states=term_states,
      step=jnp.zeros((), jnp.int32),
      rng=run_key,
      health=health_lib.healthy(),
    )

  return init


def max_ci_per_component(
  sites: tuple, ci_lowers: list[dict[str, Array]],
) -> dict[str, Float[Array, "layer c"]]:
  """Return per kind the largest lower CI each component reached on any
  position of any of the batches, stacked by the sites' rows."""
  rows: dict[str, dict[int, Array]] = {}
  for site in sites:
    peak = jnp.max(jnp.stack([
      jnp.max(ci[site.name].reshape(-1, site.c), axis=0)
      for ci in ci_lowers]), axis=0)
    rows.setdefault(site.kind, {})[site.row] = peak
  return {kind: jnp.stack([r[i] for i in range(len(r))])
          for kind, r in rows.items()}


def ci_scaled_decay(
  components: Components, max_ci: dict[str, Float[Array, "layer c"]],
  lr: float | Float[Array, ""], decay: float,
) -> Components:
  """Return the components with each `V[:, c]` and `U[c, :]` scaled by
  `1 − lr·decay·(1 − max_ci[c])` (SPEC §6.6): a component the batches
  never use decays fastest, one at CI 1 somewhere not at all."""
  out = {}
  for kind, factors in components.items():
    scale = 1.0 - lr * decay * (1.0 - max_ci[kind])
    # Pad slots hold zeros, which any scale keeps.
    n, c = factors.v.shape[0], factors.v.shape[2]
    scale = jnp.pad(scale, ((0, n - scale.shape[0]), (0, c - scale.shape[1])),
                    constant_values=1.0)
    out[kind] = factors._replace(
      v=factors.v * scale[:, None, :].astype(factors.v.dtype),
      u=factors.u * scale[:, :, None].astype(factors.u.dtype))
  return out


def check_term_names(terms: tuple[LossTerm, ...]) -> None:
  """Raise ValueError unless term names are unique: a term's state (an
  adversary's source bundle) is keyed by its name, so a name given to two
  streams or roles would share one bundle between them (I22, I45)."""
  seen: dict[str, LossTerm] = {}
  for term in terms:
    first = seen.setdefault(term.name, term)
    if first is term:
      continue
    if (first.stream, first.role) != (term.stream, term.role):
      raise ValueError(
        f"loss term {term.name} is given to stream/role "
        f"{first.stream or '-'}/{first.role} and "
        f"{term.stream or '-'}/{term.role}; its state (a source bundle) "
        "would be shared between them: build one term per stream and role, "
        "each with its own name")
    raise ValueError(f"loss term names must be unique, got "
                     f"{[t.name for t in terms]}")


def check_step(terms: tuple[LossTerm, ...], config: StepConfig) -> None:
  """Raise ValueError for settings no step can run: an unknown non-finite
  policy, clashing term names, a finish without a state, a negative decay,
  or streams without distinct names."""
  if config.on_nonfinite not in ("stop", "skip"):
    raise ValueError(f"on_nonfinite must be stop or skip, got "
                     f"{config.on_nonfinite!r}")
  check_term_names(terms)
  for term in terms:
    if term.finish is not None and term.init_state is None:
      raise ValueError(f"loss term {term.name} has a finish but no "
                       "init_state; finish returns the term's state")
  if config.ci_scaled_decay < 0:
    raise ValueError(f"the CI-scaled decay must be >= 0, got "
                     f"{config.ci_scaled_decay}")
  check_streams(config)


class StepPlan(NamedTuple):
  """What a step derives once from its settings, before any array: the
  static half of every phase below.

  `passes[j]` is the pass term `j` scores (`term_passes`); `clean_taps[k]`
  the taps stream `k`'s clean forward keeps; the two optimizers update the
  components and the CI parameters.
  """

  target: TargetFns
  ci_fn: CIFn
  terms: tuple[LossTerm, ...]
  config: StepConfig
  streams: tuple[StreamSpec, ...]
  passes: tuple[int, ...]
  clean_taps: tuple[tuple[str, ...], ...]
  components_tx: optax.GradientTransformation
  ci_tx: optax.GradientTransformation
  constrain: Constrain = no_constraint

  @property
  def roles(self) -> tuple[str, ...]:
    return self.ci_fn.roles


def stream_clean_taps(
  target: TargetFns, ci_fn: CIFn, terms: tuple[LossTerm, ...],
  config: StepConfig,
) -> tuple[tuple[str, ...], ...]:
  """Return per stream the taps its clean forward keeps: its terms' and the
  CI's, and the hidden points where one of its terms runs a hidden pass."""
  owners = term_streams(terms, config)
  wanted = []
  for k in range(len(stream_specs(config))):
    own_terms = tuple(t for t, i in zip(terms, owners) if i == k)
    hidden = any(t.role != OUTPUT for t in own_terms)
    wanted.append(tuple(dict.fromkeys((
      *clean_tap_keys(ci_fn, target, own_terms),
      *(config.hidden_points if hidden else ())))))
  return tuple(wanted)


def step_plan(
  target: TargetFns, ci_fn: CIFn, terms: tuple[LossTerm, ...],
  config: StepConfig, constrain: Constrain = no_constraint,
) -> StepPlan:
  """Return the step's `StepPlan`; ValueError for a term naming a stream or
  CI role the step does not have."""
  return StepPlan(
    target, ci_fn, terms, config, stream_specs(config),
    term_passes(terms, config, ci_fn.roles),
    stream_clean_taps(target, ci_fn, terms, config),
    optim.make_optimizer(config.components_opt, config.total_steps,
                         constrain, slots.real_matrix_dims(target.sites)),
    optim.adamw(config.ci_opt, config.total_steps), constrain)


Clean = tuple[Float[Array, "..."], dict]


def clean_passes(plan: StepPlan, weights: Weights,
                 batches: dict[str, Batch]) -> tuple[Clean, ...]:
  """Return per stream its stop-gradient clean `(output, taps)`; with a
  split head (`TargetFns.split_head`) the output is the head's input."""
  split = plan.target.split_head
  forward = plan.target.clean_forward if split is None else split.clean_forward
  return tuple(plan.constrain("activations", jax.tree.map(
    jax.lax.stop_gradient,
    forward(weights, batches[spec.name], plan.clean_taps[k])))
    for k, spec in enumerate(plan.streams))


def prepare_passes(plan: StepPlan, cleans: tuple[Clean, ...],
                   theta: tuple[Components, Any]) -> tuple:
  """Return `prepare`'s tuple for every pass from `theta = (components,
  CI parameters)`: pass `k · len(roles) + r` is stream k's CI role r."""
  # Pad slots (the owner preset's) end here: nothing computes on them.
  real = slots.real_components(theta[0], plan.target.sites)
  return tuple(own for _, taps in cleans for own in prepare_roles(
    real, theta[1], taps, plan.ci_fn, plan.config.compute_dtype,
    plan.constrain))


def pass_contexts(
  plan: StepPlan, step: Int[Array, ""], weights: Weights,
  batches: dict[str, Batch], cleans: tuple[Clean, ...], frozen: tuple,
) -> tuple[StepContext, ...]:
  """Return one context per pass, reading its stop-gradient `frozen`
  components and CI; a hidden role's reconstructs the hidden points."""
  config, roles, ctxs = plan.config, plan.roles, []
  for k, (spec, (clean_output, taps)) in enumerate(zip(plan.streams, cleans)):
    for r, role in enumerate(roles):
      own = frozen[k * len(roles) + r]
      ctxs.append(with_prepared(StepContext(
        step, config.total_steps, plan.target, weights,
        batches[spec.name], clean_output, *own[:2], clean_taps=taps,
        constrain=plan.constrain, delta_pin=spec.delta_pin,
        loss_positions=spec.loss_positions,
        hidden_points=() if role == OUTPUT else config.hidden_points,
        split_head=plan.target.split_head is not None),
        own))
  return tuple(ctxs)


def prepare_terms(
  terms: tuple[LossTerm, ...], ctxs: tuple[StepContext, ...], keys: list,
  passes: tuple[int, ...], term_states: dict[str, Any],
) -> tuple[dict[str, Any], tuple]:
  """Return the term states after every `prepare` and each term's inputs
  (None for a term without one), term `j` prepared on `ctxs[passes[j]]`."""
  term_states, term_inputs = dict(term_states), []
  for term, key, i in zip(terms, keys, passes):
    if term.prepare is None:
      term_inputs.append(None)
      continue
    new_state, inputs_j = term.prepare(ctxs[i], key,
                                       term_states.get(term.name))
    if term.name in term_states:
      term_states[term.name] = new_state
    term_inputs.append(inputs_j)
  return term_states, tuple(term_inputs)


def objective_grads(
  plan: StepPlan, prepared: tuple, term_inputs: tuple,
  ctxs: tuple[StepContext, ...], keys: list,
) -> tuple[dict[str, Array], tuple, tuple, tuple]:
  """Return `(values, auxes, g_prepared, g_inputs)`: the objective's one
  backward, or the passes' in turn (`StepConfig.sequential_passes`)."""
  args = (prepared, term_inputs, ctxs, plan.terms, keys, plan.passes)
  if plan.config.sequential_passes:
    return sequential_objective_grads(*args)
  grad_fn = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True,
                               allow_int=True)
  (_, (values, _, auxes)), (g_prepared, g_inputs) = grad_fn(*args)
  return values, auxes, g_prepared, g_inputs


def finish_terms(
  terms: tuple[LossTerm, ...], ctxs: tuple[StepContext, ...], keys: list,
  passes: tuple[int, ...], term_states: dict[str, Any], term_inputs: tuple,
  g_inputs: tuple, auxes: tuple,
) -> dict[str, Any]:
  """Return the term states after every `finish`, each handed its
  prepared state, inputs, their gradient and its aux."""
  finished = dict(term_states)
  for term, key, inputs_j, g_j, aux, i in zip(
      terms, keys, term_inputs, g_inputs, auxes, passes):
    if term.finish is not None:
      finished[term.name] = term.finish(
        ctxs[i], key, term_states[term.name], inputs_j, g_j, aux)
  return finished


class Updated(NamedTuple):
  """The parameters and optimizer states after one update, and its LR."""

  components: Components
  ci_params: Any
  components_opt: optax.OptState
  ci_opt: optax.OptState
  lr: Float[Array, ""]


def apply_updates(
  plan: StepPlan, state: TrainState, g_components: Components, g_ci: Any,
  frozen: tuple,
) -> Updated:
  """Return the components and CI parameters after their optimizers'
  update (and the CI-scaled decay, reading every pass's CI in `frozen`)."""
  config = plan.config
  updates, components_opt = plan.components_tx.update(
    g_components, state.components_opt, state.components)
  components = optax.apply_updates(state.components, updates)
  lr = schedules.schedule_value(
    config.components_opt.lr, state.step, config.total_steps)
  if config.ci_scaled_decay:
    components = ci_scaled_decay(
      components,
      max_ci_per_component(plan.target.sites, [own[1].lower for own in frozen]),
      lr, config.ci_scaled_decay)
  ci_updates, ci_opt = plan.ci_tx.update(g_ci, state.ci_opt, state.ci_params)
  ci_params = optax.apply_updates(state.ci_params, ci_updates)
  return Updated(components, ci_params, components_opt, ci_opt, lr)


def step_metrics(
  plan: StepPlan, total: Float[Array, ""], values: dict[str, Array],
  auxes: tuple, frozen: tuple, g_components: Components,
  lr: Float[Array, ""],
) -> dict[str, Array]:
  """Return the step's metrics: the total and every term's value and
  report, each pass's CI-L0 per site, the gradient norm and the LR."""
  terms, roles = plan.terms, plan.roles
  metrics = {"loss/total": total}
  metrics.update({t.metric(): values[t.name] for t in terms})
  for term, aux in zip(terms, auxes):
    if term.report is not None:
      metrics.update({term.metric(k): v
                      for k, v in term.report(aux).items()})
  for p, own in enumerate(frozen):
    spec, role = plan.streams[p // len(roles)], roles[p % len(roles)]
    prefix = f"{spec.name}/" if spec.name else ""
    for site, l0 in ci_l0(own[1].lower,
                          plan.config.ci_alive_threshold).items():
      metrics[f"{prefix}ci_l0{role_suffix(role)}/{site}"] = l0
  metrics["grad_norm/components"] = optax.tree.norm(g_components)
  metrics["lr/components"] = lr
  return metrics


def next_state(
  plan: StepPlan, state: TrainState, values: dict[str, Array],
  updated: tuple, term_states: dict[str, Any],
) -> TrainState:
  """Return the state after the step: `updated` (components, CI
  parameters, their optimizer states) and `term_states` with the health
  record, or under `on_nonfinite="skip"` the old ones when a value or an
  update is not finite (only the counter moves on)."""
  updated = (*updated, term_states)
  finite, health = health_lib.record(
    state.health, (*(values[t.name] for t in plan.terms), *updated),
    state.step + 1)
  if plan.config.on_nonfinite == "skip":
    updated = health_lib.keep_if(finite, updated, (
      state.components, state.ci_params, state.components_opt,
      state.ci_opt, state.term_states))
  return TrainState(*updated, state.step + 1, state.rng, health)


def run_step(plan: StepPlan, state: TrainState, weights: Weights,
             inputs: Batch) -> tuple[TrainState, dict[str, Array]]:
  """Return the state and metrics after one step (the module docstring's
  order), its phases composed: unjitted, as `make_train_step` jits it."""
  step_key = jax.random.fold_in(state.rng, state.step)
  batches = by_stream(plan.config, inputs)
  cleans = clean_passes(plan, weights, batches)
  prepared, prep_vjp = jax.vjp(
    functools.partial(prepare_passes, plan, cleans),
    (state.components, state.ci_params))
  frozen = jax.lax.stop_gradient(prepared)
  ctxs = pass_contexts(plan, state.step, weights, batches, cleans, frozen)
  keys = _term_keys(step_key, len(plan.terms))
  term_states, term_inputs = prepare_terms(
    plan.terms, ctxs, keys, plan.passes, state.term_states)
  values, auxes, g_prepared, g_inputs = objective_grads(
    plan, prepared, term_inputs, ctxs, keys)
  total = reported_total(plan.terms, values, state.step,
                         plan.config.total_steps)
  ((g_components, g_ci),) = prep_vjp(g_prepared)
  finished = finish_terms(plan.terms, ctxs, keys, plan.passes, term_states,
                          term_inputs, g_inputs, auxes)
  updated = apply_updates(plan, state, g_components, g_ci, frozen)
  metrics = step_metrics(plan, total, values, auxes, frozen, g_components,
                         updated.lr)
  new_state = next_state(plan, state, values, updated[:4], finished)
  metrics["nonfinite/steps"] = new_state.health.nonfinite_steps
  return new_state, metrics


def make_train_step(
  target: TargetFns,
  ci_fn: CIFn,
  terms: tuple[LossTerm, ...],
  config: StepConfig,
  sample_inputs: Optional[Callable[[Key[Array, ""]], Batch]] = None,
  shardings: Optional[StepShardings] = None,
  constrain: Constrain = no_constraint,
  max_traces: Optional[int] = None,
) -> TrainStep:
  """Return the initial-state builder and the ONE jitted training step.

  `init(components, ci_params, run_key, lead_shape)` builds the state, its
  `term_states` in the terms' order (a jitted or restored state has them
  sorted by name, as every dict pytree). Step `s` draws from
  `fold_in(run_key, s)`; the state of term `j` (its position in `terms`)
  draws from `fold_in(fold_in(run_key, TERM_STATE_STREAM), j)`, a number no
  int32 step counter reaches, so no step ever replays the initial draws. With
  `sample_inputs`, the step draws its own batch from `fold_in(data_key,
  step)` (a pure function of seed and step) and takes `(state, weights,
  data_key)`; otherwise it takes `(state, weights, inputs)`. A
  multi-stream step (`config.streams`) takes, and samples, a dict of
  batches by stream name. `shardings`
  and `constrain` (from `decompax.placement`) place the step on a mesh;
  without them it runs where its arguments live. With `max_traces` the
  step raises AssertionError when traced more often
  (`chex.assert_max_traces`): how the tests hold a run to one compile.
  """
  check_step(terms, config)
  plan = step_plan(target, ci_fn, terms, config, constrain)
  init = make_init(terms, config)
  if sample_inputs is None:

    def train_step(state, weights, inputs):
      return run_step(plan, state, weights, inputs)
  else:

    def train_step(state, weights, data_key):
      return sampled_step(plan, sample_inputs, state, weights, data_key)

  steps = None
  if sample_inputs is not None:
    single = train_step

    def steps(state, weights, data_key, n):
      return repeated_steps(single, state, weights, data_key, n)

  if max_traces is not None:
    train_step = chex.assert_max_traces(train_step, max_traces)
    steps = steps and chex.assert_max_traces(steps, max_traces)
  placed, placed_steps = {}, {}
  if shardings is not None:
    placed = dict(
      in_shardings=(shardings.state, shardings.weights, shardings.inputs),
      out_shardings=(shardings.state, shardings.metrics))
    placed_steps = dict(placed, in_shardings=(*placed["in_shardings"], None))
  return TrainStep(
    init=init, step=jax.jit(train_step, donate_argnums=0, **placed),
    steps=steps and jax.jit(steps, donate_argnums=0, **placed_steps))


def repeated_steps(
  step: Callable[..., tuple[TrainState, dict[str, Array]]],
  state: TrainState, weights: Weights, data_key: Key[Array, ""],
  n: Int[Array, ""],
) -> tuple[TrainState, dict[str, Array]]:
  """Return the state after `n >= 1` steps and the last step's metrics.

  The steps run as one `while` loop of the very step `step` (a count known
  only at run time, so a call of any length is one program), each drawing
  its batch and keys from its own counter: the result is bitwise that of
  `n` calls of the jitted step. The frozen weights stay a runtime argument,
  read by every step.
  """
  # Jitted, the step is traced once for both its shapes and the loop body.
  step = jax.jit(step)
  metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
    step, state, weights, data_key)[1])

  def body(_, carry):
    return step(carry[0], weights, data_key)

  return jax.lax.fori_loop(0, n, body, (state, metrics))


def sampled_step(
  plan: StepPlan, sample_inputs: Callable[[Key[Array, ""]], Batch],
  state: TrainState, weights: Weights, data_key: Key[Array, ""],
) -> tuple[TrainState, dict[str, Array]]:
  """Return `run_step` on the batch drawn from `fold_in(data_key, step)`."""
  # Pinned to the batch layout, a counter-based sampler draws only each
  # device's slice.
  inputs = plan.constrain("inputs", sample_inputs(
    jax.random.fold_in(data_key, state.step)))
  return run_step(plan, state, weights, inputs)
