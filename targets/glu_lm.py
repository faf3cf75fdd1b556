"""Pure forward of a decoder LM over three stored layer stacks (SPEC §9).

The block is Llama's (GLU MLP, RMSNorm, RoPE) or, by the config's family
options, GPT-2's, GPT-NeoX's or Gemma's (design §9.4): LayerNorm with
bias, a plain MLP, learned positions, partial rotary, parallel residual,
biases that every projection adds after its site matmul, outside the
decomposition (I52), and Gemma's offset RMSNorm, sandwich norms, GeGLU,
soft-capping and sliding-window layers; Qwen3-MoE's MLP is a routed mixture
of SwiGLU experts (design §9.5). The weights, segments and tap names are
`glu_weights`', one block `glu_block`'s (its attention `glu_attention`'s,
its norms `glu_norms`'); this module runs the blocks over the stored
stacks, one `lax.scan` per whole stored leaf (I41), gathers the taps and
applies the head. Activations are `[b, t, ...]`; tokens `[b, t]` int.

Taps leave a segment's scan as stacked outputs only for its layers up to
the deepest tapped one; boundaries between segments are the carries. The
attention pattern `attn.{i}` is built only when asked.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from decompax.targets import (
  glu_attention, glu_block, glu_config, glu_norms, glu_weights)


@dataclasses.dataclass(frozen=True)
class ForwardSpec:
  """Static settings of a forward: model, segments, attention, remat.

  `unroll` is `lax.scan`'s: unrolling small models is twice as fast on CPU
  (toy training), scanning keeps compile time flat for deep ones.
  """

  config: glu_config.GluConfig
  segments: glu_weights.Segments
  attention: str = "reference"
  remat: bool = True
  unroll: int | bool = 1

  def __post_init__(self):
    if (self.attention != "reference"
        and glu_attention.custom_scores(self.config)):
      raise ValueError(
        f"attention {self.attention!r} computes plain causal softmax(q·k/"
        f"√hd); this {self.config.family} model's scores need its own "
        "scale, soft-cap or sliding windows: use --attention=reference")


def _run_segment(
  h: Array, stack: glu_weights.LayerStack, extra: Any, lo: int, hi: int,
  site: glu_block.SiteFn, streams: tuple[str, ...], spec: ForwardSpec,
  rope: Optional[tuple[Array, Array]], remat: bool,
  emit_layers: tuple[int, ...] = (),
) -> tuple[Array, dict[str, Array]]:
  """Run layers `[lo, hi)`; `ys` stacks `streams` of layers `lo` up to the
  deepest of `emit_layers` (all layers when it is empty)."""
  if stack.ln1.shape[0] != hi - lo:
    raise ValueError(f"stack of {stack.ln1.shape[0]} layers does not match "
                     f"segment [{lo}, {hi}) (I41)")
  attend = glu_attention.attention_fn(spec.attention)
  config = spec.config
  # Which layers attend through a window: a flag per layer, scanned beside
  # the weights (models without windows scan none).
  local = (jnp.asarray([i in config.local_layers for i in range(lo, hi)])
           if config.windowed else None)
  # Built once for the scan; each layer picks its own.
  tables = (glu_attention.window_tables(config, h.shape[1], rope)
            if config.windowed
            else None)

  def body(carry, xs):
    lw, ex, is_local = xs
    layer_rope, mask = ((rope, None) if is_local is None else
                        glu_attention.pick_layer(tables, is_local))
    return glu_block.block(carry, lw, lambda r, x, w: site(r, x, w, ex), config,
                           layer_rope, attend, streams, mask)

  if remat:
    body = jax.checkpoint(body)
  last = max(emit_layers, default=hi - 1)
  if extra is not None or last == hi - 1:
    return jax.lax.scan(body, h, (stack, extra, local), unroll=spec.unroll)
  # Taps stop below the segment's end (SPEC §3.4): the layers above run the
  # same body emitting nothing. Both scans index the one stored stack, so no
  # sub-range of it is copied (I41). Only for forwards without live factors,
  # whose slices are never differentiated.
  def indexed(carry, i):
    return body(carry, jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
      (stack, None, local)))

  def quiet(carry, i):
    return indexed(carry, i)[0], None

  emitting = last + 1 - lo
  h, ys = jax.lax.scan(indexed, h, jnp.arange(emitting), unroll=spec.unroll)
  h, _ = jax.lax.scan(quiet, h, jnp.arange(emitting, hi - lo),
                      unroll=spec.unroll)
  return h, ys


def _parsed_taps(wanted: tuple[str, ...], config: glu_config.GluConfig,
                 first: int) -> dict[str, tuple[str, int]]:
  """Return each wanted tap's `(stream, layer)`; ValueError for one below
  the residual start at block `first` (I28) or of a role the model lacks."""
  parsed = {key: glu_weights.parse_tap(key, config.n_layers) for key in wanted}
  roles = glu_weights.model_roles(config)
  absent = [k for k, (s, _) in parsed.items()
            if s.removesuffix(".out") in glu_weights.ROLES
            and s.removesuffix(".out") not in roles]
  if absent:
    raise ValueError(f"taps {absent} name a projection this model lacks; "
                     f"its roles are {roles}")
  dense = [k for k, (s, _) in parsed.items()
           if (s in glu_weights.MOE_STREAMS or "@" in s) and not config.moe]
  if dense:
    raise ValueError(f"taps {dense} name a mixture-of-experts block; this "
                     "model's MLPs are dense")
  beyond = [k for k in parsed if (glu_weights.site_expert(k)
                                  or 0) >= config.n_experts
            > 0]
  if beyond:
    raise ValueError(f"taps {beyond} name an expert beyond the model's "
                     f"{config.n_experts}")
  below = [k for k, (_, layer) in parsed.items() if layer < first]
  if below:
    raise ValueError(f"taps {below} lie below the residual start at block "
                     f"{first} (I28)")
  return parsed


def _gathered_taps(
  parsed: dict[str, tuple[str, int]], boundary: dict[int, Array],
  stream_values: dict[tuple[int, int], dict[str, Array]],
) -> dict[str, Array]:
  """Return each parsed tap: a residual at a segment boundary as it is,
  any other stream from its segment's stacked scan outputs."""
  taps = {}
  for key, (stream, layer) in parsed.items():
    if stream == "resid" and layer in boundary:
      taps[key] = boundary[layer]
      continue
    for (lo, hi), ys in stream_values.items():
      if lo <= layer < hi:
        taps[key] = ys[stream][layer - lo]
  return taps


def head_matrix(weights: glu_weights.GluWeights) -> Float[Array, "vocab d"]:
  """Return the output head, the embedding when tied."""
  return weights.embed if weights.head is None else weights.head


def head_logits(
  weights: glu_weights.GluWeights, x: Float[Array, "*l d"]
) -> Float[Array, "*l vocab"]:
  """Return the logits of final hidden states `x` (after the final norm)."""
  return jnp.einsum("...d,vd->...v", x, head_matrix(weights))


# A live embedding `(table [vocab, d], tokens) -> [b, t, d]` and a live
# head `(x [b, t, d], head [vocab, d]) -> logits`, each in place of the
# frozen lookup or product.
EmbedFn = Callable[[Array, Array], Array]
HeadFn = Callable[[Array, Array], Array]


def forward(
  weights: glu_weights.GluWeights,
  tokens: Int[Array, "b t"],
  wanted: tuple[str, ...],
  spec: ForwardSpec,
  span_site: glu_block.SiteFn = glu_block.frozen_site,
  span_extra: Any = None,
  start: Optional[Float[Array, "b t d"]] = None,
  embed_fn: Optional[EmbedFn] = None,
  head_fn: Optional[HeadFn] = None,
) -> tuple[Float[Array, "b t vocab"], dict[str, Array]]:
  """Return logits and the `wanted` taps of one forward.

  `span_site` runs the span's matmuls (scanning `span_extra` beside the
  span weights); prefix and tail are always frozen. `start` is a residual
  start at block `split` (SPEC §3.5): the prefix is not run, a tap below
  `split` fails and `resid.{split}` is the start value (I28). `embed_fn`
  and `head_fn`, where given, are the live embedding and head sites.
  """
  logits_tap = f"{glu_weights.HEAD_SITE}.out"
  x, taps = final_hidden(weights, tokens,
                         tuple(k for k in wanted if k != logits_tap), spec,
                         span_site, span_extra, start, embed_fn)
  logits = (head_logits(weights, x) if head_fn is None
            else head_fn(x, head_matrix(weights)))
  if logits_tap in wanted:
    # The head module's output, before any final soft-cap (Gemma 2).
    taps[logits_tap] = logits
  return glu_norms.softcap(logits, spec.config.final_softcap), taps


def final_hidden(
  weights: glu_weights.GluWeights,
  tokens: Int[Array, "b t"],
  wanted: tuple[str, ...],
  spec: ForwardSpec,
  span_site: glu_block.SiteFn = glu_block.frozen_site,
  span_extra: Any = None,
  start: Optional[Float[Array, "b t d"]] = None,
  embed_fn: Optional[EmbedFn] = None,
) -> tuple[Float[Array, "b t d"], dict[str, Array]]:
  """Return `forward`'s final hidden state (after the final norm, what the
  head reads) and its `wanted` taps."""
  config, seg = spec.config, spec.segments
  glu_weights.check_segments(weights, seg)
  first = 0 if start is None else seg.split
  parsed = _parsed_taps(tuple(k for k in wanted
                              if k not in glu_weights.END_TAPS),
                        config, first)
  rope = glu_attention.rope_tables(config, tokens.shape[1])
  boundary = {}
  rows = None
  if start is None:
    h = rows = (jnp.take(weights.embed, tokens, axis=0) if embed_fn is None
                else embed_fn(weights.embed, tokens))
    if config.embed_scale:
      # √d rounded to fp32, then to the weights' dtype, as Gemma's.
      h = h * jnp.asarray(np.float32(config.d_model ** 0.5), h.dtype)
    if weights.pos is not None:
      h = h + weights.pos[:tokens.shape[1]]
  else:
    h = start
  boundary[first] = h
  stream_values = {}
  for name, lo, hi in seg.bounds():
    stack = getattr(weights, name)
    if hi <= first:
      continue
    if stack is None:
      boundary[hi] = h
      continue
    emitted = {(s, layer) for s, layer in parsed.values()
               if lo <= layer < hi and not (s == "resid" and layer == lo)}
    streams = tuple(sorted({s for s, _ in emitted}))
    is_span = name == "span"
    # A masked forward differentiates the span and, through its carry, the
    # frozen tail: without remat each tail layer's attention scores and MLP
    # activations would stay stacked until the backward. The prefix never
    # sees a live site, so it has nothing to keep.
    h, ys = _run_segment(
      h, stack, span_extra if is_span else None, lo, hi,
      span_site if is_span else glu_block.frozen_site, streams, spec, rope,
      spec.remat and name != "prefix" and span_extra is not None,
      tuple(layer for _, layer in emitted))
    boundary[hi] = h
    stream_values[(lo, hi)] = ys
  taps = _gathered_taps(parsed, boundary, stream_values)
  x = glu_norms.norm(h, weights.norm, weights.norm_bias, config)
  taps.update(_end_taps(weights, tokens, x, rows, wanted))
  return x, taps


def _end_taps(
  weights: glu_weights.GluWeights, tokens: Int[Array, "b t"],
  x: Float[Array, "b t d"],
  rows: Optional[Float[Array, "b t d"]], wanted: tuple[str, ...],
) -> dict[str, Array]:
  """Return the wanted taps of the embedding and the head (`END_TAPS`):
  `rows` the embedding's output (None from a residual start, which skips
  it, I28), the logits the frozen head's (`forward` taps its own)."""
  out = {}
  for key in (k for k in wanted if k in glu_weights.END_TAPS):
    if key == glu_weights.EMBED_SITE:
      out[key] = tokens
    elif key == glu_weights.HEAD_SITE:
      out[key] = x
    elif key == f"{glu_weights.HEAD_SITE}.out":
      out[key] = head_logits(weights, x)
    elif rows is None:
      raise ValueError(f"tap {key} lies below the residual start (I28)")
    else:
      out[key] = rows
  return out
