"""Pad slots: V/U stacks held at rest in shapes that tile the mesh (SPEC §8).

The `owner` placement puts each kind's layer stack over `replicate` and C
over `tp`. A stack of 3 layers does not split over 2 replicas, nor C = 100
over 8 tensor-parallel devices; rather than keep such a stack whole on every
device, the state holds it padded: trailing zero layer slots up to a
multiple of the layer axis's devices, trailing zero components up to a
multiple of C's. The pads live only in the fp32 masters and the optimizer's
moments (state at rest). Every computation starts from `real_components`,
so a pad slot is never computed on: its gradient is exactly zero, Adam's
moments and update for it stay zero, and weight decay of zero is zero, so
it stays zero for the whole run (design I49).

A leaf is a pad-slot leaf when its path names a kind (a dict key equal to a
kind's name) and it is that kind's `v` `(layer, d_in, c)` or `u`
`(layer, c, d_out)`; this holds for the components and for every optimizer
moment that mirrors them.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from decompax.core import sites as sites_lib


class SlotPads(NamedTuple):
  """Multiples the stack (`layer`) and component (`c`) axes round up to."""

  layer: int = 1
  c: int = 1


NO_PADS = SlotPads()


def _round_up(n: int, multiple: int) -> int:
  return multiple * math.ceil(n / multiple)


def real_shape(kind: sites_lib.KindSpec, name: str) -> tuple[int, int, int]:
  """Return the unpadded shape of a kind's `v` or `u` stack."""
  if name == "v":
    return (kind.n, kind.d_in, kind.c)
  return (kind.n, kind.c, kind.d_out)


def padded_shape(kind: sites_lib.KindSpec, name: str,
                 pads: SlotPads) -> tuple[int, int, int]:
  """Return the shape a kind's `v` or `u` stack is held in under `pads`."""
  n, c = _round_up(kind.n, pads.layer), _round_up(kind.c, pads.c)
  return (n, kind.d_in, c) if name == "v" else (n, c, kind.d_out)


def _slot_leaf(path, leaf, kinds: dict[str, sites_lib.KindSpec]):
  # The kind and factor name of a pad-slot leaf, else None.
  name = getattr(path[-1], "name", None) if path else None
  if name not in ("v", "u") or getattr(leaf, "ndim", 0) != 3:
    return None
  for key in reversed(path[:-1]):
    kind = kinds.get(getattr(key, "key", None))
    if kind is not None:
      return kind, name
  return None


def map_slots(fn, tree: Any, sites: tuple[sites_lib.SiteSpec, ...]) -> Any:
  """Return `tree` with `fn(leaf, kind, name)` applied to its pad-slot
  leaves; the rest pass unchanged."""
  kinds = sites_lib.kind_specs(sites)

  def one(path, leaf):
    found = _slot_leaf(path, leaf, kinds)
    return leaf if found is None else fn(leaf, *found)

  return jax.tree_util.tree_map_with_path(one, tree)


def real_components(tree: Any, sites: tuple[sites_lib.SiteSpec, ...]) -> Any:
  """Return `tree` with every pad-slot leaf cut to its real shape (no
  operation at all for a leaf that is unpadded)."""

  def cut(leaf, kind, name):
    n, a, b = real_shape(kind, name)
    if tuple(leaf.shape) == (n, a, b):
      return leaf
    return leaf[:n, :a, :b]

  return map_slots(cut, tree, sites)


def pad_components(tree: Any, sites: tuple[sites_lib.SiteSpec, ...],
                   pads: SlotPads) -> Any:
  """Return `tree` (real shapes) with zero pad slots appended (`pads`)."""

  def pad(leaf, kind, name):
    want = padded_shape(kind, name, pads)
    if tuple(leaf.shape) == want:
      return leaf
    return jnp.pad(leaf, [(0, w - s) for w, s in zip(want, leaf.shape)])

  return map_slots(pad, tree, sites)


def real_shape_of(sites: tuple[sites_lib.SiteSpec, ...]):
  """Return `real(path, leaf)`: a pad-slot leaf's real shape, None for any
  other leaf (checkpoints record and read pad slots by it)."""
  kinds = sites_lib.kind_specs(sites)

  def real(path, leaf) -> tuple[int, ...] | None:
    slot = _slot_leaf(path, leaf, kinds)
    return None if slot is None else real_shape(*slot)

  return real


def real_matrix_dims(sites: tuple[sites_lib.SiteSpec, ...]):
  """Return `dims(path, leaf) -> (rows, cols)`: the real trailing matrix
  shape of a leaf (its own for leaves without pad slots), for updates whose
  scale depends on a matrix's shape (Muon)."""
  real = real_shape_of(sites)

  def dims(path, leaf) -> tuple[int, int]:
    return tuple((real(path, leaf) or leaf.shape)[-2:])

  return dims


def padded_kinds(components: sites_lib.Components,
                 sites: tuple[sites_lib.SiteSpec, ...]
                 ) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
  """Return, per kind held with pad slots, its real and held
  `(layers, C)`."""
  found = {}
  for kind, spec in sites_lib.kind_specs(sites).items():
    n, _, c = components[kind].v.shape
    if (n, c) != (spec.n, spec.c):
      found[kind] = ((spec.n, spec.c), (n, c))
  return found


def has_pads(tree: Any, sites: tuple[sites_lib.SiteSpec, ...]) -> bool:
  """Return whether any pad-slot leaf of `tree` is held padded."""
  real = real_shape_of(sites)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = real(path, leaf)
    if shape is not None and tuple(leaf.shape) != shape:
      return True
  return False
