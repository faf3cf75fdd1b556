"""`./dev`: a verb for every launcher in bin/, help that succeeds, and a
one-line refusal of a verb it does not know.

What each verb runs is read off a copy of `./dev` whose environment's
python prints its arguments (`echo_dev`); the binaries' own `--helpfull`
runs in children forked from one warm process
(`tests/bin/run_binaries.py`), which pays the start-up of JAX once instead
of once per binary; `./dev run` starts the real environment.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
RUN_BINARIES = ROOT / "tests" / "bin" / "run_binaries.py"


def _launchers() -> list[str]:
  """Return the names of bin/'s launchers: its executable files without a
  suffix (each runs one binary's `entry()`)."""
  return sorted(p.name for p in (ROOT / "bin").iterdir()
                if p.is_file() and not p.suffix and os.access(p, os.X_OK))


def _dev(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  return subprocess.run([str(ROOT / "dev"), *args], cwd=ROOT, env=ENV,
                        capture_output=True, text=True, timeout=timeout)


def _listed_verbs(usage: str) -> set[str]:
  return set(re.findall(r"^  \./dev ([a-z_-]+)", usage, re.MULTILINE))


def test_bin_has_the_known_launchers():
  # Guards the discovery itself: an empty list would pass every test below.
  assert {"train", "report", "harvest", "browse", "tokenize",
          "tensorboard"} <= set(_launchers())


def test_dev_help_lists_a_verb_for_every_launcher():
  done = _dev("help")
  assert done.returncode == 0, done.stderr
  missing = set(_launchers()) - _listed_verbs(done.stdout)
  assert not missing, f"./dev help lists no verb for bin/{sorted(missing)}"


@pytest.fixture(scope="module")
def echo_dev(tmp_path_factory) -> pathlib.Path:
  """Return a copy of `./dev` in a directory of its own whose `.venv` is
  current (its stamp is what `bootstrap` compares) and whose python prints
  each argument it is given on a line of its own and exits 0."""
  home = tmp_path_factory.mktemp("echo_dev")
  for name in ("dev", "uv.lock", "pyproject.toml"):
    shutil.copy2(ROOT / name, home / name)
  options = re.search(r'^SYNC_OPTIONS="([^"]*)"$',
                      (ROOT / "dev").read_text(), re.MULTILINE).group(1)
  (home / ".venv" / "bin").mkdir(parents=True)
  (home / ".venv" / ".decompax-lock").write_bytes(
    (ROOT / "uv.lock").read_bytes() + (ROOT / "pyproject.toml").read_bytes()
    + f"{options}\n".encode())
  python = home / ".venv" / "bin" / "python"
  python.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
  python.chmod(0o755)
  return home / "dev"


def _echoed(echo_dev: pathlib.Path, *args: str) -> list[str]:
  """Return the arguments `./dev <args>` hands the environment's python."""
  done = subprocess.run([str(echo_dev), *args], cwd=echo_dev.parent,
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0 and done.stderr == "", done.stderr
  return done.stdout.splitlines()


@pytest.mark.parametrize("launcher", _launchers())
def test_every_verb_runs_its_launcher_with_the_flags_given(echo_dev,
                                                          launcher):
  got = _echoed(echo_dev, launcher, "--helpfull", "--x=a b")
  # `./dev train` alone adds the shipped recipe first (the tests below).
  recipe = ["--flagfile=flags/tms_5-2.flags"] if launcher == "train" else []
  assert got == ["-P", f"bin/{launcher}", *recipe, "--helpfull", "--x=a b"]


def test_train_without_a_flagfile_runs_the_shipped_tms_recipe(echo_dev):
  """`./dev train` alone is flags/tms_5-2.flags (restarts included), its
  flags after it so that they override it."""
  assert _echoed(echo_dev, "train", "--num_steps=100") == [
    "-P", "bin/train", "--flagfile=flags/tms_5-2.flags", "--num_steps=100"]


@pytest.mark.parametrize("flagfile", ["--flagfile=flags/resid_mlp1.flags",
                                      "--flagfile", "-flagfile=x.flags"])
def test_train_with_a_flagfile_reads_only_that_one(echo_dev, flagfile):
  assert _echoed(echo_dev, "train", flagfile, "--select_at=100") == [
    "-P", "bin/train", flagfile, "--select_at=100"]


@pytest.fixture(scope="module")
def helpfull(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
  """Run every launcher with `--helpfull`, each forked from one process
  that has imported the libraries."""
  out = tmp_path_factory.mktemp("helpfull")
  specs = [{"id": name, "program": name, "argv": ["--helpfull"],
            "cwd": str(ROOT), "env": {"JAX_PLATFORMS": "cpu"},
            "prelude": "", "out": str(out)} for name in _launchers()]
  runner = subprocess.run([sys.executable, "-P", str(RUN_BINARIES)],
                          input=json.dumps(specs), capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=ENV)
  assert runner.returncode == 0, runner.stderr
  codes = json.loads(runner.stdout)
  return {name: subprocess.CompletedProcess(
    [name, "--helpfull"], codes[name], (out / f"{name}.stdout").read_text(),
    (out / f"{name}.stderr").read_text()) for name in _launchers()}


@pytest.mark.parametrize("launcher", _launchers())
def test_every_binary_s_helpfull_succeeds(helpfull, launcher):
  done = helpfull[launcher]
  assert done.returncode == 0, done.stderr[-2000:]
  assert "Traceback" not in done.stderr
  # The binary's own flags come first, before absl's, and the help's own
  # entry is there; bin/train's are under their topics.
  listed = done.stdout.split("flags:\n\n", 1)[1]
  assert not listed.startswith("absl") and "\n  --" in listed[:400]
  assert listed.index("\n  --") < listed.index("absl.app:\n")
  assert "--helpfull" in done.stdout
  if launcher == "train":
    assert (done.stdout.index("Target and data:\n  --")
            < done.stdout.index("absl.app:\n"))


def test_help_succeeds_through_a_launcher_given_as_a_path():
  # `./dev run` runs a command given as a path inside the environment.
  done = _dev("run", "bin/report", "--helpfull")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "--run_dir" in done.stdout


def test_run_still_finds_names_in_the_environment():
  done = _dev("run", "python", "-c", "import sys; print(sys.prefix)")
  assert done.returncode == 0, done.stderr
  assert pathlib.Path(done.stdout.strip()) == ROOT / ".venv"


@pytest.mark.parametrize("verb, suggestion", [
  ("trian", "did you mean ./dev train?"),
  ("tokenise", "did you mean ./dev tokenize?"),
  ("frobnicate", ""),
])
def test_an_unknown_verb_is_one_line_naming_it(verb, suggestion):
  done = _dev(verb)
  assert done.returncode == 2
  assert done.stdout == ""
  lines = done.stderr.splitlines()
  assert len(lines) == 1, done.stderr
  assert lines[0].startswith(f"dev: error: unknown verb '{verb}'; ")
  assert suggestion in lines[0]
  assert ("did you mean" in lines[0]) == bool(suggestion)
  assert "./dev help lists the verbs" in lines[0]


@pytest.mark.parametrize("name", ["nope", "hlo_flops", "__init__"])
def test_a_name_that_is_no_benchmark_is_one_line_listing_them(name):
  done = _dev("bench", name)
  assert done.returncode == 2
  (line,) = done.stderr.splitlines()
  assert line.startswith(f"dev: error: no benchmark '{name}'; known: ")
  known = line.split("known: ")[1].split()
  assert "step_time" in known and "hlo_flops" not in known
