"""A compiled program that cannot fit is refused before it runs
(`bin/device_memory`)."""

import jax
import jax.numpy as jnp
import pytest

from decompax.bin import device_memory


@pytest.fixture(scope="module")
def big():
  # A 40 GB temporary, compiled from shapes alone: never allocated.
  fn = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x)
  return fn.lower(jax.ShapeDtypeStruct((100_000, 1000), jnp.float32)
                  ).compile()


def test_the_need_counts_temporaries_and_outputs(big):
  assert device_memory.need_bytes(big) == 100_000**2 * 4 + 100_000 * 1000 * 4


def test_a_program_larger_than_the_free_memory_is_refused(big, monkeypatch):
  monkeypatch.setattr(device_memory, "device_free_bytes",
                      lambda device: (8 << 30, 1))
  with pytest.raises(device_memory.DoesNotFit, match=(
      r"the step needs 37.6 GiB of memory beyond the state it holds, and "
      r"the host has 8.0 GiB free; lower --batch_size")):
    device_memory.check_fits(big, "the step", "lower --batch_size")


def test_devices_sharing_the_host_multiply_the_need(big, monkeypatch):
  need = device_memory.need_bytes(big)
  monkeypatch.setattr(device_memory, "device_free_bytes",
                      lambda device: (int(need * 1.5), 2))
  with pytest.raises(device_memory.DoesNotFit, match="needs 75.3 GiB"):
    device_memory.check_fits(big, "the step", "fix")


def test_what_fits_or_is_unknown_passes(big, monkeypatch):
  small = jax.jit(lambda x: x * 2).lower(
    jax.ShapeDtypeStruct((4,), jnp.float32)).compile()
  device_memory.check_fits(small, "the step", "fix")
  monkeypatch.setattr(device_memory, "device_free_bytes",
                      lambda device: (None, 1))
  device_memory.check_fits(big, "the step", "fix")


def test_the_host_reports_some_free_memory():
  free = device_memory.host_free_bytes()
  assert free is None or free > 0
