"""Flags of `bin/train`, generated from the settings they set.

Each `TrainConfig` field (`decompax.recipe.config`) is a flag of its name,
type, default, help text and choices (a seed's domain makes it a seed
flag); this module writes none of them again. Beside them it defines what only the command line has: the W&B sink
and the scale-out flags. Library code never reads FLAGS:
`config_from_flags` turns them into a `TrainConfig` at the top of `main`
and checks it as every caller's config is checked (each setting's domain
as the config is built, then `recipe.checks.check`);
a value a library config refuses is refused when the run is assembled,
naming its flag (`recipe.config.setting`).
"""

import dataclasses
import types
import typing

from absl import flags

from decompax.bin import cli, placement_flags
from decompax.recipe import checks
from decompax.recipe import config as config_lib
from decompax.recipe.config import TrainConfig


class _NumbersListParser(flags.ListParser):
  """Comma-separated list parser whose numbers must be finite: each entry,
  or with `keyed` the weight of each `kind:weight` entry
  (`config.check_numbers`)."""

  def __init__(self, keyed: bool = False) -> None:
    super().__init__()
    self.keyed = keyed

  def parse(self, argument: str | list[str]) -> list[str]:
    items = super().parse(argument)
    config_lib.check_numbers(items, self.keyed)
    return items


def _flag_default(default: typing.Any) -> typing.Any:
  """Return a field's default as its flag holds it: lists of strings."""
  if isinstance(default, tuple):
    return [str(v) for v in default]
  return default


def _define(field: dataclasses.Field, kind: typing.Any) -> None:
  """Define the flag of one `TrainConfig` field, as a flag of this module."""
  doc = config_lib.doc(field)
  name, default = field.name, _flag_default(field.default)
  fv = {"module_name": __name__}
  if typing.get_origin(kind) in (typing.Union, types.UnionType):
    kind = next(a for a in typing.get_args(kind) if a is not type(None))
  if doc.numbers:
    flags.DEFINE(_NumbersListParser(doc.numbers == "keyed"), name, default,
                 doc.help, serializer=flags.CsvListSerializer(","), **fv)
  elif typing.get_origin(kind) is tuple:
    flags.DEFINE_list(name, default, doc.help, **fv)
  elif doc.choices is not None:
    flags.DEFINE_enum(name, default, list(doc.choices), doc.help, **fv)
  elif kind is bool:
    flags.DEFINE_bool(name, default, doc.help, **fv)
  elif doc.domain == config_lib.SEED:
    cli.define_seed(name, default, doc.help, __name__)
  elif kind is int:
    flags.DEFINE_integer(name, default, doc.help, **fv)
  elif kind is float:
    # Every float flag of bin/train refuses NaN and infinity.
    cli.define_float(name, default, doc.help, module_name=__name__)
  elif kind is str:
    flags.DEFINE_string(name, default, doc.help, **fv)
  else:
    raise TypeError(f"setting {name} has type {kind}, which no flag takes")


def _define_settings() -> None:
  kinds = typing.get_type_hints(TrainConfig)
  for field in dataclasses.fields(TrainConfig):
    _define(field, kinds[field.name])


_define_settings()
_WANDB_PROJECT = flags.DEFINE_string(
  "wandb_project", "", "Also log the run to this Weights & Biases project: "
  "the metrics.jsonl scalars, the settings and the final figures "
  "(WANDB_MODE=offline writes them under the run directory; needs the "
  "decompax[wandb] extra). Empty: no W&B.")
# Scale-out (read by bin/placement_setup.py into its own config; SPEC §8):
# defined here, as this module's flags, so that a run's flags.txt records
# them; bin/harvest defines the same flags for itself.
placement_flags.define(__name__)


def help_groups() -> cli.HelpGroups:
  """Return bin/train's flags by topic for `--helpfull`: the settings'
  topics (`recipe.config.TOPICS`), then what only the command line has."""
  return (*config_lib.TOPICS,
          ("Scale-out (how this launch runs, not part of the run)",
           placement_flags.NAMES),
          ("Logging elsewhere", ("wandb_project",)))


def _parse_widths(values: list[str]) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError:
    raise ValueError(
      f"--ci_hidden must be comma-separated integers, got {','.join(values)}"
    ) from None


def config_from_flags() -> TrainConfig:
  """Return the checked config of the parsed flags."""
  values = {}
  for field in dataclasses.fields(TrainConfig):
    value = flags.FLAGS[field.name].value
    values[field.name] = tuple(value) if isinstance(value, list) else value
  values["ci_hidden"] = _parse_widths(list(values["ci_hidden"]))
  config = TrainConfig(**values)
  checks.check(config)
  return config


def parse_config(*args: str) -> TrainConfig:
  """Return the checked config of `bin/train` arguments (flagfiles
  included) without leaving them parsed: FLAGS are back at their defaults
  after, so one process can build several runs."""
  flags.FLAGS.unparse_flags()
  try:
    argv = flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)
    flags.FLAGS(["train", *argv])
    return config_from_flags()
  finally:
    flags.FLAGS.unparse_flags()
    flags.FLAGS.mark_as_parsed()
