"""Transcoders on a finished run's language model: which layers, what `k`,
the activations they learn from, their training, and the model with a
transcoder spliced in place of an MLP (`analysis/transcoder.py` holds
the transcoder itself; `docs/transcoder.md`).

Layers are those whose MLP has a decomposed site (`harvesting.
baseline_layers`); a mixture of experts' is refused (its MLP is routed,
not one map). `k` per layer is the decomposition's CI-L0 summed over that
layer's MLP sites, rounded: the count of rank-1 components active at a
position that together stand in for the layer's MLP, as the latents do.
The CI-L0 is the harvest's (firing counts over its positions, the ones
the transcoder is judged on) where the run has one, else the run's last
evaluation's (`eval/ci_l0/<site>` of `metrics.jsonl`).
"""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from decompax.analysis import explore, harvest_baselines
from decompax.analysis import transcoder as tc
from decompax.io import harvest_store, run_dir
from decompax.io import tokens as tokens_lib
from decompax.targets import (
  glu_attention, glu_block, glu_lm, glu_norms, glu_weights)


def mlp_input_tap(layer: int) -> str:
  """Return the tap of a layer's MLP input (the normed residual)."""
  return f"layers.{layer}.mlp.up_proj"


def mlp_output_tap(layer: int) -> str:
  """Return the tap of a layer's MLP output (its down projection's, bias
  included)."""
  return f"layers.{layer}.mlp.down_proj.out"


def layer_sites(run: explore.LoadedRun) -> dict[int, tuple[str, ...]]:
  """Return every layer with a decomposed MLP site and its MLP sites;
  ValueError for a mixture of experts or a run with none."""
  units = harvest_baselines.baseline_layers(run)
  if any(isinstance(u, tuple) for u in units):
    raise ValueError("the run decomposes a mixture of experts, whose MLP is "
                     "routed over experts; a transcoder stands in for one "
                     "dense MLP")
  if not units:
    raise ValueError("the run decomposes no MLP site (gate, up or down); a "
                     "transcoder stands in for an MLP")
  sites = {}
  for s in run.target.sites:
    parsed = glu_weights.parse_site(s.name)
    if parsed is not None and parsed[1] in glu_weights.MLP_ROLES:
      sites[parsed[0]] = sites.get(parsed[0], ()) + (s.name,)
  return dict(sorted(sites.items()))


def harvest_ci_l0(run_path: str) -> Optional[dict[str, float]]:
  """Return every site's CI-L0 over a finished harvest's positions (None
  without one): its firing counts summed, over the positions."""
  try:
    manifest = harvest_store.read_manifest(run_path)
  except (OSError, ValueError):
    return None
  positions = manifest["positions"]
  return {site: float(np.sum(harvest_store.read_arrays(
    run_path, site, ("fired",))["fired"])) / positions
          for site in manifest["sites"]}


def metrics_ci_l0(run_path: str) -> Optional[dict[str, float]]:
  """Return every site's CI-L0 of the run's last evaluation (None without
  one)."""
  prefix = "eval/ci_l0/"
  records = run_dir.read_metrics(os.path.join(run_path,
                                              run_dir.METRICS_FILE))
  for record in reversed(records):
    found = {k.removeprefix(prefix): float(v) for k, v in record.items()
             if k.startswith(prefix)}
    if found:
      return found
  return None


def site_ci_l0(run_path: str) -> tuple[dict[str, float], str]:
  """Return every site's CI-L0 and where it was read (`harvest` or
  `eval`); ValueError where the run records neither."""
  found = harvest_ci_l0(run_path)
  if found is not None:
    return found, "harvest"
  found = metrics_ci_l0(run_path)
  if found is not None:
    return found, "eval"
  raise ValueError(f"{run_path} records no CI-L0: it has no finished "
                   "harvest and no evaluation in metrics.jsonl; run "
                   "bin/harvest on it, or pass --k")


def matched_l0(ci_l0: dict[str, float],
               sites: dict[int, tuple[str, ...]]) -> dict[int, float]:
  """Return every layer's CI-L0: its MLP sites' summed."""
  missing = [s for names in sites.values() for s in names if s not in ci_l0]
  if missing:
    raise ValueError(f"no CI-L0 recorded for sites {missing}; pass --k")
  return {i: sum(ci_l0[s] for s in names) for i, names in sites.items()}


def matched_k(l0: dict[int, float]) -> dict[int, int]:
  """Return every layer's `k`: its CI-L0 rounded, at least 1."""
  return {i: max(1, int(round(v))) for i, v in l0.items()}


def layer_weights(weights: glu_weights.GluWeights, layer: int
                  ) -> glu_weights.LayerStack:
  """Return one layer's weights (leaves without the layer axis) from
  whichever stored stack holds it."""
  at = 0
  for stack in (weights.prefix, weights.span, weights.tail):
    if stack is None:
      continue
    n = stack.ln1.shape[0]
    if layer < at + n:
      return jax.tree.map(lambda a: a[layer - at], stack)
    at += n
  raise ValueError(f"layer {layer} is past the model's {at} layers")


# A layer's stand-in for its MLP: the MLP's input to its output.
Replace = dict[int, Callable[[Array], Array]]


def spliced_logits(
  weights: glu_weights.GluWeights, config, attention: str,
  start: Float[Array, "b t d"], first: int, replace: Replace,
) -> Float[Array, "b t v"]:
  """Return the logits of the model run from the residual `start`
  entering block `first`, each layer of `replace` adding its stand-in's
  output where its MLP's would be (every other block as it is)."""
  t = start.shape[1]
  rope = glu_attention.rope_tables(config, t)
  tables = glu_attention.window_tables(config, t,
                                       rope) if config.windowed else None
  attend = glu_attention.attention_fn(attention)
  site = lambda r, x, w: glu_block.frozen_site(r, x, w, None)  # noqa: E731
  h = start
  for i in range(first, config.n_layers):
    lw = layer_weights(weights, i)
    layer_rope, mask = ((rope, None) if tables is None else
                        glu_attention.pick_layer(tables,
                                                 i in config.local_layers))
    streams = ("up", "o.out") if i in replace else ()
    out, values = glu_block.block(h, lw, site, config, layer_rope, attend,
                                  streams, mask)
    if i in replace:
      # As the block adds each sublayer: through its sandwich norm.
      h1 = h + glu_norms.post_norm(values["o.out"], lw.post_attn_norm, config)
      out = h1 + glu_norms.post_norm(replace[i](values["up"]),
                                     lw.post_mlp_norm, config)
    h = out
  x = glu_norms.norm(h, weights.norm, weights.norm_bias, config)
  return glu_norms.softcap(glu_lm.head_logits(weights, x),
                           config.final_softcap)


def mlp_pairs(run: explore.LoadedRun, weights, tokens: Int[Array, "b t"],
              layers: tuple[int, ...]) -> dict[int, tuple[Array, Array]]:
  """Return every layer's MLP `(input, output)` on `tokens` (traceable)."""
  taps = tuple(f(i) for i in layers for f in (mlp_input_tap,
                                              mlp_output_tap))
  _, values = run.target.clean_forward(weights, tokens, taps)
  return {i: (values[mlp_input_tap(i)], values[mlp_output_tap(i)])
          for i in layers}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """What decides a set of trained transcoders."""

  data_path: str
  layers: tuple[int, ...]
  ks: tuple[int, ...]
  n_latents: tuple[int, ...]
  num_steps: int
  batch_size: int
  seq_len: int
  lr: float
  l1_coeff: float
  seed: int


def check_settings(settings: TrainSettings) -> None:
  """Raise ValueError (one line, naming the setting) for settings no
  training can use."""
  for name in ("num_steps", "batch_size", "seq_len"):
    if getattr(settings, name) <= 0:
      raise ValueError(f"{name}={getattr(settings, name)} must be positive")
  if not settings.lr > 0:
    raise ValueError(f"lr={settings.lr} must be positive")
  if not settings.l1_coeff >= 0:
    raise ValueError(f"l1_coeff={settings.l1_coeff} must be 0 or more")
  for i, k, n in zip(settings.layers, settings.ks, settings.n_latents):
    if not 1 <= k <= n:
      raise ValueError(f"k={k} of layer {i} must lie in [1, n_latents={n}]")


def token_batches(settings: TrainSettings, vocab_size: int
                  ) -> Callable[[int], np.ndarray]:
  """Return `batch(step)`: windows of the token file at random starts, a
  pure function of the seed and the step; ValueError for a file shorter
  than one window."""
  try:
    opened = tokens_lib.open_tokens(settings.data_path, vocab_size)
  except OSError as e:
    raise ValueError(f"train_data_path: {e}") from None
  n = opened.header.num_tokens
  if n < settings.seq_len:
    raise ValueError(f"train_data_path: {settings.data_path} holds {n} "
                     f"tokens, fewer than one seq_len={settings.seq_len} "
                     "window; lower seq_len")
  rows = range(settings.batch_size)
  return lambda step: np.asarray(opened.ids[
    tokens_lib.window_starts(settings.seed, step, rows, n, settings.seq_len
                             )[:, None] + np.arange(settings.seq_len)],
    np.int32)


def initial(run: explore.LoadedRun, settings: TrainSettings,
            first: Int[np.ndarray, "b t"]) -> dict[int, tc.Transcoder]:
  """Return every layer's transcoder before training, from the first
  batch's MLP activations: its encoder columns inputs of that batch
  (`tc.data_encoder`), its decoder random directions scaled to the
  outputs (`tc.scaled_to`), each from the seed folded with the layer."""
  # Jitted: run op by op, the forward would take longer than a step.
  pairs = jax.jit(lambda w, t: mlp_pairs(run, w, t, settings.layers))(
    run.weights, jnp.asarray(first))
  key = jax.random.key(settings.seed)
  out = {}
  for i, n, k in zip(settings.layers, settings.n_latents, settings.ks):
    x, y = pairs[i]
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    init_key, data_key = jax.random.split(jax.random.fold_in(key, i))
    params = tc.init(init_key, x.shape[-1], n, y.shape[-1])
    params = tc.data_encoder(params, data_key, x)
    out[i] = tc.scaled_to(params, x, y, k)
  return out


def _progress(step: int, total: int, started: float,
              losses: dict[int, float]) -> str:
  rate = step / max(time.time() - started, 1e-9)
  shown = "  ".join(f"L{i} {v:.4g}" for i, v in losses.items())
  return (f"[transcoder] step {step}/{total}  loss {shown}  "
          f"{rate:.1f} steps/s  ETA {(total - step) / rate:.0f}s")


def train(run: explore.LoadedRun, settings: TrainSettings,
          say: Callable[[str], None], log_every: int = 100
          ) -> tuple[dict[int, tc.Transcoder], dict[int, float]]:
  """Return every layer's trained transcoder and its last loss: Adam on
  the frozen model's MLP activations over `settings.num_steps` batches,
  progress said every `log_every` steps."""
  check_settings(settings)
  batch = token_batches(settings, explore.vocab_size(run))
  ks = dict(zip(settings.layers, settings.ks))
  optimizer = optax.adam(settings.lr)
  update = tc.make_update(optimizer, ks, settings.l1_coeff)

  @jax.jit
  def step(params, opt_state, weights, tokens):
    pairs = mlp_pairs(run, weights, tokens, settings.layers)
    return update(params, opt_state, pairs)

  params = initial(run, settings, batch(0))
  opt_state = optimizer.init(params)
  started, losses = time.time(), {}
  for s in range(settings.num_steps):
    params, opt_state, losses = step(params, opt_state, run.weights,
                                     jnp.asarray(batch(s)))
    if (s + 1) % log_every == 0 or s + 1 == settings.num_steps:
      losses = {i: float(v) for i, v in losses.items()}
      say(_progress(s + 1, settings.num_steps, started, losses))
  return params, {i: float(v) for i, v in losses.items()}
