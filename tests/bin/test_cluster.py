"""bin/cluster: a harvested run's clusters written beside its harvest, the
same for the same seed, every firing component in exactly one cluster."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cluster(run: str, *args: str) -> dict:
  result = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "cluster"), f"--run_dir={run}",
     "--batch_size=32", *args],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  assert [line.split(":")[0] for line in result.stdout.splitlines()[:2]] == [
    "linear1", "linear2"]
  with open(os.path.join(run, "harvest", "clusters.json")) as f:
    return json.load(f)


def test_clusters_cover_each_site_and_repeat_for_a_seed(harvested_tms):
  first = _cluster(harvested_tms, "--seed=3")
  assert first["seed"] == 3 and first["version"] == 1
  multi = [c for r in first["sites"].values() for c in r["clusters"]
           if len(c["members"]) > 1]
  assert first["batch_size"] == (32 if multi else None)
  for site, record in first["sites"].items():
    members = [m for c in record["clusters"] for m in c["members"]]
    assert sorted(members + record["never_fired"]) == list(range(6)), site
    assert record["bits"] <= record["singleton_bits"] + 1e-6
    for c in record["clusters"]:
      if len(c["members"]) > 1:
        assert c["summed"] == sum(c["member_effects"])
        assert c["joint"] >= 0
  assert _cluster(harvested_tms, "--seed=3") == first
