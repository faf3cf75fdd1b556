"""What a graded intervention curve costs: `./dev bench intervention`.

A curve is `explore.mask_sweep`: one component's mask at `--points` values
evenly over [0, 2], the next-token log-probability at the prompt's last
position per value, all values one batch through one compiled forward.
The bench times the first call (trace and compile included) and then
`--curve_repeats` calls of the compiled curve on the same prompt, each for a
different component (one compiled program serves them all), and reports
the median and the fastest.

By default the model is a small Llama of random weights (`bench.random_lm`:
a curve's cost does not depend on the weights' values) with one block's
MLP decomposed and an untrained CI function, as `bin/train` builds it;
`--intervention_run_dir` times a finished run instead (its first site), on
a prompt of random token ids. (Flag names apart from the other binaries':
tests load several into one process.)
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from decompax.analysis import explore
from decompax.recipe.flagfiles import read_args
from decompax.targets import glu_config, glu_sites, glu_weights

from bench import ROOT, random_lm

_POINTS = flags.DEFINE_integer("points", 21, "Mask values per curve.",
                               lower_bound=1)
_REPEATS = flags.DEFINE_integer("curve_repeats", 10, "Timed curves after the "
                                "first.", lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "Tokens in the prompt.",
                               lower_bound=1)
_RUN_DIR = flags.DEFINE_string(
  "intervention_run_dir", None, "A finished run to time instead of the "
  "random model.")

# A small Llama: four blocks, block 2's MLP decomposed.
MODEL = glu_config.GluConfig(
  n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
  vocab_size=512, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=False)
LAYER, C = 2, 64


def random_run(model: glu_config.GluConfig, layer: int, c: int,
               seq_len: int) -> explore.LoadedRun:
  """Return a loaded run of `model` with random weights and block
  `layer`'s MLP decomposed into `c` components at their initialisation,
  with `flags/tiny_llama.flags`' CI function."""
  config = read_args([f"--flagfile={ROOT / 'flags' / 'tiny_llama.flags'}",
                      f"--c={c}", "--batch_size=1", f"--seq_len={seq_len}",
                      "--faithfulness_warmup_steps=0"])
  names = tuple(glu_weights.site_name(layer, r) for r in ("gate", "up", "down"))
  sites = glu_sites.site_specs(model, names, c)
  return random_lm.loaded_run(config, model, sites)


def time_curves(run: explore.LoadedRun, tokens: jax.Array, points: int,
                repeats: int) -> dict:
  """Return the first curve's seconds (compile included), the median and
  fastest of `repeats` more (each on another component of the first
  site), and the first curve itself."""
  site = run.target.sites[0]
  values = np.linspace(0.0, 2.0, points)

  def curve(component):
    start = time.perf_counter()
    sweep = explore.mask_sweep(run, tokens, site.name, component, values)
    jax.block_until_ready(sweep.output)
    return time.perf_counter() - start, sweep

  first_s, first = curve(0)
  times = [curve((i + 1) % site.c)[0] for i in range(repeats)]
  return {"site": site.name, "points": points, "first_s": first_s,
          "median_s": statistics.median(times), "min_s": min(times),
          "sweep": first}


def main(argv: list[str]) -> None:
  del argv
  if _RUN_DIR.value:
    run = explore.load_run(_RUN_DIR.value)
    vocab = explore.vocab_size(run)
    what = _RUN_DIR.value
  else:
    run = random_run(MODEL, LAYER, C, _PROMPT.value)
    vocab, what = MODEL.vocab_size, (f"random Llama {MODEL.n_layers}x"
                                     f"{MODEL.d_model}, block {LAYER} MLP, "
                                     f"C={C}")
  tokens = jax.random.randint(jax.random.key(1), (_PROMPT.value,), 0, vocab,
                              jnp.int32)
  result = time_curves(run, tokens, _POINTS.value, _REPEATS.value)
  print(f"{what}: a {result['points']}-point curve of {result['site']} on "
        f"a {_PROMPT.value}-token prompt")
  print(f"  first (trace + compile): {result['first_s']:.3f} s")
  print(f"  compiled: median {result['median_s'] * 1e3:.1f} ms, fastest "
        f"{result['min_s'] * 1e3:.1f} ms over {_REPEATS.value}")


if __name__ == "__main__":
  app.run(main)
