"""Train a task model here and write it as a Hugging Face directory:
`bin/train_task_model --task=addsub --output_dir=models/addsub`.

`addsub` is the arithmetic toy (`targets/arithmetic.py`): a two-layer GLU
transformer answering `a ± b mod P` prompts and continuing induction copies.
It is trained from `--seed`, refused unless it reaches its accuracy bars,
and written as a Llama checkpoint any `--target=hf --model_dir=` run reads:
`config.json`, `model.safetensors`, a word-level tokenizer
(`tokenizer.json`, `tokenizer_config.json`; `"3 + 4 ="` encodes to the
task's token ids) and `task.json` (the prompt layout and the accuracies).
Everything is written to a temporary directory beside `--output_dir` and
renamed into place, so the directory is never half-written.
"""

import json
import os
import shutil
import tempfile
import time

from absl import flags, logging

from decompax.bin import cli
from decompax.io import hf_checkpoint
from decompax.targets import arithmetic, registry

TASKS = ("addsub",)

_TASK = flags.DEFINE_enum(
  "task", "addsub", TASKS, "Task model to train: addsub (a ± b mod 23 "
  "prompts plus induction copying).")
_OUTPUT_DIR = flags.DEFINE_string(
  "output_dir", None, "Hugging Face model directory to write.",
  required=True)
_SEED = cli.define_seed(
  "seed", None, "Training seed (default: the task's known-good seed).",
  __name__)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace an existing non-empty --output_dir.")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("train_task_model", message)


def check_output_dir(path: str, overwrite: bool) -> None:
  """Raise ValueError for an output directory that must not be written."""
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"--output_dir {path} is a file; name a directory")
  if os.path.isdir(path) and os.listdir(path) and not overwrite:
    raise ValueError(f"--output_dir {path} exists and is not empty; pass "
                     "--overwrite to replace it")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise ValueError(f"--output_dir parent {parent} does not exist")


def task_record(
  name: str, config: arithmetic.ArithmeticConfig, seed: int,
  accuracies: tuple[float, float],
) -> dict:
  """Return `task.json`: what a reader needs to build prompts."""
  return {
    "task": name, "seed": seed, "modulus": config.modulus,
    "operators": list(arithmetic.OPERATORS),
    "operator_token_ids": [arithmetic.operator_token(config, i)
                           for i in range(len(arithmetic.OPERATORS))],
    "equals_token_id": arithmetic.equals_token(config),
    "prompt_length": arithmetic.PROMPT_LENGTH,
    "answer_position": arithmetic.ANSWER_POSITION,
    "answer_accuracy": accuracies[0], "induction_accuracy": accuracies[1],
  }


def write_model_dir(path: str, arrays, config: arithmetic.ArithmeticConfig,
                    record: dict) -> None:
  """Write the Hugging Face directory to a temporary sibling, then rename
  it to `path` (an existing `path` is replaced only once all is written)."""
  tokens = arithmetic.token_strings(config)
  eos = "<eos>" if "<eos>" in tokens else None
  unk = "<unk>" if "<unk>" in tokens else None
  parent = os.path.dirname(os.path.abspath(path))
  name = os.path.basename(os.path.normpath(path))
  staging = tempfile.mkdtemp(prefix=f".{name}.", dir=parent)
  try:
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide it from others
    hf_checkpoint.write_llama_checkpoint(
      staging, arrays, config.model,
      {"bos_token_id": None, "pad_token_id": None,
       "eos_token_id": None if eos is None else tokens.index(eos)})
    hf_checkpoint.write_word_tokenizer(staging, tokens, unk, eos)
    with open(os.path.join(staging, "task.json"), "w",
              encoding="utf-8") as f:
      json.dump(record, f, indent=2)
      f.write("\n")
    old = None
    if os.path.exists(path):
      old = tempfile.mkdtemp(prefix=f".{name}.old.", dir=parent)
      os.replace(path, os.path.join(old, name))
    os.replace(staging, path)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; flags take the form --name=value")
  path = _OUTPUT_DIR.value
  try:
    check_output_dir(path, _OVERWRITE.value)
    toy = registry.get(_TASK.value)
    seed = toy.default_seed if _SEED.value is None else _SEED.value
    print(f"[task] training {toy.name} (seed {seed}) ...", flush=True)
    start = time.time()

    def progress(step, loss):
      print(f"[task]   step {step}  loss {loss:.3e}  "
            f"({time.time() - start:.0f}s)", flush=True)

    # Raises ValueError, naming the seed, below the accuracy bars.
    weights = toy.train(seed, progress=progress)
    accuracies = arithmetic.accuracy(weights, toy.config)
    print(f"[task] trained in {time.time() - start:.1f}s: answer accuracy "
          f"{accuracies[0]:.4f}, induction accuracy {accuracies[1]:.4f}",
          flush=True)
    write_model_dir(path, toy.weights_to_arrays(weights), toy.config,
                    task_record(toy.name, toy.config, seed, accuracies))
  except (ValueError, OSError) as e:
    fail(str(e))
  print(f"[task] wrote {path}")


def entry() -> None:
  """Launch the absl app (used by the `bin/train_task_model` launcher)."""
  cli.launch("train_task_model", main)


if __name__ == "__main__":
  entry()
