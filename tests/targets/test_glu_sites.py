"""A decoder LM's sites: their specs, kinds and draw paths (SPEC §3.6,
§9.2), which taps masking them reaches, and the units and MLP outputs they
declare."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decompax.core import masks as masks_lib
from decompax.core import sites as sites_lib
from decompax.losses import recon
from decompax.targets import glu_config, glu_sites, glu_weights

CONFIG = glu_config.GluConfig(
  n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=24,
  vocab_size=32, rope_theta=500000.0, rms_eps=1e-5, tied=False,
  qk_norm=True)
B, T, C = 2, 6, 5


def test_per_site_c_splits_a_role_into_kinds():
  names = (glu_weights.site_name(0, "up"), glu_weights.site_name(1, "up"))
  specs = glu_sites.site_specs(CONFIG, names, {names[0]: 3, names[1]: 7})
  assert [(s.kind, s.row, s.c) for s in specs] == [
    ("up_proj.c3", 0, 3), ("up_proj.c7", 0, 7)]
  with pytest.raises(ValueError, match="unknown"):
    glu_sites.site_specs(CONFIG, names[:1], {names[0]: 3, names[1]: 7})


def test_draws_are_keyed_by_kind_and_absolute_layer():  # SPEC §3.6
  # The same matrix draws the same source whichever other sites (and so
  # whichever span and canonical index) the decomposition has.
  down = glu_weights.site_name(2, "down")
  alone = glu_sites.site_specs(CONFIG, (down,), C)
  wider = glu_sites.site_specs(
    CONFIG, (glu_weights.site_name(0, "q"), glu_weights.site_name(1, "up"),
             down), C)
  assert alone[0].draw_path == wider[-1].draw_path == (6, 2)
  ci = jnp.full((B, T, C), 0.25)

  def mask_of(specs):
    entry = recon.all_sites_plan(specs)[0]
    masks = masks_lib.stochastic_site_masks(
      jax.random.key(5), entry.live_sites, {s.name: ci for s in specs},
      sites_lib.draw_paths(specs), True, "continuous", None)
    return masks[down].mask

  np.testing.assert_array_equal(mask_of(alone), mask_of(wider))
  first = glu_sites.site_specs(CONFIG, (glu_weights.site_name(0, "q"),), C)
  assert not np.array_equal(mask_of(alone), masks_lib.stochastic_site_masks(
    jax.random.key(5), recon.all_sites_plan(first)[0].live_sites,
    {first[0].name: ci}, sites_lib.draw_paths(first), True, "continuous",
    None)[first[0].name].mask)


def test_unknown_sites_are_refused():
  with pytest.raises(ValueError, match="unknown site"):
    glu_sites.site_specs(CONFIG, ("layers.9.mlp.up_proj",), 4)
  with pytest.raises(ValueError, match="unknown site"):
    glu_sites.site_specs(CONFIG, ("layers.0.mlp.up_proj.out",), 4)
