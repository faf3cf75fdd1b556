"""bench/intervention.py times a curve of the model it builds; the curve at
mask 1 is that model's own prediction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import explore


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("intervention")


def test_a_curve_of_the_random_model_is_timed(bench, tiny_lm):
  run = bench.random_run(tiny_lm, 1, 4, 6)
  tokens = jnp.asarray([1, 5, 2, 7, 3, 9], jnp.int32)
  result = bench.time_curves(run, tokens, 5, 2)
  assert result["site"] == "layers.1.mlp.gate_proj" and result["points"] == 5
  assert result["first_s"] > 0 and 0 < result["min_s"] <= result["median_s"]
  sweep = result["sweep"]
  clean, _ = run.target.clean_forward(run.weights, tokens[None], ())
  want = jax.nn.log_softmax(clean[0, -1])[sweep.token]
  np.testing.assert_allclose(sweep.output[2], want, atol=1e-5)
  assert sweep.output.shape == (5,)
