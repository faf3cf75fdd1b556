"""Moving pytrees between hosts and a (possibly multi-process) mesh.

A multi-process mesh spans devices no single process can address, so host
values enter it through callbacks that each process answers for its own
devices (`put`, `global_batch`) and leave it through the replicated copy or
a collective gather (`fetch`). In one process these reduce to
`device_put`/`device_get`.
"""

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def _put_leaf(leaf, sharding):
  if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
      sharding, leaf.ndim):
    return leaf  # already placed (a restored checkpoint): no host copy
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    data = _put_leaf(jax.random.key_data(leaf), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
  host = np.asarray(jax.device_get(leaf))
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: host[index])


def put(tree: Any, shardings: Any) -> Any:
  """Return `tree` laid out by `shardings` (a matching tree).

  Every process must hold the same host values (they derive from the seed),
  and each supplies only its own devices' shards. Leaves already laid out
  by their sharding are kept as they are.
  """
  return jax.tree.map(_put_leaf, tree, shardings)


def _fetch_leaf(leaf):
  if _addressable(leaf):
    return jax.device_get(leaf)
  if leaf.is_fully_replicated:
    return jax.device_get(leaf.addressable_data(0))
  # A collective: every process must fetch the same tree.
  with jax.transfer_guard("allow"):
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def _addressable(leaf) -> bool:
  return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable


def fetch(tree: Any) -> Any:
  """Return `tree` as host values, gathering shards of other processes."""
  if all(map(_addressable, jax.tree.leaves(tree))):
    # One call starts every copy before it waits on any.
    return jax.device_get(tree)
  return jax.tree.map(_fetch_leaf, tree)


def global_batch(local: Any, shardings: Any) -> Any:
  """Return the global batch built from this process's slice of it.

  `local` holds the rows of the global batch that this process's devices
  own under `shardings` (each process reads only its slice).
  """
  return jax.tree.map(
    lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)),
    local, shardings)
