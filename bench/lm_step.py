"""The Llama-3.1-8B layer-18 step on one device of any platform (CPU, GPU,
TPU): compile time, step time, FLOPs, MFU, memory, where the step's time
goes, and what prefix sharing saves (SPEC §3.5).

Run: `./dev bench lm_step` on a machine with an accelerator. The step is
`flags/l18.flags` (Llama-3.1-8B's layer-18 MLP gate/up/down, C = 24576, the
transformer CI, the full VPD recipe) at `--sequences_per_step` ×
`--tokens_per_sequence` tokens, built exactly as `bin/train` builds it
(`recipe.assembly`) around random weights of Llama-3.1-8B's shapes
(`bench.random_lm`; the config is the committed
`tests/fixtures/hf_configs/llama-3.1-8b/config.json`), so no checkpoint is
needed. `--model_config` and `--recipe_settings` shrink it to CPU sizes,
which is how `tests/bench/test_lm_step.py` keeps it running. It
reports:
  * compile time, lower + compile wall; with `--compile_cache_dir` (as
    bin/train's `--compilation_cache_dir`) the step is lowered and compiled
    again after JAX's in-memory caches are cleared, from the persistent
    cache, as a new process would;
  * step time (median of `--measured_steps` after `--warmup_steps`) and
    tokens/s;
  * matmul FLOPs per step counted in the compiled program (every loop body
    times its trip count, `bench.hlo_flops`) and from the recipe
    (`bench.lm_flops`), and their ratio, which must lie within 10%
    (the exit status says); XLA's `cost_analysis()` figure is printed
    beside: it counts each loop body once;
  * MFU: the recipe's model FLOPs (rematerialisation left out) per second
    over the device's dense bf16 peak (`PEAK_BF16` by device kind; on CPU
    the measured rate of a matmul in the compute dtype stands in; an
    accelerator not in the table has none), and over the rate this device
    measures for one large matmul in the compute dtype (`MATMUL_N`³), the
    most a step of matmuls could reach here;
  * with `--traced_steps`, where the step's time goes: that many steps
    run under `jax.profiler.trace`, and each executed HLO instruction's
    time (a CPU or GPU thunk names it in `args.hlo_op`, a TPU op event by
    its own name) is summed by category as `bench/profile.py` does (matmul,
    elementwise, reduction, layout, control flow), beside the matmuls'
    achieved FLOP rate and the slowest instructions;
  * peak device memory (`memory_stats()`, where the backend keeps it) and
    XLA's static memory analysis of the step;
  * prefix sharing's OFF/ON step-time ratio with the l18 sites moved to each
    `--ratio_layers` block, beside the reference's (`prefix.REFERENCE_RATIO`), and
    both variants' first-step recon losses, which must agree (D5), and
    the prefix scans each compiled step keeps: OFF reruns the frozen prefix
    in every masked forward, tied to its masks so that no compiler merges
    the reruns (bench/prefix.py), and the exit status fails where it holds
    no more scans than ON. The variants run after the main step, one at a
    time, so only one state is ever on the device.

The default batch, 4 × 2048 tokens, is what XLA's memory analysis of this
step compiled for CPU from its shapes (`./dev bench memory --mesh=1,1,1
--presets=ddp --global_batch=B`) fits in one H200's 141 GB with room to
spare: 44.4 GiB of arguments (state and frozen weights) plus 27.9 GiB of
temporaries at B = 1 and 53.2 GiB at B = 4 (8.4 GiB per sequence), 97.6
GiB in all; B = 6 would come to about 115 GiB. The CPU analysis overstates
attention's temporaries (XLA on CPU materialises fp32 probabilities a
fused GPU kernel does not). The device's own figures are still to be
measured. JAX's memory pool is raised from its default 75% of the device
to 95% (`XLA_PYTHON_CLIENT_MEM_FRACTION`, unless set).
"""

import collections
import dataclasses
import gc
import glob
import gzip
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.core.sites import SiteSpec
from decompax.recipe import assembly
from decompax.recipe.config import TrainConfig
from decompax.recipe.flagfiles import read_args
from decompax.targets import glu_config, glu_sites, glu_weights

from bench import hlo_flops, hlo_work, lm_flops, random_lm
# Its variants are compiled, stepped and timed as bench/prefix.py does; the
# trace is reduced as bench/profile.py reduces a toy step's.
from bench import prefix, profile

_SEQUENCES = flags.DEFINE_integer(
  "sequences_per_step", 4, "Sequences per step (the per-device batch).")
_TOKENS = flags.DEFINE_integer(
  "tokens_per_sequence", 2048, "Tokens per sequence.")
_LAYER = flags.DEFINE_integer(
  "decomposed_layer", 18, "Block whose l18 sites (MLP gate, up, down) are "
  "decomposed.")
_MODEL_CONFIG = flags.DEFINE_list(
  "model_config", [], "key=value entries over Llama-3.1-8B's Hugging Face "
  "config (hidden_size, intermediate_size, num_hidden_layers, "
  "num_attention_heads, num_key_value_heads, head_dim, vocab_size): a "
  "smaller model of the same kind.")
_RECIPE = flags.DEFINE_list(
  "recipe_settings", [], "name=value settings over flags/l18.flags (c, "
  "ci_d_model, ci_n_blocks, compute_dtype, output_chunk, ...).")
_MEASURED = flags.DEFINE_integer("measured_steps", 5, "Timed steps.")
_WARMUP = flags.DEFINE_integer(
  "warmup_steps", 2, "Untimed steps first (at least 1: the first step's "
  "losses are compared).")
_RATIO_LAYERS = flags.DEFINE_list(
  "ratio_layers", ["18", "31"], "Blocks where prefix sharing's OFF/ON "
  "ratio is measured (empty: none).")
_RATIOS_ONLY = flags.DEFINE_bool(
  "ratios_only", False, "Measure only the ratios.")
# `--trace_dir` (keep the trace and the step's HLO text there) is
# bench/profile.py's flag.
_TRACED_STEPS = flags.DEFINE_integer(
  "traced_steps", 0, "Steps traced with jax.profiler after the timed ones "
  "and reduced to a table of op categories (0: no trace).")
_CACHE_DIR = flags.DEFINE_string(
  "compile_cache_dir", None, "JAX's persistent compilation cache; the step "
  "then compiles a second time from it.")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_JSON = (ROOT / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b"
               / "config.json")
MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size")
# Dense bf16 peak (FLOP/s, no sparsity) by device kind, vendor figures:
# "Peak compute per chip (bf16)" on Google Cloud's TPU pages
# (cloud.google.com/tpu/docs/v5e: 197 TFLOP/s, /v5p: 459, /v6e: 918) and
# NVIDIA's datasheets' dense BF16 Tensor Core figures (H100 SXM 989
# TFLOP/s, H100 PCIe 756, H100 NVL 835, H200 989, B200 (HGX, 1000 W) 2250,
# A100 312; the datasheets print twice these, with sparsity). The first
# name the device kind contains wins; JAX calls a v5e "TPU v5 lite" and a
# v6e "TPU v6 lite".
PEAK_BF16 = (("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
             ("TPU v5p", 459e12), ("TPU v5", 459e12),
             ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
             ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
             ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12))
# Sides of the square matmul whose measured rate MFU is also held against:
# large enough to keep an accelerator's matrix units busy.
MATMUL_N = {"cpu": 1024}
ACCELERATOR_MATMUL_N = 8192
GOALS = {"mfu": {"H200": 0.40, "TPU v5e": 0.60}, "compile_s": 120.0,
         "warm_compile_s": 10.0,
         "ratio": {18: 1.25, 31: 1.8}}
FLOP_TOLERANCE = 0.10
GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one invocation measures, checked."""

  sequences: int
  tokens: int
  layer: int
  model_config: tuple[tuple[str, int], ...]
  recipe_settings: tuple[str, ...]
  measured: int
  warmup: int
  ratio_layers: tuple[int, ...]


def key_values(entries: list[str], flag: str) -> list[tuple[str, str]]:
  """Return `name=value` entries split; ValueError naming a bad one."""
  out = []
  for entry in entries:
    name, sep, value = entry.partition("=")
    if not sep or not name or not value:
      raise ValueError(f"--{flag} entry {entry!r} is not name=value")
    out.append((name.strip(), value.strip()))
  return out


def model_overrides(entries: list[str]) -> tuple[tuple[str, int], ...]:
  """Return `--model_config` entries as (key, int) pairs; ValueError on an
  unknown key or a value that is not a positive integer."""
  out = []
  for name, value in key_values(entries, "model_config"):
    if name not in MODEL_KEYS:
      raise ValueError(f"--model_config key {name!r} is not one of "
                       f"{', '.join(MODEL_KEYS)}")
    if not value.isdigit() or int(value) <= 0:
      raise ValueError(f"--model_config {name}={value}: want a positive "
                       "integer")
    out.append((name, int(value)))
  return tuple(out)


def settings_from_flags() -> Settings:
  """Return the checked flags; ValueError with a one-line reason."""
  for name, holder in (("sequences_per_step", _SEQUENCES),
                       ("tokens_per_sequence", _TOKENS),
                       ("measured_steps", _MEASURED),
                       ("warmup_steps", _WARMUP)):
    if holder.value < 1:
      raise ValueError(f"--{name} must be at least 1, got {holder.value}")
  try:
    ratio_layers = tuple(int(n) for n in _RATIO_LAYERS.value)
  except ValueError:
    raise ValueError(f"--ratio_layers must be block numbers, got "
                     f"{','.join(_RATIO_LAYERS.value)}") from None
  key_values(_RECIPE.value, "recipe_settings")
  return Settings(_SEQUENCES.value, _TOKENS.value, _LAYER.value,
                  model_overrides(_MODEL_CONFIG.value),
                  tuple(_RECIPE.value), _MEASURED.value, _WARMUP.value,
                  ratio_layers)


def llama_config(overrides: tuple[tuple[str, int], ...] = ()
                 ) -> glu_config.GluConfig:
  """Return Llama-3.1-8B's `GluConfig`, with `overrides` of its HF keys."""
  hf = json.loads(CONFIG_JSON.read_text())
  hf.update(overrides)
  return glu_config.config_from_hf(hf)


def l18_recipe(settings: Settings) -> TrainConfig:
  """Return `flags/l18.flags` at the bench's batch and settings."""
  return read_args([f"--flagfile={ROOT / 'flags' / 'l18.flags'}",
                    *(f"--{s}" for s in settings.recipe_settings),
                    f"--batch_size={settings.sequences}",
                    f"--seq_len={settings.tokens}"])


def l18_sites(config: TrainConfig, model: glu_config.GluConfig,
              layer: int) -> tuple[SiteSpec, ...]:
  """Return the recipe's sites (one block's matrices) moved to `layer`."""
  if not 0 < layer < model.n_layers:
    raise ValueError(f"block {layer} is not a block with a prefix of the "
                     f"{model.n_layers}-layer model (1..{model.n_layers - 1})")
  parsed = [glu_weights.parse_site(name) for name in config.sites]
  if None in parsed:
    raise ValueError(f"the bench moves one block's projections to --layer; "
                     f"sites {list(config.sites)} name others (embed_tokens "
                     "or lm_head are not a block's)")
  roles = [p[1] for p in parsed]
  names = tuple(glu_weights.site_name(layer, role) for role in roles)
  return glu_sites.site_specs(model, names, config.c)


def check_settings(settings: Settings) -> None:
  """Raise ValueError, in one line, for settings the bench cannot run."""
  config, model = l18_recipe(settings), llama_config(settings.model_config)
  lm_flops.check_covered(config)
  if not (config.stochastic_coeff > 0 and config.pgd_coeff > 0):
    raise ValueError("the bench compares both recon terms' first-step "
                     "losses; keep --stochastic_coeff and --pgd_coeff above 0")
  for layer in (settings.layer, *settings.ratio_layers):
    l18_sites(config, model, layer)


def matmul_rate(device: Any, dtype: Any) -> tuple[float, int]:
  """Return the FLOP/s this device measures for one `n×n @ n×n` matmul in
  `dtype`, and `n`."""
  n = MATMUL_N.get(device.platform, ACCELERATOR_MATMUL_N)
  return hlo_flops.measured_matmul_rate(dtype, n), n


def peak_flops(device: Any, measured: float, dtype: Any
               ) -> tuple[float | None, str]:
  """Return the device's dense bf16 peak FLOP/s and where it comes from
  (None: not known); on a CPU, the `measured` matmul rate."""
  if device.platform == "cpu":
    return measured, f"this CPU's measured {jnp.dtype(dtype).name} matmul rate"
  for kind, peak in PEAK_BF16:
    if kind in device.device_kind:
      return peak, f"{kind}, vendor figure, dense bf16"
  return None, f"no peak known for {device.device_kind}"


def peak_memory(device: Any) -> float | None:
  """Return the device's peak bytes in use so far (None: not kept)."""
  return (device.memory_stats() or {}).get("peak_bytes_in_use")


def run_steps(variant: dict, measured: int, warmup: int) -> float:
  """Step a compiled variant (`prefix.compile_variant`'s) `warmup` and then
  `measured` times; return the median time of the measured steps."""
  for _ in range(warmup + measured):
    prefix.advance(variant)
  return statistics.median(variant["times"][warmup:])


def read_trace(directory: str) -> dict:
  """Return the newest Chrome-format trace (`*trace.json.gz`) the profiler
  wrote under `directory`."""
  paths = glob.glob(os.path.join(directory, "**", "*trace.json.gz"),
                    recursive=True)
  if not paths:
    raise FileNotFoundError(f"no *trace.json.gz under {directory}")
  with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
    return json.load(f)


def op_spans(trace: dict, hlo: hlo_work.Hlo) -> list[profile.Span]:
  """Return the executed instructions of the step in a trace: an event
  naming one of its instructions, in `args.hlo_op` (a CPU or GPU thunk) or
  as its own name (a TPU op), from the one process that ran most of them
  (a TPU's ops show on the device's process, not the host's)."""
  by_process = collections.defaultdict(list)
  for event in trace.get("traceEvents", []):
    args = event.get("args") or {}
    name = args.get("hlo_op") or event.get("name")
    if (event.get("ph") == "X" and name in hlo.instructions
        and args.get("hlo_module", hlo.module) == hlo.module):
      start = float(event["ts"])
      by_process[event.get("pid")].append(profile.Span(
        name, event.get("tid"), start, start + float(event["dur"])))
  return max(by_process.values(), key=len, default=[])


def trace_steps(variant: dict, steps: int, trace_dir: str) -> float:
  """Run `steps` steps of a compiled variant under the profiler; return
  their wall time (s)."""
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    start = time.perf_counter()
    for _ in range(steps):
      prefix.advance(variant)
    return time.perf_counter() - start


def profile_step(variant: dict, steps: int, trace_dir: str) -> dict:
  """Return where `steps` traced steps of a compiled variant spend their
  time: each instruction's row (`profile.thunk_rows`: category, ms per
  step, FLOPs) and the traced wall and busy time per step (s)."""
  os.makedirs(trace_dir, exist_ok=True)
  text = variant["step"].as_text()
  # Beside the trace, so a kept trace can be read against the program.
  pathlib.Path(trace_dir, "step.hlo.txt").write_text(text)
  hlo = hlo_work.parse_hlo(text)
  wall = trace_steps(variant, steps, trace_dir)
  attribution = profile.attribute(op_spans(read_trace(trace_dir), hlo))
  return {"steps": steps, "wall_s": wall / steps,
          "busy_s": 1e-6 * attribution.busy / steps,
          "thunks": profile.thunk_rows(hlo, attribution, steps)}


def static_memory(compiled: Any) -> dict[str, float]:
  """Return XLA's memory analysis of the compiled step, in bytes."""
  stats = compiled.memory_analysis()
  return {name: float(getattr(stats, f"{name}_size_in_bytes"))
          for name in ("argument", "output", "alias", "temp")}


def measure_step(settings: Settings, recompile: bool = False,
                 profile_steps: int = 0, trace_dir: str = "") -> dict:
  """Return the report of the l18 step: compile time (and with `recompile`
  the time to compile it again from JAX's persistent cache, which the
  caller has configured), step time, FLOPs counted both ways, MFU,
  memory, and with `profile_steps` the profile of that many traced steps
  (`profile_step`; the trace under `trace_dir`, else a temporary
  folder)."""
  config, model = l18_recipe(settings), llama_config(settings.model_config)
  lm_flops.check_covered(config)
  sites = l18_sites(config, model, settings.layer)
  dtype = jnp.dtype(config.compute_dtype)
  weights = random_lm.random_weights(jax.random.key(0), model, sites, dtype)
  run = random_lm.build_run(config, model, sites, weights)
  variant = prefix.compile_variant(run, settings.layer)
  warm_s = None
  if recompile:
    # Cleared in-memory caches leave the persistent one: a new process's
    # trace, lowering and compile from the cache.
    jax.clear_caches()
    warm_s = prefix.compile_variant(run, settings.layer)["compile_s"]
  compiled = variant["step"]
  counted = hlo_flops.compiled_matmul_flops(compiled.as_text())
  predicted = lm_flops.lm_step_flops(config, model, sites)
  step_s = run_steps(variant, settings.measured, settings.warmup)
  traced = None
  if profile_steps:
    with tempfile.TemporaryDirectory() as scratch:
      traced = profile_step(variant, profile_steps, trace_dir or scratch)
  device = jax.devices()[0]
  measured, side = matmul_rate(device, dtype)
  peak, source = peak_flops(device, measured, dtype)
  # The recipe counts the program as written; a TPU's compiler may add
  # rematerialised copies of its own to fit the device's memory.
  written = counted.flops - counted.rematerialized
  ratio = predicted.executed / written if written else float("nan")
  return {
    "device": device.device_kind, "model": model, "config": config,
    "compile_s": variant["compile_s"], "warm_compile_s": warm_s,
    "step_s": step_s,
    "tokens_per_s": config.batch_size * config.seq_len / step_s,
    "flops_compiled": counted.flops, "uncounted": counted.uncounted,
    "flops_xla_remat": counted.rematerialized,
    "flops_xla_cost": hlo_flops.xla_cost_flops(compiled),
    "flops_executed": predicted.executed, "flops_model": predicted.model,
    "flops_parts": predicted, "flops_ratio": ratio,
    "flops_agree": abs(ratio - 1) <= FLOP_TOLERANCE,
    "peak_flops": peak, "peak_source": source,
    "mfu": None if peak is None else predicted.model / step_s / peak,
    "matmul_rate": measured, "matmul_n": side,
    "mfu_measured": predicted.model / step_s / measured,
    "executed_rate": predicted.executed / step_s,
    "peak_memory": peak_memory(device), "static_memory":
    static_memory(compiled), "first_losses": variant["first"],
    "prefix_loops": variant["prefix_loops"], "profile": traced,
  }


def loss_tolerance(compute_dtype: str, loss: float) -> float:
  """Return how far ON's and OFF's first-step losses may lie apart: D5's
  2e-5 in fp32, plus a bf16 rounding (2⁻⁷ relative) in a bf16 step."""
  return 2e-5 + (0.0 if compute_dtype == "float32" else 2**-7 * abs(loss))


def measure_ratio(settings: Settings, layer: int,
                  shared: dict | None = None) -> dict:
  """Return prefix sharing's OFF/ON step-time ratio with the l18 sites at
  block `layer`, each variant's compile time, prefix loops and first-step
  recon losses, or with `unfit` which variant did not fit the device's
  memory. The variants run one after the other, so only one state is ever
  on the device; `shared` is a report of the ON variant measured already
  (`measure_step`'s at the same block), reused."""
  config, model = l18_recipe(settings), llama_config(settings.model_config)
  sites = l18_sites(config, model, layer)
  weights = random_lm.random_weights(
    jax.random.key(0), model, sites, jnp.dtype(config.compute_dtype))
  variants = {}
  for sharing in (True, False):
    if sharing and shared is not None:
      variants[sharing] = {"compile_s": shared["compile_s"],
                           "step_s": shared["step_s"],
                           "prefix_loops": shared["prefix_loops"],
                           "first": shared["first_losses"]}
      continue
    name = f"block {layer}, prefix sharing {'on' if sharing else 'off'}"
    print(f"[lm_step] {name}: compile and step ...", flush=True)
    try:
      variant = prefix.compile_variant(
        random_lm.build_run(config, model, sites, weights, sharing), layer)
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      # The other blocks' ratios are still worth having.
      return {"layer": layer, "unfit": f"{name}: {str(e).splitlines()[0]}"}
    step_s = run_steps(variant, settings.measured, settings.warmup)
    variants[sharing] = {"step_s": step_s, **{
      k: variant[k] for k in ("compile_s", "prefix_loops", "first")}}
    # One state on the device at a time.
    del variant
    gc.collect()
  on, off = variants[True], variants[False]
  diff = max((abs(on["first"][k] - off["first"][k]) for k in on["first"]),
             default=0.0)
  bound = loss_tolerance(config.compute_dtype,
                         max(on["first"].values(), default=0.0))
  return {"layer": layer, "on": on, "off": off,
          "ratio": off["step_s"] / on["step_s"], "loss_diff": diff,
          "loss_bound": bound, "losses_agree": diff <= bound,
          "off_reran": off["prefix_loops"] > on["prefix_loops"]}


def _bytes(value: float | None) -> str:
  """Return a byte count in GiB, or MiB below one GiB, or n/a."""
  if value is None:
    return "n/a"
  return (f"{value / GIB:.2f} GiB" if value >= GIB
          else f"{value / 2**20:.2f} MiB")


def _si(value: float | None, unit: str) -> str:
  """Return `value` with an SI prefix (`1.23 T` + unit), or n/a."""
  if value is None:
    return "n/a"
  for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6),
                        ("k", 1e3)):
    if abs(value) >= scale:
      return f"{value / scale:.3g} {prefix}{unit}"
  return f"{value:.3g} {unit}"


def describe(report: dict, settings: Settings) -> str:
  """Return the one-line description of what was measured."""
  m, c = report["model"], report["config"]
  return (f"machine: {report['device']}; a Llama-3.1-8B-like model "
          f"({m.n_layers} layers, d {m.d_model}, d_ff {m.d_ff}, heads "
          f"{m.n_heads}/{m.n_kv_heads}, vocab {m.vocab_size}), random "
          f"weights; flags/l18.flags sites at block {settings.layer}, "
          f"C={c.c}, CI {c.ci_n_blocks}x{c.ci_d_model} ({c.ci_n_heads} "
          f"heads, d_mlp {c.ci_d_mlp}), {c.compute_dtype}, batch "
          f"{c.batch_size}x{c.seq_len}; median of {settings.measured} steps "
          f"after {settings.warmup}")


def report_rows(report: dict, settings: Settings) -> list[tuple[str, str,
                                                                str]]:
  """Return the report's `(measure, value, goal)` rows."""
  memory = report["static_memory"]
  rows = [
    ("compile (lower + compile)", f"{report['compile_s']:.1f} s",
     f"<= {GOALS['compile_s']:.0f} s"),
    ("compile again, warm persistent cache",
     "not run (no --compile_cache_dir)" if report["warm_compile_s"] is None
     else f"{report['warm_compile_s']:.1f} s",
     f"<= {GOALS['warm_compile_s']:.0f} s"),
    (f"step (median of {settings.measured} after {settings.warmup})",
     f"{1e3 * report['step_s']:.1f} ms", ""),
    ("tokens/s", f"{report['tokens_per_s']:.0f}", ""),
    ("FLOPs/step in the compiled HLO (loops x trips)",
     _si(report["flops_compiled"], "FLOP"), ""),
    ("of which XLA's own rematerialisation (.remat clones)",
     _si(report["flops_xla_remat"], "FLOP"), ""),
    ("FLOPs/step analytic, as executed (with remat)",
     _si(report["flops_executed"], "FLOP"),
     f"ratio to compiled less XLA's remat {report['flops_ratio']:.4f}: "
     f"{'agree' if report['flops_agree'] else 'DISAGREE'} (within 10%)"),
    ("FLOPs/step analytic, model (remat left out)",
     _si(report["flops_model"], "FLOP"), ""),
    ("FLOPs/step XLA cost_analysis (loop bodies once)",
     _si(report["flops_xla_cost"], "FLOP"), ""),
    (f"peak ({report['peak_source']})", _si(report["peak_flops"], "FLOP/s"),
     ""),
    ("MFU (model FLOPs / step time / peak)",
     "n/a" if report["mfu"] is None else f"{100 * report['mfu']:.1f}%",
     ", ".join(f">= {100 * v:.0f}% on a {k}"
               for k, v in GOALS["mfu"].items())),
    (f"measured {report['matmul_n']}^3 matmul rate",
     _si(report["matmul_rate"], "FLOP/s"), ""),
    ("MFU against the measured matmul rate",
     f"{100 * report['mfu_measured']:.1f}%", ""),
    ("executed FLOP rate (with remat)",
     _si(report["executed_rate"], "FLOP/s"), ""),
    ("peak device memory (memory_stats)", _bytes(report["peak_memory"]),
     ""),
    ("XLA memory analysis: arguments / outputs / alias / temp",
     " / ".join(_bytes(memory[k]) for k in
                ("argument", "output", "alias", "temp")), ""),
  ]
  if report["uncounted"]:
    rows.append(("not sized by the HLO count", ", ".join(
      f"{n} x{k}" for n, k in report["uncounted"].items()), ""))
  return rows


def profile_rows(report: dict) -> list[tuple[str, ...]]:
  """Return the traced step's time by op category: ms per step, share of
  the traced wall time, and the matmul FLOP rate it achieved."""
  traced = report["profile"]
  wall_ms = 1e3 * traced["wall_s"]
  totals = collections.defaultdict(lambda: [0.0, 0.0])
  for thunk in traced["thunks"]:
    totals[thunk.category][0] += thunk.ms
    totals[thunk.category][1] += thunk.calls * thunk.flops
  rows = []
  for name in profile.CATEGORIES:
    if name in totals:
      ms, flops = totals[name]
      rate = _si(flops / (1e-3 * ms), "FLOP/s") if flops and ms else ""
      rows.append((name, f"{ms:.1f}", f"{100 * ms / wall_ms:.1f}%", rate))
  idle = wall_ms - 1e3 * traced["busy_s"]
  rows.append(("no op running (gaps)", f"{idle:.1f}",
               f"{100 * idle / wall_ms:.1f}%", ""))
  return rows


def slowest_rows(report: dict, count: int = 15) -> list[tuple[str, ...]]:
  """Return the traced step's slowest instructions."""
  rows = []
  for t in report["profile"]["thunks"][:count]:
    rate = (_si(t.calls * t.flops / (1e-3 * t.ms), "FLOP/s")
            if t.flops and t.ms else "")
    rows.append((f"`{t.name}`", t.category, f"{t.ms:.2f}", f"{t.calls:g}",
                 rate, t.source))
  return rows


def flop_parts_rows(report: dict) -> list[tuple[str, str]]:
  """Return the analytic count's parts."""
  parts = report["flops_parts"]
  return ([(name, _si(v, "FLOP")) for name, v in parts.work.items()]
          + [(f"{name} (remat)", _si(v, "FLOP"))
             for name, v in parts.recompute.items()])


def ratio_rows(ratios: list[dict]) -> list[str]:
  """Return the OFF/ON table, one line per block."""
  lines = ["| block | step ON ms | step OFF ms | OFF/ON | reference | goal "
           "| prefix loops ON/OFF | compile ON/OFF s | max first-step loss "
           "diff (D5 bound) |", "|---|---|---|---|---|---|---|---|---|"]
  for r in ratios:
    if "unfit" in r:
      lines.append(f"| {r['layer']} | did not fit the device: {r['unfit']} "
                   "|" + " |" * 7)
      continue
    on, off, layer = r["on"], r["off"], r["layer"]
    ref, goal = prefix.REFERENCE_RATIO.get(layer), GOALS["ratio"].get(layer)
    loops = f"{on['prefix_loops']}/{off['prefix_loops']}"
    lines.append(
      f"| {layer} | {1e3 * on['step_s']:.1f} | {1e3 * off['step_s']:.1f} | "
      f"{r['ratio']:.2f}x | {f'{ref:.2f}x' if ref else '-'} | "
      f"{f'>= {goal:.2f}x' if goal else '-'} | {loops} | "
      f"{on['compile_s']:.1f}/{off['compile_s']:.1f} | {r['loss_diff']:.2e} "
      f"({r['loss_bound']:.2e})"
      f"{'' if r['losses_agree'] else ' FAILED (D5)'}"
      f"{'' if r['off_reran'] else ' FAILED (OFF reran no prefix)'} |")
  return lines


def print_table(rows: list[tuple[str, ...]]) -> None:
  """Print `rows` as a Markdown table with a header of the first row."""
  print("| " + " | ".join(rows[0]) + " |")
  print("|" + "---|" * len(rows[0]))
  for row in rows[1:]:
    print("| " + " | ".join(row) + " |", flush=True)


def measure_ratios(settings: Settings, shared: dict | None = None
                   ) -> list[dict]:
  """Return the OFF/ON measurement at every ratio block; `shared` is the
  main report, reused for the ON variant at its block."""
  return [measure_ratio(settings, layer, shared
                        if shared and layer == settings.layer else None)
          for layer in settings.ratio_layers]


def ratios_hold(ratios: list[dict]) -> bool:
  """Return whether every block's variants fit the device, agreed (D5)
  and OFF reran the prefix."""
  return all("unfit" not in r and r["losses_agree"] and r["off_reran"]
             for r in ratios)


def print_ratios(ratios: list[dict]) -> None:
  """Print the OFF/ON table."""
  print("prefix sharing OFF/ON: OFF reruns the frozen prefix in every "
        "masked forward, as the reference does")
  print("\n".join(ratio_rows(ratios)), flush=True)


def main(argv):
  del argv
  try:
    settings = settings_from_flags()
    check_settings(settings)
    cache = _CACHE_DIR.value
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
      raise ValueError(f"--compile_cache_dir {cache} is a file; name a "
                       "directory")
  except ValueError as e:
    sys.exit(f"lm_step: error: {e}")
  # JAX's default pool is 75% of the device: too little for this step.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  if _RATIOS_ONLY.value:
    ratios = measure_ratios(settings)
    print_ratios(ratios)
    sys.exit(0 if ratios_hold(ratios) else 1)
  if _CACHE_DIR.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE_DIR.value)
  print("[lm_step] the l18 step: compile, FLOPs, steps ...", flush=True)
  report = measure_step(settings, recompile=bool(_CACHE_DIR.value),
                        profile_steps=_TRACED_STEPS.value,
                        trace_dir=flags.FLAGS.trace_dir)
  print(describe(report, settings))
  print_table([("measure", "value", "goal"), *report_rows(report, settings)])
  print("analytic FLOPs by part:")
  print_table([("part", "FLOPs"), *flop_parts_rows(report)])
  if report["profile"]:
    traced = report["profile"]
    print(f"profile of {traced['steps']} traced steps: "
          f"{1e3 * traced['wall_s']:.1f} ms wall per step, ops running "
          f"{1e3 * traced['busy_s']:.1f} ms")
    print_table([("category", "ms/step", "share of wall", "matmul rate"),
                 *profile_rows(report)])
    print_table([("instruction", "category", "ms/step", "runs/step",
                  "matmul rate", "source"), *slowest_rows(report)])
  ok = report["flops_agree"]
  if settings.ratio_layers:
    print("[lm_step] prefix sharing's ratios ...", flush=True)
    ratios = measure_ratios(settings, report)
    print_ratios(ratios)
    ok &= ratios_hold(ratios)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  sys.argv[0] = "lm_step"
  app.run(main)
