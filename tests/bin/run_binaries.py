"""Run many short `bin/<program>` invocations from one warm process.

Used by `test_bad_inputs.py`, `test_run_dir_contract.py`,
`test_brown_lm.py` and `tests/test_dev.py` (every binary's `--helpfull`):
importing JAX and the libraries costs seconds per process, most of a
refusal's run. This script imports them once, then forks one child per
invocation, which runs the program's launcher `bin/<program>` itself (so
its module is the one the launcher names), with its own argv, working
directory, environment and stdout/stderr files. Only modules that define
no absl flags are imported before the fork (the binaries define clashing
flag names), and no JAX backend is started in the parent, so each child
starts its own.

stdin: a JSON list of `{"id", "program", "argv", "cwd", "env", "prelude",
"out"}`; stdout: a JSON object of `id -> exit code`. `prelude` is Python
run in the child before the program (a fault to inject); `out` is where
`<id>.stdout` and `<id>.stderr` go.
"""

import importlib
import json
import os
import pathlib
import sys
import traceback

BIN = pathlib.Path(__file__).resolve().parents[2] / "bin"

PRELOADED = ("jax", "jax.numpy", "numpy", "optax", "tensorstore", "scipy",
             "matplotlib", "decompax.core.train_step", "decompax.io.checkpoint",
             "decompax.render.figures", "decompax.evals.eval_metrics",
             "decompax.targets.registry", "decompax.placement.shardings")
# transformers, with the config classes of the fixtures' model types and
# its tokenizer classes: its lazy imports cost a child about 1.5 s, and most
# language-model rows read a config. Imported as `io.hf_checkpoint` imports
# it, its advisory about torch silenced.
TRANSFORMERS = (
  "transformers", "transformers.models.auto.configuration_auto",
  "transformers.models.auto.tokenization_auto",
  *(f"transformers.models.{m}.configuration_{m}" for m in (
    "llama", "gpt2", "gemma2", "gemma3", "gpt_neox", "qwen3", "qwen3_moe")))
PARALLEL = max(os.cpu_count() or 1, 2)


def _child(row: dict) -> None:
  """Run one invocation; never returns."""
  code = 1
  try:
    os.chdir(row["cwd"])
    os.environ.update(row["env"])
    out = os.path.join(row["out"], row["id"])
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
      file = os.open(f"{out}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(file, fd)
      os.close(file)
    sys.stdin = open(os.devnull)
    exec(row.get("prelude") or "", {})
    sys.argv = [row["program"], *row["argv"]]
    launcher = BIN / row["program"]
    exec(compile(launcher.read_text(), str(launcher), "exec"),
         {"__name__": "__main__"})
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # what the real launcher would print
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
  rows = json.load(sys.stdin)
  for name in PRELOADED:
    importlib.import_module(name)
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  for name in TRANSFORMERS:
    importlib.import_module(name)
  from jax._src import xla_bridge  # noqa: PLC0415
  assert not xla_bridge._backends, "a backend started before the fork"
  codes, running = {}, {}
  pending = list(rows)
  while pending or running:
    while pending and len(running) < PARALLEL:
      row = pending.pop(0)
      sys.stdout.flush()
      pid = os.fork()
      if pid == 0:
        _child(row)
      running[pid] = row["id"]
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
  json.dump(codes, sys.stdout)


if __name__ == "__main__":
  main()
