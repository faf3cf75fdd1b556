"""Read a local Hugging Face decoder checkpoint without torch.

The config comes from `transformers.AutoConfig` (local files only) as a
plain dict; weights from `model.safetensors` or the shards named by
`model.safetensors.index.json`. numpy has no bfloat16, so tensors are
memory-mapped straight from the safetensors layout (8-byte little-endian
header length, JSON header, raw data) with `ml_dtypes` dtypes; only the
requested tensors are read.

Arrays come back in the stacked layout of decompax's GLU target: per-layer
matrices `[n_layers, d_in, d_out]` (HF stores `Linear` weights `[d_out,
d_in]`, transposed here), norms `[n_layers, d]`, and `embed`, `norm`,
`head` (untied models only) as stored.
"""

import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F64": np.float64}
_MATRICES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def read_config(model_dir: str) -> dict[str, Any]:
  """Return the checkpoint's config as a dict (transformers' AutoConfig).

  Raises:
    ValueError: no directory or config.json there, or a config transformers
      cannot read.
  """
  if not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise ValueError(f"--model_dir {model_dir!r} holds no config.json; point "
                     "it at a local Hugging Face checkpoint directory")
  transformers = _import_transformers()
  try:
    config = transformers.AutoConfig.from_pretrained(
      model_dir, local_files_only=True)
  except (ValueError, KeyError, OSError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    raise ValueError(f"cannot read {model_dir}/config.json: {first}") from None
  return config.to_dict()


def _import_transformers():
  # transformers advises at import that torch is absent; only its config and
  # tokenizer classes are used here. Imported late: it is heavy.
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  import transformers  # noqa: PLC0415

  transformers.logging.set_verbosity_error()
  return transformers


def read_tokenizer(model_dir: str):
  """Return the checkpoint's tokenizer (transformers, local files only)."""
  transformers = _import_transformers()

  try:
    return transformers.AutoTokenizer.from_pretrained(
      model_dir, local_files_only=True)
  except (ValueError, OSError) as e:
    raise ValueError(f"cannot read a tokenizer from {model_dir}: "
                     f"{str(e).splitlines()[0]}") from None


def tensor_files(model_dir: str) -> dict[str, str]:
  """Return tensor name -> safetensors file path for the checkpoint."""
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(model_dir, file)
            for name, file in weight_map.items()}
  single = os.path.join(model_dir, "model.safetensors")
  if not os.path.isfile(single):
    raise ValueError(f"{model_dir} holds neither model.safetensors nor "
                     "model.safetensors.index.json")
  return {name: single for name in read_header(single)}


def read_header(path: str) -> dict[str, dict[str, Any]]:
  """Return a safetensors file's tensor entries (dtype, shape, offsets)."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header


def read_tensor(path: str, name: str) -> np.ndarray:
  """Return one tensor of a safetensors file, memory-mapped read-only."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
  if name not in header:
    raise ValueError(f"{path} holds no tensor {name!r}")
  entry = header[name]
  if entry["dtype"] not in _DTYPES:
    raise ValueError(f"tensor {name} in {path} has dtype {entry['dtype']}; "
                     f"supported: {sorted(_DTYPES)}")
  start, end = entry["data_offsets"]
  dtype = np.dtype(_DTYPES[entry["dtype"]])
  shape = tuple(entry["shape"])
  if end - start != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
    raise ValueError(f"tensor {name} in {path}: byte range does not match "
                     f"shape {shape} {entry['dtype']}")
  return np.memmap(path, dtype=dtype, mode="r", offset=8 + n + start,
                   shape=shape)


def load_decoder_arrays(
  model_dir: str, n_layers: int, qk_norm: bool, tied: bool,
  dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
  """Return the decoder's weights stacked per kind, cast to `dtype`.

  Raises:
    ValueError: a tensor is missing or unreadable.
  """
  files = tensor_files(model_dir)

  def get(name):
    if name not in files:
      raise ValueError(f"checkpoint {model_dir} lacks tensor {name!r}")
    return read_tensor(files[name], name)

  out = {"embed": np.asarray(get("model.embed_tokens.weight"), dtype),
         "norm": np.asarray(get("model.norm.weight"), dtype)}
  if not tied:
    out["head"] = np.asarray(get("lm_head.weight"), dtype)
  norms = dict(_NORMS) if qk_norm else {k: _NORMS[k] for k in ("ln1", "ln2")}
  for key, hf in norms.items():
    out[key] = np.stack([np.asarray(get(f"model.layers.{i}.{hf}.weight"),
                                    dtype) for i in range(n_layers)])
  for key, hf in _MATRICES.items():
    out[key] = np.stack([np.asarray(get(f"model.layers.{i}.{hf}.weight"),
                                    dtype).T for i in range(n_layers)])
  return out
