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
    chunked KL (`glu_divergence.chunked_head_kl`), on the positions padded to
    whole chunks: the clean and the masked logits forward and again in
    the backward, and the backward's product, five products a forward; an
    ascent's forward value is never read, so XLA keeps only its backward's
    three. The clean forward stops before the head. The count follows
    three or more chunks: over fewer, XLA may unroll the loop and share a
    chunk's clean logits between forwards.
  * a mixture-of-experts block runs every expert at every position, the
    unrouted ones weighted by 0 (design §9.5), so its FLOPs are all its
    experts', not the routed `experts_per_token`: a routed forward would
    run `n_experts / experts_per_token` times fewer expert products. Its
    router, the routing weights' one-hot product and the weighted sum of
    the experts' outputs are contractions too; a decomposed expert role
    runs all its experts' factors (zero for experts without a site) and,
    where XLA does not resolve the select between them, their frozen
    products.
`StepFlops.model` leaves rematerialisation out (the MFU numerator);
`StepFlops.executed` is what the program runs.
"""

import math
from typing import NamedTuple

from decompax.core.sites import SiteSpec
from decompax.recipe import terms as terms_lib
from decompax.recipe.config import TrainConfig
from decompax.targets import glu_config, glu_sites, glu_weights

# Matrices each role's input depends on within its block.
UPSTREAM = {"q": (), "k": (), "v": (), "o": ("q", "k", "v"),
            "gate": ("q", "k", "v", "o"), "up": ("q", "k", "v", "o"),
            "down": ("q", "k", "v", "o", "gate", "up"),
            "expert_gate": ("q", "k", "v", "o"),
            "expert_up": ("q", "k", "v", "o"),
            "expert_down": ("q", "k", "v", "o", "expert_gate", "expert_up")}
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
  """Return the sites' one layer and each decomposed role's C (an expert
  role's: one C for all its experts' sites, which run as one kind)."""
  parsed = [glu_weights.parse_site(s.name) for s in sites]
  layers = {p[0] for p in parsed if p is not None}
  if None in parsed or len(layers) != 1:
    raise ValueError("the analytic FLOP count covers matrices of one layer; "
                     f"got sites {[s.name for s in sites]}")
  c_of: dict[str, int] = {}
  for p, s in zip(parsed, sites):
    if c_of.setdefault(p[1], s.c) != s.c:
      raise ValueError(f"the analytic FLOP count takes one C per expert "
                       f"role; {p[1]} has {c_of[p[1]]} and {s.c}")
  return layers.pop(), c_of


def _partial(model: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
             ) -> frozenset[str]:
  """Return the expert roles whose sites leave some expert out."""
  experts: dict[str, set] = {}
  for s in sites:
    role = glu_weights.parse_site(s.name)[1]
    if role in glu_weights.EXPERT_ROLES:
      experts.setdefault(role, set()).add(glu_weights.site_expert(s.name))
  return frozenset(r for r, es in experts.items()
                   if len(es) < model.n_experts)


def _times(model: glu_config.GluConfig, role: str) -> int:
  """Return how many matrices of `role` a block runs at every position:
  an expert role's every expert (the forward weights the unrouted ones by
  0 rather than skipping them, design §9.5), else one."""
  return model.n_experts if role in glu_weights.EXPERT_ROLES else 1


def _matrix(model: glu_config.GluConfig, role: str) -> float:
  """Return a role's frozen forward FLOPs per token, all its experts'."""
  return 2.0 * _times(model, role) * math.prod(
    glu_sites.role_dims(model, role))


def _routing(model: glu_config.GluConfig) -> tuple[float, float]:
  """Return a mixture of experts' per-token contractions besides its
  experts: the router's logits and the top-k weights placed among the
  experts (`glu_block.routing_weights`' one-hot product), then the weighted
  sum of the experts' outputs; (0, 0) for a dense MLP."""
  if not model.moe:
    return 0.0, 0.0
  e, d = model.n_experts, model.d_model
  return 2.0 * d * e + 2.0 * model.experts_per_token * e, 2.0 * e * d


def _attention(model: glu_config.GluConfig, t: int) -> float:
  """Return one block's attention FLOPs per token (scores, then values)."""
  return 4.0 * t * model.q_width


def _frozen_block(model: glu_config.GluConfig, t: int) -> float:
  """Return one frozen block's forward FLOPs per token."""
  return (sum(_matrix(model, r) for r in glu_weights.model_roles(model))
          + _attention(model, t) + sum(_routing(model)))


def _last_product(model: glu_config.GluConfig) -> float:
  """Return the per-token FLOPs of a frozen block's last product, whose
  output no backward reads: `down`, or a mixture of experts' weighted
  sum (the experts' outputs are read, by the weights' gradient)."""
  return _routing(model)[1] if model.moe else _matrix(model, "down")


def _span(model: glu_config.GluConfig, c_of: dict[str, int], t: int,
          partial: frozenset[str] = frozenset()) -> _Span:
  """Return the decomposed layer's per-token FLOPs in a masked forward.

  A live expert role runs every expert decomposed (factors of experts
  without a site are zero), and its frozen products beside
  (`glu_kinds._expert_site` keeps the decomposed output where the site
  is): the rematerialised forward and the input gradient run them, the
  forward only for the `partial` roles (some expert without a site),
  since for the others XLA resolves the select to the decomposed side."""
  roles = glu_weights.model_roles(model)
  dims = {r: glu_sites.role_dims(model, r) for r in roles}
  n = {r: _times(model, r) for r in roles}
  live_input = {r: any(u in c_of for u in UPSTREAM[r]) for r in roles}
  attention = _attention(model, t)
  # Live scores (q or k decomposed) run both products, the pattern's
  # gradient and those of the live ones of q, k, v; live values alone only
  # `P·v` and its gradient (the pattern is the clean pass's). Each is half
  # of `attention`.
  gradients = sum(r in c_of for r in ("q", "k", "v"))
  if {"q", "k"} & set(c_of):
    live_attention = attention
    attention_backward = (1 + gradients) * attention / 2
  else:
    live_attention = attention_backward = gradients * attention / 2
  route, weighted = _routing(model)
  # The router reads the attention-updated stream.
  live_route = route if {"q", "k", "v", "o"} & set(c_of) else 0.0

  def frozen_too(r: str) -> float:
    d_in, d_out = dims[r]
    expert = r in c_of and r in glu_weights.EXPERT_ROLES
    return 2.0 * n[r] * d_in * d_out if expert else 0.0

  def forward(r: str) -> float:
    d_in, d_out = dims[r]
    if r not in c_of:
      return 2.0 * n[r] * d_in * d_out
    return 2.0 * n[r] * c_of[r] * (d_in + d_out) + (
      frozen_too(r) if r in partial and live_input[r] else 0.0)

  def backward(r: str, factors: bool) -> float:
    d_in, d_out = dims[r]
    input_grad = (2.0 * n[r] * d_in * c_of.get(r, d_out) + frozen_too(r)
                  if live_input[r] else 0.0)
    if r not in c_of:
      return input_grad
    # The masked `x·V`'s cotangent, then V's and U's gradients.
    own = 2.0 * n[r] * c_of[r] * d_out
    return own + input_grad + (2.0 * n[r] * c_of[r] * (d_in + d_out)
                               if factors else 0.0)

  shared_xv = sum(2.0 * n[r] * c_of[r] * dims[r][0] for r in c_of
                  if not live_input[r])
  return _Span(
    forward=sum(forward(r) for r in roles if r in c_of or live_input[r])
    + live_attention + live_route + weighted - shared_xv,
    recompute=sum(forward(r) for r in roles)
    + sum(frozen_too(r) for r in roles if r not in partial
          or not live_input[r]) + attention
    + route + weighted - _unread(model, c_of, dims, bool(live_route)),
    backward=sum(backward(r, True) for r in roles) + attention_backward
    + (live_route + weighted if live_route else 0.0),
    ascent_backward=sum(backward(r, False) for r in roles)
    + attention_backward + (live_route + weighted if live_route else 0.0),
    shared_xv=shared_xv)


def _unread(model: glu_config.GluConfig, c_of: dict[str, int],
            dims: dict[str, tuple[int, int]], live_route: bool) -> float:
  """Return the per-token FLOPs of the decomposed layer's products whose
  outputs its backward never reads, which its rematerialised forward
  skips: `down`'s (its `x·V` is read, by U's gradient); of a mixture of
  experts the weighted sum and, unless the routing weights are live (their
  gradient reads the experts' outputs), every expert's `down`."""
  if not model.moe:
    return 2.0 * dims["down"][1] * c_of.get("down", dims["down"][0])
  weighted = _routing(model)[1]
  if live_route:
    return weighted
  d_ff, d = dims["expert_down"]
  c = c_of.get("expert_down")
  down = 2.0 * model.n_experts * d * (d_ff if c is None else c + d_ff)
  return weighted + down


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
  down = _last_product(model)
  span = _span(model, c_of, t, _partial(model, sites))
  pgd = config.pgd_coeff > 0
  full = (config.n_mask_samples if config.stochastic_coeff > 0 else 0) + pgd
  ascents = config.pgd_n_warmup if pgd else 0
  passes = full + ascents
  ci_work, ci_remat = _ci(config, model.d_model, sum(s.c for s in sites), t)
  # Input gradients only: each matrix's costs its forward, and attention's
  # four gradient matmuls twice its two.
  tail_backward = n_tail * (block + attention)
  # Each site's `V·U`, every expert's its own.
  faithfulness = (sum(2.0 * s.c * s.d_in * s.d_out for s in sites)
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
