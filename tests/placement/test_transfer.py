"""Host <-> mesh transfers (one process here; two in test_two_process.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from decompax.placement import transfer

pytestmark = pytest.mark.multidevice


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 4), ("replicate", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_put_lays_out_and_fetch_gathers_back(mesh):
  tree = {"v": jnp.arange(24.0).reshape(8, 3), "rng": jax.random.key(3),
          "step": jnp.asarray(5, jnp.int32)}
  shardings = {"v": NamedSharding(mesh, P("fsdp")),
               "rng": NamedSharding(mesh, P()),
               "step": NamedSharding(mesh, P())}
  placed = transfer.put(tree, shardings)
  assert placed["v"].sharding.spec == P("fsdp")
  assert placed["v"].addressable_shards[0].data.shape == (2, 3)
  assert jax.random.key_impl(placed["rng"]) == jax.random.key_impl(tree["rng"])
  back = transfer.fetch(placed)
  np.testing.assert_array_equal(back["v"], np.asarray(tree["v"]))
  np.testing.assert_array_equal(jax.random.key_data(back["rng"]),
                                jax.random.key_data(tree["rng"]))
  assert int(back["step"]) == 5


def test_global_batch_from_this_process_rows(mesh):
  sharding = NamedSharding(mesh, P(("replicate", "fsdp")))
  rows = np.arange(16 * 2, dtype=np.int32).reshape(16, 2)
  batch = transfer.global_batch({"tokens": rows}, {"tokens": sharding})
  assert batch["tokens"].shape == (16, 2)
  assert batch["tokens"].sharding == sharding
  np.testing.assert_array_equal(transfer.fetch(batch)["tokens"], rows)
