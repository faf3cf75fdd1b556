"""The divergences of a decoder LM's target: the output KL per position and
averaged (I14), the chunked head's KL equal to the whole logits' for any
chunk, and the blocks and taps the attention KL reads."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.losses import recon
from decompax.targets import glu_config, glu_divergence, glu_sites
from decompax.targets import glu_weights

RNG = np.random.default_rng(11)
CONFIG = glu_config.GluConfig(
  n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False)


def test_the_kl_is_the_losses_kl_and_its_position_mean():
  a, b = jnp.asarray(RNG.standard_normal((2, 3, 4, 9)), jnp.float32)
  np.testing.assert_allclose(glu_divergence.kl_clean_to_masked(a, b),
                             recon.kl_clean_to_masked(a, b), rtol=1e-6)
  np.testing.assert_allclose(glu_divergence.kl_clean_to_masked(a, b),
                             jnp.mean(glu_divergence.position_kl(a, b)),
                             rtol=1e-6)
  assert glu_divergence.position_kl(a, b).shape == (3, 4)


# 20 positions: chunks of 3 pad the last, one of 64 pads most of it.
@pytest.mark.parametrize("chunk", [3, 64])
def test_the_chunked_head_kl_is_the_whole_logits_kl(chunk):
  head = jnp.asarray(RNG.standard_normal((16, 8)), jnp.float32)
  masked, clean = jnp.asarray(RNG.standard_normal((2, 2, 5, 8)), jnp.float32)
  whole = glu_divergence.kl_clean_to_masked(masked @ head.T, clean @ head.T)
  np.testing.assert_allclose(
    glu_divergence.chunked_head_kl(head, masked, clean, chunk), whole,
    rtol=1e-5)
  capped = glu_divergence.kl_clean_to_masked(
    3 * jnp.tanh(masked @ head.T / 3), 3 * jnp.tanh(clean @ head.T / 3))
  np.testing.assert_allclose(
    glu_divergence.chunked_head_kl(head, masked, clean, chunk, 3.0), capped,
    rtol=1e-5)


def test_attention_blocks_are_those_with_a_decomposed_query_or_key():
  names = (glu_weights.site_name(2, "k"), glu_weights.site_name(0, "q"),
           glu_weights.site_name(0, "k"), glu_weights.site_name(1, "v"))
  sites = glu_sites.site_specs(CONFIG, names, 3)
  assert glu_divergence.attention_blocks(sites) == (0, 2)
  assert glu_divergence.attention_taps((0, 2)) == (
    "layers.0.self_attn.q_proj.out", "layers.0.self_attn.k_proj.out",
    "layers.2.self_attn.q_proj.out", "layers.2.self_attn.k_proj.out")
