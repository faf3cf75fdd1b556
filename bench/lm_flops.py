"""Matmul FLOPs of a language-model train step, predicted from its
settings.

`lm_step_flops` counts what the step runs for a language-model run that
decomposes matrices of one layer with the reference LM recipe
(faithfulness, importance and frequency minimality, stochastic recon,
persistent PGD and its warmup ascents, the transformer CI), in the units of
`hlo_flops.compiled_matmul_flops` (contractions, 2 FLOPs per multiply-add;
attention scores as full `t × t` matrices whatever the causal mask), so
that the two counts check each other. It follows how the step runs (SPEC
§6.1) and what XLA keeps of it:
  * the clean forward runs every layer and the head once, without a
    backward;
  * each masked forward resumes at the decomposed layer (prefix sharing,
    SPEC §3.5) and runs it, the frozen tail and the head; its backward
    pulls cotangents back through them without weight gradients (the
    model is frozen), and for the adversary's ascents without V/U
    gradients either;
  * the decomposed layer and the tail are rematerialised: each backward
    recomputes their forward, less the last projection (`down`), whose
    output the backward never reads;
  * what a masked forward computes from the shared start alone (the frozen
    work upstream of the first decomposed matrix, and `x·V` of decomposed
    matrices reading it) is the same in every forward, so XLA's CSE keeps
    one copy (for the frozen part, the clean pass's);
  * the CI transformer runs forward and backward once, recomputing its
    blocks (less `w2`) under `--ci_remat`;
  * faithfulness forms `V·U` per site twice (forward, and again in its
    rematerialised backward) and both factor gradients;
  * with `--output_chunk` the head runs inside each masked forward's
    chunked KL (`glu_target.chunked_head_kl`), on the positions padded to
    whole chunks: the clean and the masked logits forward and again in
    the backward, and the backward's product, five products a forward; an
    ascent's forward value is never read, so XLA keeps only its backward's
    three. The clean forward stops before the head. The count follows
    three or more chunks: over fewer, XLA may unroll the loop and share a
    chunk's clean logits between forwards.
`StepFlops.model` leaves rematerialisation out (the MFU numerator);
`StepFlops.executed` is what the program runs.
"""

import math
from typing import NamedTuple

from decompax.core.sites import SiteSpec
from decompax.recipe import terms as terms_lib
from decompax.recipe.config import TrainConfig
from decompax.targets import glu_config, glu_lm, glu_target

# Matrices each role's input depends on within its block.
UPSTREAM = {"q": (), "k": (), "v": (), "o": ("q", "k", "v"),
            "gate": ("q", "k", "v", "o"), "up": ("q", "k", "v", "o"),
            "down": ("q", "k", "v", "o", "gate", "up")}
# Terms the count follows; any other term on is refused.
COVERED_TERMS = ("faithfulness", "importance_minimality",
                 "frequency_minimality", "stochastic_recon",
                 "persistent_pgd_recon")


class StepFlops(NamedTuple):
  """Matmul FLOPs of one step by part: `work` is the model's, `recompute`
  what rematerialisation runs a second time."""

  work: dict[str, float]
  recompute: dict[str, float]

  @property
  def model(self) -> float:
    return sum(self.work.values())

  @property
  def executed(self) -> float:
    return self.model + sum(self.recompute.values())


class _Span(NamedTuple):
  """Per-token FLOPs of the decomposed layer, by pass."""

  forward: float
  recompute: float
  backward: float
  ascent_backward: float
  shared_xv: float


def check_covered(config: TrainConfig) -> None:
  """Raise ValueError naming a setting `lm_step_flops` does not follow."""
  extra = [t.coeff_flag for t in terms_lib.TERMS
           if terms_lib.coeff_of(config, t) > 0 and t.name not in
           COVERED_TERMS]
  wrong = {"ci_fn": config.ci_fn != "transformer",
           "use_delta_component": config.use_delta_component,
           "stochastic_routing": config.stochastic_routing != "all",
           "pgd_plan": config.pgd_plan != "all_sites",
           "pgd_routing": config.pgd_routing != "all",
           "hidden_coeff": config.hidden_coeff > 0,
           "components_optimizer": config.components_optimizer != "adamw"}
  refused = extra + [name for name, bad in wrong.items() if bad]
  if refused:
    raise ValueError(f"the analytic FLOP count follows the reference LM "
                     f"recipe; it does not cover --{', --'.join(refused)}")


def _roles(sites: tuple[SiteSpec, ...]) -> tuple[int, dict[str, int]]:
  """Return the sites' one layer and each decomposed role's C."""
  parsed = [glu_lm.parse_site(s.name) for s in sites]
  layers = {p[0] for p in parsed if p is not None}
  if None in parsed or len(layers) != 1:
    raise ValueError("the analytic FLOP count covers matrices of one layer; "
                     f"got sites {[s.name for s in sites]}")
  return layers.pop(), {p[1]: s.c for p, s in zip(parsed, sites)}


def _attention(model: glu_config.GluConfig, t: int) -> float:
  """Return one block's attention FLOPs per token (scores, then values)."""
  return 4.0 * t * model.q_width


def _frozen_block(model: glu_config.GluConfig, t: int) -> float:
  """Return one frozen block's forward FLOPs per token."""
  return sum(2.0 * math.prod(glu_target.role_dims(model, r))
             for r in glu_lm.ROLES) + _attention(model, t)


def _span(model: glu_config.GluConfig, c_of: dict[str, int], t: int
          ) -> _Span:
  """Return the decomposed layer's per-token FLOPs in a masked forward."""
  dims = {r: glu_target.role_dims(model, r) for r in glu_lm.ROLES}
  live_input = {r: any(u in c_of for u in UPSTREAM[r]) for r in glu_lm.ROLES}
  attention = _attention(model, t)
  live_attention = attention if {"q", "k", "v"} & set(c_of) else 0.0

  def forward(r: str) -> float:
    d_in, d_out = dims[r]
    return 2.0 * c_of[r] * (d_in + d_out) if r in c_of else 2.0 * d_in * d_out

  def backward(r: str, factors: bool) -> float:
    d_in, d_out = dims[r]
    input_grad = (2.0 * d_in * c_of.get(r, d_out)) if live_input[r] else 0.0
    if r not in c_of:
      return input_grad
    # The masked `x·V`'s cotangent, then V's and U's gradients.
    own = 2.0 * c_of[r] * d_out
    return own + input_grad + (2.0 * c_of[r] * (d_in + d_out) if factors
                               else 0.0)

  shared_xv = sum(2.0 * c_of[r] * dims[r][0] for r in c_of
                  if not live_input[r])
  # The backward never reads the block's last product, `down`'s output.
  last = 2.0 * dims["down"][1] * c_of.get("down", dims["down"][0])
  return _Span(
    forward=sum(forward(r) for r in glu_lm.ROLES
                if r in c_of or live_input[r]) + live_attention - shared_xv,
    recompute=sum(forward(r) for r in glu_lm.ROLES) + attention - last,
    backward=sum(backward(r, True) for r in glu_lm.ROLES)
    + 2 * live_attention,
    ascent_backward=sum(backward(r, False) for r in glu_lm.ROLES)
    + 2 * live_attention,
    shared_xv=shared_xv)


def _ci(config: TrainConfig, d_in: int, c_sum: int, t: int
        ) -> tuple[float, float]:
  """Return the transformer CI's per-token forward plus backward FLOPs,
  and what `--ci_remat` recomputes."""
  d, m = config.ci_d_model, config.ci_d_mlp
  head_dim = d // config.ci_n_heads
  kv = (config.ci_n_kv_heads or config.ci_n_heads) * head_dim
  block = 2.0 * d * (2 * d + 2 * kv) + 4.0 * d * m + 4.0 * t * d
  w_in, w_out = 2.0 * d_in * d, 2.0 * d * c_sum
  # The taps are constants: `w_in` has no input gradient.
  work = (w_in + config.ci_n_blocks * block + w_out) + (
    w_in + config.ci_n_blocks * 2 * block + 2 * w_out)
  # Each block is recomputed but for its last product, `w2`'s output.
  remat = config.ci_n_blocks * (block - 2.0 * m * d)
  return work, remat if config.ci_remat else 0.0


def lm_step_flops(config: TrainConfig, model: glu_config.GluConfig,
                  sites: tuple[SiteSpec, ...]) -> StepFlops:
  """Return the matmul FLOPs of one step decomposing `sites` (one layer's
  matrices) of `model` with `config`'s recipe (see the module docstring).

  Raises:
    ValueError: a setting or a site outside what the count follows.
  """
  check_covered(config)
  layer, c_of = _roles(sites)
  t = config.seq_len
  tokens = config.batch_size * t
  n_tail = model.n_layers - layer - 1
  head = 2.0 * model.d_model * model.vocab_size
  block, attention = _frozen_block(model, t), _attention(model, t)
  down = 2.0 * math.prod(glu_target.role_dims(model, "down"))
  span = _span(model, c_of, t)
  pgd = config.pgd_coeff > 0
  full = (config.n_mask_samples if config.stochastic_coeff > 0 else 0) + pgd
  ascents = config.pgd_n_warmup if pgd else 0
  passes = full + ascents
  ci_work, ci_remat = _ci(config, model.d_model, sum(c_of.values()), t)
  # Input gradients only: each matrix's costs its forward, and attention's
  # four gradient matmuls twice its two.
  tail_backward = n_tail * (block + attention)
  faithfulness = (sum(2.0 * c * math.prod(glu_target.role_dims(model, r))
                      for r, c in c_of.items())
                  if config.faithfulness_coeff > 0 else 0.0)
  # Without a recon term nothing reads the clean output: the compiler
  # keeps only the layers below the CI's tap.
  clean = model.n_layers * block + head if passes else layer * block
  work = {
    "clean forward": tokens * clean,
    "CI forward and backward": tokens * ci_work,
    "masked forwards": tokens * (
      passes * (span.forward + n_tail * block + head)
      + (span.shared_xv if passes else 0.0)),
    "masked backwards": tokens * (
      passes * (head + tail_backward) + full * span.backward
      + ascents * span.ascent_backward),
    "faithfulness": 3 * faithfulness,
  }
  recompute = {
    "masked forwards": tokens * passes * (
      span.recompute + n_tail * (block - down)),
    "CI blocks": tokens * ci_remat,
    "faithfulness": faithfulness,
  }
  if config.output_chunk and passes:
    recompute["output head (chunked)"] = head * (
      _padded(tokens, config.output_chunk) * (5 * full + 3 * ascents)
      - tokens * (1 + 2 * passes))
  return StepFlops(work, recompute)


def _padded(tokens: int, chunk: int) -> int:
  """Return `tokens` rounded up to whole chunks of `chunk` positions."""
  return -(-tokens // chunk) * chunk
