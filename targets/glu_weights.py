"""A decoder LM's frozen weights, its layer segments and the names of its
sites and taps (SPEC §1, §9; design §9.2, §9.5).

Frozen weights are stacked per kind on a leading `layer` axis, in the
orientation `y = x @ W` (`W: [d_in, d_out]`), and stored as three stacks:
the frozen prefix `[0, split)`, the decomposed span `[split, tail)` and the
frozen tail `[tail, n_layers)` (an empty one is None). Each runs as one
`lax.scan` over a whole stored leaf, so no forward slices a copy out of a
stack (I41).

Tap keys (SPEC §1): `resid.{i}` is the residual entering block `i`
(`resid.0` the embeddings, `resid.{n_layers}` the pre-final-norm residual);
a site name `layers.{i}.self_attn.q_proj` is that matrix's input and
`<site>.out` its output; `attn.{i}` is block `i`'s fp32 attention pattern
`[b, n_heads, t, t]`; a mixture-of-experts model's
`layers.{i}.mlp` / `.mlp.out` and `layers.{i}.mlp.gate` / `.mlp.gate.out`
are its MLP block's input and output and its router's input and logits.
`parse_tap` turns a key into the `(stream, layer)` a forward emits.
"""

import dataclasses
import re
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from decompax.targets import glu_config


ROLES = ("q", "k", "v", "o", "gate", "up", "down")
# A mixture-of-experts model's expert projections, HF's
# `mlp.experts.<e>.{gate,up,down}_proj`: roles of their own, each site one
# expert's matrix (design §9.5).
EXPERT_ROLES = ("expert_gate", "expert_up", "expert_down")
_SITE_RE = re.compile(
  r"^layers\.(\d+)\.(?:self_attn\.(q|k|v|o)|mlp\.(gate|up|down)"
  r"|mlp\.experts\.(\d+)\.(gate|up|down))_proj(\.out)?$")
# The token embedding and the unembedding as sites and taps (design §9.2):
# HF's `model.embed_tokens` and `lm_head`, named like `layers.<i>` without
# the `model.` prefix. Their tap is the site's input: the token ids, and the
# final hidden state (after the final norm) the head reads; `.out` the
# site's output: the embedding rows (before any position table), the logits.
EMBED_SITE = "embed_tokens"
HEAD_SITE = "lm_head"
END_SITES = (EMBED_SITE, HEAD_SITE)
END_TAPS = END_SITES + tuple(f"{n}.out" for n in END_SITES)
# A mixture-of-experts model's MLP taps, named after HF's modules:
# `layers.<i>.mlp` is the block's input (the normed residual) and `.out`
# its output (the routed sum), `layers.<i>.mlp.gate` the router's input and
# `.out` its logits `[b, t, n_experts]`; streams `moe`, `moe.out`, `router`,
# `router.out`.
_MOE_TAP_RE = re.compile(r"^layers\.(\d+)\.mlp(\.gate)?(\.out)?$")
MOE_STREAMS = ("moe", "moe.out", "router", "router.out")
_RESID_RE = re.compile(r"^resid\.(\d+)$")
_ATTN_RE = re.compile(r"^attn\.(\d+)$")


class LayerStack(NamedTuple):
  """Frozen weights of consecutive layers, each leaf `[layer, ...]`."""

  ln1: Float[Array, "layer d"]
  q: Float[Array, "layer d q"]
  k: Float[Array, "layer d kv"]
  v: Float[Array, "layer d kv"]
  o: Float[Array, "layer q d"]
  ln2: Float[Array, "layer d"]
  gate: Float[Array, "layer d f"]
  up: Float[Array, "layer d f"]
  down: Float[Array, "layer f d"]
  q_norm: Optional[Float[Array, "layer hd"]] = None
  k_norm: Optional[Float[Array, "layer hd"]] = None
  # Frozen biases (I52) of models that have them, else None: one per
  # projection role (`<role>_bias`, `[layer, d_out]`) and LayerNorm's.
  q_bias: Optional[Float[Array, "layer q"]] = None
  k_bias: Optional[Float[Array, "layer kv"]] = None
  v_bias: Optional[Float[Array, "layer kv"]] = None
  o_bias: Optional[Float[Array, "layer d"]] = None
  gate_bias: Optional[Float[Array, "layer f"]] = None
  up_bias: Optional[Float[Array, "layer f"]] = None
  down_bias: Optional[Float[Array, "layer d"]] = None
  ln1_bias: Optional[Float[Array, "layer d"]] = None
  ln2_bias: Optional[Float[Array, "layer d"]] = None
  # Sandwich norms (Gemma): on the attention and the MLP output before
  # each residual add.
  post_attn_norm: Optional[Float[Array, "layer d"]] = None
  post_mlp_norm: Optional[Float[Array, "layer d"]] = None
  # A mixture-of-experts MLP (Qwen3-MoE) in place of gate/up/down: the
  # frozen router `x @ router -> [.., expert]` and each expert's SwiGLU
  # projections, stacked `[layer, expert, d_in, d_out]`.
  router: Optional[Float[Array, "layer d e"]] = None
  expert_gate: Optional[Float[Array, "layer e d f"]] = None
  expert_up: Optional[Float[Array, "layer e d f"]] = None
  expert_down: Optional[Float[Array, "layer e f d"]] = None


def layer_stack(**leaves: Any) -> LayerStack:
  """Return a `LayerStack` of the given leaves, every other one None (a
  plain MLP has no `gate`)."""
  return LayerStack(**{name: leaves.get(name) for name in LayerStack._fields})


class GluWeights(NamedTuple):
  """A decoder's frozen weights; `head` None means tied to `embed`.

  `pos` is a learned position table `[max_position, d]` added to the
  embeddings (GPT-2), `norm_bias` the final LayerNorm's bias; None where
  the model has none.
  """

  embed: Float[Array, "vocab d"]
  prefix: Optional[LayerStack]
  span: Optional[LayerStack]
  tail: Optional[LayerStack]
  norm: Float[Array, " d"]
  head: Optional[Float[Array, "vocab d"]] = None
  pos: Optional[Float[Array, "p d"]] = None
  norm_bias: Optional[Float[Array, " d"]] = None


@dataclasses.dataclass(frozen=True)
class Segments:
  """Layer bounds of the three stacks: `[0, split)`, `[split, tail)`, rest."""

  n_layers: int
  split: int
  tail: int

  def __post_init__(self):
    if not 0 <= self.split <= self.tail <= self.n_layers:
      raise ValueError(f"segment bounds 0 <= split {self.split} <= tail "
                       f"{self.tail} <= n_layers {self.n_layers} violated")

  def bounds(self) -> tuple[tuple[str, int, int], ...]:
    return (("prefix", 0, self.split), ("span", self.split, self.tail),
            ("tail", self.tail, self.n_layers))


MLP_ROLES = ("gate", "up", "down")


def model_roles(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return the model's projection roles: `ROLES`, less `gate` for a plain
  (ungated) MLP, and a mixture of experts' `EXPERT_ROLES` (each site one
  expert's matrix) in place of the three MLP roles."""
  if config.moe:
    return tuple(r for r in ROLES if r not in MLP_ROLES) + EXPERT_ROLES
  return ROLES if config.gated else tuple(r for r in ROLES if r != "gate")


def site_name(layer: int, role: str, expert: Optional[int] = None) -> str:
  """Return the HF-style name of one projection (of expert `expert` for an
  expert role)."""
  if role in EXPERT_ROLES:
    return (f"layers.{layer}.mlp.experts.{expert}."
            f"{role.removeprefix('expert_')}_proj")
  group = "self_attn" if role in ("q", "k", "v", "o") else "mlp"
  return f"layers.{layer}.{group}.{role}_proj"


def parse_site(name: str) -> Optional[tuple[int, str, bool]]:
  """Return `(layer, role, is_output)` of a site (or site-output) key; an
  expert's role is `expert_<gate|up|down>`, its index `site_expert`'s."""
  m = _SITE_RE.match(name)
  if m is None:
    return None
  role = (f"expert_{m.group(5)}" if m.group(4) is not None
          else m.group(2) or m.group(3))
  return int(m.group(1)), role, m.group(6) is not None


def router_tap(layer: int) -> str:
  """Return the tap of a mixture-of-experts layer's router logits `[b, t,
  n_experts]`."""
  return f"layers.{layer}.mlp.gate.out"


def site_expert(name: str) -> Optional[int]:
  """Return the expert index of an expert site (or its output) key, None
  for any other key."""
  m = _SITE_RE.match(name)
  return None if m is None or m.group(4) is None else int(m.group(4))


def split_stacks(
  full: LayerStack, segments: Segments
) -> tuple[Optional[LayerStack], Optional[LayerStack], Optional[LayerStack]]:
  """Return the prefix, span and tail stacks of a whole-model stack.

  Meant for host arrays at load time, never inside a jitted step (I41).
  """
  out = []
  for _, lo, hi in segments.bounds():
    out.append(None if lo == hi else jax.tree.map(lambda a: a[lo:hi], full))
  return tuple(out)


def check_segments(weights: GluWeights, segments: Segments) -> None:
  """Raise ValueError unless the stored stacks have the segments' bounds."""
  for name, lo, hi in segments.bounds():
    stack = getattr(weights, name)
    n = 0 if stack is None else stack.ln1.shape[0]
    if n != hi - lo:
      raise ValueError(f"stored {name} stack holds {n} layers, but the "
                       f"segments need [{lo}, {hi}) (I41)")


def parse_tap(key: str, n_layers: int) -> tuple[str, int]:
  """Return `(stream, layer)` of a tap key; ValueError if unknown."""
  m = _RESID_RE.match(key)
  if m is not None and int(m.group(1)) <= n_layers:
    return "resid", int(m.group(1))
  m = _ATTN_RE.match(key)
  if m is not None and int(m.group(1)) < n_layers:
    return "attn", int(m.group(1))
  parsed = parse_site(key)
  if parsed is not None and parsed[0] < n_layers:
    layer, role, is_out = parsed
    stream = f"{role}.out" if is_out else role
    if role in ("expert_gate", "expert_up") and not is_out:
      return "moe", layer  # every expert's gate and up read the block input
    if role in EXPERT_ROLES:
      stream += f"@{site_expert(key)}"
    return stream, layer
  m = _MOE_TAP_RE.match(key)
  if m is not None and int(m.group(1)) < n_layers:
    stream = "router" if m.group(2) else "moe"
    return stream + (m.group(3) or ""), int(m.group(1))
  raise ValueError(f"unknown tap key {key!r}; known: resid.0..resid."
                   f"{n_layers}, layers.<i>.self_attn.{{q,k,v,o}}_proj, "
                   "layers.<i>.mlp.{gate,up,down}_proj, each optionally "
                   "with .out, attn.<i>, and in a mixture-of-experts model "
                   "layers.<i>.mlp, layers.<i>.mlp.gate and "
                   "layers.<i>.mlp.experts.<e>.{gate,up,down}_proj, each "
                   "optionally with .out")


def all_tap_keys(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return every tap key of a model, in layer order."""
  keys = [f"resid.{i}" for i in range(config.n_layers + 1)]
  for i in range(config.n_layers):
    for role in model_roles(config):
      for e in range(config.n_experts) if role in EXPERT_ROLES else (None,):
        keys += [site_name(i, role, e), f"{site_name(i, role, e)}.out"]
    if config.moe:
      keys += [f"layers.{i}.mlp{s}" for s in ("", ".gate", ".gate.out",
                                              ".out")]
    keys.append(f"attn.{i}")
  return tuple(keys)


def init_stack(
  key: jax.Array, config: glu_config.GluConfig, n: int,
  dtype: Any = jnp.float32,
) -> LayerStack:
  """Return `n` random layers: matrices `N(0, 1/d_in)`, norms near 1,
  biases (of models with them) `N(0, 0.1²)`."""
  d, f, hd = config.d_model, config.d_ff, config.head_dim
  shapes = {"q": (d, config.q_width), "k": (d, config.kv_width),
            "v": (d, config.kv_width), "o": (config.q_width, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}
  keys = dict(zip([*shapes, "ln1", "ln2", "q_norm", "k_norm"],
                  jax.random.split(key, len(shapes) + 4)))
  mats = {r: jax.random.normal(keys[r], (n, *s), jnp.float32) / np.sqrt(s[0])
          for r, s in shapes.items() if r in model_roles(config)}

  def near_one(name, width):
    return 1.0 + 0.1 * jax.random.normal(keys[name], (n, width), jnp.float32)

  leaves = {"ln1": near_one("ln1", d), "ln2": near_one("ln2", d), **mats}
  if config.qk_norm:
    leaves.update(q_norm=near_one("q_norm", hd), k_norm=near_one("k_norm", hd))
  # Drawn from a key of their own, so models without them draw as before.
  widths = {f"{r}_bias": shapes[r][1] for r in mats} if config.bias else {}
  if config.norm == "layer":
    widths.update(ln1_bias=d, ln2_bias=d)
  bias_keys = jax.random.split(jax.random.fold_in(key, 1), len(widths) or 1)
  for k, (name, width) in zip(bias_keys, sorted(widths.items())):
    leaves[name] = 0.1 * jax.random.normal(k, (n, width), jnp.float32)
  if config.sandwich:
    post = jax.random.split(jax.random.fold_in(key, 2))
    for k, name in zip(post, ("post_attn_norm", "post_mlp_norm")):
      leaves[name] = 1.0 + 0.1 * jax.random.normal(k, (n, d), jnp.float32)
  if config.moe:
    e = config.n_experts
    moe_shapes = {"router": (d, e), "expert_gate": (e, d, f),
                  "expert_up": (e, d, f), "expert_down": (e, f, d)}
    moe_keys = jax.random.split(jax.random.fold_in(key, 3), len(moe_shapes))
    for k, (name, shape) in zip(moe_keys, moe_shapes.items()):
      leaves[name] = (jax.random.normal(k, (n, *shape), jnp.float32)
                      / np.sqrt(shape[-2]))
  return jax.tree.map(lambda a: a.astype(dtype), layer_stack(**leaves))
