"""Whether a compiled program's memory fits where it runs, before it runs.

A program whose buffers cannot be allocated does not always fail: on CPU,
XLA's allocation failure inside an execution can leave the host waiting on
its results forever. So `bin/train` compares the compiled step's own need
(its temporaries and new outputs, from XLA's memory analysis) with the
memory free to it, and refuses a step that cannot fit on one line naming
the flags that size it.
"""

import os
import resource
from typing import Any

import jax

GIB = 2**30


class DoesNotFit(ValueError):
  """A compiled program needs more memory than is free to it."""


def need_bytes(compiled: Any) -> int | None:
  """Return the bytes `compiled` allocates per device while it runs (its
  temporaries and outputs, less the outputs written over donated inputs),
  or None where XLA gives no analysis."""
  try:
    stats = compiled.memory_analysis()
  except (NotImplementedError, jax.errors.JaxRuntimeError):
    return None
  if stats is None:
    return None
  return int(stats.temp_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes)


def _meminfo_bytes(key: str, path: str = "/proc/meminfo") -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      for line in f:
        name, _, rest = line.partition(":")
        if name == key:
          return int(rest.split()[0]) * 1024  # reported in kB
  except (OSError, ValueError, IndexError):
    return None
  return None


def host_free_bytes() -> int | None:
  """Return the host memory this process may still allocate: the kernel's
  MemAvailable, capped by what an address-space limit (`ulimit -v`) leaves
  of this process's own mappings; None if neither is known."""
  free = [_meminfo_bytes("MemAvailable")]
  limit = resource.getrlimit(resource.RLIMIT_AS)[0]
  mapped = _meminfo_bytes("VmSize", f"/proc/{os.getpid()}/status")
  if limit != resource.RLIM_INFINITY and mapped is not None:
    free.append(max(limit - mapped, 0))
  known = [b for b in free if b is not None]
  return min(known) if known else None


def device_free_bytes(device: Any) -> tuple[int | None, int]:
  """Return the memory free to programs on `device` and how many devices
  share it: an accelerator's own (its allocator's limit less what is in
  use), or for CPU devices the host's, shared by all local CPU devices."""
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), 1
  sharing = sum(d.platform == "cpu" for d in jax.local_devices())
  return host_free_bytes(), max(sharing, 1)


def check_fits(compiled: Any, what: str, fix: str, held: int = 0) -> None:
  """Raise DoesNotFit when `compiled` (SPMD: one device's program) needs
  more than is free on this process's first device, beside `held` bytes
  its caller keeps there (arguments it has yet to make); `what` names the
  program, `fix` the flags that shrink it. Unknown sizes pass."""
  need = need_bytes(compiled)
  device = jax.local_devices()[0]
  free, sharing = device_free_bytes(device)
  if need is None or free is None:
    return
  need = need * sharing + held
  if need > free:
    where = ("the host" if device.platform == "cpu"
             else f"{device.platform} device {device.id}")
    raise DoesNotFit(
      f"{what} needs {need / GIB:.1f} GiB of memory beyond the state it "
      f"holds, and {where} has {free / GIB:.1f} GiB free; {fix}")


def check_bytes(need: int, what: str, fix: str) -> None:
  """Raise DoesNotFit when `need` bytes (an estimate's floor, made before
  anything compiles), spread evenly over this process's devices, exceed
  what is free to them; `what` names the need, `fix` the flags that
  shrink it. Unknown sizes pass."""
  devices = jax.local_devices()
  free, sharing = device_free_bytes(devices[0])
  if free is None:
    return
  # CPU devices share the host's memory (`sharing` is their count); an
  # accelerator holds its own share of the need.
  share = need * sharing // len(devices)
  if share > free:
    where = ("the host" if devices[0].platform == "cpu"
             else f"{devices[0].platform} device {devices[0].id}")
    raise DoesNotFit(
      f"{what}: at least {share / GIB:.1f} GiB of memory, and {where} "
      f"has {free / GIB:.1f} GiB free; {fix}")
