"""The logical device mesh: axis sizes and their validation (SPEC §8).

The mesh has three axes, always in this order: `replicate` (conventionally
node groups), `fsdp` (data shards within a node) and `tp` (tensor
parallelism: the `C` axis of V/U and CI). Their product is the world size,
i.e. every device of every process. Meshes themselves are built by `bin`;
this module only decides and checks their shape.
"""

import dataclasses
import math

from decompax.placement.table import MESH_AXES


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """Sizes of the `(replicate, fsdp, tp)` mesh axes."""

  replicate: int = 1
  fsdp: int = 1
  tp: int = 1

  @property
  def sizes(self) -> dict[str, int]:
    """Return mesh axis -> size, in mesh order."""
    return {axis: getattr(self, axis) for axis in MESH_AXES}

  @property
  def n_devices(self) -> int:
    """Return the number of devices the mesh spans."""
    return math.prod(self.sizes.values())

  def __str__(self) -> str:
    return " x ".join(f"{a}={n}" for a, n in self.sizes.items())


def mesh_shape(
  n_devices: int,
  replicate: int | None = None,
  fsdp: int | None = None,
  tp: int | None = None,
) -> MeshShape:
  """Return the mesh shape over `n_devices`; unset axes are 1, except an
  unset `fsdp`, which takes every device the other axes leave.

  Raises ValueError (one line, naming the fix) when a size is not positive
  or the sizes do not multiply to `n_devices`.
  """
  for name, value in (("replicate", replicate), ("fsdp", fsdp), ("tp", tp)):
    if value is not None and value < 1:
      raise ValueError(f"mesh axis {name} must have a positive size, got "
                       f"{value}")
  replicate, tp = replicate or 1, tp or 1
  if fsdp is None:
    if n_devices % (replicate * tp):
      raise ValueError(
        f"replicate={replicate} x tp={tp} does not divide the "
        f"{n_devices} devices; choose sizes whose product divides it")
    fsdp = n_devices // (replicate * tp)
  shape = MeshShape(replicate, fsdp, tp)
  if shape.n_devices != n_devices:
    raise ValueError(
      f"mesh {shape} spans {shape.n_devices} devices but {n_devices} are "
      f"present; choose replicate x fsdp x tp = {n_devices}")
  return shape


def check_local_devices(
  expected: int | None, present: int, platform: str
) -> None:
  """Raise ValueError unless `present` local devices match the launch's
  `expected` count (None: whatever is present)."""
  if expected is not None and expected != present:
    raise ValueError(
      f"{expected} local devices were expected but this process sees "
      f"{present} {platform} device(s); fix the launch (visible devices) or "
      "the expected count")
