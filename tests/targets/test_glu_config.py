"""The raw `config.json` check of `targets.glu_config` (`check_fields`)."""

import json
import pathlib

import pytest

from decompax.targets import glu_config

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
CONFIGS = sorted([FIXTURES / "tiny_llama", FIXTURES / "tiny_qwen3",
                  FIXTURES / "tiny_gpt2", FIXTURES / "tiny_pythia",
                  *(FIXTURES / "hf_configs").iterdir()])


def _raw(directory: pathlib.Path) -> dict:
  return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("directory", CONFIGS, ids=lambda p: p.name)
def test_every_fixture_config_passes(directory):
  glu_config.check_fields(_raw(directory))


@pytest.mark.parametrize("changes, message", [
  ({"hidden_size": "64"}, "key 'hidden_size' must be a positive integer, "
   "got '64' (str)"),
  ({"num_hidden_layers": 2.0}, "'num_hidden_layers' must be a positive "
   "integer, got 2.0 (float)"),
  ({"vocab_size": True}, "'vocab_size' must be a positive integer"),
  ({"intermediate_size": 0}, "'intermediate_size' must be a positive"),
  ({"head_dim": -16}, "'head_dim' must be a positive integer"),
  ({"num_attention_heads": 3, "head_dim": None},
   "3 heads do not divide hidden_size 64"),
  ({"num_key_value_heads": 3}, "3 key/value heads do not divide "
   "num_attention_heads 4"),
])
def test_a_bad_size_is_named_by_its_key(changes, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(
      ")", r"\)")):
    glu_config.check_fields(_raw(FIXTURES / "tiny_llama") | changes)


def test_a_missing_size_is_named():
  raw = _raw(FIXTURES / "tiny_llama")
  del raw["vocab_size"]
  with pytest.raises(ValueError, match="key 'vocab_size' is missing"):
    glu_config.check_fields(raw)


def test_heads_need_not_divide_the_width_given_a_head_dim():
  # Qwen3 sets head_dim on its own; only the forward's shapes must agree.
  glu_config.check_fields(_raw(FIXTURES / "tiny_llama")
                          | {"num_attention_heads": 3, "head_dim": 16,
                             "num_key_value_heads": 1})


@pytest.mark.parametrize("changes, message", [
  ({"n_embd": "64"}, "key 'n_embd' must be a positive integer"),
  ({"n_inner": 0}, "key 'n_inner' must be a positive integer"),
  ({"n_head": 3}, "key 'n_head': 3 heads do not divide n_embd 64"),
])
def test_gpt2_sizes_are_named_by_gpt2_keys(changes, message):
  raw = _raw(FIXTURES / "tiny_gpt2")
  glu_config.check_fields(raw | {"n_inner": None})  # 4·n_embd by default
  with pytest.raises(ValueError, match=message):
    glu_config.check_fields(raw | changes)
  del raw["n_layer"]
  with pytest.raises(ValueError, match="key 'n_layer' is missing"):
    glu_config.check_fields(raw)
