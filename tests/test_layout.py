"""Repository guards: packaging list, import directions, namespace imports."""

import ast
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("core", "targets", "losses", "placement", "io", "recipe",
            "analysis", "bin")
LIBRARY = set(PACKAGES) - {"bin"}
ALLOWED = {
  "core": set(),
  "targets": {"core"},
  "losses": {"core"},
  "placement": {"core"},
  "io": {"core", "placement"},
  "recipe": LIBRARY - {"recipe", "analysis"},
  "analysis": LIBRARY - {"analysis"},
  "bin": LIBRARY,
}


def _imports(path: pathlib.Path) -> list[str]:
  tree = ast.parse(path.read_text(), filename=str(path))
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.append(node.module)
      if node.module == "decompax":
        names += [f"decompax.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level > 0:
      names.append("<relative>")
  return names


def _imported_modules(path: pathlib.Path) -> list[str]:
  """Return every module `path` imports, `from a import b` as `a.b`."""
  tree = ast.parse(path.read_text(), filename=str(path))
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [f"{alias.name}." for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names += [f"{node.module}.{alias.name}" for alias in node.names]
  return names


def _modules(package: str):
  return sorted((ROOT / package).glob("*.py"))


def test_packaging_list_matches_directories():
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  setuptools = config["tool"]["setuptools"]
  assert setuptools["packages"] == [f"decompax.{p}" for p in PACKAGES]
  assert setuptools["package-dir"] == {f"decompax.{p}": p for p in PACKAGES}
  for package in PACKAGES:
    assert (ROOT / package / "__init__.py").exists(), package
    nested = [p for p in (ROOT / package).iterdir()
              if p.is_dir() and (p / "__init__.py").exists()]
    assert not nested, f"packages are flat; {package} nests {nested}"


def test_import_directions_follow_workspace_graph():
  violations = []
  for package in PACKAGES:
    for module in _modules(package):
      for name in _imports(module):
        parts = name.split(".")
        if parts[0] == "decompax" and len(parts) > 1:
          dep = parts[1]
          if dep != package and dep not in ALLOWED[package]:
            violations.append(f"{module.relative_to(ROOT)} imports {name}")
  assert not violations, "\n".join(violations)


def test_benchmarks_import_only_the_library():
  violations = []
  for module in sorted((ROOT / "bench").glob("*.py")):
    for name in _imported_modules(module):
      if name.rstrip(".") == "decompax.bin" or name.startswith("decompax.bin."):
        violations.append(f"{module.relative_to(ROOT)} imports {name}")
  assert not violations, "\n".join(violations)


def test_no_bare_or_relative_imports_of_repo_packages():
  offenders = []
  for package in PACKAGES:
    for module in _modules(package):
      for name in _imports(module):
        bare = name.split(".")[0] in PACKAGES and name.split(".")[0] != "io"
        if bare or name == "<relative>":
          offenders.append(f"{module.relative_to(ROOT)}: {name}")
  assert not offenders, "\n".join(offenders)


def test_workspace_md_states_the_enforced_edges():
  text = (ROOT / "WORKSPACE.md").read_text()
  for package in PACKAGES:
    assert f"**{package}**" in text
  assert "`io` → `core`, `placement`" in text
  assert "`bench` → the library packages" in text


def test_no_binary_module_shadows_the_standard_library():
  # `python bin/<tool>` without -P puts bin/ first on sys.path, where a
  # module named like a standard one (`tokenize`) replaces it for every
  # import, the interpreter's own included.
  names = {p.stem for p in (ROOT / "bin").glob("*.py")}
  assert sorted(names & sys.stdlib_module_names) == []
