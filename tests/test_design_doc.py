"""Every section and id the code cites resolves in docs/design.md.

Code, tests and READMEs cite the design document as `SPEC §6.1`,
`(SPEC §12)`, `§5.6-§5.8`, `(I23)`, `I36:`, `SPEC I44`, `N4`, `SPEC D5`.
A section resolves to a heading carrying its number (`### §6.1 …`); an id
(families I, N, R, D) to a list item starting with it in bold
(`- **I23** …`). A section cited after `STYLE` (the style guide, a
document outside the repository) resolves nowhere: cite this one. Ids are
read from comments and string literals of `.py` files (never from
identifiers) and from the whole text of `.md` files.
"""

import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "design.md"
SCANNED_DIRS = ("core", "targets", "losses", "placement", "io", "recipe",
                "analysis", "bin", "tests", "bench")
SCANNED_FILES = ("README.md", "WORKSPACE.md",
                 *sorted(str(p.relative_to(ROOT))
                         for p in (ROOT / "docs").glob("*.md")))

_NUM = r"\d+(?:\.\d+)*"
# One citation of a section, or a run of them: `§6.1`, `§1, §2, §6.1`,
# `§5.6-§5.8`, `§3.2-3.3`. A run after `STYLE` cites the style guide,
# which never resolves.
_SECTIONS = re.compile(
  rf"(?:\b(STYLE)\s+)?§({_NUM})((?:\s*[-–]\s*§?{_NUM}|\s*,\s*§{_NUM})*)")
_ID = re.compile(r"(?<![\w])([IDNR]\d{1,2})\b")
# Not citations: dtype codes such as safetensors' "I8".
_NOT_AN_ID_BEFORE = re.compile(r"dtype\W{0,4}$")
_HEADING = re.compile(rf"^#{{1,6}}\s+§({_NUM})(?:\s|$)", re.M)
_ENTRY = re.compile(r"^\s*[-*]\s+\*\*([IDNR]\d{1,2})\*\*", re.M)


def cited_sections(text: str) -> list[tuple[str, int]]:
  """Return `(section, offset)` for every SPEC section cited in `text`."""
  found = []
  for m in _SECTIONS.finditer(text):
    if m.group(1):
      found.append((f"{m.group(1)} §{m.group(2)}", m.start(1)))
      continue
    found.append(("§" + m.group(2), m.start(2)))
    for n in re.finditer(_NUM, m.group(3)):
      found.append(("§" + n.group(0), m.start(3) + n.start()))
  return found


def cited_ids(text: str) -> list[tuple[str, int]]:
  """Return `(id, offset)` for every invariant-family id cited in `text`."""
  return [(m.group(1), m.start()) for m in _ID.finditer(text)
          if not _NOT_AN_ID_BEFORE.search(text[max(0, m.start() - 12):
                                               m.start()])]


def _prose_of_python(text: str) -> str:
  """Return `text` with everything but comments and strings blanked out,
  offsets (hence line numbers) unchanged."""
  lines = text.splitlines(keepends=True)
  starts = [0]
  for line in lines:
    starts.append(starts[-1] + len(line))
  kept = [" " if c != "\n" else c for c in text]
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type not in (tokenize.COMMENT, tokenize.STRING):
      continue
    begin = starts[tok.start[0] - 1] + tok.start[1]
    end = starts[tok.end[0] - 1] + tok.end[1]
    kept[begin:end] = text[begin:end]
  return "".join(kept)


def citations(text: str, python: bool = False) -> list[tuple[str, int]]:
  """Return every cited section and id of one file's text, with offsets."""
  prose = _prose_of_python(text) if python else text
  return sorted(cited_sections(text) + cited_ids(prose), key=lambda c: c[1])


def defined(doc: str) -> tuple[set[str], list[str]]:
  """Return the sections and ids `doc` defines, and any defined twice."""
  names = ["§" + s for s in _HEADING.findall(doc)] + _ENTRY.findall(doc)
  twice = sorted({n for n in names if names.count(n) > 1})
  return set(names), twice


def unresolved(files: dict[str, str], doc: str) -> dict[str, list[str]]:
  """Return each citation missing from `doc` with the places citing it."""
  names, _ = defined(doc)
  missing: dict[str, list[str]] = {}
  for path, text in files.items():
    for name, offset in citations(text, path.endswith(".py")):
      if name not in names:
        line = text.count("\n", 0, offset) + 1
        missing.setdefault(name, []).append(f"{path}:{line}")
  return missing


def _scanned_files() -> dict[str, str]:
  paths = [ROOT / f for f in SCANNED_FILES]
  for folder in SCANNED_DIRS:
    for suffix in ("*.py", "*.md"):
      paths.extend((ROOT / folder).rglob(suffix))
  return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
          for p in sorted(set(paths)) if p.is_file()}


def _report(missing: dict[str, list[str]]) -> str:
  return "\n".join(f"  {name}: cited at {', '.join(places[:5])}"
                   + (f" and {len(places) - 5} more" if len(places) > 5
                      else "")
                   for name, places in sorted(missing.items()))


def test_parser_on_a_synthetic_file():
  source = '''"""Steps (SPEC §6.1, §6.3, I30, I31); STYLE_9; SPEC §5.6-§5.8."""
header = {"dtype": "I8"}  # I23: resolves; the dtype code is no citation
N4 = 1  # a variable, not a citation
"""(SPEC §3.2-3.3) SPEC I44, N2, R3 and SPEC §3.5 D5; I17-I24."""
'''
  source = source.replace("STYLE_9", "STYLE " + "§9")
  doc = "## §6 Step\n### §6.1 Order\n- **I30** x\n- **I23** y\n"
  found = [name for name, _ in citations(source, python=True)]
  assert found == ["§6.1", "§6.3", "I30", "I31", "STYLE " + "§9", "§5.6",
                   "§5.8", "I23", "§3.2", "§3.3", "I44", "N2", "R3", "§3.5",
                   "D5", "I17", "I24"]
  missing = unresolved({"m.py": source}, doc)
  assert "§6.1" not in missing and "I30" not in missing
  assert missing["I31"] == ["m.py:1"] and missing["D5"] == ["m.py:4"]
  assert missing["STYLE " + "§9"] == ["m.py:1"]
  assert "§9" not in missing and "N4" not in missing
  assert defined(doc + "- **I23** again\n")[1] == ["I23"]


def test_every_citation_resolves_in_the_design_doc():
  missing = unresolved(_scanned_files(), DOC.read_text(encoding="utf-8"))
  assert not missing, (
    f"cited but not defined in {DOC.relative_to(ROOT)} (add a `## §x` "
    f"heading or a `- **Id**` entry):\n{_report(missing)}")


def test_design_doc_defines_each_name_once_and_ids_without_gaps():
  names, twice = defined(DOC.read_text(encoding="utf-8"))
  assert not twice, f"defined more than once: {twice}"
  for family in "IDNR":
    numbers = sorted(int(n[1:]) for n in names if n[0] == family)
    assert numbers == list(range(1, len(numbers) + 1)), (family, numbers)
  assert {"I46", "I47"} <= names
