"""Importance/frequency minimality sum over the global batch (SPEC D2, I11).

The frequency penalty `Φ(f) = f·log2(1 + a'f)` is convex, so averaging
per-shard penalties (`mean_shard Φ(f_shard)`) overstates `Φ(f)` whenever the
shards' frequencies differ (Jensen). The terms as the step runs them, with
their CI sharded over eight devices, must equal the one-device values; the
per-shard form written out here must not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from decompax.core import squash, step_records
from decompax.losses import minimality
from decompax.losses import loss_terms as terms

pytestmark = pytest.mark.multidevice

B, C, A_PRIME, P_EXP = 64, 6, 64.0, 1.0


def _ci_upper():
  # Sparse firing whose rate differs between batch slices, as real CI does.
  u = jax.random.uniform(jax.random.key(0), (B, C))
  rate = jnp.linspace(0.02, 0.6, B)[:, None]
  return jnp.where(u < rate, u / rate, 0.0)


def _term_values(ci_upper):
  """Importance and frequency terms as the step calls them."""
  ci = squash.CIOutput({"s": ci_upper}, {"s": ci_upper}, {"s": ci_upper})
  ctx = step_records.StepContext(jnp.zeros((), jnp.int32), 10, None, None,
                                 None, None, None, ci)
  imp = terms.importance_minimality_term(1.0, P_EXP)
  freq = terms.frequency_minimality_term(1.0, P_EXP, A_PRIME)
  key = jax.random.key(1)
  return jnp.stack([imp.fn(ctx, key, None)[0], freq.fn(ctx, key, None)[0]])


def _per_shard_frequency(mesh):
  """The Jensen trap: each shard's penalty of its own frequencies, averaged."""

  def local(ci_upper):
    f = minimality.component_frequencies(ci_upper, P_EXP)
    penalty = jnp.sum(minimality.frequency_penalty(f, A_PRIME))
    return jax.lax.pmean(penalty, "fsdp")

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("fsdp"),
                               out_specs=P()))


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("fsdp",),
                       axis_types=(jax.sharding.AxisType.Auto,))


def test_terms_on_a_sharded_batch_equal_the_one_device_values(mesh):
  ci = _ci_upper()
  one = jax.jit(jax.value_and_grad(lambda x: jnp.sum(_term_values(x))))
  sharded_ci = jax.device_put(ci, NamedSharding(mesh, P("fsdp")))
  value_1, grad_1 = one(ci)
  value_8, grad_8 = one(sharded_ci)
  assert grad_8.sharding.spec[0] == "fsdp"
  np.testing.assert_allclose(value_8, value_1, rtol=1e-6)
  np.testing.assert_allclose(grad_8, grad_1, rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(jax.jit(_term_values)(sharded_ci),
                             _term_values(ci), rtol=1e-6)


def test_per_shard_sums_differ_and_would_fail(mesh):
  """The trap is real at this data: a per-shard implementation is caught."""
  ci = _ci_upper()
  global_freq = float(_term_values(ci)[1])
  trapped = float(_per_shard_frequency(mesh)(
    jax.device_put(ci, NamedSharding(mesh, P("fsdp")))))
  assert trapped > global_freq * (1 + 1e-2)  # convexity: strictly above
