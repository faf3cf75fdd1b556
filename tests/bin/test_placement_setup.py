"""Scale-out flags of bin/train: validation, compiler options, the mesh."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest
from absl import flags

from decompax.bin import placement_setup

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
  assert placement.compiler_options == {}


def test_mesh_and_overrides_reach_the_placement(parse):
  config = parse("--replicate=2", "--tp=2", "--placement=zero1",
                 "--place=optimizer:owner,frozen:replicated")
  placement = placement_setup.make_placement(config, (64,))
  assert dict(placement.mesh.shape) == {"replicate": 2, "fsdp": 2, "tp": 2}
  assert placement.table.layout("frozen").rules == ()
  assert dict(placement.table.layout("optimizer").rules)["stack"] == (
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
  (("--fsdp=3",), (64,), "spans 3 devices but 8 are present"),
  (("--local_device_count=4",), (64,), "sees 8 cpu device"),
  (("--replicate=2",), (12,), "batch axis of size 12 does not split"),
])
def test_placements_that_do_not_fit_are_refused(parse, args, lead, message):
  with pytest.raises(ValueError, match=message):
    placement_setup.make_placement(parse(*args), lead)


def test_compiler_presets_and_mappings():
  assert placement_setup.compiler_options("bare") == {}
  tuned = placement_setup.compiler_options("tuned-v1")
  assert tuned["xla_gpu_enable_latency_hiding_scheduler"] is True
  placement_setup.check_compiler_options(tuned)  # XLA knows every option
  assert placement_setup.compiler_options(
    "xla_gpu_enable_triton_gemm=false,xla_gpu_all_reduce_combine_threshold_"
    "bytes=1024") == {"xla_gpu_enable_triton_gemm": False,
                      "xla_gpu_all_reduce_combine_threshold_bytes": 1024}
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


def test_launch_flags_stay_out_of_the_run_record(parse):
  from decompax.bin import train
  parse("--process_id=1", "--num_processes=2", "--replicate=1")
  text = train.resolved_flags_text()
  assert "--process_id" not in text and "--num_processes" not in text
  assert "--replicate=1" in text and "--placement=ddp" in text


def test_binary_reports_a_bad_mesh_in_one_line(tmp_path):
  result = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), "--fsdp=2",
     f"--output_dir={tmp_path / 'run'}"],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("train: error:")
  assert "spans 2 devices but 1 are present" in lines[0]
  assert not (tmp_path / "run").exists()
