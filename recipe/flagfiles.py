"""Reading a recipe without absl: `read_args`.

A recipe is a flagfile: one `--name=value` per line, `#` comments.
`read_args` turns flagfiles and overrides into a `TrainConfig` for the
benchmarks and any library caller, as `bin/train` parses the same text
with the flags it generates from the same declarations
(`recipe.config`). The config checks each setting against its domain as
it is built; `read_args` then runs `recipe.checks.check`, the rules that
join settings, so a library caller is refused what `bin/train` refuses.
"""

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterator, Sequence

from decompax.recipe import checks
from decompax.recipe.config import DEFAULTS, TrainConfig

_TRUE, _FALSE = ("true", "t", "1"), ("false", "f", "0")


@functools.cache
def _types() -> dict[str, typing.Any]:
  return typing.get_type_hints(TrainConfig)


def _flagfile_args(path: str) -> list[str]:
  with open(path) as f:
    lines = [line.strip() for line in f]
  return [line for line in lines
          if line and not line.startswith(("#", "//"))]


def _expand(args: Sequence[str], depth: int = 0) -> Iterator[str]:
  """Yield `args` with each `--flagfile=PATH` replaced by PATH's lines."""
  if depth > 20:
    raise ValueError("flagfiles nest more than 20 deep")
  for arg in args:
    name, sep, value = arg.removeprefix("--").partition("=")
    if arg.startswith("--") and name == "flagfile" and sep:
      yield from _expand(_flagfile_args(value), depth + 1)
    else:
      yield arg


def _convert(kind: typing.Any, text: str) -> typing.Any:
  """Return `text` as a value of the field type `kind`; an empty value of
  an optional field is None, as a run's `flags.txt` writes unset ones."""
  if typing.get_origin(kind) in (typing.Union, types.UnionType):
    if text == "" and type(None) in typing.get_args(kind):
      return None
    kind = next(a for a in typing.get_args(kind) if a is not type(None))
  if typing.get_origin(kind) is tuple:
    item = typing.get_args(kind)[0]
    return tuple(_convert(item, p.strip()) for p in text.split(",")
                 if p.strip())
  if kind is bool:
    if text.lower() not in _TRUE + _FALSE:
      raise ValueError(f"{text!r} is not a boolean")
    return text.lower() in _TRUE
  value = kind(text)
  if kind is float and not math.isfinite(value):
    raise ValueError(f"{text!r} is not a finite number")
  return value


def _read_arg(arg: str) -> tuple[str, typing.Any]:
  """Return the field and value one `--name=value` argument sets (its
  domain is checked with the config it joins)."""
  name, sep, text = arg.removeprefix("--").partition("=")
  fields = _types()
  if not sep and name.startswith("no") and fields.get(name[2:]) is bool:
    return name[2:], False
  if not arg.startswith("--") or name not in fields:
    raise ValueError(f"{arg!r} sets no setting of a run")
  if not sep:
    if fields[name] is not bool:
      raise ValueError(f"{arg!r} needs a value, --{name}=value")
    return name, True
  try:
    return name, _convert(fields[name], text)
  except ValueError as e:
    raise ValueError(f"{arg!r}: {e}") from None


def read_args(args: Sequence[str],
              config: TrainConfig = DEFAULTS) -> TrainConfig:
  """Return `config` with the settings of `--name=value` arguments.

  `--flagfile=PATH` stands for PATH's lines (nested flagfiles too, paths
  relative to the working directory); later settings override earlier
  ones, as on `bin/train`'s command line. Raises ValueError naming an
  argument that sets no field or whose value does not convert, or the
  first setting of the result outside its domain or that
  `recipe.checks.check` refuses.
  """
  read = dataclasses.replace(config, **dict(map(_read_arg, _expand(args))))
  checks.check(read)
  return read
