"""Train a transcoder per decomposed MLP layer of a finished run and judge
it beside the decomposition: `bin/train_transcoder --run_dir=D`.

Each layer's transcoder (`analysis/transcoder.py`) learns the MLP's
output from its input on the frozen model's activations over
`--train_data_path` (default the run's `--data_path`; recipes pass the fit
split), its `k` the decomposition's CI-L0 of that layer
(`analysis/transcoder_lm.py`; `--k` overrides it). It is then judged on
the harvest's held-out positions (`analysis/transcoder_eval.py`): CE
with it spliced in place of the MLP, latent L0, fit, and its latents'
purity by part of speech beside the components' and the neurons'.
Writes `--output_dir` (default `D/transcoder`), claimed as
`io/owned_dir.py` says: `transcoders.npz`, `results.json`, `results.md`
(`io/transcoder_store.py`). Docs: `docs/transcoder.md`.
"""

import os

from absl import flags, logging

from decompax.analysis import (
  explore, harvest_settings, transcoder_eval, transcoder_lm)
from decompax.bin import cli
from decompax.io import owned_dir
from decompax.io import transcoder_store as store

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "A finished bin/train run of a language model whose MLP "
  "sites it decomposed.", required=True)
_OUTPUT_DIR = flags.DEFINE_string(
  "output_dir", None, "Where the transcoders and results go (default: "
  "<run_dir>/transcoder).")
_TRAIN_DATA_PATH = flags.DEFINE_string(
  "train_data_path", None, "Token file the transcoders train on (default: "
  "the run's --data_path).")
_K = flags.DEFINE_list(
  "k", [], "Latents kept per position, one per layer in layer order, or one "
  "for every layer (default: each layer's CI-L0, its MLP sites' summed, "
  "rounded).")
_N_LATENTS = flags.DEFINE_integer(
  "n_latents", None, "Latents per layer (default: the layer's components, "
  "its MLP sites' C summed).", lower_bound=1)
_NUM_STEPS = flags.DEFINE_integer("num_steps", 2000, "Training steps.",
                                  lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", 32, "Token windows per training step.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len", None, "Tokens per training window (default: the run's "
  "--seq_len).", lower_bound=1)
_LR = cli.define_float("lr", 1e-3, "Adam's learning rate.", __name__,
                       lower_bound=0.0)
_L1_COEFF = cli.define_float(
  "l1_coeff", 0.0, "Weight of the decoder-norm-weighted L1 penalty on the "
  "latents (0: TopK alone).", __name__, lower_bound=0.0)
_SEED = cli.define_seed("seed", 0, "Seed of the initialisation and of the "
                        "training windows.", __name__)
_EVAL_DATA_PATH = flags.DEFINE_string(
  "eval_data_path", None, "Token file to judge on when the run has no "
  "finished harvest (default: the run's --data_path, as bin/harvest's); "
  "with a harvest, its positions are used.")
_EVAL_POSITIONS = flags.DEFINE_integer(
  "eval_positions", 65536, "Positions to judge on without a harvest.",
  lower_bound=1)
_EVAL_BATCH_SIZE = flags.DEFINE_integer(
  "eval_batch_size", 64, "Windows per evaluation batch without a harvest.",
  lower_bound=1)
_DECOMPOSITION_CE = flags.DEFINE_bool(
  "decomposition_ce", True, "Also measure the decomposition's CE under its "
  "CI masks on the same positions (one masked forward per batch).")
_LOG_EVERY = flags.DEFINE_integer(
  "log_every_steps", 100, "Training steps between progress lines.",
  lower_bound=1)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace an output directory of other settings.")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("train_transcoder", message)


def _per_layer(values: list[str], layers: tuple[int, ...], flag: str
               ) -> dict[int, int]:
  """Return a list flag's integer per layer (one value: every layer's)."""
  try:
    ints = [int(v) for v in values]
  except ValueError:
    fail(f"--{flag}={','.join(values)} must be integers")
  if len(ints) == 1:
    ints = ints * len(layers)
  if len(ints) != len(layers):
    fail(f"--{flag} gives {len(ints)} values for the run's {len(layers)} "
         f"MLP layers {list(layers)}; give one per layer or one for all")
  return dict(zip(layers, ints))


def _ks(run_path: str, sites: dict) -> tuple[dict[int, int], dict, str]:
  """Return every layer's k, its CI-L0 (None unknown) and where the CI-L0
  was read."""
  try:
    l0, source = transcoder_lm.site_ci_l0(run_path)
    matched = transcoder_lm.matched_l0(l0, sites)
  except ValueError as e:
    if not _K.value:
      fail(str(e))
    matched, source = {i: None for i in sites}, "none"
  if _K.value:
    return _per_layer(_K.value, tuple(sites), "k"), matched, source
  return transcoder_lm.matched_k(matched), matched, source


def _settings(run: explore.LoadedRun, sites: dict, ks: dict
              ) -> transcoder_lm.TrainSettings:
  c = {s.name: s.c for s in run.target.sites}
  n = {i: _N_LATENTS.value or sum(c[s] for s in names)
       for i, names in sites.items()}
  data = _TRAIN_DATA_PATH.value or run.config.data_path
  return transcoder_lm.TrainSettings(
    os.path.abspath(data) if data else "", tuple(sites),
    tuple(ks[i] for i in sites), tuple(n[i] for i in sites),
    _NUM_STEPS.value, _BATCH_SIZE.value,
    _SEQ_LEN.value or run.config.seq_len, _LR.value, _L1_COEFF.value,
    _SEED.value)


def _open(run_path: str):
  """Return the run, its MLP layers' sites and the training settings, or
  fail on one line."""
  try:
    owned_dir.named(run_path, "run_dir")
    run = explore.load_run(run_path)
  except (OSError, ValueError) as e:
    fail(f"--run_dir: {e}")
  if run.config.target != "hf":
    fail(f"--run_dir: {run_path} decomposes the toy {run.config.target!r}; "
         "a transcoder needs a language model's MLPs (--target=hf)")
  try:
    sites = transcoder_lm.layer_sites(run)
  except ValueError as e:
    fail(f"--run_dir: {e}")
  ks, matched, source = _ks(run_path, sites)
  settings = _settings(run, sites, ks)
  if not settings.data_path:
    fail("--train_data_path: the run names no token file; pass one")
  try:
    transcoder_lm.check_settings(settings)
  except ValueError as e:
    fail(str(e))
  return run, sites, settings, matched, source


def _eval_positions(run_path: str, run: explore.LoadedRun):
  request = harvest_settings.Request(
    positions=_EVAL_POSITIONS.value, batch_size=_EVAL_BATCH_SIZE.value,
    data_path=_EVAL_DATA_PATH.value)
  try:
    return transcoder_eval.eval_settings(run_path, run, request)
  except ValueError as e:
    fail(f"--eval_data_path: {e}" if "data_path" in str(e) else str(e))


def _output_dir(run_path: str) -> str:
  if _OUTPUT_DIR.value is None:
    return os.path.join(run_path, "transcoder")
  try:
    return owned_dir.named(_OUTPUT_DIR.value, "output_dir")
  except ValueError as e:
    fail(str(e))


def _claim(out: str, settings, eval_settings) -> None:
  """Claim `out` (`io/owned_dir.py`), its lock held until the process
  ends, or fail on one line."""
  try:
    record = {"train": vars(settings) | {
      "data": owned_dir.file_identity(settings.data_path)},
      "eval": vars(eval_settings),
      "decomposition_ce": _DECOMPOSITION_CE.value}
    owned_dir.claim(out, store.PROGRAM, _jsonable(record), _OVERWRITE.value)
    owned_dir.record(out, *store.ENTRIES)
  except owned_dir.OwnedConflict as e:
    fail(str(e))
  except ValueError as e:
    fail(f"--output_dir: {e}")
  except OSError as e:
    fail(owned_dir.refusal(e, out))


def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (tuple, list)):
    return [_jsonable(v) for v in value]
  return value


def _record(run_path, settings, eval_settings, from_harvest, evaluation,
            matched, source, sites, last_loss) -> dict:
  others = (transcoder_eval.harvest_units(run_path, sites)
            if from_harvest and evaluation.units is not None else {})
  ks = dict(zip(settings.layers, settings.ks))
  n = dict(zip(settings.layers, settings.n_latents))
  layers = {i: transcoder_eval.layer_record(
    i, evaluation, ks[i], matched[i], n[i], others.get(i), settings.seed)
    for i in settings.layers}
  for i in layers:
    layers[i]["train_loss"] = last_loss[i]
  s = evaluation.scalars
  return _jsonable({
    "run_dir": os.path.abspath(run_path), "ci_l0_source": source,
    "positions": eval_settings.n_batches * eval_settings.batch_size
    * eval_settings.seq_len, "positions_of_harvest": from_harvest,
    "ce": {"clean": s["ce/clean"], "all": s["ce/all"],
           "ci_masked": s.get("ce/ci_masked")},
    "layers": layers, "train": vars(settings)})


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --run_dir=DIR")
  run_path = _RUN_DIR.value
  out = _output_dir(run_path)
  run, sites, settings, matched, source = _open(run_path)
  eval_settings, from_harvest = _eval_positions(run_path, run)
  _claim(out, settings, eval_settings)
  say = lambda line: print(line, flush=True)  # noqa: E731
  say(f"[transcoder] layers {list(settings.layers)}, k "
      f"{list(settings.ks)} (CI-L0 from the {source}), latents "
      f"{list(settings.n_latents)}")
  try:
    params, last = transcoder_lm.train(run, settings, say,
                                       _LOG_EVERY.value)
  except ValueError as e:
    fail(str(e))
  try:
    store.write_transcoders(out, {i: p._asdict() for i, p in params.items()},
                            _jsonable({"train": vars(settings)}))
  except OSError as e:
    fail(owned_dir.refusal(e, os.path.join(out, store.TRANSCODERS)))
  evaluation = transcoder_eval.evaluate(
    run, params, dict(zip(settings.layers, settings.ks)), eval_settings,
    say, _DECOMPOSITION_CE.value)
  record = _record(run_path, settings, eval_settings, from_harvest,
                   evaluation, matched, source, sites, last)
  table = transcoder_eval.results_table(record)
  try:
    _, path = store.write_results(out, record, table)
  except OSError as e:
    fail(owned_dir.refusal(e, os.path.join(out, store.RESULTS)))
  print(table, end="")
  say(f"[transcoder] wrote {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/train_transcoder` launcher)."""
  cli.launch("train_transcoder", main)


if __name__ == "__main__":
  entry()
