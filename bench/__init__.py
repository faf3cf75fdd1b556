"""Benchmarks over the library: `./dev bench <name>` runs `bench.<name>`.

A package of the repository, not of the distribution (the wheel ships the
library and `bin`): `./dev bench` and the tests put the repository's root
on the import path. Benchmarks import the library and each other, never
`bin`.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child_command(module: str, *args: str) -> list[str]:
  """Return the command running `bench.<module>` with `args` in a child
  Python (started with `child_environment`)."""
  return [sys.executable, "-P", "-m", f"bench.{module}", *args]


def child_environment(env: dict[str, str]) -> dict[str, str]:
  """Return `env` with the repository's root first on PYTHONPATH, where a
  child finds `bench`."""
  path = env.get("PYTHONPATH")
  return {**env, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path
                                            else "")}
