"""The token-embedding toy (targets/token_embed.py; SPEC §3.7, I53)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import sites
from decompax.core.masks import SiteMask
from decompax.measures import probe
from decompax.targets import registry, token_embed, toy_sites


@functools.cache
def _toy():
  toy = registry.get("embed_16-8")
  return toy, toy.train(toy.default_seed), toy.fns(6)


def test_the_target_is_the_embedding_read_out():
  toy, weights, fns = _toy()
  assert fns.sites == (sites.SiteSpec("embed", "embed", 0, 16, 8, 6,
                                      op=sites.EMBEDDING),)
  np.testing.assert_allclose(jnp.linalg.norm(weights.embed, axis=-1), 1.0,
                             rtol=1e-6)
  np.testing.assert_allclose(weights.readout @ weights.readout.T,
                             jnp.eye(8), atol=1e-6)
  tokens = jnp.array([[3, 15], [0, 3]], jnp.int32)
  y, taps = fns.clean_forward(weights, tokens, ("embed", "embed.out"))
  np.testing.assert_array_equal(taps["embed"], tokens)
  np.testing.assert_array_equal(taps["embed.out"], weights.embed[tokens])
  np.testing.assert_allclose(y, weights.embed[tokens] @ weights.readout,
                             rtol=1e-6)
  np.testing.assert_array_equal(token_embed.forward(weights, tokens), y)
  assert fns.batch_lead_shape(tokens) == (2, 2)
  assert toy.missing_features(weights) == ()


def test_inputs_and_probe_are_token_ids():
  toy, _, fns = _toy()
  x = toy.sample_inputs(jax.random.key(1), 4096)
  assert x.shape == (4096,) and x.dtype == jnp.int32
  assert set(np.unique(np.asarray(x))) == set(range(16))
  np.testing.assert_array_equal(fns.feature_probe(), np.arange(16))
  assert fns.expected["embed"].feature_axis == 0


def test_masked_forward_without_live_sites_is_the_clean_forward():
  """I2 on an embedding site; and with every mask and δ one the live site
  reproduces it to fp32 rounding (I3, I53)."""
  toy, weights, fns = _toy()
  components = sites.init_components(jax.random.key(2), fns.sites)
  tokens = toy.sample_inputs(jax.random.key(3), 32)
  clean, _ = fns.clean_forward(weights, tokens, ())
  np.testing.assert_array_equal(
    fns.masked_forward(weights, components, tokens, {}), clean)
  ones = SiteMask(jnp.ones((32, 6)), jnp.ones((32,)))
  np.testing.assert_allclose(
    fns.masked_forward(weights, components, tokens, {"embed": ones}), clean,
    atol=1e-5)


def test_probe_reads_every_token_including_id_zero():
  """Each token moves the site's output by its unit row; token 0 is no
  zero input."""
  _, weights, fns = _toy()
  reads = probe.probe_reads(fns, weights)["embed"]
  np.testing.assert_allclose(reads, np.ones(16), rtol=1e-6)


def test_weights_round_trip():
  toy, weights, _ = _toy()
  restored = toy.weights_from_arrays(dict(toy.weights_to_arrays(weights)))
  assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, restored,
                                          weights)))


def test_a_token_past_the_vocabulary_is_refused_in_one_line():
  _, weights, fns = _toy()
  with pytest.raises(ValueError) as raised:
    token_embed.forward(weights, jnp.array([1, 16]))
  assert str(raised.value) == (
    "tokens: token id 16 is outside the vocabulary [0, 16); give ids below "
    "16")
  # The function table's eager forwards refuse it too.
  with pytest.raises(ValueError, match="token id -2 is outside"):
    fns.clean_forward(weights, jnp.array([-2, 0]), ())


def test_a_live_embedding_site_refuses_activations():
  _, weights, fns = _toy()
  components = sites.init_components(jax.random.key(2), fns.sites)
  matmul = toy_sites.masked_matmul(fns.sites, components,
                                   {"embed": SiteMask(jnp.ones((2, 6)))})
  with pytest.raises(ValueError, match="embedding site reads integer token"):
    matmul("embed", jnp.ones((2, 16)), weights.embed)
