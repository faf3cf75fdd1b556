"""`bench/memory.py` builds its step for each model it names, from the
model's config alone (`bench/memory_models.py`; the compile itself is the
bench's, not a test's). Imported beside `bin/train`'s flags, which share
names with the bench's: the step's builder defines no flags."""

import jax
import pytest


# Qwen3-30B-A3B's MLP sites are its 128 experts' gate, up and down.
EXPERTS = tuple(f"experts.{e}.{r}" for e in range(128)
                for r in ("gate", "up", "down"))


@pytest.mark.parametrize("model,sites,frozen_gib", [
  ("llama-3.1-8b", ("gate", "up", "down"), 14.96),
  ("pythia-1.4b", ("up", "down"), 2.63),
  ("qwen3-30b-a3b", EXPERTS, 56.87),
])
def test_each_model_builds_its_mlp_step(load_bench, model, sites,
                                        frozen_gib):
  memory = load_bench("memory_models")
  _, layer, c = memory.MODELS[model]
  parts, weights = memory.build(memory.recipe(2, 64, c), layer, model)
  names = tuple(s.name for s in parts.target.sites)
  assert names == tuple(f"layers.{layer}.mlp.{r}_proj" for r in sites)
  assert all(s.c == c for s in parts.target.sites)
  size = sum(leaf.size * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(weights))
  assert size / memory.GIB == pytest.approx(frozen_gib, abs=0.01)
  # Pythia's frozen biases and untied head are among the weights.
  assert (weights.norm_bias is not None) == (model == "pythia-1.4b")
  assert weights.head is not None
