"""`decomposition.npz` alone rebuilds its decomposition and CI function."""

import jax
import numpy as np
import pytest

from decompax.core import ci_fns, ci_transformer as ct, sites as sites_lib
from decompax.io import decomposition, run_dir
from decompax.io.checkpoint import CheckpointError

D = 6
SITES = (  # chunks by block must match in width and C
  sites_lib.SiteSpec("b0.q", "q", 0, D, D, 3),
  sites_lib.SiteSpec("b1.q", "q", 1, D, D, 3),
)
TRANSFORMER = ci_fns.CIConfig("transformer", transformer=ct.TransformerCIConfig(
  chunks=ct.chunks_by_tap(SITES, lambda s: f"resid.{s.name[1]}"),
  tap_widths=(("resid.0", D), ("resid.1", D)), d_model=8, n_blocks=1,
  n_heads=2, n_kv_heads=1, d_mlp=8))


def _write(path, ci_config, **extra):
  """Write a decomposition as `bin/train` finishes a run; return it."""
  ci_fn = ci_fns.make_ci_fn(ci_config, SITES)
  components = sites_lib.init_components(jax.random.key(0), SITES)
  ci_params = ci_fn.init(jax.random.key(1))
  run_dir.save_arrays(
    path, run_dir.flatten_tree(
      {"components": components, "ci_params": ci_params}),
    decomposition.decomposition_metadata(SITES, ci_config, step=7, **extra))
  return ci_fn, components, ci_params


@pytest.mark.parametrize("ci_config", [
  TRANSFORMER, ci_fns.CIConfig("component_mlp", (4,)),
], ids=["transformer", "component_mlp"])
def test_the_npz_alone_rebuilds_and_applies_its_ci_function(tmp_path,
                                                            ci_config):
  path = tmp_path / "decomposition.npz"
  ci_fn, components, ci_params = _write(path, ci_config, target="toy")
  loaded = decomposition.load_npz(path)
  assert loaded.sites == SITES and loaded.ci_config == ci_config
  assert loaded.step == 7 and loaded.metadata["target"] == "toy"
  rebuilt = ci_fns.make_ci_fn(loaded.ci_config, loaded.sites)
  taps = {t: jax.random.normal(jax.random.key(2), (2, 5, D))
          for t in ("resid.0", "resid.1", *[s.name for s in SITES])}
  want = ci_fn.apply(ci_params, taps, components)
  got = rebuilt.apply(loaded.ci_params, taps, loaded.components)
  for site in SITES:
    np.testing.assert_array_equal(got[site.name], want[site.name])


def test_an_npz_without_its_ci_config_is_refused(tmp_path):
  path = tmp_path / "decomposition.npz"
  run_dir.save_arrays(path, {"components/q/v": np.zeros((1, D, 3))},
                      {"sites": [], "ci_fn": {"kind": "component_mlp"}})
  with pytest.raises(CheckpointError, match="predates decomposition files"):
    decomposition.load_npz(path)
