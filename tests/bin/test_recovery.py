"""Shortened decompositions recover the toys' known mechanisms (SPEC §10).

Full-length results are in the README; these runs are cut short to stay in
the default suite and assert what a short run reliably shows.
"""

import pathlib

import jax
import numpy as np
import pytest

from decompax.bin import train
from decompax.core import probe
from decompax.targets import registry

FLAGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "flags"


def _run(config):
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  weights = toy.train(toy.default_seed)
  run = train.build_run(config, toy, target, weights)
  state = run.state
  for _ in range(config.num_steps):
    state, metrics = run.built.step(state, weights, run.data_key)
  ci = probe.probe_ci(target, run.ci_fn, weights, state.components,
                      state.ci_params)
  return {k: np.asarray(v) for k, v in jax.device_get(ci).items()}, {
    k: float(v) for k, v in jax.device_get(metrics).items()}


def test_tms_5_2_embedding_becomes_one_component_per_feature(parse):
  """TMS 5-2, paper recipe after a faithfulness warmup, 10k of its 40k steps
  (seed 1): linear1 shows the identity CI pattern with five alive components."""
  config = parse("--seed=1", "--num_steps=10000",
                     "--faithfulness_warmup_steps=200")
  ci, metrics = _run(config)
  assert len(probe.alive_components(ci["linear1"])) == 5
  assert probe.identity_ci_error(ci["linear1"]) == 0
  assert metrics["loss/faithfulness"] < 1e-5
  # Each input has ρ·n = 0.25 active features on average.
  assert 0.1 < metrics["ci_l0/linear1"] < 0.4


@pytest.mark.slow
def test_tms_5_2_vpd_flagfile_recovers_one_component_per_feature(parse):
  """The full VPD flagfile (40k steps): five alive components per matrix,
  each serving one feature."""
  config = parse(f"--flagfile={FLAGS_DIR / 'tms_5-2_vpd.flags'}")
  ci, metrics = _run(config)
  for site in ("linear1", "linear2"):
    active = probe.active_features(ci[site])
    assert len(active) == 5
    assert sorted(f for fs in active.values() for f in fs) == list(range(5))
  assert metrics["loss/faithfulness"] < 1e-6
