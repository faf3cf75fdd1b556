"""`core.stable_softmax.log_softmax` is `jax.nn.log_softmax`'s function."""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import stable_softmax


def test_values_and_gradient_equal_jax_s_log_softmax():
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 97)) * 4.0
  np.testing.assert_allclose(stable_softmax.log_softmax(x),
                             jax.nn.log_softmax(x), rtol=0, atol=1e-6)
  weights = jax.random.normal(jax.random.PRNGKey(1), x.shape)
  ours = jax.grad(lambda v: jnp.sum(weights * stable_softmax.log_softmax(v)))
  theirs = jax.grad(lambda v: jnp.sum(weights * jax.nn.log_softmax(v)))
  np.testing.assert_allclose(ours(x), theirs(x), rtol=0, atol=1e-6)


def test_another_axis_and_large_logits_stay_finite():
  x = jnp.array([[1000.0, 0.0], [1001.0, -50.0], [999.0, 3.0]])
  got = stable_softmax.log_softmax(x, axis=0)
  np.testing.assert_allclose(got, jax.nn.log_softmax(x, axis=0), atol=1e-6)
  assert bool(jnp.all(jnp.isfinite(got)))


def test_a_masked_entry_keeps_probability_zero():
  x = jnp.array([0.5, -jnp.inf, 2.0])
  got = stable_softmax.log_softmax(x)
  assert got[1] == -jnp.inf
  np.testing.assert_allclose(jnp.sum(jnp.exp(got)), 1.0, atol=1e-6)


def test_the_row_maximum_stays_behind_its_barrier():
  """The barrier is the point: without it the TPU's compiler fuses the
  maximum into the exponentials as a row-wide sliding window."""
  jaxpr = jax.make_jaxpr(stable_softmax.log_softmax)(jnp.ones((2, 8)))
  names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert "optimization_barrier" in names
  assert names.index("reduce_max") < names.index("optimization_barrier")
