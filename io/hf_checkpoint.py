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
    raise ValueError(f"{model_dir!r} holds no config.json; name a local "
                     "Hugging Face checkpoint directory")
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


# Files a Hugging Face tokenizer directory holds at least one of.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
_TOKENIZER_FIX = ("; point it at a local Hugging Face tokenizer or model"
                  " directory holding tokenizer.json (or tokenizer_config.json"
                  " and its vocabulary files)")


def has_tokenizer(model_dir: str) -> bool:
  """Return whether `model_dir` holds any tokenizer file."""
  return any(os.path.isfile(os.path.join(model_dir, name))
             for name in TOKENIZER_FILES)


def read_tokenizer(model_dir: str):
  """Return the checkpoint's tokenizer (transformers, local files only).

  Raises:
    ValueError: no tokenizer files in `model_dir`, files transformers cannot
      load, or a tokenizer of fewer than two entries (what a bare model
      config loads as: it turns any text into nothing).
  """
  where = f"cannot read a tokenizer from {model_dir}"
  if not has_tokenizer(model_dir):
    raise ValueError(f"{where}: it holds no tokenizer.json,"
                     " tokenizer_config.json or other tokenizer file"
                     f"{_TOKENIZER_FIX}")
  transformers = _import_transformers()
  try:
    tokenizer = transformers.AutoTokenizer.from_pretrained(
      model_dir, local_files_only=True)
  # Malformed files surface as whatever the parser of each format raises
  # (KeyError for a tokenizer.json lacking a section); all are the
  # directory's fault and get the one-line error.
  except Exception as e:  # noqa: BLE001
    why = " ".join(str(e).split())
    raise ValueError(f"{where} ({type(e).__name__}: {why}){_TOKENIZER_FIX}"
                     ) from None
  if len(tokenizer) < 2:
    raise ValueError(f"{where}: its vocabulary size is {len(tokenizer)},"
                     f" too small to tell tokens apart{_TOKENIZER_FIX}")
  return tokenizer


_REFETCH = "download or copy it again"


def _weight_map(index: str) -> dict[str, str]:
  try:
    with open(index, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
    return {str(name): str(file) for name, file in weight_map.items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    reason = " ".join(str(e).split()) or type(e).__name__
    raise ValueError(f"cannot read {index}: {reason}; {_REFETCH}") from None


def tensor_files(model_dir: str) -> dict[str, str]:
  """Return tensor name -> safetensors file path for the checkpoint.

  Raises:
    ValueError: no weights, an unreadable index, or a shard the index names
      missing from `model_dir`.
  """
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.isfile(index):
    files = {name: os.path.join(model_dir, file)
             for name, file in _weight_map(index).items()}
    for path in sorted(set(files.values())):
      if not os.path.isfile(path):
        raise ValueError(
          f"{index} names {os.path.relpath(path, model_dir)}, which is not "
          f"in {model_dir}; download or copy the missing shard")
    return files
  single = os.path.join(model_dir, "model.safetensors")
  if not os.path.isfile(single):
    raise ValueError(f"{model_dir} holds neither model.safetensors nor "
                     "model.safetensors.index.json")
  return {name: single for name in read_header(single)}


def _data_end(path: str, header: dict[str, Any]) -> int:
  """Return the end of the data the header's entries describe."""
  try:
    return max((int(e["data_offsets"][1]) for e in header.values()),
               default=0)
  except (TypeError, KeyError, IndexError, ValueError):
    raise ValueError(f"{path} has a malformed safetensors header (an entry "
                     f"without data_offsets); {_REFETCH}") from None


def _read_header(path: str) -> tuple[int, dict[str, Any]]:
  """Return a safetensors file's header length and tensor entries.

  Raises a one-line ValueError naming `path` when it is unreadable, not
  safetensors, or shorter than its header says (a truncated copy).
  """
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      prefix = f.read(8)
      n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
      raw = f.read(n) if n is not None and 8 + n <= size else b""
  except OSError as e:
    raise ValueError(f"cannot read {path}: {e.strerror}; {_REFETCH}") from None
  if n is None:
    raise ValueError(f"{path} is not a safetensors file: {size} bytes, less "
                     f"than its 8-byte header length; {_REFETCH}")
  if 8 + n > size:
    raise ValueError(f"{path} is truncated: {size} bytes, but its header "
                     f"alone takes {8 + n}; {_REFETCH}")
  try:
    header = json.loads(raw)
  except ValueError:  # also UnicodeDecodeError
    header = None
  if not isinstance(header, dict):
    raise ValueError(f"{path} is not a safetensors file: its header is not "
                     f"a JSON object; {_REFETCH}")
  header.pop("__metadata__", None)
  need = 8 + n + _data_end(path, header)
  if need > size:
    raise ValueError(f"{path} is truncated: {size} bytes of the {need} its "
                     f"header describes; {_REFETCH}")
  return n, header


def read_header(path: str) -> dict[str, dict[str, Any]]:
  """Return a safetensors file's tensor entries (dtype, shape, offsets).

  Raises:
    ValueError: naming `path`, when it is short, truncated or no
      safetensors file.
  """
  return _read_header(path)[1]


def read_tensor(path: str, name: str) -> np.ndarray:
  """Return one tensor of a safetensors file, memory-mapped read-only."""
  n, header = _read_header(path)
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
