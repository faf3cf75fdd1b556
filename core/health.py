"""Finiteness of a training run: the flag each step computes.

A step whose losses or updated state hold a NaN or an infinity is a
*non-finite step*. The step records it in `Health`, a few scalars carried in
the state so that the host can look at them whenever it likes (every log
step, every save) without a sync per step, and can still name the first bad
step and the first bad part however many steps ago it happened.

Parts are named by the step: its loss terms in order, then the state fields
(`part_names`). `Health.first_part` indexes that list.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

# The TrainState fields whose finiteness the step checks, in this order,
# after the loss terms.
STATE_PARTS = ("components", "ci_params", "components_opt", "ci_opt",
               "term_states")


class Health(NamedTuple):
  """Non-finite steps so far, and where the first one went bad.

  `first_step` is the 1-based number of the first non-finite update (the
  `step` of its metrics record), -1 while there was none; `first_part`
  indexes `part_names(...)`, -1 likewise. `streak` counts the non-finite
  steps in a row up to the latest one (0 after a finite step).
  """

  nonfinite_steps: Int[Array, ""]
  first_step: Int[Array, ""]
  first_part: Int[Array, ""]
  streak: Int[Array, ""]


def healthy() -> Health:
  """Return the record of a run with no non-finite step."""
  # Four separate buffers: the step donates its state, and one buffer may
  # be donated only once.
  zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
  none = lambda: jnp.full((), -1, jnp.int32)  # noqa: E731
  return Health(zero(), none(), none(), zero())


def all_finite(tree: Any) -> Bool[Array, ""]:
  """Return whether every floating-point leaf of `tree` is finite.

  Integer leaves and PRNG keys cannot hold a NaN and are not looked at.
  """
  # `x·0` is 0 where x is finite and NaN where it is not, so one plain sum
  # tells. `all(isfinite(x))` would say the same, but XLA's CPU backend
  # runs that reduction as scalar code inside the update's fusion: +7% on
  # an elementwise-bound step (`bench/nonfinite_guard.py`).
  flags = [jnp.isfinite(jnp.sum(leaf * 0)) for leaf in jax.tree.leaves(tree)
           if jnp.issubdtype(leaf.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def part_names(term_names: tuple[str, ...]) -> tuple[str, ...]:
  """Return the names `Health.first_part` indexes: `loss/<term>` for each
  term, then the state fields."""
  return (*(f"loss/{name}" for name in term_names), *STATE_PARTS)


def record(
  health: Health, parts: tuple, number: Int[Array, ""]
) -> tuple[Bool[Array, ""], Health]:
  """Return whether every one of `parts` is finite, and `health` updated.

  `parts` are trees in `part_names` order; `number` is the step's 1-based
  number, kept as `first_step` when this is the run's first bad step.
  """
  flags = jnp.stack([all_finite(part) for part in parts])
  finite = jnp.all(flags)
  bad = jnp.logical_not(finite).astype(jnp.int32)
  first = jnp.logical_and(bad > 0, health.first_step < 0)
  return finite, Health(
    nonfinite_steps=health.nonfinite_steps + bad,
    first_step=jnp.where(first, number.astype(jnp.int32), health.first_step),
    first_part=jnp.where(first, jnp.argmin(flags).astype(jnp.int32),
                         health.first_part),
    streak=(health.streak + 1) * bad,
  )


def keep_if(finite: Bool[Array, ""], new: Any, old: Any) -> Any:
  """Return `new` where `finite`, else `old`, leaf by leaf (a dropped
  update)."""

  def choose(n, o):
    if jax.dtypes.issubdtype(n.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(
        jnp.where(finite, jax.random.key_data(n), jax.random.key_data(o)),
        impl=jax.random.key_impl(n))
    return jnp.where(finite, n, o)

  return jax.tree.map(choose, new, old)


def describe(health: Health, names: tuple[str, ...]) -> str:
  """Return `step N (first non-finite value: <part>)` for a host record."""
  step, part = int(health.first_step), int(health.first_part)
  name = names[part] if 0 <= part < len(names) else f"part {part}"
  return f"step {step} (first non-finite value: {name})"
