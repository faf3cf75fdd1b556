"""What every decompax binary shares: one-line errors, the exit code of a
stop signal, the absl launch and its `--helpfull` (the binary's own flags
first, grouped by topic, where it names topics)."""

import concurrent.futures
import contextlib
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from absl import app, flags

# A run stopped by SIGTERM or SIGINT exits with EX_TEMPFAIL ("try again"),
# what schedulers requeue: rerunning the same command continues it (or, with
# nothing to continue, does it again). bin/train's checkpointing exits so too.
REQUEUE_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seeds become JAX keys, which keep 32 bits: `recipe.config.SEED_LIMIT`,
# written again so that a binary's flags import no recipe.
SEED_LIMIT = 2**32


def fail(program: str, message: str, code: int = 2) -> NoReturn:
  """Print `<program>: error: <message>` on one line and exit with `code`."""
  print(f"{program}: error: {message}", file=sys.stderr)
  sys.exit(code)


# Titled groups of flag names, in the order `--helpfull` shows them.
HelpGroups = Sequence[tuple[str, Sequence[str]]]


def grouped_help(groups: HelpGroups,
                 flag_values: flags.FlagValues = flags.FLAGS) -> str:
  """Return the `--helpfull` text: each group's flags under its title,
  then every other flag under its module, as absl lists them."""
  parts, listed = [], {name for _, names in groups for name in names}
  for title, names in groups:
    group = flags.FlagValues()
    for name in names:
      group[name] = flag_values[name]
    parts.append(f"{title}:\n" + group.get_help(
      prefix="  ", include_special_flags=False))
  rest = flags.FlagValues()
  for module, defined in flag_values.flags_by_module_dict().items():
    for flag in defined:
      if flag.name not in listed and flag.name not in rest:
        rest[flag.name] = flag
        rest.register_flag_by_module(module, flag)
  parts.append(rest.get_help())
  return "\n\n".join(parts)


def project_flags(flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """Return the names of the flags decompax's own modules define, in the
  order absl lists their modules."""
  return [flag.name
          for module, defined in flag_values.flags_by_module_dict().items()
          if module.startswith("decompax.") for flag in defined]


class _GroupedHelpfull(flags.BooleanFlag):
  """absl's `--helpfull`, its text from `grouped_help`."""

  def __init__(self, program: str, groups: HelpGroups) -> None:
    super().__init__("helpfull", False, "show full help",
                     allow_hide_cpp=True)
    self.program, self.groups = program, groups

  def parse(self, argument: Any) -> None:
    if self._parse(argument):
      print(f"USAGE: {self.program} [flags]\n\nflags:\n\n"
            f"{grouped_help(self.groups)}")
      sys.exit(0)


def launch(program: str, main: Callable[[list[str]], None],
           help_groups: HelpGroups = ()) -> None:
  """Run `main` as an absl app whose flag errors are one-line errors;
  `--helpfull` lists the flags of `help_groups` first (by default, every
  flag decompax's modules define, before absl's and the libraries')."""
  help_groups = help_groups or ((program, project_flags()),)
  app.define_help_flags()  # once per process; app.run keeps these
  delattr(flags.FLAGS, "helpfull")
  flags.DEFINE_flag(_GroupedHelpfull(program, help_groups),
                    module_name="absl.app")

  def parse_flags(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.CantOpenFlagFileError as e:
      fail(program, flagfile_message(e))
    except flags.Error as e:
      fail(program, f"{e}; see --helpfull")
    except SystemExit as e:
      # absl's help flags (--help, --helpshort, --helpfull, --helpxml) print
      # what was asked for and exit 1 from inside the parse; every refusal
      # of the parse itself is a flags.Error above. Help given is success.
      sys.exit(0 if e.code == 1 else e.code)

  app.run(main, flags_parser=parse_flags)


def flagfile_message(error: flags.CantOpenFlagFileError) -> str:
  """Return why a flagfile could not be opened, without absl's `ERROR::`."""
  cause = error.__context__
  if isinstance(cause, OSError) and cause.filename is not None:
    return (f"cannot open flagfile {cause.filename}: {cause.strerror}; "
            "check the --flagfile path")
  return str(error).removeprefix("ERROR:: ")


class FiniteFloatParser(flags.FloatParser):
  """Float parser that refuses NaN and infinity (and, given bounds, values
  outside them, as `flags.FloatParser` does)."""

  def convert(self, argument: int | float | str) -> float:
    # NaN fails every comparison, so later range checks let it through;
    # refusing it here covers flagfiles and defaults alike.
    value = super().convert(argument)
    if not math.isfinite(value):
      raise ValueError("must be a finite number")
    return value


def define_float(name: str, default: float | None, help_text: str,
                 module_name: str, lower_bound: float | None = None,
                 upper_bound: float | None = None):
  """Return the holder of a float flag that refuses NaN and infinity, and
  values outside `[lower_bound, upper_bound]` where given.

  Pass the defining module's `__name__`: the flag then belongs to it, as
  with `flags.DEFINE_float`, and `get_flags_for_module` lists it.
  """
  return flags.DEFINE(FiniteFloatParser(lower_bound, upper_bound), name,
                      default, help_text,
                      serializer=flags.ArgumentSerializer(),
                      module_name=module_name)


class SeedParser(flags.IntegerParser):
  """Integer parser of a seed: a JAX key keeps 32 bits, so a seed outside
  [0, 2**32) would overflow (past 2**64) or silently name the key of one
  inside."""

  def __init__(self) -> None:
    super().__init__(0, SEED_LIMIT - 1)

  def convert(self, argument: int | str) -> int:
    value = super().convert(argument)
    if not 0 <= value < SEED_LIMIT:
      raise ValueError(f"must lie in [0, 2**32) (0..{SEED_LIMIT - 1}), the "
                       "seeds a JAX key holds")
    return value


def define_seed(name: str, default: int | None, help_text: str,
                module_name: str,
                flag_values: flags.FlagValues = flags.FLAGS):
  """Return the holder of a seed flag (`SeedParser`), the one type of every
  binary's seeds, defined on `flag_values` as a flag of `module_name`."""
  return flags.DEFINE(SeedParser(), name, default, help_text,
                      flag_values=flag_values,
                      serializer=flags.ArgumentSerializer(),
                      module_name=module_name)


@contextlib.contextmanager
def thread_map() -> Iterator[Callable[..., Iterator[Any]]]:
  """Yield the `map` of a thread pool as wide as the machine: for library
  work whose items are independent numpy (which releases the GIL), such
  as the report's bootstrap comparisons, which the library runs through
  whatever `map` it is given."""
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    yield pool.map
