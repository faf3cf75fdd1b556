"""Tests for decompax.io.checkpoint (and the tensor_store beneath it)."""

import json
import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from decompax.core import ci_fns, ci_transformer, sites as sites_lib
from decompax.io import checkpoint, decomposition, load_decomposition


class Moments(NamedTuple):
  m: jax.Array
  v: jax.Array


SITES = (sites_lib.SiteSpec("a", "sq", 0, 4, 4, 8),
         sites_lib.SiteSpec("b", "sq", 1, 4, 4, 8),
         sites_lib.SiteSpec("head", "head", 0, 4, 3, 8))
CI_CONFIG = ci_fns.CIConfig("component_mlp", (4,))


def _decomposition(seed=0, sites=SITES):
  key_vu, key_ci = jax.random.split(jax.random.key(seed))
  return {
    "components": sites_lib.init_components(key_vu, sites),
    "ci_params": ci_fns.make_ci_fn(CI_CONFIG, sites).init(key_ci),
  }


def _training(seed=0):
  keys = jax.random.split(jax.random.key(seed + 100), 2)
  return {
    "opt": Moments(jax.random.normal(keys[0], (2, 4, 8)),
                   jnp.zeros((2, 4, 8), jnp.bfloat16)),
    "term_states": (None, {"count": jnp.int32(3),
                           "source": jax.random.uniform(keys[1], (1, 9))}),
    "step": jnp.int32(11),
    "rng": jax.random.key(seed),
  }


def _items(seed=0):
  return {checkpoint.DECOMPOSITION: _decomposition(seed),
          checkpoint.TRAINING: _training(seed)}


def _metadata():
  return {checkpoint.DECOMPOSITION: decomposition.decomposition_metadata(
    SITES, CI_CONFIG, target="chain")}


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_round_trip_is_bitwise_with_keys_bf16_and_none(
    tmp_path, assert_bitwise_equal):
  items = _items()
  path = checkpoint.save(tmp_path, 11, items, _metadata())
  assert os.path.basename(path) == "000000011"
  assert checkpoint.read_index(path)["items"] == ["decomposition", "training"]
  for name, tree in items.items():
    restored = checkpoint.restore_item(path, name, _shapes(tree))
    assert_bitwise_equal(restored, tree)
  restored = checkpoint.restore_item(path, "training",
                                     _shapes(items["training"]))
  assert restored["term_states"][0] is None
  assert isinstance(restored["opt"], Moments)
  arrays, _ = checkpoint.read_item(path, "training")
  assert sorted(arrays) == sorted(
    ["opt/m", "opt/v", "term_states/1/count", "term_states/1/source", "step",
     "rng"])


def test_split_and_join_state_cover_every_field():
  class State(NamedTuple):
    components: dict
    ci_params: dict
    opt: tuple
    step: jax.Array

  state = State({"k": jnp.ones(2)}, {"w": jnp.zeros(1)}, (jnp.ones(3),),
                jnp.int32(4))
  items = checkpoint.split_state(state)
  assert set(items["decomposition"]) == {"components", "ci_params"}
  assert set(items["training"]) == {"opt", "step"}
  template = State({"k": None}, {"w": None}, None, None)
  assert checkpoint.join_state(template, items) == state


@pytest.mark.multidevice
def test_written_at_four_devices_restores_at_one_and_eight(
    tmp_path, assert_bitwise_equal):
  devices = jax.devices()
  mesh4 = Mesh(np.array(devices[:4]), ("c",))
  value = jnp.arange(2 * 4 * 8, dtype=jnp.float32).reshape(2, 4, 8)
  sharded = jax.device_put(value, NamedSharding(mesh4, P(None, None, "c")))
  replicated = jax.device_put(jnp.float32(2.5), NamedSharding(mesh4, P()))
  key = jax.device_put(jax.random.key(3), NamedSharding(mesh4, P()))
  tree = {"v": sharded, "s": replicated, "rng": key}
  path = checkpoint.save(tmp_path, 1, {"training": tree})
  # Each of the four devices wrote its own shard file; replicas wrote none.
  chunk_root = os.path.join(path, "training", "arrays", "v", "c", "0", "0")
  assert sorted(os.listdir(chunk_root)) == ["0", "1", "2", "3"]

  one = jax.sharding.SingleDeviceSharding(devices[5])
  at_one = checkpoint.restore_item(path, "training", _shapes(tree), one)
  assert at_one["v"].sharding == one
  assert_bitwise_equal(at_one, tree)

  mesh8 = Mesh(np.array(devices), ("d",))
  layout = {"v": NamedSharding(mesh8, P(None, None, "d")),
            "s": NamedSharding(mesh8, P()), "rng": NamedSharding(mesh8, P())}
  at_eight = checkpoint.restore_item(path, "training", _shapes(tree), layout)
  assert at_eight["v"].sharding == layout["v"]
  assert {s.data.shape for s in at_eight["v"].addressable_shards} == {(2, 4, 1)}
  assert_bitwise_equal(at_eight, tree)


def test_a_failed_save_leaves_no_step_and_is_cleaned_up(tmp_path):
  class Crash(Exception):
    pass

  def crash(item):
    raise Crash(item)

  with pytest.raises(Crash):
    checkpoint.save(tmp_path, 5, _items(), _metadata(), after_item=crash)
  assert checkpoint.committed_steps(tmp_path) == []
  assert checkpoint.latest_step(tmp_path) is None
  assert checkpoint.remove_partial(tmp_path) == [".tmp-000000005"]
  assert os.listdir(tmp_path) == []


def test_saving_a_label_again_replaces_it(tmp_path, assert_bitwise_equal):
  checkpoint.save(tmp_path, 2, _items(seed=0))
  path = checkpoint.save(tmp_path, 2, _items(seed=1))
  restored = checkpoint.restore_item(path, "training", _shapes(_training(1)))
  assert_bitwise_equal(restored, _training(1))
  assert sorted(os.listdir(tmp_path)) == ["000000002"]


def test_prune_keeps_the_newest_and_the_protected(tmp_path):
  for step in (0, 5, 10, 15, 20):
    checkpoint.save(tmp_path, step, {"training": {"x": jnp.int32(step)}})
  removed = checkpoint.prune(tmp_path, keep_last=2, protect=(0,))
  assert removed == [5, 10]
  assert checkpoint.committed_steps(tmp_path) == [0, 15, 20]


def _array_dir(path, key="components/sq/v"):
  return os.path.join(path, "decomposition", "arrays", *key.split("/"))


def _truncate_shard(path):
  shard = os.path.join(_array_dir(path), "c", "0", "0", "0")
  with open(shard, "rb") as f:
    data = f.read()
  with open(shard, "wb") as f:
    f.write(data[:len(data) // 2])


def _flip_byte(path):
  shard = os.path.join(_array_dir(path), "c", "0", "0", "0")
  with open(shard, "r+b") as f:
    f.seek(5)
    byte = f.read(1)
    f.seek(5)
    f.write(bytes([byte[0] ^ 0xFF]))


def _edit_zarr_json(path, field, value):
  meta_path = os.path.join(_array_dir(path), "zarr.json")
  with open(meta_path) as f:
    meta = json.load(f)
  meta[field] = value
  with open(meta_path, "w") as f:
    json.dump(meta, f)


def _remove_shard(path):
  os.remove(os.path.join(_array_dir(path), "c", "0", "0", "0"))


def _garble_manifest(path):
  with open(os.path.join(path, "decomposition", "manifest.json"), "w") as f:
    f.write("{not json")


def _remove_item(path):
  shutil.rmtree(os.path.join(path, "decomposition"))


def _remove_index(path):
  os.remove(os.path.join(path, "checkpoint.json"))


CORRUPTIONS = {
  "truncated array file": (_truncate_shard, "DATA_LOSS"),
  "flipped byte": (_flip_byte, "Digest mismatch"),
  "wrong dtype metadata": (
    lambda p: _edit_zarr_json(p, "data_type", "float64"), "data_type"),
  "wrong shape metadata": (
    lambda p: _edit_zarr_json(p, "shape", [2, 4, 9]), "components/sq/v"),
  "missing shard file": (_remove_shard, "shard file c/0/0/0 is missing"),
  "garbled manifest": (_garble_manifest, "manifest.json is unreadable"),
  "missing item": (_remove_item, "has no item 'decomposition'"),
  "missing index": (_remove_index, "checkpoint.json is missing"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_damage_is_a_one_line_error(tmp_path, name):
  corrupt, message = CORRUPTIONS[name]
  path = checkpoint.save(tmp_path, 3, _items(), _metadata())
  corrupt(path)
  template = _shapes(_decomposition())
  with pytest.raises(checkpoint.DamagedCheckpoint) as info:
    checkpoint.read_index(path)
    checkpoint.restore_item(path, "decomposition", template)
  assert message in str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["truncated array file", "missing item",
                                  "missing index"])
def test_latest_falls_back_past_a_damaged_step(
    tmp_path, name, assert_bitwise_equal):
  checkpoint.save(tmp_path, 1, _items(seed=1), _metadata())
  newest = checkpoint.save(tmp_path, 2, _items(seed=2), _metadata())
  CORRUPTIONS[name][0](newest)
  reports = []
  template = _shapes(_decomposition())
  step, restored = checkpoint.restore_latest(
    tmp_path, lambda p: checkpoint.restore_item(p, "decomposition", template),
    reports.append)
  assert step == 1
  assert_bitwise_equal(restored, _decomposition(seed=1))
  assert len(reports) == 1 and "000000002 is damaged" in reports[0]


def test_processes_fall_back_together_past_a_step_one_cannot_read(
    tmp_path, assert_bitwise_equal):
  """Step 2 reads here, but another process found its own shards of it
  damaged (`agree` says not every process read it): this process falls
  back to step 1 with it, and never runs the collective check on step 2."""
  checkpoint.save(tmp_path, 1, _items(seed=1), _metadata())
  checkpoint.save(tmp_path, 2, _items(seed=2), _metadata())
  template = _shapes(_decomposition())
  asked, checked, reports = [], [], []

  def agree(step, ok):
    asked.append((step, ok))
    return ok and step != 2

  step, restored = checkpoint.restore_latest(
    tmp_path, lambda p: checkpoint.restore_item(p, "decomposition", template),
    reports.append, check=lambda path, tree: checked.append(path),
    agree=agree)
  assert step == 1
  assert_bitwise_equal(restored, _decomposition(seed=1))
  assert asked == [(2, True), (1, True)]
  assert checked == [checkpoint.step_path(tmp_path, 1)]
  assert len(reports) == 1 and "000000002 is damaged" in reports[0]
  assert "another process found its shards damaged" in reports[0]


def test_a_step_that_fails_its_check_is_skipped(tmp_path,
                                                assert_bitwise_equal):
  checkpoint.save(tmp_path, 1, _items(seed=1), _metadata())
  checkpoint.save(tmp_path, 2, _items(seed=2), _metadata())
  template = _shapes(_decomposition())
  reports = []

  def check(path, tree):
    if path.endswith(checkpoint.step_name(2)):
      raise checkpoint.NonfiniteCheckpoint(f"checkpoint {path}: NaN")

  step, restored = checkpoint.restore_latest(
    tmp_path, lambda p: checkpoint.restore_item(p, "decomposition", template),
    reports.append, check=check)
  assert step == 1
  assert_bitwise_equal(restored, _decomposition(seed=1))
  assert "000000002 holds non-finite values" in reports[0]


def test_one_process_agrees_with_itself():
  assert checkpoint.processes_agree(3, True)
  assert not checkpoint.processes_agree(3, False)


def test_every_step_damaged_is_an_error(tmp_path):
  path = checkpoint.save(tmp_path, 1, _items(), _metadata())
  _truncate_shard(path)
  template = _shapes(_decomposition())
  with pytest.raises(checkpoint.CheckpointError, match="all 1 checkpoints"):
    checkpoint.restore_latest(
      tmp_path, lambda p: checkpoint.restore_item(p, "decomposition", template),
      lambda m: None)


def test_a_checkpoint_of_another_site_set_is_refused_by_name(tmp_path):
  path = checkpoint.save(tmp_path, 1, _items(), _metadata())
  other = _shapes(_decomposition(sites=SITES[:2]))
  with pytest.raises(checkpoint.CheckpointError) as info:
    checkpoint.restore_item(path, "decomposition", other)
  assert not isinstance(info.value, checkpoint.DamagedCheckpoint)
  assert "ci_params/head" in str(info.value)
  wider = _shapes(_decomposition(
    sites=SITES[:2] + (sites_lib.SiteSpec("head", "head", 0, 4, 5, 8),)))
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"components/head/u is stored as float32\[1, 8, 3\]"
                     r", this run expects float32\[1, 8, 5\]"):
    checkpoint.restore_item(path, "decomposition", wider)


def test_load_decomposition_needs_no_training_item(
    tmp_path, assert_bitwise_equal):  # I37
  run = tmp_path / "run"
  directory = run / checkpoint.CHECKPOINT_DIR
  checkpoint.save(directory, 4, _items(seed=4), _metadata())
  newest = checkpoint.save(directory, 8, _items(seed=8), _metadata())
  shutil.rmtree(os.path.join(newest, "training"))
  for path in (run, directory, newest):
    loaded = load_decomposition(path)
    assert loaded.step == 8
    assert loaded.sites == SITES and loaded.ci_config == CI_CONFIG
    assert loaded.metadata == {"target": "chain"}
    assert isinstance(loaded.components["sq"], sites_lib.Factors)
    assert_bitwise_equal(
      {"components": loaded.components, "ci_params": loaded.ci_params},
      _decomposition(seed=8))


def test_load_decomposition_of_nothing_is_an_error(tmp_path):
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
    load_decomposition(tmp_path)


def test_configs_survive_json():
  transformer = ci_transformer.TransformerCIConfig(
    chunks=(ci_transformer.Chunk(("a", "b"), ("a",)),
            ci_transformer.Chunk(("b",), ("b",))),
    tap_widths=(("resid", 4),), d_model=8, n_heads=2, n_kv_heads=1)
  config = ci_fns.CIConfig("transformer", (), transformer)
  text = json.dumps(decomposition.to_json(config))
  assert decomposition.from_json(ci_fns.CIConfig, json.loads(text)) == config
  assert decomposition.from_json(sites_lib.SiteSpec,
                              decomposition.to_json(SITES[0])) == SITES[0]


def test_token_target_vpd_state_resumes_bitwise(
    token_target, tmp_path, assert_bitwise_equal):  # I36
  """An LM-shaped target with Muon, persistent PGD over positions and an EMA
  frequency term: 4 straight steps equal 2 steps, save, restore onto a
  freshly built state, 2 steps."""
  from decompax.core import adversary, optim, train_step
  from decompax.core import step_records
  from decompax.core.schedules import Schedule
  from decompax.losses import adversarial, recon
  from decompax.losses import loss_terms as terms

  target, weights = token_target
  lead = (3, 5)
  sites = target.sites
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), sites)
  pgd = adversarial.PersistentConfig(
    adversary.SourceConfig(scope="sc"), Schedule(0.05), n_warmup=1)
  loss_terms = (
    terms.faithfulness_term(1.0),
    terms.ema_frequency_minimality_term(1e-3, 1.0, 15.0, 4.0, sites),
    adversarial.persistent_pgd_term(
      "pgd", 0.5, recon.all_sites_plan(sites, "all"), pgd, sites, True),
  )
  config = step_records.StepConfig(
    total_steps=4, components_opt=optim.MuonConfig(Schedule(1e-2)),
    ci_opt=optim.AdamWConfig(Schedule(1e-2, "cosine", 0.1)))
  built = train_step.make_train_step(
    target, ci_fn, loss_terms, config,
    sample_inputs=lambda key: jax.random.randint(key, lead, 0, 6))

  def fresh(seed):
    comps = sites_lib.init_components(jax.random.key(seed), sites)
    return built.init(comps, ci_fn.init(jax.random.key(seed + 1)),
                      jax.random.key(seed + 2), lead)

  data_key = jax.random.key(5)
  state, metrics = fresh(0), []
  for _ in range(4):
    state, m = built.step(state, weights, data_key)
    metrics.append(jax.device_get(m))
  straight = state

  state = fresh(0)
  for _ in range(2):
    state, _ = built.step(state, weights, data_key)
  path = checkpoint.save(tmp_path, 2, checkpoint.split_state(state))
  del state
  template = jax.eval_shape(lambda: fresh(10))  # structure, no values
  items = checkpoint.split_state(template)
  restored = {name: checkpoint.restore_item(path, name, tree)
              for name, tree in items.items()}
  state = checkpoint.join_state(template, restored)
  assert isinstance(state, step_records.TrainState)
  for k in range(2, 4):
    state, m = built.step(state, weights, data_key)
    assert_bitwise_equal(jax.device_get(m), metrics[k])
  assert_bitwise_equal(state, straight)
