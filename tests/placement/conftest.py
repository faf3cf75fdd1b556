"""Helpers of the placement tests: configs, placed runs, trajectories, HLO.

A run is built exactly as `bin/train` builds it (`assembly.build_run` with
a `shardings.Placement`), on the first `n` of the eight simulated CPU
devices, from untrained toy weights (training the target is irrelevant to
placement).
"""

import dataclasses
import math
import pathlib
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.bin import placement_setup, train_flags
from decompax.placement import shardings
from decompax.recipe import assembly
from decompax.recipe import lm as lm_lib
from decompax.placement import mesh as mesh_lib
from decompax.placement import table as table_lib
from decompax.targets import (
  glu_arrays, glu_config, glu_sites, glu_target, glu_weights, registry)
from decompax.targets import record as target_record

FLAGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "flags"


def vpd_config(name: str, *args: str) -> train_flags.TrainConfig:
  """Return the full VPD recipe of `flags/<name>.flags` with overrides.

  The step's terms are the recipe's; the faithfulness warmup before it is
  skipped. After the warmup `W − V·U` is ~1e-3 against weights of ~1, so a
  one-ulp difference in V/U (which any change of summation order makes)
  moves the faithfulness loss by ~1e-5 relative: measured 1.7e-5 at step 5
  on the 2x2x2 mesh, with V/U equal to 1.8e-7. Without the warmup every
  metric, faithfulness included, agrees to ~2e-7.
  """
  return train_flags.parse_config(
    f"--flagfile={FLAGS_DIR / (name + '.flags')}", "--eval_every=0",
    "--slow_eval_every=0", "--faithfulness_warmup_steps=0", *args)


class Problem(NamedTuple):
  """A config with its toy, function table and (untrained) weights."""

  config: train_flags.TrainConfig
  toy: object
  target: object
  weights: object


def problem(config: train_flags.TrainConfig) -> Problem:
  """Return the toy problem a config describes."""
  toy = registry.get(config.target)
  target = toy.fns(config.c)
  return Problem(config, toy, target, toy.init(jax.random.key(0)))


# A small two-block GLU transformer. C equals the vocabulary so that a
# replicated `[B, T, C]` and a replicated `[B, T, vocab]` are both caught by
# one element threshold that every weight stays below.
LM_CONFIG = glu_config.GluConfig(
  n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32,
  vocab_size=64, rope_theta=10000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)


def lm_problem(*args: str) -> Problem:
  """Return the two-block LM under the reference LM recipe (l18.flags:
  every term, the chunkwise-transformer CI) at toy sizes: MLPs of both
  blocks, C = 64, a one-block CI transformer of width 16, fp32."""
  config = train_flags.parse_config(
    f"--flagfile={FLAGS_DIR / 'l18.flags'}", "--model_dir=unused",
    "--compute_dtype=float32", "--attention=reference", "--c=64",
    "--ci_d_model=16", "--ci_n_blocks=1", "--ci_n_heads=2",
    "--ci_d_mlp=32", "--ci_attention=reference", "--seq_len=32",
    "--batch_size=16", "--num_steps=5", "--eval_every=0",
    "--slow_eval_every=0", *args)
  names = tuple(glu_weights.site_name(i, r) for i in range(LM_CONFIG.n_layers)
                for r in ("gate", "up", "down"))
  sites = glu_sites.site_specs(LM_CONFIG, names, config.c)
  fns = glu_target.target_fns(LM_CONFIG, sites, "reference", remat=True)
  seg = glu_sites.span_segments(LM_CONFIG, sites)
  stack = glu_weights.init_stack(jax.random.key(0), LM_CONFIG,
                                 LM_CONFIG.n_layers)
  arrays = {k: np.asarray(v) for k, v in stack._asdict().items()
            if v is not None}
  e, h = jax.random.split(jax.random.key(1))
  shape = (LM_CONFIG.vocab_size, LM_CONFIG.d_model)
  arrays.update(embed=np.asarray(jax.random.normal(e, shape)),
                head=np.asarray(jax.random.normal(h, shape)) / 4,
                norm=np.ones(LM_CONFIG.d_model, np.float32))
  weights = glu_arrays.weights_from_arrays(arrays, LM_CONFIG, seg)

  def sample_inputs(key, batch_size):
    return jax.random.randint(key, (batch_size, config.seq_len), 0,
                              LM_CONFIG.vocab_size, jnp.int32)

  lm = target_record.Target(name="glu_2block", sample_inputs=sample_inputs,
                            token_model=LM_CONFIG)
  return Problem(config, lm, fns, weights)


class Trajectory(NamedTuple):
  """Host metrics of each step, the final state and the compiled step."""

  metrics: list[dict[str, float]]
  state: object
  compiled: object
  run: object


def placement(shape: tuple[int, int, int], preset: str,
              overrides: tuple[str, ...] = ()) -> shardings.Placement:
  """Return a placement on the first `prod(shape)` simulated devices."""
  devices = jax.devices()[:math.prod(shape)]
  mesh = placement_setup.build_mesh(mesh_lib.MeshShape(*shape), devices)
  return shardings.Placement(mesh,
                                   table_lib.make_table(preset, overrides))


def trajectory(p: Problem, shape: tuple[int, int, int], preset: str,
               n_steps: int = 5) -> Trajectory:
  """Return `n_steps` of the run placed on a `(replicate, fsdp, tp)` mesh."""
  run = assembly.build_run(p.config, p.toy, p.target, p.weights,
                           placement=placement(shape, preset))
  compiled = run.built.step.lower(run.state, run.weights,
                                  run.data_key).compile()
  state, records = run.state, []
  for _ in range(n_steps):
    state, metrics = compiled(state, run.weights, run.data_key)
    records.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return Trajectory(records, state, compiled, run)


def assert_same_trajectory(reference: list[dict], other: list[dict],
                           rtol: float = 1e-5) -> None:
  """Assert every metric of every step agrees within `rtol` (SPEC I34)."""
  assert len(reference) == len(other)
  for step, (ref, got) in enumerate(zip(reference, other), start=1):
    assert ref.keys() == got.keys()
    for key in ref:
      np.testing.assert_allclose(got[key], ref[key], rtol=rtol, atol=0,
                                 err_msg=f"step {step} {key}")


def assert_replicas_identical(tree) -> int:
  """Assert every device holding the same slice of a leaf holds the same
  bits (SPEC I25); return the number of leaves checked."""
  leaves = jax.tree.leaves(tree)
  for leaf in leaves:
    by_slice: dict[str, np.ndarray] = {}
    for shard in leaf.addressable_shards:
      data = np.asarray(shard.data)
      first = by_slice.setdefault(str(shard.index), data)
      np.testing.assert_array_equal(data, first)
  return len(leaves)


def lead_shape(p: Problem) -> tuple[int, ...]:
  """Return the leading shape of the problem's activations."""
  return lm_lib.lead_shape(p.target, p.toy.sample_inputs,
                             p.config.batch_size)


def full_batch_elements(p: Problem) -> int:
  """Return the elements of a full-batch `[*L, C]` array (the smallest C):
  no placed step may hold that many in one buffer of one device."""
  return math.prod(lead_shape(p)) * min(s.c for s in p.target.sites)


_SHAPE = re.compile(r"\b(?:pred|[fsuc]\d+|bf16)\[([0-9,]*)\]")


def _elements(shape: str) -> int:
  return math.prod(int(d) for d in _SHAPE.match(shape).group(1).split(",")
                   if d)


def hlo_shapes(hlo_text: str) -> set[str]:
  """Return the distinct array shapes of an HLO text (per device once
  partitioned), layouts dropped."""
  return {m.group(0) for m in _SHAPE.finditer(hlo_text)}


def buffers_at_least(
  hlo_text: str, elements: int, among: set[str] | None = None
) -> list[str]:
  """Return the shapes of at least `elements` elements, optionally only
  those in `among`."""
  return sorted(s for s in hlo_shapes(hlo_text)
                if _elements(s) >= elements and (among is None or s in among))


def batch_shapes(p: Problem, reference: "Trajectory") -> set[str]:
  """Return the shapes of the one-device step that depend on the batch:
  present at the problem's batch, absent when it doubles.

  Needed where activations are wider than C (the residual MLP's 1000-wide
  stream): there a size threshold alone cannot tell a batch-sharded wide
  activation from a replicated `[B, C]`, but a replicated buffer keeps its
  one-device shape.
  """
  doubled = p._replace(config=dataclasses.replace(
    p.config, batch_size=2 * p.config.batch_size))
  run = assembly.build_run(doubled.config, p.toy, p.target, p.weights,
                           placement=placement((1, 1, 1), "ddp"))
  text = run.built.step.lower(run.state, run.weights,
                              run.data_key).compile().as_text()
  return hlo_shapes(reference.compiled.as_text()) - hlo_shapes(text)


@pytest.fixture(scope="session")
def tms_vpd() -> Problem:
  """TMS 5-2 with its full VPD recipe at a batch that splits 8 ways."""
  return problem(vpd_config("tms_5-2_vpd", "--batch_size=1024",
                            "--num_steps=5"))


@pytest.fixture(scope="session")
def tms_reference(tms_vpd) -> Trajectory:
  """Five steps of `tms_vpd` on one device: the reference trajectory."""
  return trajectory(tms_vpd, (1, 1, 1), "ddp")


@pytest.fixture(scope="session")
def lm() -> Problem:
  """The two-block LM problem."""
  return lm_problem()


@pytest.fixture(scope="session")
def lm_reference(lm) -> Trajectory:
  """Five steps of the two-block LM on one device."""
  return trajectory(lm, (1, 1, 1), "ddp")


@pytest.fixture(scope="session")
def helpers():
  """Return this module, so tests call its helpers (conftest is not
  importable by name under importlib mode)."""
  return sys.modules[__name__]
