"""Pad slots of the owner preset (design §8, §12, I49; `core.slots`).

TMS 5-2 under its VPD recipe at toy size, with C = 7 and Muon for the
components, on a (replicate 2, fsdp 1, tp 2) mesh: the one-layer stacks do
not tile the two replicas and C = 7 does not tile the two tp devices, so
the owner preset holds both padded (stacks of 2, C of 8). Three steps must
follow the unpadded one-device trajectory (I34), the pads of the masters
and of every optimizer moment must stay exactly zero, and a checkpoint of
the padded state must record the real sizes and read back into padded and
unpadded templates alike.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.bin import placement_setup
from decompax.core import sites as sites_lib
from decompax.core import slots, train_step
from decompax.io import checkpoint, decomposition
from decompax.placement import shardings
from decompax.placement import table as table_lib

pytestmark = pytest.mark.multidevice

MESH = (2, 1, 2)
STEPS = 3
C = 7


def _sites():
  return (sites_lib.SiteSpec("a", "k", 0, 4, 3, 5),
          sites_lib.SiteSpec("b", "k", 1, 4, 3, 5),
          sites_lib.SiteSpec("c", "j", 0, 2, 6, 3))


def test_pad_and_cut_round_trip_through_optimizer_shaped_trees():
  sites = _sites()
  comps = sites_lib.init_components(jax.random.key(0), sites)
  tree = {"components": comps, "opt": ({"mu": comps, "count": jnp.ones(())},)}
  padded = slots.pad_components(tree, sites, slots.SlotPads(layer=4, c=4))
  assert padded["components"]["k"].v.shape == (4, 4, 8)
  assert padded["opt"][0]["mu"]["j"].u.shape == (4, 4, 6)
  assert padded["opt"][0]["count"].shape == ()
  assert slots.has_pads(padded, sites) and not slots.has_pads(tree, sites)
  # The pads are zero and the real block is the original.
  v = padded["components"]["k"].v
  assert not np.any(np.asarray(v[2:])) and not np.any(np.asarray(v[:, :, 5:]))
  cut = slots.real_components(padded, sites)
  for got, want in zip(jax.tree.leaves(cut), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(got, want)
  # Unpadded leaves pass through untouched (no operation at all).
  assert slots.real_components(tree, sites)["components"]["k"].v is comps[
    "k"].v
  real = slots.real_shape_of(sites)
  shapes = {jax.tree_util.keystr(p): real(p, x) for p, x in
            jax.tree_util.tree_flatten_with_path(padded)[0]}
  assert shapes["['components']['k'].v"] == (2, 4, 5)
  assert shapes["['opt'][0]['mu']['j'].u"] == (1, 3, 6)
  assert shapes["['opt'][0]['count']"] is None


def test_only_the_owner_optimizer_layout_pads():
  sizes = {"replicate": 2, "fsdp": 4, "tp": 8}
  assert table_lib.slot_pads(table_lib.make_table("owner"), sizes) == (
    slots.SlotPads(layer=2, c=8))
  assert table_lib.slot_pads(table_lib.make_table("zero1"), sizes) == (
    slots.NO_PADS)
  assert table_lib.slot_pads(
    table_lib.make_table("zero1", ("optimizer:owner",)), sizes) == (
      slots.SlotPads(layer=2, c=8))
  assert table_lib.slot_pads(table_lib.make_table("ddp"), sizes) == (
    slots.NO_PADS)


@pytest.fixture(scope="module")
def runs(helpers):
  p = helpers.problem(helpers.vpd_config(
    "tms_5-2_vpd", "--batch_size=32", f"--num_steps={STEPS}", f"--c={C}",
    "--ci_hidden=4", "--components_optimizer=muon"))
  reference = helpers.trajectory(p, (1, 1, 1), "ddp", STEPS)
  return p, reference, helpers.trajectory(p, MESH, "owner", STEPS)


def test_padded_owner_run_keeps_the_trajectory(helpers, runs):
  p, reference, owner = runs
  helpers.assert_same_trajectory(reference.metrics, owner.metrics)  # I34
  assert owner.run.plan.pads == slots.SlotPads(layer=2, c=2)
  for site in p.target.sites:
    factors = owner.state.components[site.kind]
    assert factors.v.shape == (2, site.d_in, 8)
    assert factors.u.shape == (2, 8, site.d_out)
    # The stack over replicate, C over tp: they tile now.
    assert tuple(factors.v.sharding.spec) == ("replicate", None, "tp")
  # The real blocks are the unpadded run's (to reassociation).
  real = slots.real_components(owner.state.components, p.target.sites)
  for got, want in zip(jax.tree.leaves(real),
                       jax.tree.leaves(reference.state.components)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_pads_stay_zero_in_masters_and_every_moment(runs):
  p, _, owner = runs
  state = owner.state
  checked = 0
  real_of = slots.real_shape_of(p.target.sites)
  for tree in (state.components, state.components_opt):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      real = real_of(path, leaf)
      if real is None:
        continue
      array = np.asarray(jax.device_get(leaf))
      mask = np.ones(array.shape, bool)
      mask[tuple(slice(0, n) for n in real)] = False
      assert mask.any() and not np.any(array[mask]), path
      checked += 1
  # V and U of both kinds, in the masters, Muon's momentum and Adam's two
  # moments.
  assert checked == 4 * 4


def test_fallbacks_report_the_computing_shapes_not_the_pads(helpers, runs):
  p, _, owner = runs
  found = shardings.fallbacks(
    table_lib.make_table("owner"), dict(zip(
      ("replicate", "fsdp", "tp"), MESH)), owner.run.plan.state, p.weights,
    helpers.lead_shape(p), None, p.target.sites)
  categories = {f.category for f in found if f.shortfall.axis == "c"}
  # The padded masters tile; the compute copy (C = 7 over tp) does not.
  assert "optimizer" not in categories and "compute" in categories


def test_checkpoint_records_real_sizes_and_reads_across_pads(tmp_path, runs):
  p, reference, owner = runs
  sites = p.target.sites
  items = checkpoint.split_state(owner.state)
  metadata = {checkpoint.DECOMPOSITION: decomposition.decomposition_metadata(
    sites, owner.run.plan.parts.ci_config)}
  path = checkpoint.save(tmp_path, STEPS, items, metadata,
                         real_shape=slots.real_shape_of(sites))
  manifest = json.load(open(os.path.join(
    path, checkpoint.DECOMPOSITION, checkpoint.MANIFEST_FILE)))
  entry = manifest["arrays"]["components/linear1/v"]
  assert entry["shape"] == [2, 5, 8] and entry["real_shape"] == [1, 5, C]
  # Unpadded (one device, ddp): the real block alone.
  plain = checkpoint.restore_item(
    path, checkpoint.TRAINING, checkpoint.split_state(
      reference.state)[checkpoint.TRAINING],
    real_shape=slots.real_shape_of(sites))
  padded_opt = slots.real_components(owner.state.components_opt, sites)
  for got, want in zip(jax.tree.leaves(plain["components_opt"]),
                       jax.tree.leaves(padded_opt)):
    np.testing.assert_array_equal(got, jax.device_get(want))
  # The decomposition reader sees real sizes only.
  loaded = decomposition.load_decomposition(path)
  assert loaded.components["linear1"].v.shape == (1, 5, C)
  # Back into the padded owner template: bitwise, pads zero.
  again = checkpoint.restore_item(
    path, checkpoint.DECOMPOSITION,
    checkpoint.split_state(owner.state)[checkpoint.DECOMPOSITION],
    checkpoint.split_state(owner.run.plan.shardings.state)[
      checkpoint.DECOMPOSITION], real_shape=slots.real_shape_of(sites))
  for got, want in zip(jax.tree.leaves(again),
                       jax.tree.leaves(items[checkpoint.DECOMPOSITION])):
    np.testing.assert_array_equal(jax.device_get(got), jax.device_get(want))


def test_a_checkpoint_of_other_real_sizes_is_refused(tmp_path, runs):
  p, reference, owner = runs
  items = {checkpoint.DECOMPOSITION: checkpoint.split_state(
    owner.state)[checkpoint.DECOMPOSITION]}
  path = checkpoint.save(tmp_path, 1, items,
                         real_shape=slots.real_shape_of(p.target.sites))
  bigger = tuple(s.__class__(**{**s.__dict__, "c": C + 1})
                 for s in p.target.sites)
  with pytest.raises(checkpoint.CheckpointError, match=r"float32\[1, 5, 7\]"):
    checkpoint.restore_item(
      path, checkpoint.DECOMPOSITION, checkpoint.split_state(
        owner.state)[checkpoint.DECOMPOSITION],
      real_shape=slots.real_shape_of(bigger))


def test_the_startup_report_names_the_padded_kinds(runs):
  p, reference, owner = runs
  line = placement_setup.pad_line(owner.run.plan.state.components,
                                  p.target.sites)
  assert "linear1 1x7 as 2x8" in line and "linear2 1x7 as 2x8" in line
  assert placement_setup.pad_line(reference.run.plan.state.components,
                                  p.target.sites) == ""


def test_an_unpadded_checkpoint_reads_into_padded_shards(tmp_path, runs):
  # Each device of the owner template reads its region of the real block;
  # regions past it (the second layer slot, the eighth component) are zero.
  p, reference, owner = runs
  sites = p.target.sites
  items = {checkpoint.DECOMPOSITION: checkpoint.split_state(
    reference.state)[checkpoint.DECOMPOSITION]}
  path = checkpoint.save(tmp_path, 1, items,
                         real_shape=slots.real_shape_of(sites))
  read = checkpoint.restore_item(
    path, checkpoint.DECOMPOSITION,
    checkpoint.split_state(owner.state)[checkpoint.DECOMPOSITION],
    checkpoint.split_state(owner.run.plan.shardings.state)[
      checkpoint.DECOMPOSITION], real_shape=slots.real_shape_of(sites))
  for site in sites:
    v = read["components"][site.kind].v
    assert v.shape == (2, site.d_in, 8) and len(v.devices()) == 4
    host = np.asarray(jax.device_get(v))
    np.testing.assert_array_equal(
      host[:1, :, :C], jax.device_get(reference.state.components[site.kind].v))
    assert not host[1:].any() and not host[:, :, C:].any()


def test_ci_scaled_decay_reads_real_ci_onto_padded_masters():
  sites = _sites()
  comps = sites_lib.init_components(jax.random.key(1), sites)
  padded = slots.pad_components(comps, sites, slots.SlotPads(layer=4, c=4))
  max_ci = {k: jax.random.uniform(jax.random.key(2), (f.v.shape[0],
                                                      f.v.shape[2]))
            for k, f in comps.items()}
  plain = train_step.ci_scaled_decay(comps, max_ci, 0.1, 0.5)
  held = train_step.ci_scaled_decay(padded, max_ci, 0.1, 0.5)
  leaves = jax.tree.leaves(plain)
  assert len(leaves) == 2 * len({s.kind for s in sites})  # each kind's V, U
  for got, want in zip(jax.tree.leaves(slots.real_components(held, sites)),
                       leaves, strict=True):
    np.testing.assert_array_equal(got, want)
  assert not slots.has_pads(slots.real_components(held, sites), sites)
  assert not np.any(np.asarray(held["k"].v[2:]))
