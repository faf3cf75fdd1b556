"""Faithfulness warmup of fresh runs (SPEC §6.2).

`n_steps` AdamW steps on the faithfulness loss alone, all inside one jitted
`lax.scan`; the optimizer used here is discarded afterwards (I33).
"""

from collections.abc import Callable

import jax
import optax
from jaxtyping import Array, Float

from decompax.core.sites import Components

WarmupLoss = Callable[[Components, dict[str, Array]], Float[Array, ""]]


def faithfulness_warmup(
  loss_fn: WarmupLoss,
  components: Components,
  w_stacks: dict[str, Float[Array, "layer d_in d_out"]],
  n_steps: int,
  lr: float,
  weight_decay: float,
) -> tuple[Components, Float[Array, " n"]]:
  """Return the warmed components and the loss before each warmup step."""
  if n_steps <= 0:
    return components, jax.numpy.zeros((0,))
  tx = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)

  @jax.jit
  def run(components, w_stacks):
    def body(carry, _):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, w_stacks)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    (params, _), losses = jax.lax.scan(
      body, (components, tx.init(components)), length=n_steps
    )
    return params, losses

  return run(components, w_stacks)
