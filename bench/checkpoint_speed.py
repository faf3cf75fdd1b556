"""Checkpoint save and restore throughput beside the disk's own speed.

Run: `./dev bench checkpoint_speed` (`--size_mb=1024`). Builds a decomposition
item of `--size_mb` MB (fp32 V/U of four LM-like kinds, C chosen to fit,
plus a small CI-MLP), then measures, all in this one process and in one
directory on one disk:
  * raw sequential write: one file of the same size in 16 MiB writes, fsync,
  * raw sequential read of that file with its pages evicted from the cache,
  * `checkpoint.save` of the item (device-to-host copies, zarr v3 writes,
    fsyncs, atomic commit), median of `--checkpoint_repeats`,
  * `checkpoint.restore_item` onto the device with the checkpoint's pages
    evicted first (a cold read), median of `--checkpoint_repeats`,
  * one host memory copy of the same size into a fresh buffer (a restore
    makes about three: read buffer, decoded array, device buffer),
and reports each as MB/s and as a fraction of the raw rate.
"""

import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging

from decompax.core import ci_fns, sites as sites_lib
from decompax.io import checkpoint

_SIZE_MB = flags.DEFINE_integer("size_mb", 1024, "Size of the decomposition.")
_DIR = flags.DEFINE_string(
  "dir", "runs", "Directory on the disk to measure (a temporary directory "
  "inside it is removed afterwards).")
_REPEATS = flags.DEFINE_integer("checkpoint_repeats", 3,
                                "Timed saves and restores.")

MB = 1 << 20
# (kind, layers, d_in, d_out): the matrices of a small GLU transformer.
KINDS = (("q", 4, 1024, 1024), ("o", 4, 1024, 1024),
         ("mlp_in", 4, 1024, 4096), ("mlp_out", 4, 4096, 1024))


def decomposition_sites(size_mb: int) -> tuple[sites_lib.SiteSpec, ...]:
  """Return sites whose fp32 V/U total about `size_mb` MB."""
  per_c = sum(4 * n * (d_in + d_out) for _, n, d_in, d_out in KINDS)
  c = max(1, size_mb * MB // per_c)
  return tuple(sites_lib.SiteSpec(f"{kind}.{layer}", kind, layer, d_in,
                                  d_out, c)
               for kind, n, d_in, d_out in KINDS for layer in range(n))


def build_item(sites) -> dict:
  """Return the decomposition item, materialised on the device."""
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("component_mlp", (4,)), sites)
  vu_key, ci_key = jax.random.split(jax.random.key(0))
  item = {"components": jax.jit(sites_lib.init_components,
                                static_argnums=1)(vu_key, sites),
          "ci_params": jax.jit(ci_fn.init)(ci_key)}
  return jax.block_until_ready(item)


def evict(path: str) -> None:
  """Drop the cached pages of every file under `path` (no global effect)."""
  paths = [path] if os.path.isfile(path) else [
    os.path.join(root, name) for root, _, names in os.walk(path)
    for name in names]
  for name in paths:
    fd = os.open(name, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def raw_write(path: str, nbytes: int) -> float:
  """Return seconds to write `nbytes` sequentially and fsync them."""
  block = np.random.default_rng(0).bytes(16 * MB)
  start = time.perf_counter()
  with open(path, "wb", buffering=0) as f:
    written = 0
    while written < nbytes:
      written += f.write(block[:min(len(block), nbytes - written)])
    os.fsync(f.fileno())
  return time.perf_counter() - start


def host_copy(nbytes: int) -> float:
  """Return seconds to copy `nbytes` of host memory into a fresh buffer."""
  source = np.ones(nbytes // 4, np.float32)
  start = time.perf_counter()
  copy = source.copy()
  seconds = time.perf_counter() - start
  del copy
  return seconds


def raw_read(path: str) -> float:
  """Return seconds to read `path` sequentially from the disk."""
  evict(path)
  start = time.perf_counter()
  with open(path, "rb", buffering=0) as f:
    while f.read(16 * MB):
      pass
  return time.perf_counter() - start


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  os.makedirs(_DIR.value, exist_ok=True)
  root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=_DIR.value)
  try:
    sites = decomposition_sites(_SIZE_MB.value)
    item = build_item(sites)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(item))
    mb = nbytes / MB
    raw_path = os.path.join(root, "raw.bin")
    write_s = raw_write(raw_path, nbytes)
    read_s = raw_read(raw_path)
    os.remove(raw_path)
    copy_s = host_copy(nbytes)
    template = jax.eval_shape(lambda: item)
    saves, restores = [], []
    for step in range(_REPEATS.value):
      start = time.perf_counter()
      path = checkpoint.save(root, step, {"decomposition": item})
      saves.append(time.perf_counter() - start)
      evict(path)
      start = time.perf_counter()
      restored = checkpoint.restore_item(path, "decomposition", template)
      jax.block_until_ready(restored)
      restores.append(time.perf_counter() - start)
      del restored
      shutil.rmtree(path)
    save_s, restore_s = statistics.median(saves), statistics.median(restores)
    kinds = ", ".join(f"{k} {n}x{d_in}x{d_out}" for k, n, d_in, d_out in KINDS)
    print(f"decomposition: {mb:.0f} MB, {len(jax.tree.leaves(item))} arrays "
          f"({kinds}; C={sites[0].c}); disk of {os.path.abspath(root)}; "
          f"{jax.devices()[0].device_kind} x{len(jax.devices())}; load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'':24s}{'seconds':>9s}{'MB/s':>9s}{'vs raw':>8s}")
    rows = (("raw sequential write", write_s, write_s),
            ("checkpoint save", save_s, write_s),
            ("raw sequential read", read_s, read_s),
            ("checkpoint restore", restore_s, read_s),
            ("host memory copy", copy_s, copy_s))
    for name, seconds, raw in rows:
      print(f"{name:24s}{seconds:9.2f}{mb / seconds:9.0f}{raw / seconds:8.2f}")
    print(f"saves {', '.join(f'{s:.2f}' for s in saves)} s; restores "
          f"{', '.join(f'{s:.2f}' for s in restores)} s (page cache evicted "
          "before each read)")
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
