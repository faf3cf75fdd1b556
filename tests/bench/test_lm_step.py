"""bench/lm_step.py measures the l18 step at a reduced shape on CPU: every
field of its report, the step's matmul FLOPs counted in the compiled
program and from the recipe agreeing, prefix sharing ON and OFF taking the
same first step, and one-line refusals of bad flags."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

# Llama-3.1-8B's kind (GQA, Llama-3 RoPE scaling) at a few units per axis.
TINY_MODEL = ["hidden_size=16", "intermediate_size=32",
              "num_hidden_layers=4", "num_attention_heads=2",
              "num_key_value_heads=1", "vocab_size=64"]
# The recipe at CPU sizes.
TINY_RECIPE = ("c=8", "ci_d_model=16", "ci_n_blocks=1", "ci_n_heads=2",
               "ci_d_mlp=32")
# fp32 and einsum attention compile fastest on CPU; the slow checks keep the
# recipe's bf16 and `auto` attention.
FAST = ("compute_dtype=float32", "attention=reference",
        "ci_attention=reference")
REPORT_KEYS = {
  "device", "model", "config", "compile_s", "warm_compile_s", "step_s",
  "tokens_per_s", "flops_compiled", "uncounted", "flops_xla_cost",
  "flops_executed", "flops_model", "flops_parts", "flops_ratio",
  "flops_agree", "peak_flops", "peak_source", "mfu", "executed_rate",
  "peak_memory", "static_memory", "first_losses", "matmul_rate",
  "matmul_n", "mfu_measured", "profile", "flops_xla_remat", "prefix_loops"}


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("lm_step")


def tiny(bench, recipe=TINY_RECIPE + FAST, **changes):
  """Return the bench's settings at the tiny shape."""
  fields = dict(sequences=2, tokens=8, layer=2,
                model_config=bench.model_overrides(TINY_MODEL),
                recipe_settings=recipe, measured=2, warmup=1,
                ratio_layers=())
  return bench.Settings(**(fields | changes))


@pytest.fixture(scope="module")
def plain(bench):
  """The tiny step's report, with two traced steps."""
  return bench.measure_step(tiny(bench), profile_steps=2)


def test_the_report_has_every_field_and_its_flop_counts_agree(bench, plain):
  settings, report = tiny(bench), plain
  assert set(report) == REPORT_KEYS
  assert report["compile_s"] > 0 and report["step_s"] > 0
  assert report["warm_compile_s"] is None
  assert report["tokens_per_s"] == pytest.approx(16 / report["step_s"])
  # The recipe's count follows what XLA kept of the step, rematerialised
  # forwards included, within the bench's 10% (here it is exact).
  assert report["flops_agree"]
  assert report["flops_executed"] == pytest.approx(report["flops_compiled"],
                                                   rel=0.10)
  assert report["uncounted"] == {} and report["flops_xla_remat"] == 0
  assert 0 < report["flops_model"] < report["flops_executed"]
  # On CPU the peak is the measured matmul rate; the MFU is against it.
  assert report["peak_flops"] > 0 and 0 < report["mfu"] < 1
  assert report["static_memory"]["argument"] > 0
  assert set(report["first_losses"]) == set(bench.prefix.RECON_TERMS)
  rows = bench.report_rows(report, settings)
  assert len(rows) == 16 and all(value for _, value, _ in rows)
  parts = dict(bench.flop_parts_rows(report))
  assert "masked forwards (remat)" in parts
  # The traced steps' time by op category, matmuls at a positive rate.
  categories = {row[0]: row for row in bench.profile_rows(report)}
  assert "matmul" in categories and categories["matmul"][3].endswith("FLOP/s")
  assert list(categories)[-1] == "no op running (gaps)"
  assert sum(t.calls * t.flops for t in report["profile"]["thunks"]
             if t.category == "matmul") == pytest.approx(
               report["flops_compiled"])
  assert bench.slowest_rows(report)


def test_a_chunked_head_takes_the_same_first_step_and_is_counted(
    bench, plain):
  # 16 positions in chunks of 4: the recipe setting the chip run compares.
  chunked = bench.measure_step(
    tiny(bench, recipe=TINY_RECIPE + FAST + ("output_chunk=4",)))
  assert chunked["flops_agree"]
  assert chunked["flops_executed"] == pytest.approx(
    chunked["flops_compiled"], rel=1e-9)
  assert chunked["flops_model"] == plain["flops_model"]
  assert chunked["flops_executed"] > plain["flops_executed"]
  for name, loss in plain["first_losses"].items():
    assert chunked["first_losses"][name] == pytest.approx(loss, rel=1e-5)


def test_bad_flags_are_refused_in_one_line(bench):
  with pytest.raises(ValueError, match="--model_config key 'width'"):
    bench.model_overrides(["width=3"])
  with pytest.raises(ValueError, match="want a positive integer"):
    bench.model_overrides(["hidden_size=0"])
  with pytest.raises(ValueError, match="is not name=value"):
    bench.key_values(["c"], "recipe_settings")
  with pytest.raises(ValueError, match="block 4 is not a block"):
    bench.check_settings(tiny(bench, ratio_layers=(4,)))
  with pytest.raises(ValueError, match="--use_delta_component"):
    bench.check_settings(tiny(bench, recipe=TINY_RECIPE + (
      "use_delta_component=true",)))
  with pytest.raises(ValueError, match="keep --stochastic_coeff"):
    bench.check_settings(tiny(bench, recipe=("pgd_coeff=0",)))
  with pytest.raises(ValueError, match="sets no setting"):
    bench.check_settings(tiny(bench, recipe=("no_such_setting=1",)))
  with pytest.raises(ValueError, match="are not a block's"):
    bench.check_settings(tiny(bench, recipe=TINY_RECIPE + (
      "sites=lm_head",)))


@pytest.fixture
def compile_cache(tmp_path):
  """JAX's persistent cache in `tmp_path`, for this test only."""
  names = ("jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs")
  before = {name: getattr(jax.config, name) for name in names}
  jax.config.update(names[0], str(tmp_path))
  jax.config.update(names[1], 0.0)
  compilation_cache.reset_cache()
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.mark.slow
def test_the_recipe_as_shipped_compiles_again_from_a_warm_cache(
    bench, compile_cache):
  settings = tiny(bench, recipe=TINY_RECIPE)  # bf16, `auto` attention
  report = bench.measure_step(settings, recompile=True)
  assert report["config"].compute_dtype == "bfloat16"
  assert report["flops_agree"]
  assert 0 < report["warm_compile_s"] < report["compile_s"]


@pytest.mark.slow
def test_sharing_on_and_off_take_the_same_first_step(bench):  # SPEC D5
  settings = tiny(bench, recipe=TINY_RECIPE)
  ratio = bench.measure_ratio(settings, 3)
  on, off = ratio["on"], ratio["off"]
  assert set(on["first"]) == set(bench.prefix.RECON_TERMS)
  assert all(on["first"][k] > 0 for k in bench.prefix.RECON_TERMS)
  assert ratio["losses_agree"]
  # ON scans its three frozen layers once, in the clean pass; OFF again in
  # every masked forward (bench/prefix.py).
  assert on["prefix_loops"] == 1 < off["prefix_loops"]
  assert ratio["off_reran"]
  assert ratio["ratio"] > 0
  lines = bench.ratio_rows([ratio])
  assert lines[-1].startswith("| 3 | ") and "FAILED" not in lines[-1]


def test_a_ratio_that_did_not_fit_or_shared_the_prefix_fails(bench):
  """The ratio table's checks, on made-up measurements: a block whose
  variant ran out of device memory is a row of its own, and an OFF variant
  that kept no more prefix scans than ON (a compiler merged its reruns)
  measured nothing; both fail the exit status, as does a first step that
  drifted past D5's bound, which the row prints beside the difference."""
  on = {"step_s": 0.5, "compile_s": 30.0, "prefix_loops": 1,
        "first": {"loss": 1.0}}
  fair = {"layer": 7, "on": on, "off": {**on, "prefix_loops": 5},
          "ratio": 1.4, "loss_diff": 0.0, "loss_bound": 2e-5,
          "losses_agree": True,
          "off_reran": True}
  merged = {**fair, "off": on, "off_reran": False}
  drifted = {**fair, "loss_diff": 3e-2, "loss_bound": 1e-2,
             "losses_agree": False}
  unfit = {"layer": 1, "unfit": "block 1, prefix sharing off: "
           "RESOURCE_EXHAUSTED: out of memory"}
  lines = bench.ratio_rows([fair, merged, unfit, drifted])
  assert all(line.count("|") == lines[0].count("|") for line in lines)
  assert "FAILED" not in lines[2] and "0.00e+00 (2.00e-05)" in lines[2]
  assert "FAILED (OFF reran no prefix)" in lines[3]
  assert "did not fit the device: block 1, prefix sharing off" in lines[4]
  assert "3.00e-02 (1.00e-02) FAILED (D5)" in lines[5]
  assert bench.ratios_hold([fair])
  assert not bench.ratios_hold([fair, merged])
  assert not bench.ratios_hold([fair, unfit])
  assert not bench.ratios_hold([fair, drifted])
