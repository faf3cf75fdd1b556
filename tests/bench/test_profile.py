"""bench/profile.py attributes a traced step's time to its thunks and sets
the step against its limit; bench/hlo_work.py reads each thunk's category
and work from the compiled HLO."""

import math

import jax
import jax.numpy as jnp
import pytest
from absl import flags

TINY = "tms_5-2+--batch_size=16+--c=6"

# A compiled module's text, cut down (no layouts): a dot fusion, a
# reduction, a copy, an elementwise fusion and a loop of three trips around
# another dot. ROOT_DIR stands for the repository's path.
HLO = "\n".join([
  "HloModule jit_toy, is_scheduled=true", "",
  "FileNames", '1 "ROOT_DIR/core/toy.py"', "",
  "FunctionNames", '1 "toy"', "",
  "FileLocations", "1 {file_name_id=1 function_name_id=1 line=7}", "",
  "StackFrames", "1 {file_location_id=1 parent_frame_id=1}", "",
  "%region_add (a: f32[], b: f32[]) -> f32[] {",
  "  %a = f32[] parameter(0)",
  "  %b = f32[] parameter(1)",
  "  ROOT %add.0 = f32[] add(%a, %b)",
  "}", "",
  "%fused_dot (p0: f32[8,4], p1: f32[4,16]) -> f32[8,16] {",
  "  %p0 = f32[8,4] parameter(0)",
  "  %p1 = f32[4,16] parameter(1)",
  "  %dot.1 = f32[8,16] dot(%p0, %p1), lhs_contracting_dims={1}, "
  "rhs_contracting_dims={0}",
  "  ROOT %tanh.1 = f32[8,16] tanh(%dot.1)",
  "}", "",
  "%fused_sum (p2: f32[8,16]) -> f32[] {",
  "  %p2 = f32[8,16] parameter(0)",
  "  %zero = f32[] constant(0)",
  "  ROOT %reduce.1 = f32[] reduce(%p2, %zero), dimensions={0,1}, "
  "to_apply=%region_add",
  "}", "",
  "%fused_exp (p3: f32[8,16]) -> f32[8,16] {",
  "  %p3 = f32[8,16] parameter(0)",
  "  ROOT %exp.1 = f32[8,16] exponential(%p3)",
  "}", "",
  "%body (t: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {",
  "  %t = (s32[], f32[8,4]) parameter(0)",
  "  %i = s32[] get-tuple-element(%t), index=0",
  "  %h = f32[8,4] get-tuple-element(%t), index=1",
  "  %square = f32[4,4] dot(%h, %h), lhs_contracting_dims={0}, "
  "rhs_contracting_dims={0}",
  "  ROOT %next = (s32[], f32[8,4]) tuple(%i, %h)",
  "}", "",
  "%cond (c: (s32[], f32[8,4])) -> pred[] {",
  "  %c = (s32[], f32[8,4]) parameter(0)",
  "  ROOT %yes = pred[] constant(true)",
  "}", "",
  "ENTRY %main (x: f32[8,4], w: f32[4,16]) -> (f32[], f32[8,16]) {",
  "  %x = f32[8,4] parameter(0)",
  "  %w = f32[4,16] parameter(1)",
  "  %dot_fusion = f32[8,16] fusion(%x, %w), kind=kCustom, "
  'calls=%fused_dot, metadata={op_name="jit(toy)/dot_general" '
  "stack_frame_id=1}",
  "  %reduce_fusion = f32[] fusion(%dot_fusion), kind=kLoop, "
  "calls=%fused_sum",
  "  %copy.1 = f32[8,16] copy(%dot_fusion)",
  "  %exp_fusion = f32[8,16] fusion(%copy.1), kind=kLoop, calls=%fused_exp",
  "  %zero_i = s32[] constant(0)",
  "  %init = (s32[], f32[8,4]) tuple(%zero_i, %x)",
  "  %loop = (s32[], f32[8,4]) while(%init), condition=%cond, body=%body, "
  'backend_config={"known_trip_count":{"n":"3"}}',
  "  ROOT %out = (f32[], f32[8,16]) tuple(%reduce_fusion, %exp_fusion)",
  "}"])


@pytest.fixture(scope="module")
def bench(load_bench):
  return load_bench("profile")


@pytest.fixture(scope="module")
def work(load_bench):
  return load_bench("hlo_work")


@pytest.fixture(scope="module")
def hlo(work):
  return work.parse_hlo(HLO.replace("ROOT_DIR", str(work.ROOT)))


def _event(name, tid, ts, dur, module="jit_step"):
  return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
          "name": name, "args": {"hlo_op": name, "hlo_module": module}}


def test_each_instant_is_shared_among_the_innermost_running_thunks(bench):
  # Thread 1 runs fusion.1, then while.1 with dot.1 nested in it; thread 2
  # runs copy.1 overlapping dot.1's end and while.1's own time. Host events
  # and another module's thunk must be left out.
  trace = {"traceEvents": [
    {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name",
     "args": {"name": "worker"}},
    {"ph": "X", "pid": 1, "tid": 9, "ts": -5.0, "dur": 60.0,
     "name": "PjitFunction(jit(step))"},
    {"ph": "X", "pid": 1, "tid": 9, "ts": 0.0, "dur": 50.0,
     "name": "$step_time.py:115 time_steps"},
    {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 45.0,
     "name": "ThunkExecutor::Execute"},
    _event("fusion.1", 1, 0.0, 10.0),
    {"ph": "X", "pid": 1, "tid": 1, "ts": 9.0, "dur": 0.5,
     "name": "end: fusion.1", "args": {"_src": "thunk_executor.cc"}},
    _event("while.1", 1, 10.0, 30.0),
    _event("dot.1", 1, 15.0, 10.0),
    _event("copy.1", 2, 20.0, 10.0),
    _event("fusion.9", 3, 0.0, 100.0, module="jit_other"),
  ]}
  spans = bench.thunk_spans(trace, "jit_step")
  assert sorted(s.name for s in spans) == ["copy.1", "dot.1", "fusion.1",
                                           "while.1"]
  got = bench.attribute(spans)
  assert got.time == pytest.approx({"fusion.1": 10.0, "while.1": 17.5,
                                    "dot.1": 7.5, "copy.1": 5.0})
  assert got.busy == pytest.approx(40.0)
  assert got.thread_time == pytest.approx(50.0)
  assert got.parents == {"while.1"}
  assert got.calls == {"fusion.1": 1, "while.1": 1, "dot.1": 1, "copy.1": 1}
  assert got.runs["while.1"] == pytest.approx([17.5])


def test_instructions_are_classified_and_counted_from_the_hlo(work, hlo):
  assert hlo.module == "jit_toy"
  assert {name: work.category(hlo, name) for name in
          ("dot_fusion", "reduce_fusion", "copy.1", "exp_fusion", "loop",
           "absent")} == {
    "dot_fusion": "matmul", "reduce_fusion": "reduction", "copy.1": "layout",
    "exp_fusion": "elementwise", "loop": "matmul", "absent": "unknown"}
  assert work.matmul_flops(hlo, "dot_fusion") == 2 * 8 * 16 * 4
  assert work.matmul_flops(hlo, "loop") == 3 * (2 * 4 * 4 * 8)
  assert work.matmul_flops(hlo, "exp_fusion") == 0
  assert work.elementwise_ops(hlo, "dot_fusion") == {"tanh": 128}
  assert work.elementwise_ops(hlo, "exp_fusion") == {"exponential": 128}
  assert work.elementwise_ops(hlo, "reduce_fusion") == {"reduce": 128}
  assert not work.elementwise_ops(hlo, "loop")
  assert work.bytes_moved(hlo, "exp_fusion") == 2 * 8 * 16 * 4
  assert work.bytes_moved(hlo, "reduce_fusion") == 8 * 16 * 4 + 4
  assert work.source(hlo, "dot_fusion") == "dot_general core/toy.py:7"


def test_a_compiled_dot_counts_its_flops(work):
  a, b = jnp.ones((8, 4)), jnp.ones((4, 16))
  text = jax.jit(lambda a, b: jnp.tanh(a @ b).sum()).lower(a, b).compile(
  ).as_text()
  hlo = work.parse_hlo(text)
  dots = [n for n, i in hlo.instructions.items() if i.opcode == "dot"]
  assert sum(work.matmul_flops(hlo, n) for n in dots) == 2 * 8 * 4 * 16


def test_a_thunk_takes_its_median_run_and_a_parent_no_work(bench, hlo):
  attribution = bench.Attribution(
    time={"exp_fusion": 102.0, "loop": 6.0},
    runs={"exp_fusion": [1.0, 100.0, 1.0], "loop": [2.0, 2.0, 2.0]},
    calls={"exp_fusion": 3, "loop": 3}, parents={"loop"}, busy=108.0,
    thread_time=108.0)
  rows = {t.name: t for t in bench.thunk_rows(hlo, attribution, steps=3)}
  assert rows["exp_fusion"].ms == pytest.approx(1e-3)  # not the mean, 34 µs
  assert rows["exp_fusion"].ops == {"exponential": 128}
  assert (rows["loop"].category, rows["loop"].flops) == ("control flow", 0)
  assert rows["loop"].calls == 1


def test_a_thunk_is_limited_by_its_slower_resource(bench):
  rates = bench.Rates(matmul=1e9, ops=1e9, costs={"erf": 10.0},
                      fused=1e9, fused_elements=1024, dram=1e8)
  thunk = bench.Thunk("f", "elementwise", 1.0, 2.0, "", 0.0,
                      {"erf": 1000, "add": 1000}, 1000)
  # 11000 weighted ops (erf at 10) beat 1000 bytes: 11 µs a run, two runs.
  assert bench.limit_ms(thunk, rates) == pytest.approx(2 * 11e-3)
  assert bench.limit_ms(thunk._replace(bytes=10**6), rates) == pytest.approx(
    2.0)
  matmul = thunk._replace(category="matmul", flops=1e6)
  assert bench.limit_ms(matmul, rates) == pytest.approx(2.0)
  assert bench.limit_ms(thunk._replace(category="layout"), rates) == 0


def test_a_profiled_step_adds_up_and_has_a_limit(bench, tmp_path):
  profile = bench.profile_recipe(TINY, steps=2, untimed=1, matched=True,
                                 trace_dir=str(tmp_path),
                                 dram_elements=1 << 16)
  categories = profile.category_ms()
  assert set(categories) == set(bench.CATEGORIES)
  assert categories["unknown"] == 0  # every traced thunk is in the HLO
  assert categories["matmul"] > 0 and categories["elementwise"] > 0
  shares = [100 * ms / profile.thunk_ms() for ms in categories.values()]
  assert abs(sum(shares) - 100) <= 0.5
  assert 0 < profile.busy_ms <= profile.wall_ms
  assert 0 < profile.thunk_ms() <= profile.wall_ms
  assert 0 < profile.best_ms <= profile.step_ms
  rates = profile.rates
  assert min(rates.matmul, rates.ops, rates.fused, rates.dram) > 0
  # The CI-MLP kernel's gelu and its derivative run erf and a divide.
  assert {"erf", "divide"} <= set(rates.costs)
  assert min(rates.costs.values()) >= 1
  matmul, streamed = profile.limits_ms()
  assert matmul > 0 and streamed > 0 and math.isfinite(matmul + streamed)
  # Each thunk ran once per step: the step has no loop left in it.
  assert {t.calls for t in profile.thunks} == {1.0}
  text = bench.report([profile], matched=True, top=3)
  assert f"| {TINY} | {profile.step_ms:.2f} ({profile.best_ms:.2f}) |" in text
  assert text.count(f"| `{profile.thunks[0].name}` |") == 1
  # Thunks trace back to repository lines: the CI-MLP kernel's among them.
  assert "| core/component_mlp.py:" in text


def test_a_data_parallel_recipe_is_refused_with_where_to_time_it(bench):
  with pytest.raises(flags.ValidationError, match="bench step_time"):
    bench._check_recipes(["tms_5-2@2"])
  assert bench._check_recipes(["tms_5-2"])
