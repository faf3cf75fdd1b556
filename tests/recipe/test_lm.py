"""Checkpoint LMs' settings: which runs are LM runs, `--sites` patterns
expanded in the model's order (a pattern matching nothing named with the
sites there are), and a batch's leading shape."""

import jax.numpy as jnp
import pytest

from decompax.recipe import lm
from decompax.targets import tms

NAMES = ("layers.0.self_attn.q_proj", "layers.0.mlp.up_proj",
         "layers.1.self_attn.q_proj", "layers.1.mlp.up_proj", "lm_head")


def test_an_lm_run_is_one_of_a_checkpoint(parse):
  assert lm.is_lm(parse("--target=hf", "--model_dir=m"))
  assert not lm.is_lm(parse("--target=tms_5-2"))


def test_patterns_expand_in_the_models_order():
  assert lm.expand_sites(NAMES, ("layers.*.mlp.*", "layers.0.*")) == (
    NAMES[0], NAMES[1], NAMES[3])
  assert lm.expand_sites(NAMES, ("lm_head",)) == ("lm_head",)
  with pytest.raises(ValueError,
                     match=r"'layers.5.\*' matches no site.*i < 2, lm_head"):
    lm.expand_sites(NAMES, ("layers.5.*",))


def test_the_lead_shape_is_the_batchs_and_counts_its_tokens():
  config = tms.TmsConfig(5, 2)
  fns = tms.target_fns(config, 2)
  shape = lm.lead_shape(fns, lambda k, b: jnp.zeros((b, 5)), 6)
  assert shape == (6,)
  assert lm.tokens_per_batch((4, 16)) == 64
