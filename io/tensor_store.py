"""One array on disk: a zarr v3 array written and read through tensorstore.

The zarr chunk grid is the array's device shard shape, so every shard file has
exactly one writer: each process writes the shards it holds (replica 0 of
each), and nothing is gathered to one host. Inside a shard file the
`sharding_indexed` codec splits the data into inner chunks of at most
`INNER_CHUNK_BYTES`, so a restore onto another layout reads only the inner
chunks it needs. Inner chunks and the shard index carry crc32c checksums, and
chunks equal to the fill value are stored too, so a truncated, flipped or
missing file is an error on read, never silent zeros.

Every failure surfaces as `StoreError` with one line of text.
"""

import math
import os
from collections.abc import Sequence
from typing import NamedTuple

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 & co. as numpy dtypes)
import numpy as np
import tensorstore as ts

INNER_CHUNK_BYTES = 16 << 20
_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}

Index = tuple[slice, ...]


class StoreError(Exception):
  """A stored array is missing, damaged, or not what its manifest says."""


def _one_line(error: BaseException) -> str:
  # tensorstore appends the whole JSON spec in brackets; the cause comes first.
  text = " ".join(str(error).split())
  return text.split(" [tensorstore_spec=")[0] or type(error).__name__


def inner_chunk_shape(
  shard_shape: Sequence[int], itemsize: int
) -> tuple[int, ...]:
  """Return an inner chunk that tiles `shard_shape`, at most ~16 MiB if it can.

  Halves the largest even dimension until the chunk is small enough.
  """
  inner = [max(1, d) for d in shard_shape]
  while math.prod(inner) * itemsize > INNER_CHUNK_BYTES:
    even = [i for i, d in enumerate(inner) if d % 2 == 0]
    if not even:
      break
    widest = max(even, key=lambda i: inner[i])
    inner[widest] //= 2
  return tuple(inner)


def _spec(path: str, shape, dtype: np.dtype, shard_shape) -> dict:
  shard_shape = [max(1, d) for d in shard_shape]
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path},
    "metadata": {
      "shape": list(shape),
      "data_type": np.dtype(dtype).name,
      "chunk_grid": {"name": "regular",
                     "configuration": {"chunk_shape": shard_shape}},
      "chunk_key_encoding": {"name": "default"},
      "codecs": [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(inner_chunk_shape(
          shard_shape, np.dtype(dtype).itemsize)),
        "codecs": [_BYTES, _CRC],
        "index_codecs": [_BYTES, _CRC],
        "index_location": "end",
      }}],
    },
    "store_data_equal_to_fill_value": True,
  }


def shard_shape_of(array) -> tuple[int, ...]:
  """Return the shape of one device shard of `array` (whole for host arrays)."""
  if isinstance(array, jax.Array):
    return tuple(array.sharding.shard_shape(array.shape))
  return tuple(np.shape(array))


def context() -> ts.Context:
  """Return a fresh context: one cache and thread pool for a batch of arrays."""
  return ts.Context()


def _result(future, what: str):
  try:
    return future.result()
  except ValueError as e:
    raise StoreError(f"{what}{_one_line(e)}") from e


def start_create(path: str, shape, dtype, shard_shape, ctx: ts.Context):
  """Start creating an empty array at `path` (which must not exist)."""
  return ts.open(_spec(path, shape, dtype, shard_shape), create=True,
                 context=ctx)


def created(future, path: str) -> ts.TensorStore:
  """Return the array whose creation `future` started."""
  return _result(future, f"cannot create {path}: ")


def start_open(path: str, ctx: ts.Context, shape=None, dtype=None):
  """Start opening the array at `path`, constrained to `shape` and `dtype`."""
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
  constraints = {}
  if dtype is not None:
    constraints["dtype"] = ts.dtype(np.dtype(dtype).name)
  if shape is not None:
    constraints["shape"] = list(shape)
  return ts.open(spec, open=True, context=ctx, **constraints)


def opened(future, path: str, complete: bool = True) -> ts.TensorStore:
  """Return the array `future` opened, with every shard file present unless
  not `complete` (an array another process just created, to write into).

  Raises StoreError when its metadata disagrees with the requested shape or
  dtype, or a shard file is missing.
  """
  store = _result(future, "")
  if not complete:
    return store
  # A rank-0 array reports no chunk shape.
  shard_shape = tuple(store.chunk_layout.write_chunk.shape or ())
  for key in _expected_chunk_keys(tuple(store.shape), shard_shape):
    if not os.path.isfile(os.path.join(path, *key.split("/"))):
      raise StoreError(f"shard file {key} is missing")
  return store


def start_write(store: ts.TensorStore, array) -> list:
  """Start writing the locally owned shards of `array`; return the futures.

  A jax.Array contributes each addressable shard whose replica id is 0, so
  replicated data is written once; a host array is written whole (by the
  caller on the primary process only).
  """
  if not isinstance(array, jax.Array):
    return [store.write(np.asarray(array))]
  owned = [s for s in array.addressable_shards if s.replica_id == 0]
  hosts = jax.device_get([s.data for s in owned])
  return [store[s.index].write(host) for s, host in zip(owned, hosts)]


def wait(futures: list) -> None:
  """Wait until every write is durable; StoreError on the first failure."""
  for future in futures:
    _result(future, "")


def wait_value(future):
  """Return the value of a read `future`; StoreError when it failed."""
  return _result(future, "")


def _expected_chunk_keys(shape, shard_shape) -> list[str]:
  if not shape:
    return ["c"]
  grid = [math.ceil(n / max(1, d)) for n, d in zip(shape, shard_shape)]
  return ["/".join(["c", *map(str, cell)]) for cell in np.ndindex(*grid)]


def _normalize(index: Index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class PendingRead(NamedTuple):
  """Reads in flight for one array: host buffers and device regions."""

  shape: tuple[int, ...]
  sharding: jax.sharding.Sharding
  regions: dict
  buffers: dict
  futures: dict
  partial: dict = {}


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  # 64-byte alignment lets a CPU device adopt the buffer without a copy.
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def start_read(store: ts.TensorStore, sharding: jax.sharding.Sharding,
               shape: tuple[int, ...] | None = None,
               real: tuple[int, ...] | None = None) -> PendingRead:
  """Start reading each distinct region the addressable devices hold.

  Only those regions are read, each once (replicas share one read), each
  straight into the host buffer that its devices will take. With `shape`
  (default the store's) and `real` (default all of it), the array read has
  `shape`: its leading `real` block comes from the store, the rest is zero
  (pad slots held at another size than they were written with).
  """
  shape = tuple(store.shape) if shape is None else tuple(shape)
  real = shape if real is None else tuple(real)
  dtype = np.dtype(store.dtype.numpy_dtype)
  regions, buffers, futures, partial = {}, {}, {}, {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = _normalize(index, shape)
    regions[device] = key
    if key in buffers:
      continue
    buffers[key] = _aligned_empty(tuple(b - a for a, b in key), dtype)
    stored = tuple((a, min(b, r)) for (a, b), r in zip(key, real))
    if stored == key:
      futures[key] = ts.array(buffers[key]).write(
        store[tuple(slice(a, b) for a, b in key)])
      continue
    # Part (or none) of the region is stored: read that part apart, and
    # copy it into the zeroed region once it has landed.
    buffers[key].fill(0)
    if all(a < b for a, b in stored):
      part = _aligned_empty(tuple(b - a for a, b in stored), dtype)
      futures[key] = ts.array(part).write(
        store[tuple(slice(a, b) for a, b in stored)])
      partial[key] = part
  return PendingRead(shape, sharding, regions, buffers, futures, partial)


def finish_read(pending: PendingRead) -> jax.Array:
  """Return the array of `pending`, placed with its sharding."""
  for future in pending.futures.values():
    _result(future, "")
  for key, part in pending.partial.items():
    pending.buffers[key][tuple(slice(0, n) for n in part.shape)] = part
  arrays = [jax.device_put(pending.buffers[key], device, may_alias=True)
            for device, key in pending.regions.items()]
  return jax.make_array_from_single_device_arrays(
    pending.shape, pending.sharding, arrays)
