"""How a masked forward scans a decoder's live sites: a role's sites form
one kind per `C`, rows layer-ascending, and a kind's frozen stack is the
stored span leaf or the rows it gathers."""

import jax.numpy as jnp
import numpy as np

from decompax.targets import glu_config, glu_kinds, glu_sites, glu_weights

CONFIG = glu_config.GluConfig(
  n_layers=4, d_model=8, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=12,
  vocab_size=16, rope_theta=10000.0, rms_eps=1e-5, tied=True, qk_norm=False)
NAMES = (glu_weights.site_name(1, "up"), glu_weights.site_name(2, "up"),
         glu_weights.site_name(2, "q"), glu_weights.EMBED_SITE)


def test_a_roles_sites_form_one_kind_in_layer_order():
  sites = glu_sites.site_specs(CONFIG, NAMES, 4)
  layouts = glu_kinds.kind_layouts(sites)
  assert set(layouts) == {"up_proj", "q_proj"}  # the embedding runs apart
  assert layouts["up_proj"] == glu_kinds.KindLayout(
    "up", (1, 2), NAMES[:2])
  assert layouts["q_proj"].layers == (2,)
  split = glu_sites.site_specs(CONFIG, NAMES[:2], {NAMES[0]: 3, NAMES[1]: 5})
  assert {k: v.layers for k, v in glu_kinds.kind_layouts(split).items()} == {
    "up_proj.c3": (1,), "up_proj.c5": (2,)}


def _stack(n):
  shapes = {"ln1": (8,), "ln2": (8,), "q": (8, 8), "k": (8, 4),
            "v": (8, 4), "o": (8, 8), "gate": (8, 12), "up": (8, 12),
            "down": (12, 8)}
  return glu_weights.layer_stack(**{
    name: jnp.asarray(np.arange(n * np.prod(s), dtype=np.float32).reshape(
      n, *s))
    for name, s in shapes.items()})


def test_frozen_stacks_are_the_span_leaf_or_its_gathered_rows():
  # Without the embedding, which lies below layer 0, the span is [1, 3).
  sites = glu_sites.site_specs(CONFIG, NAMES[:3], 4)
  seg = glu_sites.span_segments(CONFIG, sites)
  assert (seg.split, seg.tail) == (1, 3)
  full = _stack(CONFIG.n_layers)
  prefix, span, tail = glu_weights.split_stacks(full, seg)
  weights = glu_weights.GluWeights(
    embed=jnp.asarray(np.arange(16 * 8, dtype=np.float32).reshape(16, 8)),
    prefix=prefix, span=span, tail=tail, norm=jnp.ones(8))
  stacks = glu_kinds.frozen_stacks(weights, glu_kinds.kind_layouts(sites),
                                   seg, (glu_weights.EMBED_SITE,))
  assert stacks["up_proj"] is span.up  # every span layer, in place
  np.testing.assert_array_equal(stacks["q_proj"], full.q[2:3])
  np.testing.assert_array_equal(stacks[glu_weights.EMBED_SITE][0],
                                weights.embed)
