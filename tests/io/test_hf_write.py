"""Writing Hugging Face checkpoints: safetensors files, a Llama directory
read back through `--target=hf`, and a word-level tokenizer."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from decompax.io import hf_checkpoint
from decompax.recipe import flagfiles, lm
from decompax.targets import arithmetic, glu_config, glu_lm, glu_weights

CONFIG = arithmetic.ArithmeticConfig()


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16,
                                   np.float16, np.float64])
def test_safetensors_round_trip(tmp_path, dtype):
  rng = np.random.default_rng(0)
  arrays = {"b": rng.normal(size=(3, 5)).astype(dtype),
            "a": rng.normal(size=(7,)).astype(dtype),
            "scalar": np.asarray(1.5, dtype)}
  path = str(tmp_path / "t.safetensors")
  assert hf_checkpoint.write_safetensors(path, arrays) == path
  header = hf_checkpoint.read_header(path)
  assert set(header) == set(arrays)
  for name, array in arrays.items():
    assert header[name]["data_offsets"][0] % 8 == 0
    got = hf_checkpoint.read_tensor(path, name)
    assert got.dtype == array.dtype and got.shape == array.shape
    assert got.tobytes() == array.tobytes()
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    assert json.loads(f.read(n))["__metadata__"] == {"format": "pt"}
  assert os.listdir(tmp_path) == ["t.safetensors"]


def test_safetensors_refuses_an_unsupported_dtype(tmp_path):
  with pytest.raises(ValueError, match="int32"):
    hf_checkpoint.write_safetensors(str(tmp_path / "t.safetensors"),
                                    {"x": np.zeros(3, np.int32)})
  assert not os.listdir(tmp_path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """An untrained arithmetic model, its arrays and its Llama directory."""
  weights = arithmetic.init(jax.random.key(0), CONFIG)
  arrays = arithmetic.weights_to_arrays(weights)
  path = str(tmp_path_factory.mktemp("addsub"))
  hf_checkpoint.write_llama_checkpoint(path, arrays, CONFIG.model,
                                       {"eos_token_id": 27})
  return weights, arrays, path


def test_llama_directory_reads_back_exactly(exported):
  _, arrays, path = exported
  hf = hf_checkpoint.read_config(path)
  assert hf["eos_token_id"] == 27
  assert glu_config.config_from_hf(hf) == dataclasses.replace(
    CONFIG.model, family="llama")
  m = CONFIG.model
  read = hf_checkpoint.load_decoder_arrays(path, m.n_layers, m.qk_norm,
                                           m.tied)
  assert set(read) == set(arrays)
  for name, array in arrays.items():
    np.testing.assert_array_equal(read[name], array, err_msg=name)


def test_hf_target_gives_the_toy_logits(exported):
  weights, _, path = exported
  run = flagfiles.read_args(["--target=hf", f"--model_dir={path}",
                              "--compute_dtype=float32", "--seq_len=5"])
  record, fns, load = lm.hf_target(run)
  assert record.token_model.vocab_size == CONFIG.model.vocab_size
  tokens = arithmetic.task_batch(jax.random.key(1), CONFIG, 8)
  n = CONFIG.model.n_layers
  spec = glu_lm.ForwardSpec(CONFIG.model, glu_weights.Segments(n, 0, n))

  @jax.jit
  def logits(hf_weights, toy_weights):
    return (fns.clean_forward(hf_weights, tokens, ())[0],
            glu_lm.forward(toy_weights, tokens, (), spec)[0])

  got, want = logits(load(), weights)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_llama_config_refuses_qk_norm():
  qwen = dataclasses.replace(CONFIG.model, qk_norm=True)
  with pytest.raises(ValueError, match="QK-norm"):
    hf_checkpoint.llama_config(qwen)


def test_llama_tensors_refuse_foreign_arrays(exported):
  _, arrays, _ = exported
  with pytest.raises(ValueError, match="not a Llama"):
    hf_checkpoint.llama_tensors({**arrays, "q_norm": arrays["ln1"]}, 2,
                                False)


def test_word_tokenizer_encodes_the_task_layout(tmp_path):
  tokens = arithmetic.token_strings(CONFIG)
  hf_checkpoint.write_word_tokenizer(str(tmp_path), tokens, "<unk>", "<eos>")
  tokenizer = hf_checkpoint.read_tokenizer(str(tmp_path))
  assert len(tokenizer) == CONFIG.model.vocab_size
  p = CONFIG.modulus
  ids = tokenizer("3 + 4 =", add_special_tokens=False)["input_ids"]
  assert ids == [3, arithmetic.operator_token(CONFIG, 0), 4,
                 arithmetic.equals_token(CONFIG)]
  assert tokenizer("22 - 0 = 22")["input_ids"] == [22, p + 1, 0, p + 2, 22]
  assert tokenizer.decode(ids) == "3 + 4 ="
  assert tokenizer.eos_token_id == tokens.index("<eos>")
  assert tokenizer("7 ^")["input_ids"] == [7, tokens.index("<unk>")]


def test_word_tokenizer_refuses_bad_tokens(tmp_path):
  with pytest.raises(ValueError, match="distinct"):
    hf_checkpoint.write_word_tokenizer(str(tmp_path), ["a", "a"])
  with pytest.raises(ValueError, match="whitespace"):
    hf_checkpoint.write_word_tokenizer(str(tmp_path), ["a", "b c"])
  with pytest.raises(ValueError, match="EOS"):
    hf_checkpoint.write_word_tokenizer(str(tmp_path), ["a", "b"],
                                       eos_token="</s>")
