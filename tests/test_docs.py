"""The README and the pages of docs/ agree with the repository: every
relative link and anchor resolves, and the README's first screen names
every `./dev` verb and every binary of bin/, as no document names a verb
`./dev` does not know.

Anchors are GitHub's: a heading's text, lower-cased, with everything but
letters, digits, `_`, `-` and spaces dropped and spaces turned into `-`; a
repeated one gets `-1`, `-2`, … Code blocks and inline code are not read
for links or headings.
"""

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_FENCED = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
# A code span may run over a line break; `\`` is a literal backtick.
_CODE_SPAN = re.compile(r"`[^`]+`")
_LINK = re.compile(r"\]\(([^()\s]+)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
_VERB = re.compile(r"\./dev\s+([a-z][a-z_-]*)")


def _blanked(match: re.Match) -> str:
  """Keep a match's line breaks only, so offsets keep their line numbers."""
  return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
  """Return `text` without code blocks and code spans, lines kept."""
  text = _FENCED.sub(_blanked, text).replace("\\`", "  ")
  return _CODE_SPAN.sub(_blanked, text)


def slug(heading: str) -> str:
  """Return the anchor GitHub gives a heading's text."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
  """Return the anchors of every heading of a markdown text."""
  seen: dict[str, int] = {}
  found = set()
  for m in _HEADING.finditer(_FENCED.sub(_blanked, text)):
    base = slug(m.group(1))
    found.add(base if base not in seen else f"{base}-{seen[base]}")
    seen[base] = seen.get(base, 0) + 1
  return found


def broken_links(path: pathlib.Path) -> list[str]:
  """Return `file:line: target (why)` for each relative link of a markdown
  file whose file or anchor does not exist."""
  text = path.read_text()
  broken = []
  for m in _LINK.finditer(prose(text)):
    target = m.group(1)
    if _SCHEME.match(target):
      continue
    file_part, _, anchor = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {target}"
    if not linked.exists():
      broken.append(f"{where} (no such file)")
    elif anchor and linked.suffix == ".md" and anchor not in anchors(
        linked.read_text()):
      broken.append(f"{where} (no such heading)")
  return broken


def test_every_relative_link_and_anchor_resolves():
  broken = [b for path in DOCUMENTS for b in broken_links(path)]
  assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_finds_a_missing_file_and_heading(tmp_path):
  (tmp_path / "a.md").write_text(
    "# Top\n\n## A `code` heading: with, punctuation\n\n## Top\n\n"
    "[ok](b.md#second-part) [ok](#a-code-heading-with-punctuation) "
    "[ok](#top-1) [ok](https://example.org/x.md)\n"
    "[gone](c.md) [no heading](b.md#third)\n"
    "`[in code](d.md)`\n\n```\n[in a block](e.md)\n```\n")
  (tmp_path / "b.md").write_text("# B\n\n## Second part\n\n```\n# third\n```\n")
  assert broken_links(tmp_path / "a.md") == [
    "a.md:8: c.md (no such file)", "a.md:8: b.md#third (no such heading)"]


def test_anchors_are_githubs():
  # Anchors the README linked before this check existed, written by hand.
  assert slug("The Llama-3.1-8B step on a TPU v5e: MFU and where the time "
              "goes") == ("the-llama-31-8b-step-on-a-tpu-v5e-mfu-and-where-"
                          "the-time-goes")
  assert slug("brown_s on the chip: the recipe, its sweep and its seeds") == (
    "brown_s-on-the-chip-the-recipe-its-sweep-and-its-seeds")
  assert anchors("# A\n## A\n## A\n") == {"a", "a-1", "a-2"}


def dev_verbs() -> set[str]:
  """Return the verbs `./dev help` lists (the usage atop the script)."""
  usage = (ROOT / "dev").read_text().split("\nset -euo", 1)[0]
  return set(re.findall(r"^#\s+\./dev ([a-z_-]+)", usage, re.MULTILINE))


def launchers() -> set[str]:
  """Return bin/'s launchers: its executable files without a suffix."""
  return {p.name for p in (ROOT / "bin").iterdir()
          if p.is_file() and not p.suffix and os.access(p, os.X_OK)}


def test_the_readmes_first_screen_names_every_verb_and_binary():
  readme = (ROOT / "README.md").read_text()
  first_screen = readme.split("\n## ", 1)[0]
  named = set(_VERB.findall(first_screen))
  assert {"train", "test", "harvest"} <= dev_verbs() and "train" in launchers()
  missing = (dev_verbs() | launchers()) - named
  assert not missing, (
    f"README.md's first screen names no `./dev {sorted(missing)}`: add each "
    "to its verb list (before the first `##` heading)")


def test_no_document_names_a_verb_dev_does_not_know():
  known = dev_verbs() | {"help"}
  unknown = [f"{path.name}: ./dev {verb}"
             for path in (*DOCUMENTS, ROOT / "WORKSPACE.md")
             for verb in _VERB.findall(path.read_text())
             if verb not in known]
  assert not unknown, "no such verb:\n" + "\n".join(unknown)
