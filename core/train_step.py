"""The training step factory (SPEC §6.1, §6.3).

`make_train_step` builds ONE jitted pure step `(state, weights, inputs) →
(state, metrics)` from a target's function table, a CI function, a static
tuple of loss terms and optimizer settings. Frozen target weights are a
runtime argument. Everything the step changes lives in `TrainState`; keys are
derived from `(state.rng, state.step)`, never carried forward.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from decompax.core import optim, schedules, squash
from decompax.core.ci_fns import CIFn
from decompax.core.sites import Components
from decompax.core.target import Batch, TargetFns, Weights


class TrainState(NamedTuple):
  """Everything a training step reads and writes."""

  components: Components
  ci_params: Any
  components_opt: optax.OptState
  ci_opt: optax.OptState
  step: Int[Array, ""]
  rng: Key[Array, ""]


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

  def masked_forward(self, site_masks) -> Float[Array, "..."]:
    """Run the target with `site_masks` on the step's inputs and components."""
    return self.target.masked_forward(
      self.weights, self.components, self.inputs, site_masks
    )


class LossTerm(NamedTuple):
  """One coefficiented term `coeff(step) · fn(ctx, key)` of the objective."""

  name: str
  coeff: schedules.Coefficient
  fn: Callable[[StepContext, Key[Array, ""]], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of the step."""

  total_steps: int
  components_opt: optim.AdamWConfig
  ci_opt: optim.AdamWConfig
  ci_alive_threshold: float = 0.0


class TrainStep(NamedTuple):
  """The jitted step and the function that builds its initial state."""

  init: Callable[[Components, Any, Key[Array, ""]], TrainState]
  step: Callable[..., tuple[TrainState, dict[str, Array]]]


def ci_l0(
  ci_lower: dict[str, Float[Array, "*l c"]], threshold: float
) -> dict[str, Float[Array, ""]]:
  """Return per site the position-mean count of components above threshold."""
  return {
    site: jnp.mean(jnp.sum(ci > threshold, axis=-1, dtype=jnp.float32))
    for site, ci in ci_lower.items()
  }


def objective(
  theta: tuple[Components, Any],
  step: Int[Array, ""],
  step_key: Key[Array, ""],
  target: TargetFns,
  ci_fn: CIFn,
  terms: tuple[LossTerm, ...],
  total_steps: int,
  weights: Weights,
  inputs: Batch,
  clean_output: Array,
  taps: dict[str, Array],
) -> tuple[Float[Array, ""], tuple[dict[str, Array], squash.CIOutput]]:
  """Return the coefficiented sum of all terms, their raw values and the CI."""
  components, ci_params = theta
  ci = squash.squash(ci_fn.apply(ci_params, taps, components))
  ctx = StepContext(
    step, total_steps, target, weights, inputs, clean_output, components, ci
  )
  total = jnp.zeros((), jnp.float32)
  values = {}
  for j, term in enumerate(terms):
    value = term.fn(ctx, jax.random.fold_in(step_key, 1 + j))
    coeff = schedules.schedule_value(term.coeff, step, total_steps)
    total = total + coeff * value
    values[term.name] = value
  return total, (values, ci)


def make_train_step(
  target: TargetFns,
  ci_fn: CIFn,
  terms: tuple[LossTerm, ...],
  config: StepConfig,
  sample_inputs: Optional[Callable[[Key[Array, ""]], Batch]] = None,
) -> TrainStep:
  """Return the initial-state builder and the ONE jitted training step.

  With `sample_inputs`, the step draws its own batch from
  `fold_in(data_key, step)` (a pure function of seed and step) and takes
  `(state, weights, data_key)`; otherwise it takes `(state, weights, inputs)`.
  """
  names = [t.name for t in terms]
  if len(set(names)) != len(names):
    raise ValueError(f"loss term names must be unique, got {names}")
  components_tx = optim.adamw(config.components_opt, config.total_steps)
  ci_tx = optim.adamw(config.ci_opt, config.total_steps)

  def init(components, ci_params, run_key):
    return TrainState(
      components=components,
      ci_params=ci_params,
      components_opt=components_tx.init(components),
      ci_opt=ci_tx.init(ci_params),
      step=jnp.zeros((), jnp.int32),
      rng=run_key,
    )

  def train_step(state: TrainState, weights: Weights, inputs: Batch):
    step_key = jax.random.fold_in(state.rng, state.step)
    clean_output, taps = jax.tree.map(
      jax.lax.stop_gradient,
      target.clean_forward(weights, inputs, ci_fn.input_taps),
    )
    theta = (state.components, state.ci_params)
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    (total, (values, ci)), (g_components, g_ci) = grad_fn(
      theta, state.step, step_key, target, ci_fn, terms, config.total_steps,
      weights, inputs, clean_output, taps,
    )
    updates, components_opt = components_tx.update(
      g_components, state.components_opt, state.components
    )
    components = optax.apply_updates(state.components, updates)
    ci_updates, ci_opt = ci_tx.update(g_ci, state.ci_opt, state.ci_params)
    ci_params = optax.apply_updates(state.ci_params, ci_updates)
    metrics = {"loss/total": total}
    metrics.update({f"loss/{k}": v for k, v in values.items()})
    for site, l0 in ci_l0(ci.lower, config.ci_alive_threshold).items():
      metrics[f"ci_l0/{site}"] = l0
    metrics["grad_norm/components"] = optax.tree.norm(g_components)
    metrics["lr/components"] = schedules.schedule_value(
      config.components_opt.lr, state.step, config.total_steps
    )
    new_state = TrainState(
      components, ci_params, components_opt, ci_opt, state.step + 1, state.rng
    )
    return new_state, metrics

  if sample_inputs is None:
    step = jax.jit(train_step, donate_argnums=0)
  else:

    def sampled_step(state, weights, data_key):
      inputs = sample_inputs(jax.random.fold_in(data_key, state.step))
      return train_step(state, weights, inputs)

    step = jax.jit(sampled_step, donate_argnums=0)
  return TrainStep(init=init, step=step)
