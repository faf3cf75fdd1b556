"""Eval metric math on cases with known answers (SPEC §5.11, §11)."""

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import masks
from decompax.core.sites import SiteSpec
from decompax.evals import eval_metrics

SITES = (SiteSpec("a", "a", 0, 3, 3, 4), SiteSpec("b", "b", 0, 3, 2, 2))


def _ci(shape_a=(5, 4), shape_b=(5, 2)):
  keys = jax.random.split(jax.random.key(0), 2)
  return {"a": jax.random.uniform(keys[0], shape_a),
          "b": jax.random.uniform(keys[1], shape_b)}


def test_variant_outputs_run_every_variant_on_its_own_key():
  ci = _ci()
  key = jax.random.key(1)

  def masked_forward(site_masks):
    return jnp.stack([jnp.sum(m.mask) for m in site_masks.values()])

  out = eval_metrics.variant_outputs(masked_forward, key, ci, SITES, True, 0.5)
  assert list(out) == list(masks.VARIANTS)
  for v, variant in enumerate(masks.VARIANTS):
    want = masks.variant_site_masks(variant, jax.random.fold_in(key, v), ci,
                                    SITES, True, 0.5)
    np.testing.assert_array_equal(out[variant], masked_forward(want))
  assert not np.array_equal(out["stochastic"], out["random"])


def test_cross_entropy_known_answers():
  labels = jnp.array([[1, 2, -1]])
  uniform = jnp.zeros((1, 3, 5))
  np.testing.assert_allclose(eval_metrics.cross_entropy(uniform, labels),
                             np.log(5), rtol=1e-6)
  certain = jax.nn.one_hot(jnp.array([[1, 2, 0]]), 5) * 100.0
  assert float(eval_metrics.cross_entropy(certain, labels)) < 1e-6
  # A wrong prediction at the unlabelled last position does not count.
  wrong_last = certain.at[0, 2].set(jax.nn.one_hot(4, 5) * 100.0)
  assert float(eval_metrics.cross_entropy(wrong_last, labels)) < 1e-6


def test_ce_metrics_are_zero_for_clean_and_relative_to_zero_ablation():
  key_clean, key_zero, key_mid = jax.random.split(jax.random.key(3), 3)
  labels = jax.random.randint(key_clean, (4, 6), 0, 7)
  clean = jax.nn.one_hot(labels, 7) * 4.0
  zero = jax.random.normal(key_zero, (4, 6, 7))
  outputs = {"unmasked": clean, "zero": zero,
             "random": clean + jax.random.normal(key_mid, (4, 6, 7))}
  labels = labels.at[:, -1].set(-1)  # the last position predicts nothing
  out = eval_metrics.ce_metrics(outputs, clean, labels)
  assert float(out["ce_diff/unmasked"]) == 0.0
  assert float(out["ce_unrecovered/unmasked"]) == 0.0
  # Against a float64 cross-entropy written out here (`ce_unrecovered/zero`
  # is 1 by construction, so the random variant carries the check).
  ce = {k: _np_cross_entropy(v, labels) for k, v in outputs.items()}
  clean_ce = _np_cross_entropy(clean, labels)
  np.testing.assert_allclose(out["ce/clean"], clean_ce, rtol=1e-5)
  for variant in ("zero", "random"):
    np.testing.assert_allclose(out[f"ce_diff/{variant}"],
                               ce[variant] - clean_ce, rtol=1e-5)
  np.testing.assert_allclose(
    out["ce_unrecovered/random"],
    (ce["random"] - clean_ce) / (ce["zero"] - clean_ce), rtol=1e-5)
  assert 0.05 < float(out["ce_unrecovered/random"]) < 0.95


def _np_cross_entropy(logits, labels):
  """Return the mean next-token CE over labelled positions, in float64."""
  logits, labels = np.asarray(logits, np.float64), np.asarray(labels)
  log_q = logits - logits.max(-1, keepdims=True)
  log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
  valid = labels >= 0
  picked = np.take_along_axis(log_q, np.where(valid, labels, 0)[..., None],
                              -1)[..., 0]
  return -picked[valid].mean()
