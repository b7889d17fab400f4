"""The README stays a five-minute read and the documentation's references resolve: every
relative link in README.md and docs/ names an existing file (and heading, for `#anchor`), and
every benchmark script, tool and results file the pages name exists, so a figure can be traced
to the script and the file it came from."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# Paths named in the text (commands and code spans), relative to the repository root; a name in
# capitals (benchmarks/NAME.py) is a placeholder.
SCRIPT = re.compile(
  r"(?<![\w./-])((?:benchmarks|tools)/(?:[a-z_][\w-]*/)*[a-z_][\w-]*\.(?:py|sh|md))"
)
# Results files: `results/NAME.md` (relative to benchmarks/), `*` a glob.
RESULT = re.compile(r"(?<![\w.-])(?:benchmarks/)?results/([\w*./-]+\.(?:md|json|png))")


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """README.md, then docs/ (the pages the README indexes)."""
  return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def checked(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """The pages whose references must resolve: pages() and the benchmarks' own README / GPU.md."""
  extra = [root / "benchmarks" / n for n in ("README.md", "GPU.md")]
  return [*pages(root), *[p for p in extra if p.exists()]]


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces
  to `-`."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  out, fence = set(), False
  for line in path.read_text(encoding="utf-8").splitlines():
    if line.startswith("```"):
      fence = not fence
    elif not fence and (m := re.match(r"#{1,6} (.*)", line)):
      out.add(slug(m.group(1)))
  return out


def broken_references(root: pathlib.Path = ROOT) -> list[str]:
  """One line per link, script or results file that a checked page names and that does not
  exist."""
  bad = []
  for page in checked(root):
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(root)
    for target in LINK.findall(text):
      if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
        continue
      file, _, anchor = target.partition("#")
      dest = (page.parent / file).resolve() if file else page
      if not dest.exists():
        bad.append(f"{name}: link {target!r}: no file {dest.relative_to(root.resolve())}")
      elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        bad.append(f"{name}: link {target!r}: no heading #{anchor} in {file or name}")
    for path in set(SCRIPT.findall(text)):
      if not (root / path).exists():
        bad.append(f"{name}: names {path}, which does not exist")
    for res in set(RESULT.findall(text)):
      if not list((root / "benchmarks" / "results").glob(res)):
        bad.append(f"{name}: names results/{res}, which benchmarks/results/ does not hold")
  return bad


def test_readme_is_short():
  n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
  assert n <= README_MAX_LINES, (
    f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail into a docs/ page "
    "and link it"
  )


def test_every_docs_page_is_linked_from_the_readme():
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(text)}
  missing = [str(p.relative_to(ROOT)) for p in pages()[1:] if p.resolve() not in linked]
  assert not missing, f"docs pages the README's index does not link: {missing}"


def test_links_scripts_and_results_resolve():
  bad = broken_references()
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
  "page,want",
  [
    ("[a](missing.md)", "no file docs/missing.md"),
    ("[a](other.md#nowhere)", "no heading #nowhere"),
    ("`python benchmarks/nothing_here.py`", "names benchmarks/nothing_here.py"),
    ("(`results/nothing_here.md`)", "names results/nothing_here.md"),
  ],
)
def test_the_check_catches_a_broken_reference(tmp_path, page, want):
  """The checker itself: each kind of broken reference is reported; the good ones are not."""
  (tmp_path / "docs").mkdir()
  (tmp_path / "benchmarks" / "results").mkdir(parents=True)
  (tmp_path / "benchmarks" / "results" / "there.md").write_text("x\n")
  (tmp_path / "docs" / "other.md").write_text("# Other page: a, b\n\n## The host tier\n")
  good = "[o](other.md#the-host-tier) [p](other.md#other-page-a-b) `results/there.md`\n"
  (tmp_path / "docs" / "page.md").write_text(good + page + "\n")
  (tmp_path / "README.md").write_text("[p](docs/page.md)\n")
  found = broken_references(tmp_path)
  assert len(found) == 1 and want in found[0], found
