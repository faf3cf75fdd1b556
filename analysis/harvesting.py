"""Harvest what a finished run's components do (`bin/harvest`).

Streams batches through the decomposition (token windows of a token file
for language models, the toy's own input distribution for toys), jitted
one batch at a time so memory does not grow with the harvest, and writes
`<run_dir>/harvest/` through `io/harvest_store.py`: one zarr array per
site and statistic, and `manifest.json` last, which marks the harvest
complete. Per component:
firing density and mean CI, a log-spaced CI histogram, co-activation counts
with every component of its site, the top-k contexts by CI (token windows
with the component's CI on each token, or a toy's input rows), and the
divergence from the clean model when it alone is ablated, summed over the
positions where it fires (measured on the first `ablation_batches`, each
ablating only the components that fired in it, with progress lines: one
forward of a whole batch per component, the harvest's dominant cost on a
language model, whose default is therefore none). When
the token file has a tag stream, also every component's part-of-speech
statistics, its CI as the activity (`losses/tag_profile.py`, fields
`TAG_FIELDS`; `docs/tag_profiles.md`) and those of the baselines, the
neurons of every MLP with a decomposed site (`BASELINES`; of a mixture of
experts, every expert with one, its neurons weighted by its routing weight)
and the heads of every attention with one (`HEADS`), with the tag
vocabulary, its coarse classes, the documents and the baselines' keys in
the manifest's `tags`.

An interrupted harvest resumes from `harvest/state.npz` when rerun with the
same settings; asked to stop (`stop`), it saves that state at the next batch
boundary and raises `Stopped`. The record it returns compares its
throughput with a plain clean forward over the same batches.

On a `Placement` (one process's devices; see `place`) each batch splits over
the mesh's batch axes, data-parallel, and the decomposition, CI parameters
and frozen weights lie where the placement table puts them as a run
computes with them (the `ddp` preset: replicated, enough for a harvest).
The statistics are then reductions over devices: counts equal the one-device
harvest's exactly, sums up to the order of the additions.
"""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from decompax.analysis import explore
from decompax.core import train_step
from decompax.io import harvest_store
from decompax.io import tokens as tokens_lib
from decompax.losses import component_stats as stats_lib
from decompax.losses import evals, tag_context, tag_profile, unit_activity
from decompax.placement import shardings, transfer
from decompax.placement import table as table_lib
from decompax.recipe import assembly, lm
from decompax.targets import (
  brown, brown_tags, glu_block, glu_norms, glu_weights, registry)

class Stopped(Exception):
  """The harvest stopped when asked, its progress saved: `done` batches
  (0: none yet, nothing saved)."""

  def __init__(self, done: int, total: int):
    super().__init__(f"stopped after batch {done} of {total}")
    self.done, self.total = done, total


FIELDS = ("fired", "ci_sum", "histogram", "coactive", "top_ci", "top_context",
          "top_context_ci", "ablation_sum", "ablation_count")
TAG_FIELDS = tuple(f"tag_{name}" for name in tag_profile.TagStats._fields)
# Each unit set's context statistics (`losses/tag_context.py`): harvests of
# `tag_revision` ≥ 1 only.
CONTEXT_FIELDS = tuple(f"tag_{name}"
                       for name in tag_context.ContextStats._fields)
# The revision of a tag harvest's statistics: 1 adds the context statistics
# and the per-site baselines (`SITE_BASELINES`); 0 is a harvest without
# them, or without tags.
TAG_REVISION = 1
# Most document groups of a tag harvest (`tag_profile`): more than Brown's
# held-out documents, so each is a group of its own; a file of fewer
# documents gets one group per document.
TAG_GROUPS = 64
# The baselines a tag harvest measures the same way, per layer whose MLP
# has a decomposed site (`losses/unit_activity.py`): store keys
# `layers.<i>.mlp.<kind>`, tag statistics only. A plain (ungated) MLP has
# no gates: its neurons are `act(up)`. A mixture of experts' MLP is its
# experts, each an MLP of its own where one of its projections is a site:
# keys `layers.<i>.mlp.experts.<e>.<kind>`, its neurons and gates weighted
# by its routing weight (0 where a position is not routed to it, as its
# output is).
BASELINES = ("neurons", "gates", "rotated")
# And per layer with a decomposed attention site, its heads: store key
# `layers.<i>.self_attn.heads`.
HEADS = "heads"
# Per MLP site, its MLP's neurons matched to the site's components
# (`calibrate`): kept at their top-q positions, q the median firing
# density of the site's components, and at each position its k most active
# neurons, k = ⌈the site's mean CI-L0⌉. Store keys `<site>.<kind>`.
SITE_BASELINES = ("density_matched", "top_k")


class MlpForm(NamedTuple):
  """How a model's MLP neurons are formed: `act(gate)·up` when `gated`,
  else `act(up)`; a mixture of experts' `routing` gives each expert's
  weights from the router logits (`glu_block.routing_weights`)."""

  gated: bool = True
  act: Callable[[jax.Array], jax.Array] = jax.nn.silu
  routing: Optional[Callable[[jax.Array], jax.Array]] = None


def mlp_form(run: explore.LoadedRun) -> MlpForm:
  """Return the MLP form of a run's model (a GLU model's; the default for
  targets without one, which have no baseline layers)."""
  model = assembly.resolve_target(run.config).record.token_model
  if model is None:
    return MlpForm()
  routing = (lambda logits: glu_block.routing_weights(logits, model)
             ) if model.moe else None
  return MlpForm(model.gated, glu_norms.activation(model), routing)


# An MLP with baselines: a layer's (its index), or one expert's of a
# mixture-of-experts layer (`(layer, expert)`).
MlpUnit = int | tuple[int, int]


def mlp_prefix(unit: MlpUnit) -> str:
  """Return the name an MLP's taps and baseline keys start with."""
  if isinstance(unit, tuple):
    return f"layers.{unit[0]}.mlp.experts.{unit[1]}"
  return f"layers.{unit}.mlp"


def mlp_kinds(mlp: MlpForm) -> tuple[str, ...]:
  """Return the `BASELINES` kinds an MLP of form `mlp` has."""
  return BASELINES if mlp.gated else tuple(
    k for k in BASELINES if k != "gates")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What makes two harvests the same harvest (resume checks these)."""

  data_path: str
  n_batches: int
  batch_size: int
  seq_len: int
  top_k: int
  before: int
  after: int
  threshold: float
  ablation_batches: int
  seed: int
  decomposition_step: int
  tag_groups: int = 0  # 0: no tag stream, no tag statistics
  # How a token file's windows are placed: `SPREAD` since harvests tile
  # the file; "" (older harvests, and toys) at random by seed and batch.
  windows: str = ""
  # `TAG_REVISION` of a tag harvest; 0 for older ones and without tags.
  tag_revision: int = 0


# A token file's windows tile it, spread evenly (`window_starts`).
SPREAD = "spread"
# Batches a harvest may take: batch `i`'s key is `fold_in(seed, i)`, whose
# data is 32 bits (and a toy at 10,000 batches/s takes 2.5 days for them).
MAX_BATCHES = 2**31 - 1


# Seconds between the ablations' progress lines.
ABLATION_PROGRESS_S = 5.0

# Context windows by default; shorter where a sequence is (a window never
# reaches past its sequence).
WINDOW_BEFORE, WINDOW_AFTER = 8, 4


@dataclasses.dataclass(frozen=True)
class Request:
  """What a harvest is asked for; `resolve` checks it against a run.

  None means the run's own value (`seq_len`, `threshold` as
  `ci_alive_threshold`, `data_path`), for the windows
  `WINDOW_BEFORE`/`WINDOW_AFTER`, cut to the sequence, and for
  `ablation_batches` `default_ablation_batches`.
  """

  positions: int = 65536
  batch_size: int = 64
  seq_len: Optional[int] = None
  top_k: int = 20
  window_before: Optional[int] = None
  window_after: Optional[int] = None
  threshold: Optional[float] = None
  ablation_batches: Optional[int] = None
  seed: int = 0
  data_path: Optional[str] = None


def check_request(request: Request) -> None:
  """Raise ValueError (one line, naming the setting) for a request no run
  can serve."""
  for name in ("positions", "batch_size", "top_k"):
    if getattr(request, name) <= 0:
      raise ValueError(f"{name}={getattr(request, name)} must be positive")
  for name in ("window_before", "window_after", "ablation_batches"):
    value = getattr(request, name)
    if value is not None and value < 0:
      raise ValueError(f"{name}={value} must be 0 or more")


def check_cadence(save_every_s: float, ablation_chunk: int) -> None:
  """Raise ValueError (one line, naming the setting) for a save interval or
  an ablation chunk no harvest can use."""
  if save_every_s < 0:
    raise ValueError(f"save_every_s={save_every_s} must be 0 or more")
  if ablation_chunk <= 0:
    raise ValueError(f"ablation_chunk={ablation_chunk} must be positive")


def _window(request: Request, name: str, default: int, seq_len: int,
            windowed: bool) -> int:
  """Return a context window's extent; ValueError for one past the
  sequence (always empty there, and memory grows with it)."""
  value = getattr(request, name)
  if not windowed:  # a toy's contexts are its input rows, not windows
    return default if value is None else value
  if value is None:
    return min(default, seq_len - 1)
  if value >= seq_len:
    raise ValueError(
      f"{name}={value} reaches past the sequence: a window of seq_len="
      f"{seq_len} holds at most {seq_len - 1} positions on either side of "
      "a top position; lower it")
  return value


def resolve(run: explore.LoadedRun, request: Request) -> Settings:
  """Return the settings of `request` on `run`; ValueError (one line,
  naming the setting) for a request the run cannot serve."""
  check_request(request)
  config = run.config
  data_path = request.data_path or config.data_path or ""
  if lm.is_lm(config) and not data_path:
    raise ValueError("data_path: a language-model harvest reads a token "
                     "file; pass one (make it with bin/tokenize)")
  seq_len = (request.seq_len or config.seq_len) if data_path else (
    toy_seq_len(run, request.batch_size))
  windowed = bool(data_path) or _toy_sequences(run, request.batch_size)
  before = _window(request, "window_before", WINDOW_BEFORE, seq_len,
                   windowed)
  after = _window(request, "window_after", WINDOW_AFTER, seq_len, windowed)
  per_batch = request.batch_size * seq_len
  if per_batch < request.top_k:
    raise ValueError(f"top_k={request.top_k} exceeds the {per_batch} "
                     "positions of one batch; raise batch_size or lower top_k")
  threshold = (config.ci_alive_threshold if request.threshold is None
               else request.threshold)
  groups = tag_groups(data_path) if data_path else 0
  n_batches = -(-request.positions // per_batch)
  if data_path:
    n_batches = min(n_batches, file_batches(data_path, request.batch_size,
                                            seq_len))
  if n_batches > MAX_BATCHES:
    raise ValueError(
      f"positions={request.positions} takes {n_batches} batches of "
      f"{per_batch} positions, more than the {MAX_BATCHES} a harvest "
      "numbers (a batch's index folds into its key in 32 bits); lower "
      "positions or raise batch_size")
  return Settings(
    os.path.abspath(data_path) if data_path else "",
    n_batches, request.batch_size, seq_len,
    request.top_k, before, after,
    float(threshold), default_ablation_batches(run)
    if request.ablation_batches is None else request.ablation_batches,
    request.seed,
    run.decomposition.step, tag_groups=groups,
    windows=SPREAD if data_path else "",
    tag_revision=TAG_REVISION if groups else 0)


def _bytes(tree: Any) -> int:
  return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves(tree))


def batch_bytes(run: explore.LoadedRun, settings: Settings) -> int:
  """Return a floor on the bytes one harvested batch holds at once: its
  inputs, the clean output and every component's CI at each of its
  positions (float32), each as shaped, nothing of the forward between."""
  inputs = batch_shape(run, settings)
  output = jax.eval_shape(
    lambda w, x: run.target.clean_forward(w, x, ())[0], run.weights, inputs)
  components = sum(site.c for site in run.target.sites)
  ci = settings.batch_size * settings.seq_len * components * 4
  return _bytes(inputs) + _bytes(output) + ci


def memory_floor(run: explore.LoadedRun, settings: Settings,
                 ablation_chunk: int) -> int:
  """Return a floor on the bytes a harvest of `settings` holds at once:
  one batch (`batch_bytes`), and where it measures ablation effects,
  `ablation_chunk` ablated forwards of it besides."""
  one = batch_bytes(run, settings)
  return one * (1 + (ablation_chunk if settings.ablation_batches else 0))


def file_batches(data_path: str, batch_size: int, seq_len: int) -> int:
  """Return how many whole batches of windows a token file holds without
  overlap (a harvest asking for more reads the whole file once);
  ValueError (naming the setting) for a file short of one batch."""
  try:
    num_tokens = tokens_lib.open_tokens(data_path).header.num_tokens
  except OSError as e:
    raise ValueError(f"data_path: {e}") from None
  batches = num_tokens // seq_len // batch_size
  if not batches:
    raise ValueError(
      f"data_path: {data_path} holds {num_tokens} tokens, fewer than one "
      f"batch of batch_size={batch_size} windows of seq_len={seq_len}; "
      "lower batch_size or seq_len")
  return batches


# Ablation batches by default: a toy's ablations cost little, a language
# model's hours (one forward of a whole batch per component that fired:
# `brown_s`, 3072 components, about 20 minutes per batch of 8 x 64 tokens
# on two CPU cores, 3 hours per batch of 64 x 64), so it asks for them.
TOY_ABLATION_BATCHES, LM_ABLATION_BATCHES = 2, 0


def default_ablation_batches(run: explore.LoadedRun) -> int:
  """Return the ablation batches of a harvest that names none."""
  return (LM_ABLATION_BATCHES if lm.is_lm(run.config)
          else TOY_ABLATION_BATCHES)


def tag_groups(data_path: str) -> int:
  """Return the document groups of a harvest of `data_path`: 0 without a
  tag stream, else one per document up to `TAG_GROUPS`; ValueError for a
  tag stream that does not describe its token file."""
  if not tokens_lib.has_tags(data_path):
    return 0
  try:
    stream = tokens_lib.open_tags(tokens_lib.open_tokens(data_path))
  except (OSError, ValueError) as e:
    raise ValueError(f"data_path: {e}") from None
  return max(1, min(TAG_GROUPS, len(stream.documents)))


def _toy_batch(run: explore.LoadedRun, batch_size: int):
  toy = registry.get(run.config.target)
  return jax.eval_shape(lambda k: toy.sample_inputs(k, batch_size),
                        jax.random.key(0))


def _toy_lead(run: explore.LoadedRun, batch_size: int) -> tuple[int, ...]:
  return tuple(run.target.batch_lead_shape(_toy_batch(run, batch_size)))


def _toy_sequences(run: explore.LoadedRun, batch_size: int) -> bool:
  """Return whether a toy's inputs are sequences (its contexts windows)."""
  return len(_toy_lead(run, batch_size)) == 2


def toy_seq_len(run: explore.LoadedRun, batch_size: int) -> int:
  """Return the positions per input of a toy's own batches (1 for inputs
  without a sequence axis)."""
  lead = _toy_lead(run, batch_size)
  return lead[1] if len(lead) == 2 else 1


def batch_shape(run: explore.LoadedRun, settings: Settings):
  """Return the shapes of one harvested batch (token ids `[B, T]`, or the
  toy's own inputs)."""
  if settings.data_path:
    return jax.ShapeDtypeStruct((settings.batch_size, settings.seq_len),
                                jnp.int32)
  return _toy_batch(run, settings.batch_size)


def window_starts(settings: Settings, i: int, num_tokens: int
                  ) -> np.ndarray:
  """Return the starts of batch `i`'s windows in a token file of
  `num_tokens`: the harvest's windows tile the file without overlap,
  spread evenly over it (`io.tokens.spread_window_starts`), so no
  position is counted twice and no context is a top context twice; an
  older harvest's, drawn at random, as it drew them."""
  b = settings.batch_size
  if settings.windows != SPREAD:
    return tokens_lib.window_starts(settings.seed, i, range(b), num_tokens,
                                    settings.seq_len)
  return tokens_lib.spread_window_starts(
    range(i * b, (i + 1) * b), settings.n_batches * b, num_tokens,
    settings.seq_len)


def window_positions(settings: Settings, i: int, num_tokens: int
                     ) -> np.ndarray:
  """Return the stream positions `[B, T]` of batch `i`."""
  return (window_starts(settings, i, num_tokens)[:, None]
          + np.arange(settings.seq_len))


def batch_source(run: explore.LoadedRun, settings: Settings,
                 sharding: Any = None):
  """Return `batch(i)`: the i-th harvested batch, a pure function of the
  seed and `i` (so a resumed harvest reads what it would have), laid out
  by `sharding` (a batch's shardings; None: on the default device)."""
  if settings.data_path:
    try:
      opened = tokens_lib.open_tokens(settings.data_path,
                                     explore.vocab_size(run))
    except OSError as e:
      raise ValueError(f"data_path: {e}") from None
    if opened.header.num_tokens < settings.seq_len:
      raise ValueError(f"data_path: {settings.data_path} holds fewer tokens "
                       f"than one seq_len={settings.seq_len} sequence")
    n = opened.header.num_tokens
    read = lambda i: np.asarray(opened.ids[  # noqa: E731
      window_positions(settings, i, n)], np.int32)
    if sharding is None:
      return lambda i: jnp.asarray(read(i))
    # Straight from the host into each device's rows.
    return lambda i: transfer.put(read(i), sharding)
  toy = registry.get(run.config.target)
  key = jax.random.key(settings.seed)
  sample = lambda i: toy.sample_inputs(  # noqa: E731
    jax.random.fold_in(key, i), settings.batch_size)
  if sharding is None:
    return jax.jit(sample)
  # Each device draws its own rows; the partitionable counter-based RNG
  # draws the same batch however it is split.
  return jax.jit(sample, out_shardings=sharding)


class TagSource(NamedTuple):
  """A tag harvest's positions: `read(i)` gives batch `i`'s tags, previous
  tags and document groups (each laid out like the batch), `coarse_of`
  each tag's coarse class, `record` what the manifest says of them, `mix`
  each token id's class mix over the harvested positions
  (`token_mix`)."""

  read: Callable[[int], tuple[Any, Any, Any]]
  coarse_of: np.ndarray
  record: dict
  mix: np.ndarray


def tag_source(settings: Settings, sharding: Any = None
               ) -> Optional[TagSource]:
  """Return the tag stream's positions of every harvested batch, the very
  windows `batch_source` reads (None without tag statistics)."""
  if not settings.tag_groups:
    return None
  try:
    opened = tokens_lib.open_tokens(settings.data_path)
  except OSError as e:
    raise ValueError(f"data_path: {e}") from None
  stream = tokens_lib.open_tags(opened)
  documents = np.asarray([d["start"] for d in stream.documents], np.int64)
  # The position before the stream's first one: a document starts there.
  before = (stream.tags.index(brown.EOS_TAG)
            if brown.EOS_TAG in stream.tags else 0)
  n = opened.header.num_tokens

  def read(i):
    index = window_positions(settings, i, n)
    tags, previous = tag_profile.position_tags(stream.ids, index, before)
    group = tag_profile.position_groups(documents, index,
                                        settings.tag_groups)
    if sharding is None:
      return tuple(map(jnp.asarray, (tags, previous, group)))
    return tuple(transfer.put(x, sharding) for x in (tags, previous, group))

  coarse_of = brown_tags.coarse_ids(stream.tags)
  record = {"tags": list(stream.tags), "classes": list(brown_tags.COARSE),
            "coarse_of": coarse_of.tolist(), "groups": settings.tag_groups,
            "documents": [d["name"] for d in stream.documents]}
  return TagSource(read, coarse_of, record,
                   token_mix(settings, opened, stream.ids, coarse_of))


def token_mix(settings: Settings, opened: tokens_lib.Tokens,
              tag_ids: np.ndarray, coarse_of: np.ndarray) -> np.ndarray:
  """Return each token id's class mix `[vocab, classes]` over every
  position the harvest reads (a pass over the token and tag files only,
  before any unit is streamed; `losses/tag_context.py`)."""
  n = opened.header.num_tokens
  counts = np.zeros((opened.header.vocab_size, len(brown_tags.COARSE)),
                    np.int64)
  for i in range(settings.n_batches):
    index = window_positions(settings, i, n).reshape(-1)
    counts += tag_context.token_class_counts(
      np.asarray(opened.ids[index], np.int64),
      coarse_of[np.asarray(tag_ids[index], np.int64)], *counts.shape)
  return tag_context.class_given_token(counts)


def baseline_layers(run: explore.LoadedRun) -> tuple[MlpUnit, ...]:
  """Return the MLPs with a decomposed site (a GLU model's; none for other
  targets): layers, or a mixture of experts' `(layer, expert)`."""
  units = set()
  for s in run.target.sites:
    parsed = glu_weights.parse_site(s.name)
    if parsed is not None and parsed[1] in ("gate", "up", "down"):
      units.add(parsed[0])
    elif parsed is not None and parsed[1] in glu_weights.EXPERT_ROLES:
      units.add((parsed[0], glu_weights.site_expert(s.name)))
  return tuple(sorted(units))


def site_mlps(run: explore.LoadedRun) -> tuple[tuple[str, MlpUnit], ...]:
  """Return each MLP site (a GLU model's) with the MLP whose neurons its
  matched baselines (`SITE_BASELINES`) take: its layer's, or its
  expert's."""
  out = []
  for s in run.target.sites:
    parsed = glu_weights.parse_site(s.name)
    if parsed is not None and parsed[1] in ("gate", "up", "down"):
      out.append((s.name, parsed[0]))
    elif parsed is not None and parsed[1] in glu_weights.EXPERT_ROLES:
      out.append((s.name, (parsed[0], glu_weights.site_expert(s.name))))
  return tuple(out)


def head_layers(run: explore.LoadedRun) -> tuple[int, ...]:
  """Return the layers with a decomposed attention site (a GLU model's)."""
  parsed = (glu_weights.parse_site(s.name) for s in run.target.sites)
  return tuple(sorted({p[0] for p in parsed
                       if p is not None and p[1] in ("q", "k", "v", "o")}))


def baseline_keys(layers: tuple[MlpUnit, ...],
                  heads: tuple[int, ...] = (),
                  mlp: MlpForm = MlpForm(),
                  sites: tuple[tuple[str, MlpUnit], ...] = ()
                  ) -> tuple[str, ...]:
  """Return the store keys of the baselines of `layers` (MLPs of form
  `mlp`), `heads` (attention) and `sites` (`site_mlps`)."""
  return tuple(f"{mlp_prefix(i)}.{kind}" for i in layers
               for kind in mlp_kinds(mlp)) + tuple(
    f"layers.{i}.self_attn.{HEADS}" for i in heads) + tuple(
    f"{site}.{kind}" for site, _ in sites for kind in SITE_BASELINES)


def _layer_o(weights: glu_weights.GluWeights, layer: int) -> jax.Array:
  """Return `o_proj` of a layer from whichever stored stack holds it."""
  at = 0
  for stack in (weights.prefix, weights.span, weights.tail):
    if stack is None:
      continue
    if layer < at + stack.o.shape[0]:
      return stack.o[layer - at]
    at += stack.o.shape[0]
  raise ValueError(f"layer {layer} is past the model's {at} layers")


def n_heads(run: explore.LoadedRun) -> int:
  """Return the attention heads of a GLU run's model."""
  return assembly.resolve_target(run.config).record.token_model.n_heads


def _mlp_taps(layers: tuple[MlpUnit, ...], mlp: MlpForm = MlpForm()
              ) -> tuple[str, ...]:
  roles = ("gate", "up") if mlp.gated else ("up",)
  routers = tuple(dict.fromkeys(
    glu_weights.router_tap(i[0]) for i in layers if isinstance(i, tuple)))
  return tuple(f"{mlp_prefix(i)}.{role}_proj.out" for i in layers
               for role in roles) + routers


def baseline_weights(run: explore.LoadedRun, settings: Settings,
                     layers: tuple[MlpUnit, ...], heads: tuple[int, ...]
                     ) -> dict[str, jax.Array]:
  """Return what the baselines' activities read besides the forward: the
  rotations of `layers` (`rotations`) and `o_proj` of `heads`, stacked."""
  out = {}
  if layers:
    out["rotation"] = rotations(run, settings, layers)
  if heads:
    out["w_o"] = jnp.stack([_layer_o(run.weights, i) for i in heads])
  return out


def rotations(run: explore.LoadedRun, settings: Settings,
              layers: tuple[MlpUnit, ...]) -> jax.Array:
  """Return the random rotation of each MLP's neurons (Haar, from the
  harvest's seed folded with the layer, then an expert's index):
  `[layers, d_ff, d_ff]`."""
  up = tuple(f"{mlp_prefix(i)}.up_proj.out" for i in layers)
  taps = jax.eval_shape(
    lambda w, x: run.target.clean_forward(w, x, up)[1],
    run.weights, batch_shape(run, settings))
  d_ff = taps[up[0]].shape[-1]
  key = jax.random.key(settings.seed)

  def folded(unit):
    if isinstance(unit, tuple):
      return jax.random.fold_in(jax.random.fold_in(key, unit[0]), unit[1])
    return jax.random.fold_in(key, unit)

  return jnp.stack([unit_activity.random_rotation(folded(i), d_ff)
                    for i in layers])


def _o_taps(heads: tuple[int, ...]) -> tuple[str, ...]:
  return tuple(f"layers.{i}.self_attn.o_proj" for i in heads)


def baseline_taps(layers: tuple[MlpUnit, ...], heads: tuple[int, ...],
                  mlp: MlpForm = MlpForm()) -> tuple[str, ...]:
  """Return the clean forward's taps the baselines' activities read."""
  return _mlp_taps(layers, mlp) + _o_taps(heads)


def _mlp_activity(taps: dict[str, jax.Array], unit: MlpUnit,
                  rotation: jax.Array, mlp: MlpForm) -> dict[str, jax.Array]:
  prefix = mlp_prefix(unit)
  up = taps[f"{prefix}.up_proj.out"]
  gate = taps[f"{prefix}.gate_proj.out"] if mlp.gated else None
  hidden = unit_activity.mlp_hidden(up, gate, mlp.act)
  gates = {} if gate is None else {
    "gates": unit_activity.gate_activity(gate, mlp.act)}
  out = {"neurons": unit_activity.neuron_activity(hidden), **gates,
         "rotated": unit_activity.rotated_activity(hidden, rotation)}
  if not isinstance(unit, tuple):
    return out
  # An expert's units count where its output does: by its routing weight
  # (≥ 0, so each stays a positive part).
  weight = mlp.routing(taps[glu_weights.router_tap(unit[0])])[..., unit[1], None]
  return {k: a * weight.astype(a.dtype) for k, a in out.items()}


def baseline_activity(taps: dict[str, jax.Array],
                      layers: tuple[MlpUnit, ...],
                      heads: tuple[int, ...], n_head: int,
                      extra: dict[str, Any],
                      mlp: MlpForm = MlpForm()) -> dict[str, jax.Array]:
  """Return every baseline's activity, by store key, from the clean
  forward's `baseline_taps` (traceable; `extra` from `baseline_weights`;
  the MLPs of form `mlp`)."""
  out = {}
  for j, i in enumerate(layers):
    for kind, a in _mlp_activity(taps, i, extra["rotation"][j],
                                 mlp).items():
      out[f"{mlp_prefix(i)}.{kind}"] = a
  for j, (i, key) in enumerate(zip(heads, _o_taps(heads))):
    out[f"layers.{i}.self_attn.{HEADS}"] = unit_activity.head_activity(
      taps[key], extra["w_o"][j], n_head)
  return out


def site_activity(activity: dict[str, jax.Array],
                  sites: tuple[tuple[str, MlpUnit], ...],
                  calibration: Optional[dict[str, dict[str, jax.Array]]]
                  ) -> dict[str, jax.Array]:
  """Return the matched baselines' activity of each site of `sites`
  (`SITE_BASELINES`, by store key) from its MLP's neurons in `activity`
  (`baseline_activity`), with the settings `calibrate` found (None only
  for no sites)."""
  out = {}
  for site, unit in sites:
    neurons = activity[f"{mlp_prefix(unit)}.neurons"]
    c = calibration[site]
    out[f"{site}.density_matched"] = unit_activity.density_matched_activity(
      neurons, c["threshold"])
    out[f"{site}.top_k"] = unit_activity.top_k_activity(neurons, c["k"])
  return out


def calibrate(run: explore.LoadedRun, placed: "Placed", inputs: Any,
              sites: tuple[tuple[str, MlpUnit], ...],
              layers: tuple[MlpUnit, ...], mlp: MlpForm,
              extra: dict[str, Any]) -> dict[str, dict[str, jax.Array]]:
  """Return per site of `sites` its matched baselines' settings, from one
  batch (`inputs`, the harvest's first): `q`, the median firing density
  (CI above 0) of the site's components that fire on it; `threshold`, the
  value each of its MLP's neurons exceeds at the share q of the batch's
  positions (`unit_activity.top_share_thresholds`); `k`, the ceiling of
  the site's mean CI-L0 on it."""
  wanted = _mlp_taps(layers, mlp)

  @jax.jit
  def measure(weights, components, ci_params, inputs, extra):
    ci, taps = explore.lower_ci_and_taps(
      run.target, run.ci_fn, weights, components, ci_params, inputs, wanted)
    out = {}
    for site, unit in sites:
      rotation = extra["rotation"][layers.index(unit)]
      neurons = _mlp_activity(taps, unit, rotation, mlp)["neurons"]
      q = unit_activity.median_alive_density(ci[site])
      out[site] = {
        "q": q, "threshold": unit_activity.top_share_thresholds(neurons, q),
        "k": jnp.ceil(unit_activity.mean_l0(ci[site])).astype(jnp.int32)}
    return out

  return measure(placed.weights, placed.components, placed.ci_params, inputs,
                 extra)


class Placed(NamedTuple):
  """A harvest's arrays where it computes: the frozen weights, the
  decomposition, and the layouts of each batch and of the statistics (None
  for the default device) with the hook that pins the CI to its layout."""

  weights: Any
  components: Any
  ci_params: Any
  inputs: Any
  statistics: Optional[NamedSharding]
  constrain: train_step.Constrain


def _specs(layout: table_lib.Layout, tree: Any, axes_fn: Callable,
           sizes: dict[str, int], prefix: str) -> Any:
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: table_lib.partition_spec(
      layout, axes_fn(path, leaf), tuple(leaf.shape), sizes,
      shardings.path_text(path, prefix)), tree)


def _largest(path: Any, leaf: Any) -> tuple[str, ...]:
  del path
  return ("largest",) * leaf.ndim


def place(run: explore.LoadedRun, settings: Settings,
          placement: Optional[shardings.Placement] = None) -> Placed:
  """Return the run's arrays laid out on `placement` (None: left where they
  are).

  Batches split over the `inputs` layout's batch axes; V/U take the
  `compute` layout, CI parameters `ci_weights` and frozen weights `frozen`
  (all replicated under `ddp`), and the statistics are replicated. Raises
  ValueError naming `batch_size` when a batch does not split over the mesh,
  and `table.LayoutError` where a `--place` layout does not tile.
  """
  d = run.decomposition
  if placement is None:
    return Placed(run.weights, d.components, d.ci_params, None, None,
                  train_step.no_constraint)
  mesh, table, _ = placement
  sizes = dict(mesh.shape)
  shape = batch_shape(run, settings)
  lead = tuple(run.target.batch_lead_shape(shape))
  try:
    inputs = shardings.batch_specs(table, shape, lead, sizes)
  except table_lib.LayoutError as e:
    if e.entry:  # an authored layout: the caller names its override
      raise
    raise ValueError(f"batch_size={settings.batch_size}: {e}") from None
  specs = (shardings.weights_specs(table, run.weights, sizes),
           _specs(table.layout("compute"), d.components,
                  shardings.component_axes, sizes, "components"),
           _specs(table.layout("ci_weights"), d.ci_params, _largest, sizes,
                  "ci_params"))
  weights, components, ci_params = (
    transfer.put(tree, shardings.named(mesh, spec)) for tree, spec in zip(
      (run.weights, d.components, d.ci_params), specs))
  return Placed(weights, components, ci_params,
                shardings.named(mesh, inputs),
                NamedSharding(mesh, PartitionSpec()),
                shardings.make_constrain(table, mesh, lead))


def empty_totals(shapes: dict[str, stats_lib.BatchStats],
                 tag_shapes: Optional[dict] = None) -> dict[str, dict]:
  """Return zero accumulators per site, shaped like one batch's statistics
  (counts in int64, top contexts empty; tag statistics where `tag_shapes`
  has the site)."""
  totals = {}
  for site, s in shapes.items():
    c = s.fired.shape[0]
    totals[site] = {
      "fired": np.zeros(c, np.int64),
      "ci_sum": np.zeros(c, np.float64),
      "histogram": np.zeros(s.histogram.shape, np.int64),
      "coactive": np.zeros(s.coactive.shape, np.int64),
      "top_ci": np.full(s.top_ci.shape, -np.inf, np.float32),
      "top_context": np.full(s.top_context.shape, stats_lib.NO_TOKEN,
                             s.top_context.dtype),
      "top_context_ci": np.zeros(s.top_context_ci.shape, np.float32),
      "ablation_sum": np.zeros(c, np.float64),
      "ablation_count": np.zeros(c, np.int64),
    }
  for key, (shape, _) in (tag_shapes or {}).items():
    zero = tag_profile.zero_tag_stats(shape.fine.shape[0], *_tag_sizes(shape))
    context = tag_context.zero_context_stats(*shape.fine.shape[:1],
                                             shape.coarse.shape[2])
    totals.setdefault(key, {}).update(zip(TAG_FIELDS, zero))
    totals[key].update(zip(CONTEXT_FIELDS, context))
  return totals


def _tag_sizes(shape: tag_profile.TagStats) -> tuple[int, int, int]:
  g, _, k = shape.coarse.shape
  return shape.fine.shape[1], k, g


def add_window(totals: dict,
               window: tuple[dict[str, stats_lib.BatchStats], dict]
               ) -> None:
  """Add the device's statistics of the batches since the last flush (and
  their tag statistics) into the host totals (counts in int64 and sums in
  float64, so a long harvest neither overflows nor loses its small
  increments)."""
  stats, tags = window
  for site, (s, c) in transfer.fetch(tags).items():
    t = totals[site]
    summed = tag_profile.add_tag_stats(
      tag_profile.TagStats(*(t[f] for f in TAG_FIELDS)), s)
    t.update(zip(TAG_FIELDS, summed))
    context = tag_context.add_context_stats(
      tag_context.ContextStats(*(t[f] for f in CONTEXT_FIELDS)), c)
    t.update(zip(CONTEXT_FIELDS, context))
  for site, s in transfer.fetch(stats).items():
    t = totals[site]
    t["fired"] += s.fired
    t["ci_sum"] += s.ci_sum
    t["histogram"] += s.histogram
    t["coactive"] += s.coactive
    top = stats_lib.merge_top(
      tuple(map(jnp.asarray, (t["top_ci"], t["top_context"],
                              t["top_context_ci"]))),
      tuple(map(jnp.asarray, (s.top_ci, s.top_context, s.top_context_ci))))
    t["top_ci"], t["top_context"], t["top_context_ci"] = map(np.asarray, top)


def fired_components(run: explore.LoadedRun, ci: dict[str, np.ndarray],
                     threshold: float) -> tuple[np.ndarray, np.ndarray]:
  """Return `(site_of, index_of)` of every component that fired on a batch
  (CI above `threshold` at some position), in the run's site order: the
  only ones whose ablation adds to the harvest, summed where they fire."""
  site_of, index_of = [], []
  for k, site in enumerate(run.target.sites):
    fired = np.flatnonzero(
      (ci[site.name] > threshold).reshape(-1, site.c).any(axis=0))
    site_of.append(np.full(len(fired), k, np.int32))
    index_of.append(fired.astype(np.int32))
  return np.concatenate(site_of), np.concatenate(index_of)


def empty_ablation(run: explore.LoadedRun) -> dict[str, dict]:
  """Return one batch's ablation sums and counts per site, zero."""
  return {s.name: {"ablation_sum": np.zeros(s.c, np.float64),
                   "ablation_count": np.zeros(s.c, np.int64)}
          for s in run.target.sites}


def add_ablation(sums: dict, run: explore.LoadedRun, site_of: np.ndarray,
                 index_of: np.ndarray, divergence: np.ndarray,
                 ci: dict[str, np.ndarray], threshold: float) -> None:
  """Add the divergence of each listed component's ablation (`divergence[j]`
  that of component `index_of[j]` of site `site_of[j]`), summed over the
  positions where that component fires, and those positions' count."""
  names = [s.name for s in run.target.sites]
  for j, (k, c) in enumerate(zip(site_of, index_of)):
    fired = ci[names[k]][..., c] > threshold
    sums[names[k]]["ablation_sum"][c] += np.sum(divergence[j] * fired)
    sums[names[k]]["ablation_count"][c] += np.sum(fired)


def _padded(x: np.ndarray, size: int) -> np.ndarray:
  """Return `x` (not empty) padded to `size` with its last entry, so every
  chunk of components runs one compiled program."""
  return np.concatenate([x, np.repeat(x[-1:], size - len(x))])


def _window_layout(placed: Optional[Placed]) -> tuple[Callable, dict]:
  """Return the CI's constraint and the window's jit options on `placed`."""
  if placed is None or placed.statistics is None:
    return train_step.no_constraint, {}
  # A fixed layout, so the donated window is reused in place and each
  # flush reads it from one device.
  return placed.constrain, {"out_shardings": (placed.statistics, None)}


def jitted(run: explore.LoadedRun, settings: Settings, chunk: int,
           placed: Optional[Placed] = None,
           coarse_of: Optional[np.ndarray] = None,
           layers: tuple[MlpUnit, ...] = (), heads: tuple[int, ...] = (),
           n_head: int = 0, mlp: MlpForm = MlpForm(),
           sites: tuple[tuple[str, MlpUnit], ...] = ()):
  """Return the jitted batch statistics, the accumulation of one batch
  into the device's window of statistics, the ablation of `chunk`
  components (site and index each, beside the clean output) and the plain
  clean forward, which the throughput is compared with. With `placed`, the CI
  keeps its layout and the window stays replicated.

  The window is `(statistics, tag statistics)` per site; the second is
  empty unless `coarse_of` is given, and then each batch comes with its
  positions' `(tags, previous tags, groups)` and the tag statistics hold
  the baselines of `layers`, `heads` and `sites` (reading `extra` besides
  the forward; MLPs of form `mlp`), each a pair (tags, context)."""
  target, ci_fn = run.target, run.ci_fn
  constrain, kept = _window_layout(placed)

  def stats(weights, components, ci_params, inputs, positions=None,
            extra=None):
    ci, taps = explore.lower_ci_and_taps(
      target, ci_fn, weights, components, ci_params, inputs,
      baseline_taps(layers, heads, mlp) if coarse_of is not None else ())
    ci = constrain("ci_activations", ci)
    batch = {site: stats_lib.batch_stats(
      value, inputs, settings.threshold, settings.top_k, settings.before,
      settings.after) for site, value in ci.items()}
    if coarse_of is None:
      return (batch, {}), ci
    # No baselines (`layers` and `heads` empty) adds nothing.
    activity = {**ci, **baseline_activity(taps, layers, heads, n_head,
                                          extra, mlp)}
    activity.update(site_activity(activity, sites, extra.get("calibration")))
    return (batch, _tag_batch(activity, inputs, positions, coarse_of,
                              settings.tag_groups, extra)), ci

  def accumulate(window, weights, components, ci_params, inputs,
                 positions=None, extra=None):
    (batch, tags), ci = stats(weights, components, ci_params, inputs,
                              positions, extra)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
    return ({site: stats_lib.add_stats(window[0][site], batch[site])
             for site in window[0]},
            {site: add(window[1][site], tags[site]) for site in window[1]}
            ), ci

  def ablation(weights, components, inputs, clean_output, site_of,
               index_of):
    lead = tuple(target.batch_lead_shape(inputs))
    return stats_lib.ablation_divergence(
      target, weights, components, inputs, clean_output, lead, site_of,
      index_of, chunk)

  def clean(weights, inputs):
    return target.clean_forward(weights, inputs, ci_fn.input_taps)[0]

  return (jax.jit(stats), jax.jit(accumulate, donate_argnums=0, **kept),
          jax.jit(ablation), jax.jit(clean))


def _tag_batch(activity: dict[str, jax.Array], inputs: jax.Array,
               positions: tuple, coarse_of: np.ndarray, n_groups: int,
               extra: dict[str, Any]) -> dict[str, tuple]:
  """Return each unit set's tag and context statistics of one batch."""
  return {key: (tag_profile.batch_tag_stats(
    value, *positions, jnp.asarray(coarse_of), len(brown_tags.COARSE),
    n_groups), tag_context.batch_context_stats(value, inputs, extra["mix"]))
          for key, value in activity.items()}


def _progress(done: int, total: int, started: float, first: int) -> str:
  rate = (done - first) / max(time.time() - started, 1e-9)
  eta = (total - done) / rate if rate > 0 else float("inf")
  return (f"[harvest] batch {done}/{total}  {rate:.1f} batches/s  "
          f"ETA {eta:.0f}s")


def _fresh_window(shapes: tuple[dict, dict], placed: Placed
                  ) -> Callable[[], tuple[dict, dict]]:
  def fresh():
    zeros = lambda x: jnp.zeros(x.shape, x.dtype)  # noqa: E731
    return ({site: stats_lib.zero_stats(shape)
             for site, shape in shapes[0].items()},
            jax.tree.map(zeros, shapes[1]))

  if placed.statistics is None:
    return fresh
  return jax.jit(fresh, out_shardings=placed.statistics)


def _never() -> bool:
  return False


class _Pipeline(NamedTuple):
  """A harvest's batches, tag positions, baseline weights and jitted
  functions (`jitted`), set up once; `shapes` are its window's."""

  batch: Callable[[int], Any]
  positions: Callable[[int], Any]
  extra: dict[str, Any]
  accumulate: Any
  ablation: Any
  clean: Any
  shapes: tuple[dict, dict]
  tag_record: dict
  chunk: int


def _pipeline(run: explore.LoadedRun, settings: Settings, chunk: int,
              placed: Placed) -> _Pipeline:
  batch = batch_source(run, settings, placed.inputs)
  tags = tag_source(settings, placed.inputs)
  positions = (lambda i: None) if tags is None else tags.read
  layers = () if tags is None else baseline_layers(run)
  heads = () if tags is None else head_layers(run)
  sites = () if tags is None else site_mlps(run)
  extra = baseline_weights(run, settings, layers, heads)
  mlp = mlp_form(run) if layers else MlpForm()
  calibration = calibrate(run, placed, batch(0), sites, layers, mlp,
                          extra) if sites else {}
  if tags is not None:
    extra = {**extra, "mix": jnp.asarray(tags.mix, jnp.float32),
             "calibration": calibration}
  if placed.statistics is not None:
    extra = transfer.put(extra, jax.tree.map(lambda _: placed.statistics,
                                             extra))
  stats_fn, accumulate, ablation_fn, clean_fn = jitted(
    run, settings, chunk, placed,
    None if tags is None else tags.coarse_of, layers, heads,
    n_heads(run) if heads else 0, mlp, sites)
  shapes, _ = jax.eval_shape(stats_fn, placed.weights, placed.components,
                             placed.ci_params, batch(0), positions(0), extra)
  tag_record = {} if tags is None else {"tags": {
    **tags.record, "baselines": list(baseline_keys(layers, heads, mlp,
                                                   sites)),
    "calibration": calibration_record(calibration)}}
  return _Pipeline(batch, positions, extra, accumulate, ablation_fn,
                   clean_fn, shapes, tag_record, chunk)


def calibration_record(calibration: dict[str, dict[str, jax.Array]]
                       ) -> dict[str, dict[str, float | int | None]]:
  """Return what the manifest says of each site's calibration: its q
  (None where no component fired on the batch) and its k."""
  out = {}
  for site, c in transfer.fetch(calibration).items():
    q = float(c["q"])
    out[site] = {"q": q if np.isfinite(q) else None, "k": int(c["k"])}
  return out


def harvest(run: explore.LoadedRun, settings: Settings, out: str,
            save_every_s: float = 60.0, ablation_chunk: int = 16,
            overwrite: bool = False,
            say: Callable[[str], None] = print,
            placement: Optional[shardings.Placement] = None,
            stop: Callable[[], bool] = _never,
            progress_every_s: float = ABLATION_PROGRESS_S) -> dict:
  """Run the harvest into `out` (resuming a saved one, or replacing one
  made with other settings when `overwrite`) and return its record: the
  arrays written and the throughput beside a clean forward ({} when `out`
  already holds this harvest, complete). With `placement`, on its mesh
  (`place`; ValueError when the batch does not split over it).

  `stop()` is asked before each batch and each chunk of ablations: when
  true, the progress since the last save is saved and `Stopped` raised (a
  batch whose ablations were cut short is left for the resumed harvest;
  once every batch is done, the harvest finishes instead, without timing
  the clean forward). The ablations say their progress every
  `progress_every_s` seconds.
  """
  check_cadence(save_every_s, ablation_chunk)
  placed = place(run, settings, placement)
  harvest_store.prepare(out, say)
  pipe = _pipeline(run, settings, ablation_chunk, placed)
  totals = empty_totals(*pipe.shapes)
  done = harvest_store.resume(out, totals, dataclasses.asdict(settings),
                              overwrite)
  if done < 0:
    say(f"[harvest] {out} is complete; nothing to do")
    return {}
  if done:
    say(f"[harvest] resuming after batch {done}")
  harvest_seconds, timed_start = _run_batches(
    run, settings, out, placed, pipe, totals, done, save_every_s,
    _Ablating(say, stop, progress_every_s))
  written = harvest_store.write_store(out, totals,
                                     FIELDS + TAG_FIELDS + CONTEXT_FIELDS)
  if stop():  # timing the clean forward is all that is left
    return {"arrays": written, **pipe.tag_record}
  return {"arrays": written, **pipe.tag_record, **throughput(
    pipe.clean, placed.weights, pipe.batch, harvest_seconds,
    settings.n_batches - timed_start)}


class _Ablating(NamedTuple):
  """How a harvest talks and stops: `say` its lines, `stop()` asked
  between batches and chunks of ablations, `every_s` the seconds between
  the ablations' progress lines."""

  say: Callable[[str], None]
  stop: Callable[[], bool]
  every_s: float


def _ablation_progress(batch: int, batches: int, done: int, total: int,
                       since: tuple[float, int]) -> str:
  """Return a progress line, the rate counted from `since` (a time and the
  components done then)."""
  rate = (done - since[1]) / max(time.time() - since[0], 1e-9)
  eta = (total - done) / rate if rate > 0 else float("inf")
  return (f"[harvest] ablation batch {batch}/{batches}: component "
          f"{done}/{total}  {rate:.1f} components/s  ETA {eta:.0f}s")


def _ablate(run: explore.LoadedRun, settings: Settings, placed: Placed,
            pipe: _Pipeline, i: int, inputs: Any, ci: Any,
            talk: _Ablating) -> Optional[dict]:
  """Return batch `i`'s ablation sums per site (`empty_ablation`), one
  chunk of the components that fired at a time, saying the progress by
  the clock; None when `talk.stop()` came first."""
  ci = transfer.fetch(ci)
  site_of, index_of = fired_components(run, ci, settings.threshold)
  n, chunk = len(site_of), pipe.chunk
  talk.say(f"[harvest] ablation batch {i + 1}/{settings.ablation_batches}: "
           f"the {n} of {sum(s.c for s in run.target.sites)} components "
           f"that fired, {chunk} at a time")
  sums = empty_ablation(run)
  clean = pipe.clean(placed.weights, inputs)
  # The rate from the end of the first chunk, which compiles.
  said = time.time()
  since = said, 0
  for at in range(0, n, chunk):
    if talk.stop():
      return None
    block = slice(at, at + chunk)
    divergence = transfer.fetch(pipe.ablation(
      placed.weights, placed.components, inputs, clean,
      *(jnp.asarray(_padded(x[block], chunk)) for x in (site_of, index_of))))
    add_ablation(sums, run, site_of[block], index_of[block], divergence, ci,
                 settings.threshold)
    done = min(at + chunk, n)
    if time.time() - said >= talk.every_s or done == n:
      talk.say(_ablation_progress(i + 1, settings.ablation_batches, done, n,
                                  since))
      said = time.time()
    if at == 0 and done < n:
      since = time.time(), done
  return sums


def _add_ablations(run: explore.LoadedRun, settings: Settings, out: str,
                   placed: Placed, pipe: _Pipeline, totals: dict, i: int,
                   inputs: Any, ci: Any, talk: _Ablating,
                   saved_done: int) -> None:
  """Add batch `i`'s ablations to `totals` (which hold the batches before
  it); stopped before they end, save those totals and raise `Stopped`:
  the resumed harvest redoes batch `i`."""
  sums = _ablate(run, settings, placed, pipe, i, inputs, ci, talk)
  if sums is None:
    if i > saved_done:
      harvest_store.save_state(out, totals, i, dataclasses.asdict(settings))
    raise Stopped(i, settings.n_batches)
  for site, t in sums.items():
    for name, value in t.items():
      totals[site][name] += value


def _save(out: str, totals: dict, window: Any, i: int,
          settings: Settings) -> None:
  add_window(totals, window)
  harvest_store.save_state(out, totals, i, dataclasses.asdict(settings))


def _run_batches(run: explore.LoadedRun, settings: Settings, out: str,
                 placed: Placed, pipe: _Pipeline, totals: dict, done: int,
                 save_every_s: float, talk: _Ablating) -> tuple[float, int]:
  """Add batches `done`… to `totals`, saving the state by the clock and
  when stopped (`Stopped`); return the seconds the timed batches took and
  the first of them."""
  fresh_window = _fresh_window(pipe.shapes, placed)
  # Batches accumulate on the device, with no host sync, until the next
  # save, ablation batch or the end fetches the window into the host
  # totals; `held` is the window's first batch.
  window, held = fresh_window(), done
  started, first, timed_from = time.time(), done, None
  saved, saved_done = started, done
  timed_start = max(first + 1, settings.ablation_batches)
  for i in range(done, settings.n_batches):
    if talk.stop():
      if i > saved_done:
        _save(out, totals, window, i, settings)
      raise Stopped(i, settings.n_batches)
    # Timed from the first batch after the compile and the ablations,
    # which a clean forward does not do.
    if i == timed_start:
      jax.block_until_ready(window)
      timed_from = time.time()
    ablating = i < settings.ablation_batches
    if ablating and i > held:  # the totals before batch i, should it stop
      add_window(totals, window)
      window, held = fresh_window(), i
    inputs = pipe.batch(i)
    window, ci = pipe.accumulate(window, placed.weights, placed.components,
                                 placed.ci_params, inputs, pipe.positions(i),
                                 pipe.extra)
    if ablating:
      _add_ablations(run, settings, out, placed, pipe, totals, i, inputs, ci,
                     talk, saved_done)
    # Saves go by the clock: a fixed batch count would, on a small model,
    # spend most of the harvest writing state.
    if (time.time() - saved >= save_every_s
        and i + 1 < settings.n_batches):
      _save(out, totals, window, i + 1, settings)
      window, held = fresh_window(), i + 1
      saved, saved_done = time.time(), i + 1
    if (i + 1) % max(1, settings.n_batches // 10) == 0:
      talk.say(_progress(i + 1, settings.n_batches, started, first))
  jax.block_until_ready(window)
  harvest_seconds = time.time() - timed_from if timed_from else 0.0
  add_window(totals, window)
  return harvest_seconds, timed_start


def throughput(clean_fn, weights, batch, harvest_seconds: float,
               timed_batches: int) -> dict:
  """Return the harvest's batches/s beside a clean forward's over the same
  batches (timed now, after one compiling call), with the weights the
  harvest used."""
  if timed_batches <= 0 or harvest_seconds <= 0:
    return {}
  jax.block_until_ready(clean_fn(weights, batch(0)))
  t0 = time.time()
  # Dispatched back to back, as the harvest's batches are.
  outputs = [clean_fn(weights, batch(i))
             for i in range(1, timed_batches + 1)]
  jax.block_until_ready(outputs)
  clean_seconds = time.time() - t0
  return {"harvest_batches_per_s": timed_batches / harvest_seconds,
          "clean_batches_per_s": timed_batches / clean_seconds,
          "ratio_to_clean": clean_seconds / harvest_seconds}


def write_manifest(out: str, run_path: str, run: explore.LoadedRun,
                   settings: Settings, record: dict) -> str:
  """Write `manifest.json` (last: its presence marks the harvest done)."""
  manifest = {
    "run_dir": os.path.abspath(run_path),
    "settings": dataclasses.asdict(settings),
    "sites": {s.name: s.c for s in run.target.sites},
    "positions": settings.n_batches * settings.batch_size * settings.seq_len,
    "histogram_bands": {"floor": evals.LOG_DENSITY_MIN,
                        "bins": evals.LOG_DENSITY_BINS},
    **record,
  }
  return harvest_store.write_manifest(out, manifest)


class Harvest(NamedTuple):
  """A completed harvest read back: its manifest and, per site, every
  statistic as a host array; per baseline key (`BASELINES`), its tag
  statistics."""

  manifest: dict
  sites: dict[str, dict[str, np.ndarray]]
  baselines: dict[str, dict[str, np.ndarray]]


def has_context(manifest: dict) -> bool:
  """Return whether a harvest holds the context statistics and matched
  baselines (`TAG_REVISION` 1; older tag harvests do not: harvest again
  with `--overwrite` for them)."""
  return manifest["settings"].get("tag_revision", 0) >= 1


def load_harvest(run_path: str) -> Harvest:
  """Return the harvest of the run at `run_path`; ValueError when it has
  none, or an unfinished one (no manifest yet)."""
  manifest = harvest_store.read_manifest(run_path)
  tagged = "tags" in manifest
  tag_fields = (TAG_FIELDS + (CONTEXT_FIELDS if has_context(manifest)
                              else ())) if tagged else ()
  sites = {site: harvest_store.read_arrays(run_path, site,
                                           FIELDS + tag_fields)
           for site in manifest["sites"]}
  baselines = {key: harvest_store.read_arrays(run_path, key, tag_fields)
               for key in (manifest["tags"].get("baselines", [])
                           if tagged else [])}
  return Harvest(manifest, sites, baselines)
