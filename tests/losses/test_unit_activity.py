"""The baselines' unit activities equal their definitions computed
directly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.losses import unit_activity


def _silu(x):
  return x / (1 + np.exp(-x))


@pytest.fixture(scope="module")
def gate_up():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(2, 3, 8)).astype(np.float32),
          rng.normal(size=(2, 3, 8)).astype(np.float32))


def test_glu_neuron_and_gate_activity(gate_up):
  gate, up = gate_up
  got = unit_activity.neuron_activity(
    unit_activity.mlp_hidden(jnp.asarray(up), jnp.asarray(gate)))
  np.testing.assert_allclose(got, np.maximum(_silu(gate) * up, 0), rtol=1e-5,
                             atol=1e-6)
  assert (np.asarray(got) == 0).any() and (np.asarray(got) > 0).any()
  gated = unit_activity.gate_activity(jnp.asarray(gate))
  np.testing.assert_allclose(gated, np.maximum(_silu(gate), 0), rtol=1e-5,
                             atol=1e-6)
  relu = unit_activity.neuron_activity(unit_activity.mlp_hidden(
    jnp.asarray(up), jnp.asarray(gate), act=jax.nn.relu))
  np.testing.assert_allclose(relu, np.maximum(np.maximum(gate, 0) * up, 0),
                             rtol=1e-6)


def test_a_plain_mlps_neurons_read_act_of_up(gate_up):
  _, up = gate_up
  gelu = lambda x: jax.nn.gelu(x, approximate=False)
  got = unit_activity.neuron_activity(
    unit_activity.mlp_hidden(jnp.asarray(up), None, gelu))
  want = np.maximum(np.asarray(gelu(jnp.asarray(up, jnp.float32))), 0)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert (np.asarray(got) == 0).any() and (np.asarray(got) > 0).any()


def test_random_rotation_is_orthogonal_and_seeded():
  q = np.asarray(unit_activity.random_rotation(jax.random.key(3), 8))
  np.testing.assert_allclose(q.T @ q, np.eye(8), atol=1e-5)
  again = unit_activity.random_rotation(jax.random.key(3), 8)
  np.testing.assert_array_equal(q, np.asarray(again))
  other = unit_activity.random_rotation(jax.random.key(4), 8)
  assert not np.allclose(q, np.asarray(other))


def test_rotated_activity_is_the_hidden_vector_in_the_new_basis(gate_up):
  gate, up = gate_up
  q = unit_activity.random_rotation(jax.random.key(0), 8)
  hidden_of = lambda g, u: unit_activity.mlp_hidden(jnp.asarray(u),
                                                    jnp.asarray(g))
  got = unit_activity.rotated_activity(hidden_of(gate, up), q)
  hidden = _silu(gate) * up
  np.testing.assert_allclose(got, np.maximum(hidden @ np.asarray(q), 0),
                             rtol=1e-4, atol=1e-5)
  same = unit_activity.rotated_activity(hidden_of(gate, up), jnp.eye(8))
  np.testing.assert_allclose(same, unit_activity.neuron_activity(
    hidden_of(gate, up)), rtol=1e-6)


def test_head_activity_is_the_norm_of_each_heads_write():
  rng = np.random.default_rng(1)
  n_heads, head_dim, d = 3, 4, 5
  o_in = rng.normal(size=(2, 6, n_heads * head_dim)).astype(np.float32)
  w_o = rng.normal(size=(n_heads * head_dim, d)).astype(np.float32)
  o_in[0, 0, head_dim:] = 0  # only head 0 writes at this position
  got = np.asarray(unit_activity.head_activity(
    jnp.asarray(o_in), jnp.asarray(w_o), n_heads))
  assert got.shape == (2, 6, n_heads)
  for h in range(n_heads):
    part = slice(h * head_dim, (h + 1) * head_dim)
    write = o_in[..., part] @ w_o[part]
    np.testing.assert_allclose(got[..., h], np.linalg.norm(write, axis=-1),
                               rtol=1e-4)
  assert got[0, 0, 0] > 0 and (got[0, 0, 1:] == 0).all()
