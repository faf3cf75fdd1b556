"""A prompt's attribution graph: `bin/graph --run_dir=D --tokens=1,2,3`.

Builds `explore.attribution_graph` (analysis/attribution.py, docs/design.md
§15.2) of a finished language-model run on one prompt of token ids, prints
its size and its edges summed per site and position (largest first,
`--top`), and writes the figure (`--output`, a PNG: positions across,
sites up, the logit on top) and, with `--json`, the graph's JSON.

Each file is claimed as `io/owned_dir.py` says for a file: its path
named, one writer at a time (the lock of `.NAME.lock` beside it), and
`.NAME.written.json` beside it records the settings that drew it (the
run's decomposition by its bytes, the prompt and every flag of the
graph). The same settings draw it again; other settings are refused
unless `--overwrite`, and a file no graph run wrote is never replaced.
"""

import contextlib
import json
import os

from absl import flags, logging

from decompax.analysis import attribution, explore
from decompax.bin import cli
from decompax.io import owned_dir, run_dir
from decompax.render import figures

_RUN_DIR = flags.DEFINE_string(
  "run_dir", None, "A finished bin/train run of a language model (a token "
  "toy or --target=hf).", required=True)
_TOKENS = flags.DEFINE_string(
  "tokens", None, "The prompt: token ids separated by commas.",
  required=True)
_POSITION = flags.DEFINE_integer(
  "position", -1, "The position whose prediction is explained (negative "
  "counts from the end).")
_TOKEN = flags.DEFINE_integer(
  "token", None, "The token whose logit is the output node; default the "
  "clean model's top prediction there.")
_SHARE = cli.define_float(
  "share", 0.9, "Share of each target's incoming |attribution| its kept "
  "edges carry, in (0, 1].", __name__)
_THRESHOLD = cli.define_float(
  "threshold", None, "CI above which a component is alive; default the "
  "run's --ci_alive_threshold.", __name__)
_MAX_TARGETS = flags.DEFINE_integer(
  "max_targets", 64, "Nodes expanded (the output first, then by influence).",
  lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", "attribution_graph.png",
                              "The figure (PNG).")
_JSON = flags.DEFINE_string("json", None, "Also write the graph's JSON here.")
_TOP = flags.DEFINE_integer("top", 10, "Summed edges printed.",
                            lower_bound=0)
_OVERWRITE = flags.DEFINE_bool(
  "overwrite", False, "Replace an --output (or --json) that a graph of "
  "other settings wrote.")


def fail(message: str) -> None:
  """Print a one-line error and exit non-zero."""
  cli.fail("graph", message)


def prompt_tokens(text: str) -> list[int]:
  """Return the token ids of `--tokens`; ValueError names a bad one."""
  ids = []
  for part in text.split(","):
    try:
      ids.append(int(part))
    except ValueError:
      raise ValueError(f"--tokens: {part.strip()!r} is no token id; give "
                       "integers separated by commas") from None
  return ids


def check_prompt(tokens: list[int], token: int | None, vocab: int,
                 positions: int | None) -> None:
  """Raise ValueError, naming the flag, for a prompt id (or `--token`)
  outside the vocabulary [0, vocab) or a prompt longer than the model's
  `positions`."""
  try:
    explore.check_token_ids(tokens, vocab)
  except ValueError as e:
    raise ValueError(f"--tokens: {e}") from None
  if positions is not None and len(tokens) > positions:
    raise ValueError(f"--tokens: the prompt has {len(tokens)} tokens, more "
                     f"than the model's {positions} positions; give at most "
                     f"{positions}")
  if token is not None and not 0 <= token < vocab:
    raise ValueError(f"--token={token} is outside the vocabulary "
                     f"[0, {vocab})")


def _place(where: tuple[str, int]) -> str:
  return f"{where[0]} @{where[1]}"


def summary(graph: attribution.AttributionGraph, top: int) -> str:
  """Return the graph's size and its `top` summed edges, one a line."""
  lines = [f"logit of token {graph.token} at position {graph.position}: "
           f"{graph.logit:.4g}; share {graph.share:g}, "
           f"{len(graph.nodes)} nodes, {len(graph.edges)} edges"]
  lines += [f"  {_place(e.source)} -> {_place(e.target)}: {e.weight:+.3g}"
            for e in attribution.summed_edges(graph)[:top]]
  return "\n".join(lines)


def output_problem(flag: str, path: str) -> str | None:
  """Return why `--flag=path` cannot be written as a file, or None."""
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    return f"cannot write {path}: its directory {parent} does not exist"
  if os.path.isdir(path):
    example = {"output": "attribution_graph.png"}.get(flag, "graph.json")
    return (f"--{flag}={path} is a directory; name a file in it, e.g. "
            f"{os.path.join(path, example)}")
  if os.path.exists(path) and not os.path.isfile(path):
    return f"--{flag}={path} is not a regular file; name another"
  return None


def _check_outputs(outputs: dict[str, str]) -> None:
  for flag, path in outputs.items():
    problem = output_problem(flag, path)
    if problem:
      fail(problem)


def _check_paths(outputs: dict[str, str]) -> None:
  """Refuse outputs that cannot be written as files, before the run is
  read (`io/owned_dir.py`)."""
  try:
    for flag, path in outputs.items():
      owned_dir.named(path, flag)
    _check_outputs(outputs)
    for flag, path in outputs.items():
      owned_dir.check_file(path, flag)
  except ValueError as e:
    fail(str(e))


def settings(run: explore.LoadedRun, run_path: str,
             tokens: list[int]) -> dict:
  """Return what decides the graph: the run's decomposition (its step
  and bytes; where the run lies is recorded, not compared), the prompt
  and the graph's flags."""
  arrays = run_dir.flatten_tree({
    "components": run.decomposition.components,
    "ci_params": run.decomposition.ci_params})
  return {"run": {"location": os.path.abspath(run_path),
                  "step": run.decomposition.step,
                  **owned_dir.arrays_identity(arrays)},
          "tokens": tokens, "position": _POSITION.value,
          "token": _TOKEN.value, "share": _SHARE.value,
          "threshold": _THRESHOLD.value, "max_targets": _MAX_TARGETS.value}


def main(argv: list[str]) -> None:
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; use --tokens=ID,ID,...")
  outputs = {"output": _OUTPUT.value} | (
    {"json": _JSON.value} if _JSON.value is not None else {})
  _check_paths(outputs)
  try:
    tokens = prompt_tokens(_TOKENS.value)
    run = explore.load_run(_RUN_DIR.value)
    if run.target.token_labels is not None:
      check_prompt(tokens, _TOKEN.value, explore.vocab_size(run),
                   run.positions)
  except (OSError, ValueError) as e:
    fail(str(e))
  chosen = settings(run, _RUN_DIR.value, tokens)
  with contextlib.ExitStack() as claims:
    try:
      for flag, path in outputs.items():
        claims.enter_context(owned_dir.claimed_output(
          path, flag, "graph", chosen, _OVERWRITE.value,
          {"output": "figure"}.get(flag, "graph JSON")))
    except ValueError as e:
      fail(str(e))
    graph = draw(run, tokens)
  print(summary(graph, _TOP.value))
  print(f"wrote {', '.join(outputs.values())}")


def draw(run: explore.LoadedRun,
         tokens: list[int]) -> attribution.AttributionGraph:
  """Return the prompt's graph, its figure (and JSON) written."""
  try:
    graph = explore.attribution_graph(
      run, tokens, token=_TOKEN.value, position=_POSITION.value,
      share=_SHARE.value, threshold=_THRESHOLD.value,
      max_targets=_MAX_TARGETS.value)
  except (OSError, ValueError) as e:
    fail(str(e))
  data = attribution.graph_json(graph)
  try:
    figures.plot_attribution_graph(
      data, [s.name for s in run.target.sites], _OUTPUT.value,
      labels=[str(t) for t in tokens])
    if _JSON.value:
      run_dir.atomic_write(_JSON.value,
                           lambda f: f.write(json.dumps(data).encode()))
  except OSError as e:
    fail(owned_dir.refusal(e, _OUTPUT.value))
  return graph


def entry() -> None:
  """Launch the absl app (used by the `bin/graph` launcher)."""
  cli.launch("graph", main)


if __name__ == "__main__":
  entry()
