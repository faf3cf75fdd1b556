"""Embedding sites (SPEC §3.7, I53): the linear site on one-hot tokens,
computed by row gathers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, site_forward
from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask

VOCAB, D, C = 11, 5, 7
# Every id once, some repeated, on a [2, 6] lead shape; rows 9 and 10 unread.
TOKENS = jnp.array([[3, 0, 8, 3, 1, 2], [7, 4, 6, 5, 0, 3]], jnp.int32)


@functools.cache
def _weights():
  keys = jax.random.split(jax.random.key(0), 3)
  e = jax.random.normal(keys[0], (VOCAB, D))
  v = jax.random.normal(keys[1], (VOCAB, C))
  u = jax.random.normal(keys[2], (C, D))
  return e, v, u


def _masks(delta: bool = True, route: bool = False) -> SiteMask:
  keys = jax.random.split(jax.random.key(1), 3)
  lead = TOKENS.shape
  return SiteMask(
    jax.random.uniform(keys[0], (*lead, C)),
    jax.random.uniform(keys[1], lead) if delta else None,
    jax.random.bernoulli(keys[2], 0.5, lead) if route else None)


def _onehot(tokens):
  return jax.nn.one_hot(tokens, VOCAB, dtype=jnp.float32)


@pytest.mark.parametrize("delta,route", [(False, False), (True, False),
                                         (True, True)])
def test_i53_gather_equals_the_one_hot_matmul(delta, route):
  e, v, u = _weights()
  masks = _masks(delta, route)
  gathered = site_forward.decomposed_embedding(TOKENS, e, v, u, masks)
  multiplied = site_forward.decomposed_matmul(_onehot(TOKENS), e, v, u, masks)
  np.testing.assert_allclose(gathered, multiplied, rtol=1e-6, atol=1e-6)
  spec = sites_lib.SiteSpec("embed", "embed", 0, VOCAB, D, C,
                            op=sites_lib.EMBEDDING)
  np.testing.assert_array_equal(
    site_forward.component_acts(spec, TOKENS, v), v[TOKENS])
  # The frozen path is the row itself, bit for bit.
  np.testing.assert_array_equal(
    site_forward.site_embedding(TOKENS, e, v, u, None), e[TOKENS])


def test_i53_all_masks_one_with_delta_reproduce_the_rows():
  e, v, u = _weights()
  lead = TOKENS.shape
  ones = SiteMask(jnp.ones((*lead, C)), jnp.ones(lead), jnp.ones(lead, bool))
  out = site_forward.decomposed_embedding(TOKENS, e, v, u, ones)
  # `a·U + (E[t] − a·U)`: E[t] up to the rounding of the two sums.
  np.testing.assert_allclose(out, e[TOKENS], rtol=0, atol=1e-5)


def test_i53_delta_row_is_the_residual_of_the_token():
  e, v, u = _weights()
  lead = TOKENS.shape
  only_delta = SiteMask(jnp.zeros((*lead, C)), jnp.ones(lead))
  out = site_forward.decomposed_embedding(TOKENS, e, v, u, only_delta)
  np.testing.assert_allclose(out, (e - v @ u)[TOKENS], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delta", [False, True])
def test_i53_zeroing_a_component_removes_its_piece_of_the_row(delta):
  e, v, u = _weights()
  lead = TOKENS.shape
  delta_mask = jnp.ones(lead) if delta else None
  ones = jnp.ones((*lead, C))
  full = site_forward.decomposed_embedding(
    TOKENS, e, v, u, SiteMask(ones, delta_mask))
  for c in (0, 4):
    off = site_forward.decomposed_embedding(
      TOKENS, e, v, u, SiteMask(ones.at[..., c].set(0.0), delta_mask))
    np.testing.assert_allclose(full - off, v[TOKENS, c][..., None] * u[c],
                               rtol=1e-5, atol=1e-5)


def test_i53_gradients_reach_only_the_gathered_rows():
  e, v, u = _weights()
  masks = _masks()
  probe = jax.random.normal(jax.random.key(2), (*TOKENS.shape, D))

  def loss(e, v, u):
    return jnp.sum(probe * site_forward.decomposed_embedding(
      TOKENS, e, v, u, masks))

  g_e, g_v, g_u = jax.grad(loss, argnums=(0, 1, 2))(e, v, u)
  read = np.isin(np.arange(VOCAB), np.asarray(TOKENS))
  assert not read.all()
  for g in (g_e, g_v):
    np.testing.assert_array_equal(g[~read], 0.0)
    assert np.all(np.abs(np.asarray(g)[read]).sum(-1) > 0)
  assert np.all(np.abs(np.asarray(g_u)).sum(-1) > 0)
  # The gradient is the one-hot matmul's, whose rows of V are the same sums.
  g_v_onehot = jax.grad(lambda v: jnp.sum(probe * site_forward.decomposed_matmul(
    _onehot(TOKENS), e, v, u, masks)))(v)
  np.testing.assert_allclose(g_v, g_v_onehot, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 5, -1])
def test_i53_an_id_outside_the_vocabulary_is_refused_where_it_enters(bad):
  tokens = np.array([[0, 1], [2, bad]])
  with pytest.raises(ValueError) as raised:
    site_forward.check_token_ids(tokens, VOCAB, "tokens")
  message = str(raised.value)
  assert "\n" not in message
  assert f"token id {bad} is outside the vocabulary [0, {VOCAB})" in message
  site_forward.check_token_ids(tokens.clip(0, VOCAB - 1), VOCAB, "tokens")
  with pytest.raises(ValueError, match="must be integers"):
    site_forward.check_token_ids(tokens.astype(np.float32), VOCAB, "tokens")


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_i53_inside_a_trace_a_bad_id_gives_nan_rows_never_a_clamped_one(bad):
  e, v, u = _weights()
  tokens = jnp.array([2, bad, 4], jnp.int32)
  lead = tokens.shape
  masks = SiteMask(jnp.ones((*lead, C)), jnp.ones(lead))
  out = jax.jit(site_forward.decomposed_embedding)(tokens, e, v, u, masks)
  assert np.isnan(out[1]).all()
  assert np.isfinite(out[0]).all() and np.isfinite(out[2]).all()
  frozen = jax.jit(site_forward.rows)(e, tokens)
  assert np.isnan(frozen[1]).all()


def _paired_specs():
  linear = sites_lib.SiteSpec("embed", "embed", 0, VOCAB, D, C)
  return linear, sites_lib.SiteSpec("embed", "embed", 0, VOCAB, D, C,
                                    op=sites_lib.EMBEDDING)


def test_i53_component_mlp_ci_reads_the_gathered_activations():
  """The component-MLP CI of an embedding site on token ids equals that of
  the same-shaped linear site on their one-hot inputs."""
  _, v, u = _weights()
  linear, embedding = _paired_specs()
  components = {"embed": sites_lib.Factors(v[None], u[None])}
  config = ci_fns.CIConfig("component_mlp", (4,))
  fn_linear = ci_fns.make_ci_fn(config, (linear,))
  fn_embed = ci_fns.make_ci_fn(config, (embedding,))
  params = fn_linear.init(jax.random.key(3))
  pre_linear = fn_linear.apply(params, {"embed": _onehot(TOKENS)}, components)
  pre_embed = fn_embed.apply(params, {"embed": TOKENS}, components)
  np.testing.assert_allclose(pre_embed["embed"], pre_linear["embed"],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["site_mlp", "vector_mlp", "global_mlp"])
def test_i53_input_reading_ci_functions_read_v_rows_of_width_c(kind):
  """CI functions that read a site's input read an embedding's `V[t]`
  (width C), and so carry gradient into those rows of V alone."""
  _, v, u = _weights()
  _, embedding = _paired_specs()
  config = ci_fns.CIConfig(kind, (4,))
  fn = ci_fns.make_ci_fn(config, (embedding,))
  params = fn.init(jax.random.key(3))

  def total(v):
    components = {"embed": sites_lib.Factors(v[None], u[None])}
    return jnp.sum(fn.apply(params, {"embed": TOKENS}, components)["embed"])

  assert ci_fns.ci_input_width(embedding) == C
  g = jax.grad(total)(v)
  read = np.isin(np.arange(VOCAB), np.asarray(TOKENS))
  np.testing.assert_array_equal(g[~read], 0.0)
  assert np.abs(np.asarray(g)[read]).sum() > 0


def test_transformer_ci_refuses_an_embedding_site():
  _, embedding = _paired_specs()
  with pytest.raises(ValueError, match="embedding sites \\['embed'\\]"):
    ci_fns.make_ci_fn(ci_fns.CIConfig("transformer"), (embedding,))


def test_site_ops_are_checked():
  linear, embedding = _paired_specs()
  with pytest.raises(ValueError, match="op must be one of"):
    sites_lib.validate_sites((sites_lib.SiteSpec(
      "x", "x", 0, VOCAB, D, C, op="conv"),))
  mixed = (embedding, sites_lib.SiteSpec("other", "embed", 1, VOCAB, D, C))
  with pytest.raises(ValueError, match="a kind has one op"):
    sites_lib.validate_sites(mixed)
  assert sites_lib.is_embedding(embedding) and not sites_lib.is_embedding(
    linear)
