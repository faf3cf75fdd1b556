"""One array on disk: a sharded array written shard by shard and read back
into another sharding, read at a larger shape with zeros past what was
stored, and a missing shard file refused."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from decompax.io import tensor_store

VALUES = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def _sharding(spec):
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
  return NamedSharding(mesh, PartitionSpec(*spec))


def _write(path):
  array = jax.device_put(VALUES, _sharding(("x", "y")))
  assert tensor_store.shard_shape_of(array) == (4, 3)
  ctx = tensor_store.context()
  store = tensor_store.created(tensor_store.start_create(
    path, array.shape, array.dtype, (4, 3), ctx), path)
  tensor_store.wait(tensor_store.start_write(store, array))


def _read(path, sharding, **options):
  ctx = tensor_store.context()
  store = tensor_store.opened(tensor_store.start_open(path, ctx), path)
  return tensor_store.finish_read(tensor_store.start_read(
    store, sharding, **options))


def test_an_array_reads_back_into_another_sharding(tmp_path):
  path = str(tmp_path / "a")
  _write(path)
  back = _read(path, _sharding(("y", None)))
  np.testing.assert_array_equal(back, VALUES)
  assert back.sharding.spec == PartitionSpec("y", None)


def test_a_larger_read_is_zero_past_the_stored_block(tmp_path):
  path = str(tmp_path / "a")
  _write(path)
  back = np.asarray(_read(path, _sharding((None, None)), shape=(10, 6),
                          real=(8, 6)))
  np.testing.assert_array_equal(back[:8], VALUES)
  np.testing.assert_array_equal(back[8:], 0)


def test_a_missing_shard_file_is_refused(tmp_path):
  path = str(tmp_path / "a")
  _write(path)
  chunks = [os.path.join(d, f) for d, _, files in os.walk(path)
            for f in files if f != "zarr.json"]
  os.remove(chunks[0])
  with pytest.raises(tensor_store.StoreError, match="is missing"):
    _read(path, _sharding((None, None)))


def test_inner_chunks_halve_the_widest_even_axis_until_small():
  assert tensor_store.inner_chunk_shape((4, 3), 4) == (4, 3)
  big = tensor_store.inner_chunk_shape((4096, 4096), 4)
  assert np.prod(big) * 4 <= tensor_store.INNER_CHUNK_BYTES
  assert 4096 % big[0] == 0 and 4096 % big[1] == 0
