"""bench/step_time.py times the reference's work under --matched and takes
the speed-up against the reference's faster dtype."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import component_mlp_pallas

TINY = "tms_5-2+--batch_size=16+--c=6"


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("step_time")


@pytest.fixture(scope="module")
def one_device(bench):
  return bench.compile_recipe(TINY, matched=True)


def _two_steps(recipe: dict) -> list[np.ndarray]:
  """Return the float32 leaves of the state two steps from the recipe's
  (which the step donates)."""
  state = recipe["state"]
  for _ in range(2):
    state, _ = recipe["compiled"](state, recipe["weights"], recipe["key"])
  return [np.asarray(leaf) for leaf in jax.tree.leaves(state)
          if leaf.dtype == jnp.float32]


@pytest.fixture(scope="module")
def accelerator(bench):
  """The accelerator layout's program text and its state after two steps,
  which both kernel tests compare against (compiled once for both)."""
  recipe = bench.compile_recipe(TINY, matched=True, layout="accelerator")
  return recipe["compiled"].as_text(), _two_steps(recipe)


def test_the_speed_up_is_against_the_faster_reference_dtype(bench, monkeypatch):
  monkeypatch.setitem(bench.REFERENCE_MS, "toy", {"fp32": 30.0, "bf16": 20.0})
  assert bench.best_reference("toy") == (20.0, "bf16")
  assert bench.best_reference("unknown") is None


def test_matched_rows_add_the_reference_settings(bench):
  matched = bench.load_recipe(TINY + "+" + "+".join(bench.MATCHED_FLAGS))
  shipped = bench.load_recipe(TINY)
  assert (matched.use_delta_component, matched.faithfulness_coeff) == (True, 0)
  assert (shipped.use_delta_component, shipped.faithfulness_coeff) == (False,
                                                                       1)


def test_matched_rows_drop_the_locality_the_reference_lacks(bench):
  # tms_40-10 ships nonlinearity locality; the reference has no such term.
  assert bench.load_recipe("tms_40-10").nonlinearity_coeff > 0
  matched = bench.load_recipe("tms_40-10+" + "+".join(bench.MATCHED_FLAGS))
  assert matched.nonlinearity_coeff == 0


def test_a_recipe_compiles_times_and_formats(bench, one_device):
  recipe = one_device
  assert recipe["flops"] > 0
  medians = [bench.time_steps(recipe, steps=2, warmup=1) for _ in range(2)]
  assert all(m > 0 for m in medians)
  line = bench.row("tms_5-2", recipe, medians, [1e11, 1e11], matched=True)
  assert line.startswith("| tms_5-2 | ") and "26.3 (fp32) | " in line
  assert line.count("|") == 7


def test_a_recipe_runs_data_parallel_over_the_devices_after_its_at(
    bench, one_device):
  assert bench.split_devices("tms_5-2+--c=6@2") == ("tms_5-2+--c=6", 2)
  assert bench.split_devices("tms_5-2") == ("tms_5-2", 1)
  with pytest.raises(ValueError, match="positive integer"):
    bench.split_devices("tms_5-2@two")
  two = bench.compile_recipe(TINY + "@2", matched=True)
  assert {len(leaf.sharding.device_set)
          for leaf in jax.tree.leaves(two["state"])} == {2}
  # Both count the whole step's FLOPs, not one device's share.
  assert two["flops"] == pytest.approx(one_device["flops"], rel=0.05)
  assert bench.time_steps(two, steps=2, warmup=1) > 0
  line = bench.row(TINY + "@2", two, [1e-3], [1e11], matched=True)
  assert "26.3 (fp32)" not in line  # the tiny recipe has no reference
  assert bench.row("tms_5-2@2", two, [1e-3], [1e11],
                   matched=True).count("26.3 (fp32) | ") == 1


def test_each_compile_setting_gets_its_own_row(bench):
  """`--compilers` compiles a recipe once per setting, bin/train's default
  preset when given none; the labelled row keeps its reference."""
  from decompax.placement import compiler  # noqa: PLC0415
  assert bench._COMPILERS.default == compiler.DEFAULT
  bare = bench.compile_recipe(TINY, matched=True, options="bare")
  assert bench.time_steps(bare, steps=2, warmup=1) > 0
  line = bench.row("tms_5-2 [bare]", bare, [1e-3], [1e11], matched=True)
  assert line.startswith("| tms_5-2 [bare] | ")
  assert "26.3 (fp32) | 26.30×" in line
  with pytest.raises(ValueError, match="use bare, cpu512"):
    bench.compile_recipe(TINY, matched=True, options="fast")


def test_each_ci_layout_traces_its_own_kernel_and_trains_alike(
    bench, accelerator):
  """`--ci_layouts` forces the component-MLP kernel on any backend: the CPU
  layout packs its two batch sums into one complex64 array, the
  accelerator layout has no complex values at all. Two training steps
  under each end in the same state, to float32 rounding."""
  cpu = bench.compile_recipe(TINY, matched=True, layout="cpu")
  texts = {"cpu": cpu["compiled"].as_text(), "accelerator": accelerator[0]}
  assert "c64[" in texts["cpu"]
  assert "c64[" not in texts["accelerator"]
  finals = {"cpu": _two_steps(cpu), "accelerator": accelerator[1]}
  assert len(finals["cpu"]) > 10
  for a, b in zip(finals["cpu"], finals["accelerator"], strict=True):
    np.testing.assert_allclose(a, b, rtol=0,
                               atol=2e-6 * max(float(np.max(np.abs(b))), 1e-30))
  with pytest.raises(ValueError, match="use platform, cpu, accelerator"):
    bench.ci_layout("gpu")


def test_the_pallas_kernel_trains_like_the_accelerator_layout(
    bench, accelerator, monkeypatch):
  """The Pallas kernel inside a real training step (through Pallas'
  interpreter, since this is a CPU): two steps end in the accelerator
  layout's state, to float32 rounding."""
  monkeypatch.setitem(bench.CI_LAYOUTS, "pallas", functools.partial(
    component_mlp_pallas.pallas_pre, interpret=True))
  pallas = bench.compile_recipe(TINY, matched=True, layout="pallas")
  # The interpreter runs the kernel's grid and row loops as HLO loops.
  loops = {"pallas": pallas["compiled"].as_text().count(" while("),
           "accelerator": accelerator[0].count(" while(")}
  finals = {"pallas": _two_steps(pallas), "accelerator": accelerator[1]}
  assert loops["pallas"] > loops["accelerator"]
  assert len(finals["pallas"]) > 10
  for a, b in zip(finals["pallas"], finals["accelerator"], strict=True):
    np.testing.assert_allclose(a, b, rtol=0,
                               atol=2e-6 * max(float(np.max(np.abs(b))), 1e-30))
