"""Where one training step of each toy recipe spends its time, beside the
step's limit on this machine.

Run: `./dev bench profile` (`--recipes`, `--profiled_steps`, `--out=FILE.md`).
For each recipe the step is built and compiled as `bench/step_time.py` does
(matched work by default; `--nomatched` profiles the flagfiles as shipped),
timed untraced (median and least of `--profiled_steps` steps after
`--untimed_steps`), then `--profiled_steps` more steps run under
`jax.profiler.trace`.

The trace has one complete event per executed XLA thunk, its `args.hlo_op`
naming the HLO instruction, beside host events (dispatch, buffer waits,
Python frames) that are left out. Each instant of the traced window is
shared equally among the thunks running at it, the innermost one per thread
(a thunk nested in another takes the instant from its parent), so the
thunks' times add up to the time at least one of them ran and never
exceed the wall time; the rest is the gap (dispatch, synchronization,
threads waiting on each other). The tables take each thunk's median run,
so that a run another process preempted does not skew the shares. Each
thunk's category, FLOPs, operations and bytes come from the compiled HLO
(`hlo_work.py`); a thunk that contained other thunks is `control flow`, its
work its children's.

Limits, from rates measured in this process right after the recipe's steps
(`machine_rates.py`):
  * a matmul thunk: its FLOPs at the fp32 rate of a 1024³ matmul;
  * an elementwise or reduction thunk: the larger of its operations at the
    rate of one fusion of independent multiply-adds on an in-cache array
    (each costlier opcode, such as erf or divide, weighted by its own
    measured cost in those operations), and its operand and result bytes
    at the rate of a fused `x * b + c` on arrays of the step's typical
    thunk size (the arrays a step streams from one fusion to the next stay
    in cache);
  * a layout thunk: nothing, moving data being work a better program would
    not do.
The step's limit is the sum over its thunk runs, not the larger of the
matmul and elementwise sums: both kinds of work share the same cores, one
thunk after another along the step's dependency chain. The bytes of the
elementwise thunks at the rate far out of cache (`--dram_elements`) are
shown beside it.
"""

import collections
import datetime
import glob
import gzip
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

import jax
from absl import app, flags


from bench import hlo_work, machine_rates, step_time

FLAGS = flags.FLAGS
PROFILED_RECIPES = ["tms_5-2", "tms_40-10", "resid_mlp1"]
_STEPS = flags.DEFINE_integer("profiled_steps", 20, "Steps timed untraced, "
                              "then as many traced, per recipe.",
                              lower_bound=1)
_TOP = flags.DEFINE_integer("top_thunks", 8, "Thunks listed per recipe.",
                            lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Also write the tables to this "
                           "markdown file.")
_DRAM_ELEMENTS = flags.DEFINE_integer(
  "dram_elements", 1 << 24, "fp32 elements per array of the fused rate "
  "measured far out of cache.", lower_bound=1024)
_TRACE_DIR = flags.DEFINE_string("trace_dir", "", "Keep the traces here "
                                 "(default: a temporary folder).")

CATEGORIES = ("matmul", "elementwise", "reduction", "layout",
              "control flow", "unknown")
# Limited by operations and bytes; matmuls by FLOPs; layout by nothing.
STREAMED = ("elementwise", "reduction")
class Span(NamedTuple):
  """One executed thunk: the instruction it ran, its thread, start and end
  (µs)."""
  name: str
  thread: int
  start: float
  end: float


class Attribution(NamedTuple):
  """The traced window's time by thunk name (µs) and what it adds up to."""
  time: dict[str, float]
  runs: dict[str, list[float]]  # each run's time, in trace order
  calls: dict[str, int]
  parents: set[str]  # names of thunks that contained other thunks
  busy: float  # time at least one thunk ran
  thread_time: float  # Σ over threads of the time a thunk ran on it


def thunk_spans(trace: dict, module: str) -> list[Span]:
  """Return the complete events of `module`'s thunks in a trace."""
  spans = []
  for event in trace.get("traceEvents", []):
    args = event.get("args") or {}
    if (event.get("ph") == "X" and "hlo_op" in args
        and args.get("hlo_module", module) == module):
      start = float(event["ts"])
      spans.append(Span(args["hlo_op"], event["tid"], start,
                        start + float(event["dur"])))
  return spans


def attribute(spans: list[Span]) -> Attribution:
  """Share each instant among the innermost thunk of each thread running."""
  # Ends sort before starts at one instant; of two starts, the longer (the
  # parent) opens first.
  boundaries = sorted(
    [(s.end, 0, 0.0, i) for i, s in enumerate(spans)]
    + [(s.start, 1, s.start - s.end, i) for i, s in enumerate(spans)])
  open_by_thread = collections.defaultdict(list)
  per_span = [0.0] * len(spans)
  parents, busy, thread_time, previous = set(), 0.0, 0.0, None
  for instant, is_start, _, i in boundaries:
    running = [stack[-1] for stack in open_by_thread.values() if stack]
    if running:
      elapsed = instant - previous
      for j in running:
        per_span[j] += elapsed / len(running)
      busy += elapsed
      thread_time += elapsed * len(running)
    previous = instant
    stack = open_by_thread[spans[i].thread]
    if is_start:
      if stack:
        parents.add(spans[stack[-1]].name)
      stack.append(i)
    else:
      stack.remove(i)
  runs = collections.defaultdict(list)
  for i in sorted(range(len(spans)), key=lambda i: spans[i].start):
    runs[spans[i].name].append(per_span[i])
  return Attribution({k: sum(v) for k, v in runs.items()}, dict(runs),
                     {k: len(v) for k, v in runs.items()}, parents, busy,
                     thread_time)


def read_trace(directory: str) -> dict:
  """Return the newest `*.trace.json.gz` the profiler wrote under
  `directory`."""
  paths = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"),
                    recursive=True)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {directory}")
  with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
    return json.load(f)


class Rates(NamedTuple):
  """This machine's rates, measured beside one recipe."""
  matmul: float  # FLOP/s of a 1024³ fp32 matmul
  ops: float  # elementwise operations/s of a fusion in cache
  costs: dict[str, float]  # plain operations per element of a costly opcode
  fused: float  # bytes/s of `x * b + c` at the recipe's typical size
  fused_elements: int  # that size, per array
  dram: float  # bytes/s of `x * b + c` far larger than cache


class Thunk(NamedTuple):
  """One thunk's row: its category, time and work per run."""
  name: str
  category: str
  ms: float  # per step
  calls: float  # runs per step
  source: str
  flops: float  # matmul FLOPs
  ops: dict[str, int]  # elementwise operations by opcode
  bytes: int


def thunk_rows(hlo: hlo_work.Hlo, attribution: Attribution,
               steps: int) -> list[Thunk]:
  """Return each thunk's row, slowest first. A thunk's time per step is its
  median run's times its runs per step: on a shared machine, a run another
  process preempted would otherwise weigh on its thunk's share."""
  rows = []
  for name, runs in attribution.runs.items():
    kind = ("control flow" if name in attribution.parents
            else hlo_work.category(hlo, name))
    leaf = kind != "control flow"
    calls = len(runs) / steps
    rows.append(Thunk(
      name, kind, 1e-3 * statistics.median(runs) * calls, calls,
      hlo_work.source(hlo, name),
      hlo_work.matmul_flops(hlo, name) if leaf else 0.0,
      dict(hlo_work.elementwise_ops(hlo, name)) if leaf else {},
      hlo_work.bytes_moved(hlo, name) if leaf else 0))
  return sorted(rows, key=lambda row: -row.ms)


def weighted_ops(thunk: Thunk, rates: Rates) -> float:
  """Return a thunk run's operations, costly opcodes weighted."""
  return sum(n * rates.costs.get(op, 1.0) for op, n in thunk.ops.items())


def limit_ms(thunk: Thunk, rates: Rates) -> float:
  """Return the least time (ms per step) the thunk's runs can take."""
  if thunk.category == "matmul":
    seconds = thunk.flops / rates.matmul
  elif thunk.category in STREAMED:
    seconds = max(weighted_ops(thunk, rates) / rates.ops,
                  thunk.bytes / rates.fused)
  else:
    seconds = 0.0
  return 1e3 * seconds * thunk.calls


def typical_elements(thunks: list[Thunk]) -> int:
  """Return the fp32 elements per array of an `x * b + c` moving as many
  bytes as the step's typical streamed thunk (the byte-weighted median)."""
  sizes = sorted((t.bytes, t.calls) for t in thunks if t.category in STREAMED)
  half, seen = sum(size * calls for size, calls in sizes) / 2, 0.0
  for size, calls in sizes:
    seen += size * calls
    if seen >= half:
      return max(1024, size // 16)
  return 1024


def measure_rates(thunks: list[Thunk], dram_elements: int) -> Rates:
  """Return the machine's rates for this step's work, measured now."""
  ops_per_s = machine_rates.elementwise_ops_per_s()
  opcodes = {op for t in thunks for op in t.ops}
  costs = {op: machine_rates.opcode_cost(op, ops_per_s)
           for op in sorted(opcodes) if machine_rates.has_probe(op)}
  fused_elements = typical_elements(thunks)
  # The best single matmul, as for the other rates.
  matmul = max(step_time.matmul_flops_per_s(repeats=1) for _ in range(15))
  return Rates(matmul, ops_per_s, costs,
               machine_rates.fused_bytes_per_s(fused_elements),
               fused_elements,
               machine_rates.fused_bytes_per_s(dram_elements))


class Profile(NamedTuple):
  """One recipe's profile; times are per step."""
  recipe: str
  step_ms: float  # untraced median
  best_ms: float  # untraced least
  wall_ms: float  # traced
  busy_ms: float  # traced, at least one thunk running
  thread_ms: float  # traced, Σ over threads of a thunk running
  thunks: list[Thunk]  # slowest first
  rates: Rates
  target_ms: float | None  # 8× faster than the reference implementation

  def thunk_ms(self) -> float:
    """Return the thunks' typical time per step (their medians' sum)."""
    return sum(t.ms for t in self.thunks)

  def category_ms(self) -> dict[str, float]:
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for thunk in self.thunks:
      totals[thunk.category] += thunk.ms
    return totals

  def limits_ms(self) -> tuple[float, float]:
    """Return the matmul and elementwise limits (ms per step)."""
    matmul = sum(limit_ms(t, self.rates) for t in self.thunks
                 if t.category == "matmul")
    streamed = sum(limit_ms(t, self.rates) for t in self.thunks
                   if t.category in STREAMED)
    return matmul, streamed


def traced_steps(recipe: dict, steps: int, trace_dir: str) -> float:
  """Run `steps` steps under the profiler; return their wall time (s)."""
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    start = time.perf_counter()
    step_time.time_steps(recipe, steps, 0)
    return time.perf_counter() - start


def profile_recipe(name: str, steps: int, untimed: int, matched: bool,
                   trace_dir: str, dram_elements: int) -> Profile:
  """Compile, time, trace and attribute one recipe's step."""
  recipe = step_time.compile_recipe(name, matched)
  text = recipe["compiled"].as_text()
  os.makedirs(trace_dir, exist_ok=True)
  # Beside the trace, so a kept trace can be read against the program.
  pathlib.Path(trace_dir, "step.hlo.txt").write_text(text)
  hlo = hlo_work.parse_hlo(text)
  step_time.time_steps(recipe, 1, untimed)
  times = [1e3 * step_time.time_steps(recipe, 1, 0) for _ in range(steps)]
  wall = traced_steps(recipe, steps, trace_dir)
  attribution = attribute(thunk_spans(read_trace(trace_dir), hlo.module))
  thunks = thunk_rows(hlo, attribution, steps)
  reference = step_time.best_reference(name) if matched else None
  return Profile(
    name, statistics.median(times), min(times), 1e3 * wall / steps,
    1e-3 * attribution.busy / steps,
    1e-3 * attribution.thread_time / steps, thunks,
    measure_rates(thunks, dram_elements),
    reference[0] / 8 if reference else None)


def _achieved(thunk: Thunk, rates: Rates) -> str:
  seconds = 1e-3 * thunk.ms / thunk.calls
  if thunk.category == "matmul":
    return f"{thunk.flops / seconds / 1e9:.1f} GFLOP/s"
  if thunk.category in STREAMED:
    return (f"{weighted_ops(thunk, rates) / seconds / 1e9:.1f} Gop/s, "
            f"{thunk.bytes / seconds / 1e9:.1f} GB/s")
  return f"{thunk.bytes / seconds / 1e9:.1f} GB/s"


def opcode_line(profile: Profile, count: int = 8) -> str:
  """Return the elementwise operations' opcodes, costliest first, with
  their share of the weighted operations."""
  weighted = collections.Counter()
  for t in profile.thunks:
    if t.category in STREAMED:
      for op, n in t.ops.items():
        weighted[op] += t.calls * n * profile.rates.costs.get(op, 1.0)
  total = sum(weighted.values()) or 1.0
  shares = ", ".join(f"{op} {100 * n / total:.0f}%"
                     for op, n in weighted.most_common(count))
  return (f"Elementwise operations per step: {total / 1e9:.3f} G weighted; "
          f"by opcode: {shares}.")


def _place(source: str) -> str:
  last = source.rpartition(" ")[2]
  return last if ".py:" in last else "?"


def source_table(profile: Profile, count: int = 10) -> str:
  """Return the thunk time by source line and category, largest first (a
  fusion counts toward the line of the operation it is named after)."""
  by_line = collections.defaultdict(lambda: [0.0, 0.0, 0])
  for t in profile.thunks:
    entry = by_line[(_place(t.source), t.category)]
    entry[0] += t.ms
    entry[1] += t.calls * t.flops
    entry[2] += 1
  lines = ["| source line | category | thunks | ms/step | share | GFLOP |",
           "|---|---|---|---|---|---|"]
  ranked = sorted(by_line.items(), key=lambda item: -item[1][0])
  for (place, kind), (ms, flops, n) in ranked[:count]:
    gflop = f"{flops / 1e9:.3f}" if flops else "–"
    lines.append(f"| {place} | {kind} | {n} | {ms:.3f} | "
                 f"{100 * ms / profile.thunk_ms():.1f}% | {gflop} |")
  return "\n".join(lines)


def recipe_section(profile: Profile, top: int) -> str:
  """Return one recipe's markdown: categories, then the slowest thunks."""
  busy, typical = profile.busy_ms, profile.thunk_ms()
  runs = sum(t.calls for t in profile.thunks)
  lines = [
    f"### {profile.recipe}", "",
    f"Step {profile.step_ms:.2f} ms untraced (median; best "
    f"{profile.best_ms:.2f}). Traced, per step: wall "
    f"{profile.wall_ms:.2f} ms, thunks running {busy:.2f} ms "
    f"({100 * busy / profile.wall_ms:.0f}%; {runs:.0f} thunk runs, "
    f"{1e3 * profile.thread_ms / runs:.1f} µs each on average, "
    f"{profile.thread_ms / busy:.2f} at once), gap "
    f"{profile.wall_ms - busy:.2f} ms. Below, each thunk's median run: "
    f"{typical:.2f} ms in all; shares are of that.", "",
    "| category | ms/step | share | limit ms |", "|---|---|---|---|"]
  for name, ms in profile.category_ms().items():
    if ms:
      limit = sum(limit_ms(t, profile.rates) for t in profile.thunks
                  if t.category == name)
      lines.append(f"| {name} | {ms:.3f} | {100 * ms / typical:.1f}% | "
                   f"{limit:.3f} |")
  lines += ["", opcode_line(profile), "", source_table(profile), ""]
  lines += ["| thunk | category | ms/step | share | runs/step | "
            "limit ms | achieved | source |",
            "|---|---|---|---|---|---|---|---|"]
  for t in profile.thunks[:top]:
    lines.append(
      f"| `{t.name}` | {t.category} | {t.ms:.3f} | "
      f"{100 * t.ms / typical:.1f}% | {t.calls:g} | "
      f"{limit_ms(t, profile.rates):.3f} | {_achieved(t, profile.rates)} | "
      f"{t.source} |")
  return "\n".join(lines)


def summary_table(profiles: list[Profile]) -> str:
  """Return the recipes' step times beside their limits."""
  lines = ["| recipe | step ms (best) | traced wall ms | thunk ms | matmul "
           "limit ms | elementwise limit ms | limit ms | step/limit (best) | "
           "8× target ms |", "|---|---|---|---|---|---|---|---|---|"]
  for p in profiles:
    matmul, streamed = p.limits_ms()
    limit = matmul + streamed
    target = f"{p.target_ms:.2f}" if p.target_ms else "–"
    lines.append(
      f"| {p.recipe} | {p.step_ms:.2f} ({p.best_ms:.2f}) | {p.wall_ms:.2f} "
      f"| {p.thunk_ms():.2f} | {matmul:.2f} | {streamed:.2f} | {limit:.2f} | "
      f"{p.step_ms / limit:.1f}× ({p.best_ms / limit:.1f}×) | {target} |")
  return "\n".join(lines)


def work_table(profiles: list[Profile]) -> str:
  """Return each recipe's work per step and the rates that limit it."""
  lines = ["| recipe | matmul GFLOP | elementwise Gop | streamed MB | "
           "matmul GFLOP/s | Gop/s (opcode costs) | GB/s in cache (MiB "
           "per array) | GB/s far out of cache (streamed bytes ms) |",
           "|---|---|---|---|---|---|---|---|"]
  for p in profiles:
    r, streamed = p.rates, [t for t in p.thunks if t.category in STREAMED]
    flops = sum(t.calls * t.flops for t in p.thunks
                if t.category == "matmul")
    ops = sum(t.calls * weighted_ops(t, r) for t in streamed)
    data = sum(t.calls * t.bytes for t in streamed)
    costs = ", ".join(f"{k} {v:.1f}" for k, v in r.costs.items())
    lines.append(
      f"| {p.recipe} | {flops / 1e9:.3f} | {ops / 1e9:.3f} | "
      f"{data / 1e6:.1f} | {r.matmul / 1e9:.0f} | {r.ops / 1e9:.1f} "
      f"({costs}) | {r.fused / 1e9:.1f} ({4 * r.fused_elements / 2**20:.2f})"
      f" | {r.dram / 1e9:.1f} ({1e3 * data / r.dram:.2f}) |")
  return "\n".join(lines)


def conditions(matched: bool) -> str:
  """Return the line saying what was measured, when and on what."""
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  work = step_time.MATCHED_WORK if matched else "flagfiles as shipped"
  return (f"{datetime.date.today()}, {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} cores, load average {load} (1, 5, 15 min) at "
          f"the end; {work}.")


def report(profiles: list[Profile], matched: bool, top: int) -> str:
  """Return the whole markdown report."""
  return "\n\n".join([conditions(matched), summary_table(profiles),
                      work_table(profiles),
                      *(recipe_section(p, top) for p in profiles)])


def _check_recipes(names: list[str]) -> bool:
  for name in names:
    if "@" in name:
      # Its limits price one device's program on one process's rates;
      # sharded steps are only timed, by step_time.
      raise flags.ValidationError(
        f"{name}: the profile reads one device's step; time @N recipes "
        "with ./dev bench step_time")
    file = name.split("+")[0]
    if not (hlo_work.ROOT / "flags" / f"{file}.flags").is_file():
      raise flags.ValidationError(f"no flagfile flags/{file}.flags")
    try:
      step_time.load_recipe(name)
    except ValueError as error:
      raise flags.ValidationError(f"{name}: {error}") from None
  return True


def main(argv: list[str]) -> None:
  if argv[1:]:
    sys.exit(f"profile: unexpected arguments {argv[1:]}")
  # `--recipes`, `--untimed_steps` and `--matched` are step_time's flags.
  profiles = []
  with tempfile.TemporaryDirectory() as scratch:
    for name in FLAGS.recipes:
      profiles.append(profile_recipe(
        name, _STEPS.value, FLAGS.untimed_steps, FLAGS.matched,
        os.path.join(_TRACE_DIR.value or scratch, name),
        _DRAM_ELEMENTS.value))
      print(f"[profile] {name}: {profiles[-1].step_ms:.2f} ms/step",
            flush=True)
  text = report(profiles, FLAGS.matched, _TOP.value)
  print(text)
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(text + "\n")


if __name__ == "__main__":
  sys.argv[0] = "profile"
  flags.FLAGS.set_default("recipes", PROFILED_RECIPES)
  flags.register_validator("recipes", _check_recipes)
  app.run(main)
