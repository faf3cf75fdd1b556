"""Harvest a finished run's components: `bin/harvest --run_dir=DIR`.

Writes `<run_dir>/harvest/` (see `recipe/harvest.py`): per component its
firing density, mean CI, CI histogram, co-activations, top contexts and
ablation effect. Rerun the same command to resume an interrupted harvest.
"""

import os

from absl import flags, logging

from decompax.bin import cli
from decompax.recipe import explore
from decompax.recipe import harvest as harvest_lib

_D = harvest_lib.Request()
_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "Run directory (the --output_dir of bin/train).",
  required=True)
_DATA_PATH = flags.DEFINE_string(
  "data_path", None, "Token file to harvest (language models; "
  "default: the run's --data_path).")
_POSITIONS = flags.DEFINE_integer(
  "positions", _D.positions, "Positions to harvest (tokens for language "
  "models, inputs for toys); rounded up to whole batches.")
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", _D.batch_size, "Sequences (or toy inputs) per batch.")
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len", _D.seq_len, "Tokens per sequence (default: the run's "
  "--seq_len).")
_TOP_K = flags.DEFINE_integer("top_k", _D.top_k, "Contexts kept per "
                              "component.")
_BEFORE = flags.DEFINE_integer("window_before", _D.window_before,
                               "Tokens kept before a top position.")
_AFTER = flags.DEFINE_integer("window_after", _D.window_after,
                              "Tokens kept after a top position.")
_THRESHOLD = cli.define_float(
  "threshold", _D.threshold, "CI above which a component fires "
  "(default: the run's --ci_alive_threshold).", __name__)
_ABLATION_BATCHES = flags.DEFINE_integer(
  "ablation_batches", _D.ablation_batches, "Batches on which every "
  "component is ablated in turn (0: no ablation effects).")
_ABLATION_CHUNK = flags.DEFINE_integer(
  "ablation_chunk", 16, "Ablated forwards run at once (memory: that many "
  "forwards of one batch).")
_SEED = flags.DEFINE_integer("seed", _D.seed, "Seed of the "
                             "harvested batches.")
_SAVE_EVERY_S = cli.define_float(
  "save_every_s", 60.0, "Seconds between resumable saves (0: after every "
  "batch).", __name__)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a "
                               "harvest made with other settings.")

def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("harvest", message)


def _flagged(message: str) -> str:
  """Return a library message with its leading setting named as a flag."""
  name, sep, rest = message.partition("=")
  if not sep or " " in name:
    name, sep, rest = message.partition(":")
    if not sep or " " in name:
      return message
  return f"--{name}{sep}{rest}"


def request() -> harvest_lib.Request:
  """Return the harvest the flags ask for."""
  return harvest_lib.Request(
    positions=_POSITIONS.value, batch_size=_BATCH_SIZE.value,
    seq_len=_SEQ_LEN.value, top_k=_TOP_K.value,
    window_before=_BEFORE.value, window_after=_AFTER.value,
    threshold=_THRESHOLD.value, ablation_batches=_ABLATION_BATCHES.value,
    seed=_SEED.value, data_path=_DATA_PATH.value)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  try:
    run = explore.load_run(_RUN_DIR.value)
  except (OSError, ValueError) as e:
    fail(f"--run_dir: {e}")
  out = os.path.join(_RUN_DIR.value, harvest_lib.HARVEST_DIR)
  try:
    settings = harvest_lib.resolve(run, request())
    record = harvest_lib.harvest(
      run, settings, out, _SAVE_EVERY_S.value, _ABLATION_CHUNK.value,
      _OVERWRITE.value, say=lambda line: print(line, flush=True))
  except harvest_lib.HarvestConflict as e:
    fail(f"{e} (--overwrite)")
  except ValueError as e:
    fail(_flagged(str(e)))
  if not record:
    return
  path = harvest_lib.write_manifest(out, _RUN_DIR.value, run, settings,
                                    record)
  if "ratio_to_clean" in record:
    print(f"[harvest] throughput {record['ratio_to_clean']:.2f}x a clean "
          f"forward ({record['harvest_batches_per_s']:.1f} against "
          f"{record['clean_batches_per_s']:.1f} batches/s)")
  print(f"[harvest] wrote {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/harvest` launcher)."""
  cli.launch("harvest", main)


if __name__ == "__main__":
  entry()
