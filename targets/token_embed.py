"""Token-embedding toy: one embedding site read out linearly (SPEC §3.7, §10).

Inputs are token ids `t: [*b]`, uniform on `[0, vocab)`; the model is
`y = E[t] @ R` with the table `E: [vocab, d]` (site `embed`, an embedding
site: its components are gathered by token, never multiplied) and a frozen
readout `R: [d, d_out]` that is no site. Nothing is trained: every row of
`E` is a random unit vector and `R` a random matrix with orthonormal rows,
so `‖y‖ = ‖E[t]‖` and the output's MSE is the embedding's.

The known answer: a token's one-hot input reads one row, so the fewest
components active per input is one, and the decomposition that reaches it
gives each token its own component, `V[t, c]·U[c] = E[t]`, CI-active on
that token alone (the identity pattern over tokens, `feature_axis = 0`).
"""

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key

from decompax.core import rng, site_forward, sites, target
from decompax.targets import toy_sites
from decompax.targets import toy_training as train_lib

SITE = "embed"


@dataclasses.dataclass(frozen=True)
class TokenEmbedConfig:
  """Vocabulary, embedding width and readout width."""

  vocab: int = 16
  d_embed: int = 8
  d_out: int = 16

  def __post_init__(self):
    if self.d_out < self.d_embed:
      raise ValueError(f"the readout needs d_out >= d_embed to keep every "
                       f"embedding direction, got {self.d_out} < "
                       f"{self.d_embed}")


class TokenEmbedWeights(NamedTuple):
  """The embedding table and the frozen readout."""

  embed: Float[Array, "vocab d"]
  readout: Float[Array, "d d_out"]


def site_specs(
  config: TokenEmbedConfig, c: toy_sites.CPerSite
) -> tuple[sites.SiteSpec, ...]:
  """Return the one site `embed`, an embedding of `vocab` rows."""
  cs = toy_sites.c_per_site(c, (SITE,))
  specs = (sites.SiteSpec(SITE, SITE, 0, config.vocab, config.d_embed,
                          cs[SITE], op=sites.EMBEDDING),)
  sites.validate_sites(specs)
  return specs


def init(key: Key[Array, ""], config: TokenEmbedConfig) -> TokenEmbedWeights:
  """Return the drawn weights: unit rows of `E`, orthonormal rows of `R`."""
  e_key, r_key = jax.random.split(key)
  e = jax.random.normal(e_key, (config.vocab, config.d_embed), jnp.float32)
  e = e / jnp.linalg.norm(e, axis=-1, keepdims=True)
  r = jax.random.normal(r_key, (config.d_out, config.d_embed), jnp.float32)
  q, _ = jnp.linalg.qr(r)
  return TokenEmbedWeights(embed=e, readout=q.T)


def train(
  key: Key[Array, ""],
  config: TokenEmbedConfig,
  progress: Optional[train_lib.Progress] = None,
) -> TokenEmbedWeights:
  """Return the target for `key`: its weights are drawn, not trained (see
  the module docstring), so this is `init`."""
  del progress
  return init(key, config)


def _forward(
  weights: TokenEmbedWeights,
  tokens: Int[Array, "*b"],
  matmul: toy_sites.SiteMatmul,
) -> tuple[Float[Array, "*b d_out"], dict[str, Array]]:
  h = matmul(SITE, tokens, weights.embed)
  return h @ weights.readout, {SITE: tokens}


def forward(
  weights: TokenEmbedWeights, tokens: Int[Array, "*b"]
) -> Float[Array, "*b d_out"]:
  """Return the model's output; ValueError for an id outside the vocabulary."""
  site_forward.check_token_ids(tokens, weights.embed.shape[0], "tokens")
  return _forward(weights, jnp.asarray(tokens), toy_sites.frozen_matmul)[0]


def frozen_stacks(
  weights: TokenEmbedWeights,
) -> dict[str, Float[Array, "_layer _d_in _d_out"]]:
  """Return `{"embed": E[None]}`."""
  return {SITE: weights.embed[None]}


def target_fns(
  config: TokenEmbedConfig, c: toy_sites.CPerSite
) -> target.TargetFns:
  """Return the engine's function table; the probe feeds each token once."""
  return toy_sites.sequential_target_fns(
    site_specs(config, c), _forward, frozen_stacks, config.vocab,
    expected={SITE: target.Expected("identity", feature_axis=0)},
    token_inputs=True)


def sample_inputs(
  key: Key[Array, ""], config: TokenEmbedConfig, batch_size: int
) -> Int[Array, " b"]:
  """Return `batch_size` token ids uniform on `[0, vocab)`."""
  return rng.randint(key, (batch_size,), 0, config.vocab)


def missing_features(
  weights: TokenEmbedWeights, min_norm: float = 0.5
) -> tuple[int, ...]:
  """Return the tokens whose output has norm under `min_norm`, ascending
  (none for drawn weights: each output is a unit vector)."""
  vocab = weights.embed.shape[0]
  y = forward(weights, jnp.arange(vocab, dtype=jnp.int32))
  short = np.asarray(jnp.linalg.norm(y, axis=-1) < min_norm)
  return tuple(int(i) for i in np.flatnonzero(short))


def weights_to_arrays(weights: TokenEmbedWeights) -> dict[str, np.ndarray]:
  """Return host arrays keyed `embed`, `readout`."""
  return toy_sites.fields_to_arrays(weights)


def weights_from_arrays(
  arrays: dict[str, np.ndarray], config: TokenEmbedConfig
) -> TokenEmbedWeights:
  """Return weights from `weights_to_arrays` output; ValueError on mismatch."""
  fields = toy_sites.arrays_to_fields(arrays, {
    "embed": (config.vocab, config.d_embed),
    "readout": (config.d_embed, config.d_out)})
  return TokenEmbedWeights(**fields)
