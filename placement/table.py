"""The placement table: where each category of state lives (SPEC §8).

Every array a step touches belongs to one *category* (`CATEGORIES`). A
category's `Layout` maps *semantic axes* (`SEMANTIC_AXES`) to mesh axes
(`replicate`, `fsdp`, `tp`); axes it does not name stay replicated. A leaf is
described by one semantic axis per dimension (`None`: never sharded);
`largest` stands for every dimension of a leaf without named axes (CI
weights, frozen weights) and shards its largest dimension that tiles.

Presets (`owner`, `zero1`, `ddp`) expand to a full table; override entries
replace single categories, each by a named layout (`LAYOUTS`) or by explicit
rules `axis=mesh+mesh;axis=mesh`.

Resolution is per leaf, dimension by dimension: a mesh axis serves at most
one dimension of a leaf (the first that asks for it) and axes of size 1 are
dropped. When a dimension does not tile its mesh axes, a preset's layout
drops trailing mesh axes until it does (the dimension stays partly
replicated; `resolve` returns these `Shortfall`s so that callers can report
them), while a layout the user authored (an override) and the batch axis never
fall back: there a dimension that does not tile is a configuration error.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

from jax.sharding import PartitionSpec

from decompax.core import slots

MESH_AXES = ("replicate", "fsdp", "tp")

CATEGORIES = {
  "optimizer": "V/U fp32 masters and the components optimizer's moments",
  "compute": "V/U as the step computes with them, once per step",
  "operands": "V/U as each masked forward consumes them",
  "faithfulness": "V/U and frozen stacks inside the faithfulness loss",
  "muon": "Muon's Newton-Schulz work (the blended momenta)",
  "ci_weights": "CI-function parameters and their optimizer state",
  "ci_activations": "CI pre-activations and squashings [*L, C]",
  "frozen": "frozen target weights",
  "inputs": "the batch (external activations)",
  "activations": "clean outputs and taps (intermediate activations)",
  "adversary": "shared-scope persistent sources and their moments; "
               "batch-scoped ones follow the inputs' batch axes",
}

SEMANTIC_AXES = ("layer", "d_in", "d_out", "c", "batch", "seq", "feature",
                 "largest")
# Axes that must split as asked: replicating a batch defeats data parallelism.
STRICT_AXES = ("batch",)

Rules = tuple[tuple[str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Semantic axis -> mesh axes, in the order they split the dimension.

  `authored` is the override entry that wrote the layout (empty for a
  preset's): an authored layout is strict, it never falls back.
  """

  rules: Rules = ()
  authored: str = ""
  # Whether V/U stacks under this layout are held with pad slots
  # (`core.slots`) so that the layer and C axes tile their mesh axes.
  pads: bool = False

  def mesh_axes(self, axis: str | None) -> tuple[str, ...]:
    """Return the mesh axes that shard `axis` (empty: replicated)."""
    return dict(self.rules).get(axis, ()) if axis else ()


def _layout(**rules: tuple[str, ...]) -> Layout:
  return Layout(tuple(rules.items()))


_R, _F, _T = MESH_AXES
LAYOUTS: dict[str, Layout] = {
  "replicated": _layout(),
  # Pure data parallelism: the batch over every device.
  "data": _layout(batch=(_R, _F, _T)),
  # Activations of the sharded presets: batch over (replicate, fsdp), C and
  # the CI's C-sized axes over tp.
  "batch": _layout(batch=(_R, _F), c=(_T,)),
  # Matrix dims over fsdp (one per leaf), unannotated leaves likewise.
  "fsdp": _layout(d_in=(_F,), d_out=(_F,), largest=(_F,)),
  # fsdp-resident compute weights: matrix dims over fsdp, C over tp.
  "fsdp_tp": _layout(d_in=(_F,), d_out=(_F,), c=(_T,), largest=(_F,)),
  "tp": _layout(c=(_T,)),
  # Intra-matrix over the full mesh (SPEC §8 zero1).
  "zero1": _layout(d_in=(_F,), d_out=(_F,), c=(_T, _R), largest=(_F, _T, _R)),
  # Whole matrices per replica group, matrix dims over fsdp, C over tp.
  # Stacks and C that do not tile are padded (SPEC §8): see `slot_pads`.
  "owner": dataclasses.replace(
    _layout(layer=(_R,), d_in=(_F,), d_out=(_F,), c=(_T,), largest=(_F,)),
    pads=True),
  # Whole matrices per device where the layer axis tiles (Newton-Schulz work).
  "stacked": _layout(layer=(_R, _F, _T)),
}

_SHARDED_PRESET = {
  "optimizer": "zero1",
  "compute": "fsdp_tp",
  "operands": "tp",
  # C whole: `W − V·U` cancels, so a C contraction split over devices
  # would change the loss by far more than reassociation elsewhere does.
  "faithfulness": "fsdp",
  "muon": "stacked",
  "ci_weights": "fsdp",
  "ci_activations": "batch",
  "frozen": "fsdp",
  "inputs": "batch",
  "activations": "batch",
  "adversary": "tp",
}
PRESETS: dict[str, dict[str, str]] = {
  "ddp": {**{c: "replicated" for c in CATEGORIES},
          "inputs": "data", "activations": "data", "ci_activations": "data"},
  "zero1": _SHARDED_PRESET,
  "owner": {**_SHARDED_PRESET, "optimizer": "owner"},
}


@dataclasses.dataclass(frozen=True)
class PlacementTable:
  """A layout for every category; build with `make_table`."""

  preset: str
  layouts: tuple[tuple[str, Layout], ...]

  def layout(self, category: str) -> Layout:
    """Return the layout of `category`."""
    found = dict(self.layouts)
    if category not in found:
      raise ValueError(f"unknown placement category {category!r}; use one "
                       f"of {', '.join(CATEGORIES)}")
    return found[category]


def parse_layout(text: str) -> Layout:
  """Return a named layout or one written `axis=mesh+mesh;axis=mesh`."""
  text = text.strip()
  if text in LAYOUTS:
    return LAYOUTS[text]
  if "=" not in text:
    raise ValueError(f"unknown layout {text!r}; use one of "
                     f"{', '.join(LAYOUTS)} or axis=mesh_axis[+mesh_axis];...")
  rules = {}
  for rule in filter(None, (r.strip() for r in text.split(";"))):
    axis, _, mesh = rule.partition("=")
    axis = axis.strip()
    if axis not in SEMANTIC_AXES:
      raise ValueError(f"layout {text!r} names unknown axis {axis!r}; axes "
                       f"are {', '.join(SEMANTIC_AXES)}")
    mesh_axes = tuple(m.strip() for m in mesh.split("+") if m.strip())
    missing = [m for m in mesh_axes if m not in MESH_AXES]
    if missing or not mesh_axes:
      raise ValueError(f"layout {text!r} maps {axis} to mesh axis "
                       f"{(missing or [''])[0]!r}; the mesh has "
                       f"{', '.join(MESH_AXES)}")
    if len(set(mesh_axes)) != len(mesh_axes):
      raise ValueError(f"layout {text!r} repeats a mesh axis for {axis}")
    rules[axis] = mesh_axes
  return Layout(tuple(rules.items()))


class LayoutError(ValueError):
  """A placement override that is malformed or does not tile the arrays.

  `entry` is the `category:layout` override concerned, so that a caller can
  name where it came from (the library never names command-line flags).
  """

  def __init__(self, message: str, entry: str = "") -> None:
    super().__init__(message)
    self.entry = entry


def make_table(preset: str, overrides: tuple[str, ...] = ()) -> PlacementTable:
  """Return the preset's table with `category:layout` overrides applied."""
  if preset not in PRESETS:
    raise ValueError(f"unknown placement preset {preset!r}; use one of "
                     f"{', '.join(PRESETS)}")
  layouts = {c: LAYOUTS[name] for c, name in PRESETS[preset].items()}
  for item in overrides:
    category, sep, text = item.partition(":")
    category = category.strip()
    if not sep:
      raise LayoutError(f"override {item!r} is not category:layout", item)
    if category not in CATEGORIES:
      raise LayoutError(f"override {item!r} names unknown category "
                        f"{category!r}; use one of {', '.join(CATEGORIES)}",
                        item)
    try:
      layout = parse_layout(text)
    except ValueError as e:
      raise LayoutError(f"override {item!r}: {e}", item) from None
    layouts[category] = dataclasses.replace(
      layout, authored=f"{category}:{text.strip()}")
  return PlacementTable(preset, tuple(layouts.items()))


class Shortfall(NamedTuple):
  """A dimension that does not tile every mesh axis its layout names, where
  no other dimension of the leaf takes the axes it leaves.

  `axis` is its semantic axis, or `largest` for a leaf of which no
  dimension tiles them all (`size`: the dimension that took the most, else
  the largest); `kept` is the part of `wanted` it does tile, the rest
  replicates.
  """

  axis: str
  size: int
  wanted: tuple[str, ...]
  kept: tuple[str, ...]


class Resolved(NamedTuple):
  """A leaf's spec and the dimensions that fell back to get it."""

  spec: PartitionSpec
  shortfalls: tuple[Shortfall, ...]


def mesh_text(mesh_axes: tuple[str, ...], sizes: Mapping[str, int]) -> str:
  """Return `fsdp=8` or `tp+replicate=4`: mesh axes and their product."""
  return f"{'+'.join(mesh_axes)}={math.prod(sizes[a] for a in mesh_axes)}"


def _tiling(
  size: int, mesh_axes: list[str], sizes: Mapping[str, int]
) -> list[str]:
  # Drops trailing mesh axes until their product divides the dimension.
  while mesh_axes and size % math.prod(sizes[a] for a in mesh_axes):
    mesh_axes = mesh_axes[:-1]
  return mesh_axes


def _entry(mesh_axes: list[str]):
  if not mesh_axes:
    return None
  return mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)


def resolve(
  layout: Layout,
  axes: tuple[str | None, ...],
  shape: tuple[int, ...],
  sizes: Mapping[str, int],
) -> Resolved:
  """Return the spec of one leaf with semantic `axes` under `layout`, with
  the dimensions that do not tile their mesh axes (never raises for them).

  `sizes` maps mesh axis -> size.
  """
  if len(axes) != len(shape):
    raise ValueError(f"axes {axes} do not match shape {shape}")
  if "largest" in axes:
    return _largest(layout, shape, sizes)
  used: set[str] = set()
  parts, shortfalls = [], []
  for axis, size in zip(axes, shape):
    wanted = [a for a in layout.mesh_axes(axis)
              if a not in used and sizes.get(a, 1) > 1]
    tiled = _tiling(size, wanted, sizes)
    if tiled != wanted:
      shortfalls.append(Shortfall(axis, size, tuple(wanted), tuple(tiled)))
    used.update(tiled)
    parts.append(_entry(tiled))
  # A mesh axis one dimension could not take, a later one may have taken.
  return Resolved(PartitionSpec(*parts), tuple(
    s for s in shortfalls if set(s.wanted) - set(s.kept) - used))


def _largest(
  layout: Layout, shape: tuple[int, ...], sizes: Mapping[str, int]
) -> Resolved:
  # Shards the largest dimension that tiles, with as many of the rule's
  # mesh axes as it can take (FSDP-style placement of unannotated leaves).
  wanted = [a for a in layout.mesh_axes("largest") if sizes.get(a, 1) > 1]
  parts: list = [None] * len(shape)
  best: tuple[int, int, list[str]] | None = None
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    tiled = _tiling(shape[dim], wanted, sizes)
    shards = math.prod(sizes[a] for a in tiled)
    if tiled and (best is None or shards > best[0]):
      best = (shards, dim, tiled)
  if best is not None:
    parts[best[1]] = _entry(best[2])
  kept = best[2] if best is not None else []
  shortfalls = ()
  if shape and kept != wanted:
    size = shape[best[1]] if best is not None else max(shape)
    shortfalls = (Shortfall("largest", size, tuple(wanted), tuple(kept)),)
  return Resolved(PartitionSpec(*parts), shortfalls)


def _refusal(layout: Layout, leaf: str, shape: tuple[int, ...],
             short: Shortfall, sizes: Mapping[str, int]) -> str:
  mesh = mesh_text(short.wanted, sizes)
  if not layout.authored:  # the batch axis of a preset
    devices = math.prod(sizes[a] for a in short.wanted)
    return (f"the {short.axis} axis of size {short.size} does not split "
            f"over the {devices} devices of mesh axes "
            f"{'x'.join(short.wanted)}; choose a size divisible by {devices}")
  category = layout.authored.partition(":")[0]
  product = "*".join(short.wanted)
  if short.axis == "largest":
    what = f"no dimension that tiles {mesh}"
    fix = f"{product} divides one of its dimensions"
  else:
    what = f"{short.axis} of size {short.size}, which does not tile {mesh}"
    fix = f"{product} divides {short.size}"
  return (f"layout {layout.authored}: {leaf or 'a leaf'} "
          f"[{','.join(map(str, shape))}] has {what}; choose mesh sizes so "
          f"that {fix}, or another layout for {category}")


def partition_spec(
  layout: Layout,
  axes: tuple[str | None, ...],
  shape: tuple[int, ...],
  sizes: Mapping[str, int],
  leaf: str = "",
) -> PartitionSpec:
  """Return the spec of one leaf (`leaf`: its name, for errors).

  Raises ValueError (one line) when a dimension does not tile its mesh axes
  under an authored layout, or a batch axis does not split.
  """
  resolved = resolve(layout, axes, tuple(shape), sizes)
  for short in resolved.shortfalls:
    if layout.authored or short.axis in STRICT_AXES:
      raise LayoutError(_refusal(layout, leaf, tuple(shape), short, sizes),
                        layout.authored)
  return resolved.spec


def slot_pads(table: PlacementTable, sizes: Mapping[str, int]
              ) -> slots.SlotPads:
  """Return the multiples the V/U masters' layer and C axes are padded to:
  the device counts of the mesh axes the optimizer layout splits them over,
  when that layout holds pad slots (`owner`); no pads otherwise."""
  layout = table.layout("optimizer")
  if not layout.pads:
    return slots.NO_PADS
  devices = lambda axis: math.prod(  # noqa: E731
    sizes.get(a, 1) for a in layout.mesh_axes(axis))
  return slots.SlotPads(layer=devices("layer"), c=devices("c"))
