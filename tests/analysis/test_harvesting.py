"""analysis/harvesting: statistics of every component over a stream of batches,
checked against direct computation, resumed after an interruption, written
as a zarr store with a manifest, and the same when sharded over devices."""

import dataclasses
import json
import math
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import AxisType

from decompax.analysis import (
  explore, harvest_accumulate, harvest_baselines, harvest_batches,
  harvest_settings)
from decompax.analysis import harvesting as harvest_lib
from decompax.io import harvest_store
from decompax.measures import ci_counts
from decompax.measures import component_stats as stats_lib
from decompax.placement import shardings
from decompax.placement import table as table_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Two ablated batches: a harvest stopped in batch 1's ablations resumes to
# this one's result.
REQUEST = harvest_settings.Request(positions=4 * 8 * 32, batch_size=8, top_k=5,
                                   window_before=3, window_after=2,
                                   ablation_batches=2)


@pytest.fixture(scope="module")
def harvested(induction, tmp_path_factory):
  settings = harvest_settings.resolve(induction, REQUEST)
  out = str(tmp_path_factory.mktemp("harvest"))
  record = harvest_lib.harvest(induction, settings, out, save_every_s=0.0,
                               ablation_chunk=5, say=lambda _: None)
  harvest_lib.write_manifest(out, "run", induction, settings, record)
  return settings, out, record


def _read(out, site, field):
  store = ts.open({"driver": "zarr3", "kvstore": {
    "driver": "file", "path": os.path.join(out, site, field)}}).result()
  return store.read().result()


def _direct(run, settings):
  """Every batch's CI and inputs, computed one by one."""
  batch = harvest_batches.batch_source(run, settings)
  inputs = [batch(i) for i in range(settings.n_batches)]
  return inputs, [jax.device_get(explore.component_ci(run, x))
                  for x in inputs]


def test_counts_sums_and_top_contexts_match_direct_computation(
    induction, harvested):
  settings, out, _ = harvested
  assert settings.n_batches == 4 and settings.seq_len == 32
  inputs, cis = _direct(induction, settings)
  threshold = settings.threshold
  for site in induction.target.sites:
    ci = np.stack([c[site.name] for c in cis])            # [n, B, T, C]
    fired = (ci > threshold).reshape(-1, site.c)
    np.testing.assert_array_equal(_read(out, site.name, "fired"),
                                  fired.sum(0))
    np.testing.assert_allclose(_read(out, site.name, "ci_sum"),
                               ci.reshape(-1, site.c).sum(0), rtol=1e-5)
    coactive = _read(out, site.name, "coactive")
    np.testing.assert_array_equal(
      coactive, fired.T.astype(np.int64) @ fired.astype(np.int64))
    # Log-spaced bands: column 0 holds CI below 1e-9, the last band
    # [10^-0.5, 1] of the 18 over [1e-9, 1].
    histogram = _read(out, site.name, "histogram")
    flat = ci.reshape(-1, site.c)
    assert histogram.shape == (site.c, ci_counts.LOG_DENSITY_BINS + 1)
    np.testing.assert_array_equal(histogram.sum(1), len(flat))
    np.testing.assert_array_equal(histogram[:, 0], (flat < 1e-9).sum(0))
    np.testing.assert_array_equal(histogram[:, -1],
                                  (flat >= 10 ** -0.5).sum(0))
    # The top CI per component is the k largest over every batch, and the
    # window's centre holds that CI and the token at that position.
    top_ci = _read(out, site.name, "top_ci")
    np.testing.assert_allclose(
      top_ci, -np.sort(-ci.reshape(-1, site.c), axis=0)[:5].T, rtol=1e-6)
    window_ci = _read(out, site.name, "top_context_ci")
    centre = settings.before
    np.testing.assert_allclose(window_ci[:, :, centre], top_ci, rtol=1e-6)
    tokens = np.stack(inputs).reshape(-1, settings.seq_len)
    flat = ci.reshape(-1, settings.seq_len, site.c)
    context = _read(out, site.name, "top_context")
    for c in range(site.c):
      row, col = np.unravel_index(np.argmax(flat[:, :, c]), flat.shape[:2])
      assert context[c, 0, centre] == tokens[row, col]


def test_a_fresh_window_has_the_input_types_of_an_accumulated_one(induction):
  """So the jitted accumulation compiles once, not again on a harvest's
  second batch and after every save (a weakly typed `-inf` once made each
  window's second batch a compile)."""
  settings = harvest_settings.resolve(induction, REQUEST)
  placed = harvest_accumulate.place(induction, settings)
  pipe = harvest_lib._pipeline(induction, settings, 5, placed)
  fresh = harvest_lib._fresh_window(pipe.shapes, placed)()
  types = jax.tree.map(jax.typeof, fresh)
  window, _ = pipe.accumulate(fresh, placed.weights, placed.components,
                              placed.ci_params, pipe.batch(0))
  assert jax.tree.map(jax.typeof, window) == types
  pipe.accumulate(window, placed.weights, placed.components,
                  placed.ci_params, pipe.batch(1))
  assert pipe.accumulate._cache_size() == 1


def test_ablation_effect_sums_the_divergence_where_a_component_fires(
    induction, harvested):
  settings, out, _ = harvested
  assert settings.ablation_batches == 2 < settings.n_batches
  inputs, cis = _direct(induction, settings)
  site = induction.target.sites[0]
  counts = _read(out, site.name, "ablation_count")
  fired = np.stack([ci[site.name] > settings.threshold   # the first two
                    for ci in cis[:2]])                   # batches only
  np.testing.assert_array_equal(counts, fired.reshape(-1, site.c).sum(0))
  # One component's sum, from its own ablated forwards.
  c = int(np.argmax(counts))
  expected = 0.0
  for x, fired_x in zip(inputs[:2], fired):
    one = explore.ablated_forward(induction, x, ablate={site.name: [c]})
    clean = jax.nn.log_softmax(one.clean.astype(np.float32), axis=-1)
    masked = jax.nn.log_softmax(one.output.astype(np.float32), axis=-1)
    kl = np.sum(np.exp(clean) * (clean - masked), axis=-1)
    expected += float(np.sum(np.where(fired_x[..., c], kl, 0.0)))
  assert _read(out, site.name, "ablation_sum")[c] == pytest.approx(
    expected, rel=1e-3, abs=1e-6)
  assert counts[c] > 0


def test_manifest_records_the_settings_and_the_throughput(
    induction, harvested):
  settings, out, record = harvested
  manifest = json.load(open(os.path.join(out, harvest_store.MANIFEST)))
  assert manifest["settings"]["n_batches"] == settings.n_batches
  assert manifest["positions"] == 4 * 8 * 32
  assert manifest["ratio_to_clean"] == record["ratio_to_clean"] > 0
  assert not os.path.exists(os.path.join(out, harvest_store.STATE_FILE))
  # A rerun of a complete harvest does nothing.
  said = []
  assert harvest_lib.harvest(induction, settings, out, say=said.append) == {}
  assert said == [f"[harvest] {out} is complete; nothing to do"]


def test_an_interrupted_harvest_resumes_to_the_same_result(
    induction, harvested, tmp_path, monkeypatch):
  settings, whole, _ = harvested
  out = str(tmp_path)
  source = harvest_batches.batch_source

  def failing(run, s, *placed):
    batch = source(run, s, *placed)

    def fetch(i):
      if i == 3:
        raise KeyboardInterrupt  # as a kill would, after batch 2's save
      return batch(i)
    return fetch

  monkeypatch.setattr(harvest_batches, "batch_source", failing)
  with pytest.raises(KeyboardInterrupt):
    harvest_lib.harvest(induction, settings, out, save_every_s=0.0,
                        ablation_chunk=5, say=lambda _: None)
  assert os.path.exists(os.path.join(out, harvest_store.STATE_FILE))
  monkeypatch.setattr(harvest_batches, "batch_source", source)
  said = []
  harvest_lib.harvest(induction, settings, out, save_every_s=0.0,
                      ablation_chunk=5, say=said.append)
  assert "[harvest] resuming after batch 3" in said
  for site in induction.target.sites:
    for field in harvest_settings.FIELDS:
      np.testing.assert_array_equal(_read(out, site.name, field),
                                    _read(whole, site.name, field), field)


def test_a_stopped_harvest_saves_and_resumes_to_the_same_result(
    induction, harvested, tmp_path):
  """Asked to stop before batch 2 with no save due, it saves batches 0-1
  and raises; a temporary a killed save left goes on the rerun."""
  settings, whole, _ = harvested
  out = str(tmp_path)
  lines = []

  def stop():  # once batch 1's progress line is out
    return any(line.startswith("[harvest] batch 2/4") for line in lines)

  with pytest.raises(harvest_lib.Stopped, match="after batch 2 of 4"):
    harvest_lib.harvest(induction, settings, out, save_every_s=60.0,
                        ablation_chunk=5, say=lines.append, stop=stop)
  assert sorted(os.listdir(out)) == [harvest_store.STATE_FILE]
  (tmp_path / ".state.npz.k1ll3d00.tmp").write_bytes(b"PK")
  said = []
  harvest_lib.harvest(induction, settings, out, save_every_s=60.0,
                      ablation_chunk=5, say=said.append)
  assert said[:2] == [
    "[harvest] removed .state.npz.k1ll3d00.tmp, left by a killed harvest",
    "[harvest] resuming after batch 2"]
  assert not (tmp_path / ".state.npz.k1ll3d00.tmp").exists()
  # `whole` saved after every batch: its sums were added in another order.
  _assert_same_harvest(induction, out, whole)


def test_only_the_components_that_fired_are_ablated_to_the_same_sums(
    induction, tmp_path):
  """Each batch ablates only what fired in it, one chunk at a time: the
  sums equal those of every component's ablated forward, one pass."""
  one = dataclasses.replace(REQUEST, positions=8 * 32)
  inputs, cis = _direct(induction, harvest_settings.resolve(induction, one))
  # A threshold only the components with the highest CI pass on the batch.
  peaks = np.concatenate([ci.reshape(-1, ci.shape[-1]).max(0)
                          for ci in cis[0].values()])
  settings = harvest_settings.resolve(induction, dataclasses.replace(
    one, threshold=float(peaks[peaks < peaks.max()].max())))
  harvest_lib.harvest(induction, settings, str(tmp_path), ablation_chunk=5,
                      say=lambda _: None)
  target, sites = induction.target, induction.target.sites
  clean = target.clean_forward(induction.weights, inputs[0], ())[0]
  site_of = np.repeat(np.arange(len(sites)), [s.c for s in sites])
  every = np.asarray(stats_lib.ablation_divergence(
    target, induction.weights, induction.decomposition.components,
    inputs[0], clean, tuple(target.batch_lead_shape(inputs[0])),
    jax.numpy.asarray(site_of, np.int32),
    jax.numpy.asarray(np.concatenate([np.arange(s.c) for s in sites]),
                      np.int32), 7))
  fired_of = harvest_accumulate.fired_components(induction, cis[0],
                                                 settings.threshold)
  assert 0 < len(fired_of[0]) < len(site_of)   # some are skipped
  at = 0
  for site in sites:
    fired = cis[0][site.name] > settings.threshold
    want = [np.sum(every[at + c] * fired[..., c]) for c in range(site.c)]
    np.testing.assert_allclose(_read(str(tmp_path), site.name,
                                     "ablation_sum"), want,
                               rtol=1e-4, atol=1e-7)
    at += site.c


def test_the_ablations_say_their_progress(induction, tmp_path):
  """Before its first ablated forward the harvest says how many it will
  run, then every `progress_every_s` how many are done, the rate and the
  time left."""
  settings = harvest_settings.resolve(induction, dataclasses.replace(
    REQUEST, positions=8 * 32, ablation_batches=1))
  said = []
  harvest_lib.harvest(induction, settings, str(tmp_path), ablation_chunk=5,
                      say=said.append, progress_every_s=0.0)
  _, cis = _direct(induction, settings)
  n = len(harvest_accumulate.fired_components(induction, cis[0],
                                              settings.threshold)[0])
  total = sum(s.c for s in induction.target.sites)
  assert said[0] == (f"[harvest] ablation batch 1/1: the {n} of {total} "
                     "components that fired, 5 at a time")
  progress = [line for line in said if " component " in line]
  done = [int(line.split(" component ")[1].split("/")[0])
          for line in progress]
  assert done == [min(k, n) for k in range(5, n + 5, 5)]
  assert all(line.startswith("[harvest] ablation batch 1/1: component ")
             and f"/{n}  " in line and " components/s  ETA " in line
             for line in progress)
  batch_line = [line.startswith("[harvest] batch 1/1") for line in said]
  assert said.index(progress[-1]) < batch_line.index(True)


def test_a_harvest_stopped_in_its_ablations_resumes_to_the_same_result(
    induction, harvested, tmp_path):
  """Stopped between two chunks of batch 1's ablations, it saves the
  batches before and redoes batch 1 on resuming."""
  settings, whole, _ = harvested
  assert settings.ablation_batches == 2
  out = str(tmp_path / "stopped")
  lines = []

  def stop():  # once batch 1's first chunk is ablated
    return any(line.startswith("[harvest] ablation batch 2/2: component ")
               for line in lines)

  with pytest.raises(harvest_lib.Stopped, match="after batch 1 of 4"):
    harvest_lib.harvest(induction, settings, out, save_every_s=60.0,
                        ablation_chunk=5, say=lines.append, stop=stop,
                        progress_every_s=0.0)
  assert lines[-1].startswith("[harvest] ablation batch 2/2: component 5/")
  said = []
  harvest_lib.harvest(induction, settings, out, save_every_s=60.0,
                      ablation_chunk=5, say=said.append)
  assert "[harvest] resuming after batch 1" in said
  _assert_same_harvest(induction, out, whole)


def test_a_language_model_ablates_only_when_asked(induction, finished_run):
  """A toy's ablations cost little, a language model's a forward of the
  whole batch per component: by default only the toy ablates."""
  assert harvest_settings.resolve(induction, harvest_settings.Request()
                                  ).ablation_batches == 2
  llama = explore.load_run(finished_run("tiny_llama"))
  assert harvest_settings.resolve(llama, harvest_settings.Request()
                                  ).ablation_batches == 0
  assert harvest_settings.resolve(llama, harvest_settings.Request(
    ablation_batches=1)).ablation_batches == 1


def test_windows_stay_inside_the_sequence(induction, tmp_path):
  """Default windows are cut to a short sequence; asked-for ones past it
  are refused (the window's memory grows with it, for columns always
  empty)."""
  from decompax.io import tokens  # noqa: PLC0415
  path = tmp_path / "tokens.bin"
  tokens.write_tokens(path, [np.arange(40) % 31], 32, 31, "test")
  short = harvest_settings.Request(positions=16, batch_size=4, seq_len=4,
                                   top_k=3, data_path=str(path))
  settings = harvest_settings.resolve(induction, short)
  assert (settings.before, settings.after) == (3, 3)
  assert harvest_settings.resolve(induction, REQUEST).before == 3
  assert harvest_settings.resolve(induction,
                                  harvest_settings.Request()).before == (
    harvest_settings.WINDOW_BEFORE)


def test_other_settings_are_refused_unless_overwritten(induction, harvested):
  settings, out, _ = harvested
  other = harvest_settings.resolve(induction, harvest_settings.Request(
    positions=REQUEST.positions, batch_size=8, top_k=4))
  with pytest.raises(harvest_store.HarvestConflict, match="top_k"):
    harvest_lib.harvest(induction, other, out, say=lambda _: None)


@pytest.mark.parametrize("request_, message", [
  (harvest_settings.Request(top_k=0), "top_k=0 must be positive"),
  (harvest_settings.Request(batch_size=1, top_k=100), "top_k=100 exceeds"),
  (harvest_settings.Request(window_after=-1), "window_after=-1 must be 0"),
  # The induction run's sequences hold 32 tokens.
  (harvest_settings.Request(window_before=100_000_000),
   "window_before=100000000 reaches past the sequence: a window of "
   "seq_len=32 holds at most 31 positions"),
  (harvest_settings.Request(window_after=32), "window_after=32 reaches past"),
])
def test_bad_requests_are_named(induction, request_, message):
  with pytest.raises(ValueError, match=message):
    harvest_settings.resolve(induction, request_)


@pytest.mark.slow
def test_a_language_model_harvests_its_token_file(finished_run, tmp_path):
  """The tiny Llama, on the token file it trained on: every site harvested,
  every position counted, contexts are token windows of that file."""
  path = finished_run("tiny_llama")
  run = explore.load_run(path)
  settings = harvest_settings.resolve(run, harvest_settings.Request(
    positions=4 * 8 * 16, batch_size=8, top_k=3, ablation_batches=1))
  assert settings.data_path.endswith("tokens.bin") and settings.seq_len == 16
  out = str(tmp_path)
  record = harvest_lib.harvest(run, settings, out, say=lambda _: None)
  harvest_lib.write_manifest(out, path, run, settings, record)
  for site in run.target.sites:
    histogram = _read(out, site.name, "histogram")
    assert histogram.sum() == 4 * 8 * 16 * site.c
    context = _read(out, site.name, "top_context")
    assert context.shape == (site.c, 3, 1 + settings.before + settings.after)
    assert context.max() < 128 and (context >= -1).all()
  assert record["ratio_to_clean"] > 0


def test_a_token_file_is_harvested_in_windows_of_its_own(induction, tmp_path):
  """Fast variant of the tiny Llama harvest: the induction run over a token
  file of its 32-token vocabulary, in windows of the requested length."""
  from decompax.io import tokens  # noqa: PLC0415
  rng = np.random.default_rng(1)
  path = tmp_path / "tokens.bin"
  tokens.write_tokens(path, [rng.integers(0, 31, rng.integers(5, 40))
                             for _ in range(50)], 32, 31, "test")
  settings = harvest_settings.resolve(induction, harvest_settings.Request(
    positions=2 * 4 * 12, batch_size=4, seq_len=12, top_k=3,
    ablation_batches=0, data_path=str(path)))
  assert settings.seq_len == 12 and settings.n_batches == 2
  out = str(tmp_path / "harvest")
  harvest_lib.harvest(induction, settings, out, say=lambda _: None)
  opened = tokens.open_tokens(path)
  starts = tokens.spread_window_starts(range(8), 8,
                                       opened.header.num_tokens, 12)
  ids = opened.ids[starts[:, None] + np.arange(12)]
  for site in induction.target.sites:
    assert _read(out, site.name, "histogram").sum() == 2 * 4 * 12 * site.c
    context = _read(out, site.name, "top_context")
    centre = context[:, :, settings.before]
    assert np.isin(centre, ids).all()


def test_a_harvest_asking_for_more_than_the_file_reads_each_window_once(
    induction, tmp_path):
  from decompax.io import tokens  # noqa: PLC0415
  path = tmp_path / "tokens.bin"
  tokens.write_tokens(path, [np.arange(100) % 31], 32, 31, "test")
  # 101 ids: 8 whole windows of 12, so 2 batches of 4, not the 10 asked.
  settings = harvest_settings.resolve(induction, harvest_settings.Request(
    positions=10 * 4 * 12, batch_size=4, seq_len=12, top_k=3,
    ablation_batches=0, data_path=str(path)))
  assert settings.n_batches == 2 and settings.windows == harvest_settings.SPREAD
  positions = np.concatenate([
    harvest_batches.window_positions(settings, i, 101).reshape(-1)
    for i in range(2)])
  np.testing.assert_array_equal(positions, np.arange(96))
  out = str(tmp_path / "harvest")
  harvest_lib.harvest(induction, settings, out, say=lambda _: None)
  for site in induction.target.sites:
    assert _read(out, site.name, "histogram").sum() == 96 * site.c
  with pytest.raises(ValueError, match="fewer than one batch of "
                     "batch_size=9 windows of seq_len=12"):
    harvest_settings.resolve(induction, harvest_settings.Request(
           batch_size=9, seq_len=12, top_k=3, data_path=str(path)))


# Four batches of eight TMS inputs, the first one ablated.
TMS_REQUEST = harvest_settings.Request(positions=4 * 8, batch_size=8, top_k=5,
                                       ablation_batches=1)


def _placement(preset: str, shape: tuple[int, int, int]):
  """A `(replicate, fsdp, tp)` mesh over the first devices, and a preset."""
  mesh = jax.make_mesh(shape, table_lib.MESH_AXES,
                       axis_types=(AxisType.Auto,) * 3,
                       devices=jax.devices()[:math.prod(shape)])
  return shardings.Placement(mesh, table_lib.make_table(preset))


@pytest.fixture(scope="module")
def tms_one_device(tms, tmp_path_factory):
  settings = harvest_settings.resolve(tms, TMS_REQUEST)
  out = str(tmp_path_factory.mktemp("one_device"))
  harvest_lib.harvest(tms, settings, out, save_every_s=0.0, ablation_chunk=5,
                      say=lambda _: None)
  return settings, out


def _assert_same_harvest(run, out, reference):
  """Counts equal exactly, sums and CI up to the order of the additions."""
  for site in run.target.sites:
    for field in harvest_settings.FIELDS:
      got, want = _read(out, site.name, field), _read(reference, site.name,
                                                      field)
      if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, f"{site.name}/{field}")
      else:
        np.testing.assert_allclose(got, want, rtol=1e-5,
                                   err_msg=f"{site.name}/{field}")


def test_a_harvest_on_four_devices_equals_the_one_device_harvest(
    tms, tms_one_device, tmp_path):
  """zero1 on a (1, 2, 2) mesh: the batch split over fsdp, the components'
  C axis over tp (ddp, the batch over all four: the resume test below)."""
  settings, reference = tms_one_device
  placement = _placement("zero1", (1, 2, 2))
  placed = harvest_accumulate.place(tms, settings, placement)
  assert placed.inputs.spec[0] == "fsdp"
  for factors in placed.components.values():
    assert factors.v.sharding.spec[2] == "tp"
  said = []
  harvest_lib.harvest(tms, settings, str(tmp_path), save_every_s=0.0,
                      ablation_chunk=5, say=said.append, placement=placement)
  assert said[-1].startswith("[harvest] batch 4/4")
  _assert_same_harvest(tms, str(tmp_path), reference)


def test_a_sharded_harvest_resumes_to_the_same_result(
    tms, tms_one_device, tmp_path, monkeypatch):
  """ddp on four devices, each with two of the eight inputs of a batch,
  interrupted after two batches and resumed."""
  settings, reference = tms_one_device
  placement = _placement("ddp", (1, 4, 1))
  assert harvest_accumulate.place(tms, settings,
                                  placement).inputs.spec[0] == "fsdp"
  source = harvest_batches.batch_source

  def failing(run, s, *placed):
    batch = source(run, s, *placed)

    def fetch(i):
      if i == 2:
        raise KeyboardInterrupt  # as a kill would, after batch 1's save
      return batch(i)
    return fetch

  monkeypatch.setattr(harvest_batches, "batch_source", failing)
  with pytest.raises(KeyboardInterrupt):
    harvest_lib.harvest(tms, settings, str(tmp_path), save_every_s=0.0,
                        ablation_chunk=5, say=lambda _: None,
                        placement=placement)
  monkeypatch.setattr(harvest_batches, "batch_source", source)
  said = []
  harvest_lib.harvest(tms, settings, str(tmp_path), save_every_s=0.0,
                      ablation_chunk=5, say=said.append, placement=placement)
  assert "[harvest] resuming after batch 2" in said
  _assert_same_harvest(tms, str(tmp_path), reference)


@pytest.mark.parametrize("save_every_s, chunk, message", [
  (-1.0, 5, "save_every_s=-1.0 must be 0 or more"),
  (0.0, 0, "ablation_chunk=0 must be positive"),
])
def test_bad_cadences_are_named(tms, save_every_s, chunk, message):
  settings = harvest_settings.resolve(tms, TMS_REQUEST)
  with pytest.raises(ValueError, match=f"^{message}$"):
    harvest_lib.harvest(tms, settings, "unused", save_every_s, chunk)


def test_a_toy_without_sequences_keeps_its_windows_unchecked(tms):
  # Its contexts are input rows: a window is never cut from them.
  settings = harvest_settings.resolve(tms, harvest_settings.Request(
    positions=8, batch_size=8, top_k=5, window_before=100))
  assert (settings.seq_len, settings.before, settings.after) == (1, 100, 4)


def test_a_batch_that_does_not_split_over_the_mesh_is_refused(tms):
  settings = harvest_settings.resolve(tms, harvest_settings.Request(
    positions=12, batch_size=6, top_k=5))
  with pytest.raises(ValueError, match=(
      r"^batch_size=6: the batch axis of size 6 does not split over the 4 "
      r"devices of mesh axes fsdp; choose a size divisible by 4$")):
    harvest_accumulate.place(tms, settings, _placement("ddp", (1, 4, 1)))


# A tag vocabulary in Brown's spelling: the special tags, then words' tags.
TAGS = ("<eos>", "<sep>", "at", "nn", "vbd-hl", "in", ".", "fw-nn")


def _add_tag_activity(want, activity, settings, batch, opened, stream):
  """Add each unit's activity in harvest batch `batch` (4 windows of 12)
  to its tag's row of `want[kind]`, as the harvest's tag statistics do."""
  from decompax.io import tokens  # noqa: PLC0415
  starts = tokens.spread_window_starts(
    range(4 * batch, 4 * batch + 4), 4 * settings.n_batches,
    opened.header.num_tokens, 12)
  tags = stream.ids[starts[:, None] + np.arange(12)].reshape(-1)
  for kind, a in activity.items():
    fine = want.setdefault(kind, np.zeros((a.shape[-1], len(TAGS))))
    np.add.at(fine.T, tags, a.reshape(-1, a.shape[-1]))


def _tagged_token_file(folder, seed: int, n_docs: int, vocab: int):
  """Write random tagged documents of ids below `vocab − 1` (the last id is
  the end of a document) and return the file's path."""
  from decompax.io import tokens  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  docs = []
  for d in range(n_docs):
    n = int(rng.integers(5, 30))
    docs.append(tokens.TaggedDocument(
      f"doc{d}", rng.integers(0, vocab - 1, n),
      rng.integers(1, len(TAGS), n), np.asarray([0, n // 2])))
  path = folder / "tokens.bin"
  tokens.write_tagged_tokens(path, docs, TAGS, "<eos>", vocab, vocab - 1,
                             "test")
  return path


def _two_batches(run, path):
  """Return the settings of a two-batch harvest of `run` over `path`."""
  return harvest_settings.resolve(run, harvest_settings.Request(
    positions=2 * 4 * 12, batch_size=4, seq_len=12, top_k=3,
    ablation_batches=0, data_path=str(path)))


@pytest.fixture(scope="module")
def tagged(induction, tmp_path_factory):
  """The induction run over a tagged token file of its vocabulary: the
  settings of a two-batch harvest and the harvest, made with a save after
  every batch."""
  path = _tagged_token_file(tmp_path_factory.mktemp("tagged"), 2, 7, 32)
  settings = _two_batches(induction, path)
  out = str(tmp_path_factory.mktemp("tag_harvest"))
  record = harvest_lib.harvest(induction, settings, out, save_every_s=0.0,
                               say=lambda _: None)
  harvest_lib.write_manifest(out, "run", induction, settings, record)
  return settings, out, record


def test_a_tagged_token_file_gives_tag_statistics_of_the_ci(
    induction, tagged):
  """Against the CI and the tag stream read directly, position by
  position."""
  from decompax.io import tokens  # noqa: PLC0415
  from decompax.targets import brown_tags  # noqa: PLC0415
  settings, out, record = tagged
  assert settings.tag_groups == 7  # one group per document
  opened = tokens.open_tokens(settings.data_path)
  stream = tokens.open_tags(opened)
  doc_starts = [d["start"] for d in stream.documents]
  coarse_of = brown_tags.coarse_ids(TAGS)
  assert record["tags"]["tags"] == list(TAGS)
  assert record["tags"]["coarse_of"] == coarse_of.tolist()
  assert record["tags"]["documents"] == [f"doc{d}" for d in range(7)]
  inputs, cis = _direct(induction, settings)
  k, g = len(brown_tags.COARSE), settings.tag_groups
  for site in induction.target.sites:
    fine = np.zeros((site.c, len(TAGS)))
    coarse = np.zeros((g, site.c, k))
    bigram = np.zeros((site.c, k, k))
    base = np.zeros((g, k), np.int64)
    for i, ci in enumerate(cis):
      starts = tokens.spread_window_starts(
        range(4 * i, 4 * i + 4), 4 * settings.n_batches,
        opened.header.num_tokens, 12)
      for row, start in enumerate(starts):
        for col in range(12):
          at = start + col
          assert inputs[i][row, col] == opened.ids[at]
          tag, cls = stream.ids[at], coarse_of[stream.ids[at]]
          prev = coarse_of[stream.ids[at - 1]] if at else coarse_of[0]
          doc = int(np.searchsorted(doc_starts, at, side="right")) - 1
          a = ci[site.name][row, col]
          fine[:, tag] += a
          coarse[doc, :, cls] += a
          bigram[:, prev, cls] += a
          base[doc, cls] += 1
    for field, want in (("tag_fine", fine), ("tag_coarse", coarse),
                        ("tag_bigram", bigram), ("tag_base_coarse", base)):
      np.testing.assert_allclose(_read(out, site.name, field), want,
                                 rtol=1e-5, atol=1e-6, err_msg=field)
    assert base.sum() == 2 * 4 * 12


def test_an_interrupted_tag_harvest_resumes_to_the_same_result(
    induction, tagged, tmp_path, monkeypatch):
  settings, whole, _ = tagged
  out = str(tmp_path)
  source = harvest_batches.tag_source

  def failing(s, *placed):
    tags = source(s, *placed)

    def read(i):
      if i == 1:
        raise KeyboardInterrupt  # as a kill would, after batch 0's save
      return tags.read(i)
    return tags._replace(read=read)

  monkeypatch.setattr(harvest_batches, "tag_source", failing)
  with pytest.raises(KeyboardInterrupt):
    harvest_lib.harvest(induction, settings, out, save_every_s=0.0,
                        say=lambda _: None)
  monkeypatch.setattr(harvest_batches, "tag_source", source)
  said = []
  record = harvest_lib.harvest(induction, settings, out, save_every_s=0.0,
                               say=said.append)
  assert "[harvest] resuming after batch 1" in said
  assert record["tags"]["tags"] == list(TAGS)
  tag_fields = harvest_settings.TAG_FIELDS + harvest_settings.CONTEXT_FIELDS
  for site in induction.target.sites:
    for field in harvest_settings.FIELDS + tag_fields:
      np.testing.assert_array_equal(_read(out, site.name, field),
                                    _read(whole, site.name, field), field)
  for key in record["tags"]["baselines"]:
    for field in tag_fields:
      np.testing.assert_array_equal(_read(out, key, field),
                                    _read(whole, key, field), field)


def test_load_harvest_reads_the_tag_statistics(induction, tagged, tmp_path):
  settings, out, _ = tagged
  shutil.copytree(out, tmp_path / harvest_store.HARVEST_DIR)
  loaded = harvest_lib.load_harvest(str(tmp_path))
  assert loaded.manifest["tags"]["classes"][0] == "noun"
  site = induction.target.sites[0]
  fields = loaded.sites[site.name]
  tag_fields = harvest_settings.TAG_FIELDS + harvest_settings.CONTEXT_FIELDS
  assert set(fields) == set(harvest_settings.FIELDS + tag_fields)
  assert fields["tag_coarse"].shape == (settings.tag_groups, site.c, 12)
  np.testing.assert_array_equal(fields["tag_base_fine"],
                                _read(out, site.name, "tag_base_fine"))
  assert sorted(loaded.baselines) == sorted(
    loaded.manifest["tags"]["baselines"])
  neurons = loaded.baselines["layers.1.mlp.neurons"]
  assert set(neurons) == set(tag_fields)
  np.testing.assert_array_equal(neurons["tag_base_coarse"],
                                fields["tag_base_coarse"])
  # A harvest from before the context statistics reads without them.
  manifest = tmp_path / harvest_store.HARVEST_DIR / harvest_store.MANIFEST
  older = json.loads(manifest.read_text())
  del older["settings"]["tag_revision"]
  older["tags"]["baselines"] = [
    k for k in older["tags"]["baselines"]
    if not k.endswith(harvest_settings.SITE_BASELINES)]
  manifest.write_text(json.dumps(older))
  loaded = harvest_lib.load_harvest(str(tmp_path))
  assert set(loaded.sites[site.name]) == set(
    harvest_settings.FIELDS + harvest_settings.TAG_FIELDS)
  assert not harvest_lib.has_context(loaded.manifest)


def test_the_baselines_tag_statistics_are_those_of_the_neurons(
    induction, tagged):
  """Each decomposed MLP's neurons, gates and rotated neurons, and each
  decomposed attention's heads, against their activity computed from a
  clean forward's taps, batch by batch."""
  from decompax.io import tokens  # noqa: PLC0415
  from decompax.targets import glu_arrays
  settings, out, record = tagged
  layers = harvest_baselines.baseline_layers(induction)
  assert layers == (1,) == harvest_baselines.head_layers(induction)
  mlp_sites = [s.name for s in induction.target.sites if ".mlp." in s.name]
  assert record["tags"]["baselines"] == [
    "layers.1.mlp.neurons", "layers.1.mlp.gates", "layers.1.mlp.rotated",
    "layers.1.self_attn.heads"] + [
    f"{site}.{kind}" for site in mlp_sites
    for kind in harvest_settings.SITE_BASELINES]
  w_o = glu_arrays.weights_to_arrays(induction.weights)["o"][1]
  n_heads = harvest_baselines.n_heads(induction)
  head_dim = w_o.shape[0] // n_heads
  opened = tokens.open_tokens(settings.data_path)
  stream = tokens.open_tags(opened)
  rotation = np.asarray(harvest_baselines.rotations(induction, settings,
                                                    layers))[0]
  np.testing.assert_allclose(rotation.T @ rotation, np.eye(len(rotation)),
                             atol=1e-5)
  inputs, cis = _direct(induction, settings)
  want, context = {}, {}
  for i, x in enumerate(inputs):
    _, taps = induction.target.clean_forward(induction.weights, x, (
      "layers.1.mlp.gate_proj.out", "layers.1.mlp.up_proj.out",
      "layers.1.self_attn.o_proj"))
    o_in = np.asarray(taps["layers.1.self_attn.o_proj"], np.float64)
    gate = np.asarray(taps["layers.1.mlp.gate_proj.out"], np.float64)
    up = np.asarray(taps["layers.1.mlp.up_proj.out"], np.float64)
    silu = gate / (1 + np.exp(-gate))
    activity = {"neurons": np.maximum(silu * up, 0),
                "gates": np.maximum(silu, 0),
                "rotated": np.maximum((silu * up) @ rotation, 0),
                "heads": np.stack([np.linalg.norm(
                  o_in[..., h * head_dim:(h + 1) * head_dim]
                  @ w_o[h * head_dim:(h + 1) * head_dim], axis=-1)
                  for h in range(n_heads)], axis=-1)}
    if i == 0:
      matched = _calibration(cis[0], activity["neurons"], mlp_sites)
    activity.update(_matched(activity["neurons"], matched))
    _add_tag_activity(want, activity, settings, i, opened, stream)
    _add_context(context, {**activity, **cis[i]}, np.asarray(x), opened,
                 stream, settings)
  assert want["heads"].shape == (n_heads, len(TAGS)) and n_heads > 1
  for site in mlp_sites:
    q, _, k = matched[site]
    assert record["tags"]["calibration"][site] == {"q": pytest.approx(q),
                                                   "k": k}
  for kind, fine in want.items():
    where = "self_attn" if kind == "heads" else "mlp"
    key = kind if kind.count(".") > 1 else f"layers.1.{where}.{kind}"
    got = _read(out, key, "tag_fine")
    np.testing.assert_allclose(got, fine, rtol=1e-4, atol=1e-5,
                               err_msg=kind)
    on, implied = context[kind]
    np.testing.assert_array_equal(_read(out, key, "tag_on"), on)
    np.testing.assert_allclose(_read(out, key, "tag_implied"), implied,
                               rtol=1e-4, atol=1e-5, err_msg=kind)
  for site in mlp_sites:
    on, implied = context[site]
    np.testing.assert_array_equal(_read(out, site, "tag_on"), on)
    np.testing.assert_allclose(_read(out, site, "tag_implied"), implied,
                               rtol=1e-4, atol=1e-5)
  assert not np.allclose(want["rotated"], want["neurons"])
  site = mlp_sites[0]
  for kind in harvest_settings.SITE_BASELINES:  # each keeps part of the neurons
    assert 0 < want[f"{site}.{kind}"].sum() < want["neurons"].sum()


def _calibration(ci: dict, neurons: np.ndarray, sites: list[str]) -> dict:
  """Per site, from one batch: q (the median firing density of its
  components that fire), each neuron's threshold (its (round(qP)+1)-th
  largest value), k (the ceiling of the mean CI-L0)."""
  flat = neurons.reshape(-1, neurons.shape[-1])
  out = {}
  for site in sites:
    fires = np.asarray(ci[site]).reshape(-1, ci[site].shape[-1]) > 0
    density = fires.mean(axis=0)
    q = float(np.median(density[density > 0]))
    m = round(q * len(flat))
    threshold = np.sort(flat, axis=0)[::-1][m] if m < len(flat) else None
    out[site] = (q, threshold, int(np.ceil(fires.sum(axis=1).mean())))
  assert any(0 < m < 1 for m, _, _ in out.values())
  return out


def _matched(neurons: np.ndarray, matched: dict) -> dict:
  """Each site's density-matched and top-k neurons, directly."""
  out = {}
  for site, (_, threshold, k) in matched.items():
    out[f"{site}.density_matched"] = np.where(neurons > threshold, neurons,
                                              0.0)
    kth = np.sort(neurons, axis=-1)[..., -k, None]
    out[f"{site}.top_k"] = np.where(neurons >= kth, neurons, 0.0)
  return out


def _add_context(context: dict, activity: dict, ids: np.ndarray, opened,
                 stream, settings) -> None:
  """Add each unit set's positions on and token-implied class profile,
  the class mix of each token counted over every harvested position."""
  from decompax.io import tokens  # noqa: PLC0415
  from decompax.targets import brown_tags  # noqa: PLC0415
  coarse_of = brown_tags.coarse_ids(TAGS)
  starts = tokens.spread_window_starts(
    range(4 * settings.n_batches), 4 * settings.n_batches,
    opened.header.num_tokens, 12)
  every = (starts[:, None] + np.arange(12)).reshape(-1)
  mix = np.zeros((opened.header.vocab_size, len(brown_tags.COARSE)))
  np.add.at(mix, (np.asarray(opened.ids[every], np.int64),
                  coarse_of[stream.ids[every]]), 1)
  mix /= np.maximum(mix.sum(axis=1, keepdims=True), 1)
  for kind, a in activity.items():
    a = np.asarray(a, np.float64).reshape(-1, a.shape[-1])
    on, implied = context.get(kind, (0, 0))
    context[kind] = (on + (a > 0).sum(axis=0),
                     implied + a.T @ mix[ids.reshape(-1)])


def test_a_sharded_tag_harvest_equals_the_one_device_one(
    induction, tagged, tmp_path):
  """ddp on four devices: each batch's positions split like its tokens;
  counts exact, sums up to their order."""
  settings, reference, record = tagged
  harvest_lib.harvest(induction, settings, str(tmp_path), save_every_s=0.0,
                      say=lambda _: None,
                      placement=_placement("ddp", (1, 4, 1)))
  keys = [s.name for s in induction.target.sites] + record["tags"][
    "baselines"]
  for key in keys:
    for field in harvest_settings.TAG_FIELDS + harvest_settings.CONTEXT_FIELDS:
      got, want = _read(str(tmp_path), key, field), _read(reference, key,
                                                           field)
      if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, f"{key}/{field}")
      else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{key}/{field}")


def test_a_plain_mlp_s_units_are_its_act_up_neurons(induction):
  """Fast variant of the tiny GPT-2 harvest below: GPT-2's settings give a
  plain MLP form, whose units read the up projection alone (no gates
  baseline), its neurons `gelu_tanh(up)` and its rotated neurons that
  hidden vector rotated, against direct computation on random taps."""
  from decompax.recipe import flagfiles  # noqa: PLC0415
  config = flagfiles.read_args([
    f"--flagfile={ROOT / 'flags' / 'tiny_gpt2.flags'}",
    f"--model_dir={ROOT / 'tests' / 'fixtures' / 'tiny_gpt2'}"])
  # The form is the model's: read from the settings, whatever the run.
  mlp = harvest_baselines.mlp_form(induction._replace(config=config))
  assert not mlp.gated
  assert harvest_baselines.baseline_taps((1,), (), mlp) == (
    "layers.1.mlp.up_proj.out",)
  assert harvest_baselines.baseline_keys((1,), (), mlp, ()) == (
    "layers.1.mlp.neurons", "layers.1.mlp.rotated")
  up = np.random.default_rng(0).normal(size=(2, 6, 5))
  rotation = np.linalg.qr(np.random.default_rng(1).normal(size=(5, 5)))[0]
  got = harvest_baselines.baseline_activity(
    {"layers.1.mlp.up_proj.out": jax.numpy.asarray(up, np.float32)}, (1,),
    (), 0, {"rotation": jax.numpy.asarray(rotation[None], np.float32)}, mlp)
  hidden = 0.5 * up * (1 + np.tanh(
    np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
  want = {"neurons": np.maximum(hidden, 0),
          "rotated": np.maximum(hidden @ rotation, 0)}
  assert sorted(got) == [f"layers.1.mlp.{k}" for k in sorted(want)]
  for kind, value in want.items():
    np.testing.assert_allclose(got[f"layers.1.mlp.{kind}"], value,
                               rtol=1e-5, atol=1e-6, err_msg=kind)
  assert not np.allclose(want["rotated"], want["neurons"])


# The fast variant is
# tests/analysis/test_harvesting.py::test_a_plain_mlp_s_units_are_its_act_up_neurons
# (the same form and activities, from GPT-2's settings on random taps);
# this one trains a GPT-2 decomposition of its own to harvest.
@pytest.mark.slow
def test_a_plain_mlp_s_baselines_are_its_act_up_neurons(finished_run,
                                                        tmp_path):
  """GPT-2's MLP has no gate: its neurons are `gelu_tanh(up)`, rotated the
  same way, and it has no gates baseline."""
  from decompax.io import tokens  # noqa: PLC0415
  gpt2 = explore.load_run(finished_run("tiny_gpt2"))
  settings = _two_batches(gpt2, _tagged_token_file(tmp_path, 3, 5, 128))
  out = str(tmp_path / "harvest")
  record = harvest_lib.harvest(gpt2, settings, out, save_every_s=0.0,
                               say=lambda _: None)
  assert record["tags"]["baselines"][:2] == ["layers.1.mlp.neurons",
                                             "layers.1.mlp.rotated"]
  assert record["tags"]["baselines"][2:] == [
    f"{s.name}.{kind}" for s in gpt2.target.sites if ".mlp." in s.name
    for kind in harvest_settings.SITE_BASELINES]
  rotation = np.asarray(harvest_baselines.rotations(gpt2, settings, (1,)))[0]
  opened = tokens.open_tokens(settings.data_path)
  stream = tokens.open_tags(opened)
  inputs, _ = _direct(gpt2, settings)
  want = {}
  for i, x in enumerate(inputs):
    _, taps = gpt2.target.clean_forward(gpt2.weights, x,
                                        ("layers.1.mlp.up_proj.out",))
    up = np.asarray(taps["layers.1.mlp.up_proj.out"], np.float64)
    hidden = 0.5 * up * (1 + np.tanh(
      np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
    activity = {"neurons": np.maximum(hidden, 0),
                "rotated": np.maximum(hidden @ rotation, 0)}
    _add_tag_activity(want, activity, settings, i, opened, stream)
  for kind, fine in want.items():
    got = _read(out, f"layers.1.mlp.{kind}", "tag_fine")
    np.testing.assert_allclose(got, fine, rtol=1e-4, atol=1e-5,
                               err_msg=kind)
  assert not np.allclose(want["rotated"], want["neurons"])


def test_each_layer_rotates_its_neurons_by_its_own_draw(induction):
  """I59: layer i's rotated-neuron basis is drawn from the harvest's seed
  folded with i, so two layers never share one rotation."""
  from decompax.measures import unit_activity  # noqa: PLC0415
  settings = harvest_settings.resolve(induction, REQUEST)
  got = np.asarray(harvest_baselines.rotations(induction, settings, (0, 1)))
  d_ff = got.shape[-1]
  for layer in (0, 1):
    np.testing.assert_allclose(got[layer], unit_activity.random_rotation(
      jax.random.fold_in(jax.random.key(settings.seed), layer), d_ff),
      rtol=1e-6, atol=1e-7)
  assert np.abs(got[0] - got[1]).max() > 0.1


@pytest.mark.slow
def test_an_experts_baselines_are_its_routed_neurons(finished_run, tmp_path):
  """A mixture of experts: each expert with a site has its own neurons,
  gates and rotated neurons, each weighted by its routing weight (0 where
  a position is not routed to it)."""
  from decompax.io import tokens  # noqa: PLC0415
  from decompax.recipe import assembly  # noqa: PLC0415
  moe = explore.load_run(finished_run("tiny_qwen3moe"))
  settings = _two_batches(moe, _tagged_token_file(tmp_path, 4, 5, 64))
  out = str(tmp_path / "harvest")
  record = harvest_lib.harvest(moe, settings, out, save_every_s=0.0,
                               say=lambda _: None)
  experts = [f"layers.1.mlp.experts.{e}.{k}" for e in range(4)
             for k in harvest_settings.BASELINES]
  matched = [f"{s.name}.{kind}" for s in moe.target.sites
             if ".mlp." in s.name for kind in harvest_settings.SITE_BASELINES]
  assert record["tags"]["baselines"] == experts + [
    "layers.1.self_attn.heads"] + matched
  units = harvest_baselines.baseline_layers(moe)
  assert units == tuple((1, e) for e in range(4))
  rotation = np.asarray(harvest_baselines.rotations(moe, settings, units))[2]
  config = assembly.resolve_target(moe.config).record.token_model
  opened = tokens.open_tokens(settings.data_path)
  stream = tokens.open_tags(opened)
  inputs, _ = _direct(moe, settings)
  wanted = ("layers.1.mlp.experts.2.gate_proj.out",
            "layers.1.mlp.experts.2.up_proj.out", "layers.1.mlp.gate.out")
  want, routed = {}, []
  for i, x in enumerate(inputs):
    _, taps = moe.target.clean_forward(moe.weights, x, wanted)
    gate, up, logits = (np.asarray(taps[k], np.float64) for k in wanted)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[..., :2]
    chosen = (top == 2).any(-1)
    weight = np.where(chosen, probs[..., 2] / np.take_along_axis(
      probs, top, -1).sum(-1), 0.0)[..., None]
    routed.append(chosen)
    silu = gate / (1 + np.exp(-gate))
    hidden = silu * up
    activity = {"neurons": np.maximum(hidden, 0) * weight,
                "gates": np.maximum(silu, 0) * weight,
                "rotated": np.maximum(hidden @ rotation, 0) * weight}
    _add_tag_activity(want, activity, settings, i, opened, stream)
  # Expert 2 is routed at some positions, not at others.
  assert 0 < np.mean(routed) < 1 and config.experts_per_token == 2
  for kind, fine in want.items():
    got = _read(out, f"layers.1.mlp.experts.2.{kind}", "tag_fine")
    np.testing.assert_allclose(got, fine, rtol=1e-4, atol=1e-5,
                               err_msg=kind)
