"""`./dev`: a verb for every launcher in bin/, help that succeeds, and a
one-line refusal of a verb it does not know."""

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


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
def helpfull() -> dict[str, subprocess.CompletedProcess]:
  """Run `./dev <launcher> --helpfull` for every launcher, in parallel."""
  running = {name: subprocess.Popen(
    [str(ROOT / "dev"), name, "--helpfull"], cwd=ROOT, env=ENV, text=True,
    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in _launchers()}
  done = {}
  for name, process in running.items():
    stdout, stderr = process.communicate(timeout=600)
    done[name] = subprocess.CompletedProcess(process.args, process.returncode,
                                             stdout, stderr)
  return done


@pytest.mark.parametrize("launcher", _launchers())
def test_every_verb_runs_its_binary_and_helpfull_succeeds(helpfull, launcher):
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


def test_train_without_a_flagfile_runs_the_shipped_tms_recipe():
  """`./dev train` alone is flags/tms_5-2.flags, restarts included: a
  schedule too short for its selection step is refused by that."""
  done = _dev("train", "--num_steps=100", "--output_dir=/nonexistent/run")
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.splitlines() == [
    "train: error: --restarts=3 needs --select_at in (0, --num_steps=100), "
    "the step at which the candidates are compared; for one run, set "
    "--restarts=1 --select_at=0"]


def test_train_with_a_flagfile_reads_only_that_one():
  # Restarts are not inherited: here --select_at has nothing to compare.
  done = _dev("train", "--flagfile=flags/resid_mlp1.flags", "--select_at=100",
              "--output_dir=/nonexistent/run")
  assert done.returncode == 2, done.stderr[-2000:]
  assert "--select_at=100 compares restart candidates" in done.stderr


@pytest.mark.parametrize("name", ["nope", "hlo_flops", "__init__"])
def test_a_name_that_is_no_benchmark_is_one_line_listing_them(name):
  done = _dev("bench", name)
  assert done.returncode == 2
  (line,) = done.stderr.splitlines()
  assert line.startswith(f"dev: error: no benchmark '{name}'; known: ")
  known = line.split("known: ")[1].split()
  assert "step_time" in known and "hlo_flops" not in known
