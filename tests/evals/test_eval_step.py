"""The eval passes on known answers: a perfect toy decomposition, an LM shape.

The toy is a two-site diagonal ReLU chain decomposed exactly (one component
per feature, `V = I`, `U = diag(w)`) with an oracle CI function: CI 1 where a
component's activation is non-zero, else 0. Every masked variant that keeps
the CI-active components then reproduces the clean output exactly, and the
zero ablation is the worst variant.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import ci_fns, optim, sites as sites_lib, squash
from decompax.core import step_records, train_step
from decompax.core.schedules import Schedule
from decompax.core.target import Expected
from decompax.evals import eval_step
from decompax.losses import adversarial, recon
from decompax.losses import loss_terms as terms
from decompax.targets import sparse_data, tms, toy_sites

N = 5
BATCH = 16


def _diag_target():
  specs = tuple(sites_lib.SiteSpec(n, n, 0, N, N, N) for n in ("l0", "l1"))

  def forward(weights, x, matmul):
    taps = {"l0": x}
    h = jax.nn.relu(matmul("l0", x, weights["l0"][0]))
    taps["l1"] = h
    return jax.nn.relu(matmul("l1", h, weights["l1"][0])), taps

  fns = toy_sites.sequential_target_fns(
    specs, forward, lambda w: dict(w), N)
  scale = jnp.linspace(0.5, 2.0, N)
  weights = {"l0": jnp.diag(scale)[None], "l1": jnp.diag(scale[::-1])[None]}
  return fns, weights


def _oracle_ci_fn(sites):
  def apply(params, taps, components):
    del params
    out = {}
    for site in sites:
      v, _ = sites_lib.site_factors(components, site)
      active = jnp.abs(taps[site.name] @ v) > 0
      out[site.name] = jnp.where(active, 2.0, -1.0)
    return out

  return ci_fns.CIFn(tuple(s.name for s in sites), lambda key: {}, apply)


def _state(target, ci_fn, loss_terms, components, ci_params, lead):
  adam = optim.AdamWConfig(Schedule(1e-3))
  built = train_step.make_train_step(
    target, ci_fn, loss_terms, step_records.StepConfig(10, adam, adam))
  return built.init(components, ci_params, jax.random.key(0), lead)


def _terms(sites):
  return (
    terms.faithfulness_term(1.0),
    terms.importance_minimality_term(1e-3, 1.0),
    terms.stochastic_recon_term("stochastic_recon", 1.0,
                                recon.all_sites_plan(sites), False),
  )


@pytest.fixture(scope="module")
def perfect():
  target, weights = _diag_target()
  components = {
    site: sites_lib.Factors(v=jnp.eye(N)[None], u=weights[site])
    for site in ("l0", "l1")}
  ci_fn = _oracle_ci_fn(target.sites)
  loss_terms = _terms(target.sites)
  state = _state(target, ci_fn, loss_terms, components, {}, (BATCH,))

  def sample(key):
    return sparse_data.sample_sparse_features(key, BATCH, N, 0.3, 0.0, 1.0)

  config = eval_step.EvalConfig(n_batches=3, total_steps=10)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, sample)
  key = jax.random.key(5)
  output, batches = fns.fast(state, weights, key)
  slow = fns.slow(state, weights, key, batches)
  output = jax.device_get(eval_step.merge_slow(output, slow))
  return eval_step.summarize(output), np.asarray(batches), fns, state, weights


def test_perfect_decomposition_has_zero_identity_error_and_recon(perfect):
  summary = perfect[0]
  s = summary.scalars
  for site in ("l0", "l1"):
    assert s[f"identity_ci_error/{site}"] == 0
    np.testing.assert_array_equal(summary.probe[site] > 0.5, np.eye(N))
  # The PGD probe too: masks ci + (1 − ci)·S keep every active component
  # whole whatever S, and inactive ones contribute nothing (SPEC §5.7).
  for variant in ("ci_masked", "unmasked", "rounded", "stochastic", "pgd"):
    assert s[f"recon/{variant}"] < 1e-12, variant
  # Zero ablation silences both sites: its MSE is that of the clean output
  # `w0·w1·x` (x >= 0) against 0, per batch, averaged over batches.
  batches = perfect[1].astype(np.float64)
  scale = np.linspace(0.5, 2.0, N)
  zero_mse = np.mean(np.mean((batches * scale * scale[::-1]) ** 2,
                             axis=(1, 2)))
  np.testing.assert_allclose(s["recon/zero"], zero_mse, rtol=1e-5)
  assert s["recon/zero"] > s["recon/random"] > 1e-6
  assert s["loss/faithfulness"] == 0.0
  assert s["loss/stochastic_recon"] < 1e-12
  assert s["hidden_acts/ci_masked/all"] < 1e-12
  assert s["hidden_acts/stochastic/all"] < 1e-12


def test_ci_l0_alive_and_density_count_the_active_features(perfect):
  summary, batches = perfect[0], perfect[1]
  active = batches > 0  # [n_batches, B, N]; features map to components
  for site in ("l0", "l1"):
    np.testing.assert_allclose(summary.scalars[f"ci_l0/{site}"],
                               active.sum(-1).mean(), rtol=1e-6)
    assert summary.scalars[f"alive/{site}"] == np.any(
      active, axis=(0, 1)).sum()
    np.testing.assert_allclose(summary.arrays["density"][site],
                               active.mean(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(summary.arrays["mean_ci"][site],
                               active.mean(axis=(0, 1)), rtol=1e-6)


def test_slow_histograms_hold_every_position_exactly(perfect):
  summary, batches = perfect[0], perfect[1]
  n_active = int(np.sum(batches > 0))
  for site in ("l0", "l1"):
    lower = summary.arrays["hist_lower"][site]
    assert lower.sum() == batches.size
    assert lower[-2] == n_active and lower[1] == batches.size - n_active
    pre = summary.arrays["hist_pre"][site]
    assert pre.sum() == batches.size
    density = summary.arrays["log_density"][site]
    np.testing.assert_array_equal(density[:, -1],
                                  np.sum(batches > 0, axis=(0, 1)))


def test_eval_passes_trace_once(perfect):
  _, _, fns, state, weights = perfect
  key = jax.random.key(5)
  for _ in range(2):
    _, batches = fns.fast(state, weights, key)
    fns.slow(state, weights, key, batches)
  assert fns.fast._cache_size() == 1 and fns.slow._cache_size() == 1


def test_held_out_batches_depend_only_on_the_key(perfect):
  _, batches, fns, state, weights = perfect
  _, again = fns.fast(state, weights, jax.random.key(5))
  np.testing.assert_array_equal(np.asarray(again), batches)
  _, other = fns.fast(state, weights, jax.random.key(6))
  assert not np.array_equal(np.asarray(other), batches)


@pytest.fixture(scope="module")
def token_eval(token_target):
  target, weights = token_target
  ci_fn = ci_fns.make_ci_fn(ci_fns.CIConfig("vector_mlp", (4,)), target.sites)
  components = sites_lib.init_components(jax.random.key(1), target.sites)
  loss_terms = _terms(target.sites)
  lead = (3, 5)
  state = _state(target, ci_fn, loss_terms, components,
                 ci_fn.init(jax.random.key(2)), lead)

  def sample(key):
    return jax.random.randint(key, lead, 0, 6)

  config = eval_step.EvalConfig(n_batches=2, total_steps=10, top_contexts=3)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, sample)
  key = jax.random.key(9)
  output, batches = fns.fast(state, weights, key)
  output = jax.device_get(eval_step.merge_slow(
    output, fns.slow(state, weights, key, batches)))

  def ci_of(tokens):
    _, taps = target.clean_forward(weights, tokens, ci_fn.input_taps)
    pre = ci_fn.apply(state.ci_params, taps, state.components)
    return np.clip(np.asarray(pre["mix"]), 0.0, 1.0)

  def logits_of(tokens, variant):
    """Return the variant's logits in float64 numpy, written out here:
    clean `relu(h·W_mix)·W_head`, unmasked `relu(h·V·U)·V·U`, zero 0."""
    emb = np.asarray(weights["embed"], np.float64)[np.asarray(tokens)]
    h = np.cumsum(emb, axis=1) / np.arange(1, emb.shape[1] + 1)[:, None]
    mats = {}
    for kind in ("mix", "head"):
      f = state.components[kind]
      mats[kind] = {
        "clean": np.asarray(weights[kind][0], np.float64),
        "unmasked": np.asarray(f.v[0], np.float64) @ np.asarray(f.u[0]),
        "zero": np.zeros(weights[kind][0].shape)}[variant]
    return np.maximum(h @ mats["mix"], 0.0) @ mats["head"]

  return (output, eval_step.summarize(output), np.asarray(batches), ci_of,
          logits_of)


def _log_softmax(logits):
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_token_target_reports_ce_and_kl(token_eval):
  """CE, CE differences, unrecovered fractions and KLs of the clean, the
  unmasked and the zero-ablated model, per batch, against float64 forwards
  written out here, then averaged over the batches (SPEC §5.11)."""
  _, summary, batches, _, logits_of = token_eval
  s = summary.scalars
  per_batch = {k: [] for k in (
    "ce/clean", "ce_diff/unmasked", "ce_diff/zero",
    "ce_unrecovered/unmasked", "recon/unmasked", "recon/zero")}
  for tokens in batches:
    log = {v: _log_softmax(logits_of(tokens, v))
           for v in ("clean", "unmasked", "zero")}
    labels = tokens[:, 1:]
    ce = {v: -np.mean(np.take_along_axis(
      lq[:, :-1], labels[..., None], -1)) for v, lq in log.items()}
    p = np.exp(log["clean"])
    kl = {v: np.mean(np.sum(p * (log["clean"] - log[v]), -1))
          for v in ("unmasked", "zero")}
    per_batch["ce/clean"].append(ce["clean"])
    for v in ("unmasked", "zero"):
      per_batch[f"ce_diff/{v}"].append(ce[v] - ce["clean"])
      per_batch[f"recon/{v}"].append(kl[v])
    per_batch["ce_unrecovered/unmasked"].append(
      (ce["unmasked"] - ce["clean"]) / (ce["zero"] - ce["clean"]))
  for key, values in per_batch.items():
    np.testing.assert_allclose(s[key], np.mean(values), rtol=1e-4,
                               err_msg=key)
  assert s["recon/unmasked"] > 1e-3  # untrained factors: VU ≠ W
  assert "identity_ci_error/mix" not in s  # no feature probe


def test_token_target_top_contexts_are_the_largest_ci(token_eval):
  output, _, batches, ci_of, _ = token_eval
  assert np.array_equal(output.stats["tokens"], batches)
  ci = np.stack([ci_of(b) for b in batches])  # [n_batches, B, T, C]
  values, batch, position = eval_step.top_contexts(output.stats, "mix", 3)
  for c in range(ci.shape[-1]):
    flat = ci[..., c].reshape(len(batches), -1)
    np.testing.assert_allclose(values[c], np.sort(flat.reshape(-1))[::-1][:3],
                               rtol=1e-6)
    np.testing.assert_allclose(flat[batch[c], position[c]], values[c],
                               rtol=1e-6)


def test_token_target_position_ci_is_the_batch_mean(token_eval):
  _, summary, batches, ci_of, _ = token_eval
  ci = np.stack([ci_of(b) for b in batches])
  np.testing.assert_allclose(summary.arrays["position_ci"]["mix"],
                             ci.mean(axis=(0, 1)), rtol=1e-5, atol=1e-7)


# The fresh-PGD eval probe (SPEC §5.7) on the diagonal chain with CI 0
# everywhere: masks are the sources themselves, so the output is
# `s0·s1·w0·w1·x` per feature (x >= 0) and the MSE is
# `mean(((1 − s0·s1)·w0·w1·x)²)`. Every ascent lowers both sources (the
# gradient is <= 0), so enough steps reach S = 0, the zero ablation.


def _zero_ci_fn(sites):
  def apply(params, taps, components):
    del params, components
    return {s.name: jnp.full(taps[s.name].shape[:-1] + (s.c,), -1.0)
            for s in sites}

  return ci_fns.CIFn(tuple(s.name for s in sites), lambda key: {}, apply)


def _perfect_components(weights):
  return {site: sites_lib.Factors(v=jnp.eye(N)[None], u=weights[site])
          for site in ("l0", "l1")}


@pytest.fixture(scope="module")
def zero_ci_context():
  target, weights = _diag_target()
  x = sparse_data.sample_sparse_features(jax.random.key(3), BATCH, N, 0.5,
                                         0.0, 1.0)
  clean, _ = target.clean_forward(weights, x, ())
  zeros = {s.name: jnp.zeros((BATCH, N)) for s in target.sites}
  ctx = step_records.StepContext(
    jnp.zeros((), jnp.int32), 10, target, weights, x, clean,
    _perfect_components(weights), squash.CIOutput(zeros, zeros, zeros))
  gain = np.asarray(weights["l0"][0].diagonal() * weights["l1"][0].diagonal())
  return ctx, np.asarray(x) * gain  # the clean output, per feature


def test_pgd_probe_without_steps_is_the_divergence_at_its_random_init(
    zero_ci_context):
  ctx, clean = zero_ci_context
  key = jax.random.key(11)
  value = adversarial.pgd_probe(ctx, key, 0, 0.1)
  # Site i draws one [C] vector from fold_in(key, i), shared by the batch.
  s0, s1 = (np.asarray(jax.random.uniform(jax.random.fold_in(key, i), (1, N)))
            for i in range(2))
  expected = np.mean(((1.0 - s0 * s1) * clean) ** 2)
  np.testing.assert_allclose(float(value), expected, rtol=1e-5)
  assert expected < 0.9 * np.mean(clean ** 2)  # the init is no ablation


def test_pgd_probe_ascends_to_the_zero_ablation(zero_ci_context):
  ctx, clean = zero_ci_context
  key = jax.random.key(11)
  values = [float(adversarial.pgd_probe(ctx, key, n, 0.1))
            for n in (0, 3, 12)]
  zero_ablation = np.mean(clean ** 2)
  assert values[0] < values[1] < zero_ablation
  # 12 steps of 0.1 take every source from U[0,1] to 0.
  np.testing.assert_allclose(values[2], zero_ablation, rtol=1e-6)


def test_eval_probe_reaches_the_zero_ablation_and_zero_steps_disable_it():
  target, weights = _diag_target()
  ci_fn = _zero_ci_fn(target.sites)
  loss_terms = _terms(target.sites)
  state = _state(target, ci_fn, loss_terms, _perfect_components(weights), {},
                 (BATCH,))

  def sample(key):
    return sparse_data.sample_sparse_features(key, BATCH, N, 0.3, 0.0, 1.0)

  scalars = {}
  for n_steps in (12, 0):
    config = eval_step.EvalConfig(n_batches=2, total_steps=10,
                                  pgd_steps=n_steps, pgd_lr=0.1)
    fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, sample)
    output, _ = fns.fast(state, weights, jax.random.key(5))
    scalars[n_steps] = eval_step.summarize(jax.device_get(output)).scalars
  s = scalars[12]
  assert s["recon/zero"] > s["recon/random"] > 0
  np.testing.assert_allclose(s["recon/pgd"], s["recon/zero"], rtol=1e-6)
  assert "recon/pgd" not in scalars[0]
  assert scalars[0]["recon/zero"] == s["recon/zero"]


@pytest.mark.parametrize("field,value,message", [
  ("pgd_steps", -1, "PGD steps must be >= 0"),
  ("pgd_lr", 0.0, "PGD step size must be positive"),
])
def test_eval_config_refuses_a_bad_pgd_probe(field, value, message):
  with pytest.raises(ValueError, match=message):
    eval_step.EvalConfig(n_batches=1, total_steps=1, **{field: value})


# TMS 5-2 with the hidden identity (SPEC §10), split exactly into one
# rank-1 component per feature in both embeddings and two components that
# add up to the identity, at `TMS_C = 6` components per site (the last one
# zero). The oracle CI reads the features themselves: component `f` of
# either embedding is on where feature `f` is, the hidden pair wherever any
# feature is, so the probe CI is the identity and a dense `k = 2` block.

TMS_C = 6
TMS_ANGLES = 2 * np.pi * np.arange(5) / 5
TMS_NORMS = np.array([1.0, 0.8, 1.2, 0.9, 1.1])
TMS_W = TMS_NORMS[:, None] * np.stack(
  [np.cos(TMS_ANGLES), np.sin(TMS_ANGLES)], 1)


def _tms_split(w):
  """Return the exact split: linear1 `V = e_f`, `U[f] = W[f]`; linear2
  `V[:, f] = W[f]`, `U = e_f` (W.T's columns); hidden `V = U = e_j`."""
  n, m = w.shape
  v1, u1 = np.zeros((n, TMS_C)), np.zeros((TMS_C, m))
  v1[np.arange(n), np.arange(n)], u1[:n] = 1.0, w
  vh, uh = np.zeros((m, TMS_C)), np.zeros((TMS_C, m))
  vh[np.arange(m), np.arange(m)] = uh[np.arange(m), np.arange(m)] = 1.0
  v2, u2 = np.zeros((m, TMS_C)), np.zeros((TMS_C, n))
  v2[:, :n], u2[np.arange(n), np.arange(n)] = w.T, 1.0
  return {name: sites_lib.Factors(jnp.asarray(v[None], jnp.float32),
                                  jnp.asarray(u[None], jnp.float32))
          for name, v, u in (("linear1", v1, u1), ("hidden_layers.0", vh, uh),
                             ("linear2", v2, u2))}


def _feature_ci_fn(sites):
  def apply(params, taps, components):
    del params, components
    x = taps["linear1"]
    lead = x.shape[:-1]
    on = jnp.concatenate(
      [jnp.where(x > 0, 2.0, -1.0), jnp.full(lead + (TMS_C - 5,), -1.0)], -1)
    any_on = jnp.any(x > 0, axis=-1, keepdims=True)
    dense = jnp.where(any_on & (jnp.arange(TMS_C) < 2), 2.0, -1.0)
    return {"linear1": on, "hidden_layers.0": dense, "linear2": on}

  return ci_fns.CIFn(("linear1",), lambda key: {}, apply)


@pytest.fixture(scope="module")
def tms_eval():
  """Return `evaluate(components) -> summary` on TMS 5-2+ID (both tiers,
  each compiled once) and the held-out batches."""
  config = tms.TmsConfig(5, 2, hidden_identity=True)
  target = tms.target_fns(config, TMS_C)
  weights = tms.TmsWeights(w=jnp.asarray(TMS_W, jnp.float32),
                           b=jnp.zeros(5), hidden=jnp.eye(2))
  ci_fn = _feature_ci_fn(target.sites)
  loss_terms = _terms(target.sites)
  state = _state(target, ci_fn, loss_terms, _tms_split(TMS_W), {}, (BATCH,))

  def sample(key):
    return sparse_data.sample_sparse_features(key, BATCH, 5, 0.3, 0.0, 1.0)

  eval_config = eval_step.EvalConfig(n_batches=2, total_steps=10,
                                     pgd_steps=1)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, eval_config,
                                 sample)
  key = jax.random.key(5)

  def evaluate(components):
    s = state._replace(components=components)
    output, batches = fns.fast(s, weights, key)
    output = jax.device_get(eval_step.merge_slow(
      output, fns.slow(s, weights, key, batches)))
    return eval_step.summarize(output, target.expected), np.asarray(batches)

  return evaluate, fns


def _merged(components):
  """Return the split with linear2's component 0 also writing feature 1
  (whose own component is emptied)."""
  u = np.array(components["linear2"].u)
  u[0, 0, 1], u[0, 1, 1] = 1.0, 0.0
  return {**components, "linear2": components["linear2"]._replace(
    u=jnp.asarray(u))}


def test_exact_tms_split_matches_every_feature(tms_eval):
  summary, _ = tms_eval[0](_tms_split(TMS_W))
  s = summary.scalars
  for site in ("linear1", "linear2"):
    np.testing.assert_allclose([s[f"mmcs/{site}"], s[f"ml2r/{site}"]],
                               [1.0, 1.0], rtol=1e-6)
    assert s[f"identity_ci_error/{site}"] == 0
  # The hidden identity is dense (SPEC §10): no feature axis, no match, and
  # its error is the dense one alone.
  assert s["dense_ci_error/hidden_layers.0"] == 0
  assert "identity_ci_error/hidden_layers.0" not in s
  assert "mmcs/hidden_layers.0" not in s
  # Every component unmasked, the split is the target itself.
  assert s["recon/unmasked"] < 1e-12


def test_halved_u_halves_ml2r_and_keeps_mmcs(tms_eval):
  split = _tms_split(TMS_W)
  halved = {**split, "linear1": split["linear1"]._replace(
    u=split["linear1"].u / 2)}
  s = tms_eval[0](halved)[0].scalars
  np.testing.assert_allclose([s["mmcs/linear1"], s["ml2r/linear1"]],
                             [1.0, 0.5], rtol=1e-6)
  np.testing.assert_allclose([s["mmcs/linear2"], s["ml2r/linear2"]],
                             [1.0, 1.0], rtol=1e-6)


def test_merged_features_lower_mmcs_by_hand(tms_eval):
  s = tms_eval[0](_merged(_tms_split(TMS_W)))[0].scalars
  # Feature 1's column is now best served by component 0, whose vector is
  # W[0]: cosine cos 72°, norm ratio |W[0]| / |W[1]|; the others stay exact.
  np.testing.assert_allclose(s["mmcs/linear2"],
                             (4 + np.cos(2 * np.pi / 5)) / 5, rtol=1e-6)
  np.testing.assert_allclose(s["ml2r/linear2"],
                             (4 + TMS_NORMS[0] / TMS_NORMS[1]) / 5,
                             rtol=1e-6)
  np.testing.assert_allclose([s["mmcs/linear1"], s["ml2r/linear1"]],
                             [1.0, 1.0], rtol=1e-6)


def _unit_expectations(soft, ratio, batches):
  """Return the four `nonlinearity/*/neuron` scalars of per-component soft
  counts and ratios, active = components whose feature fires somewhere."""
  active = np.zeros(TMS_C, bool)
  active[:5] = np.any(batches > 0, axis=(0, 1))
  soft, ratio = np.asarray(soft), np.asarray(ratio)
  return {"nonlinearity/soft_count/neuron": soft.mean(),
          "nonlinearity/participation/neuron": ratio.mean(),
          "nonlinearity/soft_count_active/neuron": soft[active].mean(),
          "nonlinearity/participation_active/neuron": ratio[active].mean()}


@pytest.mark.parametrize("merged", [False, True])
def test_slow_tier_reports_linear2_unit_locality(tms_eval, merged):
  """SPEC §5.10 eval at t = 4 over linear2's 5 neurons: a one-neuron write
  counts 1/(1 + 4/5) with ratio 1; the merged component's even split over
  two neurons 2·0.5/(0.5 + 4/5) with ratio 2; zero rows count 0."""
  split = _tms_split(TMS_W)
  summary, batches = tms_eval[0](_merged(split) if merged else split)
  one, two = 1 / (1 + 4 / 5), 1 / 1.3
  if merged:
    soft, ratio = [two, 0, one, one, one, 0], [2, 0, 1, 1, 1, 0]
  else:
    soft, ratio = [one] * 5 + [0], [1] * 5 + [0]
  for key, value in _unit_expectations(soft, ratio, batches).items():
    np.testing.assert_allclose(summary.scalars[key], value, rtol=1e-6,
                               err_msg=key)


def test_tms_eval_passes_compile_once(tms_eval):
  """Two evaluations of different components, whatever ran before: one
  program per tier."""
  evaluate, fns = tms_eval
  split = _tms_split(TMS_W)
  evaluate(split)
  evaluate(_merged(split))
  assert fns.fast._cache_size() == 1 and fns.slow._cache_size() == 1


def test_probe_scalars_name_each_site_by_its_expected_pattern():
  """A ResidMLP-like pair (SPEC §10): `mlp_in` identity, `mlp_out` dense
  over k = 3 with one weak dense column and one stray entry."""
  ci_in = np.eye(4, 6)
  ci_out = np.zeros((4, 6))
  ci_out[:, [4, 1, 2]] = 1.0
  ci_out[:, 2] = 0.85          # the third dense column never reaches 0.9
  ci_out[3, 0] = 0.5           # a stray entry outside the dense block
  ci = {"layers.0.mlp_in": ci_in, "layers.0.mlp_out": ci_out}
  expected = {"layers.0.mlp_in": Expected("identity"),
              "layers.0.mlp_out": Expected("dense", 3)}
  assert eval_step.probe_scalars(ci, {}, expected) == {
    "identity_ci_error/layers.0.mlp_in": 0.0,
    "dense_ci_error/layers.0.mlp_out": 2.0}
  # Without expected patterns every site keeps the identity error.
  plain = eval_step.probe_scalars(ci, {})
  assert set(plain) == {"identity_ci_error/layers.0.mlp_in",
                        "identity_ci_error/layers.0.mlp_out"}
  assert plain["identity_ci_error/layers.0.mlp_out"] > 0
