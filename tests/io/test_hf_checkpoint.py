"""Reading Hugging Face checkpoints without torch (io.hf_checkpoint)."""

import json
import pathlib
import shutil
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


def test_layers_of_different_shapes_are_named_not_stacked(tmp_path):
  layers = {f"model.layers.{i}.input_layernorm.weight":
            np.ones((4 + i,), np.float32) for i in range(2)}
  save_file({"model.embed_tokens.weight": np.zeros((4, 2), np.float32),
             "model.norm.weight": np.ones((2,), np.float32), **layers},
            str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=(
      r"tensor model.layers.1.input_layernorm.weight in .*model.safetensors "
      r"has shape \(5,\), but model.layers.0.input_layernorm.weight has "
      r"\(4,\)")):
    hf_checkpoint.load_decoder_arrays(str(tmp_path), 2, False, True)


@pytest.mark.parametrize("text, message", [
  ('{"model_type": ', "config.json is not valid JSON"),
  ("[1]", "config.json holds a JSON list"),
])
def test_a_config_that_is_not_a_json_object_names_its_file(tmp_path, text,
                                                          message):
  (tmp_path / "config.json").write_text(text)
  with pytest.raises(ValueError, match=message):
    hf_checkpoint.read_config(str(tmp_path))


def test_a_check_of_the_raw_config_names_the_file(tmp_path):
  (tmp_path / "config.json").write_text('{"hidden_size": "64"}')

  def check(raw):
    raise ValueError(f"key 'hidden_size' got {raw['hidden_size']!r}")

  with pytest.raises(ValueError, match=r"config.json: key 'hidden_size'"):
    hf_checkpoint.read_config(str(tmp_path), check)


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


# A damaged checkpoint is refused on one line that names the file and the
# fix; each test damages a copy of a fixture.


def _copy(tmp_path, name):
  out = tmp_path / name
  shutil.copytree(FIXTURES / name, out)
  return out


def _load_error(model_dir, n_layers=3, qk_norm=False) -> str:
  with pytest.raises(ValueError) as info:
    hf_checkpoint.load_decoder_arrays(str(model_dir), n_layers, qk_norm, True)
  message = str(info.value)
  assert "\n" not in message
  return message


def test_a_file_shorter_than_its_header_length_is_named(tmp_path):
  model = _copy(tmp_path, "tiny_llama")
  path = model / "model.safetensors"
  path.write_bytes(path.read_bytes()[:4])
  assert _load_error(model) == (
    f"{path} is not a safetensors file: 4 bytes, less than its 8-byte "
    "header length; download or copy it again")


def test_a_half_truncated_file_is_named(tmp_path):
  model = _copy(tmp_path, "tiny_llama")
  path = model / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  assert _load_error(model) == (
    f"{path} is truncated: {len(data) // 2} bytes of the {len(data)} its "
    "header describes; download or copy it again")


def test_a_file_cut_inside_its_header_is_named(tmp_path):
  model = _copy(tmp_path, "tiny_llama")
  path = model / "model.safetensors"
  path.write_bytes(path.read_bytes()[:20])
  assert _load_error(model).startswith(f"{path} is truncated: 20 bytes, but "
                                       "its header alone takes ")


def test_a_header_that_is_not_json_is_named(tmp_path):
  path = tmp_path / "model.safetensors"
  path.write_bytes(struct.pack("<Q", 4) + b"\xff{}x")
  with pytest.raises(ValueError, match="its header is not a JSON object"):
    hf_checkpoint.tensor_files(str(tmp_path))


def test_a_missing_shard_is_named_with_its_index(tmp_path):
  model = _copy(tmp_path, "tiny_qwen3")
  (model / "model-00002-of-00002.safetensors").unlink()
  index = model / "model.safetensors.index.json"
  assert _load_error(model, qk_norm=True) == (
    f"{index} names model-00002-of-00002.safetensors, which is not in "
    f"{model}; download or copy the missing shard")


def test_an_unreadable_index_is_named(tmp_path):
  model = _copy(tmp_path, "tiny_qwen3")
  index = model / "model.safetensors.index.json"
  index.write_text(index.read_text()[:100])
  message = _load_error(model, qk_norm=True)
  assert message.startswith(f"cannot read {index}: ")
  assert message.endswith("; download or copy it again")
