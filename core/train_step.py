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
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from decompax.core import health as health_lib, optim, schedules, squash
from decompax.core.ci_fns import CIFn
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

  def operands(self) -> Components:
    """Return V/U as a masked forward consumes them."""
    components = (self.components if self.compute_components is None
                  else self.compute_components)
    return self.constrain("operands", components)

  def masked_forward(self, site_masks) -> Float[Array, "..."]:
    """Run the target with `site_masks` on the step's inputs and components."""
    if self.target.masked_forward_taps is not None:
      return self.masked_forward_with_taps(site_masks, ())[0]
    return self.target.masked_forward(
      self.weights, self.operands(), self.inputs, site_masks
    )

  def masked_forward_with_taps(
    self, site_masks, wanted: tuple[str, ...]
  ) -> tuple[Float[Array, "..."], dict[str, Float[Array, "..."]]]:
    """Run the masked forward and return the `wanted` activations too."""
    if self.target.masked_forward_taps is None:
      raise ValueError("this target's masked forward returns no activations; "
                       "drop the hidden-activation terms")
    return self.target.masked_forward_taps(
      self.weights, self.operands(), self.inputs,
      site_masks, self.clean_taps or {}, wanted)

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
  forward (`ctx.clean_taps`).
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


class TrainStep(NamedTuple):
  """The jitted step and the function that builds its initial state."""

  init: Callable[..., TrainState]
  step: Callable[..., tuple[TrainState, dict[str, Array]]]


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
  `compute_dtype` is set, as `with_prepared` reads them.

  With a compute dtype (N4) V/U are cast once, before the gather to the
  compute layout, and so are the CI parameters and taps before the CI call;
  the fp32 masters stay for faithfulness (N2) and the CI is squashed in
  fp32 (N3).
  """
  if compute_dtype is None:
    components = constrain("compute", components)
    return components, squash.squash(constrain(
      "ci_activations", ci_fn.apply(ci_params, taps, components)))
  compute = constrain("compute", cast_floats(components, compute_dtype))
  pre = ci_fn.apply(cast_floats(ci_params, compute_dtype),
                    cast_floats(taps, compute_dtype), compute)
  ci = squash.squash(constrain(
    "ci_activations", cast_floats(pre, jnp.float32)))
  return components, ci, compute


def objective(
  prepared: tuple,
  term_inputs: tuple,
  ctx: StepContext,
  terms: tuple[LossTerm, ...],
  keys: list,
) -> tuple[Float[Array, ""], tuple[dict[str, Array], Float[Array, ""], tuple]]:
  """Return the differentiated sum, the raw term values, the coefficiented
  total and each term's aux; `prepared` as `with_prepared` reads it."""
  differentiated = jnp.zeros((), jnp.float32)
  reported = jnp.zeros((), jnp.float32)
  values, auxes = {}, []
  for term, key, inputs in zip(terms, keys, term_inputs):
    coeff = schedules.schedule_value(term.coeff, ctx.step, ctx.total_steps)
    if term.coeff_on_model_side:
      term_ctx = with_prepared(
        ctx, tuple(scale_cotangent(p, coeff) for p in prepared))
      value, aux = term.fn(term_ctx, key, inputs)
      differentiated = differentiated + value
    else:
      value, aux = term.fn(with_prepared(ctx, prepared), key, inputs)
      differentiated = differentiated + coeff * value
    reported = reported + coeff * value
    values[term.name] = value
    auxes.append(aux)
  return differentiated, (values, reported, tuple(auxes))


def clean_tap_keys(
  ci_fn: CIFn, target: TargetFns, terms: tuple[LossTerm, ...]
) -> tuple[str, ...]:
  """Return, in first-seen order, every tap the step's clean forward keeps."""
  keys = [*ci_fn.input_taps, *target.start_taps]
  for term in terms:
    keys.extend(term.clean_taps)
  return tuple(dict.fromkeys(keys))


def make_init(
  terms: tuple[LossTerm, ...], config: StepConfig
) -> Callable[..., TrainState]:
  """Return `init(components, ci_params, run_key, lead_shape=())`, the
  builder of the step's initial state (see `make_train_step`).

  Apart from the step, so that a run can take the state's shapes
  (`jax.eval_shape`), and from them its shardings, before it builds the
  step those shardings place.
  """
  # Optimizer states depend on no placement: `constrain` acts in updates.
  components_tx = optim.make_optimizer(config.components_opt,
                                       config.total_steps)
  ci_tx = optim.adamw(config.ci_opt, config.total_steps)

  def init(components, ci_params, run_key, lead_shape=()):
    state_key = jax.random.fold_in(run_key, TERM_STATE_STREAM)
    term_states = {
      t.name: t.init_state(jax.random.fold_in(state_key, j), tuple(lead_shape))
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


def make_train_step(
  target: TargetFns,
  ci_fn: CIFn,
  terms: tuple[LossTerm, ...],
  config: StepConfig,
  sample_inputs: Optional[Callable[[Key[Array, ""]], Batch]] = None,
  shardings: Optional[StepShardings] = None,
  constrain: Constrain = no_constraint,
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
  data_key)`; otherwise it takes `(state, weights, inputs)`. `shardings`
  and `constrain` (from `decompax.placement`) place the step on a mesh;
  without them it runs where its arguments live.
  """
  names = [t.name for t in terms]
  if config.on_nonfinite not in ("stop", "skip"):
    raise ValueError(f"on_nonfinite must be stop or skip, got "
                     f"{config.on_nonfinite!r}")
  if len(set(names)) != len(names):
    raise ValueError(f"loss term names must be unique, got {names}")
  for term in terms:
    if term.finish is not None and term.init_state is None:
      raise ValueError(f"loss term {term.name} has a finish but no "
                       "init_state; finish returns the term's state")
  wanted_taps = clean_tap_keys(ci_fn, target, terms)
  components_tx = optim.make_optimizer(config.components_opt,
                                       config.total_steps, constrain)
  ci_tx = optim.adamw(config.ci_opt, config.total_steps)

  init = make_init(terms, config)

  def train_step(state: TrainState, weights: Weights, inputs: Batch):
    step_key = jax.random.fold_in(state.rng, state.step)
    clean_output, taps = constrain("activations", jax.tree.map(
      jax.lax.stop_gradient,
      target.clean_forward(weights, inputs, wanted_taps),
    ))

    def prep(theta):
      return prepare(theta[0], theta[1], taps, ci_fn, config.compute_dtype,
                     constrain)

    prepared, prep_vjp = jax.vjp(
      prep, (state.components, state.ci_params))
    frozen = jax.lax.stop_gradient(prepared)
    ctx = with_prepared(
      StepContext(state.step, config.total_steps, target, weights, inputs,
                  clean_output, *frozen[:2], clean_taps=taps,
                  constrain=constrain), frozen)
    keys = _term_keys(step_key, len(terms))
    term_states, term_inputs = dict(state.term_states), []
    for term, key in zip(terms, keys):
      if term.prepare is None:
        term_inputs.append(None)
        continue
      new_state, inputs_j = term.prepare(ctx, key, term_states.get(term.name))
      if term.name in term_states:
        term_states[term.name] = new_state
      term_inputs.append(inputs_j)
    grad_fn = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True,
                                 allow_int=True)
    (_, (values, total, auxes)), (g_prepared, g_inputs) = grad_fn(
      prepared, tuple(term_inputs), ctx, terms, keys)
    ((g_components, g_ci),) = prep_vjp(g_prepared)
    finished = dict(term_states)
    for term, key, inputs_j, g_j, aux in zip(
        terms, keys, term_inputs, g_inputs, auxes):
      if term.finish is not None:
        finished[term.name] = term.finish(
          ctx, key, term_states[term.name], inputs_j, g_j, aux)
    updates, components_opt = components_tx.update(
      g_components, state.components_opt, state.components)
    components = optax.apply_updates(state.components, updates)
    ci_updates, ci_opt = ci_tx.update(g_ci, state.ci_opt, state.ci_params)
    ci_params = optax.apply_updates(state.ci_params, ci_updates)
    metrics = {"loss/total": total}
    metrics.update({f"loss/{k}": v for k, v in values.items()})
    for term, aux in zip(terms, auxes):
      if term.report is not None:
        metrics.update({f"loss/{k}": v for k, v in term.report(aux).items()})
    for site, l0 in ci_l0(prepared[1].lower, config.ci_alive_threshold).items():
      metrics[f"ci_l0/{site}"] = l0
    metrics["grad_norm/components"] = optax.tree.norm(g_components)
    metrics["lr/components"] = schedules.schedule_value(
      config.components_opt.lr, state.step, config.total_steps)
    updated = (components, ci_params, components_opt, ci_opt, finished)
    finite, health = health_lib.record(
      state.health, (*(values[n] for n in names), *updated), state.step + 1)
    if config.on_nonfinite == "skip":
      updated = health_lib.keep_if(finite, updated, (
        state.components, state.ci_params, state.components_opt,
        state.ci_opt, state.term_states))
    metrics["nonfinite/steps"] = health.nonfinite_steps
    new_state = TrainState(*updated, state.step + 1, state.rng, health)
    return new_state, metrics

  placed = {}
  if shardings is not None:
    placed = dict(
      in_shardings=(shardings.state, shardings.weights, shardings.inputs),
      out_shardings=(shardings.state, shardings.metrics))
  if sample_inputs is None:
    step = jax.jit(train_step, donate_argnums=0, **placed)
  else:

    def sampled_step(state, weights, data_key):
      # Pinned to the batch layout, a counter-based sampler draws only each
      # device's slice.
      inputs = constrain("inputs", sample_inputs(
        jax.random.fold_in(data_key, state.step)))
      return train_step(state, weights, inputs)

    step = jax.jit(sampled_step, donate_argnums=0, **placed)
  return TrainStep(init=init, step=step)
