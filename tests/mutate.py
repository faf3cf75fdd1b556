"""Does the suite catch plausible one-line bugs? (`./dev mutate`)

Each entry of `tests/mutations.toml` changes one line of the
implementation (a sign, an index, an argument, a dropped `stop_gradient`)
in a way a reviewer would call a real bug, names the invariant of
`docs/design.md` it breaks and the tests that must catch it. This script
copies the working tree (tracked and untracked files git does not ignore)
into a scratch directory, runs the named tests there once unmutated (the
baseline: they must pass), then for each mutation applies it, runs its
tests, and restores the file. A mutation is caught when its tests fail.

The environment's editable install maps `decompax.*` onto the checkout, so
the scratch copy is put ahead of it: a directory on `PYTHONPATH` holds a
`decompax` namespace whose subpackages link to the copy's folders, and the
path finder reaches it before the editable install's finder (appended last
to `sys.meta_path`). Every run first checks that `decompax` imports from
the copy. No bytecode is written, so a restored file is never read from a
stale cache; the XLA compilation cache is shared by the runs (its keys are
the programs, so a mutated program compiles anew), the trained test runs
are not.

  ./dev mutate                 every mutation
  ./dev mutate NAME...         the named ones
  ./dev mutate --list          print the list
"""

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MUTATIONS = ROOT / "tests" / "mutations.toml"
LINK_DIR = ".mutate-path"
# As `./dev test` runs the suite: LLVM's cheapest level, one process.
PYTEST = ("-m", "pytest", "-p", "no:cacheprovider", "-x", "-q",
          "--numprocesses=0")


@dataclasses.dataclass(frozen=True)
class Mutation:
  """One one-line bug: `before` (exactly once in `file`) becomes `after`;
  `tests` (pytest paths or node ids) must fail; `invariant` is what it
  breaks (an id of docs/design.md, or a SPEC section)."""

  name: str
  file: str
  before: str
  after: str
  invariant: str
  tests: tuple[str, ...]

  def apply(self, text: str) -> str:
    """Return `text` mutated; ValueError unless `before` occurs once, within
    one line."""
    count = text.count(self.before)
    if count != 1:
      raise ValueError(f"mutation {self.name}: {self.before!r} occurs "
                       f"{count} times in {self.file}, not once")
    if "\n" in self.before or "\n" in self.after:
      raise ValueError(f"mutation {self.name}: not a one-line change")
    if self.before == self.after:
      raise ValueError(f"mutation {self.name}: changes nothing")
    return text.replace(self.before, self.after)


def load(path: pathlib.Path = MUTATIONS) -> list[Mutation]:
  """Return the mutations of `path`, names unique."""
  entries = tomllib.loads(path.read_text())["mutation"]
  mutations = [Mutation(**{**e, "tests": tuple(e["tests"])}) for e in entries]
  names = [m.name for m in mutations]
  if len(set(names)) != len(names):
    raise ValueError(f"{path}: mutation names repeat")
  return mutations


def working_files(root: pathlib.Path) -> list[str]:
  """Return the working tree's files: tracked and untracked, not ignored."""
  listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=root, check=True, capture_output=True).stdout.decode()
  return [f for f in listed.split("\0") if f and (root / f).is_file()]


def scratch_copy(root: pathlib.Path, scratch: pathlib.Path) -> None:
  """Copy the working tree into `scratch` and link its packages under
  `scratch/.mutate-path/decompax`."""
  for name in working_files(root):
    target = scratch / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / name, target)
  project = tomllib.loads((root / "pyproject.toml").read_text())
  namespace = scratch / LINK_DIR / "decompax"
  namespace.mkdir(parents=True)
  for module, folder in project["tool"]["setuptools"]["package-dir"].items():
    (namespace / module.split(".")[-1]).symlink_to(scratch / folder)


def environment(scratch: pathlib.Path, cache: pathlib.Path) -> dict:
  env = {**os.environ, "PYTHONPATH": str(scratch / LINK_DIR),
         "PYTHONDONTWRITEBYTECODE": "1", "JAX_PLATFORMS": "cpu",
         "JAX_COMPILATION_CACHE_DIR": str(cache)}
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_backend_optimization_level=0").strip()
  env.pop("DECOMPAX_TEST_SHARED_RUNS", None)  # runs trained unmutated
  env.pop("PYTEST_ADDOPTS", None)
  return env


def check_imports_from(scratch: pathlib.Path, env: dict) -> None:
  """Exit unless every `decompax` package imports from the scratch copy."""
  probe = ("import importlib, tomllib\n"
           "p = tomllib.load(open('pyproject.toml', 'rb'))\n"
           "for m in p['tool']['setuptools']['packages']:\n"
           "  print(importlib.import_module(m).__file__)\n")
  done = subprocess.run([sys.executable, "-P", "-c", probe], cwd=scratch,
                        env=env, capture_output=True, text=True)
  files = done.stdout.split()
  copied = [f for f in files if f.startswith(str(scratch) + os.sep)]
  if done.returncode or not files or copied != files:
    sys.exit(f"mutate: error: the scratch copy's packages are not what "
             f"imports: {done.stdout}{done.stderr}")


def run_tests(scratch: pathlib.Path, env: dict, tests,
              timeout: float | None, log: pathlib.Path) -> str:
  """Run `tests` in the scratch copy; return passed, failed or an error."""
  with open(log, "w") as out:
    try:
      code = subprocess.run([sys.executable, "-P", *PYTEST, *tests],
                            cwd=scratch, env=env, stdout=out,
                            stderr=subprocess.STDOUT, timeout=timeout
                            ).returncode
    except subprocess.TimeoutExpired:
      return f"timed out after {timeout:.0f} s"  # never the baseline
  # pytest: 0 all passed, 1 some failed; others are usage or collection.
  return {0: "passed", 1: "failed"}.get(code, f"pytest exit {code}")


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="./dev mutate", description=(
    "apply each one-line mutation of tests/mutations.toml to a scratch "
    "copy and check its tests catch it"))
  parser.add_argument("names", nargs="*", help="mutations to run (all)")
  parser.add_argument("--list", action="store_true", help="print the list")
  parser.add_argument("--timeout", type=float, default=900.0,
                      help="seconds per mutation's test run (900)")
  parser.add_argument("--keep", action="store_true",
                      help="keep the scratch copy and its logs")
  args = parser.parse_args(argv)
  mutations = load()
  if unknown := sorted(set(args.names) - {m.name for m in mutations}):
    parser.error(f"unknown mutations {', '.join(unknown)}; "
                 "--list shows them")
  chosen = [m for m in mutations if not args.names or m.name in args.names]
  if args.list:
    for m in chosen:
      print(f"{m.name:32s} {m.invariant:8s} {m.file}: {m.before.strip()} "
            f"-> {m.after.strip()}")
    return 0
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="decompax-mutate-"))
  try:
    return run_all(chosen, scratch, args.timeout)
  finally:
    if args.keep:
      print(f"kept {scratch}")
    else:
      shutil.rmtree(scratch, ignore_errors=True)


def run_all(chosen: list[Mutation], scratch: pathlib.Path,
            timeout: float) -> int:
  work = scratch / "repo"
  scratch_copy(ROOT, work)
  for m in chosen:  # every mutation applies before anything runs
    m.apply((work / m.file).read_text())
  env = environment(work, scratch / "xla-cache")
  check_imports_from(work, env)
  logs = scratch / "logs"
  logs.mkdir()
  tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
  start = time.time()
  # Every covering test at once: as long as the suite's share of them.
  baseline = run_tests(work, env, tests, None, logs / "baseline.log")
  print(f"baseline ({len(tests)} test paths): {baseline} "
        f"[{time.time() - start:.0f} s]", flush=True)
  if baseline != "passed":
    print((logs / "baseline.log").read_text()[-3000:])
    print("mutate: error: the covering tests fail unmutated; fix them first",
          file=sys.stderr)
    return 2
  missed = []
  for m in chosen:
    path = work / m.file
    original = path.read_text()
    path.write_text(m.apply(original))
    start = time.time()
    try:
      outcome = run_tests(work, env, m.tests, timeout,
                          logs / f"{m.name}.log")
    finally:
      path.write_text(original)
    verdict = "caught" if outcome == "failed" else "MISSED"
    if verdict == "MISSED":
      missed.append(m.name)
    note = "" if outcome in ("passed", "failed") else f" ({outcome})"
    print(f"{verdict:7s} {m.name:32s} {m.invariant:8s}{note} "
          f"[{time.time() - start:.0f} s]", flush=True)
  print(f"{len(chosen) - len(missed)} of {len(chosen)} mutations caught"
        + (f"; missed: {', '.join(missed)}" if missed else ""))
  return 1 if missed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
