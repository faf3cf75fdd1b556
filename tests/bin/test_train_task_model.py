"""bin/train_task_model: its refusals and (slow) a trained model written
as a Hugging Face directory that `--target=hf` reads."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from decompax.io import hf_checkpoint
from decompax.recipe import flagfiles
from decompax.recipe import lm
from decompax.targets import arithmetic

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args):
  return subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train_task_model"), *args],
    cwd=ROOT, capture_output=True, text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_refuses_an_existing_directory_and_a_file(tmp_path):
  existing = tmp_path / "model"
  existing.mkdir()
  (existing / "keep.txt").write_text("mine")
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for path, why in ((existing, "exists and is not empty; pass --overwrite"),
                    (a_file, "is a file")):
    done = _run(f"--output_dir={path}")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
      "train_task_model: error: --output_dir"), done.stderr
    assert why in lines[0]
    assert "[task] training" not in done.stdout
  assert (existing / "keep.txt").read_text() == "mine"
  assert sorted(os.listdir(tmp_path)) == ["file", "model"]


@pytest.mark.slow
def test_trains_and_writes_a_model_directory(tmp_path):
  out = tmp_path / "addsub"
  out.mkdir()
  (out / "stale.txt").write_text("old")
  done = _run(f"--output_dir={out}", "--overwrite")
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert sorted(os.listdir(out)) == [
    "config.json", "model.safetensors", "task.json", "tokenizer.json",
    "tokenizer_config.json"]
  assert sorted(os.listdir(tmp_path)) == ["addsub"]
  config = arithmetic.ArithmeticConfig()
  task = json.loads((out / "task.json").read_text())
  assert task["answer_accuracy"] >= config.min_answer_accuracy
  assert task["induction_accuracy"] >= config.min_induction_accuracy
  tokenizer = hf_checkpoint.read_tokenizer(str(out))
  prompts = ["3 + 4 =", "5 - 9 =", "22 + 22 ="]
  tokens = jax.numpy.asarray(
    [tokenizer(p)["input_ids"] for p in prompts], jax.numpy.int32)
  run = flagfiles.read_args(["--target=hf", f"--model_dir={out}",
                              "--compute_dtype=float32", "--seq_len=4"])
  _, fns, load = lm.hf_target(run)
  logits = fns.clean_forward(load(), tokens, ())[0]
  predicted = np.argmax(np.asarray(logits[:, -1]), axis=-1)
  assert [tokenizer.decode([int(t)]) for t in predicted] == ["7", "19", "21"]
