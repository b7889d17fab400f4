"""Results files: every benchmark writes benchmarks/results/<name>.json (the raw numbers, its
arguments and the machine record), <name>.md (the table it prints) and, where it plots,
<name>.png.

  record(args)                      a payload's start: argv, args, machine (load at start)
  write_results(name, payload, md)  the JSON and the markdown (the load at the end added)
  md_table(header, rows)            a markdown table
  png(path, ncols)                  a matplotlib figure (Agg) saved when the block ends
  can_plot()                        whether matplotlib is installed
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from .machine import machine_info

#: Where results go: benchmarks/results/, or $RECGNN_BENCH_RESULTS (a test's run of a
#: benchmark's --quick form writes there, leaving the checked-in results alone).
RESULTS_VAR = "RECGNN_BENCH_RESULTS"
RESULTS = pathlib.Path(
  os.environ.get(RESULTS_VAR) or pathlib.Path(__file__).resolve().parents[1] / "results"
)


def record(args=None, argv: Sequence[str] | None = None) -> dict:
  """The start of a results payload: the command line's arguments (`argv`, default
  sys.argv[1:]), the parsed `args` (an argparse Namespace or a dict) and the machine record
  (machine_info: load average at the start). Take it before measuring."""
  if args is not None and not isinstance(args, dict):
    args = vars(args)
  return {
    "argv": list(sys.argv[1:] if argv is None else argv),
    "args": dict(args or {}),
    "machine": machine_info(),
  }


def write_results(
  name: str,
  payload: dict,
  markdown: str,
  out_dir: pathlib.Path = RESULTS,
  sort_keys=False,
  show: bool = True,
) -> pathlib.Path:
  """results/<name>.json (payload; a value JSON cannot hold as its str) and results/<name>.md
  (markdown); prints the markdown unless `show` is False. A payload with a machine record gets
  the load average at the end beside the one at the start. Returns the path without suffix."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  machine = payload.get("machine")
  if isinstance(machine, dict) and "load_avg_at_start" in machine:
    machine.setdefault("load_avg_at_end", os.getloadavg())
  text = json.dumps(payload, indent=2, sort_keys=sort_keys, default=str)
  (out_dir / f"{name}.json").write_text(text + "\n")
  (out_dir / f"{name}.md").write_text(markdown)
  if show:
    print(markdown)
  print(f"wrote {out_dir / name}.json and .md")
  return out_dir / name


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
  """A markdown table: `header` cells, one row per item of `rows` (cells str()-ed). `align`
  one character per column (l / r / c); default: first column left, the others right."""
  align = align or "l" + "r" * (len(header) - 1)
  rule = {"l": "---", "r": "---:", "c": ":---:"}
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def can_plot() -> bool:
  """Whether matplotlib is installed (the peers' venv may lack it); says so when not."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print("matplotlib not installed: no PNG (pip install matplotlib)")
    return False
  return True


@contextlib.contextmanager
def png(path, ncols: int = 1, nrows: int = 1, figsize=(10, 4), dpi: int = 120):
  """with png(path, ncols=2) as (fig, axes): draw; the figure is laid out, saved to `path`
  and closed when the block ends (matplotlib's Agg backend: no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(nrows, ncols, figsize=figsize)
  try:
    yield fig, axes
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}")
  finally:
    plt.close(fig)
