"""No function of the library or of its binaries runs over 60 lines (def
to end): a longer one is split into named phases that can be read and
tested alone (the train step, the eval passes, the adversary terms, a
binary's checks, work and records)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("core", "targets", "losses", "placement", "io", "recipe",
            "analysis", "bin")
MAX_LINES = 60


def long_functions(source: str, max_lines: int = MAX_LINES
                   ) -> list[tuple[str, int]]:
  """Return `(name, lines)` of every function, nested ones too, whose
  body runs from its `def` line to its last over `max_lines` lines."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      lines = node.end_lineno - node.lineno + 1
      if lines > max_lines:
        out.append((node.name, lines))
  return out


def test_the_scan_sees_a_long_nested_function():
  body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
  source = f"def outer():\n  def inner():\n{body}  return inner\n"
  assert long_functions(source) == [("outer", MAX_LINES + 3),
                                    ("inner", MAX_LINES + 1)]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_runs_over_sixty_lines(package):
  found = [f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
           for path in sorted((ROOT / package).rglob("*.py"))
           for name, lines in long_functions(path.read_text())]
  assert not found, "split these into named phases: " + "; ".join(found)
