"""The elementwise pieces of a decoder block: its norms (RMSNorm, LayerNorm
with bias, Gemma's offset RMSNorm and sandwich norms), soft-capping and
the MLP's activation, each chosen by the config's family options
(design §9.4). Statistics are taken in fp32 (N4).
"""

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from decompax.core import attention as attention_lib
from decompax.targets import glu_config


def rms_norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"], eps: float
) -> Float[Array, "*l d"]:
  """Return `x·rsqrt(mean(x²)+eps)·w`, the statistic in fp32 (N4)."""
  return w * attention_lib.rms_normalize(x, eps).astype(x.dtype)


def layer_norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"], b: Float[Array, " d"],
  eps: float,
) -> Float[Array, "*l d"]:
  """Return `(x − mean)·rsqrt(var + eps)·w + b` (biased variance), the
  statistics in fp32 (N4)."""
  xf = x.astype(jnp.float32)
  centered = xf - jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
  return w * (centered * jax.lax.rsqrt(var + eps)).astype(x.dtype) + b


def rms_offset_norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"], eps: float
) -> Float[Array, "*l d"]:
  """Return Gemma's `x·rsqrt(mean(x²)+eps)·(1 + w)`, the product taken in
  fp32 before the cast back (where Llama casts, then scales)."""
  scale = 1.0 + w.astype(jnp.float32)
  return (attention_lib.rms_normalize(x, eps) * scale).astype(x.dtype)


def norm(
  x: Float[Array, "*l d"], w: Float[Array, " d"],
  b: Optional[Float[Array, " d"]], config: glu_config.GluConfig,
) -> Float[Array, "*l d"]:
  """Return the model's norm of `x`: RMSNorm, LayerNorm with bias `b`, or
  Gemma's offset RMSNorm."""
  if config.norm == "layer":
    return layer_norm(x, w, b, config.rms_eps)
  if config.norm == "rms_offset":
    return rms_offset_norm(x, w, config.rms_eps)
  return rms_norm(x, w, config.rms_eps)


def softcap(x: Array, cap: Optional[float]) -> Array:
  """Return `cap·tanh(x/cap)` (Gemma's soft-capping), `x` for None."""
  return x if cap is None else jnp.tanh(x / cap) * cap


_ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def activation(config: glu_config.GluConfig) -> Callable[[Array], Array]:
  """Return the MLP's activation `act`: of the gate in `act(gate)·up`, of
  `up` in a plain MLP's `act(up)`."""
  return _ACTIVATIONS[config.activation]


def post_norm(
  y: Float[Array, "b t d"], w: Optional[Float[Array, " d"]],
  config: glu_config.GluConfig,
) -> Float[Array, "b t d"]:
  """Return a sublayer's output as the residual adds it: through its
  sandwich norm where the model has one."""
  return y if w is None else norm(y, w, None, config)
