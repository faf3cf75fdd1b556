"""bin/match: a run against itself prints a table of stable sites, every
pair at similarity 1, and shares its spans, weights and groups whole."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_run_against_itself_is_stable_in_every_site(finished_run):
  run = finished_run("tms")
  result = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "match"), f"--run_a={run}",
     f"--run_b={run}", "--batch_size=64", "--pairs"],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  rows = [line.strip("|").split("|") for line in result.stdout.splitlines()
          if line.startswith("| linear")]
  sites = [r for r in rows if len(r) == 9 and "/" not in r[1]]
  shared = [r for r in rows if len(r) == 9 and "/" in r[1]]
  pairs = [r for r in rows if len(r) == 6]
  assert [r[0].strip() for r in sites] == ["linear1", "linear2"]
  for site in sites:
    alive = int(site[1])
    # Every alive component paired with itself, each at the threshold.
    assert alive > 0 and int(site[2]) == int(site[3]) == int(site[4]) == alive
    assert float(site[5]) == 1.0 and site[8].strip() == "1.00"
  # Against itself a run shares its spans, its weights and its groups.
  assert [r[0].strip() for r in shared] == ["linear1", "linear2"]
  for site in shared:
    assert float(site[2].split()[0]) == float(site[3].split()[0]) == 1.0
    assert float(site[4]) == float(site[5]) == float(site[7]) == 1.0
  assert len(pairs) == sum(int(s[1]) for s in sites)
  assert all(p[1] == p[2] and float(p[3]) == 1.0 for p in pairs)
