"""The baselines' unit activities equal their definitions computed
directly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.measures import unit_activity


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


def _sparse_activity(seed: int, shape: tuple[int, ...]) -> np.ndarray:
  """Non-negative activity, zero at about half the entries."""
  rng = np.random.default_rng(seed)
  return np.maximum(rng.normal(size=shape), 0).astype(np.float32)


def test_firing_density_median_and_l0_match_direct_counts():
  ci = _sparse_activity(1, (3, 4, 6))
  ci[..., 5] = 0  # a dead component, left out of the median
  flat = ci.reshape(-1, 6)
  density = (flat > 0).mean(axis=0)
  np.testing.assert_allclose(unit_activity.firing_density(jnp.asarray(ci)),
                             density, rtol=1e-6)
  np.testing.assert_allclose(
    unit_activity.median_alive_density(jnp.asarray(ci)),
    np.median(density[:5]), rtol=1e-6)
  np.testing.assert_allclose(unit_activity.mean_l0(jnp.asarray(ci)),
                             (flat > 0).sum(axis=1).mean(), rtol=1e-6)
  assert np.isnan(unit_activity.median_alive_density(jnp.zeros((4, 3))))


@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_density_matched_neurons_keep_their_top_share_of_positions(share):
  a = np.random.default_rng(2).uniform(0.1, 1, size=(5, 8, 4))
  a = a.astype(np.float32)
  threshold = unit_activity.top_share_thresholds(jnp.asarray(a),
                                                 jnp.float32(share))
  kept = np.asarray(unit_activity.density_matched_activity(
    jnp.asarray(a), threshold)).reshape(-1, 4)
  flat = a.reshape(-1, 4)
  m = round(share * len(flat))
  for u in range(4):
    top = np.argsort(-flat[:, u])[:m]
    want = np.zeros(len(flat), np.float32)
    want[top] = flat[top, u]
    np.testing.assert_array_equal(kept[:, u], want)


def test_no_share_keeps_no_position():
  a = jnp.ones((3, 2))
  threshold = unit_activity.top_share_thresholds(a, jnp.float32(jnp.nan))
  assert not np.asarray(unit_activity.density_matched_activity(
    a, threshold)).any()


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_top_k_keeps_each_positions_k_most_active_units(k):
  a = np.random.default_rng(3).uniform(0.1, 1, size=(2, 5, 6))
  a = a.astype(np.float32)
  got = np.asarray(unit_activity.top_k_activity(jnp.asarray(a),
                                                jnp.int32(k)))
  order = np.argsort(-a, axis=-1)[..., :k]
  want = np.zeros_like(a)
  np.put_along_axis(want, order, np.take_along_axis(a, order, -1), -1)
  np.testing.assert_array_equal(got, want)
