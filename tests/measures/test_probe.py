"""Toy recovery metrics (SPEC §10, §11)."""

import jax
import numpy as np
import pytest

from decompax.core.target import Expected
from decompax.measures import probe
from decompax.targets import registry, resid_mlp


def _permuted_identity():
  ci = np.zeros((4, 7))
  cols = [5, 2, 6, 0]
  for row, col in enumerate(cols):
    ci[row, col] = 1.0
  return ci, cols


def test_identity_permutation_recovers_columns_then_rest():
  ci, cols = _permuted_identity()
  order = probe.identity_permutation(ci)
  assert order[:4] == cols and sorted(order) == list(range(7))


def test_identity_error_is_zero_for_identity_and_counts_breaks():
  ci, _ = _permuted_identity()
  assert probe.identity_ci_error(ci) == 0
  broken = ci.copy()
  broken[0, 1] = 0.5   # an extra active component
  broken[3, 0] = 0.7   # a weak diagonal entry
  assert probe.identity_ci_error(broken) == 2


def test_dense_error():
  ci = np.zeros((3, 5))
  ci[:, 2] = 1.0
  assert probe.dense_ci_error(ci, k=1) == 0
  assert probe.dense_ci_error(ci, k=2) == 1
  ci[1, 4] = 0.3
  assert probe.dense_ci_error(ci, k=1) == 1


def test_alive_and_active_features():
  ci, cols = _permuted_identity()
  assert probe.alive_components(ci) == sorted(cols)
  assert probe.active_features(ci)[5] == [0]


def test_permutation_recovers_permuted_identity_with_dead_columns():
  n, c = 4, 7
  rng = np.random.default_rng(0)
  perm = rng.permutation(c)
  ci = np.zeros((n, c), np.float32)
  ci[np.arange(n), perm[:n]] = 1.0
  order = probe.identity_permutation(ci)
  assert order[:n] == [int(p) for p in perm[:n]]
  assert sorted(order) == list(range(c))
  np.testing.assert_array_equal(ci[:, order][:, :n], np.eye(n))


def test_permutation_puts_leftovers_by_descending_max():
  ci = np.array([[0.9, 0.0, 0.2, 0.5]], np.float32)
  assert probe.identity_permutation(ci) == [0, 3, 2, 1]


def test_permutation_more_rows_than_columns():
  ci = np.eye(5, 3, dtype=np.float32)
  assert probe.identity_permutation(ci) == [0, 1, 2]


def _tms_split(seed: int = 0, c: int = 9):
  """A TMS-5-2-like embedding `W: [5, 2]` split exactly into one rank-1
  component per feature (`V = e_f`, `U = W[f]`), at shuffled columns among
  `c`, the rest zero."""
  rng = np.random.default_rng(seed)
  weight = rng.normal(size=(5, 2))
  columns = rng.permutation(c)[:5]
  v, u = np.zeros((5, c)), np.zeros((c, 2))
  v[np.arange(5), columns] = 1.0
  u[columns] = weight
  return weight, v, u, columns


def test_feature_match_of_an_exact_split_is_one_and_finds_the_columns():
  weight, v, u, columns = _tms_split()
  match = probe.feature_match(weight, v, u, feature_axis=0)
  np.testing.assert_allclose([match.mmcs, match.ml2r], [1.0, 1.0])
  assert list(match.best) == list(columns)
  # The tied second matrix `W.T` with the factors swapped: the same match
  # read along its output axis.
  transposed = probe.feature_match(weight.T, u.T, v.T, feature_axis=1)
  np.testing.assert_allclose([transposed.mmcs, transposed.ml2r], [1.0, 1.0])


def test_feature_match_sees_a_shared_component_and_a_wrong_scale():
  weight, v, u, columns = _tms_split()
  # Features 0 and 1 served by one component: its vector is feature 0's, so
  # feature 1's best cosine is that of W[0] with W[1], below 1.
  shared = v.copy()
  shared[1, columns[1]] = 0.0
  shared[1, columns[0]] = 1.0
  match = probe.feature_match(weight, shared, u, feature_axis=0)
  w0, w1 = weight[0], weight[1]
  cosine = abs(w0 @ w1) / np.linalg.norm(w0) / np.linalg.norm(w1)
  assert match.mmcs < 1.0
  np.testing.assert_allclose(match.mmcs, (4 + cosine) / 5, rtol=1e-12)
  # Halving every U leaves the directions and halves the norm ratio.
  halved = probe.feature_match(weight, v, u / 2, feature_axis=0)
  np.testing.assert_allclose([halved.mmcs, halved.ml2r], [1.0, 0.5])


def test_feature_match_passes_over_a_numerically_dead_component():
  weight, v, u, columns = _tms_split()
  # A dead component that points exactly along feature 0 at 1e-8 of its
  # norm, as trained runs leave them, beside a live one turned slightly off
  # the feature: by cosine alone the dead one would be the match, and the
  # feature would read ML2R ~0.
  dead = next(c for c in range(v.shape[1]) if c not in columns)
  v_dead, u_dead = v.copy(), u.copy()
  v_dead[0, dead] = 1.0
  u_dead[dead] = 1e-8 * weight[0]
  u_dead[columns[0]] = weight[0] + 1e-3 * np.array([-weight[0, 1],
                                                    weight[0, 0]])
  match = probe.feature_match(weight, v_dead, u_dead, feature_axis=0)
  assert match.best[0] == columns[0]
  np.testing.assert_allclose([match.mmcs, match.ml2r], [1.0, 1.0], atol=1e-5)
  # At twice the floor it is a candidate again, and its exact direction wins.
  u_dead[dead] = 2 * probe.MATCH_MIN_NORM_RATIO * weight[0]
  assert probe.feature_match(weight, v_dead, u_dead, 0).best[0] == dead


@pytest.mark.parametrize("feature_axis", [0, 1])
def test_ml2r_reads_the_best_cosine_component_not_the_largest(feature_axis):
  weight, v, u, columns = _tms_split()
  # SPEC §10: ML2R is the norm ratio of the best-cosine component.
  # Feature 0 keeps its exact component at half its norm and gains a spare
  # one three times its norm, 45 degrees off: the match (and the norm ratio
  # ML2R reports) is the aligned component's, though the spare is larger.
  spare = next(c for c in range(v.shape[1]) if c not in columns)
  w0 = weight[0]
  turned = np.array([w0[0] - w0[1], w0[0] + w0[1]]) / np.sqrt(2)
  v[0, spare], u[spare] = 1.0, 3.0 * turned
  u[columns[0]] = 0.5 * w0
  args = (weight, v, u) if feature_axis == 0 else (weight.T, u.T, v.T)
  match = probe.feature_match(*args, feature_axis=feature_axis)
  assert list(match.best) == list(columns)
  np.testing.assert_allclose([match.mmcs, match.ml2r], [1.0, 0.9],
                             rtol=1e-12)


def test_feature_match_of_all_dust_scores_zero():
  weight, v, u, _ = _tms_split()
  match = probe.feature_match(weight, v, 1e-6 * u, feature_axis=0)
  assert (match.mmcs, match.ml2r) == (0.0, 0.0)


def test_pattern_error_reads_the_expected_pattern():
  ci = np.zeros((3, 5))
  ci[:, :2] = 1.0
  assert probe.pattern_error(ci, Expected("dense", 2)) == 0
  assert probe.pattern_error(ci, Expected("identity")) == \
    probe.identity_ci_error(ci) > 0


def test_expected_refuses_inconsistent_patterns():
  for bad in (dict(pattern="dense"), dict(pattern="identity", k=3),
              dict(pattern="diagonal"), dict(pattern="identity",
                                                feature_axis=2)):
    with pytest.raises(ValueError):
      Expected(**bad)


def test_pattern_permutation_orders_dense_sites_by_column_mass():
  ci = np.array([[0.0, 0.5, 1.0, 0.0],
                 [0.0, 0.5, 1.0, 0.2]])
  assert probe.dense_permutation(ci) == [2, 1, 3, 0]
  assert probe.pattern_permutation(ci, Expected("dense", 1)) == [2, 1, 3, 0]
  for identity in (None, Expected("identity")):
    assert probe.pattern_permutation(ci, identity) == \
      probe.identity_permutation(ci)


def test_identity_breaks_names_each_form_of_failure():
  assert probe.identity_breaks(np.eye(4)) == (0, 0, 0, 0, 1.0)
  # One column serving features 0-2 at CI 1 (the TMS `linear2` failure).
  shared = np.zeros((4, 4))
  shared[:3, 0] = 1.0
  shared[3, 3] = 1.0
  assert probe.identity_breaks(shared) == (1, 3, 0, 0, 1.0)
  # Feature 1 needs two components; feature 2 is kept at CI 0.6 only.
  split = np.eye(4, 5)
  split[1, 4] = 0.8
  split[2, 2] = 0.6
  assert probe.identity_breaks(split) == (0, 0, 1, 1, 0.6)
  assert probe.identity_ci_error(split) == 2


def test_dense_breaks_counts_extra_pieces_and_missing_columns():
  block = np.full((6, 3), 1.0)
  assert probe.dense_breaks(block, k=3) == (0, 0, 0, 1.0)
  pieces = np.concatenate([block, np.zeros((6, 2))], axis=1)
  pieces[0, 3] = pieces[4, 3] = 0.5  # one piece on two features
  pieces[1, 4] = 0.2
  assert probe.dense_breaks(pieces, k=3) == (2, 3, 0, 1.0)
  assert probe.dense_ci_error(pieces, k=3) == 3
  faint = block.copy()
  faint[:, 1] = 0.7
  assert probe.dense_breaks(faint, k=3) == (0, 0, 1, 0.7)


def test_the_lowest_peak_tells_a_near_miss_from_a_faint_column():
  # Both blocks miss the 0.9 threshold on one column; only the peak tells
  # the kept piece just under the line from the faint one.
  near = np.full((6, 3), 1.0)
  near[:, 2] = np.linspace(0.2, 0.899, 6)
  faint = np.full((6, 3), 1.0)
  faint[:, 2] = 0.3
  assert probe.dense_breaks(near, k=3).missing == 1
  assert probe.dense_breaks(near, k=3).lowest_peak == pytest.approx(0.899)
  assert probe.dense_breaks(faint, k=3).lowest_peak == pytest.approx(0.3)
  kept = np.eye(3)
  kept[1, 1] = 0.89
  assert probe.identity_breaks(kept).weak == 1
  assert probe.identity_breaks(kept).lowest_peak == pytest.approx(0.89)


def test_pattern_breaks_reads_the_expected_pattern():
  ci = np.full((6, 3), 1.0)
  assert probe.pattern_breaks(ci, Expected("dense", 3)) == \
    probe.dense_breaks(ci, 3)
  assert probe.pattern_breaks(ci, Expected("identity")) == \
    probe.identity_breaks(ci)


def test_probe_reads_are_how_far_each_feature_moves_a_site():
  toy = registry.get("tms_5-2")
  c = {"linear1": 3, "linear2": 3}
  target = toy.fns(c)
  weights = toy.init(jax.random.key(0))
  # Neither site's output holds the output bias, so a zero input moves
  # neither: linear1 reads row i of W at the probe's 0.75, linear2 that row
  # through Wᵀ.
  reads = probe.probe_reads(target, weights)
  w = np.asarray(weights.w)
  np.testing.assert_allclose(reads["linear1"],
                             0.75 * np.linalg.norm(w, axis=1), rtol=1e-6)
  np.testing.assert_allclose(reads["linear2"],
                             0.75 * np.linalg.norm(w @ w.T, axis=1),
                             rtol=1e-5)


def test_probe_reads_leave_out_what_a_zero_input_already_gives():
  config = resid_mlp.ResidMlpConfig(2, 4, 3, d_embed=6, in_bias=True,
                                    out_bias=True)
  target = resid_mlp.target_fns(config, 2)
  weights = resid_mlp.init(jax.random.key(1), config)
  reads = probe.probe_reads(target, weights)
  # The first layer's biases reach the second layer's input on every input,
  # the zero one included; only what the feature changes is its read.
  w_e, w_in, w_out = (np.asarray(a) for a in
                      (weights.w_e, weights.w_in, weights.w_out))
  b_in, b_out = np.asarray(weights.b_in), np.asarray(weights.b_out)

  def second_read(x):
    first = np.maximum(x @ w_e @ w_in[0] + b_in[0], 0) @ w_out[0]
    return (x @ w_e + first + b_out[0]) @ w_in[1]

  probes = 0.75 * np.eye(4)
  moved = second_read(probes) - second_read(np.zeros((1, 4)))
  np.testing.assert_allclose(reads["layers.1.mlp_in"],
                             np.linalg.norm(moved, axis=1), rtol=1e-5)
  np.testing.assert_allclose(reads["layers.0.mlp_in"],
                             np.linalg.norm(probes @ w_e @ w_in[0], axis=1),
                             rtol=1e-5)
  assert set(reads) == {s.name for s in target.sites}


def test_probe_read_vectors_are_the_moves_whose_norms_are_the_reads():
  toy = registry.get("tms_5-2")
  target = toy.fns({"linear1": 3, "linear2": 3})
  weights = toy.init(jax.random.key(0))
  vectors = probe.probe_read_vectors(target, weights)
  # linear1's output on a probe is the probe's 0.75 times row i of W.
  np.testing.assert_allclose(vectors["linear1"],
                             0.75 * np.asarray(weights.w), rtol=1e-6)
  reads = probe.probe_reads(target, weights)
  for name, moved in vectors.items():
    np.testing.assert_allclose(reads[name], np.linalg.norm(moved, axis=1),
                               rtol=1e-6)


def _fan(angles):
  return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def test_shared_reads_rank_the_pair_a_component_serves_among_all_pairs():
  # Reads at 0, 0.1, 1.2 and 2.0 rad: features 0 and 1 are the site's most
  # parallel pair (cosine cos 0.1), 2 and 3 its third (cos 0.8).
  vectors = 3.0 * _fan(np.array([0.0, 0.1, 1.2, 2.0]))
  ci = np.eye(4)
  ci[1, 0] = 1.0  # component 0 serves features 0 and 1
  shared = probe.shared_reads(ci, vectors)
  assert shared.cosine == pytest.approx(np.cos(0.1))
  assert (shared.as_parallel, shared.pairs) == (1, 6)
  # A component on the pair 2, 3 (0.8 rad apart): of the other pairs only
  # 0, 1 is as parallel (1.1 rad the next).
  ci = np.eye(4)
  ci[3, 2] = 0.5
  shared = probe.shared_reads(ci, vectors)
  assert shared.cosine == pytest.approx(np.cos(0.8))
  assert shared.as_parallel == 2
  # Two shared components: the lower of their cosines speaks for both.
  ci[1, 0] = 1.0
  assert probe.shared_reads(ci, vectors).cosine == pytest.approx(np.cos(0.8))
  # A component on three features is as parallel as its least parallel pair.
  ci = np.eye(4)
  ci[1, 0] = ci[2, 0] = 1.0
  assert probe.shared_reads(ci, vectors).cosine == pytest.approx(np.cos(1.2))


def test_shared_reads_are_none_without_sharing_or_with_an_unread_feature():
  vectors = _fan(np.array([0.0, 0.1, 1.2, 2.0]))
  assert probe.shared_reads(np.eye(4), vectors) is None
  ci = np.eye(4)
  ci[1, 0] = 1.0
  # Below the activity threshold a second feature is not served.
  ci_faint = np.eye(4)
  ci_faint[1, 0] = 0.05
  assert probe.shared_reads(ci_faint, vectors) is None
  vectors[3] = 0.0
  assert probe.shared_reads(ci, vectors) is None


def test_weak_read_ratio_compares_weak_features_with_the_rest():
  ci = np.eye(4)
  ci[1, 1] = ci[3, 3] = 0.7
  reads = np.array([2.0, 0.5, 4.0, 1.5])
  assert probe.weak_read_ratio(ci, reads) == pytest.approx(1.0 / 3.0)
  # Nothing to compare without weak features, or without the rest.
  assert np.isnan(probe.weak_read_ratio(np.eye(4), reads))
  assert np.isnan(probe.weak_read_ratio(0.5 * np.eye(4), reads))
