"""Placement tables, mesh shapes and the specs they give (SPEC §8)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from decompax.core import health, sites as sites_lib
from decompax.core import step_records
from decompax.placement import mesh as mesh_lib
from decompax.placement import shardings
from decompax.placement import table as table_lib

MESH_2X2X2 = {"replicate": 2, "fsdp": 2, "tp": 2}
FSDP_8 = {"replicate": 1, "fsdp": 8, "tp": 1}
ONE = {"replicate": 1, "fsdp": 1, "tp": 1}
V_AXES = ("layer", "d_in", "c")
U_AXES = ("layer", "c", "d_out")


def _spec(table, category, axes, shape, sizes):
  return table_lib.partition_spec(table.layout(category), axes, shape, sizes)


@pytest.mark.parametrize("preset", sorted(table_lib.PRESETS))
def test_every_preset_places_every_category(preset):
  table = table_lib.make_table(preset)
  assert [c for c, _ in table.layouts] == list(table_lib.CATEGORIES)


def test_overrides_replace_only_their_categories():
  base = table_lib.make_table("zero1")
  table = table_lib.make_table(
    "zero1", ("optimizer:fsdp", "frozen:replicated",
              "adversary:c=tp+replicate;layer=fsdp"))
  assert table.layout("optimizer").rules == table_lib.LAYOUTS["fsdp"].rules
  assert table.layout("frozen").rules == ()
  assert table.layout("adversary").rules == (
    ("c", ("tp", "replicate")), ("layer", ("fsdp",)))
  # Authored entries remember their text: they never fall back.
  assert table.layout("optimizer").authored == "optimizer:fsdp"
  assert table.layout("compute").authored == ""
  for category in set(table_lib.CATEGORIES) - {"optimizer", "frozen",
                                               "adversary"}:
    assert table.layout(category) == base.layout(category)


@pytest.mark.parametrize("preset,overrides,message", [
  ("fsdp2", (), "unknown placement preset 'fsdp2'"),
  ("zero1", ("optimiser:fsdp",), "unknown category 'optimiser'"),
  ("zero1", ("optimizer",), "not category:layout"),
  ("zero1", ("optimizer:sharded",), "unknown layout 'sharded'"),
  ("zero1", ("optimizer:d_in=model",), "mesh axis 'model'"),
  ("zero1", ("optimizer:rows=fsdp",), "unknown axis 'rows'"),
  ("zero1", ("optimizer:c=tp+tp",), "repeats a mesh axis"),
])
def test_bad_tables_fail_with_one_line(preset, overrides, message):
  with pytest.raises(ValueError, match=message) as info:
    table_lib.make_table(preset, overrides)
  assert "\n" not in str(info.value)


def test_zero1_shards_factors_over_the_whole_mesh():
  table = table_lib.make_table("zero1")
  v = _spec(table, "optimizer", V_AXES, (3, 16, 24), MESH_2X2X2)
  u = _spec(table, "optimizer", U_AXES, (3, 24, 16), MESH_2X2X2)
  assert v == P(None, "fsdp", ("tp", "replicate"))
  assert u == P(None, ("tp", "replicate"), "fsdp")


def test_owner_puts_stacks_on_replicate():
  table = table_lib.make_table("owner")
  assert _spec(table, "optimizer", V_AXES, (4, 16, 24), MESH_2X2X2) == P(
    "replicate", "fsdp", "tp")
  # An unpadded stack of 3 does not tile 2 replicas and would stay whole;
  # runs hold it padded to 4 instead (`slot_pads`, test_pad_slots.py).
  assert _spec(table, "optimizer", V_AXES, (3, 16, 24), MESH_2X2X2) == P(
    None, "fsdp", "tp")


def test_non_tiling_dimensions_drop_trailing_mesh_axes():
  table = table_lib.make_table("zero1")
  # C = 6 tiles tp (2) but not tp x replicate (4); d_in = 5 tiles nothing.
  assert _spec(table, "optimizer", V_AXES, (1, 5, 6), MESH_2X2X2) == P(
    None, None, "tp")
  # The preset's fallbacks are recorded, for the startup report.
  resolved = table_lib.resolve(table.layout("optimizer"), V_AXES, (1, 5, 6),
                               MESH_2X2X2)
  assert resolved.shortfalls == (
    table_lib.Shortfall("d_in", 5, ("fsdp",), ()),
    table_lib.Shortfall("c", 6, ("tp", "replicate"), ("tp",)))
  assert table_lib.resolve(table.layout("optimizer"), V_AXES, (1, 8, 8),
                           MESH_2X2X2).shortfalls == ()


@pytest.mark.parametrize("place,axes,shape,sizes,message", [
  ("optimizer:d_in=fsdp", V_AXES, (1, 5, 16), FSDP_8,
   "layout optimizer:d_in=fsdp: components/l/v [1,5,16] has d_in of size "
   "5, which does not tile fsdp=8; choose mesh sizes so that fsdp divides 5,"
   " or another layout for optimizer"),
  ("optimizer:zero1", V_AXES, (1, 16, 6), MESH_2X2X2,
   "layout optimizer:zero1: components/l/v [1,16,6] has c of size 6, "
   "which does not tile tp+replicate=4; choose mesh sizes so that "
   "tp*replicate divides 6, or another layout for optimizer"),
  ("frozen:fsdp", ("largest",) * 2, (5, 3), FSDP_8,
   "layout frozen:fsdp: components/l/v [5,3] has no dimension that tiles "
   "fsdp=8; choose mesh sizes so that fsdp divides one of its dimensions, "
   "or another layout for frozen"),
])
def test_authored_layouts_never_fall_back(place, axes, shape, sizes,
                                         message):
  category = place.partition(":")[0]
  layout = table_lib.make_table("zero1", (place,)).layout(category)
  with pytest.raises(ValueError) as info:
    table_lib.partition_spec(layout, axes, shape, sizes, "components/l/v")
  assert str(info.value) == message
  # The same rules from the preset fall back instead.
  preset = dataclasses.replace(layout, authored="")
  table_lib.partition_spec(preset, axes, shape, sizes, "components/l/v")


def test_a_mesh_axis_shards_one_dimension_of_a_leaf():
  table = table_lib.make_table("zero1")
  w = _spec(table, "faithfulness", ("layer", "d_in", "d_out"), (2, 8, 8),
            FSDP_8)
  assert w == P(None, "fsdp", None)


def test_unannotated_leaves_shard_their_largest_tiling_dimension():
  table = table_lib.make_table("zero1")
  largest = ("largest", "largest")
  assert _spec(table, "frozen", largest, (12, 16), FSDP_8) == P(None, "fsdp")
  assert _spec(table, "frozen", largest, (20, 16), FSDP_8) == P(None, "fsdp")
  assert _spec(table, "frozen", largest, (5, 3), FSDP_8) == P(None, None)


def test_a_batch_that_does_not_split_is_refused():
  table = table_lib.make_table("zero1")
  with pytest.raises(ValueError, match="batch axis of size 6 does not split"):
    _spec(table, "inputs", ("batch", "feature"), (6, 4), MESH_2X2X2)
  with pytest.raises(ValueError, match="divisible by 8"):
    _spec(table_lib.make_table("ddp"), "inputs", ("batch",), (12,), FSDP_8)


@pytest.mark.parametrize("preset", sorted(table_lib.PRESETS))
def test_presets_at_degenerate_sizes_replicate_everything(preset):
  """fsdp = 1, tp = 1 (and replicate = 1): every spec is fully replicated."""
  table = table_lib.make_table(preset)
  for category in table_lib.CATEGORIES:
    for axes, shape in ((V_AXES, (2, 8, 8)), (U_AXES, (2, 8, 8)),
                        (("batch", "feature"), (8, 4)),
                        (("largest",) * 2, (8, 8))):
      spec = _spec(table, category, axes, shape, ONE)
      assert all(part is None for part in spec), (category, spec)


@pytest.mark.parametrize("preset,shards", [
  ("ddp", 1), ("zero1", 8), ("owner", 8)])
def test_optimizer_state_divides_by_the_fsdp_size(preset, shards):
  """Llama-3.1-8B MLP shapes at C = 24576 on an fsdp=8 mesh."""
  sites = (sites_lib.SiteSpec("gate", "gate", 0, 4096, 14336, 24576),
           sites_lib.SiteSpec("down", "down", 0, 14336, 4096, 24576))
  components = jax.eval_shape(
    lambda: sites_lib.init_components(jax.random.key(0), sites))
  specs = shardings._specs(components,
                           table_lib.make_table(preset).layout("optimizer"),
                           shardings.component_axes, FSDP_8)
  for leaf, spec in zip(jax.tree.leaves(components), jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    split = math.prod(FSDP_8[a] for part in spec if part
                      for a in ((part,) if isinstance(part, str) else part))
    assert split == shards, (leaf.shape, spec)


def test_sources_follow_the_batch_and_shared_ones_replicate():
  table = table_lib.make_table("zero1")
  layout = shardings.source_layout(table)
  lead = (8, 16)
  bsc = shardings.source_axes(jnp.zeros((8, 16, 7)), lead)
  c = shardings.source_axes(jnp.zeros((1, 1, 7)), lead)
  assert bsc == ("batch", "seq", "c") and c == (None, None, "c")
  sizes = MESH_2X2X2
  assert table_lib.partition_spec(layout, bsc, (8, 16, 7), sizes) == P(
    ("replicate", "fsdp"), None, None)
  assert table_lib.partition_spec(layout, c, (1, 1, 8), sizes) == P(
    None, None, "tp")
  assert shardings.source_axes(jnp.zeros((7,)), lead) is None  # an EMA


@pytest.mark.parametrize("args,message", [
  ((8, 3, 1, 1), "spans 3 devices but 8 are present"),
  ((8, 3, None, None), "replicate=3 x tp=1 does not divide"),
  ((8, None, None, 3), "does not divide the 8 devices"),
  ((8, 0, None, None), "mesh axis replicate must have a positive size"),
  ((4, 2, 1, 1), "spans 2 devices"),
])
def test_bad_mesh_shapes_fail_with_one_line(args, message):
  with pytest.raises(ValueError, match=message):
    mesh_lib.mesh_shape(*args)


def test_unset_fsdp_takes_the_devices_left():
  assert mesh_lib.mesh_shape(8, replicate=2) == mesh_lib.MeshShape(2, 4, 1)
  assert mesh_lib.mesh_shape(8, tp=2, fsdp=2, replicate=2).n_devices == 8
  assert mesh_lib.mesh_shape(1) == mesh_lib.MeshShape(1, 1, 1)


def test_local_device_count_must_match_the_launch():
  mesh_lib.check_local_devices(None, 8, "cpu")
  with pytest.raises(ValueError, match="sees 8 cpu device"):
    mesh_lib.check_local_devices(4, 8, "cpu")


def _abstract_run(d_in: int, d_out: int, c: int):
  """Return an abstract state, frozen weights and stacks of one kind."""
  f32 = jnp.float32
  shape = jax.ShapeDtypeStruct
  factors = sites_lib.Factors(shape((2, d_in, c), f32),
                              shape((2, c, d_out), f32))
  state = step_records.TrainState(
    components={"mlp": factors}, ci_params={"w": shape((d_in, c), f32)},
    components_opt=(), ci_opt=(), term_states={},
    step=shape((), jnp.int32),
    rng=jax.eval_shape(lambda: jax.random.key(0)),
    health=jax.eval_shape(health.healthy))
  stacks = {"mlp": shape((2, d_in, d_out), f32)}
  return state, stacks, stacks


def test_fallbacks_list_what_a_preset_replicates():
  table = table_lib.make_table("zero1")
  tiling = _abstract_run(16, 8, 8)
  assert shardings.fallbacks(table, MESH_2X2X2, *tiling[:2], (16,),
                             tiling[2]) == ()
  state, weights, stacks = _abstract_run(5, 8, 8)
  found = shardings.fallbacks(table, MESH_2X2X2, state, weights, (16,),
                              stacks)
  short = table_lib.Shortfall("d_in", 5, ("fsdp",), ())
  # V's d_in under every V/U category that shards it; the frozen stack
  # [2,5,8] is no fallback: its d_out takes fsdp instead.
  assert {(f.category, f.leaf, f.shortfall) for f in found} == {
    ("optimizer", "components/mlp/v", short),
    ("compute", "components/mlp/v", short),
    ("faithfulness", "components/mlp/v", short),
  }
  assert all(f.shape == (2, 5, 8) for f in found)
  with pytest.raises(ValueError, match="layout compute:fsdp_tp: "
                     "components/mlp/v"):
    shardings.fallbacks(table_lib.make_table("zero1", ("compute:fsdp_tp",)),
                        MESH_2X2X2, state, weights, (16,), stacks)
