"""Static shape of a decoder language model, and its check against a HF
config.

A `GluConfig` describes the decoder of SPEC §9.1: Llama-3.x (optionally with
Llama-3 RoPE scaling) and Qwen3 dense (QK-norm), and through its family
options (design §9.4) GPT-2 (LayerNorm, learned positions, biases, a plain
GELU MLP), GPT-NeoX/Pythia (parallel residual, partial rotary) and Gemma 2
and Gemma 3 text (offset RMSNorm, sandwich norms, GeGLU, scaled embeddings,
soft-capping, sliding-window layers with their own RoPE base) and Qwen3-MoE
(a routed mixture of SwiGLU experts in place of every MLP).
`config_from_hf` reads the plain dict of a Hugging Face config
(`AutoConfig.to_dict()`, transformers 5 or 4 spelling) and refuses anything
this forward would silently compute differently, with a one-line reason.
"""

import dataclasses
import math
from typing import Any, Optional

import numpy as np

FAMILIES = ("llama", "qwen3", "gpt2", "gpt_neox", "gemma2", "gemma3_text",
            "qwen3_moe", "toy")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gpt2": "GPT2LMHeadModel",
                  "gpt_neox": "GPTNeoXForCausalLM",
                  "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}
_SUPPORTED = ("supported: llama (Llama-3.x), qwen3 (dense Qwen3), gpt2 "
              "(GPT2LMHeadModel), gpt_neox (GPT-NeoX/Pythia), gemma2 "
              "(Gemma2ForCausalLM), gemma3_text (Gemma3ForCausalLM), qwen3_moe "
              "(Qwen3MoeForCausalLM)")
# `rms_offset` is Gemma's RMSNorm: `x·rsqrt(mean(x²)+eps)·(1 + w)`.
NORMS = ("rms", "layer", "rms_offset")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
POSITIONS = ("rope", "learned")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1 frequency rescaling (SPEC §9.1)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True)
class GluConfig:
  """Sizes and options of one decoder (hashable, static).

  The defaults are the Llama block; the family options (design §9.4):
  `norm` RMSNorm or LayerNorm (with a bias; `rms_eps` is either norm's
  epsilon), `gated` MLP `down(act(gate)·up)` or plain `down(act(up))`,
  `activation` silu, gelu_tanh or gelu (exact), `positions` RoPE or a
  learned table added to the embeddings, `parallel_residual` (attention and
  MLP both read the block input), `rotary_dims` (RoPE on the first that
  many dims of each head, None for all) and `bias` (every projection adds
  a frozen bias, I52). Gemma's: `sandwich` (the attention and MLP outputs
  are normed before their residual adds), `embed_scale` (embeddings times
  √d_model), `attn_scalar` (scores scaled by `attn_scalar^-½` rather than
  `head_dim^-½`), `attn_softcap` and `final_softcap` (`c·tanh(x/c)` on the
  attention scores and on the logits), `local_layers` (the layers whose
  keys are a `sliding_window` of the latest positions, the rest attending
  to the whole causal prefix) and `local_rope_theta` (those layers' RoPE
  base, None for `rope_theta`). Qwen3-MoE's: `n_experts` > 0 makes every
  MLP a mixture of that many SwiGLU experts of width `d_ff`, each token
  summing its `experts_per_token` best-routed ones' outputs weighted by
  their router probabilities (renormalised over the chosen when
  `norm_topk`); 0 is a dense MLP.
  """

  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  vocab_size: int
  rope_theta: float
  rms_eps: float
  tied: bool
  qk_norm: bool
  rope_scaling: Optional[RopeScaling] = None
  family: str = "llama"
  max_position: int = 8192
  norm: str = "rms"
  gated: bool = True
  activation: str = "silu"
  positions: str = "rope"
  parallel_residual: bool = False
  rotary_dims: Optional[int] = None
  bias: bool = False
  sandwich: bool = False
  embed_scale: bool = False
  attn_scalar: Optional[float] = None
  attn_softcap: Optional[float] = None
  final_softcap: Optional[float] = None
  sliding_window: Optional[int] = None
  local_layers: tuple[int, ...] = ()
  local_rope_theta: Optional[float] = None
  n_experts: int = 0
  experts_per_token: int = 0
  norm_topk: bool = False

  def __post_init__(self):
    for name, allowed in (("family", FAMILIES), ("norm", NORMS),
                          ("activation", ACTIVATIONS),
                          ("positions", POSITIONS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"unknown model {name} {getattr(self, name)!r}; "
                         f"use one of {allowed}")
    for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "vocab_size"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model {name} must be positive, got "
                         f"{getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads {self.n_heads} must be a multiple of "
                       f"n_kv_heads {self.n_kv_heads}")
    if self.positions == "rope" and (
        self.rope_dims % 2 or not 0 < self.rope_dims <= self.head_dim):
      raise ValueError(f"rotary dims {self.rope_dims} must be even and in "
                       f"(0, head_dim {self.head_dim}] (RoPE rotates "
                       "halves)")
    for name in ("attn_scalar", "attn_softcap", "final_softcap",
                 "sliding_window"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model {name} must be positive or None, got "
                         f"{value}")
    if any(not 0 <= i < self.n_layers for i in self.local_layers):
      raise ValueError(f"local layers {self.local_layers} must lie in [0, "
                       f"n_layers {self.n_layers})")
    if self.local_layers and self.sliding_window is None:
      raise ValueError(f"local layers {self.local_layers} need a "
                       "sliding_window")
    if self.n_experts < 0 or (self.n_experts and not
                              0 < self.experts_per_token <= self.n_experts):
      raise ValueError(f"experts per token {self.experts_per_token} must lie "
                       f"in [1, n_experts {self.n_experts}] (n_experts >= 0)")
    if self.n_experts and not (self.gated and self.activation == "silu"):
      raise ValueError("mixture-of-experts layers are SwiGLU experts: they "
                       "need gated=True and activation 'silu'")

  @property
  def q_width(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_width(self) -> int:
    return self.n_kv_heads * self.head_dim

  @property
  def attention_scale(self) -> float:
    """The factor on `q·k`: `attn_scalar^-½`, by default `head_dim^-½`."""
    return (self.head_dim if self.attn_scalar is None
            else self.attn_scalar) ** -0.5

  @property
  def windowed(self) -> bool:
    """Whether some layers attend to a sliding window only."""
    return bool(self.local_layers)

  @property
  def moe(self) -> bool:
    """Whether every MLP is a routed mixture of experts."""
    return self.n_experts > 0

  @property
  def rope_dims(self) -> int:
    """Leading dims of each head that RoPE rotates (all by default)."""
    return self.head_dim if self.rotary_dims is None else self.rotary_dims


def inv_freq(config: GluConfig, local: bool = False) -> np.ndarray:
  """Return RoPE inverse frequencies `[rope_dims/2]` in fp32 (SPEC §9.1),
  of the sliding-window layers' base `local_rope_theta` when `local`.

  Computed in fp32 in the same op order as transformers' reference, so the
  tables agree bit for bit where the two libraries' `pow` and `cos` do.
  """
  dim = config.rope_dims
  theta = (config.local_rope_theta if local and config.local_rope_theta
           is not None else config.rope_theta)
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
  freq = (np.float32(1.0) / np.float32(theta) ** exponents)
  freq = freq.astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None:
    return freq
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = np.float32(2 * math.pi) / freq
  scaled = np.where(wavelen > low_wavelen, freq / scaling.factor, freq)
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
  value = hf.get(key, default)
  return default if value is None else value


def _refuse(hf: dict[str, Any], what: str, fix: str) -> None:
  name = hf.get("_name_or_path") or hf.get("model_type", "?")
  raise ValueError(f"unsupported model config ({name}): {what}; {fix}")


def _rope(hf: dict[str, Any]) -> tuple[float, Optional[RopeScaling]]:
  # transformers 5 folds `rope_theta` and `rope_scaling` into
  # `rope_parameters`; 4.x configs keep them apart.
  params = dict(_get(hf, "rope_scaling", {}))
  params.update(_get(hf, "rope_parameters", {}))
  theta = params.get("rope_theta", hf.get("rope_theta"))
  if theta is None:
    _refuse(hf, "no rope_theta", "the config must name the RoPE base")
  rope_type = params.get("rope_type", params.get("type", "default"))
  partial = params.get("partial_rotary_factor",
                       _get(hf, "partial_rotary_factor", 1.0))
  if float(partial) != 1.0:
    _refuse(hf, "partial_rotary_factor != 1", "partial RoPE is implemented "
            "for gpt_neox only")
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    _refuse(hf, f"rope scaling type {rope_type!r}", "supported: default, "
            "llama3")
  return float(theta), RopeScaling(
    float(params["factor"]), float(params["low_freq_factor"]),
    float(params["high_freq_factor"]),
    int(params["original_max_position_embeddings"]))


def _check_options(hf: dict[str, Any], family: str) -> None:
  if _get(hf, "hidden_act", "silu") != "silu":
    _refuse(hf, f"hidden_act {hf['hidden_act']!r}", "only SwiGLU (silu) MLPs "
            "are implemented")
  for key in ("attention_bias", "mlp_bias"):
    if _get(hf, key, False):
      _refuse(hf, f"{key} is set", "the forward has no biases")
  if family != "qwen3_moe":
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
      if _get(hf, key, 0):
        _refuse(hf, "mixture-of-experts layers", "mixture-of-experts models "
                "are supported as qwen3_moe (Qwen3MoeForCausalLM) only")
  if _get(hf, "use_sliding_window", False):
    _refuse(hf, "sliding-window attention", "only full causal attention is "
            "implemented")
  layer_types = _get(hf, "layer_types", [])
  if any(t != "full_attention" for t in layer_types):
    _refuse(hf, f"layer types {sorted(set(layer_types))}", "only "
            "full_attention layers are implemented")
  if family == "llama" and _get(hf, "sliding_window", None):
    _refuse(hf, "sliding-window attention", "only full causal attention is "
            "implemented")


# Sizes the forward reads from a HF config: required, then optional.
_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers",
          "intermediate_size", "vocab_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim",
                   "max_position_embeddings")
# GPT-2 spells them its own way; its MLP width defaults to 4·n_embd.
_GPT2_SIZES = ("n_embd", "n_head", "n_layer", "vocab_size")
_GPT2_OPTIONAL_SIZES = ("n_inner", "n_positions")


def _is_size(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_fields(hf: dict[str, Any]) -> None:
  """Raise ValueError naming the first key of a raw `config.json` dict whose
  value this forward cannot use: a size that is not a positive integer
  (a string "64" included), or heads that do not divide their widths.
  Checked before transformers reads the file, whose own refusals of these
  name no key."""
  gpt2 = hf.get("model_type") == "gpt2"
  sizes, optional = ((_GPT2_SIZES, _GPT2_OPTIONAL_SIZES) if gpt2
                     else (_SIZES, _OPTIONAL_SIZES))
  for key in sizes + optional:
    if key not in hf or (key in optional and hf[key] is None):
      if key in sizes:
        raise ValueError(f"key {key!r} is missing; a decoder config gives "
                         "it as a positive integer")
      continue
    if not _is_size(hf[key]):
      raise ValueError(f"key {key!r} must be a positive integer, got "
                       f"{hf[key]!r} ({type(hf[key]).__name__})")
  heads_key, width_key = (("n_head", "n_embd") if gpt2
                          else ("num_attention_heads", "hidden_size"))
  heads, width = hf[heads_key], hf[width_key]
  if hf.get("head_dim") is None and width % heads:
    raise ValueError(f"key {heads_key!r}: {heads} heads do not divide "
                     f"{width_key} {width} (and no head_dim is given)")
  kv_heads = hf.get("num_key_value_heads") or heads
  if heads % kv_heads:
    raise ValueError(f"key 'num_key_value_heads': {kv_heads} key/value "
                     f"heads do not divide num_attention_heads {heads}")


# HF activation names -> this forward's; gelu_new is GPT-2's tanh form.
_GELUS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
          "gelu": "gelu"}


def _gelu(hf: dict[str, Any], key: str) -> str:
  name = _get(hf, key, "")
  if name not in _GELUS:
    _refuse(hf, f"{key} {name!r}", f"supported: {sorted(_GELUS)}")
  return _GELUS[name]


def _gpt2_config(hf: dict[str, Any]) -> GluConfig:
  """GPT2LMHeadModel: LayerNorm with bias, learned positions, biased
  Conv1D projections, a plain gelu_new MLP, scores scaled by 1/√hd."""
  for key, want in (("scale_attn_weights", True),
                    ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False),
                    ("add_cross_attention", False)):
    if bool(_get(hf, key, want)) != want:
      _refuse(hf, f"{key}={not want}", f"only {key}={want} is implemented")
  d, n_heads = int(hf["n_embd"]), int(hf["n_head"])
  return GluConfig(
    n_layers=int(hf["n_layer"]), d_model=d, n_heads=n_heads,
    n_kv_heads=n_heads, head_dim=d // n_heads,
    d_ff=int(_get(hf, "n_inner", 4 * d)), vocab_size=int(hf["vocab_size"]),
    rope_theta=0.0, rms_eps=float(hf["layer_norm_epsilon"]),
    tied=bool(_get(hf, "tie_word_embeddings", True)), qk_norm=False,
    family="gpt2", max_position=int(_get(hf, "n_positions", 1024)),
    norm="layer", gated=False,
    activation=_gelu(hf, "activation_function"), positions="learned",
    bias=True)


def _neox_rope(hf: dict[str, Any]) -> tuple[float, float]:
  # transformers 5 folds rotary_pct / rotary_emb_base into rope_parameters.
  params = dict(_get(hf, "rope_scaling", {}))
  params.update(_get(hf, "rope_parameters", {}))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default":
    _refuse(hf, f"rope scaling type {rope_type!r}", "supported: default")
  theta = params.get("rope_theta", _get(hf, "rotary_emb_base", 10000.0))
  partial = params.get("partial_rotary_factor", _get(hf, "rotary_pct", 1.0))
  return float(theta), float(partial)


def _neox_config(hf: dict[str, Any]) -> GluConfig:
  """GPTNeoXForCausalLM (Pythia): LayerNorm with bias, biased projections,
  a plain GELU MLP, partial rotary, parallel or sequential residual."""
  if not _get(hf, "attention_bias", True):
    _refuse(hf, "attention_bias=False", "only GPT-NeoX with biases on "
            "every projection (attention_bias=True) is implemented")
  theta, partial = _neox_rope(hf)
  d, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  head_dim = d // n_heads
  return GluConfig(
    n_layers=int(hf["num_hidden_layers"]), d_model=d, n_heads=n_heads,
    n_kv_heads=n_heads, head_dim=head_dim, d_ff=int(hf["intermediate_size"]),
    vocab_size=int(hf["vocab_size"]), rope_theta=theta,
    rms_eps=float(hf["layer_norm_eps"]),
    tied=bool(_get(hf, "tie_word_embeddings", False)), qk_norm=False,
    family="gpt_neox",
    max_position=int(_get(hf, "max_position_embeddings", 2048)),
    norm="layer", gated=False, activation=_gelu(hf, "hidden_act"),
    parallel_residual=bool(_get(hf, "use_parallel_residual", True)),
    rotary_dims=int(head_dim * partial), bias=True)


_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma_rope(hf: dict[str, Any], family: str) -> tuple[float, float]:
  """Return the RoPE bases of full and sliding-window layers: one for
  Gemma 2, per layer type for Gemma 3 (`rope_parameters` keyed by layer
  type in transformers 5, `rope_theta` and `rope_local_base_freq` in 4)."""
  params = _get(hf, "rope_parameters", {})
  if family == "gemma3_text" and "full_attention" in params:
    per_type = {t: params.get(t) or {} for t in _LAYER_TYPES}
  elif family == "gemma3_text":
    per_type = {"full_attention": {**_get(hf, "rope_scaling", {}),
                                   "rope_theta": _get(hf, "rope_theta",
                                                      1e6)},
                "sliding_attention": {"rope_theta": _get(
                  hf, "rope_local_base_freq", 1e4)}}
  else:
    one = {**_get(hf, "rope_scaling", {}), **params}
    one.setdefault("rope_theta", _get(hf, "rope_theta", 1e4))
    per_type = {t: one for t in _LAYER_TYPES}
  for layer_type, p in per_type.items():
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type != "default":
      _refuse(hf, f"{layer_type} rope scaling type {rope_type!r}",
              "supported: default")
  return (float(per_type["full_attention"]["rope_theta"]),
          float(per_type["sliding_attention"]["rope_theta"]))


def _optional_float(hf: dict[str, Any], key: str) -> Optional[float]:
  value = hf.get(key)
  return None if value is None else float(value)


def _gemma_config(hf: dict[str, Any], family: str) -> GluConfig:
  """Gemma2ForCausalLM and Gemma3ForCausalLM (text): offset RMSNorm, four
  norms a block (sandwich), GeGLU, embeddings scaled by √d, scores scaled
  by `query_pre_attn_scalar^-½`, soft-capping, sliding-window layers (with
  their own RoPE base and QK-norm in Gemma 3), a tied head."""
  for key in ("attention_bias", "use_bidirectional_attention"):
    if _get(hf, key, False):
      _refuse(hf, f"{key} is set", "only causal Gemma attention without "
              "biases is implemented")
  if family == "gemma3_text" and hf.get("attn_logit_softcapping"):
    _refuse(hf, "attn_logit_softcapping is set, which Gemma3ForCausalLM "
            "ignores", "unset it (null)")
  n_layers = int(hf["num_hidden_layers"])
  layer_types = list(_get(hf, "layer_types", []))
  unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
  if unknown or len(layer_types) != n_layers:
    _refuse(hf, f"layer_types {layer_types}", f"give one of {_LAYER_TYPES} "
            f"for each of the {n_layers} layers")
  local = tuple(i for i, t in enumerate(layer_types)
                if t == "sliding_attention")
  window = _get(hf, "sliding_window", None)
  if local and not _is_size(window):
    _refuse(hf, f"sliding_window {window!r}", "sliding_attention layers "
            "need a positive integer window")
  theta, local_theta = _gemma_rope(hf, family)
  n_heads = int(hf["num_attention_heads"])
  return GluConfig(
    n_layers=n_layers, d_model=int(hf["hidden_size"]), n_heads=n_heads,
    n_kv_heads=int(_get(hf, "num_key_value_heads", n_heads)),
    head_dim=int(_get(hf, "head_dim", int(hf["hidden_size"]) // n_heads)),
    d_ff=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
    rope_theta=theta, rms_eps=float(hf["rms_norm_eps"]),
    tied=bool(_get(hf, "tie_word_embeddings", True)),
    qk_norm=family == "gemma3_text", family=family,
    max_position=int(_get(hf, "max_position_embeddings", 8192)),
    norm="rms_offset", activation=_gelu(hf, "hidden_activation"),
    sandwich=True, embed_scale=True,
    attn_scalar=float(_get(hf, "query_pre_attn_scalar", 256)),
    attn_softcap=_optional_float(hf, "attn_logit_softcapping"),
    final_softcap=_optional_float(hf, "final_logit_softcapping"),
    sliding_window=int(window) if local else None, local_layers=local,
    local_rope_theta=local_theta if family == "gemma3_text" else None)


_MOE_SUPPORTED = ("supported: every layer a routed mixture of SwiGLU experts "
                  "(decoder_sparse_step 1, mlp_only_layers []), no shared "
                  "expert")


def _moe_options(hf: dict[str, Any]) -> dict[str, Any]:
  """Return the GluConfig options of a Qwen3MoeForCausalLM config: its
  expert count, experts per token, `norm_topk_prob` and the experts' width
  `moe_intermediate_size` as `d_ff`.

  A layer is a sparse block when it is not in `mlp_only_layers` and
  `(i + 1) % decoder_sparse_step == 0` (transformers' Qwen3MoeDecoderLayer),
  else a dense MLP of width `intermediate_size`; only all-sparse models are
  supported, since one scan runs every layer on one pytree of weights.
  """
  # transformers 5 writes `num_local_experts` (its attribute map's name for
  # `num_experts`); released configs say `num_experts`.
  n_experts = hf.get("num_experts", hf.get("num_local_experts"))
  top_k = hf.get("num_experts_per_tok")
  width = hf.get("moe_intermediate_size")
  for key, value in (("num_experts", n_experts),
                     ("num_experts_per_tok", top_k),
                     ("moe_intermediate_size", width)):
    if not _is_size(value):
      _refuse(hf, f"{key} {value!r}", "give a positive integer")
  if top_k > n_experts:
    _refuse(hf, f"num_experts_per_tok {top_k} > num_experts {n_experts}",
            "route each token to at most num_experts experts")
  for key in ("shared_expert_intermediate_size", "n_shared_experts"):
    if _get(hf, key, 0):
      _refuse(hf, f"a shared expert ({key})", _MOE_SUPPORTED)
  n_layers = int(hf["num_hidden_layers"])
  step = _get(hf, "decoder_sparse_step", 1)
  dense_only = list(_get(hf, "mlp_only_layers", []))
  dense = [i for i in range(n_layers)
           if i in dense_only or not _is_size(step) or (i + 1) % step]
  if dense:
    _refuse(hf, f"dense MLP layers {dense} (decoder_sparse_step {step!r}, "
            f"mlp_only_layers {dense_only})", _MOE_SUPPORTED)
  norm_topk = _get(hf, "norm_topk_prob", False)
  if not isinstance(norm_topk, bool):
    _refuse(hf, f"norm_topk_prob {norm_topk!r}", "give true or false")
  return {"n_experts": int(n_experts), "experts_per_token": int(top_k),
          "norm_topk": norm_topk, "d_ff": int(width)}


def config_from_hf(hf: dict[str, Any]) -> GluConfig:
  """Return the `GluConfig` of a HF config dict; ValueError if unsupported."""
  family = hf.get("model_type")
  if family == "gemma3":
    _refuse(hf, "model_type 'gemma3' is the multimodal Gemma 3 "
            f"({hf.get('architectures')})", "use a text-only checkpoint "
            "(model_type gemma3_text, Gemma3ForCausalLM)")
  if family not in _ARCHITECTURES:
    _refuse(hf, f"model_type {family!r} (architectures "
            f"{hf.get('architectures')})", _SUPPORTED)
  archs = _get(hf, "architectures", [_ARCHITECTURES[family]])
  if list(archs) != [_ARCHITECTURES[family]]:
    _refuse(hf, f"architectures {archs}", f"expected "
            f"[{_ARCHITECTURES[family]}]")
  if family == "gpt2":
    return _gpt2_config(hf)
  if family == "gpt_neox":
    return _neox_config(hf)
  if family in ("gemma2", "gemma3_text"):
    return _gemma_config(hf, family)
  _check_options(hf, family)
  theta, scaling = _rope(hf)
  n_heads = int(hf["num_attention_heads"])
  head_dim = _get(hf, "head_dim", int(hf["hidden_size"]) // n_heads)
  options = (_moe_options(hf) if family == "qwen3_moe"
             else {"d_ff": int(hf["intermediate_size"])})
  return GluConfig(
    n_layers=int(hf["num_hidden_layers"]),
    d_model=int(hf["hidden_size"]),
    n_heads=n_heads,
    n_kv_heads=int(_get(hf, "num_key_value_heads", n_heads)),
    head_dim=int(head_dim),
    vocab_size=int(hf["vocab_size"]),
    rope_theta=theta,
    rms_eps=float(hf["rms_norm_eps"]),
    tied=bool(_get(hf, "tie_word_embeddings", False)),
    qk_norm=family in ("qwen3", "qwen3_moe"),
    rope_scaling=scaling,
    family=family,
    max_position=int(_get(hf, "max_position_embeddings", 8192)),
    **options,
  )
