"""Read and write local Hugging Face decoder checkpoints without torch.

The config comes from `transformers.AutoConfig` (local files only) as a
plain dict; weights from `model.safetensors` or the shards named by
`model.safetensors.index.json`. numpy has no bfloat16, so tensors are
memory-mapped straight from the safetensors layout (8-byte little-endian
header length, JSON header, raw data) with `ml_dtypes` dtypes; only the
requested tensors are read.

Arrays come back in the stacked layout of decompax's GLU target: per-layer
matrices `[n_layers, d_in, d_out]` (HF stores `Linear` weights `[d_out,
d_in]`, transposed here; GPT-2's Conv1D `[d_in, d_out]` as stored; fused
q/k/v split), norms and biases `[n_layers, d]`, and `embed`, `norm`,
`head` (untied models only), `pos` and `norm_bias` (where the family has
them) as stored; Gemma's sandwich norms as `post_attn_norm` and
`post_mlp_norm`; Qwen3-MoE's router and experts as `router` and
`expert_{gate,up,down}` `[n_layers, n_experts, d_in, d_out]`.

The writers invert that read for models trained here: `write_safetensors`
writes the same file layout, `write_llama_checkpoint` a Llama directory
from the stacked arrays, `write_word_tokenizer` a whitespace-split
word-level tokenizer. Each file is replaced atomically.
"""

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, Optional

import ml_dtypes
import numpy as np

from decompax.io import run_dir

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F64": np.float64}
_MATRICES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj",
             "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def read_config(model_dir: str,
                check: Optional[Callable[[dict[str, Any]], None]] = None
                ) -> dict[str, Any]:
  """Return the checkpoint's config as a dict (transformers' AutoConfig).

  `check(raw)` sees the file's own JSON object first; its ValueError comes
  back naming the file.

  Raises:
    ValueError: no directory or config.json there, a file that is not a
      JSON object, one `check` refuses, or a config transformers cannot
      read; each on one line naming the file.
  """
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{model_dir!r} holds no config.json; name a local "
                     "Hugging Face checkpoint directory")
  try:
    with open(path, encoding="utf-8") as f:
      raw = json.load(f)
  except OSError as e:
    raise ValueError(f"cannot read {path}: {e.strerror}") from None
  except ValueError as e:  # also UnicodeDecodeError
    raise ValueError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(raw, dict):
    raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not the "
                     "object of a model config")
  if check is not None:
    try:
      check(raw)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None
  transformers = _import_transformers()
  try:
    config = transformers.AutoConfig.from_pretrained(
      model_dir, local_files_only=True)
  # Its validators raise their own error classes (huggingface_hub's strict
  # dataclasses among them); any of them is the file's fault.
  except Exception as e:  # noqa: BLE001
    why = " ".join(str(e).split()) or type(e).__name__
    raise ValueError(f"cannot read {path}: {why}") from None
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


class _Tensors:
  """The tensors of one checkpoint directory, read by name."""

  def __init__(self, model_dir: str, dtype: Any):
    self.model_dir, self.dtype = model_dir, dtype
    self.files = tensor_files(model_dir)

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise ValueError(f"checkpoint {self.model_dir} lacks tensor {name!r}")
    return read_tensor(self.files[name], name)

  def array(self, name: str) -> np.ndarray:
    return np.asarray(self.get(name), self.dtype)

  def stack(self, names: Sequence[str],
            per_layer: Callable[[np.ndarray], np.ndarray] = lambda a: a
            ) -> np.ndarray:
    """Return the named per-layer tensors, each through `per_layer`,
    stacked on a new leading axis; ValueError unless their shapes agree."""
    layers = [self.get(name) for name in names]
    for name, layer in zip(names[1:], layers[1:]):
      if layer.shape != layers[0].shape:
        raise ValueError(
          f"tensor {name} in {self.files[name]} has shape {layer.shape}, but "
          f"{names[0]} has {layers[0].shape}; every layer's must match "
          f"({_REFETCH})")
    return np.stack([per_layer(np.asarray(layer, self.dtype))
                     for layer in layers])


_GEMMA_NORMS = {"ln1": "input_layernorm",
                "post_attn_norm": "post_attention_layernorm",
                "ln2": "pre_feedforward_layernorm",
                "post_mlp_norm": "post_feedforward_layernorm"}


def load_decoder_arrays(
  model_dir: str, n_layers: int, qk_norm: bool, tied: bool,
  dtype: Any = np.float32, sandwich: bool = False,
) -> dict[str, np.ndarray]:
  """Return a Llama, Qwen3 or Gemma decoder's weights stacked per kind,
  cast to `dtype`.

  The three share their names and layout but for the norms: `sandwich`
  reads Gemma's four a block, mapped to `ln1` (input_layernorm),
  `post_attn_norm` (post_attention_layernorm, on the attention output),
  `ln2` (pre_feedforward_layernorm) and `post_mlp_norm`
  (post_feedforward_layernorm), each stored as the offset `w` of
  `x·(1 + w)` (design §9.4).

  Raises:
    ValueError: a tensor is missing or unreadable.
  """
  ts = _Tensors(model_dir, dtype)

  def stack(hf, transpose=False):
    return ts.stack([f"model.layers.{i}.{hf}.weight" for i in range(n_layers)],
                    np.transpose if transpose else (lambda a: a))

  out = {"embed": ts.array("model.embed_tokens.weight"),
         "norm": ts.array("model.norm.weight")}
  if not tied:
    out["head"] = ts.array("lm_head.weight")
  norms = dict(_GEMMA_NORMS if sandwich
               else {k: _NORMS[k] for k in ("ln1", "ln2")})
  if qk_norm:
    norms.update(q_norm=_NORMS["q_norm"], k_norm=_NORMS["k_norm"])
  for key, hf in norms.items():
    out[key] = stack(hf)
  for key, hf in _MATRICES.items():
    out[key] = stack(hf, transpose=True)
  return out


def load_qwen3_moe_arrays(
  model_dir: str, n_layers: int, n_experts: int, tied: bool,
  dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
  """Return a Qwen3MoeForCausalLM's weights in the stacked `x @ W` layout:
  attention, norms and QK-norm as dense Qwen3's, and for each layer's
  sparse block the router `mlp.gate` as `router [layer, d, experts]` and
  the experts as `expert_{gate,up,down} [layer, expert, d_in, d_out]`.

  Experts are read as released checkpoints store them, one `nn.Linear`
  each (`mlp.experts.<e>.{gate,up,down}_proj.weight`, `[out, in]`), or as
  transformers 5 fuses them (`mlp.experts.gate_up_proj [expert, 2·f, d]`,
  gate rows first, and `mlp.experts.down_proj [expert, d, f]`).

  Raises:
    ValueError: a tensor is missing or unreadable.
  """
  ts = _Tensors(model_dir, dtype)

  def stack(hf, per_layer=lambda a: a):
    return ts.stack([f"model.layers.{i}.{hf}" for i in range(n_layers)],
                    per_layer)

  out = {"embed": ts.array("model.embed_tokens.weight"),
         "norm": ts.array("model.norm.weight")}
  if not tied:
    out["head"] = ts.array("lm_head.weight")
  for key, hf in _NORMS.items():
    out[key] = stack(f"{hf}.weight")
  for key in ("q", "k", "v", "o"):
    out[key] = stack(f"{_MATRICES[key]}.weight", np.transpose)
  out["router"] = stack("mlp.gate.weight", np.transpose)
  swap = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
  if "model.layers.0.mlp.experts.gate_up_proj" in ts.files:
    fused = stack("mlp.experts.gate_up_proj", swap)
    width = fused.shape[-1] // 2
    out["expert_gate"] = fused[..., :width]
    out["expert_up"] = fused[..., width:]
    out["expert_down"] = stack("mlp.experts.down_proj", swap)
    return out
  for role in ("gate", "up", "down"):
    out[f"expert_{role}"] = np.stack([
      ts.stack([f"model.layers.{i}.mlp.experts.{e}.{role}_proj.weight"
                for e in range(n_experts)], np.transpose)
      for i in range(n_layers)])
  return out


def _columns(part: int, n: int) -> Callable[[np.ndarray], np.ndarray]:
  """Return the function taking part `part` of `n` equal column blocks."""
  def take(a: np.ndarray) -> np.ndarray:
    width = a.shape[-1] // n
    return a[..., part * width:(part + 1) * width]
  return take


def load_gpt2_arrays(
  model_dir: str, n_layers: int, tied: bool, dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
  """Return a GPT2LMHeadModel's weights in the stacked `x @ W` layout.

  Conv1D stores `[in, out]`, already that orientation; the fused
  `attn.c_attn` `[d, 3d]` (and its bias) splits by columns into q, k, v
  (design §9.4). Tensor names with or without the `transformer.` prefix.
  """
  ts = _Tensors(model_dir, dtype)
  pre = "transformer." if "transformer.wte.weight" in ts.files else ""

  def stack(hf, per_layer=lambda a: a):
    return ts.stack([f"{pre}h.{i}.{hf}" for i in range(n_layers)], per_layer)

  out = {"embed": ts.array(f"{pre}wte.weight"),
         "pos": ts.array(f"{pre}wpe.weight"),
         "norm": ts.array(f"{pre}ln_f.weight"),
         "norm_bias": ts.array(f"{pre}ln_f.bias")}
  if not tied:
    out["head"] = ts.array("lm_head.weight")
  for key, hf in (("ln1", "ln_1"), ("ln2", "ln_2")):
    out[key] = stack(f"{hf}.weight")
    out[f"{key}_bias"] = stack(f"{hf}.bias")
  for part, role in enumerate("qkv"):
    out[role] = stack("attn.c_attn.weight", _columns(part, 3))
    out[f"{role}_bias"] = stack("attn.c_attn.bias", _columns(part, 3))
  for role, hf in (("o", "attn.c_proj"), ("up", "mlp.c_fc"),
                   ("down", "mlp.c_proj")):
    out[role] = stack(f"{hf}.weight")
    out[f"{role}_bias"] = stack(f"{hf}.bias")
  return out


def _neox_part(part: int, n_heads: int) -> Callable[[np.ndarray], np.ndarray]:
  """Return the function taking q (0), k (1) or v (2) out of a fused
  `query_key_value` weight `[nh·3·hd, d]` or bias `[nh·3·hd]`, whose output
  axis is `[nh, 3, hd]`; a weight comes back as `x @ W`'s `[d, nh·hd]`."""
  def take(a: np.ndarray) -> np.ndarray:
    heads = a.reshape(n_heads, 3, -1, *a.shape[1:])[:, part]
    return heads.reshape(-1, *a.shape[1:]).T
  return take


def load_neox_arrays(
  model_dir: str, n_layers: int, n_heads: int, tied: bool,
  dtype: Any = np.float32,
) -> dict[str, np.ndarray]:
  """Return a GPTNeoXForCausalLM's (Pythia's) weights in the stacked
  `x @ W` layout: `nn.Linear` weights transposed, the fused
  `attention.query_key_value` split per head into q, k, v (design §9.4),
  the untied head read from `embed_out` (or `lm_head`)."""
  ts = _Tensors(model_dir, dtype)

  def stack(hf, per_layer=lambda a: a):
    return ts.stack([f"gpt_neox.layers.{i}.{hf}" for i in range(n_layers)],
                    per_layer)

  out = {"embed": ts.array("gpt_neox.embed_in.weight"),
         "norm": ts.array("gpt_neox.final_layer_norm.weight"),
         "norm_bias": ts.array("gpt_neox.final_layer_norm.bias")}
  if not tied:
    head = "lm_head.weight" if "lm_head.weight" in ts.files else (
      "embed_out.weight")
    out["head"] = ts.array(head)
  for key, hf in (("ln1", "input_layernorm"),
                  ("ln2", "post_attention_layernorm")):
    out[key] = stack(f"{hf}.weight")
    out[f"{key}_bias"] = stack(f"{hf}.bias")
  for part, role in enumerate("qkv"):
    out[role] = stack("attention.query_key_value.weight",
                      _neox_part(part, n_heads))
    out[f"{role}_bias"] = stack("attention.query_key_value.bias",
                                _neox_part(part, n_heads))
  for role, hf in (("o", "attention.dense"), ("up", "mlp.dense_h_to_4h"),
                   ("down", "mlp.dense_4h_to_h")):
    out[role] = stack(f"{hf}.weight", np.transpose)
    out[f"{role}_bias"] = stack(f"{hf}.bias")
  return out


def load_model_arrays(glu: Any, model_dir: str,
                      dtype: Any = np.float32) -> dict[str, np.ndarray]:
  """Return the stacked weights of a checkpoint of `glu`'s family (a
  `targets.glu_config.GluConfig`, read by attribute).

  Raises:
    ValueError: a tensor is missing or unreadable, or a family with no
      checkpoint layout.
  """
  if glu.family in ("llama", "qwen3", "gemma2", "gemma3_text"):
    return load_decoder_arrays(model_dir, glu.n_layers, glu.qk_norm,
                               glu.tied, dtype, glu.sandwich)
  if glu.family == "gpt2":
    return load_gpt2_arrays(model_dir, glu.n_layers, glu.tied, dtype)
  if glu.family == "gpt_neox":
    return load_neox_arrays(model_dir, glu.n_layers, glu.n_heads, glu.tied,
                            dtype)
  if glu.family == "qwen3_moe":
    return load_qwen3_moe_arrays(model_dir, glu.n_layers, glu.n_experts,
                                 glu.tied, dtype)
  raise ValueError(f"no checkpoint layout for model family {glu.family!r}; "
                   "supported: llama, qwen3, gpt2, gpt_neox, gemma2, "
                   "gemma3_text, qwen3_moe")


# Safetensors data offsets need no alignment, but readers that map tensors
# in place (numpy, torch) want each one aligned; 8 bytes covers F64.
_ALIGN = 8


def _dtype_name(array: np.ndarray, name: str) -> str:
  for key, dtype in _DTYPES.items():
    if array.dtype == np.dtype(dtype):
      return key
  raise ValueError(f"tensor {name} has dtype {array.dtype}; writable: "
                   f"{sorted(_DTYPES)}")


def _little_endian_bytes(array: np.ndarray) -> bytes:
  # Through unsigned integers of the same width: bfloat16 has no byte-order
  # variant of its own.
  width = array.dtype.itemsize
  raw = np.ascontiguousarray(array).view(f"u{width}")
  return raw.astype(f"<u{width}", copy=False).tobytes()


def write_safetensors(path: str, arrays: Mapping[str, np.ndarray]) -> str:
  """Return `path` after writing `arrays` to it as one safetensors file.

  Tensors are laid out in name order, each starting at a multiple of 8
  bytes; the header carries `{"format": "pt"}` metadata, which transformers
  expects of a checkpoint.

  Raises:
    ValueError: a dtype other than F32, F16, BF16 or F64, or a tensor
      named `__metadata__`.
  """
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  blobs, offset = [], 0
  for name in sorted(arrays):
    if name == "__metadata__":
      raise ValueError("a tensor cannot be named __metadata__")
    array = np.asarray(arrays[name])
    dtype = _dtype_name(array, name)
    pad = -offset % _ALIGN
    blob = _little_endian_bytes(array)
    blobs.append(b"\0" * pad + blob)
    offset += pad
    header[name] = {"dtype": dtype, "shape": list(array.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  # Spaces pad the header so the data section starts aligned.
  raw += b" " * (-(8 + len(raw)) % _ALIGN)

  def write(f: BinaryIO) -> None:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for blob in blobs:
      f.write(blob)

  return run_dir.atomic_write(path, write)


def _write_json(path: str, value: Mapping[str, Any]) -> str:
  text = json.dumps(value, indent=2, sort_keys=True) + "\n"
  return run_dir.atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def llama_config(glu: Any, dtype: str = "float32") -> dict[str, Any]:
  """Return the `config.json` dict of a `targets.glu_config.GluConfig`.

  `glu` is read by attribute (io does not import targets); the dict is
  one `glu_config.config_from_hf` reads back as `glu` with family
  `llama`.

  Raises:
    ValueError: a model with QK-norm, which Llama has no place for.
  """
  if glu.qk_norm:
    raise ValueError("a Llama config has no QK-norm; this model's "
                     "q_norm/k_norm weights would be dropped")
  rope: dict[str, Any] = {"rope_type": "default",
                          "rope_theta": float(glu.rope_theta)}
  if glu.rope_scaling is not None:
    s = glu.rope_scaling
    rope.update(rope_type="llama3", factor=s.factor,
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position)
  return {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": glu.vocab_size, "hidden_size": glu.d_model,
    "intermediate_size": glu.d_ff, "num_hidden_layers": glu.n_layers,
    "num_attention_heads": glu.n_heads,
    "num_key_value_heads": glu.n_kv_heads, "head_dim": glu.head_dim,
    "hidden_act": "silu", "rms_norm_eps": glu.rms_eps,
    "tie_word_embeddings": glu.tied,
    "max_position_embeddings": glu.max_position,
    "rope_parameters": rope, "attention_bias": False, "mlp_bias": False,
    "dtype": dtype,
  }


def llama_tensors(
  arrays: Mapping[str, np.ndarray], n_layers: int, tied: bool
) -> dict[str, np.ndarray]:
  """Return Llama tensors by name from stacked `x @ W` arrays, exactly the
  inverse of `load_decoder_arrays` (matrices back to torch's `[out, in]`).

  Raises:
    ValueError: `arrays` lacks or adds a name, or a stack has another
      layer count.
  """
  want = {"embed", "norm", "ln1", "ln2", *_MATRICES}
  if not tied:
    want.add("head")
  if set(arrays) != want:
    raise ValueError(f"weight arrays {sorted(arrays)} are not a Llama's "
                     f"{sorted(want)}")
  out = {"model.embed_tokens.weight": arrays["embed"],
         "model.norm.weight": arrays["norm"]}
  if not tied:
    out["lm_head.weight"] = arrays["head"]
  for key in (*_MATRICES, "ln1", "ln2"):
    if arrays[key].shape[0] != n_layers:
      raise ValueError(f"weight {key} stacks {arrays[key].shape[0]} layers, "
                       f"not {n_layers}")
  for i in range(n_layers):
    for key in ("ln1", "ln2"):
      out[f"model.layers.{i}.{_NORMS[key]}.weight"] = arrays[key][i]
    for key, hf in _MATRICES.items():
      out[f"model.layers.{i}.{hf}.weight"] = np.ascontiguousarray(
        np.asarray(arrays[key][i]).T)
  return out


def write_llama_checkpoint(
  model_dir: str, arrays: Mapping[str, np.ndarray], glu: Any,
  extra_config: Optional[Mapping[str, Any]] = None,
) -> str:
  """Return `model_dir` after writing `config.json` and `model.safetensors`
  of a Llama decoder there (the directory is created if missing).

  `arrays` is the GLU target's stacked layout (`weights_to_arrays`), its
  dtype kept; `glu` its `GluConfig`; `extra_config` entries (token ids)
  are added to `config.json`.

  Raises:
    ValueError: arrays that are not this model's Llama weights.
  """
  tensors = llama_tensors(arrays, glu.n_layers, glu.tied)
  config = llama_config(glu, np.asarray(arrays["embed"]).dtype.name)
  config.update(extra_config or {})
  os.makedirs(model_dir, exist_ok=True)
  write_safetensors(os.path.join(model_dir, "model.safetensors"), tensors)
  _write_json(os.path.join(model_dir, "config.json"), config)
  return model_dir


def write_word_tokenizer(
  model_dir: str, tokens: Sequence[str], unk_token: Optional[str] = None,
  eos_token: Optional[str] = None,
) -> str:
  """Return `model_dir` after writing a word-level tokenizer there.

  Token `tokens[i]` gets id `i`; text splits on whitespace, so `"3 + 4 ="`
  encodes word by word, and decoding joins words with spaces. Writes
  `tokenizer.json` (the `tokenizers` library's format) and
  `tokenizer_config.json`, which makes transformers load it as a plain
  fast tokenizer whatever the model's type.

  Raises:
    ValueError: repeated or whitespace-holding tokens, or an unknown or
      EOS token that is not among `tokens`.
  """
  import tokenizers  # noqa: PLC0415  (heavy; only exporters need it)

  if len(set(tokens)) != len(tokens):
    raise ValueError("tokenizer tokens must be distinct")
  if any(not t or t != "".join(t.split()) for t in tokens):
    raise ValueError("tokenizer tokens must be non-empty and hold no "
                     "whitespace (text splits on it)")
  for role, token in (("unknown", unk_token), ("EOS", eos_token)):
    if token is not None and token not in tokens:
      raise ValueError(f"{role} token {token!r} is not among the tokens")
  vocab = {t: i for i, t in enumerate(tokens)}
  tokenizer = tokenizers.Tokenizer(
    tokenizers.models.WordLevel(vocab, unk_token=unk_token))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  special = [t for t in (unk_token, eos_token) if t is not None]
  tokenizer.add_special_tokens(special)
  os.makedirs(model_dir, exist_ok=True)
  text = tokenizer.to_str(pretty=True)
  run_dir.atomic_write(os.path.join(model_dir, "tokenizer.json"),
                       lambda f: f.write(text.encode("utf-8")))
  config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                            "model_max_length": 1 << 30}
  if unk_token is not None:
    config["unk_token"] = unk_token
  if eos_token is not None:
    config["eos_token"] = eos_token
  _write_json(os.path.join(model_dir, "tokenizer_config.json"), config)
  return model_dir


def write_tokenizer_json(
  model_dir: str, tokenizer_json: str, eos_token: Optional[str] = None,
) -> str:
  """Return `model_dir` after writing a trained `tokenizers` tokenizer
  there: `tokenizer.json` as serialized (`Tokenizer.to_str()`) and a
  `tokenizer_config.json` that makes transformers load it as a plain fast
  tokenizer whose decoding gives back the text encoded (no cleanup of
  spaces before punctuation).
  """
  os.makedirs(model_dir, exist_ok=True)
  run_dir.atomic_write(os.path.join(model_dir, "tokenizer.json"),
                       lambda f: f.write(tokenizer_json.encode("utf-8")))
  config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                            "model_max_length": 1 << 30,
                            "clean_up_tokenization_spaces": False}
  if eos_token is not None:
    config["eos_token"] = eos_token
  _write_json(os.path.join(model_dir, "tokenizer_config.json"), config)
  return model_dir
