"""Scale-out flags of bin/train: validation, compiler options, the mesh.

The binary's one-line refusal of a mesh larger than the devices present is
a row of tests/bin/test_bad_inputs.py (`mesh_beyond_devices`)."""

import json
import pathlib

import jax
import numpy as np
import pytest
from absl import flags

from decompax.bin import placement_setup, train, train_flags
from decompax.io import checkpoint, run_dir
from decompax.placement import compiler


@pytest.fixture
def parse():
  """Parse flags into a PlacementConfig; restore the defaults after."""

  def _parse(*args):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", *args])
    return placement_setup.config_from_flags()

  yield _parse
  flags.FLAGS.unparse_flags()
  flags.FLAGS.mark_as_parsed()


def test_defaults_are_ddp_over_every_device(parse):
  config = parse()
  assert config.placement == "ddp" and not config.distributed
  placement = placement_setup.make_placement(config, (64,))
  assert dict(placement.mesh.shape) == {"replicate": 1, "fsdp": 8, "tp": 1}
  assert placement.compiler_options == compiler.PRESETS["cpu512"]


def test_mesh_and_overrides_reach_the_placement(parse):
  config = parse("--replicate=2", "--tp=2", "--placement=zero1",
                 "--place=optimizer:owner,frozen:replicated")
  placement = placement_setup.make_placement(config, (64,))
  assert dict(placement.mesh.shape) == {"replicate": 2, "fsdp": 2, "tp": 2}
  assert placement.table.layout("frozen").rules == ()
  assert dict(placement.table.layout("optimizer").rules)["layer"] == (
    "replicate",)


@pytest.mark.parametrize("args,message", [
  (("--place=optimiser:fsdp",), "unknown category 'optimiser'"),
  (("--place=optimizer:d_in=model",), "mesh axis 'model'"),
  (("--compiler=fast",), "--compiler='fast'"),
  (("--num_processes=2", "--process_id=2"), "must lie in"),
  (("--local_device_count=0",), "must be positive"),
])
def test_bad_flags_fail_before_any_compile(parse, args, message):
  with pytest.raises(ValueError, match=message) as info:
    parse(*args)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("args,lead,message", [
  (("--fsdp=3",), (64,),
   "^--replicate/--fsdp/--tp: mesh .* spans 3 devices but 8 are present"),
  (("--local_device_count=4",), (64,),
   "^--local_device_count: 4 local devices were expected but this process "
   "sees 8 cpu device"),
  (("--replicate=2",), (12,),
   "^--batch_size: the batch axis of size 12 does not split"),
])
def test_placements_that_do_not_fit_are_refused(parse, args, lead, message):
  with pytest.raises(ValueError, match=message):
    placement_setup.make_placement(parse(*args), lead)


def test_xla_knows_every_preset_option():
  for name in compiler.PRESETS:
    placement_setup.check_compiler_options(compiler.options(name))
  with pytest.raises(ValueError, match="No such compile option"):
    placement_setup.check_compiler_options({"xla_no_such_option": 1})


def test_compilation_cache_dir_reaches_jax(parse, tmp_path):
  before = jax.config.jax_compilation_cache_dir
  try:
    placement_setup.start(parse(f"--compilation_cache_dir={tmp_path}"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="is a file"):
    parse(f"--compilation_cache_dir={tmp_path / 'file'}")


def _recorded_run(path: pathlib.Path, flags_text: str) -> pathlib.Path:
  path.mkdir()
  (path / run_dir.FLAGS_FILE).write_text(flags_text)
  return path


def test_launch_flags_stay_out_of_the_run_record(parse, tmp_path):
  from decompax.bin import train
  parse("--process_id=1", "--num_processes=2", "--replicate=1",
        "--compiler=bare")
  text = train.resolved_flags_text()
  assert "--process_id" not in text and "--num_processes" not in text
  # A run recorded with a compiler flag (older versions did) resumes
  # under any: the flag no longer names part of the run.
  assert "--compiler" not in text
  older = _recorded_run(tmp_path / "run", text + "--compiler=tuned-v1\n")
  run_dir.check_run_dir(older, text, overwrite=False,
                        defaults=train.flag_defaults())
  assert "--replicate=1" in text and "--placement=ddp" in text


def _setup_args(parse, tms_target, out, *args):
  placement_config = parse(f"--target_path={tms_target}",
                           f"--output_dir={out}", "--batch_size=64", *args)
  config = train_flags.config_from_flags()
  return config, placement_setup.make_placement(placement_config, (64,))


def test_an_authored_layout_that_does_not_tile_fails_before_any_write(
    parse, tms_target, tmp_path):
  out = tmp_path / "run"
  config, placement = _setup_args(parse, tms_target, out, "--placement=zero1",
                                  "--place=optimizer:d_in=fsdp")
  with pytest.raises(ValueError) as info:
    train.setup(config, placement)
  assert str(info.value).startswith(
    "--place: layout optimizer:d_in=fsdp: components/linear1/v [1,5,")
  assert "d_in of size 5, which does not tile fsdp=8" in str(info.value)
  assert "\n" not in str(info.value)
  assert not out.exists()


def _report(capsys) -> list[str]:
  return [line for line in capsys.readouterr().out.splitlines()
          if line.startswith("[placement]")]


def test_setup_reports_preset_fallbacks_once_per_category(
    parse, tms_target, tmp_path, capsys):
  # TMS dims (5, 2) tile no 8-way fsdp: zero1 keeps them replicated.
  config, placement = _setup_args(parse, tms_target, tmp_path / "zero1",
                                  "--placement=zero1")
  train.setup(config, placement)
  lines = _report(capsys)
  categories = [line.split(":")[0] for line in lines]
  assert len(set(categories)) == len(categories)
  assert any(line.startswith("[placement] optimizer: ")
             and "do not tile fsdp=8 (e.g. components/linear1/v [1,5," in line
             for line in lines), lines
  # Nothing shards under ddp except the batch, which tiles: no report.
  config, placement = _setup_args(parse, tms_target, tmp_path / "ddp")
  train.setup(config, placement)
  assert _report(capsys) == []


def test_owner_pad_slots_stay_out_of_every_output(parse, tms_target,
                                                  tmp_path, capsys):
  # C = 7 on tp = 2 and one-layer stacks on replicate = 2: both padded
  # (design §8, I49). The run's checkpoint records the real sizes, and its
  # evals, exported decomposition and figures see only them.
  out = tmp_path / "owner"
  config, placement = _setup_args(
    parse, tms_target, out, "--placement=owner", "--replicate=2", "--tp=2",
    "--c=7", "--num_steps=2", "--eval_every=2",
    "--log_every=1", "--slow_eval_every=0", "--eval_batches=1",
    "--figures_every=0")
  train.train(train.setup(config, placement))
  lines = _report(capsys)
  assert any("linear1 1x7 as 2x8" in line for line in lines), lines
  step = out / checkpoint.CHECKPOINT_DIR / checkpoint.step_name(2)
  manifest = json.loads((step / checkpoint.DECOMPOSITION /
                         checkpoint.MANIFEST_FILE).read_text())
  entry = manifest["arrays"]["components/linear1/v"]
  assert entry["shape"] == [2, 5, 8] and entry["real_shape"] == [1, 5, 7]
  arrays, _ = checkpoint.read_item(step, checkpoint.TRAINING)
  assert arrays["components_opt/0/mu/linear1/v"].shape == (1, 5, 7)
  exported = run_dir.load_arrays(out / "decomposition.npz")[0]
  assert exported["components/linear1/v"].shape == (1, 5, 7)
  records = run_dir.read_metrics(out / run_dir.METRICS_FILE)
  l0 = [r for r in records if "eval/ci_l0/linear1" in r]
  assert l0 and all(np.isfinite(r["eval/ci_l0/linear1"]) for r in l0)


@pytest.mark.slow
def test_a_padded_owner_decomposition_fine_tunes_unpadded(
    parse, tms_target, tmp_path):
  # A run's placement is one of its flags, so a resume keeps it; a fine-tune
  # (--init_from) may place the child anew. Two steps under owner with pad
  # slots, then a ddp child (no pads) starts from exactly the parent's real
  # blocks (design §12, I49).
  common = ("--c=7", "--log_every=1", "--eval_every=0",
            "--slow_eval_every=0", "--figures_every=0")
  parent, child = tmp_path / "parent", tmp_path / "child"
  config, placement = _setup_args(
    parse, tms_target, parent, *common, "--num_steps=2", "--placement=owner",
    "--replicate=2", "--tp=2")
  train.train(train.setup(config, placement))
  config, placement = _setup_args(
    parse, tms_target, child, *common, "--num_steps=1",
    f"--init_from={parent}/latest")
  train.train(train.setup(config, placement))
  start = checkpoint.read_item(
    child / checkpoint.CHECKPOINT_DIR / checkpoint.step_name(0),
    checkpoint.DECOMPOSITION)[0]
  final = run_dir.load_arrays(parent / "decomposition.npz")[0]
  assert final["components/linear1/v"].shape == (1, 5, 7)
  assert start.keys() == final.keys()
  for key in final:
    np.testing.assert_array_equal(start[key], final[key], err_msg=key)

