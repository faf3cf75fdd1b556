"""The objective of one step over its prepared values (SPEC §6.1): the
components and CI prepared once (`prepare`, `prepare_roles`), the
coefficiented sum of the terms (`objective`), the total the step reports,
and the passes scored one after another behind an optimization barrier
(`sequential_objective_grads`). `scale_cotangent` scales a value's
cotangent and leaves its forward unchanged.
"""

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from decompax.core import schedules, squash, step_records
from decompax.core.ci_fns import CIFn, role_pre
from decompax.core.sites import Components


@jax.custom_vjp
def scale_cotangent(x: Any, scale: Float[Array, ""]) -> Any:
  """Return `x` unchanged; its cotangent is multiplied by `scale`."""
  del scale
  return x


def _scale_fwd(x, scale):
  return x, scale


def _scale_bwd(scale, g):
  return jax.tree.map(lambda t: t * scale.astype(t.dtype), g), jnp.zeros_like(
    scale)


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def with_prepared(ctx: step_records.StepContext,
                  prepared: tuple) -> step_records.StepContext:
  """Return `ctx` reading `prepared`: `(components, ci)`, then the
  compute-dtype V/U when the step casts them (N4)."""
  components, ci, *compute = prepared
  return ctx._replace(components=components, ci=ci,
                      compute_components=compute[0] if compute else None)


def prepared_of(ctx: step_records.StepContext) -> tuple:
  """Return what `with_prepared` read into `ctx` (its inverse)."""
  if ctx.compute_components is None:
    return ctx.components, ctx.ci
  return ctx.components, ctx.ci, ctx.compute_components


def cast_floats(tree: Any, dtype: Any) -> Any:
  """Return `tree` with its floating-point leaves cast to `dtype`."""
  return jax.tree.map(
    lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
    else a, tree)


def prepare(
  components: Components, ci_params: Any, taps: dict, ci_fn: CIFn,
  compute_dtype: Optional[str],
  constrain: step_records.Constrain = step_records.no_constraint,
) -> tuple:
  """Return `(components, ci)`, plus the compute-dtype V/U when
  `compute_dtype` is set, as `with_prepared` reads them: the output role's.

  With a compute dtype (N4) V/U are cast once, before the gather to the
  compute layout, and so are the CI parameters and taps before the CI call;
  the fp32 masters stay for faithfulness (N2) and the CI is squashed in
  fp32 (N3).
  """
  components, compute, pre = _run_ci(components, ci_params, taps,
                                     ci_fn.apply, compute_dtype, constrain)
  return _packed(components, _squash(pre, constrain), compute)


def prepare_roles(
  components: Components, ci_params: Any, taps: dict, ci_fn: CIFn,
  compute_dtype: Optional[str],
  constrain: step_records.Constrain = step_records.no_constraint,
) -> tuple[tuple, ...]:
  """Return `prepare`'s tuple for every role of `ci_fn`, in its order, the
  CI trunk run once."""
  components, compute, by_role = _run_ci(
    components, ci_params, taps,
    lambda *args: role_pre(ci_fn, *args), compute_dtype, constrain)
  return tuple(_packed(components, _squash(by_role[r], constrain), compute)
               for r in ci_fn.roles)


def _run_ci(components, ci_params, taps, apply, compute_dtype, constrain):
  """Return `(components, compute-dtype V/U or None, apply(...))`."""
  if compute_dtype is None:
    components = constrain("compute", components)
    return components, None, apply(ci_params, taps, components)
  compute = constrain("compute", cast_floats(components, compute_dtype))
  return components, compute, apply(cast_floats(ci_params, compute_dtype),
                                    cast_floats(taps, compute_dtype), compute)


def _packed(components, ci, compute) -> tuple:
  return (components, ci) if compute is None else (components, ci, compute)


def _squash(pre: dict, constrain: step_records.Constrain) -> squash.CIOutput:
  return squash.squash(constrain("ci_activations",
                                 cast_floats(pre, jnp.float32)))


def objective(
  prepared: tuple,
  term_inputs: tuple,
  ctxs: tuple[step_records.StepContext, ...],
  terms: tuple[step_records.LossTerm, ...],
  keys: list,
  term_passes: tuple[int, ...],
) -> tuple[Float[Array, ""], tuple[dict[str, Array], Float[Array, ""], tuple]]:
  """Return the differentiated sum, the raw term values, the coefficiented
  total and each term's aux. `prepared[i]` is pass `i`'s, as
  `with_prepared` reads it into `ctxs[i]`; term `j` scores pass
  `term_passes[j]`."""
  differentiated = jnp.zeros((), jnp.float32)
  reported = jnp.zeros((), jnp.float32)
  values, auxes = {}, []
  for term, key, inputs, i in zip(terms, keys, term_inputs, term_passes):
    ctx, own = ctxs[i], prepared[i]
    coeff = schedules.schedule_value(term.coeff, ctx.step, ctx.total_steps)
    if term.coeff_on_model_side:
      term_ctx = with_prepared(
        ctx, tuple(scale_cotangent(p, coeff) for p in own))
      value, aux = term.fn(term_ctx, key, inputs)
      differentiated = differentiated + value
    else:
      value, aux = term.fn(with_prepared(ctx, own), key, inputs)
      differentiated = differentiated + coeff * value
    reported = reported + coeff * value
    values[term.name] = value
    auxes.append(aux)
  return differentiated, (values, reported, tuple(auxes))


def reported_total(terms: tuple[step_records.LossTerm, ...],
                   values: dict[str, Array],
                   step: Int[Array, ""], total_steps: int) -> Float[Array, ""]:
  """Return `Σ coeff·value` in the terms' order (as `objective` sums it)."""
  total = jnp.zeros((), jnp.float32)
  for term in terms:
    total = total + schedules.schedule_value(
      term.coeff, step, total_steps) * values[term.name]
  return total


def sequential_objective_grads(
  prepared: tuple, term_inputs: tuple,
  ctxs: tuple[step_records.StepContext, ...],
  terms: tuple[step_records.LossTerm, ...], keys: list,
  term_passes: tuple[int, ...],
) -> tuple[dict[str, Array], tuple, tuple, tuple]:
  """Return `(values, auxes, g_prepared, g_inputs)` as one backward of
  `objective` would, scoring one pass at a time.

  Each pass's inputs go through an optimization barrier together with the
  previous pass's gradients, so XLA cannot start a pass's masked forwards
  before the previous pass's backward is done.
  """
  g_prepared = [jax.tree.map(jnp.zeros_like, own) for own in prepared]
  g_inputs, auxes, values = [None] * len(terms), [None] * len(terms), {}
  done = None
  for p in sorted(set(term_passes)):
    picked = [j for j, q in enumerate(term_passes) if q == p]
    own, inputs = prepared[p], tuple(term_inputs[j] for j in picked)
    if done is not None:
      done, own, inputs = jax.lax.optimization_barrier((done, own, inputs))

    def one_pass(own, inputs, p=p, picked=picked):
      return objective((own,), inputs, (ctxs[p],),
                       tuple(terms[j] for j in picked),
                       [keys[j] for j in picked], (0,) * len(picked))

    (_, (pass_values, _, pass_auxes)), (g_own, g_in) = jax.value_and_grad(
      one_pass, argnums=(0, 1), has_aux=True, allow_int=True)(own, inputs)
    g_prepared[p] = g_own
    values.update(pass_values)
    for j, aux, g in zip(picked, pass_auxes, g_in):
      auxes[j], g_inputs[j] = aux, g
    done = g_own
  return values, tuple(auxes), tuple(g_prepared), tuple(g_inputs)
