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
so each can be run and tested alone. The records these phases pass are
`step_records`', the objective over the prepared values `step_objective`'s
and the streams, passes and checks `step_streams`'.

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

import functools
from collections.abc import Callable
from typing import Any, Optional

import chex
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from decompax.core import health as health_lib, optim, schedules, slots
from decompax.core.ci_fns import OUTPUT, CIFn, role_suffix
from decompax.core.sites import Components
from decompax.core.target import Batch, TargetFns, Weights
from decompax.core import step_objective, step_records, step_streams


def ci_l0(
  ci_lower: dict[str, Float[Array, "*l c"]], threshold: float
) -> dict[str, Float[Array, ""]]:
  """Return per site the position-mean count of components above threshold."""
  return {
    site: jnp.mean(jnp.sum(ci > threshold, axis=-1, dtype=jnp.float32))
    for site, ci in ci_lower.items()
  }


# The run key's fold-ins below 2**31 are step keys; term states take the top
# of the uint32 range, which a step counter (int32) never reaches.
TERM_STATE_STREAM = 2**32 - 1


def _term_keys(step_key, n):
  return [jax.random.fold_in(step_key, 1 + j) for j in range(n)]


def make_init(
  terms: tuple[step_records.LossTerm, ...], config: step_records.StepConfig
) -> Callable[..., step_records.TrainState]:
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
  step_streams.term_streams(terms, config)

  def init(components, ci_params, run_key, lead_shape=()):
    state_key = jax.random.fold_in(run_key, TERM_STATE_STREAM)
    leads = step_streams.by_stream(config, lead_shape)
    term_states = {
      t.name: t.init_state(jax.random.fold_in(state_key, j),
                           tuple(leads[t.stream]))
      for j, t in enumerate(terms) if t.init_state is not None
    }
    return step_records.TrainState(
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


def step_plan(
  target: TargetFns, ci_fn: CIFn, terms: tuple[step_records.LossTerm, ...],
  config: step_records.StepConfig,
  constrain: step_records.Constrain = step_records.no_constraint,
) -> step_records.StepPlan:
  """Return the step's `StepPlan`; ValueError for a term naming a stream or
  CI role the step does not have."""
  return step_records.StepPlan(
    target, ci_fn, terms, config, step_streams.stream_specs(config),
    step_streams.term_passes(terms, config, ci_fn.roles),
    step_streams.stream_clean_taps(target, ci_fn, terms, config),
    optim.make_optimizer(config.components_opt, config.total_steps,
                         constrain, slots.real_matrix_dims(target.sites)),
    optim.adamw(config.ci_opt, config.total_steps), constrain)


def clean_passes(plan: step_records.StepPlan, weights: Weights,
                 batches: dict[str, Batch]) -> tuple[step_records.Clean, ...]:
  """Return per stream its stop-gradient clean `(output, taps)`; with a
  split head (`TargetFns.split_head`) the output is the head's input."""
  split = plan.target.split_head
  forward = plan.target.clean_forward if split is None else split.clean_forward
  return tuple(plan.constrain("activations", jax.tree.map(
    jax.lax.stop_gradient,
    forward(weights, batches[spec.name], plan.clean_taps[k])))
    for k, spec in enumerate(plan.streams))


def prepare_passes(plan: step_records.StepPlan,
                   cleans: tuple[step_records.Clean, ...],
                   theta: tuple[Components, Any]) -> tuple:
  """Return `prepare`'s tuple for every pass from `theta = (components,
  CI parameters)`: pass `k · len(roles) + r` is stream k's CI role r."""
  # Pad slots (the owner preset's) end here: nothing computes on them.
  real = slots.real_components(theta[0], plan.target.sites)
  return tuple(own for _, taps in cleans
               for own in step_objective.prepare_roles(
    real, theta[1], taps, plan.ci_fn, plan.config.compute_dtype,
    plan.constrain))


def pass_contexts(
  plan: step_records.StepPlan, step: Int[Array, ""], weights: Weights,
  batches: dict[str, Batch], cleans: tuple[step_records.Clean, ...],
  frozen: tuple,
) -> tuple[step_records.StepContext, ...]:
  """Return one context per pass, reading its stop-gradient `frozen`
  components and CI; a hidden role's reconstructs the hidden points."""
  config, roles, ctxs = plan.config, plan.roles, []
  for k, (spec, (clean_output, taps)) in enumerate(zip(plan.streams, cleans)):
    for r, role in enumerate(roles):
      own = frozen[k * len(roles) + r]
      ctxs.append(step_objective.with_prepared(step_records.StepContext(
        step, config.total_steps, plan.target, weights,
        batches[spec.name], clean_output, *own[:2], clean_taps=taps,
        constrain=plan.constrain, delta_pin=spec.delta_pin,
        loss_positions=spec.loss_positions,
        hidden_points=() if role == OUTPUT else config.hidden_points,
        split_head=plan.target.split_head is not None),
        own))
  return tuple(ctxs)


def prepare_terms(
  terms: tuple[step_records.LossTerm, ...],
  ctxs: tuple[step_records.StepContext, ...], keys: list,
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
  plan: step_records.StepPlan, prepared: tuple, term_inputs: tuple,
  ctxs: tuple[step_records.StepContext, ...], keys: list,
) -> tuple[dict[str, Array], tuple, tuple, tuple]:
  """Return `(values, auxes, g_prepared, g_inputs)`: the objective's one
  backward, or the passes' in turn (`StepConfig.sequential_passes`)."""
  args = (prepared, term_inputs, ctxs, plan.terms, keys, plan.passes)
  if plan.config.sequential_passes:
    return step_objective.sequential_objective_grads(*args)
  grad_fn = jax.value_and_grad(step_objective.objective, argnums=(0, 1),
                               has_aux=True, allow_int=True)
  (_, (values, _, auxes)), (g_prepared, g_inputs) = grad_fn(*args)
  return values, auxes, g_prepared, g_inputs


def finish_terms(
  terms: tuple[step_records.LossTerm, ...],
  ctxs: tuple[step_records.StepContext, ...], keys: list,
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


def apply_updates(
  plan: step_records.StepPlan, state: step_records.TrainState,
  g_components: Components, g_ci: Any, frozen: tuple,
) -> step_records.Updated:
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
  return step_records.Updated(components, ci_params, components_opt, ci_opt, lr)


def step_metrics(
  plan: step_records.StepPlan, total: Float[Array, ""],
  values: dict[str, Array],
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
  plan: step_records.StepPlan, state: step_records.TrainState,
  values: dict[str, Array], updated: tuple, term_states: dict[str, Any],
) -> step_records.TrainState:
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
  return step_records.TrainState(*updated, state.step + 1, state.rng, health)


def run_step(plan: step_records.StepPlan, state: step_records.TrainState,
             weights: Weights,
             inputs: Batch) -> tuple[step_records.TrainState, dict[str, Array]]:
  """Return the state and metrics after one step (the module docstring's
  order), its phases composed: unjitted, as `make_train_step` jits it."""
  step_key = jax.random.fold_in(state.rng, state.step)
  batches = step_streams.by_stream(plan.config, inputs)
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
  total = step_objective.reported_total(plan.terms, values, state.step,
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
  terms: tuple[step_records.LossTerm, ...],
  config: step_records.StepConfig,
  sample_inputs: Optional[Callable[[Key[Array, ""]], Batch]] = None,
  shardings: Optional[step_records.StepShardings] = None,
  constrain: step_records.Constrain = step_records.no_constraint,
  max_traces: Optional[int] = None,
) -> step_records.TrainStep:
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
  step_streams.check_step(terms, config)
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
  return step_records.TrainStep(
    init=init, step=jax.jit(train_step, donate_argnums=0, **placed),
    steps=steps and jax.jit(steps, donate_argnums=0, **placed_steps))


def repeated_steps(
  step: Callable[..., tuple[step_records.TrainState, dict[str, Array]]],
  state: step_records.TrainState, weights: Weights, data_key: Key[Array, ""],
  n: Int[Array, ""],
) -> tuple[step_records.TrainState, dict[str, Array]]:
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
  plan: step_records.StepPlan, sample_inputs: Callable[[Key[Array, ""]], Batch],
  state: step_records.TrainState, weights: Weights, data_key: Key[Array, ""],
) -> tuple[step_records.TrainState, dict[str, Array]]:
  """Return `run_step` on the batch drawn from `fold_in(data_key, step)`."""
  # Pinned to the batch layout, a counter-based sampler draws only each
  # device's slice.
  inputs = plan.constrain("inputs", sample_inputs(
    jax.random.fold_in(data_key, state.step)))
  return run_step(plan, state, weights, inputs)
