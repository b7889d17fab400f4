"""Malformed lines of CTR sources: the error budget per file (`Budget`), their counts by
reason with the first lines quoted (`BadLines`), and the error that stops a conversion over
budget (`MalformedDataError`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

MAX_EXAMPLES = 10  # malformed lines quoted in reports


class MalformedDataError(ValueError):
  """Too many malformed lines in a source file."""


@dataclasses.dataclass(frozen=True)
class Budget:
  """Malformed lines tolerated per file: max(max_bad_lines, max_bad_fraction * lines read)."""

  max_bad_lines: int = 100
  max_bad_fraction: float = 0.0


class BadLines:
  """Counts malformed lines per file and enforces the error budget."""

  def __init__(self, budget: Budget, hint: str = ""):
    self.budget = budget
    self.hint = hint or "(--config.data.max_bad_lines / max_bad_fraction)"
    self.files: dict[str, dict[str, Any]] = {}

  def add(self, path: str, result: dict[str, Any], first_line: int, lines_read: int):
    """Record one task's malformed lines (`_work`'s result) and enforce the budget."""
    if result["bad"]:
      rec = self.files.setdefault(path, {"count": 0, "by_reason": {}, "examples": []})
      for _, reason in result["bad"]:
        rec["count"] += 1
        rec["by_reason"][reason] = rec["by_reason"].get(reason, 0) + 1
      for index, reason, text in result["examples"]:
        if len(rec["examples"]) < MAX_EXAMPLES:
          rec["examples"].append({"line": first_line + index, "reason": reason, "text": text})
    self.check(path, lines_read)

  def check(self, path: str, lines_read: int):
    rec = self.files.get(path)
    if not rec:
      return
    b = self.budget
    budget = max(b.max_bad_lines, int(b.max_bad_fraction * lines_read))
    if rec["count"] > budget:
      first = "; ".join(f"line {e['line']} ({e['reason']}): {e['text']!r}" for e in rec["examples"])
      raise MalformedDataError(
        f"{path}: {rec['count']} malformed lines in the first {lines_read} "
        f"({reasons(rec)}), over the budget of {budget}. First: {first}. "
        f"If the file is right, raise the budget: {self.hint}."
      )

  def recheck(self, files: dict[str, Any], paths: Sequence[str], file_rows: Sequence[int]):
    """Check a cached conversion's counts against this (maybe smaller) budget."""
    self.files = files
    for path, rows in zip(paths, file_rows):
      rec = files.get(os.path.abspath(path))
      if rec:
        self.check(os.path.abspath(path), rows + rec["count"])

  def total(self) -> int:
    return sum(r["count"] for r in self.files.values())


def reasons(rec) -> str:
  return ", ".join(f"{v} {k}" for k, v in sorted(rec["by_reason"].items()))
