"""Train a Llama-architecture language model on a token file and write it
as a Hugging Face directory: `bin/train_lm --preset=brown-s`.

The presets (`targets/text_lm.py`): `brown-s` (4 layers, d_model 256, d_ff
1024, context 256, BPE 4096; two CPU cores) and `brown-m` (8 layers,
d_model 512, d_ff 2048, context 512, BPE 8192; one TPU v5e chip). Data:
`--data_dir` (default `data/brown/bpe-<V>`, from `./dev data brown`) holds
`train.bin`, `held_out.bin` and the tokenizer. Step `s` trains on the
window batch `(seed, s)` of `train.bin` (`io/tokens.py`).

`--output_dir` (default `models/<preset>`) receives `train_state.npz` (the
resumable state: rerunning the same command resumes from it; saved every
`--save_every_seconds`, at the end, and on SIGTERM/SIGINT, after which the
process exits 75), `train_lm.json` (settings, then results),
`metrics.jsonl` (training loss and held-out cross entropy every
`--eval_every_steps`, on `--eval_windows` windows) and, at the
end, the Hugging Face directory: `config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json`. Tests stop a run as a
preemption would through `DECOMPAX_FAULT=sigterm_after_step=K` (the process
signals itself after step K). The results are held-out cross
entropies (nats per token) of the model and of a unigram and a bigram
model fitted on the training split, all on the same predicted tokens: the
held-out stream cut into disjoint windows of the context length.
"""

import dataclasses
import functools
import json
import os
import shutil
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from decompax.bin import cli, device_memory
from decompax.io import hf_checkpoint, owned_dir, run_dir, tree_npz
from decompax.io import tokens as tokens_lib
from decompax.targets import brown, glu_arrays, text_lm

FAULT_ENV = "DECOMPAX_FAULT"
# The step counter (`TrainState.step`) is int32.
MAX_STEPS = 2**31 - 1
STATE = "train_state.npz"
RECORD = "train_lm.json"
METRICS = "metrics.jsonl"

_PRESET = flags.DEFINE_enum(
  "preset", "brown-s", sorted(text_lm.PRESETS), "Model shape and training"
  " schedule.")
_DATA_DIR = flags.DEFINE_string(
  "data_dir", None, "Folder with train.bin, held_out.bin and tokenizer.json"
  " (default: data/brown/bpe-<the preset's vocab>).")
_OUTPUT_DIR = flags.DEFINE_string(
  "output_dir", None, "Model directory to write (default:"
  " models/<preset>).")
_NUM_STEPS = flags.DEFINE_integer(
  "num_steps", None, "Training steps (default: the preset's).")
_BATCH_SIZE = flags.DEFINE_integer(
  "batch_size", None, "Windows per step (default: the preset's).")
_SEED = cli.define_seed("seed", 0, "Initialisation and data seed.", __name__)
_MAX_EVAL_WINDOWS = flags.DEFINE_integer(
  "max_eval_windows", 0, "Held-out windows scored at the end; 0: all.")
_EVAL_EVERY_STEPS = flags.DEFINE_integer(
  "eval_every_steps", 100, "Steps between held-out evaluations during"
  " training (on --eval_windows windows); 0: only at the end.")
_EVAL_WINDOWS = flags.DEFINE_integer(
  "eval_windows", 64, "Held-out windows, spread evenly over the split, of"
  " the evaluations during training.")
_EVAL_BATCH = flags.DEFINE_integer(
  "eval_batch", 16, "Held-out windows per evaluation forward.")
_PROGRESS_SECONDS = cli.define_float(
  "progress_seconds", 10.0, "Seconds between progress lines.", __name__)
_SAVE_EVERY_SECONDS = cli.define_float(
  "save_every_seconds", 300.0, "Seconds between saves of the training"
  " state.", __name__)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Start over in an --output_dir holding another run.")


def fail(message: str, code: int = 2) -> None:
  """Print a one-line error and exit."""
  cli.fail("train_lm", message, code)


def settings() -> tuple[text_lm.LmPreset, dict]:
  """Return the preset with the flags' overrides and the settings record
  a resumed run must match."""
  preset = text_lm.PRESETS[_PRESET.value]
  changes = {k: v for k, v in (("num_steps", _NUM_STEPS.value),
                               ("batch_size", _BATCH_SIZE.value))
             if v is not None}
  if any(v <= 0 for v in changes.values()):
    raise ValueError(f"{', '.join(f'--{k}' for k in changes)} must be"
                     " positive")
  if changes.get("num_steps", 0) > MAX_STEPS:
    raise ValueError(f"--num_steps={changes['num_steps']} is past"
                     f" {MAX_STEPS}, the most steps a run counts (an int32"
                     " step counter)")
  for holder in (_EVAL_WINDOWS, _EVAL_BATCH):
    if holder.value <= 0:
      raise ValueError(f"--{holder.name} must be positive, got"
                       f" {holder.value}")
  if changes.get("num_steps", preset.num_steps) <= preset.warmup_steps:
    changes["warmup_steps"] = changes["num_steps"] // 10
  preset = dataclasses.replace(preset, **changes)
  record = {"preset": dataclasses.asdict(preset), "seed": _SEED.value}
  return preset, record


def open_data(data_dir: str, preset: text_lm.LmPreset):
  """Return the training and held-out token files of `data_dir`."""
  if not os.path.isdir(data_dir):
    raise ValueError(f"--data_dir {data_dir} does not exist; run ./dev data"
                     " brown first (or name a folder with train.bin,"
                     " held_out.bin and tokenizer.json)")
  if not os.path.isfile(os.path.join(data_dir, "tokenizer.json")):
    raise ValueError(f"--data_dir {data_dir} holds no tokenizer.json; run"
                     " ./dev data brown again")
  train = tokens_lib.open_tokens(os.path.join(data_dir, "train.bin"),
                                 preset.vocab_size)
  held_out = tokens_lib.open_tokens(os.path.join(data_dir, "held_out.bin"),
                                    preset.vocab_size)
  for part in (train, held_out):
    if part.header.vocab_size != preset.vocab_size:
      raise ValueError(
        f"{part.path} was tokenized for vocab {part.header.vocab_size}, the"
        f" preset {preset.name} has {preset.vocab_size}; use"
        f" data/brown/bpe-{preset.vocab_size}")
    if part.header.num_tokens < preset.seq_len + 1:
      raise ValueError(f"{part.path} holds {part.header.num_tokens} tokens,"
                       f" fewer than one window of {preset.seq_len + 1}")
  return train, held_out


# Every file a run writes into its --output_dir, each listed in the
# directory's manifest before it is written (`io/owned_dir.py`).
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json")
# The files of --data_dir whose bytes decide the model.
DATA_FILES = ("train.bin", "train.json", "held_out.bin", "held_out.json",
              "tokenizer.json")


def output_dir(preset: text_lm.LmPreset) -> str:
  """Return --output_dir (an empty or blank one refused), else
  models/<preset>."""
  if _OUTPUT_DIR.value is None:
    return f"models/{preset.name}"
  return owned_dir.named(_OUTPUT_DIR.value, "output_dir")


def claim_output(path: str, record: dict, overwrite: bool) -> bool:
  """Claim `path` for this run, its lock held until the process ends;
  return whether it holds a saved state of the run to resume (`io/owned_dir.py`: a directory holding another run is
  refused unless `overwrite`, which removes what that run wrote; one this
  binary did not write is refused). A run of these settings that never
  saved starts over, its metrics cut."""
  try:
    claim = owned_dir.claim(path, "train_lm", record, overwrite)
  except owned_dir.OwnedConflict as e:
    raise ValueError(f"--output_dir {e}") from None
  except ValueError as e:
    raise ValueError(f"--output_dir {e}") from None
  owned_dir.record(path, RECORD, METRICS, STATE)
  return claim.resumed and os.path.isfile(os.path.join(path, STATE))


def write_record(path: str, record: dict) -> None:
  """Write `train_lm.json` atomically."""
  text = json.dumps(record, indent=1) + "\n"
  run_dir.atomic_write(os.path.join(path, RECORD),
                       lambda f: f.write(text.encode()))


def start_state(path: str, preset: text_lm.LmPreset, record: dict,
                resume: bool):
  """Return the training state: the saved one (the metrics past its step
  cut, so a killed attempt's records are not repeated), else a fresh one
  (the metrics of a run that never saved removed)."""
  metrics = os.path.join(path, METRICS)
  if not resume:
    run_dir.remove_path(metrics)
    write_record(path, {"settings": record})
    return text_lm.init_state(jax.random.key(_SEED.value), preset)
  template = jax.eval_shape(
    lambda: text_lm.init_state(jax.random.key(_SEED.value), preset))
  state, meta = tree_npz.load_tree(os.path.join(path, STATE), template)
  run_dir.truncate_metrics(metrics, int(meta["step"]))
  print(f"[train_lm] resuming {path} at step {meta['step']}", flush=True)
  return jax.tree.map(jnp.asarray, state)


def install_stop_flag() -> threading.Event:
  """Return an event SIGTERM and SIGINT set (serviced between steps)."""
  stop = threading.Event()
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda *_: stop.set())
  return stop


def eval_windows(held_out: tokens_lib.Tokens, seq_len: int,
                 limit: int) -> np.ndarray:
  """Return the held-out stream cut into disjoint `[n, seq_len + 1]`
  windows (each overlapping the next by its last token); with `limit`, at
  most that many, spread evenly over the stream (so over every genre)."""
  n = brown.eval_windows(held_out.header.num_tokens, seq_len)
  chosen = np.arange(n)
  if 0 < limit < n:
    chosen = np.arange(limit) * n // limit
  index = chosen[:, None] * seq_len + np.arange(seq_len + 1)
  return np.asarray(held_out.ids[index], np.int32)


@functools.cache
def step_function(preset: text_lm.LmPreset):
  """Return the jitted training step of `preset`: one function per preset,
  so the step `check_step_fits` compiles is the one that runs."""
  return jax.jit(text_lm.make_train_step(preset), donate_argnums=0)


def check_step_fits(preset: text_lm.LmPreset, seed: int) -> None:
  """Raise `device_memory.DoesNotFit`, before anything is written, when
  one training step of `preset` needs more memory than is free: a batch
  too large to allocate is otherwise killed by the kernel without a
  word, or hangs."""
  state = jax.eval_shape(
    lambda: text_lm.init_state(jax.random.key(seed), preset))
  window = jax.ShapeDtypeStruct((preset.batch_size, preset.seq_len + 1),
                                jnp.int32)
  compiled = step_function(preset).lower(state, window).compile()
  device_memory.check_fits(
    compiled, f"a step of --batch_size={preset.batch_size} windows of"
    f" {preset.seq_len + 1} tokens", "lower --batch_size")


def make_scorer(preset: text_lm.LmPreset, batch: int):
  """Return `score(weights, windows)`: the model's mean next-token cross
  entropy over `windows`, `batch` windows per forward."""
  config = text_lm.model_config(preset)
  losses = jax.jit(lambda w, x: jnp.sum(text_lm.token_losses(w, x, config)))

  def score(weights, windows: np.ndarray) -> float:
    total = 0.0
    for i in range(0, len(windows), batch):
      total += float(losses(weights, jnp.asarray(windows[i:i + batch])))
    return total / (windows.shape[0] * (windows.shape[1] - 1))

  return score


def evaluate(weights, train, held_out, preset, limit, score) -> dict:
  """Return held-out cross entropies of the model and the baselines."""
  windows = eval_windows(held_out, preset.seq_len, limit)
  previous, targets = windows[:, :-1].ravel(), windows[:, 1:].ravel()
  base = brown.baselines(np.asarray(train.ids), previous, targets,
                         preset.vocab_size)
  model = score(weights, windows)
  return {"held_out_tokens": int(targets.size),
          "model_ce": model, "unigram_ce": base.unigram,
          "bigram_ce": base.bigram, "bigram_alpha": base.bigram_alpha,
          "model_ppl": brown.perplexity(model),
          "bigram_ppl": brown.perplexity(base.bigram)}


def copier(source: str):
  """Return a writer of `source`'s bytes (for `run_dir.atomic_write`)."""

  def write(f) -> None:
    with open(source, "rb") as src:
      shutil.copyfileobj(src, f)

  return write


def export(path: str, data_dir: str, weights, preset) -> None:
  """Write the Hugging Face directory of the trained weights into `path`."""
  owned_dir.record(path, *HF_FILES)
  config = text_lm.model_config(preset)
  arrays = glu_arrays.weights_to_arrays(jax.device_get(weights))
  hf_checkpoint.write_llama_checkpoint(
    path, arrays, config, {"bos_token_id": None, "pad_token_id": None,
                           "eos_token_id": 0})
  for name in ("tokenizer.json", "tokenizer_config.json"):
    source = os.path.join(data_dir, name)
    if os.path.isfile(source):
      run_dir.atomic_write(os.path.join(path, name), copier(source))


class Progress:
  """Prints step, loss, throughput and ETA every `every` seconds.

  Rates count from the end of the first step, so compiling is not taken
  for training time.
  """

  def __init__(self, total: int, tokens: int, every: float):
    self.total, self.tokens, self.every = total, tokens, every
    self.first = None
    self.start = self.last = time.time()

  def __call__(self, step: int, loss) -> None:
    now = time.time()
    if self.first is None:
      self.first, self.start = step, now
      print(f"[train_lm] step {step}/{self.total}  loss {float(loss):.4f}"
            "  (compiled)", flush=True)
      return
    if now - self.last < self.every and step < self.total:
      return
    self.last = now
    rate = (step - self.first) / max(now - self.start, 1e-9)
    eta = (self.total - step) / max(rate, 1e-9)
    print(f"[train_lm] step {step}/{self.total}  loss {float(loss):.4f}  "
          f"{rate:.3f} steps/s  {rate * self.tokens:,.0f} tokens/s  "
          f"elapsed {now - self.start:.0f}s  ETA {eta:.0f}s", flush=True)


def sigterm_step() -> int | None:
  """Return K of `sigterm_after_step=K` in DECOMPAX_FAULT, if set."""
  for part in os.environ.get(FAULT_ENV, "").split(","):
    key, _, value = part.partition("=")
    if key == "sigterm_after_step":
      return int(value)
  return None


def train(path, preset, train_tokens, state, stop, check) -> tuple:
  """Run the remaining steps; return the state and whether it stopped.

  `check(step, weights, loss)` runs after every step (the held-out
  evaluations it makes when due).
  """
  step_fn = step_function(preset)
  first = int(state.step)
  progress = Progress(preset.num_steps, preset.batch_size * preset.seq_len,
                      _PROGRESS_SECONDS.value)
  saved_at = time.time()
  fault = sigterm_step()
  for step in range(first, preset.num_steps):
    window = tokens_lib.read_batch(train_tokens, _SEED.value, step,
                                   preset.batch_size, preset.seq_len + 1)
    state, loss = step_fn(state, jnp.asarray(window))
    if not np.isfinite(float(loss)):
      fail(f"loss is {float(loss)} at step {step + 1}; lower the preset's lr"
           " and start over with --overwrite", 3)
    progress(step + 1, loss)
    check(step + 1, state.weights, loss)
    if fault == step + 1:
      os.kill(os.getpid(), signal.SIGTERM)
    due = time.time() - saved_at >= _SAVE_EVERY_SECONDS.value
    if stop.is_set() or due:
      tree_npz.save_tree(os.path.join(path, STATE), state,
                         {"step": step + 1})
      saved_at = time.time()
      if stop.is_set() and step + 1 < preset.num_steps:
        return state, True
  tree_npz.save_tree(os.path.join(path, STATE), state,
                     {"step": int(state.step)})
  return state, False


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  stop = install_stop_flag()
  try:
    preset, record = settings()
    data_dir = owned_dir.named(
      _DATA_DIR.value or f"data/brown/bpe-{preset.vocab_size}", "data_dir")
    path = output_dir(preset)
    train_tokens, held_out = open_data(data_dir, preset)
    check_step_fits(preset, _SEED.value)
    # The data's bytes decide the model as much as the preset does.
    record["data"] = owned_dir.files_identity(data_dir, DATA_FILES)
    resume = claim_output(path, record, _OVERWRITE.value)
    state = start_state(path, preset, record, resume)
    print(f"[train_lm] {preset.name}: {preset.n_layers} layers, d_model"
          f" {preset.d_model}, d_ff {preset.d_ff}, context {preset.seq_len},"
          f" vocab {preset.vocab_size}; {preset.num_steps} steps of"
          f" {preset.batch_size} windows on {jax.devices()[0].platform}",
          flush=True)
    score = make_scorer(preset, _EVAL_BATCH.value)
    during = eval_windows(held_out, preset.seq_len, _EVAL_WINDOWS.value)

    def check(step, weights, loss):
      every = _EVAL_EVERY_STEPS.value
      if every <= 0 or (step % every and step != preset.num_steps):
        return
      ce = score(weights, during)
      print(f"[train_lm] step {step}: held-out cross entropy {ce:.4f}"
            f" ({len(during)} windows)", flush=True)
      run_dir.append_metrics(os.path.join(path, METRICS), {
        "step": step, "train_loss": float(loss), "held_out_ce": ce,
        "held_out_windows": len(during)})

    start = time.time()
    state, stopped = train(path, preset, train_tokens, state, stop, check)
    if stopped:
      print(f"[train_lm] stop signal: saved step {int(state.step)} to"
            f" {path}/{STATE}; rerun the same command to resume", flush=True)
      sys.exit(cli.REQUEUE_EXIT_CODE)
    results = evaluate(state.weights, train_tokens, held_out, preset,
                       _MAX_EVAL_WINDOWS.value, score)
    export(path, data_dir, state.weights, preset)
    write_record(path, {"settings": record, "results": results,
                        "train_seconds_this_run": time.time() - start})
  except ValueError as e:
    fail(str(e))
  except OSError as e:
    fail(owned_dir.refusal(e, _OUTPUT_DIR.value or "models"))
  gap = results["bigram_ce"] - results["model_ce"]
  print(f"[train_lm] held-out cross entropy (nats/token, "
        f"{results['held_out_tokens']} tokens): model"
        f" {results['model_ce']:.4f}, bigram {results['bigram_ce']:.4f},"
        f" unigram {results['unigram_ce']:.4f}; the model"
        f" {'beats' if gap > 0 else 'does not beat'} the bigram by"
        f" {abs(gap):.4f}", flush=True)
  print(f"[train_lm] wrote {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/train_lm` launcher)."""
  cli.launch("train_lm", main)


if __name__ == "__main__":
  entry()
