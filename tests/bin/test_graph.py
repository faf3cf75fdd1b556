"""bin/graph: the induction toy's graph of a repeated prompt, printed,
drawn and saved as JSON that agrees with the printed size."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Eight tokens and their repeat: position 12 (the second copy of token 4)
# predicts the copied token 5.
PROMPT = "15,16,24,30,1,4,26,30,15,16,24,30,1,4,26,30"


def test_graph_prints_draws_and_saves_the_graph(finished_run, tmp_path):
  run = finished_run("induction")
  png, data = tmp_path / "g.png", tmp_path / "g.json"
  result = subprocess.run(
    [sys.executable, "-P", str(ROOT / "bin" / "graph"), f"--run_dir={run}",
     f"--tokens={PROMPT}", "--position=12", "--token=4", "--threshold=0",
     "--max_targets=4", f"--output={png}", f"--json={data}", "--top=3"],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  graph = json.loads(data.read_text())
  assert (graph["token"], graph["position"]) == (4, 12)
  lines = result.stdout.splitlines()
  assert lines[0].startswith("logit of token 4 at position 12: ")
  assert (f"{len(graph['nodes'])} nodes, {len(graph['edges'])} edges"
          in lines[0])
  assert len([x for x in lines if " -> " in x]) == 3
  assert png.read_bytes()[:4] == b"\x89PNG"
  # Each file with its manifest beside it (`io/owned_dir.claimed_output`),
  # the locks gone.
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    ".g.json.written.json", ".g.png.written.json", "g.json", "g.png"]
  manifest = json.loads((tmp_path / ".g.png.written.json").read_text())
  assert manifest["program"] == "graph"
  assert manifest["settings"]["tokens"] == [int(t) for t in PROMPT.split(",")]
  assert (manifest["settings"]["position"],
          manifest["settings"]["token"]) == (12, 4)
