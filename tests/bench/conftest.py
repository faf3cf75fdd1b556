"""Fixtures shared by the bench tests."""

import importlib

import pytest


@pytest.fixture(scope="session")
def load_bench():
  """Return a loader of `bench.<name>` (each defines its absl flags at
  import, so every test shares the one module `bench` itself imports)."""
  return lambda name: importlib.import_module(f"bench.{name}")
