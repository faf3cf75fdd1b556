"""One seed flag type for every binary (`cli.define_seed`): a seed a JAX key
cannot hold is refused when the flags are parsed, on one line naming the
flag, instead of an OverflowError from deep in the run."""

import ast
import dataclasses
import pathlib

import pytest
from absl import flags

from decompax.bin import cli
from decompax.bin import train_flags  # noqa: F401 (bin/train's flags)
from decompax.recipe import config as config_lib

BIN = pathlib.Path(__file__).resolve().parents[2] / "bin"


@pytest.mark.parametrize("text", ["0", "4294967295", "17"])
def test_a_seed_in_range_is_kept(text):
  assert cli.SeedParser().parse(text) == int(text)


@pytest.mark.parametrize("text", ["4294967296", "-1", str(2**70)])
def test_a_seed_a_key_cannot_hold_is_refused(text):
  with pytest.raises(ValueError, match=r"must lie in \[0, 2\*\*32\)"):
    cli.SeedParser().parse(text)


def test_the_seed_limit_is_the_library_s():
  assert cli.SEED_LIMIT == config_lib.SEED_LIMIT


def test_bin_train_s_seeds_are_seed_flags():
  """Every setting whose domain is a seed's, and only those, is a seed
  flag; each is named so."""
  seeds = [f.name for f in dataclasses.fields(config_lib.TrainConfig)
           if config_lib.doc(f).domain == config_lib.SEED]
  assert set(seeds) == {"seed", "target_seed", "eval_seed"}
  for name in seeds:
    assert isinstance(flags.FLAGS[name].parser, cli.SeedParser), name


def _seed_definitions(path: pathlib.Path) -> list[tuple[str, str]]:
  """Return (flag name, defining function) of each flag named `*seed` that
  `path` defines."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not (isinstance(node, ast.Call) and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.endswith("seed")):
      continue
    function = ast.unparse(node.func)
    if "DEFINE" in function or function.endswith("define_seed"):
      found.append((node.args[0].value, function))
  return found


def test_every_binary_defines_its_seeds_with_the_seed_flag_type():
  found = {path.name: _seed_definitions(path) for path in BIN.glob("*.py")}
  assert {name for name, defs in found.items() if defs} >= {
    "train_lm.py", "harvest.py", "match.py", "cluster.py",
    "train_task_model.py"}
  other = [(name, d) for name, defs in found.items() for d in defs
           if d[1] != "cli.define_seed"]
  assert other == []


def test_a_float_flag_keeps_its_bounds():
  parser = cli.FiniteFloatParser(0.0)
  assert parser.parse("0") == 0.0
  for text in ("-1", "nan", "inf"):
    with pytest.raises(ValueError):
      parser.parse(text)
