"""Browse harvested decompositions: `bin/browse --run_dir=DIR[,DIR…]`.

A local server (127.0.0.1 by default) with one page: the component table of
every site (sortable, filterable, searchable by a token of the top
contexts; its ablation column named by the run's divergence), a
component's page (top contexts shaded by CI, none for a dead component,
CI histogram, V/U norms, the components it fires with), and, for
language models, a prompt box that shows the next token predictions with
chosen components ablated, beside the clean model's, with the KL per
position (a toy's inputs are feature vectors: it gets no prompt box).
Its mode selector also masks every component as the evaluation does
(CI-masked, stochastic, adversarial PGD: `/intervene`), and a component's
page sweeps its mask over [0, 2] on the prompt and draws the clean top
token's log-probability against the mask value (`/sweep`,
`explore.mask_sweep`). The graph button draws the prompt's attribution
graph (`/graph`, `explore.attribution_graph`): the alive components by site
and position, edges by gradient × mask weight to the clean top token's
logit after the prompt; a node opens its component. Each run needs a
finished harvest (`bin/harvest`).
A prompt is token ids, or text where the run's model has a tokenizer. A
targeted run's component page also shows the component's A/B grid: its CI
at the answer position over every operand pair, from the run's snapshot
(`report/ab_grid_data.js`, read on its first request, then kept). Where
`bin/cluster` left clusters beside the harvest, a chosen site lists its
clusters as units (members, the positions the cluster fires, its joint
ablation effect beside the sum of its members'); a member opens its
component.

A run harvested over a token file with a tag stream is labelled by part of
speech (`analysis/unit_labels.py`): the table gains each component's top
class, top tag, purity, lift and excess over its token-implied purity
(sort and filter by them), its page its label (with its token-implied
purity) and contexts as text with each token's tag on hover, and a
"neurons" view lists the baselines' units (neurons, the neurons matched
to each site, gates, rotated neurons, heads) alike, a unit's page beside
the component's. Those
contexts come from the harvest's first batches streamed again
(`analysis/unit_contexts.py`), on the first request that needs them.

Requests name runs by their index in `--run_dir` and sites by name; no
path from a request reaches the file system, and the one file read while
serving (the A/B grid) is opened only as a regular file of bounded size.
Prompts are padded to a few fixed lengths, so a new prompt reuses a
compiled forward. `browse_server` serves the app: threaded, with socket
timeouts, answering only for this host and refusing writes from other
origins. `--host` other than loopback is warned about.
"""

import importlib.resources
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from decompax.analysis import (
  attribution, explore, harvest_settings, interventions, unit_contexts,
  unit_labels)
from decompax.analysis import harvesting as harvest_lib
from decompax.bin import cli
from decompax.core import sites as sites_lib
from decompax.io import harvest_store, hf_checkpoint, tensor_store
from decompax.render import ab_grid
from decompax.render import run_report as report
from decompax.io import tokens as tokens_lib
from decompax.render import ab_grid
from decompax.render import run_report as report

# A row's label fields in the tables (the rest show on a unit's page).
LABEL_FIELDS = ("class", "tag", "purity", "lift", "excess")

# Not `required`: tests import this module beside other binaries' flags,
# and a required flag would fail their parses; main checks it instead.
_RUN_DIRS = flags.DEFINE_list(
  "run_dir", None, "Run directories with a finished harvest.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to serve on.")
_PORT = flags.DEFINE_integer("port", 8470, "Port to serve on (0: any free).",
                             lower_bound=0, upper_bound=65535)
_CONTEXT_BATCHES = flags.DEFINE_integer(
  "context_batches", unit_contexts.SAMPLE_BATCHES,
  "A tagged run's contexts with tags come from this many of its harvest's "
  "first batches, streamed again on the first request.", lower_bound=1)

# Prompts pad to the first of these lengths that holds them.
BUCKETS = (16, 32, 64, 128, 256)
MAX_BODY_BYTES = 1 << 16
# A request body is an object of prompt and site lists: 3 levels deep.
MAX_JSON_DEPTH = 16
# A prompt part of digits alone is a token id; one this long is no vocab's.
MAX_ID_DIGITS = 12
TOKEN_ID = re.compile(r"[+-]?[0-9]+")
# A JSON string, escapes included: brackets inside one do not nest.
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# A client that sends or takes nothing this long is disconnected; each
# connection has its own thread, at most this many at once.
SOCKET_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
MAX_ABLATED = 4096
TOP_PREDICTIONS = 5
# A mask sweep's default points, evenly over [0, 2], and its most.
SWEEP_POINTS = 21
MAX_SWEEP_POINTS = 101
CONTEXTS_SHOWN = 20
# An attribution graph's default share of each target's incoming
# attribution, and its most expanded targets (one backward pass each).
GRAPH_SHARE = 0.9
GRAPH_TARGETS = 32
# A snapshot is parsed whole into Python lists; past this the server
# refuses it rather than hold many times its size in memory.
MAX_AB_GRID_BYTES = 1 << 28
NO_TOKENIZER = ("this run has no tokenizer: type whitespace-separated token "
                "ids, e.g. '3 17 5'")

# `text -> token ids` of a run's tokenizer; ValueError for text it refuses.
Encoder = Callable[[str], list[int]]


class Tagged(NamedTuple):
  """A tagged harvest's part-of-speech view: every unit set's labels by
  store key (sites and baselines), and the token file and tag stream its
  contexts are read from."""

  classes: list[str]
  tags: list[str]
  coarse_of: list[int]  # each tag's class
  labels: dict[str, list[dict]]
  baselines: list[str]
  settings: harvest_settings.Settings
  ids: np.ndarray
  tag_ids: np.ndarray


class Served(NamedTuple):
  """One run as the browser serves it."""

  name: str
  run: explore.LoadedRun
  harvest: harvest_lib.Harvest
  rows: list[dict]
  decode: Callable[[int], str]
  # Toys: each site's CI on the one-feature probe inputs, [n_features, C].
  probe: dict[str, np.ndarray]
  # Token models: the vocabulary size prompts are checked against.
  vocab: int | None
  # Models with a tokenizer: how typed text becomes token ids.
  encode: Encoder | None
  # Harvests of a token file with a tag stream: labels and tagged contexts.
  tagged: Tagged | None = None
  # Clusters `bin/cluster` wrote beside the harvest (`clusters.json`).
  clusters: dict | None = None


class AbGrid(NamedTuple):
  """A run's A/B grid snapshot, its components keyed by (site, component)."""

  step: int
  operators: list[str]
  shape: list[int]
  roles: list[str]
  components: dict[tuple[str, int], dict]


class BadRequest(Exception):
  """A request the server refuses: its status and a one-line reason."""

  def __init__(self, status: int, reason: str):
    super().__init__(reason)
    self.status = status


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("browse", message)


def serve_run(path: str) -> Served:
  """Return the run at `path` with its harvest, ready to serve."""
  run = explore.load_run(path)
  harvest = load_harvest(path)
  rows = explore.component_rows(run, harvest.sites,
                                harvest.manifest["positions"])
  probe = {}
  if run.target.feature_probe is not None:
    probe = {site: np.asarray(ci) for site, ci in explore.component_ci(
      run, run.target.feature_probe()).items()}
  vocab = (explore.vocab_size(run) if run.target.token_labels is not None
           else None)
  tagged = tag_view(harvest)
  if tagged is not None:
    rows = [{**r, **{f: tagged.labels[r["site"]][r["component"]][f]
                     for f in LABEL_FIELDS}} for r in rows]
  return Served(path, run, harvest, rows, token_decoder(run), probe, vocab,
                text_encoder(run.config.model_dir), tagged,
                harvest_clusters(path, harvest.manifest))


# What a clusters file shares with the harvest it was made from.
CLUSTER_KEYS = ("positions", "threshold", "decomposition_step")


def harvest_clusters(path: str, manifest: dict) -> dict | None:
  """Return the clusters beside the harvest of the run at `path` (None
  without); ValueError for a file made from another harvest."""
  record = harvest_store.read_clusters(path)
  if record is None:
    return None
  made = {"positions": manifest["positions"],
          "threshold": manifest["settings"]["threshold"],
          "decomposition_step": manifest["settings"]["decomposition_step"]}
  if any(record.get(k) != made[k] for k in CLUSTER_KEYS):
    raise ValueError(f"{harvest_store.clusters_path(path)} was made from "
                     f"another harvest; rerun bin/cluster --run_dir={path}")
  return record


def site_clusters(served: Served, site: str) -> dict:
  """Return a site's clusters; BadRequest where the run has none."""
  if served.clusters is None:
    raise BadRequest(404, "this run has no clusters; run bin/cluster "
                     "--run_dir=<run> and serve it again")
  if site not in served.clusters["sites"]:
    raise BadRequest(404, f"no site {site!r} in this run's clusters")
  return served.clusters["sites"][site]


def tag_view(harvest: harvest_lib.Harvest) -> Tagged | None:
  """Return a tagged harvest's labels and tagged token stream (None for a
  harvest without tag statistics); ValueError when its token file or tag
  stream cannot be opened."""
  if not unit_labels.tagged(harvest):
    return None
  settings = unit_contexts.settings_of(harvest.manifest)
  try:
    opened = tokens_lib.open_tokens(settings.data_path)
    stream = tokens_lib.open_tags(opened)
  except OSError as e:
    raise ValueError(f"the harvest's token file cannot be read ({e}); "
                     "restore it or harvest again") from None
  record = harvest.manifest["tags"]
  return Tagged(
    list(record["classes"]), list(record["tags"]),
    list(record["coarse_of"]),
    {key: unit_labels.labels(harvest, key)
     for key in unit_labels.unit_sets(harvest)},
    list(record.get("baselines", [])), settings, opened.ids, stream.ids)


def tag_note(tagged: Tagged, tag: int) -> str:
  """Return a token's tag as its hover note reads it: `tag (class)`."""
  return f"tag {tagged.tags[tag]} ({tagged.classes[tagged.coarse_of[tag]]})"


def tagged_contexts(served: Served, top: unit_contexts.Top, unit: int,
                    what: str) -> list[dict]:
  """Return a unit's contexts over the tagged sample as the page draws
  them: tokens as text, the position where it is most active shaded, and
  per token its tag (and the activity, `what`, at that position) on
  hover."""
  tagged = served.tagged
  settings = tagged.settings
  out = []
  for x in unit_contexts.contexts(top, unit, tagged.ids, tagged.tag_ids,
                                  settings.seq_len, settings.before,
                                  settings.after)[:CONTEXTS_SHOWN]:
    notes = [tag_note(tagged, t) for t in x.tags]
    notes[x.focus] += f" · {what} {x.activity:.3g}"
    out.append({"ci": x.activity,
                "tokens": [served.decode(i) for i in x.ids],
                "tags": [tagged.tags[t] for t in x.tags],
                "shade": [float(i == x.focus) for i in range(len(x.ids))],
                "notes": notes, "focus": x.focus})
  return out


def unit_rows(served: Served, key: str) -> list[dict]:
  """Return the table of a baseline's units: their labels and their share
  of the set's activity."""
  tagged = served.tagged
  if tagged is None:
    raise BadRequest(404, "this run's harvest has no tag statistics: "
                     "harvest a token file with a tag stream")
  if key not in tagged.baselines:
    raise BadRequest(404, f"no baseline {key!r} in this harvest; it has "
                     f"{', '.join(tagged.baselines) or 'none'}")
  return [{"key": key, **{f: r[f] for f in ("unit", "activity",
                                             *LABEL_FIELDS)}}
          for r in tagged.labels[key]]


def unit_page(served: Served, key: str, unit: int,
              top: dict[str, unit_contexts.Top]) -> dict:
  """Return what a baseline unit's page shows: its label, heaviest tags
  and bigrams, and its contexts over the tagged sample."""
  rows = unit_rows(served, key)
  if not 0 <= unit < len(rows):
    raise BadRequest(404, f"{key} has no unit {unit}")
  label = served.tagged.labels[key][unit]
  return {"key": key, **label,
          "contexts": tagged_contexts(served, top[key], unit, "activity")}


def load_harvest(path: str) -> harvest_lib.Harvest:
  """Return the finished harvest of the run at `path`; ValueError naming
  what is missing or damaged, and how to harvest again."""
  out = os.path.join(path, harvest_store.HARVEST_DIR)
  again = f"rerun bin/harvest --run_dir={path} --overwrite to harvest again"
  try:
    return harvest_lib.load_harvest(path)
  except tensor_store.StoreError as e:   # an array deleted or cut short
    raise ValueError(f"a harvest array in {out} cannot be read ({e}); "
                     f"{again}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{out}/{harvest_store.MANIFEST} is not JSON ({e}); "
                     f"{again}") from None
  except (KeyError, TypeError) as e:
    raise ValueError(f"{out}/{harvest_store.MANIFEST} lacks {_one_line(e)}; "
                     f"{again}") from None


def token_decoder(run: explore.LoadedRun) -> Callable[[int], str]:
  """Return `id -> text`: the run's tokenizer where it has one, else the id."""
  if run.config.model_dir:
    from decompax.bin import tokens_text  # noqa: PLC0415 (LM runs only)
    return tokens_text.token_decoder(run.config.model_dir)
  return str


def text_encoder(model_dir: str | None) -> Encoder | None:
  """Return the encoder of the tokenizer in `model_dir`, or None where there
  is no loadable one (prompts are then token ids only)."""
  if not model_dir or not hf_checkpoint.has_tokenizer(model_dir):
    return None
  try:
    tokenizer = hf_checkpoint.read_tokenizer(model_dir)
  except ValueError:
    # The decoder has already said why on the console; ids still work.
    return None

  def encode(text: str) -> list[int]:
    # No special tokens: the decomposition was trained on raw windows cut
    # anywhere from the token stream, not on sequences that open with BOS,
    # so a prompt should look like such a window.
    try:
      return [int(i) for i in tokenizer(
        text, add_special_tokens=False)["input_ids"]]
    # The tokenizers library raises a bare Exception for text it cannot
    # encode (a word missing from a vocabulary without an unknown token).
    except Exception as e:  # noqa: BLE001
      raise ValueError(" ".join(str(e).split())) from None

  return encode


def prompt_ids(text: str, encode: Encoder | None, vocab: int) -> list[int]:
  """Return `text` as token ids: itself when it is whitespace-separated
  integers (ASCII digits), else its encoding by the run's tokenizer."""
  parts = text.split()
  if all(TOKEN_ID.fullmatch(part) for part in parts):
    # Past a few digits, no id is in a vocabulary (and past 4300, Python
    # refuses to convert one).
    for part in parts:
      if len(part.lstrip("+-")) > MAX_ID_DIGITS:
        raise BadRequest(400, f"token id {part[:MAX_ID_DIGITS]}… "
                         f"({len(part)} characters) is outside the "
                         f"vocabulary [0, {vocab})")
    return [int(part) for part in parts]
  if encode is None:
    raise BadRequest(400, NO_TOKENIZER)
  try:
    return encode(text)
  except ValueError as e:
    raise BadRequest(400, f"the tokenizer cannot encode the prompt: {e}"
                     ) from None


def parse_prompt(text: Any, vocab: int, encode: Encoder | None = None,
                 positions: int | None = None) -> list[int]:
  """Return the token ids of a prompt: whitespace-separated ids, or text
  that `encode` (the run's tokenizer, if it has one) turns into ids, at
  most the model's `positions` (None: no bound but the buckets')."""
  if not isinstance(text, str) or not text.strip():
    raise BadRequest(400, "prompt must be a non-empty string")
  ids = prompt_ids(text, encode, vocab)
  if not ids:
    raise BadRequest(400, "the prompt encodes to no tokens")
  if len(ids) > BUCKETS[-1]:
    raise BadRequest(413, f"prompt has {len(ids)} tokens; at most "
                     f"{BUCKETS[-1]}")
  if positions is not None and len(ids) > positions:
    raise BadRequest(400, f"prompt has {len(ids)} tokens, more than the "
                     f"model's {positions} positions; give at most "
                     f"{positions}")
  bad = [i for i in ids if not 0 <= i < vocab]
  if bad:
    raise BadRequest(400, f"token id {bad[0]} is outside the vocabulary "
                     f"[0, {vocab})")
  return ids


def request_prompt(request: dict, served: Served) -> list[int]:
  """Return the request's prompt as token ids, checked against the run's
  vocabulary and its model's positions."""
  return parse_prompt(request.get("prompt"), served.vocab, served.encode,
                      served.run.positions)


def parse_choice(value: Any, served: Served, field: str
                 ) -> dict[str, list[int]]:
  """Return the request's `field` (`ablate` or `keep`) as `{site:
  [component, …]}`, checked against the run's sites."""
  if value is None:
    return {}
  if not isinstance(value, dict):
    raise BadRequest(400, f"{field} must map site names to component lists")
  sizes = {s.name: s.c for s in served.run.target.sites}
  total, chosen = 0, {}
  for site, components in value.items():
    if site not in sizes:
      raise BadRequest(400, f"no site {site!r} in this run")
    # A JSON true is a Python int: only integers name components.
    if (not isinstance(components, list)
        or not all(type(c) is int and 0 <= c < sizes[site]
                   for c in components)):
      raise BadRequest(400, f"{field}[{site!r}] must list components in "
                       f"[0, {sizes[site]})")
    total += len(components)
    chosen[site] = sorted(set(components))
  if total > MAX_ABLATED:
    raise BadRequest(413, f"at most {MAX_ABLATED} components in {field}")
  return chosen


def bucket(length: int, positions: int | None = None) -> int:
  """Return the padded length of a prompt of `length` tokens: its bucket,
  but never past the model's `positions`."""
  chosen = next(b for b in BUCKETS if b >= length)
  return chosen if positions is None else max(min(chosen, positions), length)


def padded_prompt(ids: list[int], positions: int | None = None) -> np.ndarray:
  """Return the prompt's ids zero-padded to its bucket's length (at most
  the model's `positions`)."""
  padded = np.zeros(bucket(len(ids), positions), np.int32)
  padded[:len(ids)] = ids
  return padded


def predictions(served: Served, ids: list[int], ablate: dict[str, list[int]],
                keep: dict[str, list[int]] | None = None,
                predict: Callable | None = None) -> dict:
  """Return the prompt's clean and ablated predictions per position, and
  the CI of every component alive on the prompt, per site and position.
  `predict(run, tokens, top)` replaces the ablation where given."""
  padded = padded_prompt(ids, served.run.positions)
  start = time.perf_counter()
  if predict is None:
    p = explore.predict(served.run, jnp.asarray(padded), ablate,
                        TOP_PREDICTIONS, keep or None)
  else:
    p = predict(served.run, jnp.asarray(padded), TOP_PREDICTIONS)
  p = [np.asarray(a)[:len(ids)] for a in p]
  seconds = time.perf_counter() - start
  ci = explore.component_ci(served.run, jnp.asarray(padded)[None])
  decode = served.decode

  def top(tokens, probs):
    return [[decode(int(t)), float(q)] for t, q in zip(tokens, probs)]

  return {
    "tokens": [decode(i) for i in ids],
    "positions": [{"clean": top(p[0][t], p[1][t]),
                   "ablated": top(p[2][t], p[3][t]), "kl": float(p[4][t])}
                  for t in range(len(ids))],
    "seconds": seconds,
    "ci": alive_ci(ci, len(ids), served.run.config.ci_alive_threshold),
  }


def mode_predictions(served: Served, ids: list[int], mode: str,
                     seed: int) -> dict:
  """Return `predictions`' answer with the masked model under an
  intervention mode (`explore.intervened_forward`) in place of ablation."""
  return predictions(served, ids, {}, None, lambda run, tokens, top:
                     explore.intervened_prediction(run, tokens, mode, top,
                                                   seed))


def parse_mode(value: Any) -> str:
  """Return the request's intervention mode, checked."""
  if value not in interventions.MODES:
    raise BadRequest(400, f"mode must be one of {list(interventions.MODES)}")
  return value


def parse_int(value: Any, field: str, low: int, high: int) -> int:
  """Return the request's integer `field`, checked to lie in [low, high)."""
  # A JSON true is a Python int, but no index.
  if type(value) is not int or not low <= value < high:
    raise BadRequest(400, f"{field} must be an integer in [{low}, {high})")
  return value


def parse_values(value: Any) -> list[float]:
  """Return a sweep's mask values: by default `SWEEP_POINTS` evenly over
  [0, 2], else a list of at most `MAX_SWEEP_POINTS` numbers in [0, 2]."""
  low, high = interventions.MASK_RANGE
  if value is None:
    return list(np.linspace(low, high, SWEEP_POINTS))
  if (not isinstance(value, list) or not 0 < len(value) <= MAX_SWEEP_POINTS
      or not all(type(v) in (int, float) for v in value)):
    raise BadRequest(400, f"values must list 1 to {MAX_SWEEP_POINTS} "
                     "numbers")
  outside = [v for v in value if not low <= v <= high]
  if outside:
    raise BadRequest(400, f"mask value {outside[0]} is outside [{low:g}, "
                     f"{high:g}]")
  return [float(v) for v in value]


def parse_sweep(request: dict, served: Served) -> dict:
  """Return a sweep request's checked arguments for `sweep`."""
  sizes = {s.name: s.c for s in served.run.target.sites}
  site = request.get("site")
  if not isinstance(site, str) or site not in sizes:
    raise BadRequest(400, f"no site {site!r} in this run")
  ids = request_prompt(request, served)
  position = request.get("position", len(ids) - 1)
  token = request.get("token")
  return {
    "ids": ids, "site": site,
    "component": parse_int(request.get("component"), "component", 0,
                           sizes[site]),
    "position": parse_int(position, "position", 0, len(ids)),
    "token": None if token is None else parse_int(token, "token", 0,
                                                  served.vocab),
    "values": parse_values(request.get("values")),
  }


def sweep(served: Served, ids: list[int], site: str, component: int,
          position: int, token: int | None, values: list[float]) -> dict:
  """Return the log-probability of `token` (default: the clean top
  prediction) at `position` of the prompt with the component's mask at
  each of `values` (`explore.mask_sweep`)."""
  padded = padded_prompt(ids, served.run.positions)
  start = time.perf_counter()
  result = explore.mask_sweep(served.run, jnp.asarray(padded), site,
                              component, values, position, token)
  log_probs = [float(x) for x in np.asarray(result.output)]
  return {"site": site, "component": component, "position": position,
          "token": served.decode(result.token), "token_id": result.token,
          "values": values, "log_probs": log_probs,
          "seconds": time.perf_counter() - start}


def parse_share(value: Any) -> float:
  """Return a graph request's share of attribution kept, in (0, 1]."""
  if value is None:
    return GRAPH_SHARE
  if type(value) not in (int, float) or not 0 < value <= 1:
    raise BadRequest(400, "share must be a number in (0, 1]")
  return float(value)


def parse_graph(request: dict, served: Served) -> dict:
  """Return a graph request's checked arguments for `graph`."""
  ids = request_prompt(request, served)
  position = request.get("position", len(ids) - 1)
  token = request.get("token")
  return {
    "ids": ids,
    "position": parse_int(position, "position", 0, len(ids)),
    "token": None if token is None else parse_int(token, "token", 0,
                                                  served.vocab),
    "share": parse_share(request.get("share")),
  }


def graph(served: Served, ids: list[int], position: int, token: int | None,
          share: float) -> dict:
  """Return the prompt's attribution graph to the logit of `token`
  (default: the clean top prediction) at `position`, with the prompt's
  tokens and the sites in forward order for drawing it."""
  start = time.perf_counter()
  padded = jnp.asarray(padded_prompt(ids, served.run.positions))
  result = explore.attribution_graph(served.run, padded, token, position,
                                     share, max_targets=GRAPH_TARGETS)
  return {**attribution.graph_json(result),
          "tokens": [served.decode(i) for i in ids],
          "token_text": served.decode(result.token),
          "sites": [s.name for s in served.run.target.sites],
          "seconds": time.perf_counter() - start}


def alive_ci(ci: dict, length: int, threshold: float) -> dict:
  """Return per site `[[component, [CI per position]], …]` of the
  components whose CI exceeds `threshold` somewhere in the prompt."""
  out = {}
  for site, values in ci.items():
    values = np.asarray(values)[0, :length]
    alive = np.flatnonzero(values.max(axis=0) > threshold)
    out[site] = [[int(c), [round(float(x), 4) for x in values[:, c]]]
                 for c in alive]
  return out


def component_page(served: Served, site: str, component: int,
                   top: dict[str, unit_contexts.Top] | None = None) -> dict:
  """Return what the component page shows. A tagged run's page has the
  component's label, and its contexts are those of the tagged sample
  (`top`, from `unit_contexts.top_positions`), as a baseline unit's."""
  stats = served.harvest.sites.get(site)
  if stats is None:
    raise BadRequest(404, f"no site {site!r} in this run")
  if not 0 <= component < stats["fired"].shape[0]:
    raise BadRequest(404, f"site {site!r} has no component {component}")
  row = next(r for r in served.rows
             if r["site"] == site and r["component"] == component)
  threshold = float(served.harvest.manifest["settings"]["threshold"])
  # Dead: its CI never passed the threshold on the harvested positions, so
  # its top "contexts" would be arbitrary positions at CI 0.
  dead = int(stats["fired"][component]) == 0
  contexts = []
  for values, context, ci in zip(stats["top_ci"][component],
                                 stats["top_context"][component],
                                 stats["top_context_ci"][component]):
    if not np.isfinite(values) or values <= threshold:
      continue
    contexts.append(context_item(served.decode, float(values), context, ci))
  label = {}
  if served.tagged is not None:
    label = {"label": served.tagged.labels[site][component]}
    if top is not None:
      contexts = [] if dead else tagged_contexts(served, top[site],
                                                 component, "CI")
  toy = {}
  if site in served.probe:
    spec = sites_lib.site_by_name(served.run.target.sites)[site]
    v, u = (np.asarray(a) for a in sites_lib.site_factors(
      served.run.decomposition.components, spec))
    toy = {"probe_ci": [float(x) for x in served.probe[site][:, component]],
           "v": [float(x) for x in v[:, component]],
           "u": [float(x) for x in u[component]]}
  return {
    **row, **toy, **label, "dead": dead, "threshold": threshold,
    "contexts": contexts[:CONTEXTS_SHOWN],
    "histogram": {"floor": served.harvest.manifest["histogram_bands"]["floor"],
                  "counts": [int(x) for x in stats["histogram"][component]]},
    "correlated": explore.correlated(stats, component),
  }


def context_item(decode: Callable[[int], str], ci: float,
                 context: np.ndarray, window_ci: np.ndarray) -> dict:
  """Return one top context as the page draws it: its tokens (a toy's input
  values), and per token a shade in [0, 1] and a hover note.

  A token window is shaded by the component's CI on each token. A toy's
  context is one input row with one CI: its values are shaded by their
  magnitude relative to the row's largest, which marks the features
  present in the input (zero: absent) rather than the first value.
  """
  if np.issubdtype(context.dtype, np.integer):
    cis = [float(x) for x in window_ci]
    return {"ci": ci, "tokens": [decode(int(t)) if t >= 0 else ""
                                 for t in context],
            "token_ci": cis, "shade": cis,
            "notes": [f"CI {x:.3g}" for x in cis]}
  values = np.asarray(context, np.float64)
  top = float(np.max(np.abs(values), initial=0.0))
  shade = np.abs(values) / top if top > 0 else np.zeros_like(values)
  return {"ci": ci, "tokens": [f"{x:.2f}" for x in values],
          "token_ci": [float(x) for x in window_ci],
          "shade": [float(x) for x in shade],
          "notes": [f"feature {i}: {x:.3g}" for i, x in enumerate(values)]}


def divergence_name(run: explore.LoadedRun) -> str:
  """Return the short name of the run's divergence, as columns label it:
  KL for language models (next-token distributions), MSE for toys."""
  return "KL" if run.target.token_labels is not None else "MSE"


def ab_grid_file(path: str) -> str:
  """Return the A/B grid snapshot's file in the run at `path`."""
  return os.path.join(path, report.REPORT_DIR, ab_grid.DATA)


def read_ab_grid(path: str) -> AbGrid | str:
  """Return the A/B grid snapshot of the run at `path`, or the one-line
  reason it has none to show."""
  try:
    data = ab_grid.read(os.path.dirname(ab_grid_file(path)),
                        MAX_AB_GRID_BYTES)
  except ab_grid.TooLarge:
    return (f"the run's A/B grid snapshot is over {MAX_AB_GRID_BYTES} "
            "bytes; open report/ab_grid.html instead")
  except (OSError, ValueError, RecursionError) as e:
    return f"the run's A/B grid snapshot cannot be read: {_one_line(e)}"
  if data is None:
    return ("this run has no A/B grid (a --target_task run writes one at "
            "each slow eval)")
  try:
    return AbGrid(int(data["step"]), list(data["operators"]),
                  list(data["shape"]), list(data["roles"]),
                  {(c["site"], int(c["component"])): c
                   for c in data["components"]})
  except (KeyError, TypeError, ValueError) as e:
    return f"the run's A/B grid snapshot is malformed: {_one_line(e)}"


def _one_line(error: Exception) -> str:
  return " ".join(str(error).split()) or type(error).__name__


def ab_grid_page(grid: AbGrid | str, sizes: dict[str, int], site: str,
                 component: int) -> dict:
  """Return a component's A/B grids with the snapshot's step, operators,
  shape and roles; `sizes` are the run's components per site."""
  if site not in sizes:
    raise BadRequest(404, f"no site {site!r} in this run")
  if not 0 <= component < sizes[site]:
    raise BadRequest(404, f"site {site!r} has no component {component}")
  if isinstance(grid, str):
    raise BadRequest(404, grid)
  item = grid.components.get((site, component))
  if item is None:
    raise BadRequest(404, f"{site} c{component} is not in the A/B grid of "
                     f"step {grid.step}: it was not alive on the target "
                     "stream")
  return {**item, "step": grid.step, "operators": grid.operators,
          "shape": grid.shape, "roles": grid.roles}


def nesting(raw: bytes) -> int:
  """Return how deep the arrays and objects of the JSON text `raw` nest
  (brackets inside strings do not count)."""
  bare = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
  opens = np.isin(bare, list(b"[{")).astype(np.int64)
  closes = np.isin(bare, list(b"]}")).astype(np.int64)
  return int(np.cumsum(opens - closes).max(initial=0))


def model_request(served: Served, endpoint: str, request: dict,
                  lock: threading.Lock) -> dict:
  """Answer a request that runs the model (`predict`, `sweep`, `graph` or
  `intervene`), checked before it takes its turn under `lock`."""
  if endpoint == "graph":
    args = parse_graph(request, served)
    with lock:
      return graph(served, **args)
  if endpoint == "sweep":
    args = parse_sweep(request, served)
    with lock:
      return sweep(served, **args)
  ids = request_prompt(request, served)
  if endpoint == "intervene":
    mode = parse_mode(request.get("mode"))
    seed = parse_int(request.get("seed", 0), "seed", 0, 2 ** 31)
    with lock:
      return {**mode_predictions(served, ids, mode, seed), "mode": mode}
  ablate = parse_choice(request.get("ablate"), served, "ablate")
  keep = parse_choice(request.get("keep"), served, "keep")
  with lock:
    return predictions(served, ids, ablate, keep)


def page_html() -> bytes:
  """Return the browser's single page."""
  return importlib.resources.files("decompax.bin").joinpath(
    "browse.html").read_bytes()


def _routes():
  """Return the URL map of the page and its JSON API."""
  from werkzeug.routing import Map, Rule  # noqa: PLC0415

  run = "/api/runs/<int:run>"
  return Map([
    Rule("/", endpoint="page", methods=["GET"]),
    Rule("/api/runs", endpoint="runs", methods=["GET"]),
    Rule(f"{run}/components", endpoint="components", methods=["GET"]),
    Rule(f"{run}/components/<site>/<int:component>", endpoint="component",
         methods=["GET"]),
    Rule(f"{run}/ab_grid/<site>/<int:component>", endpoint="ab_grid",
         methods=["GET"]),
    Rule(f"{run}/predict", endpoint="predict", methods=["POST"]),
    Rule(f"{run}/sweep", endpoint="sweep", methods=["POST"]),
    Rule(f"{run}/graph", endpoint="graph", methods=["POST"]),
    Rule(f"{run}/intervene", endpoint="intervene", methods=["POST"]),
    Rule(f"{run}/clusters/<site>", endpoint="clusters", methods=["GET"]),
    Rule(f"{run}/units/<key>", endpoint="units", methods=["GET"]),
    Rule(f"{run}/units/<key>/<int:unit>", endpoint="unit", methods=["GET"]),
  ])


def request_body(request) -> dict:
  """Return a POST request's JSON object, or raise BadRequest naming what
  is wrong with it (too large, late, too deep, not JSON, not an object)."""
  from werkzeug.exceptions import ClientDisconnected  # noqa: PLC0415

  if request.content_length is None or request.content_length > MAX_BODY_BYTES:
    raise BadRequest(413, f"the body must be JSON of at most "
                     f"{MAX_BODY_BYTES} bytes")
  try:
    raw = request.get_data(cache=False)
  # werkzeug's word for a body cut short: the client stalled past the
  # socket timeout, or closed.
  except (ClientDisconnected, OSError):
    raise BadRequest(408, f"the body did not arrive in time (its "
                     f"{request.content_length} bytes)") from None
  if nesting(raw) > MAX_JSON_DEPTH:
    raise BadRequest(400, f"the body nests deeper than {MAX_JSON_DEPTH} "
                     "levels")
  try:
    value = json.loads(raw)
  except (ValueError, UnicodeDecodeError):
    raise BadRequest(400, "the body is not valid JSON") from None
  if not isinstance(value, dict):
    raise BadRequest(400, "the body must be a JSON object")
  return value


def run_list(runs: list[Served]) -> list[dict]:
  """Return what the page's run menu shows of each served run."""
  return [{"index": i, "name": s.name, "target": s.run.config.target,
           "sites": {x.name: x.c for x in s.run.target.sites},
           "positions": s.harvest.manifest["positions"],
           "tokens": s.run.target.token_labels is not None,
           "divergence": divergence_name(s.run),
           "tokenizer": s.encode is not None,
           "classes": s.tagged.classes if s.tagged else None,
           "baselines": s.tagged.baselines if s.tagged else [],
           "ab_grid": os.path.isfile(ab_grid_file(s.name)),
           "clusters": s.clusters is not None}
          for i, s in enumerate(runs)]


class _Kept(NamedTuple):
  """What the app reads once and keeps (see `_kept_reads`)."""

  sample_of: Callable[[int], dict[str, unit_contexts.Top] | None]
  ab_grid_of: Callable[[int], AbGrid | str]
  # Requests run on threads; predictions take turns, so that concurrent
  # prompts do not each compile or hold a forward's memory at once.
  model_lock: threading.Lock


def _kept_reads(runs: list[Served], context_batches: int) -> _Kept:
  """Return the reads a request may need that are dear once and then
  kept: a tagged run's units' top positions, a run's A/B grid."""
  # Per run index, its A/B grid or why it has none: read on the first
  # request, then kept, so a request costs a lookup and never a parse.
  grids: dict[int, AbGrid | str] = {}
  grids_lock, model_lock = threading.Lock(), threading.Lock()
  # Per tagged run index, every unit's top positions over the sample:
  # computed on the first request that shows contexts, then kept.
  samples: dict[int, dict[str, unit_contexts.Top]] = {}

  def sample_of(index: int) -> dict[str, unit_contexts.Top] | None:
    s = runs[index]
    if s.tagged is None:
      return None
    with model_lock:
      if index not in samples:
        samples[index] = unit_contexts.top_positions(
          s.run, s.tagged.settings, CONTEXTS_SHOWN, context_batches)
      return samples[index]

  def ab_grid_of(index: int) -> AbGrid | str:
    with grids_lock:
      if index not in grids:
        grids[index] = read_ab_grid(runs[index].name)
      return grids[index]

  return _Kept(sample_of, ab_grid_of, model_lock)


def _served(runs: list[Served], index: int) -> Served:
  if not 0 <= index < len(runs):
    raise BadRequest(404, f"no run {index}; runs are 0..{len(runs) - 1}")
  return runs[index]


def _handle(runs: list[Served], kept: _Kept, request, endpoint: str,
            args: dict):
  """Return the answer to one routed request: a Response or JSON data."""
  from werkzeug.wrappers import Response  # noqa: PLC0415

  if endpoint == "page":
    return Response(page_html(), mimetype="text/html")
  if endpoint == "runs":
    return run_list(runs)
  s = _served(runs, args["run"])
  if endpoint == "components":
    return s.rows
  if endpoint == "component":
    if args["site"] not in s.harvest.sites:
      raise BadRequest(404, f"no site {args['site']!r} in this run")
    return component_page(s, args["site"], args["component"],
                          kept.sample_of(args["run"]))
  if endpoint == "clusters":
    return site_clusters(s, args["site"])
  if endpoint == "units":
    return unit_rows(s, args["key"])
  if endpoint == "unit":
    unit_rows(s, args["key"])   # refuses an unknown key before the sample
    return unit_page(s, args["key"], args["unit"],
                     kept.sample_of(args["run"]))
  if endpoint == "ab_grid":
    return ab_grid_page(kept.ab_grid_of(args["run"]),
                        {x.name: x.c for x in s.run.target.sites},
                        args["site"], args["component"])
  if s.run.target.token_labels is None:
    raise BadRequest(400, "predictions need a language-model run")
  return model_request(s, endpoint, request_body(request), kept.model_lock)


def make_app(runs: list[Served],
             context_batches: int = unit_contexts.SAMPLE_BATCHES):
  """Return the WSGI application serving `runs` (a tagged run's contexts
  from its harvest's first `context_batches` batches)."""
  from werkzeug.exceptions import HTTPException  # noqa: PLC0415
  from werkzeug.wrappers import Request, Response  # noqa: PLC0415

  routes, kept = _routes(), _kept_reads(runs, context_batches)

  def app(environ, start_response):
    request = Request(environ)
    adapter = routes.bind_to_environ(environ)
    try:
      endpoint, args = adapter.match()
      result = _handle(runs, kept, request, endpoint, args)
      response = result if isinstance(result, Response) else Response(
        json.dumps(result), mimetype="application/json")
    except BadRequest as e:
      response = Response(json.dumps({"error": str(e)}), status=e.status,
                          mimetype="application/json")
    except HTTPException as e:
      response = Response(json.dumps({"error": e.description}),
                          status=e.code, mimetype="application/json")
    return response(environ, start_response)

  return app


def make_server(runs: list[Served], host: str, port: int,
                listening: socket.socket | None = None,
                timeout: float = SOCKET_TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS,
                context_batches: int = unit_contexts.SAMPLE_BATCHES):
  """Return a threaded server of `runs` on `listening`, or on a socket it
  binds to `host:port` (port 0: any free port; OSError where it cannot).
  Its `port` is the port it serves on."""
  from decompax.bin import browse_server  # noqa: PLC0415 (werkzeug)
  own = listening is None
  if own:
    listening = browse_server.listen(host, port)
  try:
    return browse_server.make_server(make_app(runs, context_batches), host,
                                     listening, timeout, max_connections)
  finally:
    if own:
      listening.close()   # the server holds its own copy


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  if not _RUN_DIRS.value:
    fail("--run_dir must name at least one run directory with a finished "
         "harvest (bin/harvest --run_dir=DIR makes one)")
  host, port = _HOST.value, _PORT.value
  if not host.strip():
    fail("--host is empty; give the address to serve on, e.g. 127.0.0.1 "
         "(this machine alone)")
  try:
    from decompax.bin import browse_server  # noqa: PLC0415
  except ImportError:
    fail("the browser needs its extra: pip install 'decompax[browse]'")
  # Bound before the runs load: a taken port is said at once.
  try:
    listening = browse_server.listen(host, port)
  except (OSError, ValueError) as e:
    fail(browse_server.bind_error(host, port, e))
  warning = browse_server.exposure(host,
                                   browse_server.bound_address(listening))
  if warning:
    print(f"browse: warning: {warning}", file=sys.stderr, flush=True)
  runs = []
  for path in _RUN_DIRS.value:
    try:
      runs.append(serve_run(path))
    except (OSError, ValueError) as e:
      fail(f"--run_dir: {e}")
  server = make_server(runs, host, port, listening,
                       context_batches=_CONTEXT_BATCHES.value)
  listening.close()
  shown = f"[{host}]" if ":" in host else host
  print(f"[browse] serving {len(runs)} run(s) on "
        f"http://{shown}:{server.port}/", flush=True)
  server.serve_forever()


def entry() -> None:
  """Launch the absl app (used by the `bin/browse` launcher)."""
  cli.launch("browse", main)


if __name__ == "__main__":
  entry()
