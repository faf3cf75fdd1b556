"""bench/attribution_graph.py times graphs of the model it builds; the
graph's output node is that model's own logit."""

import jax.numpy as jnp
import numpy as np
import pytest

from decompax.analysis import attribution


@pytest.fixture(scope="module")
def intervention(load_bench):
  return load_bench("intervention")


def test_graphs_of_the_random_model_are_timed(load_bench, intervention,
                                              tiny_lm):
  bench = load_bench("attribution_graph")
  run = intervention.random_run(tiny_lm, 1, 4, 6)
  result = bench.time_graphs(run, tiny_lm.vocab_size, 6, 2, max_targets=4,
                             chunk=2, threshold=0.0)
  assert result["first_s"] > 0 and 0 < result["min_s"] <= result["median_s"]
  graph = result["graph"]
  clean, _ = run.target.clean_forward(run.weights, result["tokens"][None],
                                      ())
  assert graph.nodes[0].site == attribution.LOGIT
  assert graph.token == int(jnp.argmax(clean[0, -1]))
  np.testing.assert_allclose(graph.logit, clean[0, -1, graph.token],
                             rtol=1e-5)
  assert graph.edges
