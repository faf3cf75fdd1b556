"""The mutation list of `./dev mutate` (tests/mutations.toml) still applies:
every `before` occurs once in its file, the mutated file still parses, and
every entry names a known invariant and existing tests. `./dev mutate`
itself is not part of the default suite; this keeps its list from rotting
as the code it mutates changes."""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mutate_module():
  spec = importlib.util.spec_from_file_location("mutate",
                                                ROOT / "tests" / "mutate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MUTATE = _mutate_module()
MUTATIONS = MUTATE.load()
DESIGN = (ROOT / "docs" / "design.md").read_text()


def test_the_list_is_about_thirty_mutations_with_unique_names():
  assert len(MUTATIONS) >= 25
  assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_and_still_parses(mutation):
  path = ROOT / mutation.file
  assert path.is_file(), mutation.file
  mutated = mutation.apply(path.read_text())  # refuses 0 or 2+ matches
  if path.suffix == ".py" or path.parent.name == "bin":
    ast.parse(mutated, filename=str(path))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_names_its_invariant_and_existing_tests(mutation):
  invariant = mutation.invariant
  if invariant.startswith("SPEC "):
    assert re.fullmatch(r"SPEC §[0-9.]+", invariant), invariant
  else:
    assert f"**{invariant}**" in DESIGN, invariant
  assert mutation.tests
  for test in mutation.tests:
    file, _, name = test.partition("::")
    source = (ROOT / file).read_text()
    assert file.startswith("tests/") and "/test_" in file, test
    if name:
      assert f"def {name.split('[')[0]}(" in source, test


def test_applying_refuses_a_line_that_is_gone_or_repeated():
  mutation = MUTATIONS[0]
  with pytest.raises(ValueError, match="occurs 0 times"):
    mutation.apply("nothing here\n")
  with pytest.raises(ValueError, match="occurs 2 times"):
    mutation.apply(f"{mutation.before}\n{mutation.before}\n")


def test_the_scratch_copy_is_what_its_processes_import(tmp_path):
  # The environment's editable install points `decompax.*` at this
  # checkout; a mutation applied to the copy must be the code that runs.
  work = tmp_path / "repo"
  MUTATE.scratch_copy(ROOT, work)
  assert (work / "core" / "masks.py").read_text() == (
    ROOT / "core" / "masks.py").read_text()
  env = MUTATE.environment(work, tmp_path / "cache")
  MUTATE.check_imports_from(work, env)  # exits unless all come from `work`
  (work / "core" / "marker.py").write_text("WHERE = 'scratch'\n")
  done = subprocess.run(
    [sys.executable, "-P", "-c",
     "from decompax.core import marker; print(marker.WHERE)"],
    cwd=work, env=env, capture_output=True, text=True)
  assert done.stdout.strip() == "scratch", done.stderr[-2000:]
