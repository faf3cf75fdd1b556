"""Reading Hugging Face checkpoints without torch (io.hf_checkpoint)."""

import json
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from decompax.io import hf_checkpoint

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


def test_bf16_shards_read_through_the_index():
  model_dir = str(FIXTURES / "tiny_qwen3")
  files = hf_checkpoint.tensor_files(model_dir)
  assert len(set(files.values())) == 2
  name = "model.layers.0.self_attn.q_proj.weight"
  w = hf_checkpoint.read_tensor(files[name], name)
  assert w.dtype == ml_dtypes.bfloat16 and w.shape == (128, 64)
  arrays = hf_checkpoint.load_decoder_arrays(model_dir, 3, True, True)
  # HF stores Linear weights [d_out, d_in]; the stacks are y = x @ W.
  np.testing.assert_array_equal(arrays["q"][0], np.asarray(w, np.float32).T)
  assert arrays["q"].dtype == np.float32 and arrays["q"].shape == (3, 64, 128)
  assert arrays["q_norm"].shape == (3, 32) and "head" not in arrays
  assert arrays["down"].shape == (3, 96, 64)


def test_single_file_and_dtype_choice(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {"a": rng.standard_normal((3, 2)).astype(np.float32),
             "b": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16)}
  save_file(tensors, str(tmp_path / "model.safetensors"))
  files = hf_checkpoint.tensor_files(str(tmp_path))
  assert sorted(files) == ["a", "b"]
  for name, value in tensors.items():
    got = hf_checkpoint.read_tensor(files[name], name)
    assert got.dtype == value.dtype
    np.testing.assert_array_equal(got, value)


def test_missing_pieces_fail_with_one_line(tmp_path):
  with pytest.raises(ValueError, match="holds no config.json"):
    hf_checkpoint.read_config(str(tmp_path))
  with pytest.raises(ValueError, match="neither model.safetensors"):
    hf_checkpoint.tensor_files(str(tmp_path))
  save_file({"model.embed_tokens.weight": np.zeros((4, 2), np.float32)},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="lacks tensor 'model.norm.weight'"):
    hf_checkpoint.load_decoder_arrays(str(tmp_path), 1, False, True)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "nope"}))
  with pytest.raises(ValueError, match="cannot read") as info:
    hf_checkpoint.read_config(str(tmp_path))
  assert "\n" not in str(info.value)


def test_unsupported_tensor_dtype_is_refused(tmp_path):
  path = tmp_path / "x.safetensors"
  header = json.dumps({"x": {"dtype": "I8", "shape": [2],
                             "data_offsets": [0, 2]}}).encode()
  path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
  with pytest.raises(ValueError, match="dtype I8"):
    hf_checkpoint.read_tensor(str(path), "x")


def test_read_config_gives_the_plain_dict():
  hf = hf_checkpoint.read_config(str(FIXTURES / "tiny_llama"))
  assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == 3
  assert hf["rope_parameters"]["rope_type"] == "llama3"
