"""Benchmarks over the library: `./dev bench <name>` runs `bench.<name>`.

A package of the repository, not of the distribution (the wheel ships the
library and `bin`): `./dev bench` and the tests put the repository's root
on the import path. Benchmarks import the library and each other, never
`bin`.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
