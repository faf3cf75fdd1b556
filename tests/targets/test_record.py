"""targets/record: one typed record for toys, checkpoint LMs and task
models."""

import dataclasses

import jax
import pytest

from decompax.targets import record, registry


@pytest.mark.parametrize("name,decoder", [("tms_5-2", False),
                                          ("resid_mlp1", False),
                                          ("induction", True),
                                          ("addsub", True)])
def test_every_toy_is_a_target_naming_the_decoder_its_tokens_feed(name,
                                                                  decoder):
  toy = registry.get(name)
  assert isinstance(toy, record.Target) and toy.name == name
  if decoder:
    assert toy.token_model is toy.config.model
  else:
    assert toy.token_model is None
  batch = toy.sample_inputs(jax.random.key(0), 3)
  assert batch.shape[0] == 3


def test_the_record_is_frozen_and_keyword_only():
  target = record.Target(name="t", sample_inputs=lambda key, b: key)
  with pytest.raises(dataclasses.FrozenInstanceError):
    target.name = "u"
  with pytest.raises(TypeError):
    record.Target("t", lambda key, b: key)
