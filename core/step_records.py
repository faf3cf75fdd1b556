"""The records of the training step: the state it carries (`TrainState`), its
static settings (`StepConfig`, `StreamSpec`), what a loss term is
(`LossTerm`) and sees (`StepContext`), the plan `make_train_step` derives
once (`StepPlan`), and what it returns (`TrainStep`, `StepShardings`).

Every record is a NamedTuple of arrays or a frozen dataclass of Python
values; the phases that read and write them are `train_step`'s,
the objective `step_objective`'s and the stream and term checks
`step_streams`'.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from decompax.core import health as health_lib, optim, schedules, squash
from decompax.core.ci_fns import OUTPUT, CIFn
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


Clean = tuple[Float[Array, "..."], dict]


class Updated(NamedTuple):
  """The parameters and optimizer states after one update, and its LR."""

  components: Components
  ci_params: Any
  components_opt: optax.OptState
  ci_opt: optax.OptState
  lr: Float[Array, ""]
