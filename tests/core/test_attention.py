"""core/attention: the primitives the CI transformer and the LM share."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import attention


def _qkv(nh=4, nkv=2, t=5, hd=8):
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (2, t, nh, hd)),
          jax.random.normal(keys[1], (2, t, nkv, hd)),
          jax.random.normal(keys[2], (2, t, nkv, hd)))


def test_rope_rotates_each_pair_by_its_position_angle():
  q, _, _ = _qkv()
  inv_freq = 1.0 / 10000.0 ** (jnp.arange(4, dtype=jnp.float32) / 4)
  cos, sin = attention.rope_tables(inv_freq, q.shape[1])
  out = attention.apply_rope(q, cos, sin)
  # Position 0 is the identity; a rotation keeps each (i, i + hd/2) pair's
  # length; the split form gives the same values.
  np.testing.assert_allclose(out[:, 0], q[:, 0], rtol=1e-6)
  pairs = lambda x: jnp.hypot(x[..., :4], x[..., 4:])  # noqa: E731
  np.testing.assert_allclose(pairs(out), pairs(q), rtol=1e-5)
  np.testing.assert_array_equal(
    attention.apply_rope(q, cos, sin, split=True), out)


def test_grouped_logits_serve_each_query_head_its_kv_head():
  q, k, v = _qkv()
  logits = attention.grouped_logits(q, k)
  assert logits.shape == (2, 2, 2, 5, 5)
  # Query head 3 is the second of kv head 1's group.
  np.testing.assert_allclose(
    logits[:, 1, 1], jnp.einsum("bth,bsh->bts", q[:, :, 3], k[:, :, 1]),
    rtol=1e-5)
  probs = jax.nn.softmax(logits, axis=-1)
  out = attention.grouped_values(probs, v)
  np.testing.assert_allclose(
    out[:, :, 3], jnp.einsum("bts,bsh->bth", probs[:, 1, 1], v[:, :, 1]),
    rtol=1e-5)


def test_causal_mask_lets_a_query_see_itself_and_the_past():
  np.testing.assert_array_equal(attention.causal_mask(3),
                                [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


class PrimitivesTest(chex.TestCase):
  """RMS normalisation and RoPE agree with and without jit
  (`chex.variants`): the CI transformer runs them traced, tests eagerly."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_rms_and_rope_agree_with_and_without_jit(self):
    q, _, _ = _qkv()
    inv_freq = jnp.linspace(1.0, 0.01, 4)
    rms = self.variant(attention.rms_normalize, static_argnums=1)(q, 1e-6)
    chex.assert_trees_all_close(rms, attention.rms_normalize(q, 1e-6),
                                rtol=1e-6)
    np.testing.assert_allclose(jnp.mean(jnp.square(rms), -1), 1.0,
                               rtol=1e-4)
    rope = self.variant(
      lambda x, f: attention.apply_rope(x, *attention.rope_tables(f, 5)))
    chex.assert_trees_all_close(
      rope(q, inv_freq),
      attention.apply_rope(q, *attention.rope_tables(inv_freq, 5)),
      rtol=1e-6)
