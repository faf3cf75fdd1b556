"""Mesh sizes (SPEC §8): an unset fsdp takes the devices the other axes
leave, and sizes that cannot span the devices are refused on one line."""

import pytest

from decompax.placement import mesh


def test_an_unset_fsdp_takes_the_remaining_devices():
  shape = mesh.mesh_shape(8, replicate=2)
  assert (shape.replicate, shape.fsdp, shape.tp) == (2, 4, 1)
  assert shape.sizes == {"replicate": 2, "fsdp": 4, "tp": 1}
  assert shape.n_devices == 8 and str(shape) == "replicate=2 x fsdp=4 x tp=1"
  assert mesh.mesh_shape(8, tp=8) == mesh.MeshShape(1, 1, 8)


@pytest.mark.parametrize("sizes, message", [
  ({"tp": 0}, "must have a positive size"),
  ({"replicate": 3}, "does not divide the 8 devices"),
  ({"fsdp": 2, "tp": 2}, "spans 4 devices but 8 are present"),
])
def test_sizes_that_cannot_span_the_devices_are_refused(sizes, message):
  with pytest.raises(ValueError, match=message):
    mesh.mesh_shape(8, **sizes)


def test_the_launch_must_see_the_devices_it_expects():
  mesh.check_local_devices(None, 4, "cpu")
  mesh.check_local_devices(4, 4, "cpu")
  with pytest.raises(ValueError, match="4 local devices were expected"):
    mesh.check_local_devices(4, 2, "cpu")
