"""Fixtures shared by the bench tests."""

import importlib

import pytest

from decompax.targets import glu_config


@pytest.fixture(scope="session")
def load_bench():
  """Return a loader of `bench.<name>` (each defines its absl flags at
  import, so every test shares the one module `bench` itself imports)."""
  return lambda name: importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="session")
def tiny_lm():
  """Return the two-block Llama shape the analysis benches build at random."""
  return glu_config.GluConfig(
    n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8,
    vocab_size=16, rope_theta=500000.0, rms_eps=1e-5, tied=False,
    qk_norm=False)
