"""What every decompax binary shares: one-line errors and the absl launch."""

import sys
from collections.abc import Callable
from typing import NoReturn

from absl import app, flags


def fail(program: str, message: str) -> NoReturn:
  """Print `<program>: error: <message>` on one line and exit with 2."""
  print(f"{program}: error: {message}", file=sys.stderr)
  sys.exit(2)


def launch(program: str, main: Callable[[list[str]], None]) -> None:
  """Run `main` as an absl app whose flag errors are one-line errors."""

  def parse_flags(argv: list[str]) -> list[str]:
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      fail(program, f"{e}; see --helpfull")

  app.run(main, flags_parser=parse_flags)
