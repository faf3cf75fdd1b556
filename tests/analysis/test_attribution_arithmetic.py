"""Attribution graphs on a trained arithmetic model's answer.

The graph of the answer logit of `[a, op, b, =]` (position 3) against what
is known of the model:

- Layer 1 is the last, and an MLP acts on its own position alone, so layer
  1's MLP components reach the answer only at the answer position; layer
  0's reach it from the operands and the operator through layer 1's
  attention.
- An edge into the logit is the first-order change of the logit as that
  component is removed (gradient × mask, I51), so the strongest edges
  predict each component's own ablation: the logit at every mask 1 minus
  the logit with that one component at that position off.
- A trained targeted decomposition's graph holds what the answer needs:
  with only the graph's components kept (every other mask 0, the delta
  path on) the model still answers. (Removing only them, every other
  mask at 1, is no test of it: the components that are not alive on the
  prompt, at mask 1, carry much of the arithmetic again.)

The fast variant is a small arithmetic model trained here for a few
hundred steps, decomposed exactly (each MLP matrix's SVD, one component
per singular direction, so the delta path is zero); the slow one is the
targeted decomposition of docs/targeted.md (`flags/addsub_tpd.flags`) trained for 500
steps.
"""

import os
import pathlib
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import attribution, explore
from decompax.core import ci_fns
from decompax.core.masks import SiteMask
from decompax.core.sites import Factors
from decompax.io.decomposition import Decomposition
from decompax.recipe.config import TrainConfig
from decompax.targets import arithmetic, glu_config, glu_sites, registry
from decompax.targets import toy_training as train_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
A = arithmetic.ANSWER_POSITION
MLPS = tuple(f"layers.{i}.mlp.{k}_proj" for i in (0, 1)
             for k in ("gate", "up", "down"))
# Edges into the logit whose ablation is compared, per prompt.
STRONGEST = 20


def _svd_components(stacks: dict) -> dict[str, Factors]:
  """Return each matrix kind's exact rank-1 split: `V` its left singular
  vectors, `U` the singular values times the right ones."""
  out = {}
  for kind, w in stacks.items():
    left, s, right = jnp.linalg.svd(w.astype(jnp.float32),
                                    full_matrices=False)
    out[kind] = Factors(left, s[..., None] * right)
  return out


@pytest.fixture(scope="module")
def small_addsub():
  """A `a ± b mod 7` model of d_model 32 trained 300 steps, its MLPs
  decomposed exactly by SVD (C = 32, every component alive at CI
  threshold 0)."""
  model = glu_config.GluConfig(
    n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64,
    vocab_size=12, rope_theta=10000.0, rms_eps=1e-6, tied=False,
    qk_norm=False, family="toy", max_position=16)
  config = arithmetic.ArithmeticConfig(
    modulus=7, model=model, seq_len=8, min_repeat=2, max_repeat=4,
    batch_size=64, other_batch_size=4,
    training=train_lib.TargetTraining(steps=300, lr=1e-2, chunk_steps=300))
  toy = registry.build_addsub(config)
  trained = arithmetic.train(jax.random.key(0), config)
  sites = glu_sites.site_specs(model, MLPS, 32)
  target = registry.fns_for(toy, 32, sites)
  weights = registry.weights_for(toy, trained, sites)
  ci_config = ci_fns.CIConfig("vector_mlp", (8,))
  ci_fn = ci_fns.make_ci_fn(ci_config, sites)
  decomposition = Decomposition(
    _svd_components(target.frozen_stacks(weights)),
    ci_fn.init(jax.random.key(1)), sites, ci_config, 0, {})
  run = explore.LoadedRun(TrainConfig(), target, weights, decomposition,
                          ci_fn, explore.jit_functions(target, ci_fn))
  return run, np.asarray(arithmetic.grid_prompts(config))


def _answer_forward(run: explore.LoadedRun):
  """Return a jitted `(tokens [T], masks {site: [n, T, C]}) -> log-softmax
  at the answer position [n, vocab]` and the logits beside it, the delta
  path on."""
  d = run.decomposition

  @jax.jit
  def forward(tokens, masks):
    n = next(iter(masks.values())).shape[0]
    site_masks = {s.name: SiteMask(masks[s.name],
                                   jnp.ones((n, tokens.shape[0])))
                  for s in d.sites}
    batch = jnp.broadcast_to(tokens, (n, tokens.shape[0]))
    logits = run.target.masked_forward(run.weights, d.components, batch,
                                       site_masks)[:, A]
    return logits, jax.nn.log_softmax(logits, axis=-1)

  return forward


def _ones(sites, n: int, t: int) -> dict[str, np.ndarray]:
  return {s.name: np.ones((n, t, s.c), np.float32) for s in sites}


def _logit_edges(graph: attribution.AttributionGraph, k: int):
  """Return the `k` strongest edges into the output."""
  edges = [e for e in graph.edges if e.target == 0]
  return sorted(edges, key=lambda e: -abs(e.weight))[:k]


def ablation_agreement(run, forward, prompt, graph) -> tuple[float, float]:
  """Return, over the strongest edges into the answer logit, the share
  whose sign is that of their component's own ablation effect (logit at
  every mask 1 minus logit with it off) and the rank correlation of the
  two."""
  edges = _logit_edges(graph, STRONGEST)
  t = len(prompt)
  masks = _ones(run.decomposition.sites, len(edges) + 1, t)
  for i, e in enumerate(edges, start=1):
    node = graph.nodes[e.source]
    masks[node.site][i, node.position, node.component] = 0.0
  logits, _ = forward(jnp.asarray(prompt), masks)
  effect = np.asarray(logits[0, graph.token] - logits[1:, graph.token])
  weight = np.asarray([e.weight for e in edges])
  ranks = [np.argsort(np.argsort(x)) for x in (weight, effect)]
  return (float(np.mean(np.sign(weight) == np.sign(effect))),
          float(np.corrcoef(*ranks)[0, 1]))


class Faithfulness(NamedTuple):
  """Answer accuracy over prompts: clean, with only each prompt's graph
  components kept, and with them removed; and per position the share of
  the |attribution| into the answer logit."""

  clean: float
  kept: float
  removed: float
  position_share: np.ndarray


def faithfulness(run, forward, prompts, graphs) -> Faithfulness:
  """Return `Faithfulness` over `prompts` and their answer graphs."""
  sites = run.decomposition.sites
  hits, shares = [], np.zeros(prompts.shape[1])
  for prompt, graph in zip(prompts, graphs):
    kept = attribution.node_masks(graph, sites, len(prompt))
    masks = {s.name: np.stack([np.ones_like(kept[s.name]), kept[s.name],
                               1.0 - kept[s.name]]) for s in sites}
    _, log_p = forward(jnp.asarray(prompt), masks)
    hits.append(np.asarray(jnp.argmax(log_p, axis=-1)) == prompt[A + 1])
    for e in graph.edges:
      if e.target == 0:
        shares[graph.nodes[e.source].position] += abs(e.weight)
  clean, kept, removed = np.mean(hits, axis=0)
  return Faithfulness(float(clean), float(kept), float(removed),
                      shares / shares.sum())


def _graph(run, prompt, **kwargs):
  return explore.attribution_graph(run, prompt[:A + 1], position=A,
                                   token=int(prompt[A + 1]), **kwargs)


def test_layer_1_mlps_reach_the_answer_only_from_its_position(small_addsub):
  run, grid = small_addsub
  for prompt in grid[::17]:
    graph = _graph(run, prompt, share=1.0, threshold=0.0, max_targets=1,
                   max_edges=4096)
    sources = [graph.nodes[e.source] for e in graph.edges if e.target == 0]
    layer1 = {n.position for n in sources if n.site.startswith("layers.1")}
    layer0 = {n.position for n in sources if n.site.startswith("layers.0")}
    assert layer1 == {A}
    assert layer0 == {0, 1, 2, A}  # the operands and operator too


def test_strongest_edges_predict_each_component_s_ablation(small_addsub):
  run, grid = small_addsub
  forward = _answer_forward(run)
  measured = [ablation_agreement(
    run, forward, prompt, _graph(run, prompt, threshold=0.0, max_targets=1,
                                 max_edges=4096)) for prompt in grid[::11]]
  agree, corr = np.mean(measured, axis=0)
  # Measured: 0.97 of the signs agree, rank correlation 0.88 (means over
  # 9 prompts, the least 0.67): removing a component is a step of 1 in its
  # mask, which the first-order edge only approximates.
  assert agree >= 0.85 and corr >= 0.75, measured


@pytest.fixture(scope="module")
def trained_addsub(tmp_path_factory):
  out = tmp_path_factory.mktemp("addsub") / "run"
  done = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"),
     f"--flagfile={ROOT / 'flags' / 'addsub_tpd.flags'}", "--num_steps=500",
     "--eval_every=0", "--slow_eval_every=0", "--figures_every=0",
     f"--output_dir={out}"], cwd=ROOT, capture_output=True, text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  return explore.load_run(str(out))


@pytest.mark.slow
def test_a_trained_targeted_decomposition_s_graph_holds_the_answer(
    trained_addsub):
  run = trained_addsub
  prompts = np.asarray(arithmetic.grid_prompts(
    arithmetic.ArithmeticConfig()))[::23]
  forward = _answer_forward(run)
  graphs = [_graph(run, p) for p in prompts]
  result = faithfulness(run, forward, prompts, graphs)
  agree, corr = np.mean([ablation_agreement(run, forward, p, g)
                         for p, g in zip(prompts, graphs)], axis=0)
  # Measured (46 prompts, every 23rd of the grid): clean 1.00, kept 0.87,
  # removed 0.61; every edge into the logit from the answer position;
  # signs agree 0.97, rank correlation 0.92.
  assert result.clean == 1.0
  assert result.kept >= 0.8 and result.removed < result.kept, result
  assert result.position_share[A] >= 0.99, result
  assert agree >= 0.9 and corr >= 0.8, (agree, corr)
