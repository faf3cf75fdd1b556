"""Short finished runs of `bin/train`, trained once per test process."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHORT = ("--num_steps=4", "--log_every=2", "--eval_every=0",
         "--slow_eval_every=0", "--save_every=4",
         "--faithfulness_warmup_steps=0")
RECIPES = {
  "tms": ("--target=tms_5-2", "--c=6", "--batch_size=16",
          "--use_delta_component"),
  "induction": (f"--flagfile={ROOT / 'flags' / 'induction.flags'}", "--c=8",
                "--batch_size=4"),
}


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
  """Return `path(name)`: the directory of a 4-step run of `RECIPES[name]`
  (a TMS 5-2 toy, or the induction toy's token model)."""
  paths = {}

  def path(name: str) -> str:
    if name not in paths:
      output = tmp_path_factory.mktemp("runs") / name
      done = subprocess.run(
        [sys.executable, "-P", str(ROOT / "bin" / "train"), *RECIPES[name],
         *SHORT, f"--output_dir={output}"], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
      assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
      paths[name] = str(output)
    return paths[name]

  return path
