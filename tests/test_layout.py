"""Repository guards: packaging list, import directions, namespace imports."""

import ast
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("core", "targets", "losses", "measures", "evals", "placement",
            "io", "render", "recipe", "analysis", "bin")
LIBRARY = set(PACKAGES) - {"bin"}
ALLOWED = {
  "core": set(),
  "targets": {"core"},
  "losses": {"core"},
  "measures": {"core"},
  "evals": {"core", "losses", "measures"},
  "placement": {"core"},
  "io": {"core", "placement"},
  "render": {"core", "measures", "io"},
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


def _defined_flags(module: pathlib.Path) -> list[str]:
  """Return the names of the absl flags `module` defines at import."""
  names = []
  for node in ast.walk(ast.parse(module.read_text())):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("DEFINE_") and node.args
        and isinstance(node.args[0], ast.Constant)):
      names.append(node.args[0].value)
  return names


def test_no_two_benchmarks_define_the_same_flag():
  # Benchmarks define their flags on absl's global registry at import, and
  # one test process imports several: a name defined twice fails whichever
  # test imports the second module, depending on how files are shared out.
  owners = {}
  for module in sorted((ROOT / "bench").glob("*.py")):
    for name in _defined_flags(module):
      owners.setdefault(name, []).append(module.name)
  shared = {name: files for name, files in owners.items() if len(files) > 1}
  assert not shared, shared


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


# The rules of WORKSPACE.md's "Rules" that a scan of the source can hold.
# File-system writes: a call that creates, changes or removes a file or a
# directory. `Path.replace` is left out: its name is `str.replace`'s too.
_WRITING_CALLS = {
  "os": {"remove", "unlink", "rmdir", "removedirs", "replace", "rename",
         "renames", "makedirs", "mkdir", "truncate", "link", "symlink"},
  "shutil": {"rmtree", "move", "copy", "copy2", "copyfile", "copytree"},
  "tempfile": {"mkdtemp", "mkstemp", "NamedTemporaryFile",
               "TemporaryDirectory"},
  "np": {"save", "savez", "savez_compressed"},
}
_WRITING_METHODS = {"write_text", "write_bytes", "unlink", "rmdir", "mkdir",
                    "touch", "rename", "symlink_to", "hardlink_to",
                    "savefig"}
# Process control: signals, child processes, threads, priorities.
_PROCESS_MODULES = {"signal", "subprocess", "threading", "multiprocessing",
                    "concurrent", "ctypes"}
_PROCESS_CALLS = {"os": {"nice", "kill", "killpg", "fork", "_exit", "system",
                         "popen", "setpgrp", "setsid", "execv", "execvp"}}


def _called(node: ast.Call, calls: dict[str, set[str]]) -> str | None:
  func = node.func
  if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
      and func.attr in calls.get(func.value.id, ())):
    return f"{func.value.id}.{func.attr}"
  return None


def _writes_a_file(node: ast.AST) -> str | None:
  """Return what `node` does that writes the file system, if anything."""
  if isinstance(node, ast.ImportFrom) and node.module in _WRITING_CALLS:
    names = {a.name for a in node.names} & _WRITING_CALLS[node.module]
    return f"from {node.module} import {sorted(names)}" if names else None
  if not isinstance(node, ast.Call):
    return None
  if (called := _called(node, _WRITING_CALLS)) is not None:
    return called
  func = node.func
  if isinstance(func, ast.Attribute) and func.attr in _WRITING_METHODS:
    return f".{func.attr}()"
  if isinstance(func, ast.Name) and func.id == "open":
    modes = node.args[1:2] + [k.value for k in node.keywords
                              if k.arg == "mode"]
    for mode in modes:
      if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)
              and set(mode.value) <= set("rbt")):
        return f"open(mode={ast.unparse(mode)})"
  return None


def _controls_the_process(node: ast.AST) -> str | None:
  """Return what `node` does that is process policy, if anything."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names
             if a.name.split(".")[0] in _PROCESS_MODULES]
    return f"import {', '.join(names)}" if names else None
  if isinstance(node, ast.ImportFrom) and node.module:
    if node.module.split(".")[0] in _PROCESS_MODULES:
      return f"from {node.module} import"
    if node.module == "os":
      names = {a.name for a in node.names} & _PROCESS_CALLS["os"]
      return f"from os import {sorted(names)}" if names else None
  if isinstance(node, ast.Call):
    return _called(node, _PROCESS_CALLS)
  return None


def _offences(packages, rule) -> list[str]:
  found = []
  for package in packages:
    for module in _modules(package):
      tree = ast.parse(module.read_text(), filename=str(module))
      for node in ast.walk(tree):
        if (what := rule(node)) is not None:
          found.append(f"{module.relative_to(ROOT)}:{node.lineno}: {what}")
  return found


def test_only_io_writes_the_file_system_in_the_library():
  offences = _offences(sorted(LIBRARY - {"io"}), _writes_a_file)
  assert not offences, "write through decompax.io:\n" + "\n".join(offences)


def test_only_bin_controls_the_process():
  offences = _offences(sorted(LIBRARY), _controls_the_process)
  assert not offences, "process policy is bin's:\n" + "\n".join(offences)


@pytest.mark.parametrize("rule, source", [
  (_writes_a_file, "open(path, 'w')"),
  (_writes_a_file, "open(path, mode=m)"),
  (_writes_a_file, "os.replace(a, b)"),
  (_writes_a_file, "shutil.rmtree(a)"),
  (_writes_a_file, "pathlib.Path(a).write_text('x')"),
  (_writes_a_file, "from os import remove"),
  (_controls_the_process, "import threading"),
  (_controls_the_process, "from concurrent import futures"),
  (_controls_the_process, "os.nice(19)"),
  (_controls_the_process, "import subprocess as sp"),
])
def test_the_scans_catch_each_kind_of_offence(rule, source):
  assert any(rule(node) for node in ast.walk(ast.parse(source)))


@pytest.mark.parametrize("rule, source", [
  (_writes_a_file, "open(path)"),
  (_writes_a_file, "open(path, 'rb')"),
  (_writes_a_file, "text.replace('a', 'b')"),
  (_writes_a_file, "os.path.join(a, b)"),
  (_controls_the_process, "import os, time"),
  (_controls_the_process, "os.getpid()"),
])
def test_the_scans_pass_what_is_no_offence(rule, source):
  assert not any(rule(node) for node in ast.walk(ast.parse(source)))


def test_no_two_modules_share_a_name():
  owners: dict[str, list[str]] = {}
  for package in (*PACKAGES, "bench"):
    for module in _modules(package):
      if module.stem != "__init__":
        owners.setdefault(module.stem, []).append(package)
  shared = {name: where for name, where in owners.items() if len(where) > 1}
  assert not shared, shared


def _sibling_imports(path: pathlib.Path, package: str) -> set[str]:
  """Return the modules of `package` that `path` imports, at module level
  or inside a function alike."""
  names = set()
  for name in _imported_modules(path):
    parts = name.rstrip(".").split(".")
    if parts[:2] == ["decompax", package] and len(parts) > 2:
      names.add(parts[2])
  return names & {m.stem for m in _modules(package)}


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Return a cycle through each back edge of `graph`'s depth-first walk
  (none: the imports form a DAG)."""
  state: dict[str, str] = {}
  cycles = []

  def visit(module: str, path: list[str]) -> None:
    state[module], path = "open", path + [module]
    for dep in sorted(graph[module]):
      if state.get(dep) == "open":
        cycles.append(path[path.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, path)
    state[module] = "done"

  for module in sorted(graph):
    if module not in state:
      visit(module, [])
  return cycles


@pytest.mark.parametrize("package", (*PACKAGES, "bench"))
def test_no_package_s_modules_import_each_other_in_a_circle(package):
  """A circle closed by an import inside a function counts: it hides an
  order of modules that the package does not have."""
  graph = {m.stem: _sibling_imports(m, package) for m in _modules(package)}
  cycles = _import_cycles(graph)
  assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_scan_sees_a_circle():
  graph = {"config": {"checks"}, "checks": {"terms"}, "terms": {"config"},
           "lm": set()}
  assert _import_cycles(graph) == [["checks", "terms", "config", "checks"]]
  assert _import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_settings_import_no_module_of_recipe():
  """Settings are read by everything in recipe; nothing there is below
  them, so `recipe/config` stands on the library packages alone."""
  assert _sibling_imports(ROOT / "recipe" / "config.py", "recipe") == set()


def test_tests_mirror_the_packages():
  folders = {p.name for p in (ROOT / "tests").iterdir()
             if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
  assert folders == {*PACKAGES, "bench"}


def _library_modules() -> set[str]:
  return {f"{package}/{path.stem}" for package in LIBRARY
          for path in _modules(package) if path.stem != "__init__"}


def test_every_library_module_has_its_test_file():
  """A newcomer finds a module's tests at `tests/<package>/test_<module>.py`,
  whatever else tests it."""
  assert {"core/train_step", "io/run_dir", "recipe/config"} <= (
    _library_modules())
  missing = {m for m in _library_modules()
             if not (ROOT / "tests" / f"{m.replace('/', '/test_')}.py"
                     ).exists()}
  assert not missing, (f"library modules without tests/<package>/"
                       f"test_<module>.py: {sorted(missing)}")


def test_bench_is_a_package_of_the_repository_not_of_the_wheel():
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert (ROOT / "bench" / "__init__.py").exists()
  assert not [p for p in config["tool"]["setuptools"]["packages"]
              if "bench" in p]
  # Benches import each other as modules, never by a file's path.
  loaders = [str(m.relative_to(ROOT)) for m in _modules("bench")
             if "spec_from_file_location" in m.read_text()
             or "sys.path" in m.read_text()]
  assert not loaders, loaders


def _tracked_text_files():
  listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                          capture_output=True).stdout.decode().split("\0")
  suffixes = {".py", ".md", ".toml", ".flags", ".cfg", ".txt", ".sh"}
  return [ROOT / name for name in listed
          if name and pathlib.Path(name).suffix in suffixes
          and (ROOT / name).is_file()]


def test_no_merge_conflict_markers_are_committed():
  # A half-resolved merge once left both sides of a paragraph in a doc.
  markers = ("<<<<<<< ", ">>>>>>> ")
  offenders = [
    f"{path.relative_to(ROOT)}:{number}"
    for path in _tracked_text_files()
    for number, line in enumerate(path.read_text().splitlines(), 1)
    if line.startswith(markers)]
  assert not offenders
