"""The objective over the step's prepared values: `scale_cotangent` scales
the gradient and leaves the value, floats are cast and the rest kept (N4),
and the reported total is `Σ coeff·value` under the schedules."""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import step_objective, step_records
from decompax.core.schedules import Schedule


def test_scale_cotangent_scales_the_gradient_only():
  x = jnp.asarray([1.0, -2.0])

  def loss(x, scale):
    return jnp.sum(step_objective.scale_cotangent(x, scale) ** 2)

  assert float(loss(x, jnp.asarray(0.25))) == 5.0
  np.testing.assert_allclose(jax.grad(loss)(x, jnp.asarray(0.25)),
                             0.25 * 2 * np.asarray(x))
  np.testing.assert_array_equal(jax.grad(loss)(x, jnp.asarray(0.0)), 0.0)


def test_only_floating_leaves_are_cast():
  tree = {"w": jnp.ones(2, jnp.float32), "i": jnp.arange(3)}
  cast = step_objective.cast_floats(tree, jnp.bfloat16)
  assert cast["w"].dtype == jnp.bfloat16
  assert cast["i"].dtype == tree["i"].dtype


def test_the_reported_total_weights_each_value_by_its_coefficient():
  terms = (step_records.LossTerm("a", 2.0, None),
           step_records.LossTerm("b", Schedule(1.0, "linear", 0.0), None))
  values = {"a": jnp.asarray(3.0), "b": jnp.asarray(5.0)}
  total = step_objective.reported_total(terms, values, jnp.asarray(0), 10)
  np.testing.assert_allclose(total, 2 * 3 + 1 * 5)
  # The linear schedule reaches its final 0 at the last step.
  last = step_objective.reported_total(terms, values, jnp.asarray(9), 10)
  np.testing.assert_allclose(last, 2 * 3)
