"""Attribution graphs (analysis/attribution, explore.attribution_graph)
against known answers: a linear toy whose gradient × mask is each
component's contribution in closed form (I51), the induction toy's
mechanism by position, and the arithmetic model's answer logit, whose
attributions sum to the derivative along the all-masks direction."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib.figure import Figure

from decompax.analysis import attribution, explore
from decompax.core import ci_fns, site_forward
from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask
from decompax.core.sites import Factors, SiteSpec
from decompax.core.target import TargetFns
from decompax.io.decomposition import Decomposition
from decompax.recipe.config import TrainConfig
from decompax.render import figures
from decompax.targets import arithmetic, glu_sites, registry

# The linear toy: tokens → embedding → site a → prefix sum over positions
# → site b → logits. Every step is linear, so each edge has a closed form.
N, D, T, CA, CB = 5, 4, 3, 3, 2
SITES = (SiteSpec("a", "a", 0, D, D, CA), SiteSpec("b", "b", 0, D, N, CB))
TOKENS = jnp.asarray([1, 4, 2], jnp.int32)


def _linear_forward(weights, components, tokens, site_masks):
  def matmul(site, x):
    v, u = sites_lib.site_factors(components, site)
    return site_forward.site_matmul(x, weights[site.name], v, u,
                                    site_masks.get(site.name))

  e = weights["e"][tokens]
  h = jnp.cumsum(matmul(SITES[0], e), axis=1)
  return matmul(SITES[1], h), {"a": e, "b": h}


@pytest.fixture(scope="module")
def linear():
  k = jax.random.split(jax.random.key(0), 7)
  weights = {"e": jax.random.normal(k[0], (N, D)),
             "a": jax.random.normal(k[1], (D, D)),
             "b": jax.random.normal(k[2], (D, N))}
  components = {
    "a": Factors(jax.random.normal(k[3], (1, D, CA)),
                 jax.random.normal(k[4], (1, CA, D))),
    "b": Factors(jax.random.normal(k[5], (1, D, CB)),
                 jax.random.normal(k[6], (1, CB, N)))}

  def taps_forward(w, c, tokens, masks, clean, wanted):
    del clean
    out, taps = _linear_forward(w, c, tokens, masks)
    return out, {key: taps[key] for key in wanted}

  target = TargetFns(
    sites=SITES,
    clean_forward=lambda w, x, wanted: taps_forward(w, components, x, {}, {},
                                                    wanted),
    masked_forward=lambda w, c, x, m: _linear_forward(w, c, x, m)[0],
    frozen_stacks=lambda w: {}, divergence=lambda a, b: jnp.mean((a - b)**2),
    batch_lead_shape=lambda x: tuple(x.shape),
    masked_forward_taps=taps_forward, token_labels=lambda x: x)
  # A linear CI: each component's pre-activation is its input's x·V_c.
  ci_fn = ci_fns.CIFn(
    input_taps=("a", "b"), init=lambda key: None,
    apply=lambda params, taps, comps: {
      s.name: taps[s.name] @ sites_lib.site_factors(comps, s)[0]
      for s in SITES})
  return target, ci_fn, weights, components


def _closed_form(weights, components, position, token):
  """Return the gradient × mask rows of the linear toy by hand: per target
  row of `target_values`, every source's contribution `[T, CA + CB]`."""
  (va, ua), (vb, ub) = ((f.v[0], f.u[0]) for f in components.values())
  e = weights["e"][TOKENS]
  acts_a = e @ va
  h = jnp.cumsum(e @ weights["a"], axis=0)
  causal = (jnp.arange(T)[:, None] <= jnp.arange(T)[None, :])  # [p, q]
  rows = np.zeros((T * (CA + CB) + 1, T, CA + CB))
  # CI pre-activations of site a read the embedding: no mask moves them.
  for q in range(T):
    for d in range(CB):
      reach = acts_a * (ua @ vb[:, d])[None]
      rows[T * CA + q * CB + d, :, :CA] = reach * causal[:, q, None]
  logit = rows[-1]
  logit[:, :CA] = acts_a * (ua @ weights["b"][:, token])[None]
  logit[:, :CA] *= np.asarray(causal[:, position, None])
  logit[position, CA:] = (h[position] @ vb) * ub[:, token]
  return rows


def test_linear_gradient_times_mask_is_each_contribution(linear):
  target, ci_fn, weights, components = linear
  position, token = 1, 3
  n = T * (CA + CB) + 1
  rows, values = attribution.attribution_rows(
    target, ci_fn, weights, components, None, TOKENS, jnp.int32(position),
    jnp.int32(token), jnp.arange(n, dtype=jnp.int32))
  want = _closed_form(weights, components, position, token)
  np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-5)
  full, _ = _linear_forward(weights, components, TOKENS[None], {})
  np.testing.assert_allclose(values[-1], full[0, position, token], rtol=1e-6)


def test_a_target_is_fed_by_alive_earlier_sites_at_no_later_position():
  """I51: site b's CI at position 1 takes edges from site a's columns at
  positions 0 and 1, never from b's own; the output (index 2, after every
  site) from all of them; a dead source from nowhere."""
  columns = attribution.column_sites(SITES)
  np.testing.assert_array_equal(columns, [0, 0, 0, 1, 1])
  alive = np.ones((T, CA + CB), bool)
  alive[0, 1] = False
  ok = attribution.allowed(jnp.asarray(alive), columns,
                           jnp.asarray([1, 2]), jnp.asarray([1, 2]))
  into_b = np.zeros((T, CA + CB), bool)
  into_b[:2, :CA] = True
  into_b[0, 1] = False
  into_output = alive
  np.testing.assert_array_equal(ok, [into_b, into_output])


def _linear_graph(linear, share, max_targets=8, max_edges=64):
  target, ci_fn, weights, components = linear
  ci = np.ones((T, CA + CB))
  values, pull = attribution.pullback(target, ci_fn, weights, components,
                                      None, TOKENS, jnp.int32(2),
                                      jnp.int32(0))
  edges = jax.jit(functools.partial(
    attribution.batch_edges, SITES, max_edges, pull, values,
    jnp.asarray(ci > 0.5)))
  return attribution.grow_graph(edges, SITES, ci, 2, 0, share, max_targets,
                                4)


def test_linear_graph_edges_to_the_logit_sum_to_site_a_s_share(linear):
  """f is affine in site a's masks: their edges into the logit add up to
  the logit minus the logit with all of a's components off."""
  target, _, weights, components = linear
  graph = _linear_graph(linear, share=1.0)
  from_a = sum(e.weight for e in graph.edges
               if e.target == 0 and graph.nodes[e.source].site == "a")
  off = {"a": SiteMask(jnp.zeros((1, T, CA)), jnp.ones((1, T)))}
  full = target.masked_forward(weights, components, TOKENS[None], {})
  ablated = target.masked_forward(weights, components, TOKENS[None], off)
  np.testing.assert_allclose(from_a, full[0, 2, 0] - ablated[0, 2, 0],
                             rtol=1e-4)
  assert graph.nodes[0] == attribution.Node(attribution.LOGIT, 2, 0, None)
  np.testing.assert_allclose(graph.logit, full[0, 2, 0], rtol=1e-6)


def test_edges_run_forward_in_sites_and_positions(linear):
  graph = _linear_graph(linear, share=1.0)
  order = {"a": 0, "b": 1, attribution.LOGIT: 2}
  assert graph.edges
  for e in graph.edges:
    source, target = graph.nodes[e.source], graph.nodes[e.target]
    assert order[source.site] < order[target.site]
    assert source.position <= target.position


def test_pruning_keeps_the_fewest_edges_carrying_the_share(linear):
  weight = np.asarray([[3.0, -2.0, 1.0, 0.5]])
  counts = [int(attribution.kept_counts(weight, np.asarray([6.5]), s)[0])
            for s in (0.4, 0.5, 0.9, 1.0)]
  assert counts == [1, 2, 3, 4]
  # Edges past `max_edges` count in the total: all kept ones fall short.
  assert attribution.kept_counts(weight, np.asarray([100.0]), 0.9)[0] == 4
  full, pruned = (_linear_graph(linear, s) for s in (1.0, 0.5))
  assert 0 < len(pruned.edges) < len(full.edges)
  into = [abs(e.weight) for e in full.edges if e.target == 0]
  kept = [abs(e.weight) for e in pruned.edges if e.target == 0]
  assert sum(kept) >= 0.5 * sum(into)
  assert sum(kept) - min(kept) < 0.5 * sum(into)


def test_every_node_reaches_the_output(linear):
  graph = _linear_graph(linear, share=0.6, max_targets=3)
  reached, grew = {0}, True
  while grew:
    more = {e.source for e in graph.edges if e.target in reached}
    grew = not more <= reached
    reached |= more
  assert reached == set(range(len(graph.nodes)))


def test_graph_converts_to_json(linear):
  graph = _linear_graph(linear, share=0.9)
  data = json.loads(json.dumps(attribution.graph_json(graph)))
  assert data["nodes"][0] == {"site": "logit", "position": 2,
                              "component": 0, "ci": None}
  assert len(data["edges"]) == len(graph.edges)
  assert data["edges"][0] == graph.edges[0]._asdict()


def test_summed_edges_add_up_per_site_and_position(linear):
  graph = _linear_graph(linear, share=1.0)
  sums = attribution.summed_edges(graph)
  assert sum(e.weight for e in sums) == pytest.approx(
    sum(e.weight for e in graph.edges))
  assert len({(e.source, e.target) for e in sums}) == len(sums)
  assert [abs(e.weight) for e in sums] == sorted(
    (abs(e.weight) for e in sums), reverse=True)
  into = [e for e in sums if e.source == ("b", 2)
          and e.target == (attribution.LOGIT, 2)]
  want = sum(e.weight for e in graph.edges if e.target == 0
             and graph.nodes[e.source][:2] == ("b", 2))
  assert len(into) == 1 and into[0].weight == pytest.approx(want)


def test_node_masks_mark_each_component_node_at_its_position(linear):
  graph = _linear_graph(linear, share=0.5)
  masks = attribution.node_masks(graph, SITES, T)
  assert {k: v.shape for k, v in masks.items()} == {"a": (T, CA),
                                                    "b": (T, CB)}
  marked = {(site, int(p), int(c)) for site, m in masks.items()
            for p, c in zip(*np.nonzero(m))}
  assert marked == {n[:3] for n in graph.nodes[1:]}
  assert all(set(np.unique(m)) <= {0.0, 1.0} for m in masks.values())


def test_the_drawn_graph_has_its_nodes_and_edges(linear, tmp_path):
  graph = _linear_graph(linear, share=0.5)
  data = attribution.graph_json(graph)
  ax = Figure().subplots()
  drawn = figures.draw_attribution_graph(ax, data, [s.name for s in SITES])
  assert len(drawn.nodes.get_offsets()) == len(graph.nodes)
  assert len(drawn.edges.get_segments()) == len(graph.edges)
  np.testing.assert_allclose(
    np.sort(drawn.edges.get_linewidths()),
    np.sort([abs(e.weight) for e in graph.edges])
    / max(abs(e.weight) for e in graph.edges) * 4.0, rtol=1e-6)
  top = drawn.nodes.get_offsets()[0]  # the output, above every site
  assert top[1] == len(SITES) and top[0] == graph.position
  path = figures.plot_attribution_graph(data, [s.name for s in SITES],
                                        tmp_path / "g.png")
  assert open(path, "rb").read(4) == b"\x89PNG"


# The induction toy: a random prompt whose positions 4..11 repeat at
# 12..19. At Q the token is the one at Q - 8, so an induction head attends
# to Q - 7, the token after the earlier copy, and copies it.
Q = 17


@pytest.fixture(scope="module")
def induction_graph(induction):
  base = np.random.default_rng(0).integers(0, 32, 24)
  base[12:20] = base[4:12]
  tokens = jnp.asarray(base, jnp.int32)
  clean = explore.ablated_forward(induction, tokens[None]).clean[0, Q]
  assert int(jnp.argmax(clean)) == base[Q + 1]  # the target copies
  graph = explore.attribution_graph(induction, tokens, position=Q, share=1.0,
                                    threshold=0.0, max_targets=1,
                                    max_edges=4096)
  assert graph.token == base[Q + 1]
  return graph


def _into_logit_by_position(graph, kind):
  sums = np.zeros(Q + 1)
  for e in graph.edges:
    node = graph.nodes[e.source]
    if e.target == 0 and node.site.endswith(kind):
      sums[node.position] += abs(e.weight)
  return sums


def test_induction_values_and_keys_are_read_at_the_earlier_copy(
    induction_graph):
  """The value copied is the one at Q - 7, and it is the strongest edge
  from another position. The keys that move the logit are the earlier
  copy's (positions 4..11), where the head attends. Which of those keys
  weighs most is not the mechanism's: it follows the toy's rounding (the
  toy trained under `./dev test`'s XLA options puts Q - 7 first, under
  XLA's defaults Q - 9 and Q - 10), so the test does not pin it."""
  values = _into_logit_by_position(induction_graph, "v_proj")
  assert int(np.argmax(values)) == Q - 7, values
  keys = _into_logit_by_position(induction_graph, "k_proj")
  assert keys[4:12].sum() > 0.8 * keys.sum(), keys
  strongest = max((e for e in induction_graph.edges if e.target == 0
                   and induction_graph.nodes[e.source].position != Q),
                  key=lambda e: abs(e.weight))
  node = induction_graph.nodes[strongest.source]
  assert (node.site, node.position) == ("layers.1.self_attn.v_proj", Q - 7)


def test_induction_queries_and_later_sites_act_at_the_copy_position(
    induction_graph):
  """Layer 1 is the last: only its attention's keys and values move the
  output from other positions."""
  for kind in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    sums = _into_logit_by_position(induction_graph, kind)
    assert sums[Q] > 0 and not sums[:Q].any(), (kind, sums)


def test_induction_graph_keeps_values_to_output_to_logit(induction):
  base = np.random.default_rng(0).integers(0, 32, 24)
  base[12:20] = base[4:12]
  graph = explore.attribution_graph(induction, base, position=Q, share=0.9,
                                    threshold=0.0, max_targets=16)
  nodes = graph.nodes
  feeds_logit = {e.source for e in graph.edges if e.target == 0
                 and nodes[e.source].site.endswith("o_proj")}
  assert any(nodes[e.source].site.endswith("v_proj")
             and nodes[e.source].position == Q - 7
             and e.target in feeds_logit for e in graph.edges)


# The arithmetic toy at its initialisation (its training is a slow test
# of its own): the answer logit's attributions as a property of any model.
C = 8


@pytest.fixture(scope="module")
def addsub():
  toy = registry.get("addsub")
  names = tuple(f"layers.{i}.mlp.{k}_proj" for i in (0, 1)
                for k in ("gate", "up", "down"))
  sites = glu_sites.site_specs(toy.token_model, names, C)
  target = registry.fns_for(toy, C, sites)
  weights = registry.weights_for(toy, jax.jit(toy.init)(jax.random.key(0)),
                                 sites)
  components = sites_lib.init_components_projected(
    jax.random.key(1), sites, target.frozen_stacks(weights))
  ci_config = ci_fns.CIConfig("vector_mlp", (8,))
  ci_fn = ci_fns.make_ci_fn(ci_config, sites)
  decomposition = Decomposition(components, ci_fn.init(jax.random.key(2)),
                                sites, ci_config, 0, {})
  return explore.LoadedRun(TrainConfig(), target, weights, decomposition,
                           ci_fn, explore.jit_functions(target, ci_fn))


PROMPT = jnp.asarray([7, arithmetic.ArithmeticConfig().modulus, 5,
                      arithmetic.ArithmeticConfig().modulus + 2, 12],
                     jnp.int32)


def test_addsub_answer_attributions_sum_to_the_all_masks_derivative(addsub):
  """Σ m·∂f/∂m = d/dt f(t·m) at t = 1 (I51), the derivative taken by
  central differences of the masked forward."""
  at = jnp.int32(arithmetic.ANSWER_POSITION)
  d = addsub.decomposition
  n = sum(s.c for s in d.sites) * PROMPT.shape[0]
  rows, _ = jax.jit(functools.partial(
    attribution.attribution_rows, addsub.target, addsub.ci_fn))(
      addsub.weights, d.components, d.ci_params, PROMPT, at, jnp.int32(12),
      jnp.asarray([n], jnp.int32))

  @jax.jit
  def logits(t):
    masks = {s.name: SiteMask(jnp.full((1, 5, s.c), t), jnp.ones((1, 5)))
             for s in d.sites}
    return addsub.target.masked_forward(addsub.weights, d.components,
                                        PROMPT[None], masks)

  def logit(t):
    return float(logits(jnp.float32(t))[0, at, 12])

  eps = 1e-2
  derivative = (logit(1 + eps) - logit(1 - eps)) / (2 * eps)
  np.testing.assert_allclose(float(rows.sum()), derivative, rtol=2e-3,
                             atol=1e-4)
  assert not np.asarray(rows[0, at + 1:]).any()  # causal


def test_addsub_answer_logit_has_edges_from_both_mlps(addsub):
  graph = explore.attribution_graph(addsub, PROMPT,
                                    position=arithmetic.ANSWER_POSITION,
                                    token=12, share=0.9, threshold=0.0)
  layers = {graph.nodes[e.source].site.split(".")[1]
            for e in graph.edges if e.target == 0}
  assert layers == {"0", "1"}
  assert graph.token == 12


@pytest.mark.parametrize("kwargs, match", [
  ({"share": 0.0}, "share"), ({"share": 1.5}, "share"),
  ({"position": 9}, "position 9"), ({"token": 999}, "vocabulary"),
  ({"max_targets": 0}, "max_targets"), ({"chunk": 0}, "chunk"),
  ({"max_edges": -1}, "max_edges"),
  ({"threshold": 1.0}, "threshold"),
])
def test_bad_arguments_are_refused(addsub, kwargs, match):
  with pytest.raises(ValueError, match=match):
    explore.attribution_graph(addsub, PROMPT, **kwargs)


def test_a_toy_without_tokens_is_refused(tms):
  with pytest.raises(ValueError, match="not a language model"):
    explore.attribution_graph(tms, [0, 1])
