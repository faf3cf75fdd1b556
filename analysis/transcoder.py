"""A per-layer transcoder: a trained sparse dictionary from an MLP's input
to its output, the strongest baseline a decomposition's components are
judged against (`docs/transcoder.md`).

One transcoder per layer reads the MLP's input `x` (the normed residual
its projections read, tap `layers.<i>.mlp.up_proj`) and predicts its
output `y` (tap `layers.<i>.mlp.down_proj.out`, bias included):
- encode: `z = TopK_k(ReLU(x·W_enc + b_enc))`, the `k` largest
  pre-activations kept (their positive parts), every other latent 0, so
  at most `k` latents fire at a position;
- decode: `ŷ = z·W_dec + b_dec`;
- loss: `Σ_d (ŷ − y)²` averaged over positions, plus `l1_coeff ·
  Σ_i |z_i|·‖W_dec[i]‖` (the L1 variant; its decoder norms keep the
  penalty from shrinking `z` by growing `W_dec`).

Transcoders of several layers are a `dict[layer, Transcoder]`; their `k`
a `dict[layer, int]`, static (`lax.top_k` needs it). Arrays are fp32.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, Key


class Transcoder(NamedTuple):
  """One layer's sparse dictionary from the MLP's input to its output."""

  w_enc: Float[Array, "d_in n"]
  b_enc: Float[Array, " n"]
  w_dec: Float[Array, "n d_out"]
  b_dec: Float[Array, " d_out"]


def init(key: Key[Array, ""], d_in: int, n_latents: int, d_out: int
         ) -> Transcoder:
  """Return a transcoder of random directions: decoder rows of unit norm,
  encoder columns `N(0, 1/d_in)`, zero biases."""
  k_enc, k_dec = jax.random.split(key)
  w_dec = jax.random.normal(k_dec, (n_latents, d_out), jnp.float32)
  w_dec = w_dec / jnp.linalg.norm(w_dec, axis=1, keepdims=True)
  w_enc = jax.random.normal(k_enc, (d_in, n_latents), jnp.float32)
  return Transcoder(w_enc / np.sqrt(d_in), jnp.zeros(n_latents),
                    w_dec, jnp.zeros(d_out))


def data_encoder(params: Transcoder, key: Key[Array, ""],
                 x: Float[Array, "p d_in"]) -> Transcoder:
  """Return `params` with each encoder column a distinct input drawn from
  `x` (repeats only where `x` has fewer rows than latents), scaled to unit
  norm: every latent then leads at some input, so TopK selects each from
  the first step (random columns leave some never selected, never
  trained)."""
  n = params.w_enc.shape[1]
  rows = jax.random.choice(key, x.shape[0], (n,), replace=n > x.shape[0])
  w = x[rows].astype(jnp.float32).T
  norms = jnp.linalg.norm(w, axis=0, keepdims=True)
  return params._replace(w_enc=w / jnp.where(norms > 0, norms, 1.0))


def scaled_to(params: Transcoder, x: Float[Array, "p d_in"],
              y: Float[Array, "p d_out"], k: int) -> Transcoder:
  """Return `params` with the decoder's bias the mean of `y` and its rows
  scaled so that the prediction's spread about its mean matches `y`'s:
  an MLP's output may be far smaller (or larger) than unit-norm rows
  would predict, and Adam's steps would take long to rescale them."""
  y = y.astype(jnp.float32)
  mean = jnp.mean(y, axis=0)
  z = encode(params, x, k)
  spread = jnp.sum(jnp.var(z @ params.w_dec, axis=0))
  target = jnp.sum(jnp.var(y, axis=0))
  scale = jnp.where(spread > 0, jnp.sqrt(target / spread), 1.0)
  return params._replace(w_dec=params.w_dec * scale, b_dec=mean)


def top_k(pre: Float[Array, "*l n"], k: int) -> Float[Array, "*l n"]:
  """Return the positive parts of each row's `k` largest entries, every
  other entry 0 (exactly `k` entries kept, ties broken by index)."""
  n = pre.shape[-1]
  flat = pre.reshape(-1, n)
  values, index = jax.lax.top_k(flat, k)
  rows = jnp.arange(flat.shape[0])[:, None]
  # A scatter, not a one-hot sum: `[positions, k, n]` would not fit.
  kept = jnp.zeros_like(flat).at[rows, index].set(jax.nn.relu(values))
  return kept.reshape(pre.shape)


def encode(params: Transcoder, x: Float[Array, "*l d_in"], k: int
           ) -> Float[Array, "*l n"]:
  """Return the latents of inputs `x` (see the module docstring)."""
  pre = x.astype(jnp.float32) @ params.w_enc + params.b_enc
  return top_k(pre, k)


def decode(params: Transcoder, z: Float[Array, "*l n"]
           ) -> Float[Array, "*l d_out"]:
  """Return the predicted MLP output of latents `z`."""
  return z @ params.w_dec + params.b_dec


def apply(params: Transcoder, x: Float[Array, "*l d_in"], k: int
          ) -> Float[Array, "*l d_out"]:
  """Return the transcoder's prediction of the MLP output at `x`."""
  return decode(params, encode(params, x, k))


def loss(params: Transcoder, x: Float[Array, "p d_in"],
         y: Float[Array, "p d_out"], k: int, l1_coeff: float = 0.0
         ) -> Float[Array, ""]:
  """Return the position-mean squared error of the prediction plus the
  decoder-norm-weighted L1 penalty of the latents."""
  z = encode(params, x, k)
  error = jnp.mean(jnp.sum((decode(params, z) - y) ** 2, axis=-1))
  norms = jnp.linalg.norm(params.w_dec, axis=1)
  penalty = jnp.mean(jnp.sum(jnp.abs(z) * norms, axis=-1))
  return error + l1_coeff * penalty


def layer_losses(params: dict[int, Transcoder],
                 pairs: dict[int, tuple[Array, Array]],
                 ks: dict[int, int], l1_coeff: float
                 ) -> dict[int, Float[Array, ""]]:
  """Return every layer's `loss` on its `(x, y)` pairs, positions
  flattened."""
  flat = lambda a: a.reshape(-1, a.shape[-1]).astype(jnp.float32)  # noqa
  return {i: loss(params[i], flat(x), flat(y), ks[i], l1_coeff)
          for i, (x, y) in pairs.items()}


def make_update(optimizer: optax.GradientTransformation,
                ks: dict[int, int], l1_coeff: float = 0.0) -> Callable:
  """Return `update(params, opt_state, pairs) -> (params, opt_state,
  losses)`: one optimizer step on the sum of the layers' losses (each
  layer's gradient is its own loss's; they share no parameter)."""

  def update(params, opt_state, pairs):
    def total(p):
      losses = layer_losses(p, pairs, ks, l1_coeff)
      return sum(losses.values()), losses

    grads, losses = jax.grad(total, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, losses

  return update


class Fit(NamedTuple):
  """Running sums of a prediction's error over positions, from which its
  fraction of variance unexplained follows (`fvu`)."""

  sse: Float[Array, ""]  # Σ ‖ŷ − y‖²
  y_sum: Float[Array, " d_out"]
  y_sq: Float[Array, ""]  # Σ ‖y‖²
  positions: Int[Array, ""]


def fit_sums(prediction: Float[Array, "*l d_out"],
             target: Float[Array, "*l d_out"]) -> Fit:
  """Return one batch's `Fit` sums (fp32)."""
  y = target.reshape(-1, target.shape[-1]).astype(jnp.float32)
  p = prediction.reshape(-1, y.shape[-1]).astype(jnp.float32)
  return Fit(jnp.sum((p - y) ** 2), jnp.sum(y, axis=0), jnp.sum(y ** 2),
             jnp.asarray(y.shape[0], jnp.int32))


def fvu(fit: Any) -> float:
  """Return the squared error over the target's total variance about its
  mean (0: exact, 1: no better than the mean); NaN without variance."""
  n = float(fit.positions)
  y_sum = np.asarray(fit.y_sum, np.float64)
  variance = float(fit.y_sq) - float(y_sum @ y_sum) / max(n, 1.0)
  return float(fit.sse) / variance if variance > 0 else float("nan")


def latent_l0(z: Float[Array, "*l n"]) -> Float[Array, ""]:
  """Return the position-mean count of latents that fire (nonzero)."""
  return jnp.mean(jnp.sum(z > 0, axis=-1, dtype=jnp.float32))
