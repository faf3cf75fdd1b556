"""Shardings of the step's pytrees under a placement table (SPEC §8).

Turns the train state, frozen weights and batches into `NamedSharding` trees
for the jitted step's `in_shardings`/`out_shardings`, and builds the
`constrain(role, tree)` hook the step applies to its intermediates with
`jax.lax.with_sharding_constraint`. Semantic axes come from each leaf's place
in its tree:

- V/U (`Factors` leaves `v`, `u`, and every optimizer leaf under those names):
  `v (layer, d_in, c)`, `u (layer, c, d_out)`; other 3-D leaves of those
  trees are frozen stacks `(layer, d_in, d_out)`.
- Batch-led leaves (inputs, taps, outputs, CI): the batch's lead shape
  `(batch[, seq])` then `feature` (or `c` for CI activations). Leaves whose
  leading dims are not the batch's are left to the compiler.
- Persistent sources (term-state leaves of rank `len(lead) + 1`): full-size
  lead dims are `batch`/`seq` and follow the `inputs` layout, the channel
  axis is `c` under `adversary`; other term-state leaves are replicated.
- CI weights and frozen weights carry no names: every dimension is `largest`.

`fallbacks` lists, before anything is placed, every dimension a preset's
layout leaves (partly) replicated because it does not tile its mesh axes;
an authored (override) layout raises `LayoutError` there instead.
`sharded_init` jits a state's init with these shardings as its outputs', so
the state is born in its shards (a `Placement` is a run's mesh and table).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from decompax.core import slots
from decompax.core.adversary import SourceState
from decompax.core.optim import MuonState
from decompax.core.step_records import StepShardings, TrainState
from decompax.placement.table import Layout, PlacementTable, Shortfall
from decompax.placement.table import partition_spec, resolve

COMPONENT_ROLES = ("optimizer", "compute", "operands", "faithfulness", "muon")
BATCH_ROLES = {"inputs": "feature", "activations": "feature",
               "ci_activations": "c"}


def _last_name(path) -> str | None:
  key = path[-1] if path else None
  return getattr(key, "name", None)


def component_axes(path, leaf) -> tuple[str | None, ...]:
  """Return the semantic axes of a leaf of a V/U-shaped tree."""
  name = _last_name(path)
  if leaf.ndim == 3 and name == "v":
    return ("layer", "d_in", "c")
  if leaf.ndim == 3 and name == "u":
    return ("layer", "c", "d_out")
  if leaf.ndim == 3:
    return ("layer", "d_in", "d_out")
  return (None,) * leaf.ndim


# A run's batch lead shape: `(B,)` or `(B, T)`, or a targeted run's one per
# stream (SPEC §6.6), by stream name.
LeadShape = tuple[int, ...] | dict[str, tuple[int, ...]]


def lead_shapes(lead_shape: LeadShape) -> tuple[tuple[int, ...], ...]:
  """Return every lead shape the run's batches have."""
  if isinstance(lead_shape, dict):
    return tuple(tuple(v) for v in lead_shape.values())
  return (tuple(lead_shape),)


def batch_axes(
  leaf, lead_shape: LeadShape, last: str
) -> tuple[str | None, ...] | None:
  """Return `(batch[, seq], last…)`, or None when `leaf` is not batch-led
  (by any of the run's lead shapes)."""
  for lead in lead_shapes(lead_shape):
    n = len(lead)
    if leaf.ndim >= n and tuple(leaf.shape[:n]) == lead:
      return ("batch", "seq")[:n] + (last,) * (leaf.ndim - n)
  return None


def source_axes(
  leaf, lead_shape: LeadShape
) -> tuple[str | None, ...] | None:
  """Return a persistent source's axes, or None for other term-state leaves."""
  for lead in lead_shapes(lead_shape):
    n = len(lead)
    if leaf.ndim != n + 1:
      continue
    if any(d not in (1, m) for d, m in zip(leaf.shape[:n], lead)):
      continue
    names = ("batch", "seq")[:n]
    return tuple(name if d == m and m > 1 else None
                 for name, d, m in zip(names, leaf.shape, lead)) + ("c",)
  return None


def path_text(path, prefix: str = "") -> str:
  """Return a tree path as `components/linear1/v` (for messages)."""
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
           for k in path]
  return "/".join([prefix, *names] if prefix else names)


def _specs(tree, layout: Layout, axes_fn, sizes, prefix: str = "") -> Any:
  def one(path, leaf):
    axes = axes_fn(path, leaf)
    if axes is None:
      return PartitionSpec()
    return partition_spec(layout, axes, tuple(leaf.shape), sizes,
                          path_text(path, prefix))

  return jax.tree_util.tree_map_with_path(one, tree)


def _largest(path, leaf):
  del path
  return ("largest",) * leaf.ndim


def source_layout(table: PlacementTable) -> Layout:
  """Return the adversary's layout with the batch axes of the inputs."""
  inputs = dict(table.layout("inputs").rules)
  rules = dict(table.layout("adversary").rules)
  for axis in ("batch", "seq"):
    rules.pop(axis, None)
    if axis in inputs:
      rules[axis] = inputs[axis]
  return Layout(tuple(rules.items()))


def _state_trees(table: PlacementTable, lead_shape: LeadShape):
  # (field, category, layout, axes_fn) of every TrainState field that the
  # table places; `step`, `rng` and `health` are replicated.
  optimizer, ci = table.layout("optimizer"), table.layout("ci_weights")
  # Persistent sources and their moments follow the batch; the rest of the
  # term states (counts, frequency EMAs) is replicated.
  sources = lambda p, x: (  # noqa: E731
    source_axes(x, lead_shape) if _last_name(p) in SourceState._fields
    else None)
  return (
    ("components", "optimizer", optimizer, component_axes),
    ("components_opt", "optimizer", optimizer, component_axes),
    ("ci_params", "ci_weights", ci, _largest),
    ("ci_opt", "ci_weights", ci, _largest),
    ("term_states", "adversary", source_layout(table), sources),
  )


def state_specs(
  table: PlacementTable, state: TrainState, lead_shape: LeadShape,
  sizes: dict[str, int],
) -> TrainState:
  """Return a `TrainState` of `PartitionSpec`s (works on abstract states)."""
  return TrainState(
    **{field: _specs(getattr(state, field), layout, axes_fn, sizes, field)
       for field, _, layout, axes_fn in _state_trees(table, lead_shape)},
    step=PartitionSpec(),
    rng=PartitionSpec(),
    health=jax.tree.map(lambda _: PartitionSpec(), state.health),
  )


def weights_specs(
  table: PlacementTable, weights: Any, sizes: dict[str, int]
) -> Any:
  """Return the frozen weights' specs (largest tiling dimension)."""
  return _specs(weights, table.layout("frozen"), _largest, sizes, "weights")


def batch_specs(
  table: PlacementTable, batch: Any, lead_shape: LeadShape,
  sizes: dict[str, int],
) -> Any:
  """Return the specs of a batch whose leaves lead with `lead_shape`."""
  return _specs(batch, table.layout("inputs"),
                lambda p, x: batch_axes(x, lead_shape, "feature"), sizes)


def named(mesh: Mesh, specs: Any) -> Any:
  """Return `NamedSharding`s on `mesh` for a tree of specs."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def step_shardings(
  table: PlacementTable, mesh: Mesh, state: TrainState, weights: Any,
  lead_shape: LeadShape, inputs: Any = None,
) -> StepShardings:
  """Return the jitted step's argument and result shardings.

  `inputs` is a batch (its specs follow `inputs`) or None for steps that
  take a data key (replicated) and sample inside.
  """
  sizes = dict(mesh.shape)
  if inputs is None:
    batch = NamedSharding(mesh, PartitionSpec())
  else:
    batch = named(mesh, batch_specs(table, inputs, lead_shape, sizes))
  return StepShardings(
    state=named(mesh, state_specs(table, state, lead_shape, sizes)),
    weights=named(mesh, weights_specs(table, weights, sizes)),
    inputs=batch,
    metrics=NamedSharding(mesh, PartitionSpec()),
  )


def make_constrain(
  table: PlacementTable, mesh: Mesh, lead_shape: LeadShape
) -> Callable[[str, Any], Any]:
  """Return the step's `constrain(role, tree)` hook.

  A role is a placement category; each leaf the role's axis rule recognises
  is pinned with `with_sharding_constraint`, the rest pass unchanged.
  """
  sizes = dict(mesh.shape)

  def axes_of(role, path, leaf):
    if role in COMPONENT_ROLES:
      return component_axes(path, leaf)
    if role in BATCH_ROLES:
      return batch_axes(leaf, lead_shape, BATCH_ROLES[role])
    return None

  def constrain(role: str, tree: Any) -> Any:
    layout = table.layout(role)

    def one(path, leaf):
      axes = axes_of(role, path, leaf)
      if axes is None:
        return leaf
      spec = partition_spec(layout, axes, tuple(leaf.shape), sizes,
                            path_text(path, role))
      return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, tree)

  return constrain


class Fallback(NamedTuple):
  """A leaf whose preset layout leaves a dimension (partly) replicated."""

  category: str
  leaf: str
  shape: tuple[int, ...]
  shortfall: Shortfall


def _ci_activation_shapes(components: Any, lead_shape: LeadShape):
  # `[*lead, C]` per kind (and stream): the CI activations' shapes, C from
  # each V.
  found = {}
  leads = lead_shapes(lead_shape)
  for path, leaf in jax.tree_util.tree_flatten_with_path(components)[0]:
    if _last_name(path) == "v" and leaf.ndim == 3:
      for i, lead in enumerate(leads):
        name = path_text(path[:-1]) + (f"#{i}" if len(leads) > 1 else "")
        found[name] = jax.ShapeDtypeStruct((*lead, leaf.shape[-1]),
                                           leaf.dtype)
  return found


def _uses_muon(components_opt: Any) -> bool:
  return any(isinstance(x, MuonState) for x in jax.tree.leaves(
    components_opt, is_leaf=lambda x: isinstance(x, MuonState)))


def _resolved_trees(
  table: PlacementTable, state: TrainState, weights: Any,
  lead_shape: LeadShape, frozen_stacks: Any, sites: tuple,
) -> list:
  # (category, layout, tree, axes_fn, prefix) of every tree whose shapes
  # are known before the step is traced. The step computes on V/U without
  # their pad slots (`core.slots`), so the compute-side roles see them so.
  batch_led = lambda p, x: batch_axes(x, lead_shape, "c")  # noqa: E731
  real = jax.eval_shape(lambda c: slots.real_components(c, sites),
                        state.components)
  found = [(category, layout, getattr(state, field), axes_fn, field)
           for field, category, layout, axes_fn
           in _state_trees(table, lead_shape)]
  found.append(("frozen", table.layout("frozen"), weights, _largest,
                "weights"))
  for role in ["compute", "operands", "faithfulness"]:
    found.append((role, table.layout(role), real, component_axes,
                  "components"))
  if _uses_muon(state.components_opt):
    found.append(("muon", table.layout("muon"), state.components,
                  component_axes, "components"))
  if frozen_stacks is not None:
    found.append(("faithfulness", table.layout("faithfulness"),
                  frozen_stacks, component_axes, "frozen_stacks"))
  found.append(("ci_activations", table.layout("ci_activations"),
                _ci_activation_shapes(real, lead_shape),
                batch_led, "ci"))
  return found


def fallbacks(
  table: PlacementTable, sizes: dict[str, int], state: TrainState,
  weights: Any, lead_shape: LeadShape, frozen_stacks: Any = None,
  sites: tuple = (),
) -> tuple[Fallback, ...]:
  """Return every dimension a preset's layout leaves (partly) replicated.

  Covers the state, the frozen weights (and `frozen_stacks`, as the
  faithfulness loss sees them) and the CI activations, under every
  category whose trees these are; works on abstract trees. `sites` are
  the run's: the computing categories see V/U without pad slots. Raises
  ValueError (one line) where an authored layout does not tile.
  """
  found = []
  for category, layout, tree, axes_fn, prefix in _resolved_trees(
      table, state, weights, lead_shape, frozen_stacks, sites):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      axes = axes_fn(path, leaf)
      if axes is None:
        continue
      shape, name = tuple(leaf.shape), path_text(path, prefix)
      partition_spec(layout, axes, shape, sizes, name)  # authored: raises
      found += [Fallback(category, name, shape, short)
                for short in resolve(layout, axes, shape, sizes).shortfalls]
  return tuple(found)


def constrained_sampler(
  sample_inputs: Callable[[jax.Array], Any],
  constrain: Callable[[str, Any], Any],
) -> Callable[[jax.Array], Any]:
  """Return `sample_inputs` whose batch is pinned to the `inputs` layout, so
  an in-step sampler draws only each device's slice (counter-based RNG)."""
  return lambda key: constrain("inputs", sample_inputs(key))


class Placement(NamedTuple):
  """A run's mesh, its placement table and the step's XLA options."""

  mesh: Mesh
  table: PlacementTable
  compiler_options: dict[str, Any] = {}


def sharded_init(
  init: Callable[..., Any], shardings: Any = None
) -> Callable[..., Any]:
  """Return `init` jitted to build its result straight into `shardings` (a
  tree matching its output), so no device ever holds a whole copy of what
  it builds; without shardings, `init` itself."""
  if shardings is None:
    return init
  return jax.jit(init, out_shardings=shardings)
