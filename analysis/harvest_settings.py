"""A harvest's settings: what a user asks for (`Request`), checked and
resolved against a finished run into `Settings` (a toy's input shape
included), the statistics' field names, and the sizes a harvest reads off a
run or a token file (batches in it, the tag groups, the default ablation
batches).
"""

import dataclasses
import os
from typing import Optional

import jax

from decompax.analysis import explore
from decompax.io import tokens as tokens_lib
from decompax.measures import tag_context, tag_profile
from decompax.recipe import lm
from decompax.targets import registry


FIELDS = ("fired", "ci_sum", "histogram", "coactive", "top_ci", "top_context",
          "top_context_ci", "ablation_sum", "ablation_count")
TAG_FIELDS = tuple(f"tag_{name}" for name in tag_profile.TagStats._fields)
# Each unit set's context statistics (`measures/tag_context.py`): harvests of
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
# has a decomposed site (`measures/unit_activity.py`): store keys
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


def toy_batch(run: explore.LoadedRun, batch_size: int):
  toy = registry.get(run.config.target)
  return jax.eval_shape(lambda k: toy.sample_inputs(k, batch_size),
                        jax.random.key(0))


def _toy_lead(run: explore.LoadedRun, batch_size: int) -> tuple[int, ...]:
  return tuple(run.target.batch_lead_shape(toy_batch(run, batch_size)))


def _toy_sequences(run: explore.LoadedRun, batch_size: int) -> bool:
  """Return whether a toy's inputs are sequences (its contexts windows)."""
  return len(_toy_lead(run, batch_size)) == 2


def toy_seq_len(run: explore.LoadedRun, batch_size: int) -> int:
  """Return the positions per input of a toy's own batches (1 for inputs
  without a sequence axis)."""
  lead = _toy_lead(run, batch_size)
  return lead[1] if len(lead) == 2 else 1
