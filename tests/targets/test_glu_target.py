"""A decoder LM's function table: next-token labels, the split head's
refusals, and the table's own fields for its sites."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.targets import (
  glu_config, glu_sites, glu_target, glu_weights)

CONFIG = glu_config.GluConfig(
  n_layers=3, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False)


def test_labels_are_the_next_tokens_and_minus_one_at_the_end():
  tokens = jnp.array([[1, 2, 3], [4, 5, 6]])
  np.testing.assert_array_equal(glu_target.token_labels(tokens),
                                [[2, 3, -1], [5, 6, -1]])


def test_the_split_head_refuses_a_negative_chunk_and_a_decomposed_head():
  sites = glu_sites.site_specs(CONFIG, (glu_weights.site_name(1, "up"),), 3)
  assert glu_target.target_fns(CONFIG, sites).split_head is None
  assert glu_target.target_fns(CONFIG, sites, output_chunk=4).split_head
  with pytest.raises(ValueError, match="must be >= 0"):
    glu_target.target_fns(CONFIG, sites, output_chunk=-1)
  head = glu_sites.site_specs(
    CONFIG, (glu_weights.site_name(1, "up"), glu_weights.HEAD_SITE), 3)
  with pytest.raises(ValueError, match="cannot decompose lm_head"):
    glu_target.target_fns(CONFIG, head, output_chunk=4)


def test_the_table_starts_masked_forwards_at_the_span():
  sites = glu_sites.site_specs(CONFIG, (glu_weights.site_name(1, "up"),), 3)
  fns = glu_target.target_fns(CONFIG, sites)
  assert fns.start_taps == ("resid.1",)
  assert fns.batch_lead_shape(jnp.zeros((2, 5), jnp.int32)) == (2, 5)
  assert glu_target.start_key(glu_sites.span_segments(CONFIG, sites)) == (
    "resid.1")
