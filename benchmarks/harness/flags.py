"""The flags benchmarks share, so that the same option has one name, default and help text
everywhere.

  parser(doc)             an ArgumentParser whose --help prints the benchmark's docstring
  add_output(p, name)     --name (results file), --quick (a smoke run at small sizes)
  add_rounds(p, ...)      --warmup, --steps, --rounds: interleaved rounds of timed steps
  add_dlrm(p, ...)        --batch, --tables, --rows, --dim, --zipf: the DLRM step's sizes
  add_against(p)          --against=COMMIT: the same measurement of COMMIT's tree, interleaved
"""

from __future__ import annotations

import argparse


def parser(doc: str) -> argparse.ArgumentParser:
  """The benchmark's parser; --help shows its module docstring (question, command, results
  file) as written."""
  return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)


def add_output(p: argparse.ArgumentParser, name: str) -> None:
  p.add_argument("--quick", action="store_true", help="a smoke run at small sizes")
  p.add_argument(
    "--name", default=None, help=f"results file name in benchmarks/results/ (default {name})"
  )


def add_rounds(
  p: argparse.ArgumentParser, *, warmup: int, steps: int, rounds: int, steps_help: str = ""
) -> None:
  p.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
  p.add_argument("--steps", type=int, default=steps, help=steps_help or "timed steps per round")
  p.add_argument(
    "--rounds", type=int, default=rounds, help="interleaved rounds (each contestant once each)"
  )


def add_dlrm(
  p: argparse.ArgumentParser,
  *,
  batch: int = 2048,
  tables: int = 26,
  rows: int | str = 100_000,
  dim: int | None = 16,
  zipf: float = 1.05,
) -> None:
  """The DLRM step's sizes (Kaggle's model: 26 tables of dim 16, batch 2048). `rows` a str:
  a comma-separated list of sizes; `dim` None: no --dim (the benchmark fixes it)."""
  p.add_argument("--batch", type=int, default=batch)
  p.add_argument("--tables", type=int, default=tables)
  if isinstance(rows, str):
    p.add_argument("--rows", default=rows, help="table sizes (rows per table), comma-separated")
  else:
    p.add_argument("--rows", type=int, default=rows, help="rows per table")
  if dim is not None:
    p.add_argument("--dim", type=int, default=dim)
  p.add_argument("--zipf", type=float, default=zipf, help="Zipf exponent of the ids")


def add_against(p: argparse.ArgumentParser, what: str = "") -> None:
  p.add_argument(
    "--against",
    default="",
    metavar="COMMIT",
    help="also measure COMMIT's tree (its `git archive`), interleaved with this one"
    + (f": {what}" if what else ""),
  )
