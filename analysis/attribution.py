"""Attribution graphs: which components of a prompt drive which (design §15.2).

A *node* is a component alive on the prompt (lower CI above a threshold) at
one site and one position, or the output node: the logit of a chosen token
at a chosen position. An *edge* runs from a component at an earlier site
(in the target's forward order) and at a position no later than its
target's to a later node: to a later component's CI pre-activation, or to
the output logit. Its weight is gradient × mask through the masked forward
at every mask 1 with the delta path on, which is the target exactly
(invariant I51):

    w(s → y) = m_s · ∂y/∂m_s |_{m = 1},

`m_s` the mask of component `c` of site `i` at position `p` alone (masks
are per position, so one component at two positions is two nodes).

Targets are expanded best first in batches of `chunk` (the output alone
first): one batched backward pass (`jax.vmap` of one `jax.vjp` pullback
over one-hot cotangents) gives every target of a batch its incoming attribution from
every component at every position, with no Python loop over components.
Each target keeps the smallest set of its incoming edges whose |weight|
carries `share` of its total incoming |weight| (at most `max_edges`);
their sources become nodes, ranked for expansion by their influence on the
output (the output's is 1; a source adds `|w| / total · influence` of each
target it feeds). So every node of the graph reaches the output.

Axis names: `t` positions of the prompt, `k` targets of one batch, `call`
every site's components side by side in the order of `target.sites`.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from decompax.core import ci_fns
from decompax.core.masks import SiteMask
from decompax.core.sites import SiteSpec
from decompax.core.target import TargetFns

# The output node's site name.
LOGIT = "logit"


class Node(NamedTuple):
  """A graph node: a component at a site and position with its CI there,
  or the output (`site == LOGIT`, `component` the token, `ci` None)."""

  site: str
  position: int
  component: int
  ci: Optional[float]


class Edge(NamedTuple):
  """An edge between nodes (indices into `AttributionGraph.nodes`) with its
  gradient × mask weight (I51): positive where the source raises the
  target."""

  source: int
  target: int
  weight: float


class AttributionGraph(NamedTuple):
  """One prompt's pruned attribution graph; node 0 is the output."""

  nodes: tuple[Node, ...]
  edges: tuple[Edge, ...]
  token: int
  position: int
  share: float
  logit: float


class Batch(NamedTuple):
  """One batch of targets' strongest incoming edges."""

  column: Int[Array, "k e"]
  position: Int[Array, "k e"]
  weight: Float[Array, "k e"]
  total: Float[Array, " k"]
  logit: Float[Array, ""]


# (flat target rows, their site index, their position) -> Batch.
EdgesFn = Callable[[Int[Array, " k"], Int[Array, " k"], Int[Array, " k"]],
                   Batch]


def unit_site_masks(sites: tuple[SiteSpec, ...],
                    masks: dict[str, Float[Array, "t c"]]
                    ) -> dict[str, SiteMask]:
  """Return one prompt's site masks from per-position component masks,
  the delta path on (at mask 1 the masked forward is the target)."""
  return {s.name: SiteMask(masks[s.name][None],
                           jnp.ones((1, masks[s.name].shape[0]), jnp.float32))
          for s in sites}


def target_values(target: TargetFns, ci_fn: ci_fns.CIFn, weights,
                  components, ci_params, tokens: Int[Array, " t"],
                  clean_taps: dict, position: Int[Array, ""],
                  token: Int[Array, ""], masks: dict[str, Float[Array, "t c"]]
                  ) -> Float[Array, " n"]:
  """Return every quantity a node can be the target of, flat: each site's
  CI pre-activations `[t, c]` in site order, then the output logit.

  The CI function reads the masked forward's taps, so a mask moves a later
  component's CI through the model (the CI function's own parameters stay
  fixed). Pre-activations, not the squashed CI: the lower CI is clamped to
  [0, 1], which would zero the gradient of a saturated component.
  """
  logits, taps = target.masked_forward_taps(
    weights, components, tokens[None], unit_site_masks(target.sites, masks),
    clean_taps, ci_fn.input_taps)
  pre = ci_fn.apply(ci_params, {k: taps[k] for k in ci_fn.input_taps},
                    components)
  parts = [pre[s.name][0].reshape(-1) for s in target.sites]
  logit = logits[0, position, token].astype(jnp.float32)
  return jnp.concatenate(parts + [logit[None]])


def pullback(target: TargetFns, ci_fn: ci_fns.CIFn, weights, components,
             ci_params, tokens: Int[Array, " t"], position: Int[Array, ""],
             token: Int[Array, ""]) -> tuple[Float[Array, " n"], Callable]:
  """Return `target_values` at every mask 1 and its pullback to the masks
  (a `jax.tree_util.Partial`: it passes in and out of `jax.jit`, so one
  forward serves every batch of targets)."""
  _, clean_taps = target.clean_forward(weights, tokens[None],
                                       target.start_taps)
  t = tokens.shape[0]
  ones = {s.name: jnp.ones((t, s.c), jnp.float32) for s in target.sites}
  return jax.vjp(
    functools.partial(target_values, target, ci_fn, weights, components,
                      ci_params, tokens, clean_taps, position, token), ones)


def pulled_rows(sites: tuple[SiteSpec, ...], pull: Callable,
                values: Float[Array, " n"], rows: Int[Array, " k"]
                ) -> Float[Array, "k t call"]:
  """Return per target row of `target_values` the gradient × mask of every
  component at every position (I51): the pullback vmapped over the rows'
  one-hot cotangents, each row one backward pass, all one program."""

  def row(i):
    (grad,) = pull(jax.nn.one_hot(i, values.shape[0], dtype=values.dtype))
    # I51: w = m · ∂y/∂m, with every m = 1 here.
    return jnp.concatenate([grad[s.name] for s in sites], axis=-1)

  return jax.vmap(row)(rows)


def attribution_rows(target: TargetFns, ci_fn: ci_fns.CIFn, weights,
                     components, ci_params, tokens: Int[Array, " t"],
                     position: Int[Array, ""], token: Int[Array, ""],
                     rows: Int[Array, " k"]
                     ) -> tuple[Float[Array, "k t call"], Float[Array, " n"]]:
  """Return `pulled_rows` of `rows` and `target_values`, from one forward."""
  values, pull = pullback(target, ci_fn, weights, components, ci_params,
                          tokens, position, token)
  return pulled_rows(target.sites, pull, values, rows), values


def column_sites(sites: tuple[SiteSpec, ...]) -> Int[Array, " call"]:
  """Return the site index of each component column."""
  return jnp.concatenate([jnp.full((s.c,), i, jnp.int32)
                          for i, s in enumerate(sites)])


def allowed(alive: Bool[Array, "t call"], columns: Int[Array, " call"],
            target_site: Int[Array, " k"], target_position: Int[Array, " k"]
            ) -> Bool[Array, "k t call"]:
  """Return which sources may feed each target: alive, at an earlier site
  (the output's index is the number of sites) and no later position."""
  t = alive.shape[0]
  earlier = columns[None, None, :] < target_site[:, None, None]
  causal = jnp.arange(t)[None, :, None] <= target_position[:, None, None]
  return alive[None] & earlier & causal


def strongest_edges(weights: Float[Array, "k t call"],
                    ok: Bool[Array, "k t call"], max_edges: int,
                    logit: Float[Array, ""]) -> Batch:
  """Return each target's `max_edges` allowed sources of largest |weight|
  (position and column) with their weights, its total allowed |weight|,
  and `logit` (the output's value) alongside."""
  k, t, call = weights.shape
  magnitude = jnp.where(ok, jnp.abs(weights), 0.0).reshape(k, t * call)
  _, flat = jax.lax.top_k(magnitude, min(max_edges, t * call))
  picked = jnp.take_along_axis(
    jnp.where(ok, weights, 0.0).reshape(k, t * call), flat, axis=1)
  return Batch(flat % call, flat // call, picked, magnitude.sum(axis=1),
               logit)


def batch_edges(sites: tuple[SiteSpec, ...], max_edges: int, pull: Callable,
                values: Float[Array, " n"], alive: Bool[Array, "t call"],
                rows: Int[Array, " k"], target_site: Int[Array, " k"],
                target_position: Int[Array, " k"]) -> Batch:
  """Return the strongest incoming edges of one batch of targets from a
  prompt's `pullback` (traceable; `explore` jits it per run with `sites`
  and `max_edges` static)."""
  ok = allowed(alive, column_sites(sites), target_site, target_position)
  return strongest_edges(pulled_rows(sites, pull, values, rows), ok,
                         max_edges, values[-1])


def kept_counts(weight: np.ndarray, total: np.ndarray, share: float
                ) -> np.ndarray:
  """Return per target the fewest of its edges (sorted by |weight|, largest
  first) whose |weight| carries `share` of `total`; all of them where even
  those fall short."""
  carried = np.cumsum(np.abs(weight), axis=1)
  enough = carried >= share * total[:, None]
  return np.where(enough.any(axis=1), enough.argmax(axis=1) + 1,
                  weight.shape[1])


class _Table(NamedTuple):
  """Where each site's rows and columns start: `offsets[i]` is the first
  column of site `i`, its rows start at `t · offsets[i]`."""

  offsets: np.ndarray
  t: int

  def row(self, site: int, position: int, component: int) -> int:
    c = self.offsets[site + 1] - self.offsets[site]
    return int(self.t * self.offsets[site] + position * c + component)

  def site_of(self, column: int) -> int:
    return int(np.searchsorted(self.offsets, column, side="right") - 1)


class _Growth(NamedTuple):
  """The graph as it grows: nodes with their (site index, position,
  component) keys, each node's (site index, position, row of
  `target_values`), edges and each node's influence on the output."""

  nodes: list
  keys: dict
  where: list
  edges: list
  influence: list


def _source_node(growth: _Growth, table: _Table, sites: tuple[SiteSpec, ...],
                 ci: np.ndarray, position: int, column: int) -> int:
  """Return the node index of a component column at `position`, adding
  the node where it is new."""
  site = table.site_of(column)
  key = (site, position, column - int(table.offsets[site]))
  if key not in growth.keys:
    growth.keys[key] = len(growth.nodes)
    growth.nodes.append(Node(sites[site].name, position, key[2],
                             float(ci[position, column])))
    growth.where.append((site, position, table.row(*key)))
    growth.influence.append(0.0)
  return growth.keys[key]


def _add_incoming(growth: _Growth, table: _Table, sites: tuple[SiteSpec, ...],
                  ci: np.ndarray, target: int, batch: Batch, j: int,
                  share: float) -> None:
  """Add target `target`'s kept incoming edges (row `j` of `batch`) and
  pass its influence on to their sources."""
  weight, total = batch.weight[j], float(batch.total[j])
  n = int(kept_counts(weight[None], batch.total[j:j + 1], share)[0])
  for column, position, w in zip(batch.column[j][:n], batch.position[j][:n],
                                 weight[:n]):
    if w == 0.0:
      continue  # a padded pick: no allowed source left
    source = _source_node(growth, table, sites, ci, int(position),
                          int(column))
    growth.edges.append(Edge(source, target, float(w)))
    growth.influence[source] += (abs(float(w)) / total
                                 * growth.influence[target])


def _next_targets(growth: _Growth, expanded: set, room: int, chunk: int
                  ) -> list[int]:
  """Return up to `min(room, chunk)` unexpanded nodes, most influential
  first."""
  order = np.argsort(-np.asarray(growth.influence), kind="stable")
  todo = [int(i) for i in order if int(i) not in expanded]
  return todo[:max(0, min(room, chunk))]


def grow_graph(edges_fn: EdgesFn, sites: tuple[SiteSpec, ...],
               ci: Float[np.ndarray, "t call"], position: int, token: int,
               share: float, max_targets: int, chunk: int) -> AttributionGraph:
  """Return the pruned graph of one prompt, expanding at most
  `max_targets` targets (the output first) in batches of `chunk` through
  `edges_fn` (`batch_edges` bound to a run and prompt)."""
  t = ci.shape[0]
  table = _Table(np.cumsum([0] + [s.c for s in sites]), t)
  # The output's row is the last of `target_values`; its site index is
  # past every site's, so every site may feed it.
  growth = _Growth([Node(LOGIT, position, token, None)], {},
                   [(len(sites), position, int(t * table.offsets[-1]))], [],
                   [1.0])
  expanded, logit = set(), float("nan")
  while todo := _next_targets(growth, expanded, max_targets - len(expanded),
                              chunk):
    # Padding repeats a target, so every batch has one of two shapes (two
    # compiles): a lone target (the output's first batch) runs alone
    # rather than as `chunk` backward passes.
    padded = todo + [todo[0]] * ((1 if len(todo) == 1 else chunk) - len(todo))
    batch = Batch(*(np.asarray(a) for a in edges_fn(
      *(jnp.asarray([growth.where[i][f] for i in padded], jnp.int32)
        for f in (2, 0, 1)))))
    logit = float(batch.logit)
    for j, node in enumerate(todo):
      _add_incoming(growth, table, sites, ci, node, batch, j, share)
    expanded.update(todo)
  return AttributionGraph(tuple(growth.nodes), tuple(growth.edges), token,
                          position, share, logit)


def graph_json(graph: AttributionGraph) -> dict[str, Any]:
  """Return the graph as JSON-ready data: nodes and edges as objects,
  edges naming their nodes by index."""
  return {"token": graph.token, "position": graph.position,
          "share": graph.share, "logit": graph.logit,
          "nodes": [n._asdict() for n in graph.nodes],
          "edges": [e._asdict() for e in graph.edges]}


class SummedEdge(NamedTuple):
  """The edges between two (site, position) places, their weights summed."""

  source: tuple[str, int]
  target: tuple[str, int]
  weight: float


def summed_edges(graph: AttributionGraph) -> list[SummedEdge]:
  """Return the graph's edges summed per source and target site and
  position (components apart), largest |sum| first."""
  sums: dict[tuple, float] = {}
  for e in graph.edges:
    s, t = graph.nodes[e.source], graph.nodes[e.target]
    key = ((s.site, s.position), (t.site, t.position))
    sums[key] = sums.get(key, 0.0) + e.weight
  return sorted((SummedEdge(*k, w) for k, w in sums.items()),
                key=lambda e: -abs(e.weight))


def node_masks(graph: AttributionGraph, sites: tuple[SiteSpec, ...],
               t: int) -> dict[str, np.ndarray]:
  """Return per site a `[t, c]` mask, 1 at each component node of the
  graph (at its position) and 0 elsewhere: keeping only the graph's
  components, or with `1 - mask` removing only them."""
  masks = {s.name: np.zeros((t, s.c), np.float32) for s in sites}
  for node in graph.nodes:
    if node.site != LOGIT:
      masks[node.site][node.position, node.component] = 1.0
  return masks
