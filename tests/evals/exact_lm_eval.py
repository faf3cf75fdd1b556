"""An exactly decomposed tiny GLU LM under the fast eval, shared by the
tests of the eval's attention-row and router recon (design §11).

The test gives the target, its exact factors and a CI function of all ones
whose `knock` parameter sets one component's CI to 0; these helpers build
the run's state and read the eval's scalars with and without the knock.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from decompax.core import optim, step_records, train_step
from decompax.core.schedules import Schedule
from decompax.evals import eval_step
from decompax.losses import loss_terms as terms
from decompax.losses import recon
from decompax.recipe import config as config_lib
from decompax.recipe import evaluation
from decompax.targets import glu_arrays, glu_sites, glu_weights


def random_weights(config, sites):
  """Return random frozen weights of `config`, stacked around `sites`."""
  stack = glu_weights.init_stack(jax.random.key(0), config, config.n_layers)
  arrays = {k: np.asarray(v) for k, v in stack._asdict().items()
            if v is not None}
  arrays["embed"] = np.random.default_rng(1).standard_normal(
    (config.vocab_size, config.d_model)).astype(np.float32)
  arrays["norm"] = np.ones(config.d_model, np.float32)
  return glu_arrays.weights_from_arrays(
    arrays, config, glu_sites.span_segments(config, sites))


def exact_run(target, ci_fn, components, weights, batch_shape):
  """Return `(target, ci_fn, loss terms, weights, state)`: faithfulness
  and stochastic recon over every site, the state initialised from the
  exact `components`."""
  loss_terms = (terms.faithfulness_term(1.0),
                terms.stochastic_recon_term(
                  "stochastic_recon", 1.0,
                  recon.all_sites_plan(target.sites), False))
  adam = optim.AdamWConfig(Schedule(1e-3))
  built = train_step.make_train_step(target, ci_fn, loss_terms,
                                     step_records.StepConfig(10, adam, adam))
  state = built.init(components, ci_fn.init(None), jax.random.key(3),
                     batch_shape)
  return target, ci_fn, loss_terms, weights, state


def knocked(state, knock: bool = True):
  """Return `state` with the CI function's knock set."""
  return state._replace(ci_params={"knock": jnp.array(knock)})


def fast_scalars(run, sample, **eval_flags):
  """Return the fast eval's scalars without and with the knock."""
  target, ci_fn, loss_terms, weights, state = run
  config = eval_step.EvalConfig(n_batches=2, total_steps=10, pgd_steps=0,
                                **eval_flags)
  fns = eval_step.make_eval_step(target, ci_fn, loss_terms, config, sample)
  return tuple(
    eval_step.summarize(jax.device_get(fns.fast(
      knocked(state, knock), weights, jax.random.key(5))[0])).scalars
    for knock in (False, True))


def unscored_names(run, sample) -> list[str]:
  """Return the scalars one fast eval at its defaults would report."""
  target, ci_fn, loss_terms, weights, state = run
  fns = eval_step.make_eval_step(
    target, ci_fn, loss_terms,
    eval_step.EvalConfig(n_batches=1, total_steps=10, pgd_steps=0), sample)
  return list(jax.eval_shape(fns.fast, state, weights,
                             jax.random.key(0))[0].scalars)


def evaluator_record(run, sample, out_dir, **config_flags):
  """Return the run evaluator's record at step 5 of the knocked state."""
  target, ci_fn, loss_terms, weights, state = run
  config = dataclasses.replace(
    config_lib.DEFAULTS, target="hf", num_steps=10, eval_every=5,
    slow_eval_every=0, eval_batches=2, eval_pgd_steps=0, **config_flags)
  evaluator = evaluation.make_evaluator(
    config, target, ci_fn, loss_terms, sample, weights, str(out_dir),
    say=print)
  record = evaluator.evaluate(knocked(state), 5)
  evaluator.close()
  return record
