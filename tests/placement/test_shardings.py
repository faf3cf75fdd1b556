"""placement/shardings.sharded_init: a state is born in its shards."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from decompax.placement import shardings


def _mesh():
  return jax.make_mesh((2, 4), ("replicate", "fsdp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_each_leaf_is_built_straight_into_its_sharding():
  mesh = _mesh()
  traced = []

  def init(x):
    traced.append(isinstance(x, jax.core.Tracer))
    return {"moments": jnp.zeros((8, 4)) + x, "count": jnp.zeros((), jnp.int32)}

  want = {"moments": NamedSharding(mesh, P("fsdp", None)),
          "count": NamedSharding(mesh, P())}
  state = shardings.sharded_init(init, want)(jnp.ones(4))
  assert traced == [True]  # compiled with its out_shardings, not run eagerly
  for name, sharding in want.items():
    assert state[name].sharding.is_equivalent_to(sharding, state[name].ndim)
  assert state["moments"].sharding.shard_shape((8, 4)) == (2, 4)
  np.testing.assert_array_equal(state["moments"], np.ones((8, 4)))


def test_without_shardings_the_init_is_returned_as_it_is():
  def init(x):
    return x

  assert shardings.sharded_init(init) is init
  assert shardings.sharded_init(init, None) is init
