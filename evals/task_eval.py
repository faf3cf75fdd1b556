"""Task metrics of a targeted decomposition (SPEC §6.6): what the target
stream's components do for the task, and what removing them costs
elsewhere.

A task's *prompts* are the full set a task defines (for two-operand tasks,
every operator and operand pair: its A/B grid), each scored at its answer
positions. A component is *target-alive* when its lower CI passes the
alive threshold at an answer position of any prompt. The pass reports the
answer accuracy and cross entropy of the clean model, under CI masks
(`m = ci`, no delta, as the `ci_masked` eval variant) and with the
target-alive components ablated (mask 0, every other component and the
delta path at 1: the model minus those rank-1 pieces); on the non-target
batch it reports the clean and ablated next-token cross entropy. It also
returns every component's CI at the answer position of every prompt, the
data of the A/B grid, for every CI role: a dual-role CI function's hidden
role adds its answer CI-L0 (`task/answer_l0_hidden/<site>`), while the
alive set, the masks and the ablation stay the output role's.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from decompax.core import masks as masks_lib
from decompax.core import slots
from decompax.core.ci_fns import OUTPUT, CIFn, role_suffix
from decompax.core.masks import SiteMask
from decompax.core.sites import Components
from decompax.core.step_objective import prepare, prepare_roles
from decompax.core.target import TargetFns, Weights
from decompax.evals.eval_metrics import cross_entropy


class TaskOutput(NamedTuple):
  """`scalars` by name (`task/…`); `alive` per site the target-alive
  components; `answer_ci` per CI role (`CIFn.roles`), per site, the lower
  CI at each prompt's (first) answer position, `[n_prompts, c]`;
  `other_density` per site each component's firing density (CI above the
  threshold) on the non-target batch."""

  scalars: dict[str, Float[Array, ""]]
  alive: dict[str, Bool[Array, " c"]]
  answer_ci: dict[str, dict[str, Float[Array, "n c"]]]
  other_density: dict[str, Float[Array, " c"]]


def answer_labels(labels: Int[Array, "b t"],
                  positions: tuple[int, ...]) -> Int[Array, "b t"]:
  """Return `labels` with every position but `positions` unlabelled (-1)."""
  keep = jnp.zeros(labels.shape[-1], bool).at[jnp.asarray(positions)].set(
    True)
  return jnp.where(keep, labels, -1)


def accuracy(logits: Float[Array, "*l v"],
             labels: Int[Array, "*l"]) -> Float[Array, ""]:
  """Return the share of labelled positions (label `>= 0`) whose argmax is
  the label."""
  valid = labels >= 0
  hit = (jnp.argmax(logits, axis=-1) == labels) & valid
  return jnp.sum(hit) / jnp.maximum(jnp.sum(valid), 1)


def _operands(prepared: tuple) -> Components:
  """Return the V/U a masked forward computes with: the compute-dtype copy
  when `prepare` made one (N4), else the masters."""
  return prepared[2] if len(prepared) == 3 else prepared[0]


class TaskSpec(NamedTuple):
  """A task pass's static settings: the target and CI function, the
  answer positions prompts are scored at, the alive threshold and the
  step's compute dtype (N4)."""

  target: TargetFns
  ci_fn: CIFn
  positions: tuple[int, ...]
  threshold: float
  compute_dtype: str | None = None


class PromptResults(NamedTuple):
  """The prompt half of a task pass: its scalars, the target-alive
  components, every role's lower CI and the V/U masked forwards read."""

  scalars: dict[str, Float[Array, ""]]
  alive: dict[str, Bool[Array, " c"]]
  role_lower: dict[str, dict[str, Float[Array, "n t c"]]]
  operands: Components


def prompt_results(spec: TaskSpec, components: Components, ci_params: Any,
                   weights: Weights, prompts: Int[Array, "n t"]
                   ) -> PromptResults:
  """Return the answer accuracy and CE of the clean, CI-masked and
  ablated forwards on `prompts`, with what the non-target half reads."""
  target, ci_fn, positions = spec.target, spec.ci_fn, spec.positions
  clean, taps = target.clean_forward(weights, prompts, ci_fn.input_taps)
  # Every role's CI as the train step computes it, the trunk run once.
  by_role = dict(zip(ci_fn.roles, prepare_roles(
    components, ci_params, taps, ci_fn, spec.compute_dtype)))
  comps = _operands(by_role[OUTPUT])
  role_lower = {r: own[1].lower for r, own in by_role.items()}
  lower = role_lower[OUTPUT]
  picked = jnp.asarray(positions)
  alive = {s: jnp.any(ci[:, picked] > spec.threshold, axis=(0, 1))
           for s, ci in lower.items()}
  labels = answer_labels(target.token_labels(prompts), positions)
  logits = {
    "clean": clean,
    "ci_masked": target.masked_forward(
      weights, comps, prompts,
      {s: SiteMask(ci) for s, ci in lower.items()}),
    "ablated": target.masked_forward(
      weights, comps, prompts,
      masks_lib.component_site_masks(
        target.sites, {s: 1.0 - a for s, a in alive.items()},
        prompts.shape)),
  }
  scalars = {}
  for name, out in logits.items():
    scalars[f"task/answer_accuracy/{name}"] = accuracy(out, labels)
    scalars[f"task/answer_ce/{name}"] = cross_entropy(out, labels)
  return PromptResults(scalars, alive, role_lower, comps)


def nontarget_results(
  spec: TaskSpec, components: Components, ci_params: Any, weights: Weights,
  other: Int[Array, "b s"], prompts: PromptResults,
) -> tuple[dict[str, Float[Array, ""]], dict[str, Float[Array, " c"]]]:
  """Return the clean and ablated next-token CE of the non-target batch
  (the prompts' target-alive components ablated) and each component's
  firing density on it."""
  target, ci_fn = spec.target, spec.ci_fn
  other_labels = target.token_labels(other)
  other_clean, other_taps = target.clean_forward(weights, other,
                                                 ci_fn.input_taps)
  other_lower = prepare(components, ci_params, other_taps, ci_fn,
                        spec.compute_dtype)[1].lower
  density = {
    s: jnp.mean((ci > spec.threshold).reshape(-1, ci.shape[-1]), axis=0,
                dtype=jnp.float32)
    for s, ci in other_lower.items()}
  other_ablated = target.masked_forward(
    weights, prompts.operands, other,
    masks_lib.component_site_masks(
      target.sites, {s: 1.0 - a for s, a in prompts.alive.items()},
      other.shape))
  scalars = {
    "task/nontarget_ce/clean": cross_entropy(other_clean, other_labels),
    "task/nontarget_ce/ablated": cross_entropy(other_ablated, other_labels)}
  return scalars, density


def task_pass(spec: TaskSpec, components: Components, ci_params: Any,
              weights: Weights, prompts: Int[Array, "n t"],
              other: Int[Array, "b s"]) -> TaskOutput:
  """Return the task metrics (see the module docstring), unjitted."""
  # Metrics never see the owner preset's pad slots (`core.slots`).
  components = slots.real_components(components, spec.target.sites)
  own = prompt_results(spec, components, ci_params, weights, prompts)
  other_scalars, density = nontarget_results(
    spec, components, ci_params, weights, other, own)
  scalars = {**own.scalars, **other_scalars}
  for s, mask in own.alive.items():
    scalars[f"task/alive/{s}"] = jnp.sum(mask, dtype=jnp.int32)
  picked = jnp.asarray(spec.positions)
  for role, lower in own.role_lower.items():
    for s, ci in lower.items():
      # Components active where the answer is computed, per prompt.
      scalars[f"task/answer_l0{role_suffix(role)}/{s}"] = jnp.mean(jnp.sum(
        ci[:, picked] > spec.threshold, axis=-1, dtype=jnp.float32))
  answer_ci = {role: {s: ci[:, spec.positions[0]] for s, ci in lower.items()}
               for role, lower in own.role_lower.items()}
  return TaskOutput(scalars, own.alive, answer_ci, density)


def make_task_eval(
  target: TargetFns, ci_fn: CIFn, positions: tuple[int, ...],
  threshold: float, compute_dtype: str | None = None,
) -> Callable[..., TaskOutput]:
  """Return the jitted `task(components, ci_params, weights, prompts, other)
  -> TaskOutput` over a task's `prompts [n, t]` (scored at `positions`)
  and a non-target token batch `other [b, t']` (see the module
  docstring)."""
  if target.token_labels is None:
    raise ValueError("task metrics score next-token answers; this target "
                     "has no token labels")
  spec = TaskSpec(target, ci_fn, positions, threshold, compute_dtype)

  def task(components: Components, ci_params: Any, weights: Weights,
           prompts: Int[Array, "n t"], other: Int[Array, "b s"]
           ) -> TaskOutput:
    return task_pass(spec, components, ci_params, weights, prompts, other)

  return jax.jit(task)
