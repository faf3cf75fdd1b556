"""bin/train: flagfiles, bad input, and one short end-to-end run.

The binary's one-line refusals (an unknown flag, a bad value, a malformed
flagfile line) are rows of tests/bin/test_bad_inputs.py."""

import contextlib
import dataclasses
import errno
import io
import json
import os
import pathlib
from typing import NamedTuple

import jax
import pytest
from absl import flags

from decompax.bin import placement_setup, train, train_flags
from decompax.io import decomposition, run_dir
from decompax.recipe import assembly, terms
from decompax.targets import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAGFILES = sorted((ROOT / "flags").glob("*.flags"))
# Checkpoint LMs (--target=hf) read --model_dir: tests/bin/test_lm_train.py.
TOY_FLAGFILES = [p for p in FLAGFILES if "--target=hf" not in p.read_text()]


def test_there_are_flagfiles_for_every_paper_toy():
  names = {p.stem for p in FLAGFILES}
  assert {"tms_5-2", "tms_5-2-id", "tms_40-10", "tms_40-10-id", "resid_mlp1",
          "resid_mlp2", "resid_mlp3"} <= names


@pytest.mark.parametrize("name", ["tms_5-2-id", "tms_40-10", "tms_40-10-id"])
def test_flagfile_trains_nonlinearity_locality(parse, name):
  """Its measured seed table (docs/recovery.md) rests on the term."""
  config = parse(f"--flagfile={ROOT / 'flags' / f'{name}.flags'}")
  toy, target, _ = assembly.resolve_target(config)
  assert "nonlinearity_locality" in assembly.parts(config, toy, target).term_names


@pytest.mark.parametrize(
  "name", ["tms_5-2-id", "tms_40-10-id", "resid_mlp2", "resid_mlp3"])
def test_flagfile_trains_smooth_l0(parse, name):
  """Under the `p` penalty some of their needed CI settles under the
  patterns' 0.9 line (tms_40-10-id, resid_mlp2, resid_mlp3) or their
  embeddings grow past the target's (tms_5-2-id); their seed tables
  (docs/recovery.md) rest on smooth-L0."""
  config = parse(f"--flagfile={ROOT / 'flags' / f'{name}.flags'}")
  assert config.importance_penalty == "smooth_l0"
  assert config.smooth_l0_gamma_schedule == "linear"


@pytest.mark.parametrize("path", TOY_FLAGFILES, ids=lambda p: p.stem)
def test_every_flagfile_parses_and_builds_its_terms(parse, path):
  config = parse(f"--flagfile={path}")
  toy, target, _ = assembly.resolve_target(config)
  parts = assembly.parts(config, toy, target)
  # A targeted decomposition has no faithfulness term (SPEC §6.6).
  wanted = {"importance_minimality"} | (
    set() if config.target_task else {"faithfulness"})
  assert set(parts.term_names) >= wanted
  # Toys stay fp32 whatever --compute_dtype says (N4).
  assert parts.step_config.compute_dtype is None


def test_defaults_are_the_tms_5_2_flagfile_as_one_run(parse):
  """The library's defaults are TMS 5-2's recipe; the shipped flagfile
  adds only the loss-chosen restarts, at the default seed."""
  default = parse()
  from_file = parse(f"--flagfile={ROOT / 'flags' / 'tms_5-2.flags'}")
  assert from_file == dataclasses.replace(default, restarts=3,
                                          select_at=12000)
  # No seed is pinned to hide a failing one (docs/recovery.md).
  lines = (ROOT / "flags" / "tms_5-2.flags").read_text().splitlines()
  assert not [line for line in lines if line.startswith("--seed")]


# The flagfiles that choose among candidates by loss, where one run fails
# seeds the candidates recover (docs/recovery.md): (restarts, select_at).
RESTARTS = {"tms_5-2": (3, 12000), "embed_16-8": (3, 4000)}


@pytest.mark.parametrize("path", FLAGFILES, ids=lambda p: p.stem)
def test_only_the_measured_flagfiles_select_among_restarts(parse, path):
  config = parse(f"--flagfile={path}", "--model_dir=unused")
  assert (config.restarts, config.select_at) == RESTARTS.get(path.stem,
                                                             (1, 0))


@pytest.mark.parametrize("args,message", [
  (("--c=0",), "--c must be positive, got 0"),
  (("--sites=linear1,nope",), "unknown site 'nope'"),
  (("--lr_schedule=constant", "--lr_final_frac=0.5"), "lr_final_frac"),
  (("--stochastic_coeff=0", "--per_site_coeff=0"), "no reconstruction term"),
  (("--ci_hidden=8,x",), "comma-separated integers"),
  (("--groups_coeff=1", "--recon_groups=linear1+nope"), "unknown site 'nope'"),
  (("--groups_coeff=1",), "needs --recon_groups"),
  (("--pgd_coeff=1", "--pgd_scope=sc"), "needs positions"),
  (("--nonlinearity_coeff=1", "--nonlinearity_weights=attention_head:1"),
   "exactly neuron"),
  (("--log_every=300",), "--eval_every=1000 must be a multiple of"),
  (("--slow_eval_every=1500",), "must be a multiple of --eval_every"),
  (("--eval_every=0",), "--slow_eval_every needs --eval_every"),
  (("--eval_batches=0",), "--eval_batches must be positive"),
  (("--eval_pgd_steps=-1",), "--eval_pgd_steps must be >= 0"),
  (("--eval_pgd_lr=0",), "--eval_pgd_lr must be positive"),
  (("--figure_cpu_share=0",), "--figure_cpu_share must lie in"),
  (("--figure_cpu_share=2",), "--figure_cpu_share must lie in"),
  (("--hidden_coeff=1",), "never stands alone"),
  (("--hidden_coeff=1", "--hidden_terms=fresh_pgd_recon"),
   "not a recon term that takes a rider"),
  (("--hidden_coeff=1", "--hidden_terms=merged_recon"), "which is off"),
  (("--hidden_coeff=1", "--hidden_terms=stochastic_recon",
    "--hidden_points=linear1.out,nope"), "unknown tap keys"),
  (("--merged_coeff=1", "--merged_adv_fraction=1.5"),
   r"--merged_adv_fraction must lie in \[0, 1\], got 1.5"),
])
def test_bad_settings_fail_before_writing(parse, tmp_path, tms_target, args,
                                          message):
  # A cached target: a check after the target's load (the tap keys') does
  # not train the toy first.
  out = tmp_path / "run"
  with pytest.raises(ValueError, match=message):
    config = parse(*args, f"--output_dir={out}",
                   f"--target_path={tms_target}")
    train.setup(config)
  assert not out.exists()


def test_missing_output_parent_is_refused(parse, tmp_path):
  out = tmp_path / "absent" / "run"
  with pytest.raises(ValueError, match="does not exist"):
    train.setup(parse(f"--output_dir={out}"))
  assert not out.parent.exists()


def test_existing_run_with_other_flags_is_refused(parse, tmp_path):
  out = tmp_path / "run"
  out.mkdir()
  (out / "flags.txt").write_text("--c=7\n")
  with pytest.raises(ValueError, match="--overwrite"):
    train.setup(parse(f"--output_dir={out}"))
  assert (out / "flags.txt").read_text() == "--c=7\n"
  assert sorted(os.listdir(out)) == ["flags.txt"]


class ShortRun(NamedTuple):
  """`SHORT_RUN`'s launch, run in this process: its arguments, output
  directory and printed lines, and the transfer guard each call of the
  step loop ran under."""
  args: tuple[str, ...]
  out: pathlib.Path
  stdout: str
  guards: list


# Evals and a save inside the loop as well as at its ends, a slow eval at
# the last step and a faithfulness warmup: every kind of device read a
# launch makes.
SHORT_RUN = ("--num_steps=20", "--batch_size=64", "--log_every=10",
             "--eval_every=10", "--slow_eval_every=20", "--save_every=10",
             "--faithfulness_warmup_steps=5")


@pytest.fixture(scope="module")
def short_run(tms_target, tmp_path_factory, implicit_reads_fail) -> ShortRun:
  """One launch of `bin/train` (its setup and loop, as `main` calls them)
  on a cached untrained TMS 5-2: the records do not depend on the weights,
  and a launch that trains its toy is `finished_run("tms")`'s. Implicit
  scalar reads fail inside the step loop, as the transfer guard makes them
  fail on an accelerator (CPU arrays are host memory: the real guard never
  fires here)."""
  out = tmp_path_factory.mktemp("short") / "run"
  args = (*SHORT_RUN, f"--target_path={tms_target}", f"--output_dir={out}")
  guards, run_steps = [], train.run_steps

  def checked(*a):
    guards.append(jax.config.jax_transfer_guard_device_to_host)
    with implicit_reads_fail():
      return run_steps(*a)

  printed = io.StringIO()
  flags.FLAGS.unparse_flags()
  try:
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(
        printed):
      patch.setattr(train, "run_steps", checked)
      argv = flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)
      flags.FLAGS(["train", *argv])
      prepared = train.setup(train_flags.config_from_flags())
      try:
        train.train(prepared)
      finally:  # the run directory's lock, as the launch's exit would
        os.close(prepared.lock)
  finally:
    flags.FLAGS.unparse_flags()
    flags.FLAGS.mark_as_parsed()
  return ShortRun(args, out, printed.getvalue(), guards)


def test_short_run_writes_every_record(short_run, parse,
                                      assert_bitwise_equal):
  out = short_run.out
  assert "step 20/20" in short_run.stdout and "ETA" in short_run.stdout
  assert "--num_steps=20" in (out / "flags.txt").read_text()
  records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  # Step 0 is the fresh run's eval baseline; the last step evals too.
  assert [r["step"] for r in records] == [0, 10, 20]
  for key in ("loss/faithfulness", "loss/stochastic_recon", "ci_l0/linear1",
              "step_time_s", "eval/recon/ci_masked", "eval/alive/linear1"):
    assert key in records[-1]
  assert "eval/recon/zero" in records[0] and "loss/total" not in records[0]
  assert (out / "report" / "index.html").is_file()
  arrays, meta = run_dir.load_arrays(out / "decomposition.npz")
  assert arrays["components/linear1/v"].shape == (1, 5, 20)
  assert [s["name"] for s in meta["sites"]] == ["linear1", "linear2"]
  # The file alone rebuilds the decomposition, equal to the final checkpoint.
  npz, final = decomposition.load_npz(out / "decomposition.npz"), (
    decomposition.load_decomposition(out))
  assert npz.ci_config == final.ci_config and npz.step == final.step == 20
  assert_bitwise_equal((npz.components, npz.ci_params),
                       (final.components, final.ci_params))
  for name in ("ci_on_features", "components", "losses"):
    png = (out / "figures" / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "checkpoints" / "000000020" / "checkpoint.json").is_file()
  # The same command again would resume; a finished run is refused (§12)
  # by the launch's setup (a ValueError is the binary's one-line exit 2:
  # tests/bin/test_bad_inputs.py).
  with pytest.raises(ValueError, match=r"already holds the finished run "
                     r"\(step 20 of 20\)"):
    train.setup(parse(*short_run.args))


def test_only_the_step_loop_runs_under_the_transfer_guard(short_run):
  # The loop reads the device only through device_get, at log and eval
  # steps; setup (a toy target's training and checks) and the final writing
  # read it freely.
  assert short_run.guards == ["disallow"]
  assert jax.config.jax_transfer_guard_device_to_host is None
  assert (short_run.out / "decomposition.npz").is_file()


def test_parse_config_leaves_the_flags_at_their_defaults():
  from absl import flags as absl_flags

  from decompax.bin import train_flags as tf

  assert tf.parse_config("--c=7", "--seed=3").c == 7
  assert absl_flags.FLAGS.c == absl_flags.FLAGS["c"].default


def test_rerun_with_other_flags_names_them(parse, tmp_path):
  out = tmp_path / "run"
  parse(f"--output_dir={out}", "--lr=0.001", "--c=8")
  run_dir.prepare_run_dir(out, train.resolved_flags_text(), overwrite=False)
  with pytest.raises(ValueError) as info:
    train.setup(parse(f"--output_dir={out}", "--lr=0.002", "--c=8"))
  assert str(info.value) == (
    f"--output_dir: output dir {out} holds a run with other flags (--lr was "
    "0.001, now 0.002); resume it with the same flags, replace it, or choose "
    "another directory (--overwrite replaces it)")


def _disk_full(monkeypatch):
  def fsync(fd):
    del fd
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "fsync", fsync)


def test_rerun_on_a_full_disk_is_refused_before_writing(parse, tmp_path,
                                                        tms_target,
                                                        monkeypatch):
  out = tmp_path / "run"
  args = (f"--output_dir={out}", "--c=8", f"--target_path={tms_target}")
  parse(*args)
  run_dir.prepare_run_dir(out, train.resolved_flags_text(), overwrite=False)
  before = {p: p.stat().st_mtime_ns for p in out.iterdir()}
  config = parse(*args)
  _disk_full(monkeypatch)
  with pytest.raises(ValueError) as info:
    train.setup(config)
  assert str(info.value) == (
    f"--output_dir: cannot write to {out}: No space left on device; free "
    "space there and rerun, or choose another directory")
  assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_a_full_disk_at_the_launch_record_is_one_line(tmp_path, monkeypatch):
  from decompax.bin import run_records
  from decompax.io import checkpoint

  _disk_full(monkeypatch)
  with pytest.raises(checkpoint.CheckpointError) as info:
    run_records.record_launch(str(tmp_path), "resume")
  assert str(info.value) == (
    f"--output_dir: cannot write to {tmp_path / 'run_info.json'}: No space "
    "left on device; free space there and rerun, or choose another "
    "directory")
  assert os.listdir(tmp_path) == []


def test_unwritable_output_dirs_are_refused_in_setup(parse, tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("x")
  with pytest.raises(ValueError,
                     match=f"^--output_dir: {afile} is a file, not a dir"):
    train.setup(parse(f"--output_dir={afile / 'x'}"))
  if os.path.isdir("/sys"):  # read-only even for root
    with pytest.raises(ValueError, match="^--output_dir: cannot write to /sys: "):
      train.setup(parse("--output_dir=/sys/decompax_run"))


def test_a_run_of_an_older_version_is_resumed_not_refused(parse, tmp_path,
                                                         tms_target):
  # Its flags.txt still names a flag removed since (--pgd_bundle) and lacks
  # one added since at its default (--components_init): same run.
  out = tmp_path / "run"
  args = (f"--output_dir={out}", "--c=8", f"--target_path={tms_target}")
  parse(*args)
  lines = [line for line in train.resolved_flags_text().splitlines()
           if not line.startswith("--components_init=")]
  out.mkdir()
  (out / "flags.txt").write_text("\n".join([*lines, "--pgd_bundle=pgd"]) + "\n")
  config = parse(*args)
  train.setup(config)
  assert (out / "flags.txt").read_text() == train.resolved_flags_text()
  # Off its default, the added flag is a change like any other.
  config = parse(*args, "--components_init=projected")
  (out / "flags.txt").write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match="--components_init was not recorded, "
                     "now projected"):
    train.setup(config)


def test_a_launch_builds_each_term_once(parse, tmp_path, monkeypatch):
  """`setup` checks and plans the run and `assembly.start` starts it from
  that plan: no term is built a second time (to validate, or to place)."""
  calls = []

  def counted(build):
    def build_once(*args):
      calls.append(args[2])  # the term's name
      return build(*args)
    return build_once

  monkeypatch.setattr(terms, "TERMS", tuple(
    t._replace(build=counted(t.build)) for t in terms.TERMS))
  toy = registry.get("tms_5-2")
  cache = tmp_path / "target.npz"
  run_dir.save_arrays(cache, toy.weights_to_arrays(toy.init(jax.random.key(0))),
                      {"target": toy.name, "target_seed": toy.default_seed})
  config = parse(f"--flagfile={ROOT / 'flags' / 'tms_5-2_vpd.flags'}",
                 "--c=8", "--batch_size=8", f"--target_path={cache}",
                 f"--output_dir={tmp_path / 'run'}")
  placement = placement_setup.make_placement(
    placement_setup.PlacementConfig(placement="zero1"), (8,))
  prepared = train.setup(config, placement)
  run = assembly.start(prepared.plan, prepared.weights)
  assert sorted(calls) == sorted(run.plan.parts.term_names)
  assert len(calls) == 5
