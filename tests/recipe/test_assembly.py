"""recipe/assembly: a run is assembled once, in order, by library code.

A tiny TMS 5-2 under the full VPD recipe (subset recon, persistent PGD with
its source state, EMA frequency minimality), on untrained weights; placed
runs use a `(replicate, fsdp, tp) = (1, 2, 2)` mesh of the simulated CPU
devices under the `owner` preset, which splits C over tp.
"""

import functools
import pathlib

import jax
import pytest
from jax.sharding import AxisType

from decompax.core import train_step
from decompax.placement import shardings
from decompax.placement import table as table_lib
from decompax.recipe import assembly, engine, terms
from decompax.recipe.config import SettingError
from decompax.recipe.flagfiles import read_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
VPD = (f"--flagfile={ROOT / 'flags' / 'tms_5-2_vpd.flags'}", "--c=8",
       "--batch_size=8", "--num_steps=4")


def _problem(*args: str):
  config = read_args([*VPD, *args])
  toy, target, _ = assembly.resolve_target(config)
  return config, toy, target, toy.init(jax.random.key(0))


def _placement() -> shardings.Placement:
  mesh = jax.make_mesh((1, 2, 2), table_lib.MESH_AXES,
                       axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:4])
  return shardings.Placement(mesh, table_lib.make_table("owner", ()))


def _counting(fn, calls: list):
  @functools.wraps(fn)
  def counted(*args, **kwargs):
    calls.append(fn.__name__)
    return fn(*args, **kwargs)
  return counted


def test_terms_ci_config_and_step_are_each_built_once(monkeypatch):
  calls = []
  monkeypatch.setattr(terms, "TERMS", tuple(
    t._replace(build=_counting(t.build, calls)) for t in terms.TERMS))
  monkeypatch.setattr(engine, "ci_config", _counting(engine.ci_config, calls))
  monkeypatch.setattr(train_step, "make_train_step",
                      _counting(train_step.make_train_step, calls))
  config, toy, target, weights = _problem()
  run = assembly.build_run(config, toy, target, weights,
                           placement=_placement())
  built = [t for t in terms.TERMS if terms.coeff_of(config, t) > 0]
  assert len(built) == len(run.terms) == 5
  # One builder call per term on, one CI config, one step.
  assert sorted(calls) == sorted(
    [t.build.__name__ for t in built] + ["ci_config", "make_train_step"])


def test_the_state_is_born_in_its_shards(monkeypatch):
  """`start` jits the init with the plan's state shardings as its
  out_shardings: every leaf comes out where the step takes it, and the
  V/U leaves split C over tp."""
  given = []

  def spy(init, out_shardings=None):
    given.append(out_shardings)
    return sharded_init(init, out_shardings)

  sharded_init = shardings.sharded_init
  monkeypatch.setattr(shardings, "sharded_init", spy)
  config, toy, target, weights = _problem()
  planned = assembly.plan(assembly.parts(config, toy, target), weights,
                          _placement())
  run = assembly.start(planned, weights)
  assert given == [planned.shardings.state]
  leaves = jax.tree.leaves(run.state)
  for leaf, sharding in zip(leaves, jax.tree.leaves(planned.shardings.state)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  v = run.state.components["linear1"].v
  assert v.sharding.shard_shape(v.shape) == (1, 5, 4)


def test_the_plan_needs_only_the_weights_shapes():
  config, toy, target, weights = _problem()
  parts = assembly.parts(config, toy, target)
  placement = _placement()
  from_arrays = assembly.plan(parts, weights, placement)
  from_shapes = assembly.plan(parts, jax.eval_shape(lambda: weights),
                              placement)
  assert from_shapes.state == from_arrays.state
  assert from_shapes.shardings == from_arrays.shardings


def test_the_abstract_state_is_the_state_start_builds():
  config, toy, target, weights = _problem()
  planned = assembly.plan(assembly.parts(config, toy, target), weights)
  run = assembly.start(planned, weights)
  assert (jax.tree.structure(planned.state)
          == jax.tree.structure(run.state))
  for shape, leaf in zip(jax.tree.leaves(planned.state),
                         jax.tree.leaves(run.state)):
    assert (shape.shape, shape.dtype) == (leaf.shape, leaf.dtype)


def test_a_fresh_run_warms_up_and_a_restored_one_does_not():
  config, toy, target, weights = _problem("--faithfulness_warmup_steps=2")
  planned = assembly.plan(assembly.parts(config, toy, target), weights,
                          _placement())
  assert assembly.start(planned, weights).warmup_losses.shape == (2,)
  seen = {}

  def restore(template, reinit, state_shardings, term_names):
    seen.update(shardings=state_shardings, term_names=term_names)
    return reinit(template.components, template.ci_params)

  run = assembly.start(planned, weights, restore)
  assert run.warmup_losses.shape == (0,)
  assert seen == {"shardings": planned.shardings.state,
                  "term_names": planned.parts.term_names}
  # The restored state goes where the step takes it.
  for leaf, sharding in zip(jax.tree.leaves(run.state),
                            jax.tree.leaves(planned.shardings.state)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_a_refused_setting_names_its_field():
  # Inside the setting's domain (0 is kept for a constant γ), refused by
  # the library's own config once γ anneals to it.
  config, toy, target, _ = _problem("--importance_penalty=smooth_l0",
                                    "--smooth_l0_gamma_final_frac=0")
  with pytest.raises(SettingError,
                     match=r"^--smooth_l0_gamma_final_frac: smooth-L0 gamma "):
    assembly.parts(config, toy, target)


def test_toys_resolve_to_their_selected_sites():
  config = read_args(["--target=resid_mlp2", "--sites=layers.1.mlp_in"])
  toy, target, load = assembly.resolve_target(config)
  assert load is None and toy.name == "resid_mlp2"
  assert [s.name for s in target.sites] == ["layers.1.mlp_in"]
