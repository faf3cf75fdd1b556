"""Clustering by description length (design §15.1, I50) against known
answers: synthetic firing whose optimum is known, a TMS 5-2 decomposition
built to be the recovered one, and the firing of ResidMLP-1's `mlp_out`."""

import itertools
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import (
  clustering, explore, harvest_batches, harvest_settings, harvesting)
from decompax.io import harvest_store


def _entropy(p: float) -> float:
  """Return the binary entropy of `p` in bits."""
  return 0.0 if p in (0.0, 1.0) else float(
    -p * np.log2(p) - (1 - p) * np.log2(1 - p))


def _exact_bits(fired: np.ndarray, partition) -> float:
  """Return L of design §15.1 written out from the firing matrix itself
  (each cluster's firing by OR, no pairwise estimate)."""
  n = fired.shape[0]
  alive = int((fired.sum(0) > 0).sum())
  total = alive * np.log2(len(partition))
  for members in partition:
    big_f = float(fired[:, list(members)].any(1).sum())
    total += n * _entropy(big_f / n)
    total += sum(big_f * _entropy(fired[:, m].sum() / big_f) for m in members)
    total += (1 + len(members)) * 0.5 * np.log2(n)
  return total


def _partitions(items):
  """Yield every partition of `items` (a list) as a list of tuples."""
  if not items:
    yield []
    return
  first, rest = items[0], items[1:]
  for sub in _partitions(rest):
    for i in range(len(sub)):
      yield sub[:i] + [(first,) + sub[i]] + sub[i + 1:]
    yield [(first,)] + sub


@pytest.fixture(scope="module")
def firing():
  """Four independent components (rate 0.05) and a block of three that
  always fire together (rate 0.1), over 4000 positions."""
  rng = np.random.default_rng(0)
  n = 4000
  independent = rng.random((n, 4)) < 0.05
  block = np.repeat(rng.random((n, 1)) < 0.1, 3, axis=1)
  return np.concatenate([independent, block], axis=1)


def test_independent_components_stay_singletons(firing):
  found = clustering.cluster_site(clustering.counts_from_firing(firing[:, :4]))
  assert found.clusters == ((0,), (1,), (2,), (3,))
  assert found.bits == pytest.approx(found.singleton_bits)


def test_a_block_that_always_fires_together_is_one_cluster(firing):
  found = clustering.cluster_site(clustering.counts_from_firing(firing))
  assert found.clusters == ((0,), (1,), (2,), (3,), (4, 5, 6))
  assert found.fired[-1] == firing[:, 4].sum()
  assert found.bits < found.singleton_bits


def test_the_found_partition_is_the_exact_optimum(firing):
  # Bell(7) = 877 partitions: the greedy's answer has the least L computed
  # from the firing matrix itself, and its own L is that value.
  found = clustering.cluster_site(clustering.counts_from_firing(firing))
  exact = {tuple(sorted(p)): _exact_bits(firing, p)
           for p in _partitions(list(range(7)))}
  best = min(exact, key=exact.get)
  assert tuple(sorted(found.clusters)) == best
  assert found.bits == pytest.approx(exact[best], rel=1e-9)


def test_components_that_never_fire_are_left_out(firing):
  padded = np.concatenate([np.zeros((firing.shape[0], 1), bool), firing], 1)
  found = clustering.cluster_site(clustering.counts_from_firing(padded))
  assert found.never_fired == (0,)
  assert found.clusters[-1] == (5, 6, 7)
  assert all(0 not in c for c in found.clusters)


def test_ties_go_to_the_lowest_pair_and_repeat_exactly():
  # Two identical blocks of two: every merge inside a block gains the same,
  # and the same counts give the same clusters every time.
  rng = np.random.default_rng(1)
  a, b = (np.repeat(rng.random((3000, 1)) < 0.1, 2, 1) for _ in range(2))
  counts = clustering.counts_from_firing(np.concatenate([a, b], 1))
  first = clustering.cluster_site(counts)
  assert first.clusters == ((0, 1), (2, 3))
  assert clustering.cluster_site(counts) == first


def test_the_union_estimate_is_exact_for_nested_firing():
  # A ⊂ B ⊂ C: every triple overlap is the smallest pairwise count.
  rng = np.random.default_rng(2)
  u = rng.random(5000)
  nested = np.stack([u < 0.05, u < 0.08, u < 0.1], axis=1)
  found = clustering.cluster_site(clustering.counts_from_firing(nested))
  assert found.clusters == ((0, 1, 2),)
  assert found.fired == (float(nested[:, 2].sum()),)
  assert found.bits == pytest.approx(_exact_bits(nested, [(0, 1, 2)]))


def test_residmlp1_mlp_out_components_form_one_cluster():
  """ResidMLP-1's `mlp_out` (SPEC §10): a recovered decomposition's 50
  dense components each fire on every input with an active feature. This
  builds those firing statistics (100 features at rate 0.01, the toy's
  input distribution) rather than training a run; the per-feature
  components of `mlp_in`, a site of their own, stay singletons."""
  rng = np.random.default_rng(3)
  features = rng.random((4096, 100)) < 0.01
  any_active = features.any(axis=1, keepdims=True)
  mlp_out = np.repeat(any_active, 50, axis=1)
  found = clustering.cluster_site(clustering.counts_from_firing(mlp_out))
  assert found.clusters == (tuple(range(50)),)
  assert found.fired == (float(any_active.sum()),)
  found = clustering.cluster_site(clustering.counts_from_firing(features))
  assert found.clusters == tuple((i,) for i in range(100))


def _recovered_tms(path: str) -> explore.LoadedRun:
  """Return the TMS 5-2 run (C = 6) at `path` with the decomposition a
  recovered run has on `linear1`: component c < 5 writes feature c's row
  of `W` and its CI is 1 wherever feature c is active (its CI MLP reads
  `x·V[:, c] = x_c` through one steep unit), component 5 is empty;
  `linear2`'s CI is 0."""
  run = explore.load_run(path)
  d, w = run.decomposition, run.weights.w
  v1 = jnp.zeros((1, 5, 6)).at[0, :, :5].set(jnp.eye(5))
  u1 = jnp.zeros((1, 6, 2)).at[0, :5].set(w)
  components = {**d.components, "linear1": d.components["linear1"]._replace(
    v=v1, u=u1)}
  mlp1, mlp2 = d.ci_params["linear1"], d.ci_params["linear2"]
  steep = mlp1._replace(
    w_in=jnp.zeros_like(mlp1.w_in).at[:, 0].set(1.0),
    b_in=jnp.zeros_like(mlp1.b_in),
    w_out=jnp.zeros_like(mlp1.w_out).at[:5, 0].set(1e3),
    b_out=jnp.zeros_like(mlp1.b_out))
  off = mlp2._replace(w_out=jnp.zeros_like(mlp2.w_out),
                      b_out=jnp.full_like(mlp2.b_out, -1.0))
  built = d._replace(components=components,
                     ci_params={**d.ci_params, "linear1": steep,
                                "linear2": off})
  return explore.load_run(path, built)


@pytest.fixture(scope="module")
def recovered_tms(finished_run, tmp_path_factory):
  """A copy of the TMS run with the recovered decomposition, harvested."""
  path = str(tmp_path_factory.mktemp("cluster") / "tms")
  # Another test may have harvested the shared run: not this harvest.
  shutil.copytree(finished_run("tms"), path,
                  ignore=shutil.ignore_patterns(harvest_store.HARVEST_DIR))
  run = _recovered_tms(path)
  settings = harvest_settings.resolve(run, harvest_settings.Request(
    positions=4096, batch_size=512, top_k=2, ablation_batches=0))
  out = f"{path}/{harvest_store.HARVEST_DIR}"
  record = harvesting.harvest(run, settings, out, say=lambda _: None)
  harvesting.write_manifest(out, path, run, settings, record)
  return run, harvesting.load_harvest(path)


def test_tms_clusters_are_the_single_features(recovered_tms):
  _, harvest = recovered_tms
  n = harvest.manifest["positions"]
  found = clustering.cluster_site(
    clustering.site_counts(harvest.sites["linear1"], n))
  assert found.clusters == tuple((c,) for c in range(5))
  assert found.never_fired == (5,)
  assert clustering.cluster_site(clustering.site_counts(
    harvest.sites["linear2"], n)).never_fired == tuple(range(6))


def test_joint_and_summed_effects_are_the_ablations_they_name(recovered_tms):
  run, _ = recovered_tms
  inputs = harvest_batches.batch_source(run, harvest_settings.resolve(
    run, harvest_settings.Request(batch_size=64, ablation_batches=0)))(0)
  pair = clustering.SiteClusters(((0, 1), (2,)), (0.0, 0.0), (), 0.0, 0.0)
  effects = clustering.cluster_effects(run, inputs, {"linear1": pair})
  joint, single = effects["linear1"]
  assert single is None
  both = explore.ablated_forward(run, inputs, {"linear1": [0, 1]})
  alone = [explore.ablated_forward(run, inputs, {"linear1": [c]})
           for c in (0, 1)]
  assert joint.joint == pytest.approx(float(both.divergence), rel=1e-5)
  assert joint.members == pytest.approx(
    [float(a.divergence) for a in alone], rel=1e-5)
  assert joint.summed == pytest.approx(sum(joint.members))
  # Features 0 and 1 are separate outputs: removing both costs what
  # removing each does, up to the rare inputs where both are active.
  assert joint.joint > 0
  assert joint.joint == pytest.approx(joint.summed, rel=0.2)
