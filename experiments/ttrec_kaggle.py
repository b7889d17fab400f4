"""TT-Rec on Criteo Kaggle: tensor-train cores (`tt`) for the 7 largest tables, dense elsewhere.

dlrm_kaggle's config with one change, the embedding plan (as in TT-Rec, Yin et al. MLSys'21:
TT on the 7 largest tables of the real Kaggle data, C3 C4 C12 C16 C21 C24 C26; the synthetic
default scales every table alike, so the same names are the largest there too):

  python run.py --experiment=ttrec_kaggle                       # synthetic default
  python run.py --experiment=ttrec_kaggle:rank=16,cache_rows=10000
  python run.py --experiment=ttrec_kaggle --config.data.path=/data/criteo/train.txt

The argument after ':' holds `tt(...)` options (see recgnn/backends/tt/__init__.py) plus `tables=K`
(how many of the largest tables get TT). get_config prints the embedding float count and the
compression against the all-dense model for the real Kaggle cardinalities (computed from the
specs, nothing allocated) and for the synthetic default's tables; the trainer's plan table
shows the tables actually trained.
"""

from __future__ import annotations

from experiments import _options, dlrm_kaggle
from recgnn import planner
from recgnn.embeddings import base

KAGGLE_CARDINALITIES = dlrm_kaggle.KAGGLE_CARDINALITIES
DEFAULTS = {"rank": 32, "tables": 7}


def table_names(n: int = 26) -> list[str]:
  return [f"C{i + 1}" for i in range(n)]


def largest(cardinalities, k: int) -> list[str]:
  """Names of the k largest tables (ties: the earlier table)."""
  names = table_names(len(cardinalities))
  order = sorted(range(len(cardinalities)), key=lambda i: (-cardinalities[i], i))
  return [names[i] for i in sorted(order[:k])]


def tt_text(options: dict) -> str:
  opts = {k: v for k, v in options.items() if k != "tables"}
  return "tt(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"


def make_plan(options: dict, cardinalities=KAGGLE_CARDINALITIES) -> list[tuple[str, str]]:
  """[(regex of the largest tables, 'tt(...)'), ('.*', 'dense')]."""
  chosen = largest(cardinalities, options["tables"])
  rules = [(".*", "dense")]
  if chosen:
    rules.insert(0, (f"C({'|'.join(n[1:] for n in chosen)})", tt_text(options)))
  return rules


def compression_report(cardinalities, plan, dim: int = 16) -> dict:
  """Embedding floats of a plan against all-dense, from the specs (nothing allocated).

  Counts what represents the tables (TT cores, dense rows); optimizer state excluded.
  """
  specs = [
    base.TableSpec(name=n, num_rows=int(c), dim=dim)
    for n, c in zip(table_names(len(cardinalities)), cardinalities)
  ]
  resolved = planner.resolve_plan(plan, specs, log=False)
  per_table = {}
  for n, spec in resolved.specs.items():
    g = resolved.backend_of(n)
    per_table[n] = {"rows": spec.num_rows, "backend": g.describe(n), "floats": g.num_params()[n]}
  dense_floats = sum(s.num_rows * s.dim for s in resolved.specs.values())
  tt_names = [n for n in per_table if resolved.backend_of(n).name == "tt"]
  tt_floats = sum(per_table[n]["floats"] for n in tt_names)
  tt_dense = sum(per_table[n]["rows"] * dim for n in tt_names)
  total = sum(t["floats"] for t in per_table.values())
  return {
    "tables": per_table,
    "tt_params": tt_floats,
    "dense_params": total - tt_floats,
    "total_params": total,
    "all_dense_params": dense_floats,
    "ratio": dense_floats / total,
    "tt_tables_ratio": tt_dense / max(tt_floats, 1),
  }


def format_report(title: str, rep: dict) -> str:
  return (
    f"{title}: {rep['total_params']:,} embedding floats ({rep['tt_params']:,} in TT cores, "
    f"{rep['dense_params']:,} in dense tables) vs {rep['all_dense_params']:,} all-dense: "
    f"{rep['ratio']:.1f}x smaller (TT tables alone {rep['tt_tables_ratio']:.0f}x)"
  )


def parse_arg(arg: str | None) -> dict:
  """'rank=16,cache_rows=10000' -> DEFAULTS updated (values are Python literals or words)."""
  options = _options.parse(
    arg, DEFAULTS, name="ttrec_kaggle", rest=True, usage="tables=K and tt(...)'s options"
  )
  if not isinstance(options["tables"], int) or not 0 <= options["tables"] <= 26:
    raise ValueError(f"ttrec_kaggle: tables must be an int in [0, 26], got {options['tables']!r}")
  return options


def get_config(arg=None):
  options = parse_arg(arg)
  c = dlrm_kaggle.get_config()
  c.embeddings.plan = tuple(make_plan(options))  # a tuple: overridable from the CLI
  # Fail now, not after the data is loaded, on a bad tt option.
  planner.make_backend(c.embeddings.plan[0][1], base.TableSpec(name="C3", num_rows=1000, dim=16))
  dim = c.embeddings.dim
  kaggle = compression_report(KAGGLE_CARDINALITIES, c.embeddings.plan, dim)
  print(format_report("Kaggle (real cardinalities)", kaggle))
  synthetic = compression_report(_synthetic_sizes(c), c.embeddings.plan, dim)
  scale = c.data.synthetic.scale
  print(format_report(f"Synthetic default (Kaggle x {scale}, ids it can draw)", synthetic))
  return c


def _synthetic_sizes(c):
  """Table sizes the synthetic generator draws ids from (the reader may drop unseen ids)."""
  from recgnn.data import criteo_synthetic

  cfg = criteo_synthetic.SyntheticConfig(
    num_rows=c.data.synthetic.rows, scale=c.data.synthetic.scale, seed=c.data.synthetic.seed
  )
  sizes = cfg.cardinalities
  return tuple(sizes() if callable(sizes) else sizes)
