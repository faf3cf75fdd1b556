"""A decoder LM's decomposition sites: which it has, their specs and order,
the span they make, their CI inputs and locality units, and which taps
masking them can move.

Sites are any subset of `layers.{i}.self_attn.{q,k,v,o}_proj` and
`layers.{i}.mlp.{gate,up,down}_proj` (SPEC §9.2; no `gate` in a plain MLP,
design §9.4; in a mixture-of-experts model each expert's
`layers.{i}.mlp.experts.{e}.{gate,up,down}_proj` instead, §9.5), plus the
token embedding `embed_tokens` and the unembedding `lm_head`, each a kind
of its own run outside the scan; a projection's bias stays frozen, outside
its factors (I52). The decomposed span is `[split, tail)`, the first and
one past the last decomposed layer.
"""

from collections.abc import Callable
from typing import Union


from decompax.core import ci_transformer, target
from decompax.core.sites import EMBEDDING, SiteSpec, validate_sites
from decompax.targets import glu_config, glu_weights


CPerSite = Union[int, dict[str, int]]


def role_dims(config: glu_config.GluConfig, role: str) -> tuple[int, int]:
  """Return `(d_in, d_out)` of a role (SPEC §9.2)."""
  d, f = config.d_model, config.d_ff
  return {"q": (d, config.q_width), "k": (d, config.kv_width),
          "v": (d, config.kv_width), "o": (config.q_width, d),
          "gate": (d, f), "up": (d, f), "down": (f, d),
          "expert_gate": (d, f), "expert_up": (d, f),
          "expert_down": (f, d)}[role]


def all_site_names(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return every decomposable projection in canonical order: the sites a
  run without `--sites` decomposes."""
  names = []
  for i in range(config.n_layers):
    names += [glu_weights.site_name(i,
                                    r) for r in glu_weights.model_roles(config)
              if r not in glu_weights.EXPERT_ROLES]
    # A mixture of experts: expert by expert, gate, up, down each.
    names += [glu_weights.site_name(i, r, e) for e in range(config.n_experts)
              for r in glu_weights.EXPERT_ROLES]
  return tuple(names)


def selectable_site_names(config: glu_config.GluConfig) -> tuple[str, ...]:
  """Return every site `--sites` may name, in canonical order: the token
  embedding, the projections, the unembedding (design §9.2)."""
  return ((glu_weights.EMBED_SITE,) + all_site_names(config)
          + (glu_weights.HEAD_SITE,))


def is_end_site(name: str) -> bool:
  """Return whether a site is the token embedding or the unembedding."""
  return name in glu_weights.END_SITES


def _end_spec(config: glu_config.GluConfig, name: str, c: int) -> SiteSpec:
  """Return the embedding's or the head's spec: a kind of its own, one row,
  draws keyed past the projections' roles."""
  v, d = config.vocab_size, config.d_model
  if name == glu_weights.EMBED_SITE:
    return SiteSpec(name, name, 0, v, d, c, (len(glu_weights.ROLES), 0),
                    EMBEDDING)
  return SiteSpec(name, name, 0, d, v, c, (len(glu_weights.ROLES) + 1, 0))


def _order_key(config: glu_config.GluConfig, parsed: tuple) -> tuple:
  if parsed[1] == glu_weights.EMBED_SITE:
    return (-1, 0)
  if parsed[1] == glu_weights.HEAD_SITE:
    return (config.n_layers, 0)
  if parsed[1] in glu_weights.EXPERT_ROLES:
    return (parsed[0], len(glu_weights.ROLES) + 3 * parsed[2]
            + glu_weights.EXPERT_ROLES.index(parsed[1]))
  return (parsed[0], glu_weights.ROLES.index(parsed[1]))


def _draw_path(config: glu_config.GluConfig, parsed: tuple
               ) -> tuple[int, int]:
  """Return a projection's draw path: (role, absolute layer), an expert's
  (a role past the end sites', layer·n_experts + expert)."""
  if parsed[1] in glu_weights.EXPERT_ROLES:
    return (len(glu_weights.ROLES) + 2
            + glu_weights.EXPERT_ROLES.index(parsed[1]),
            parsed[0] * config.n_experts + parsed[2])
  return (glu_weights.ROLES.index(parsed[1]), parsed[0])


def site_specs(
  config: glu_config.GluConfig, names: tuple[str, ...], c: CPerSite
) -> tuple[SiteSpec, ...]:
  """Return the named sites in canonical order (the embedding, then layer
  by layer q…down, then the head)."""
  parsed = {}
  roles = glu_weights.model_roles(config)
  for name in names:
    if is_end_site(name):
      parsed[name] = (None, name)
      continue
    p = glu_weights.parse_site(name)
    expert = glu_weights.site_expert(name)
    if (p is None or p[2] or p[0] >= config.n_layers
        or p[1] not in roles or (expert or 0) >= max(config.n_experts, 1)):
      mlp = ",".join(r for r in roles if r in ("gate", "up", "down"))
      mlp_sites = (f" and layers.<i>.mlp.{{{mlp}}}_proj" if mlp else
                   " and layers.<i>.mlp.experts.<e>.{gate,up,down}_proj "
                   f"for e < {config.n_experts}")
      raise ValueError(f"unknown site {name!r}; sites are layers.<i>.self_attn"
                       f".{{q,k,v,o}}_proj{mlp_sites} for i < "
                       f"{config.n_layers}, {glu_weights.EMBED_SITE} and "
                       f"{glu_weights.HEAD_SITE}")
    parsed[name] = (p[0], p[1], expert)
  if not parsed:
    raise ValueError("no sites to decompose")
  order = sorted(parsed, key=lambda n: _order_key(config, parsed[n]))
  cs = {n: c for n in order} if isinstance(c, int) else dict(c)
  missing = [n for n in order if n not in cs]
  extra = sorted(set(cs) - set(order))
  if missing or extra:
    raise ValueError(f"C per site must name exactly the sites; missing "
                     f"{missing}, unknown {extra}")
  by_role: dict[str, list[str]] = {}
  for n in order:
    if not is_end_site(n):
      by_role.setdefault(parsed[n][1], []).append(n)
  specs = {n: _end_spec(config, n, cs[n]) for n in order if is_end_site(n)}
  rows = {}
  for role, members in by_role.items():
    mixed = len({cs[n] for n in members}) > 1
    d_in, d_out = role_dims(config, role)
    for n in members:
      kind = f"{role}_proj.c{cs[n]}" if mixed else f"{role}_proj"
      rows[kind] = rows.get(kind, -1) + 1
      # Keyed by (kind, absolute layer): draws independent of the span.
      specs[n] = SiteSpec(n, kind, rows[kind], d_in, d_out, cs[n],
                          _draw_path(config, parsed[n]))
  out = tuple(specs[n] for n in order)
  validate_sites(out)
  return out


def span_segments(
  config: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
) -> glu_weights.Segments:
  """Return the three-stack bounds around the decomposed layers.

  A decomposed embedding starts the span at layer 0 (no prefix: the
  residual stream is live from the start); the head adds no layer, and
  without a decomposed layer the span is empty where the layers would end
  (`[n, n)`, all frozen layers a prefix the head's forwards share)."""
  layers = [glu_weights.parse_site(s.name)[0] for s in sites
            if not is_end_site(s.name)]
  embed = any(s.name == glu_weights.EMBED_SITE for s in sites)
  if not layers:
    first = 0 if embed else config.n_layers
    return glu_weights.Segments(config.n_layers, first, first)
  return glu_weights.Segments(config.n_layers, 0 if embed else min(layers),
                              max(layers) + 1)


def _block_tap(config: glu_config.GluConfig) -> Callable[[SiteSpec], str]:
  def tap(site: SiteSpec) -> str:
    if site.name == glu_weights.HEAD_SITE:
      return f"resid.{config.n_layers}"
    if site.name == glu_weights.EMBED_SITE:
      raise ValueError(
        f"the transformer CI function reads residual taps and has no input "
        f"for the embedding sites ['{site.name}']; use an MLP CI function "
        f"(--ci_fn=component_mlp, vector_mlp, site_mlp or global_mlp)")
    parsed = glu_weights.parse_site(site.name)
    if parsed is None or parsed[2]:
      raise ValueError(f"site {site.name!r} is not layers.<i>.<module> or "
                       f"{glu_weights.HEAD_SITE}; the transformer CI chunks "
                       "language-model sites by block")
    return f"resid.{parsed[0]}"

  return tap


def ci_chunks(
  config: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
) -> tuple[tuple[ci_transformer.Chunk, ...], tuple[tuple[str, int], ...]]:
  """Return the transformer CI's chunks over LM sites, one per decomposed
  block reading that block's residual `resid.<i>` (SPEC §4.3), and the
  width of each chunk's tap; the head's chunk reads the last residual
  `resid.<n_layers>` (before the final norm)."""
  chunks = ci_transformer.chunks_by_tap(tuple(sites), _block_tap(config))
  return chunks, tuple((c.input_taps[0], config.d_model) for c in chunks)


def nonlinear_units(
  config: glu_config.GluConfig, sites: tuple[SiteSpec, ...]
) -> dict[str, target.UnitSpec]:
  """Return the locality units (SPEC §5.10): gate/up neurons, q heads, k/v
  kv heads counted `n_heads/n_kv_heads` times; o and down have none."""
  out = {}
  for s in sites:
    if is_end_site(s.name):
      continue
    role = glu_weights.parse_site(s.name)[1]
    if role in ("gate", "up", "expert_gate", "expert_up"):
      out[s.name] = target.UnitSpec("neuron", config.d_ff)
    elif role == "q":
      out[s.name] = target.UnitSpec("attention_head", config.n_heads)
    elif role in ("k", "v"):
      out[s.name] = target.UnitSpec(
        "attention_head", config.n_kv_heads,
        config.n_heads / config.n_kv_heads)
  return out


# Within one block, the roles whose masking moves each tap (`parse_tap`'s
# stream): q, k and v read the block's normed input, the pattern reads q and
# k, o reads the attention output, the MLP the attention-updated stream.
_ATTENTION_ROLES = frozenset("qkvo")
_MOVED_BY: dict[str, frozenset] = {
  "q": frozenset(), "k": frozenset(), "v": frozenset(),
  "q.out": frozenset("q"), "k.out": frozenset("k"), "v.out": frozenset("v"),
  "attn": frozenset("qk"), "o": frozenset("qkv"), "o.out": _ATTENTION_ROLES,
  "gate": _ATTENTION_ROLES, "up": _ATTENTION_ROLES,
  "gate.out": _ATTENTION_ROLES | {"gate"}, "up.out": _ATTENTION_ROLES | {"up"},
  "down": _ATTENTION_ROLES | {"gate", "up"},
  "down.out": _ATTENTION_ROLES | {"gate", "up", "down"},
  # A mixture-of-experts block's input, router and output (its experts are
  # not sites).
  "moe": _ATTENTION_ROLES, "router": _ATTENTION_ROLES,
  "router.out": _ATTENTION_ROLES,
  "moe.out": _ATTENTION_ROLES | set(glu_weights.EXPERT_ROLES),
  # An expert's streams (`<stream>@<e>`), moved by the expert roles of its
  # block, whichever expert they belong to (a superset).
  "expert_gate.out": _ATTENTION_ROLES | {"expert_gate"},
  "expert_up.out": _ATTENTION_ROLES | {"expert_up"},
  "expert_down": _ATTENTION_ROLES | {"expert_gate", "expert_up"},
  "expert_down.out": _ATTENTION_ROLES | set(glu_weights.EXPERT_ROLES),
}
_MLP_STREAMS = ("gate", "up", "gate.out", "up.out", "down", "down.out",
                *glu_weights.MOE_STREAMS, "expert_gate.out", "expert_up.out",
                "expert_down", "expert_down.out")


def moved_by(config: glu_config.GluConfig) -> dict[str, frozenset]:
  """Return, per tap stream, the roles of its own block that move it: a
  parallel block's MLP reads the block input, which its attention does not
  touch."""
  if not config.parallel_residual:
    return _MOVED_BY
  return {s: (r - _ATTENTION_ROLES if s in _MLP_STREAMS else r)
          for s, r in _MOVED_BY.items()}


def masking_reaches(config: glu_config.GluConfig,
                    sites: tuple[SiteSpec, ...]):
  """Return `tap -> bool`: whether masking `sites` can move that tap (a
  later layer's anything; in the site's own layer, what reads it). The
  embedding lies below layer 0 and reaches every tap, the head none. Unknown
  taps raise `parse_tap`'s ValueError."""
  placed = [(-1, glu_weights.EMBED_SITE) if s.name == glu_weights.EMBED_SITE
            else glu_weights.parse_site(s.name)[:2] for s in sites
            if s.name != glu_weights.HEAD_SITE]
  moving = moved_by(config)
  ends = {glu_weights.EMBED_SITE: False,  # the token ids
          f"{glu_weights.EMBED_SITE}.out": any(l < 0 for l, _ in placed),
          glu_weights.HEAD_SITE: bool(placed),
          f"{glu_weights.HEAD_SITE}.out": bool(sites)}

  def reaches(tap: str) -> bool:
    if tap in ends:
      return ends[tap]
    stream, layer = glu_weights.parse_tap(tap, config.n_layers)
    if stream == "resid":
      return any(l < layer for l, _ in placed)
    moved = moving[stream.partition("@")[0]]
    return any(l < layer or (l == layer and role in moved)
               for l, role in placed)

  return reaches


def hidden_pass_points(config: glu_config.GluConfig,
                       sites: tuple[SiteSpec, ...]) -> tuple[str, ...]:
  """Return the MLP outputs from the first decomposed layer to the last:
  what a hidden pass reconstructs by default (from layer 0 with a
  decomposed embedding; none with the head alone). A mixture-of-experts
  MLP's output is its block's `layers.<i>.mlp.out`."""
  first = min((0 if s.name == glu_weights.EMBED_SITE else config.n_layers
               if s.name == glu_weights.HEAD_SITE
               else glu_weights.parse_site(s.name)[0]) for s in sites)
  return tuple(f"layers.{i}.mlp.out" if config.moe
               else f"{glu_weights.site_name(i, 'down')}.out"
               for i in range(first, config.n_layers))
