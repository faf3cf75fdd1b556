"""What prefix sharing saves on a deep, narrow Llama (SPEC §3.5, §9.3).

Run: `./dev bench prefix`.
The model is Llama-shaped (32 layers, GQA, SwiGLU) but narrow, with random
weights (`bench.random_lm`): step cost does not depend on them. For each
`--layers` entry it decomposes that whole block (all 7 sites q, k, v, o,
gate, up, down) with the reference LM recipe (`flags/l18.flags`:
faithfulness, importance and frequency minimality, stochastic recon,
persistent PGD with its warmup ascents, the chunkwise transformer CI)
shrunk to CPU sizes, and builds the step exactly as `bin/train` does,
twice:
  * prefix sharing ON: masked forwards resume from the clean pass's
    `resid.{layer}`, the frozen prefix runs once per step;
  * OFF: every masked forward reruns the frozen prefix from the tokens.
All variants are compiled and timed in one process; their timed steps
interleave (one step of each in turn), so machine-load drift hits all
alike. It reports compile time (lower + compile wall), the median step
time, the prefix scans left in the compiled step, the OFF/ON ratios beside
the reference's (GPU), and both variants' first-step recon losses,
which must agree (D5: within 2e-5 abs; the exit status says).

Every OFF prefix rerun is the same computation of the same operands
(weights, tokens), which a compiler may merge into the clean pass's scan
(XLA's common-subexpression elimination does on a CPU; its TPU compiler
does so even with that pass disabled). OFF therefore ties each masked
forward's tokens to its masks through an optimization barrier
(`glu_target.rerun_prefix`), so its compiled step keeps one prefix scan per
masked forward on every platform, as a framework that shares nothing runs
it; the table's prefix loops show it, and the exit status fails where OFF
holds no more of them than ON.
"""

import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from decompax.core.sites import SiteSpec
from decompax.recipe import assembly
from decompax.recipe.config import TrainConfig
from decompax.recipe.flagfiles import read_args
from decompax.targets import glu_config, glu_sites, glu_weights

from bench import hlo_flops, random_lm

_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per variant.")
_WARMUP = flags.DEFINE_integer(
  "warmup", 3, "Untimed steps after compiling (at least 1: the first "
  "step's losses are compared).")
_LAYERS = flags.DEFINE_list("layers", ["18", "31"],
                            "Decomposed blocks, one pair of variants each.")
# Named apart from bin/train's flags, which the recipe's flagfile sets.
_BATCH = flags.DEFINE_integer("prefix_batch", 4, "Sequences per batch.")
_SEQ_LEN = flags.DEFINE_integer("prefix_seq_length", 32, "Tokens per sequence.")
_C = flags.DEFINE_integer("prefix_components", 64, "Components per matrix.")

ROOT = pathlib.Path(__file__).resolve().parents[1]
# OFF/ON step-time ratio of the reference implementation on one GPU.
REFERENCE_RATIO = {18: 1.25, 31: 1.82}
# Llama-3.1-8B's depth and head layout, narrow enough for a CPU step.
MODEL = glu_config.GluConfig(
  n_layers=32, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
  vocab_size=256, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
# The reference recipe at CPU sizes (the CI as in flags/tiny_llama.flags).
RECIPE_OVERRIDES = (
  "--compute_dtype=float32", "--attention=reference",
  "--ci_attention=reference", "--ci_d_model=32", "--ci_n_blocks=1",
  "--ci_n_heads=2", "--ci_d_mlp=64", "--faithfulness_warmup_steps=0")
RECON_TERMS = ("loss/stochastic_recon", "loss/persistent_pgd_recon")


def recipe(batch: int, seq_len: int, c: int) -> TrainConfig:
  """Return the `flags/l18.flags` config at bench sizes."""
  return read_args([f"--flagfile={ROOT / 'flags' / 'l18.flags'}",
                    *RECIPE_OVERRIDES, f"--batch_size={batch}",
                    f"--seq_len={seq_len}", f"--c={c}"])


def block_sites(config: TrainConfig, model: glu_config.GluConfig,
                layer: int) -> tuple[SiteSpec, ...]:
  """Return the sites of block `layer` whole (all 7 matrices)."""
  names = tuple(glu_weights.site_name(layer, r) for r in glu_weights.ROLES)
  return glu_sites.site_specs(model, names, config.c)


def build_pair(config: TrainConfig, model: glu_config.GluConfig,
               layer: int) -> dict[bool, assembly.Run]:
  """Return the runs decomposing block `layer` whole, as `bin/train` builds
  them for `--target=hf`, sharing the prefix (True) or not, on the same
  random weights."""
  sites = block_sites(config, model, layer)
  weights = random_lm.random_weights(jax.random.key(0), model, sites,
                                     jnp.float32)
  return {sharing: random_lm.build_run(config, model, sites, weights, sharing)
          for sharing in (True, False)}


def prefix_loops(compiled_text: str, split: int) -> int:
  """Return how many `split`-trip loops (prefix scans) the compiled step
  holds, RNG loops aside."""
  return hlo_flops.loop_trips(compiled_text).count(split)


def compile_variant(run: assembly.Run, layer: int) -> dict:
  """Return the compiled step with its compile wall time and prefix loops."""
  start = time.perf_counter()
  step = run.built.step.lower(run.state, run.weights, run.data_key).compile()
  return {"step": step, "compile_s": time.perf_counter() - start,
          "prefix_loops": prefix_loops(step.as_text(), layer),
          "run": run, "state": run.state, "times": [], "first": None}


def advance(variant: dict) -> None:
  """Run one step of `variant`, recording its wall time and, the first
  time, its recon losses."""
  run = variant["run"]
  start = time.perf_counter()
  variant["state"], metrics = variant["step"](variant["state"], run.weights,
                                              run.data_key)
  jax.block_until_ready(variant["state"])
  variant["times"].append(time.perf_counter() - start)
  if variant["first"] is None:
    variant["first"] = {k: float(metrics[k]) for k in RECON_TERMS}


def measure(config: TrainConfig, layers: list[int], steps: int,
            warmup: int) -> dict[tuple[int, bool], dict]:
  """Return every variant `(layer, sharing)` compiled and timed, its
  timed steps interleaved with the others'."""
  # The process's first compile pays one-time setup; not the variants'.
  jax.jit(jnp.sin)(jnp.ones(2)).block_until_ready()
  variants = {}
  for i, layer in enumerate(layers):
    runs = build_pair(config, MODEL, layer)
    # Alternating which variant compiles first evens out warm caches.
    for sharing in ((True, False) if i % 2 == 0 else (False, True)):
      variants[layer, sharing] = compile_variant(runs[sharing], layer)
      print(f"  compiled layer {layer} prefix sharing "
            f"{'on' if sharing else 'off'} in "
            f"{variants[layer, sharing]['compile_s']:.1f} s", flush=True)
  for i in range(warmup + steps):
    for v in variants.values():
      advance(v)
      if i < warmup:
        v["times"].pop()
  return variants


def report(variants: dict[tuple[int, bool], dict]) -> bool:
  """Print the table and OFF/ON ratios; return whether D5 held and OFF
  reran the prefix."""
  print(f"{'layer':>5} {'sharing':>7} {'compile s':>9} {'step ms':>8} "
        f"{'prefix loops':>12} " + " ".join(
          f"{k.split('/')[1]:>20}" for k in RECON_TERMS))
  for layer, sharing in sorted(variants, key=lambda k: (k[0], not k[1])):
    v = variants[layer, sharing]
    print(f"{layer:>5} {'on' if sharing else 'off':>7} {v['compile_s']:9.1f} "
          f"{1e3 * statistics.median(v['times']):8.1f} "
          f"{v['prefix_loops']:12d} " + " ".join(
            f"{v['first'][k]:20.8g}" for k in RECON_TERMS))
  print("OFF/ON ratios:")
  print(f"{'layer':>5} {'step':>7} {'reference (GPU)':>15} {'compile':>8} "
        f"{'max |first-step loss diff|':>26}")
  ok = True
  for layer in sorted({layer for layer, _ in variants}):
    on, off = variants[layer, True], variants[layer, False]
    ratio = statistics.median(off["times"]) / statistics.median(on["times"])
    ref = REFERENCE_RATIO.get(layer)
    diff = max(abs(on["first"][k] - off["first"][k]) for k in RECON_TERMS)
    reran = off["prefix_loops"] > on["prefix_loops"]
    ok &= diff <= 2e-5 and reran
    print(f"{layer:>5} {ratio:6.2f}x {f'{ref:.2f}x' if ref else '-':>15} "
          f"{off['compile_s'] / on['compile_s']:7.2f}x {diff:26.2e}"
          f"{'' if diff <= 2e-5 else '  FAILED (D5: 2e-5 abs)'}"
          f"{'' if reran else '  FAILED (OFF kept no more prefix scans)'}")
  return ok


def main(argv):
  del argv
  steps, warmup = _STEPS.value, max(1, _WARMUP.value)
  layers = [int(n) for n in _LAYERS.value]
  config = recipe(_BATCH.value, _SEQ_LEN.value, _C.value)
  print(f"machine: {jax.devices()[0].device_kind}; "
        f"{MODEL.n_layers}-layer Llama, d "
        f"{MODEL.d_model}, d_ff {MODEL.d_ff}, heads {MODEL.n_heads}/"
        f"{MODEL.n_kv_heads}; one whole block (7 sites), C={config.c}, batch "
        f"{config.batch_size}x{config.seq_len}; flags/l18.flags recipe "
        f"(pgd_n_warmup={config.pgd_n_warmup}); median of {steps} "
        f"interleaved steps after {warmup}", flush=True)
  ok = report(measure(config, layers, steps, warmup))
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  sys.argv[0] = "prefix"
  app.run(main)
