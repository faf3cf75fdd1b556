"""A targeted run's streams (SPEC §6.6): the shipped recipe's two streams
with their batch sizes and positions, and the settings a targeted run, or
a run without streams, refuses on one line naming the setting."""

import pathlib

import pytest

from decompax.recipe import streams

RECIPE = pathlib.Path(__file__).resolve().parents[2] / "flags" / (
  "addsub_tpd.flags")


@pytest.fixture
def targeted(parse):
  return lambda *args: parse(f"--flagfile={RECIPE}", "--num_steps=10", *args)


def test_the_recipe_has_two_streams_of_their_own_sizes(targeted, parse):
  config = targeted()
  assert streams.is_targeted(config) and not streams.is_targeted(parse())
  assert streams.batch_size(config, streams.TARGET) == 256
  assert streams.batch_size(config, streams.NONTARGET) == 32
  target, nontarget = streams.specs(config)
  assert target.loss_positions == streams.tasks()["addsub"].answer_positions
  assert nontarget.delta_pin and not target.delta_pin
  every = streams.specs(targeted("--target_loss_positions=all"))
  assert every[0].loss_positions is None


@pytest.mark.parametrize("args, message", [
  (("--faithfulness_coeff=1",), "no faithfulness term"),
  (("--nontarget_task=addsub",), "both streams read --\\*_task=addsub"),
  (("--nontarget_task=",), "needs exactly one source"),
  (("--target_task=sort",), "is no built-in task"),
  (("--nontarget_recon_coeff=0",), "non-target stream needs its"),
])
def test_a_targeted_run_refuses_what_it_cannot_run(targeted, args, message):
  with pytest.raises(ValueError, match=message):
    targeted(*args)


def test_a_run_without_streams_refuses_their_settings(parse):
  with pytest.raises(ValueError, match="--nontarget_recon_coeff belongs to"):
    parse("--nontarget_recon_coeff=1")
  with pytest.raises(ValueError, match="--ab_grid=on"):
    parse("--ab_grid=on")
