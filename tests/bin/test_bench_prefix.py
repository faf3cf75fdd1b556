"""bench/prefix.py builds runs whose prefix sharing ON and OFF agree."""

import pytest
from absl import flags

from decompax.targets import glu_config

# The bench's model at test size; layer 2 leaves a two-layer prefix.
SMALL = glu_config.GluConfig(
  n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24,
  vocab_size=32, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
LAYER = 2


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("prefix")


@pytest.mark.slow
def test_sharing_on_and_off_take_the_same_first_step(bench):  # I27
  try:
    config = bench.recipe(2, 8, 8)
  finally:
    flags.FLAGS.unparse_flags()
    flags.FLAGS.mark_as_parsed()
  arrays = bench.random_arrays(SMALL)
  variants = {}
  for sharing in (True, False):
    run = bench.build_variant(config, SMALL, arrays, LAYER, sharing)
    variants[sharing] = bench.compile_variant(run, LAYER)
    bench.advance(variants[sharing])
  # ON runs the frozen prefix once per step: the clean pass's scan.
  assert variants[True]["prefix_loops"] == 1
  for key in bench.RECON_TERMS:
    on, off = variants[True]["first"][key], variants[False]["first"][key]
    assert on > 0
    assert abs(on - off) <= 2e-5, key  # SPEC §3.5 D5
