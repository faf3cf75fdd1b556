"""The step's records: a term's metric names, a stateless term built from a
value function, a stream's refusals, and the context's delta pin and loss
positions (SPEC §6.6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import step_records
from decompax.core.masks import SiteMask


def test_a_terms_metric_drops_its_streams_prefix():
  assert step_records.term_metric("importance") == "loss/importance"
  assert step_records.term_metric("nontarget_recon", "nontarget") == (
    "nontarget/loss/recon")
  term = step_records.LossTerm("target_pgd", 1.0, None, stream="target")
  assert term.metric() == "target/loss/pgd"
  assert term.metric("pgd_steps") == "target/loss/pgd_steps"


def test_a_simple_term_returns_its_value_and_no_aux():
  term = step_records.simple_term(
    "constant", 0.5, lambda ctx, key: jnp.asarray(3.0) + ctx)
  value, aux = term.fn(jnp.asarray(1.0), jax.random.key(0), None)
  assert (float(value), aux) == (4.0, None)
  assert term.coeff == 0.5 and term.init_state is None


def test_the_default_constraint_is_the_identity():
  tree = {"a": jnp.ones(2)}
  assert step_records.no_constraint("operands", tree) is tree


@pytest.mark.parametrize("name, positions, message", [
  ("a/b", None, "takes no '/'"), ("target", (), "names no position")])
def test_a_bad_stream_is_refused(name, positions, message):
  with pytest.raises(ValueError, match=message):
    step_records.StreamSpec(name, loss_positions=positions)


def _context(**options):
  return step_records.StepContext(
    jnp.asarray(0), 1, None, None, None, jnp.zeros(()), {}, None, **options)


def test_a_pinned_stream_runs_every_delta_at_one():
  masks = {"s": SiteMask(jnp.full((2, 3), 0.5), jnp.zeros(2))}
  assert _context().pinned(masks) is masks
  pinned = _context(delta_pin=True).pinned(masks)
  np.testing.assert_array_equal(pinned["s"].delta, np.ones(2))
  np.testing.assert_array_equal(pinned["s"].mask, masks["s"].mask)
