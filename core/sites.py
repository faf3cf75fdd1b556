"""Decomposition sites and their rank-1 component factors (SPEC §1, §2, §6.1).

Math is right-multiplication, `y = x @ W` with `W: [d_in, d_out]`. An
embedding site (`op == "embedding"`, SPEC §3.7) is the same map read off
one-hot tokens: `W` is the table `E: [vocab, d]`, its input token ids, and
its component activations are rows `V[t]`, gathered. A *kind* is
a group of same-shaped sites (one matrix role across layers); its factors are
stacked on a leading `layer` axis whose row `r` belongs to the kind's site
with `row == r`. Canonical site order is the order of the `sites` tuple.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key


# How a site reads its input (`SiteSpec.op`).
LINEAR, EMBEDDING = "linear", "embedding"
SITE_OPS = (LINEAR, EMBEDDING)


@dataclasses.dataclass(frozen=True)
class SiteSpec:
  """One decomposed matrix: its name, kind, row in the kind's stack, shape.

  `draw_path` keys the site's stochastic draws (`fold_in` along the path,
  SPEC §3.6): layered targets give `(kind_index, absolute_layer)`, so a
  site's draws do not depend on which other sites are decomposed; empty
  means the site's canonical index (positionless toys).

  `op` is how the site reads its input (SPEC §3.7): `linear`, `x @ W` on
  activations `[*L, d_in]`; `embedding`, the rows `W[t]` of token ids
  `t: [*L]` in `[0, d_in)`, `d_in` being the vocabulary.
  """

  name: str
  kind: str
  row: int
  d_in: int
  d_out: int
  c: int
  draw_path: tuple[int, ...] = ()
  op: str = LINEAR


def is_embedding(site: SiteSpec) -> bool:
  """Return whether the site reads token ids (SPEC §3.7)."""
  return site.op == EMBEDDING


class Factors(NamedTuple):
  """Rank-1 factors of one matrix kind, stacked over layers."""

  v: Float[Array, "layer d_in c"]
  u: Float[Array, "layer c d_out"]


Components = dict[str, Factors]


@dataclasses.dataclass(frozen=True)
class KindSpec:
  """Shape of one kind's stack."""

  name: str
  n: int
  d_in: int
  d_out: int
  c: int


def validate_sites(sites: tuple[SiteSpec, ...]) -> None:
  """Raise ValueError unless names are unique and kinds stack cleanly."""
  names = [s.name for s in sites]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate site names in {names}")
  for site in sites:
    if site.c <= 0:
      raise ValueError(f"site {site.name}: C must be positive, got {site.c}")
    if site.op not in SITE_OPS:
      raise ValueError(f"site {site.name}: op must be one of {SITE_OPS}, "
                       f"got {site.op!r}")
  with_path = [s for s in sites if s.draw_path]
  if with_path and len(with_path) != len(sites):
    raise ValueError("either every site has a draw_path or none has: mixed "
                     "keys could collide with canonical indices")
  paths = [s.draw_path for s in with_path]
  if len(set(paths)) != len(paths):
    raise ValueError(f"draw paths must be unique, got {paths}")
  kind_specs(sites)


def draw_paths(sites: tuple[SiteSpec, ...]) -> dict[str, tuple[int, ...]]:
  """Return the path keying each site's stochastic draws (see SiteSpec)."""
  return {s.name: s.draw_path or (i,) for i, s in enumerate(sites)}


def fold_path(key: Key[Array, ""], path: tuple[int, ...]) -> Key[Array, ""]:
  """Return `key` folded with each element of `path` in turn."""
  for part in path:
    key = jax.random.fold_in(key, part)
  return key


def kind_specs(sites: tuple[SiteSpec, ...]) -> dict[str, KindSpec]:
  """Return each kind's stack shape, in first-appearance order."""
  by_kind: dict[str, list[SiteSpec]] = {}
  for site in sites:
    by_kind.setdefault(site.kind, []).append(site)
  specs = {}
  for kind, members in by_kind.items():
    first = members[0]
    for m in members:
      if m.op != first.op:
        raise ValueError(f"kind {kind}: site {m.name} is {m.op} but "
                         f"{first.name} is {first.op}; a kind has one op")
      if (m.d_in, m.d_out, m.c) != (first.d_in, first.d_out, first.c):
        raise ValueError(
          f"kind {kind}: site {m.name} has shape/C {(m.d_in, m.d_out, m.c)},"
          f" but {first.name} has {(first.d_in, first.d_out, first.c)};"
          " sites of one kind must share them"
        )
    rows = sorted(m.row for m in members)
    if rows != list(range(len(members))):
      raise ValueError(f"kind {kind}: rows {rows} must be 0..{len(members)-1}")
    specs[kind] = KindSpec(kind, len(members), first.d_in, first.d_out, first.c)
  return specs


def site_by_name(sites: tuple[SiteSpec, ...]) -> dict[str, SiteSpec]:
  """Return the sites keyed by name."""
  return {s.name: s for s in sites}


def init_components(key: Key[Array, ""], sites: tuple[SiteSpec, ...]) -> Components:
  """Draw fp32 factors: `V ~ N(0,1)/√d_in`, `U ~ N(0,1)/√C` (SPEC §6.1).

  Site `i` (canonical order) draws V from `keys[2i]` and U from `keys[2i+1]`
  of `split(key, 2·n_sites)`, so adding a site never changes another's init.
  """
  keys = jax.random.split(key, 2 * len(sites))
  v_rows: dict[str, dict[int, Array]] = {}
  u_rows: dict[str, dict[int, Array]] = {}
  for i, s in enumerate(sites):
    v = jax.random.normal(keys[2 * i], (s.d_in, s.c), jnp.float32)
    u = jax.random.normal(keys[2 * i + 1], (s.c, s.d_out), jnp.float32)
    v_rows.setdefault(s.kind, {})[s.row] = v / jnp.sqrt(s.d_in)
    u_rows.setdefault(s.kind, {})[s.row] = u / jnp.sqrt(s.c)
  return {
    kind: Factors(
      v=jnp.stack([v_rows[kind][r] for r in range(spec.n)]),
      u=jnp.stack([u_rows[kind][r] for r in range(spec.n)]),
    )
    for kind, spec in kind_specs(sites).items()
  }


def site_factors(
  components: Components, site: SiteSpec
) -> tuple[Float[Array, "d_in c"], Float[Array, "c d_out"]]:
  """Return one site's `(V, U)` from its kind's stack."""
  factors = components[site.kind]
  return factors.v[site.row], factors.u[site.row]


def init_components_projected(
  key: Key[Array, ""], sites: tuple[SiteSpec, ...],
  w_stacks: dict[str, Float[Array, "layer d_in d_out"]],
) -> Components:
  """Draw unit-norm factors, each component scaled to its overlap with `W`.

  The SPD paper's init: `V[:, c]` and `U[c, :]` are random unit vectors and
  `U[c, :]` is multiplied by `V[:, c]ᵀ·W·U[c, :]`, so each component starts
  as the target's restriction to a random rank-1 direction pair. Keys as in
  `init_components`.
  """
  drawn = init_components(key, sites)
  out = {}
  for kind, factors in drawn.items():
    v = factors.v / jnp.linalg.norm(factors.v, axis=-2, keepdims=True)
    u = factors.u / jnp.linalg.norm(factors.u, axis=-1, keepdims=True)
    w = w_stacks[kind].astype(jnp.float32)
    overlap = jnp.einsum("nic,nio,nco->nc", v, w, u)
    out[kind] = Factors(v=v, u=u * overlap[..., None])
  return out
