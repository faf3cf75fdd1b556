"""bin/train checkpoints: exact resume, preemption, fine-tune init (SPEC §12).

The in-process tests drive bin/train's own pieces (setup, build_run, the
checkpoint session) around ONE compiled step of a tiny TMS 5-2 run with the
full VPD recipe (subset recon, persistent PGD with its Adam moments, EMA
frequency minimality). One subprocess test kills a real `bin/train` mid-write
and then stops its resumed run with a real SIGTERM.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, NamedTuple

import jax
import pytest

from decompax.bin import checkpointing, placement_setup, run_records, train
from decompax.bin import train_flags, wandb_sink
from decompax.recipe import assembly, engine
from decompax.core import health
from decompax.io import checkpoint, load_decomposition, run_dir
from decompax.placement import mesh as mesh_lib
from decompax.placement import shardings
from decompax.placement import table as table_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY = 8, 4
VPD_ARGS = (
  f"--flagfile={ROOT / 'flags' / 'tms_5-2_vpd.flags'}",
  f"--num_steps={STEPS}", "--batch_size=16", "--log_every=2",
  f"--save_every={SAVE_EVERY}", "--keep_all", "--faithfulness_warmup_steps=3",
  "--eval_every=0", "--slow_eval_every=0",
)


class Straight(NamedTuple):
  config: Any
  toy: Any
  target: Any
  weights: Any
  compiled: Any
  data_key: Any
  state: Any
  metrics: list
  output_dir: str
  target_path: str
  term_names: tuple[str, ...]


def _session(config, target, term_names=()):
  os.makedirs(config.output_dir, exist_ok=True)
  return checkpointing.open_session(config, config.output_dir, target.sites,
                                    engine.ci_config(config), term_names)


def _restored_run(config, straight):
  """Return the run `bin/train` would build to resume `config`."""
  session = _session(config, straight.target)
  try:
    return assembly.build_run(config, straight.toy, straight.target,
                              straight.weights,
                              checkpointing.restorer(session))
  finally:
    checkpointing.close(session)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tms_target):
  """The uninterrupted run: label 0 after warmup, saves at 4 and 8, on a
  cached untrained TMS 5-2 (every check compares runs with each other,
  whatever the weights; training the toy would be most of the setup)."""
  root = tmp_path_factory.mktemp("resume")
  target_path = str(tms_target)
  config = train_flags.parse_config(*VPD_ARGS, f"--output_dir={root / 'straight'}",
                   f"--target_path={target_path}")
  prepared = train.setup(config)
  toy, target = prepared.plan.parts.record, prepared.target
  weights, output_dir = prepared.weights, prepared.output_dir
  session = _session(config, target)
  try:
    run = assembly.start(prepared.plan, weights,
                         checkpointing.restorer(session))
    assert run.warmup_losses.shape == (3,)
    checkpointing.after_warmup(session, run.state)
    compiled = run.built.step.lower(run.state, weights, run.data_key).compile()
    state, metrics = run.state, []
    for done in range(1, STEPS + 1):
      state, m = compiled(state, weights, run.data_key)
      metrics.append(jax.device_get(m))
      checkpointing.after_step(session, state, done)
  finally:
    checkpointing.close(session)
  return Straight(config, toy, target, weights, compiled, run.data_key, state,
                  metrics, output_dir, target_path,
                  tuple(t.name for t in run.terms))


def test_the_vpd_state_holds_adversary_and_ema_state(straight):
  arrays, _ = checkpoint.read_item(
    checkpoint.step_path(checkpointing.checkpoint_dir(straight.output_dir),
                         STEPS), checkpoint.TRAINING)
  assert "term_states/persistent_pgd_recon/sources/linear1/m" in arrays
  assert "term_states/persistent_pgd_recon/count" in arrays
  assert "term_states/frequency_minimality/ema/linear1" in arrays
  assert "rng" in arrays and "step" in arrays
  assert int(arrays["step"]) == STEPS


def test_resume_from_half_way_is_bitwise_the_straight_run(
    straight, tmp_path, assert_bitwise_equal):
  # I36: the run "killed" after its step-4 save resumes and ends identical.
  out = tmp_path / "run"
  shutil.copytree(straight.output_dir, out)
  ckpts = out / checkpoint.CHECKPOINT_DIR
  shutil.rmtree(ckpts / checkpoint.step_name(STEPS))
  metrics = out / run_dir.METRICS_FILE
  for step in (2, 4, 6):  # the killed attempt had logged past its save
    run_dir.append_metrics(metrics, {"step": step})
  config = dataclasses.replace(straight.config, output_dir=str(out))

  def at_resume(session, run):
    assert session.mode == "resume"
    assert run.warmup_losses.shape == (0,)  # no warmup on resume
    assert [r["step"] for r in run_dir.read_metrics(metrics)] == [2, 4]

  _resume_to_the_end(config, straight, assert_bitwise_equal, at_resume)
  assert checkpoint.committed_steps(ckpts) == [0, SAVE_EVERY, STEPS]


def _resume_to_the_end(config, straight, assert_bitwise_equal,
                       at_resume=lambda session, run: None) -> None:
  """Resume `config` from its step-4 checkpoint and run it to the end,
  checking every step's metrics and the final state against `straight`."""
  session = _session(config, straight.target)
  try:
    run = assembly.build_run(config, straight.toy, straight.target,
                             straight.weights, checkpointing.restorer(session))
    assert int(jax.device_get(run.state.step)) == SAVE_EVERY
    at_resume(session, run)
    state = run.state
    for done in range(SAVE_EVERY + 1, STEPS + 1):
      state, m = straight.compiled(state, straight.weights, run.data_key)
      assert_bitwise_equal(jax.device_get(m), straight.metrics[done - 1])
      checkpointing.after_step(session, state, done)
  finally:
    checkpointing.close(session)
  assert_bitwise_equal(state, straight.state)


def test_sigterm_saves_the_completed_step_and_exits_75(straight, tmp_path):
  config = dataclasses.replace(straight.config, output_dir=str(tmp_path / "r"))
  before = signal.getsignal(signal.SIGTERM)
  session = _session(config, straight.target)
  run = assembly.build_run(config, straight.toy, straight.target,
                           straight.weights, checkpointing.restorer(session))
  checkpointing.after_warmup(session, run.state)
  state, _ = straight.compiled(run.state, straight.weights, run.data_key)
  os.kill(os.getpid(), signal.SIGTERM)  # through bin/train's real handler
  with pytest.raises(SystemExit) as exit_info:
    checkpointing.after_step(session, state, 1)
  assert exit_info.value.code == checkpointing.REQUEUE_EXIT_CODE == 75
  assert signal.getsignal(signal.SIGTERM) == before
  ckpts = checkpointing.checkpoint_dir(config.output_dir)
  assert checkpoint.committed_steps(ckpts) == [0, 1]
  assert load_decomposition(config.output_dir).step == 1


def test_signal_during_warmup_exits_without_saving(straight, tmp_path,
                                                   monkeypatch):  # I40
  monkeypatch.setenv(checkpointing.FAULT_ENV, "sigterm_before_warmup")
  config = dataclasses.replace(straight.config, output_dir=str(tmp_path / "r"))
  session = _session(config, straight.target)
  run = assembly.build_run(config, straight.toy, straight.target,
                           straight.weights, checkpointing.restorer(session))
  assert run.warmup_losses.shape == (3,)
  with pytest.raises(SystemExit) as exit_info:
    checkpointing.after_warmup(session, run.state)
  assert exit_info.value.code == 75
  assert not os.path.exists(checkpointing.checkpoint_dir(config.output_dir))


def test_checkpointing_none_writes_nothing_and_refuses_reentry(
    straight, tmp_path, monkeypatch):  # I39
  config = dataclasses.replace(straight.config, checkpointing="none",
                               output_dir=str(tmp_path / "r"))
  sites, ci_config = straight.target.sites, engine.ci_config(config)
  checkpointing.check_entry(config, config.output_dir, sites, ci_config)
  session = _session(config, straight.target)
  run = assembly.build_run(config, straight.toy, straight.target,
                           straight.weights, checkpointing.restorer(session))
  checkpointing.after_warmup(session, run.state)
  state = run.state
  monkeypatch.setenv(checkpointing.FAULT_ENV,
                     f"sigterm_after_step={SAVE_EVERY}")
  with pytest.raises(SystemExit) as exit_info:
    for done in range(1, STEPS + 1):
      state, _ = straight.compiled(state, straight.weights, run.data_key)
      checkpointing.after_step(session, state, done)
  assert exit_info.value.code == 75 and done == SAVE_EVERY
  assert not os.path.exists(checkpointing.checkpoint_dir(config.output_dir))
  with pytest.raises(ValueError, match="cannot be re-entered"):
    checkpointing.check_entry(config, config.output_dir, sites, ci_config)
  again = dataclasses.replace(config, overwrite=True)
  checkpointing.check_entry(again, config.output_dir, sites, ci_config)


def test_a_finished_run_refuses_to_resume(straight):
  args = (straight.config, straight.output_dir, straight.target.sites,
          engine.ci_config(straight.config))
  records = os.path.join(straight.output_dir, "decomposition.npz")
  # Killed after the final save but before the final records: resumable.
  assert not os.path.exists(records)
  checkpointing.check_entry(*args)
  pathlib.Path(records).write_bytes(b"")
  try:
    with pytest.raises(ValueError, match=r"finished run \(step 8 of 8\)"):
      checkpointing.check_entry(*args)
  finally:
    os.remove(records)


def test_init_from_restores_only_the_decomposition(
    straight, tmp_path, assert_bitwise_equal):  # I38
  parent = os.path.join(straight.output_dir, str(SAVE_EVERY))
  config = dataclasses.replace(
    straight.config, output_dir=str(tmp_path / "ft"), init_from=parent,
    lr=3e-3, pgd_coeff=0.25)
  sites, ci_config = straight.target.sites, engine.ci_config(config)
  checkpointing.check_entry(config, config.output_dir, sites, ci_config)
  session = _session(config, straight.target)
  assert session.mode == "init_from"
  run = assembly.build_run(config, straight.toy, straight.target,
                           straight.weights, checkpointing.restorer(session))
  fresh_session = _session(dataclasses.replace(
    config, init_from=None, output_dir=str(tmp_path / "fresh")),
    straight.target)
  fresh = assembly.build_run(config, straight.toy, straight.target,
                             straight.weights,
                             checkpointing.restorer(fresh_session))
  assert run.warmup_losses.shape == (0,)  # no warmup
  loaded = load_decomposition(checkpoint.step_path(
    checkpointing.checkpoint_dir(straight.output_dir), SAVE_EVERY))
  assert_bitwise_equal(run.state.components, loaded.components)
  assert_bitwise_equal(run.state.ci_params, loaded.ci_params)
  # Optimizers, adversary sources, EMA, step and rng are a fresh run's.
  for field in ("components_opt", "ci_opt", "term_states", "step", "rng"):
    assert_bitwise_equal(getattr(run.state, field),
                          getattr(fresh.state, field))
  checkpointing.after_warmup(session, run.state)  # label 0 of the new run
  assert checkpoint.committed_steps(session.directory) == [0]
  checkpointing.close(session)
  checkpointing.close(fresh_session)


@pytest.mark.parametrize("change,message", [
  ({"c": 10}, "site linear1.c is 20 in the parent, 10 here"),
  ({"ci_hidden": (8,)}, "ci_config.hidden is [16] in the parent, [8] here"),
  ({"sites": ("linear2",)}, "sites are linear1,linear2 in the parent, "
   "linear2 here"),
])
def test_init_from_refuses_a_structural_mismatch(straight, tmp_path, change,
                                                 message):  # I38
  config = dataclasses.replace(
    straight.config, output_dir=str(tmp_path / "ft"),
    init_from=os.path.join(straight.output_dir, "latest"), **change)
  sites = engine.select_sites(straight.toy.sites(config.c), config.sites,
                              config.target)
  with pytest.raises(ValueError) as info:
    checkpointing.check_entry(config, config.output_dir, sites,
                              engine.ci_config(config))
  assert message in str(info.value)
  assert not os.path.exists(config.output_dir)


def test_init_from_names_a_missing_step(straight, tmp_path):
  config = dataclasses.replace(
    straight.config, output_dir=str(tmp_path / "ft"),
    init_from=os.path.join(straight.output_dir, "3"))
  with pytest.raises(ValueError, match="no checkpoint of step 3"):
    checkpointing.check_entry(config, config.output_dir,
                              straight.target.sites,
                              engine.ci_config(config))


def _bin_train(args, env_extra=None, **kwargs):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop(checkpointing.FAULT_ENV, None)
  env.update(env_extra or {})
  return subprocess.Popen(
    [sys.executable, "-P", str(ROOT / "bin" / "train"), *args], cwd=ROOT,
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    **kwargs)


def test_killed_mid_write_then_sigterm_resumes_without_losing_steps(
    straight, tmp_path, output_lines):
  out = tmp_path / "run"
  args = ["--num_steps=100000", "--batch_size=16", "--log_every=5",
          "--per_site_coeff=0", "--save_every=5", "--keep_last=2",
          "--faithfulness_warmup_steps=2",
          "--eval_every=0", "--slow_eval_every=0",
          f"--target_path={straight.target_path}", f"--output_dir={out}"]
  ckpts = out / checkpoint.CHECKPOINT_DIR
  # A SIGKILL after the first item of step 10's checkpoint was written.
  killed = _bin_train(args, {checkpointing.FAULT_ENV: "kill_mid_save=10"})
  output = "".join(output_lines(killed))
  assert killed.wait(timeout=60) == -signal.SIGKILL, output[-2000:]
  assert checkpoint.committed_steps(ckpts) == [0, 5]
  assert os.path.exists(ckpts / ".tmp-000000010" / "decomposition")
  assert [r["step"] for r in run_dir.read_metrics(out / "metrics.jsonl")] == [
    5, 10]

  # The same command resumes from step 5; a real SIGTERM then stops it.
  resumed = _bin_train(args)
  seen, stopped_at = [], None
  for line in output_lines(resumed):
    seen.append(line)
    if stopped_at is None and line.startswith("step 20/"):
      resumed.send_signal(signal.SIGTERM)
      stopped_at = 20
  output = "".join(seen)
  assert resumed.wait(timeout=60) == 75, output[-2000:]
  assert "[target] loaded" in output and "[warmup]" not in output
  assert "removed .tmp-000000010" in output
  assert "resumed from step 5" in output
  final = load_decomposition(out).step
  assert final >= stopped_at
  assert f"stop signal: step {final} saved" in output
  records = [r["step"] for r in run_dir.read_metrics(out / "metrics.jsonl")]
  assert records == list(range(5, final // 5 * 5 + 1, 5))
  assert not [n for n in os.listdir(ckpts) if n.startswith(".")]
  launches = json.loads((out / "run_info.json").read_text())["launches"]
  assert [entry["mode"] for entry in launches] == ["fresh", "resume"]
  assert launches[0]["versions"]["tensorstore"]


def test_sigterm_mid_warmup_stops_at_a_warmup_step_within_seconds(
    straight, tmp_path, output_lines):  # I40
  out = tmp_path / "run"
  # Ten million warmup steps: minutes, far longer than the wait below.
  process = _bin_train([
    "--num_steps=10", "--batch_size=16", "--faithfulness_warmup_steps=10000000",
    "--eval_every=0", "--slow_eval_every=0", "--figures_every=0",
    f"--target_path={straight.target_path}", f"--output_dir={out}"])
  try:
    seen, lines = [], output_lines(process)
    for line in lines:
      seen.append(line)
      if line.startswith("[warmup] 10000000 faithfulness steps"):
        break
    time.sleep(3)  # into the warmup's loop, past its compile
    process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    seen.extend(lines)
    code = process.wait(timeout=120)
    waited = time.monotonic() - signalled
  finally:
    process.kill()
    process.wait()
  output = "".join(seen)
  assert code == checkpointing.REQUEUE_EXIT_CODE, output[-2000:]
  assert waited < 10, output[-2000:]
  assert ("stop signal during the faithfulness warmup, after " in output
          and " of its 10000000 steps: nothing saved" in output), output
  assert checkpoint.committed_steps(out / checkpoint.CHECKPOINT_DIR) == []


@pytest.mark.parametrize("args,message", [
  (("--save_every=0",), "--save_every must be positive"),
  (("--keep_last=0",), "--keep_last must be positive"),
  (("--init_from=runs",), "--init_from must be <run_dir>/<step>"),
  (("--init_from=runs/x/step5",), "--init_from must be <run_dir>/<step>"),
  (("--profile_steps=5",), "--profile_steps must be START:END"),
  (("--num_steps=10", "--profile_steps=4:11"), "0 <= START < END <= "
   "--num_steps"),
])
def test_bad_checkpoint_flags_are_refused(args, message):
  with pytest.raises(ValueError, match=message):
    train_flags.parse_config(*args)


def test_profile_window_writes_a_trace(straight, tmp_path):
  config = dataclasses.replace(straight.config, output_dir=str(tmp_path),
                               profile_steps="1:2")
  session = _session(dataclasses.replace(config, checkpointing="none"),
                     straight.target)
  run = assembly.build_run(config, straight.toy, straight.target,
                           straight.weights, None)
  state = run.state
  for index in range(3):
    run_records.profile_before_step(config, config.output_dir, index)
    state, _ = straight.compiled(state, straight.weights, run.data_key)
    run_records.profile_after_step(config, config.output_dir, state,
                                         index + 1)
  checkpointing.close(session)
  traces = [name for _, _, names in os.walk(tmp_path / "profile")
            for name in names if name.endswith(".xplane.pb")]
  assert len(traces) == 1


def _truncate_first_shard(step_dir):
  arrays = os.path.join(step_dir, checkpoint.DECOMPOSITION, "arrays",
                        "components", "linear1", "v", "c", "0", "0", "0")
  with open(arrays, "r+b") as f:
    f.truncate(8)


def _resumable_copy(straight, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(straight.output_dir, out)
  ckpts = out / checkpoint.CHECKPOINT_DIR
  shutil.rmtree(ckpts / checkpoint.step_name(STEPS))
  return out, ckpts


def test_resume_skips_a_damaged_newest_checkpoint(straight, tmp_path,
                                                  capsys):
  out, ckpts = _resumable_copy(straight, tmp_path)
  _truncate_first_shard(ckpts / checkpoint.step_name(SAVE_EVERY))
  config = dataclasses.replace(straight.config, output_dir=str(out))
  run = _restored_run(config, straight)
  assert int(jax.device_get(run.state.step)) == 0
  printed = capsys.readouterr().out
  assert "checkpoint 000000004 is damaged and is skipped" in printed
  assert "resumed from step 0" in printed


@pytest.mark.parametrize("damage,message", [
  ("all", "all 2 checkpoints are damaged"),
  ("foreign", "belongs to another run: sites are linear1,linear2 in the "
   "parent, linear1 here"),
])
def test_unusable_checkpoints_are_one_line_errors(straight, tmp_path, damage,
                                                  message):
  out, ckpts = _resumable_copy(straight, tmp_path)
  config = dataclasses.replace(straight.config, output_dir=str(out))
  target = straight.target
  if damage == "all":
    for step in (0, SAVE_EVERY):
      _truncate_first_shard(ckpts / checkpoint.step_name(step))
  else:
    config = dataclasses.replace(config, sites=("linear1",))
    target = target._replace(sites=target.sites[:1])
  session = _session(config, target)
  try:
    with pytest.raises(checkpoint.CheckpointError) as info:
      assembly.build_run(config, straight.toy, target, straight.weights,
                         checkpointing.restorer(session))
  finally:
    checkpointing.close(session)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_a_moved_run_resumes_from_its_new_place(straight, tmp_path, parse):
  # flags.txt records --output_dir, but where a run lies is not what it is.
  out, _ = _resumable_copy(straight, tmp_path)
  args = (*VPD_ARGS, f"--target_path={straight.target_path}")
  parse(*args, f"--output_dir={tmp_path / 'old'}")
  (out / run_dir.FLAGS_FILE).write_text(train.resolved_flags_text())
  config = parse(*args, f"--output_dir={out}")
  prepared = train.setup(config)
  os.close(prepared.lock)
  assert (out / run_dir.FLAGS_FILE).read_text() == (
    train.resolved_flags_text())
  assert f"--output_dir={out}\n" in train.resolved_flags_text()
  run = _restored_run(config, straight)
  assert int(jax.device_get(run.state.step)) == SAVE_EVERY


@pytest.mark.parametrize("evidence,shown", [
  ("records", "metrics.jsonl records up to step 6"),
  ("results", "its decomposition.npz")])
def test_a_run_whose_checkpoints_are_gone_is_not_restarted_silently(
    straight, tmp_path, evidence, shown):
  out, ckpts = _resumable_copy(straight, tmp_path)
  shutil.rmtree(ckpts)
  if evidence == "records":
    for step in (0, 2, 6):
      run_dir.append_metrics(out / run_dir.METRICS_FILE, {"step": step})
  else:
    (out / "decomposition.npz").write_bytes(b"")
  config = dataclasses.replace(straight.config, output_dir=str(out))
  structure = (straight.target.sites, engine.ci_config(config))
  with pytest.raises(ValueError) as info:
    checkpointing.check_entry(config, str(out), *structure)
  assert str(info.value) == (
    f"output dir {out} holds a run that has trained ({shown}) but no "
    "checkpoint to resume it from; pass --overwrite to train it again from "
    "step 0, or choose another --output_dir")
  checkpointing.check_entry(dataclasses.replace(config, overwrite=True),
                            str(out), *structure)
  # A run stopped during its warmup saved and logged nothing: it starts
  # again as the requeue asks.
  (out / "decomposition.npz").unlink(missing_ok=True)
  (out / run_dir.METRICS_FILE).unlink(missing_ok=True)
  checkpointing.check_entry(config, str(out), *structure)


def test_overwrite_removes_every_entry_checkpointing_writes():
  written = (checkpoint.CHECKPOINT_DIR, checkpointing.NONE_MARKER,
             run_records.RUN_INFO_FILE, run_records.PROFILE_DIR,
             wandb_sink.STATE_FILE)
  assert set(written) <= set(run_dir.RUN_ENTRIES)
  assert {checkpoint.CHECKPOINT_DIR, run_records.PROFILE_DIR} <= set(
    run_dir.RUN_DIRS)


def test_a_placed_resume_reads_each_leaf_into_its_shards(
    straight, tmp_path, monkeypatch, assert_bitwise_equal):
  """The restore is handed the zero1 shardings of a 2x2x2 mesh and its
  arrays are the placed state itself: no leaf passes through one device."""
  out, _ = _resumable_copy(straight, tmp_path)
  config = dataclasses.replace(straight.config, output_dir=str(out))
  table = table_lib.make_table("zero1")
  mesh = placement_setup.build_mesh(mesh_lib.MeshShape(2, 2, 2))
  handed, restored = [], []
  restore_item = checkpoint.restore_item

  def spy(path, item, template, shardings=None, **kwargs):
    handed.append(shardings)
    restored.append(restore_item(path, item, template, shardings, **kwargs))
    return restored[-1]

  monkeypatch.setattr(checkpoint, "restore_item", spy)
  session = _session(config, straight.target)
  try:
    placed = assembly.build_run(config, straight.toy, straight.target,
                                straight.weights,
                                checkpointing.restorer(session),
                                shardings.Placement(mesh, table))
  finally:
    checkpointing.close(session)
  monkeypatch.undo()
  want = shardings.named(mesh, shardings.state_specs(
    table, placed.state, (config.batch_size,), dict(mesh.shape)))
  items = checkpoint.split_state(want)
  assert handed == [items[checkpoint.DECOMPOSITION],
                    items[checkpoint.TRAINING]]
  for leaf, sharding in zip(jax.tree.leaves(placed.state),
                            jax.tree.leaves(want)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  # The start kept the restored arrays rather than copying them again.
  assert {id(x) for x in jax.tree.leaves(placed.state)} <= {
    id(x) for x in jax.tree.leaves(restored)}
  assert not placed.state.components["linear1"].v.sharding.is_fully_replicated
  plain = _restored_run(config, straight)
  assert int(jax.device_get(plain.state.step)) == SAVE_EVERY
  assert_bitwise_equal(placed.state, plain.state)


def test_a_placed_init_from_reads_the_parent_into_its_shards(
    straight, tmp_path, assert_bitwise_equal):  # I38
  config = dataclasses.replace(
    straight.config, output_dir=str(tmp_path / "ft"),
    init_from=os.path.join(straight.output_dir, str(SAVE_EVERY)))
  mesh = placement_setup.build_mesh(mesh_lib.MeshShape(2, 2, 2))
  table = table_lib.make_table("zero1")
  session = _session(config, straight.target)
  try:
    run = assembly.build_run(config, straight.toy, straight.target,
                             straight.weights, checkpointing.restorer(session),
                             shardings.Placement(mesh, table))
  finally:
    checkpointing.close(session)
  want = shardings.named(mesh, shardings.state_specs(
    table, run.state, (config.batch_size,), dict(mesh.shape)))
  for leaf, sharding in zip(jax.tree.leaves(run.state),
                            jax.tree.leaves(want)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  loaded = load_decomposition(checkpoint.step_path(
    checkpointing.checkpoint_dir(straight.output_dir), SAVE_EVERY))
  assert_bitwise_equal(run.state.components, loaded.components)
  assert int(jax.device_get(run.state.step)) == 0


def _poison(tree):
  """Return `tree` with every float leaf NaN."""
  return jax.tree.map(
    lambda a: a * float("nan") if jax.numpy.issubdtype(
      a.dtype, jax.numpy.floating) else a, tree)


def _save_raw(ckpts, step, state, like):
  """Write `state` as label `step` with the metadata of step dir `like`,
  bypassing the trainer's finiteness check (an older trainer's save)."""
  metadata = {item: checkpoint.item_metadata(like, item)
              for item in (checkpoint.DECOMPOSITION, checkpoint.TRAINING)}
  checkpoint.save(ckpts, step, checkpoint.split_state(state), metadata)


def test_resume_never_chooses_a_nonfinite_checkpoint(straight, tmp_path,
                                                     capsys):
  out, ckpts = _resumable_copy(straight, tmp_path)
  newest = ckpts / checkpoint.step_name(SAVE_EVERY)
  state = _restored_run(dataclasses.replace(
    straight.config, output_dir=str(out)), straight).state
  _save_raw(ckpts, SAVE_EVERY, state._replace(
    components=_poison(state.components)), newest)
  capsys.readouterr()
  run = _restored_run(dataclasses.replace(
    straight.config, output_dir=str(out)), straight)
  assert int(jax.device_get(run.state.step)) == 0
  printed = capsys.readouterr().out
  assert "checkpoint 000000004 holds non-finite values and is skipped" in (
    printed)
  assert "components/linear1/v holds NaN or infinity" in printed
  # A library user is warned too, and gets the older, finite step.
  with pytest.warns(UserWarning, match="holds non-finite values"):
    assert load_decomposition(out).step == 0
  with pytest.warns(UserWarning, match="not a usable decomposition"):
    assert load_decomposition(newest).step == SAVE_EVERY


def test_a_checkpoint_without_the_health_record_resumes(
    straight, tmp_path, assert_bitwise_equal):
  # Checkpoints written before the state carried `health` still resume,
  # with a clean record.
  out, ckpts = _resumable_copy(straight, tmp_path)
  training = ckpts / checkpoint.step_name(SAVE_EVERY) / checkpoint.TRAINING
  shutil.rmtree(training / checkpoint.ARRAYS_DIR / "health")
  manifest = json.loads((training / checkpoint.MANIFEST_FILE).read_text())
  manifest["arrays"] = {k: v for k, v in manifest["arrays"].items()
                        if not k.startswith("health/")}
  (training / checkpoint.MANIFEST_FILE).write_text(json.dumps(manifest))
  run = _restored_run(dataclasses.replace(
    straight.config, output_dir=str(out)), straight)
  assert int(jax.device_get(run.state.step)) == SAVE_EVERY
  assert_bitwise_equal(run.state.health, health.healthy())


def test_a_nonfinite_state_is_never_saved_and_nothing_is_pruned(
    straight, tmp_path):
  out, ckpts = _resumable_copy(straight, tmp_path)
  config = dataclasses.replace(straight.config, output_dir=str(out),
                               keep_all=False, keep_last=1)
  session = _session(config, straight.target, ("recon",))
  try:
    state = _restored_run(config, straight).state
    bad = state._replace(ci_params=_poison(state.ci_params),
                         step=state.step + 1)
    with pytest.raises(checkpointing.Diverged) as info:
      checkpointing.save(session, bad)
  finally:
    checkpointing.close(session)
  message = str(info.value)
  assert "the state of step 5 is not finite" in message
  assert f"newest good checkpoint: {ckpts / '000000004'}" in message
  assert "\n" not in message
  assert checkpoint.committed_steps(ckpts) == [0, SAVE_EVERY]


def test_a_resume_from_label_0_keeps_no_stale_baseline(straight, tmp_path):
  # The loop logs the step-0 baseline again whenever it starts at step 0.
  out, ckpts = _resumable_copy(straight, tmp_path)
  shutil.rmtree(ckpts / checkpoint.step_name(SAVE_EVERY))
  metrics = out / run_dir.METRICS_FILE
  metrics.unlink(missing_ok=True)
  for step in (0, 2):
    run_dir.append_metrics(metrics, {"step": step})
  run = _restored_run(dataclasses.replace(
    straight.config, output_dir=str(out)), straight)
  assert int(jax.device_get(run.state.step)) == 0
  assert run_dir.read_metrics(metrics) == []


# The VPD recipe's stateful terms and their positions among all its terms.
POSITIONS = {"frequency_minimality": 2, "persistent_pgd_recon": 4}


def _positional_layout(training):
  """Rewrite a training item into the layout written while term states were
  a tuple over every loss term: `term_states/<j>/...`, `j` the position."""
  arrays = training / checkpoint.ARRAYS_DIR / "term_states"
  for name, j in POSITIONS.items():
    (arrays / name).rename(arrays / str(j))

  def old(key):
    parts = key.split("/")
    if parts[0] == "term_states":
      parts[1] = str(POSITIONS[parts[1]])
    return "/".join(parts)

  manifest = json.loads((training / checkpoint.MANIFEST_FILE).read_text())
  manifest["arrays"] = {old(k): v for k, v in manifest["arrays"].items()}
  (training / checkpoint.MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_checkpoint_with_term_states_by_position_resumes_bitwise(
    straight, tmp_path, capsys, assert_bitwise_equal):
  assert {n: straight.term_names.index(n) for n in POSITIONS} == POSITIONS
  out, ckpts = _resumable_copy(straight, tmp_path)
  for step in (0, SAVE_EVERY):
    _positional_layout(ckpts / checkpoint.step_name(step) / checkpoint.TRAINING)
  half = ckpts / checkpoint.step_name(SAVE_EVERY)
  assert "term_states/4/sources/linear1/m" in checkpoint.item_paths(
    half, checkpoint.TRAINING)
  config = dataclasses.replace(straight.config, output_dir=str(out))
  _resume_to_the_end(config, straight, assert_bitwise_equal)
  assert ("term states stored by position, read by name (2: "
          "frequency_minimality, 4: persistent_pgd_recon)"
          ) in capsys.readouterr().out
  # Its next save is keyed by name.
  assert "term_states/persistent_pgd_recon/count" in checkpoint.item_paths(
    ckpts / checkpoint.step_name(STEPS), checkpoint.TRAINING)


def test_term_states_by_position_of_another_structure_are_refused(
    straight, tmp_path):
  out, ckpts = _resumable_copy(straight, tmp_path)
  for step in (0, SAVE_EVERY):
    _positional_layout(ckpts / checkpoint.step_name(step) / checkpoint.TRAINING)
  config = dataclasses.replace(straight.config, output_dir=str(out),
                               pgd_coeff=0.0)
  session = _session(config, straight.target)
  try:
    with pytest.raises(checkpoint.CheckpointError) as info:
      assembly.build_run(config, straight.toy, straight.target,
                         straight.weights, checkpointing.restorer(session))
  finally:
    checkpointing.close(session)
  message = str(info.value)
  assert ("stores 2 term states by position, this run has 1 stateful terms "
          "(frequency_minimality)") in message and "\n" not in message
