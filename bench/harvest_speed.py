"""What a harvest costs beside a clean forward: `./dev bench harvest_speed`.

Runs `analysis.harvesting.harvest` as `bin/harvest` does, on a model of
`brown_s`'s shape (`text_lm`'s `brown-s` preset: 4 layers, d_model 256,
every MLP projection a site, 12 sites of C = 256) with random weights and
its CI function at initialisation, over a tagged token file of random
tokens and Brown tags (so the tag statistics and their baselines run, as
on the corpus), and prints the harvest's batches/s, the clean forward's
over the same batches and their ratio: the harvest's own `throughput`
record, both measured in the one run after their compiles. A harvest's
cost does not depend on the weights' or tags' values.

`--harvest_c` and `--harvest_layers` shrink the model for a quick look;
`--harvest_tags=false` leaves the tag statistics out. (Flag names apart
from the other binaries': tests load several into one process.)
"""

import dataclasses
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from decompax.analysis import explore, harvest_settings, harvesting
from decompax.io import hf_checkpoint, tokens
from decompax.recipe.flagfiles import read_args
from decompax.targets import (
  brown, brown_tags, glu_arrays, glu_sites, glu_weights, text_lm)

from bench import ROOT, random_lm

_BATCHES = flags.DEFINE_integer("harvest_batches", 24, "Harvested batches "
                                "(the first, which compiles, is not timed).",
                                lower_bound=2)
_BATCH = flags.DEFINE_integer("harvest_batch_size", 8, "Windows a batch.",
                              lower_bound=1)
_SEQ = flags.DEFINE_integer("harvest_seq_len", 64, "Tokens a window.",
                            lower_bound=2)
_C = flags.DEFINE_integer("harvest_c", 256, "Components per site.",
                          lower_bound=1)
_LAYERS = flags.DEFINE_integer("harvest_layers", 4, "Decoder layers.",
                               lower_bound=1)
_TAGS = flags.DEFINE_boolean("harvest_tags", True, "Harvest tag statistics "
                             "and their baselines, as on the Brown corpus.")

ROLES = ("gate", "up", "down")
# Every fine tag of the Brown classes, and the stream's boundary tags.
TAGS = tuple(dict.fromkeys(
  (*brown.SPECIAL_TAGS, *brown_tags.BASE_CLASS)))


def random_run(layers: int, c: int, seq_len: int, model_dir: str,
               preset: str = "brown-s") -> explore.LoadedRun:
  """Return a loaded run of a `preset`-shaped model of `layers` layers and
  random weights, every MLP projection decomposed into `c` components at
  their initialisation, with `flags/brown_s.flags`' CI function; its
  config names a checkpoint of that shape, written into `model_dir` (the
  harvest reads the model's shape from it)."""
  shape = dataclasses.replace(text_lm.PRESETS[preset], n_layers=layers)
  model = text_lm.model_config(shape)
  hf_checkpoint.write_llama_checkpoint(
    model_dir, glu_arrays.weights_to_arrays(
      text_lm.init(jax.random.key(0), shape)), model, {"eos_token_id": 0})
  config = read_args([f"--flagfile={ROOT / 'flags' / 'brown_s.flags'}",
                      f"--model_dir={model_dir}", f"--c={c}",
                      f"--seq_len={seq_len}",
                      "--faithfulness_warmup_steps=0"])
  names = tuple(glu_weights.site_name(i, r) for i in range(layers)
                for r in ROLES)
  sites = glu_sites.site_specs(model, names, c)
  return random_lm.loaded_run(config, model, sites)


def write_token_file(path: str, num_tokens: int, vocab_size: int,
                     tagged: bool) -> None:
  """Write `num_tokens` random tokens in 16 documents (with random Brown
  tags beside them when `tagged`)."""
  rng = np.random.default_rng(0)
  sizes = [num_tokens // 16] * 16
  ids = [rng.integers(1, vocab_size, n) for n in sizes]
  if not tagged:
    tokens.write_tokens(path, ids, vocab_size, 0, "random")
    return
  docs = [tokens.TaggedDocument(
    f"d{i:02d}", x, rng.integers(2, len(TAGS), len(x)),
    np.arange(0, len(x), 20)) for i, x in enumerate(ids)]
  tokens.write_tagged_tokens(path, docs, TAGS, brown.EOS_TAG, vocab_size, 0,
                             "random")


def measure(batches: int, batch_size: int, seq_len: int, c: int,
            layers: int, tagged: bool, preset: str = "brown-s") -> dict:
  """Return the harvest's throughput record (`harvesting.throughput`) and
  its wall seconds, compile included, on the random run (`random_run`)."""
  with tempfile.TemporaryDirectory() as tmp:
    run = random_run(layers, c, seq_len, f"{tmp}/model", preset)
    path = f"{tmp}/tokens.bin"
    # A little more than the batches, so none is cut short.
    write_token_file(path, (batches + 1) * batch_size * (seq_len + 1),
                     explore.vocab_size(run), tagged)
    settings = harvest_settings.resolve(run, harvest_settings.Request(
      positions=batches * batch_size * seq_len, batch_size=batch_size,
      seq_len=seq_len, ablation_batches=0, data_path=path))
    start = time.perf_counter()
    record = harvesting.harvest(run, settings, f"{tmp}/harvest",
                                save_every_s=1e9, say=lambda _: None)
    wall = time.perf_counter() - start
  return {**record, "wall_s": wall, "batches": settings.n_batches,
          "sites": len(run.target.sites)}


def main(argv: list[str]) -> None:
  del argv
  r = measure(_BATCHES.value, _BATCH.value, _SEQ.value, _C.value,
              _LAYERS.value, _TAGS.value)
  print(f"harvest of a random brown-s-shaped model ({_LAYERS.value} layers, "
        f"{r['sites']} sites, C={_C.value}), {r['batches']} batches of "
        f"{_BATCH.value}x{_SEQ.value} tokens, tags "
        f"{'on' if _TAGS.value else 'off'}, {jax.default_backend()}")
  print(f"  harvest        {r['harvest_batches_per_s']:10.2f} batches/s")
  print(f"  clean forward  {r['clean_batches_per_s']:10.2f} batches/s")
  print(f"  ratio          {r['ratio_to_clean']:10.3f}")
  print(f"  wall (compile, writes included) {r['wall_s']:.1f} s")


if __name__ == "__main__":
  app.run(main)
