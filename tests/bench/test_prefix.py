"""bench/prefix.py builds runs whose prefix sharing ON and OFF agree."""

import jax
import jax.numpy as jnp
import pytest

from decompax.core import sites as sites_lib
from decompax.core.masks import SiteMask
from decompax.targets import glu_config, glu_target

from bench import random_lm

# The bench's model at test size; layer 2 leaves a two-layer prefix.
SMALL = glu_config.GluConfig(
  n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
  vocab_size=32, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
LAYER = 2
# Smaller still for the default suite; a three-layer prefix, since no other
# scan of the step runs three trips.
TINY = glu_config.GluConfig(
  n_layers=4, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
  vocab_size=16, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
TINY_LAYER = 3


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("prefix")


def _scans(jaxpr, length: int, in_loop: bool = False) -> list[bool]:
  """Return, for each scan of `length` trips in `jaxpr` or a jaxpr it
  calls, whether it runs inside a loop (a scan or while body)."""
  found = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "scan" and eqn.params["length"] == length:
      found.append(in_loop)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own
        if hasattr(sub, "eqns"):
          found += _scans(sub, length,
                          in_loop or name in ("scan", "while"))
  return found


def test_sharing_runs_the_frozen_prefix_once_per_step(bench):  # SPEC §3.5
  """Fast variant of the slow check below, on the step as traced: with
  sharing ON the train step holds one scan over the frozen prefix, outside
  any loop (the clean pass's); OFF holds one per masked forward, which
  shows the count sees reruns. The compiled program is checked on the
  forwards alone below; ON/OFF loss agreement (D5) is checked on the
  forwards in tests/targets/test_glu_lm.py and, on the step, below."""
  config = bench.recipe(2, 4, 4)
  found = {}
  for sharing, run in bench.build_pair(config, TINY, TINY_LAYER).items():
    traced = jax.make_jaxpr(run.built.step)(run.state, run.weights,
                                            run.data_key)
    found[sharing] = _scans(traced.jaxpr, TINY_LAYER)
  assert found[True] == [False]
  assert len(found[False]) > 1


def test_compiled_off_keeps_a_prefix_scan_per_masked_forward(bench):  # I27
  """What the traced check cannot show: once compiled, OFF's reruns stay
  apart, tied to their masks (`glu_target.rerun_prefix`), where a compiler
  merges identical reruns into the clean pass's scan (XLA's CSE on a CPU;
  a TPU's compiler even with that pass off), and OFF would measure ON."""
  sites = bench.block_sites(bench.recipe(2, 4, 4), TINY, TINY_LAYER)
  weights = random_lm.random_weights(jax.random.key(0), TINY, sites,
                                     jnp.float32)
  components = sites_lib.init_components(jax.random.key(1), sites)
  tokens = jnp.zeros((2, 4), jnp.int32)
  masks = [{s.name: SiteMask(jnp.full((2, 4, s.c), value)) for s in sites}
           for value in (0.25, 0.75)]
  for sharing, scans in ((True, 1), (False, 3)):
    fns = glu_target.target_fns(TINY, sites, prefix_sharing=sharing)

    def forwards(weights, components, tokens, masks):
      clean, taps = fns.clean_forward(weights, tokens, fns.start_taps)
      return clean, [fns.masked_forward_taps(weights, components, tokens, m,
                                             taps, ())[0] for m in masks]

    compiled = jax.jit(forwards).lower(weights, components, tokens,
                                       masks).compile()
    assert bench.prefix_loops(compiled.as_text(), TINY_LAYER) == scans


@pytest.mark.slow
def test_sharing_on_and_off_take_the_same_first_step(bench):  # I27
  config = bench.recipe(2, 8, 8)
  variants = {}
  for sharing, run in bench.build_pair(config, SMALL, LAYER).items():
    variants[sharing] = bench.compile_variant(run, LAYER)
    bench.advance(variants[sharing])
  # ON runs the frozen prefix once per step: the clean pass's scan.
  assert variants[True]["prefix_loops"] == 1
  for key in bench.RECON_TERMS:
    on, off = variants[True]["first"][key], variants[False]["first"][key]
    assert on > 0
    assert abs(on - off) <= 2e-5, key  # SPEC §3.5 D5
