"""Faithfulness warmup of fresh runs (SPEC §6.2).

`n_steps` AdamW steps on the faithfulness loss alone, in one jitted loop;
the optimizer used here is discarded afterwards (I33). The loop may run in
chunks of steps, with the host called between them (`Between`): that is
where a run on a cluster notices a stop signal, at a step boundary, however
long the warmup. Every step runs the same compiled loop body, so the result
does not depend on where the chunks end.
"""

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from decompax.core.sites import Components

WarmupLoss = Callable[[Components, dict[str, Array]], Float[Array, ""]]
# `between(done, seconds)`: called after each chunk that leaves steps to
# run, with the steps done so far and the chunk's wall time; returns the
# next chunk's length, or raises to end the warmup there.
Between = Callable[[int, float], int]
# Wall time a chunk aims at: short enough to answer a stop signal within
# about a second, long enough that the host's look between chunks costs
# nothing measurable.
CHUNK_SECONDS = 0.5


def next_chunk(length: int, seconds: float,
               target: float = CHUNK_SECONDS) -> int:
  """Return the next chunk's length after one of `length` steps took
  `seconds`: doubled while well under `target`, halved (to 1) while well
  over it (the first chunk, which compiles, among them)."""
  if seconds < target / 2:
    return 2 * length
  if seconds > 2 * target:
    return max(length // 2, 1)
  return length


def faithfulness_warmup(
  loss_fn: WarmupLoss,
  components: Components,
  w_stacks: dict[str, Float[Array, "layer d_in d_out"]],
  n_steps: int,
  lr: float,
  weight_decay: float,
  between: Between | None = None,
) -> tuple[Components, Float[Array, " n"]]:
  """Return the warmed components and the loss before each warmup step.

  Without `between` the steps run as one chunk; with it, in chunks that
  start at one step and follow its answers.
  """
  if n_steps <= 0:
    return components, jnp.zeros((0,))
  tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)

  @jax.jit
  def run(params, opt_state, losses, w_stacks, start, stop):
    def body(i, carry):
      params, opt_state, losses = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, w_stacks)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state,
              losses.at[i].set(loss))

    # Traced bounds: one compiled loop serves every chunk.
    return jax.lax.fori_loop(start, stop, body, (params, opt_state, losses))

  loss_type = jax.eval_shape(loss_fn, components, w_stacks)
  carry = (components, tx.init(components),
           jnp.zeros((n_steps,), loss_type.dtype))
  done, length = 0, n_steps if between is None else 1
  while done < n_steps:
    stop = min(done + length, n_steps)
    start_time = time.monotonic()
    carry = run(*carry, w_stacks, jnp.int32(done), jnp.int32(stop))
    done = stop
    if between is not None and done < n_steps:
      jax.block_until_ready(carry)
      length = max(int(between(done, time.monotonic() - start_time)), 1)
  return carry[0], carry[2]
