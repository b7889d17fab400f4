"""The library's prose says what the code does, not its history: no docstring or comment in
recgnn/ cites an issue number (the why goes in words; a measurement behind a choice goes in
docs/ with its date and command). Reads the files only: no jax import."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
ISSUE = re.compile(r"\bissue \d+", re.IGNORECASE)
#: Files allowed to cite an issue for a while (another branch is editing them): an entry whose
#: file cites none fails the test, so the list cannot outlive its files.
ISSUE_MENTIONS_FOR_NOW: frozenset[str] = frozenset(
  {
    "recgnn/train/loop.py",
  }
)


def issue_mentions(root: pathlib.Path = ROOT / "recgnn") -> list[str]:
  """'path:line: text' of every line under `root` that cites an issue number (path relative
  to root's parent)."""
  hits = []
  for path in sorted(root.rglob("*")):
    if not path.is_file() or path.suffix not in {".py", ".md", ".json", ".txt", ".toml"}:
      continue
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
      if ISSUE.search(line):
        hits.append(f"{path.relative_to(root.parent).as_posix()}:{i}: {line.strip()}")
  return hits


def test_no_issue_numbers_in_recgnn():
  hits = issue_mentions()
  new = [h for h in hits if h.split(":", 1)[0] not in ISSUE_MENTIONS_FOR_NOW]
  assert not new, "say what the code does, not which issue made it so:\n" + "\n".join(new)
  stale = ISSUE_MENTIONS_FOR_NOW - {h.split(":", 1)[0] for h in hits}
  assert not stale, f"cite no issue now: drop them from ISSUE_MENTIONS_FOR_NOW: {sorted(stale)}"


def test_the_check_finds_an_issue_number(tmp_path):
  (tmp_path / "m.py").write_text('"""Fine."""\nx = 1  # since Issue 42\ny = 2  # issues 3\n')
  assert [h.split(": ", 1)[1] for h in issue_mentions(tmp_path)] == ["x = 1  # since Issue 42"]
