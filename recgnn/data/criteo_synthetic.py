"""Synthetic Criteo: TSV files in the exact Kaggle format, labels from a hidden planted model.

The embedded default dataset (real Criteo data cannot be redistributed). What it mimics:
  - the 26 Kaggle table cardinalities times `scale` (at least `min_rows` each);
  - Zipf-like id popularity: rank r of a table drawn with P(r) ~ (r + 1)^-zipf_exponent;
    the raw hex value of rank r is an odd-multiplier bijection of r (values look random);
  - Kaggle's missing-value rates per column (e.g. I12 76 %, C22 76 %, C19/C20 44 %) and
    long-tailed non-negative counts for I1..I13, I2 with small negatives;
  - a click rate near `ctr` (Kaggle: 0.256).

Labels: y ~ Bernoulli(sigmoid(logit)), with the hidden planted model
  logit = bias + s * (sum_t w_t[r_t]                          first order, per table
                      + sum_{(i, j) in pairs} <F_i[r_i], F_j[r_j]>  pairwise, rank `rank`
                      + sum_k beta_k * log(max(x_k, 0) + 1))         weak dense term
Every table has one factor matrix F_t shared by all its pairs: exactly the form DLRM's dot
interaction of per-table embeddings represents. Effects shrink with popularity rank,
amp(r) = (1 + r / head)^-effect_decay, so what matters sits in the Zipf head, seen often
enough to be learned from a few million rows; missing fields have no effect. The three parts
are scaled to the variance shares in `SyntheticConfig`, then `s` and `bias` are calibrated
on a held-out sample so the oracle AUC (the AUC of the true probabilities) is `target_auc` and
the mean click probability is `ctr`. The realised oracle AUC of the generated eval splits and the
per-row true probabilities are saved beside the TSV.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.special

from recgnn.data import criteo, file_check
from recgnn.data.ctr_auc import dense_only_baseline_auc, expected_auc, roc_auc  # noqa: F401
from recgnn.data.tsv_writer import format_tsv

# Kaggle's share of empty fields per column (approximate; from the public train.txt).
DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.76, 0.22)
SPARSE_MISSING = (
  0, 0, 0.03, 0.03, 0, 0.12, 0, 0, 0, 0.03, 0, 0.03, 0,
  0, 0, 0.03, 0, 0, 0.44, 0.44, 0.03, 0.76, 0, 0.03, 0.44, 0.44,
)  # fmt: skip
# log-normal (mu, sigma) of each dense column's counts, roughly Kaggle's spread.
DENSE_LOGNORMAL = (
  (0.5, 1.5), (2.0, 2.0), (2.0, 1.5), (1.5, 1.2), (7.5, 2.0), (4.0, 2.0), (1.5, 1.5),
  (2.5, 1.2), (3.5, 1.5), (0.0, 0.8), (1.0, 1.0), (0.0, 1.2), (1.5, 1.2),
)  # fmt: skip
_ROWS_PER_CHUNK = 1 << 18  # fixed: the rows drawn depend on the seed only, never on memory
_SIDE_JSON = ".synthetic.json"
_SIDE_PROBS = ".oracle.npy"
_GENERATOR_VERSION = 2  # bump when the same config would draw different data


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
  """What to generate.

  Attributes:
    num_rows: lines of the TSV.
    scale: factor on the Kaggle cardinalities.
    min_rows: smallest table.
    seed: everything drawn derives from it.
    zipf_exponent: id popularity P(rank r) ~ (r + 1)^-zipf_exponent.
    head, effect_decay: effects shrink with rank as amp(r) = (1 + r / head)^-effect_decay,
      so the ids that matter are the frequent ones (a learnable number of parameters).
    rank: width of the hidden per-table factors (<= 8).
    num_pairs: table pairs with a hidden interaction.
    first_order_share, pair_share, dense_share: variance shares of the logit's three parts.
    target_auc: oracle AUC the calibration aims at.
    ctr: mean click probability.
    calibration_rows: sample the calibration solves on (its error: ~1/sqrt of this).
  """

  num_rows: int = 4_000_000
  scale: float = 0.01
  min_rows: int = 4
  seed: int = 0
  zipf_exponent: float = 1.1
  head: float = 20.0
  effect_decay: float = 1.0
  rank: int = 4
  num_pairs: int = 16
  first_order_share: float = 0.45
  pair_share: float = 0.45
  dense_share: float = 0.10
  target_auc: float = 0.80
  ctr: float = 0.256
  calibration_rows: int = 200_000

  def __post_init__(self):
    if not 1 <= self.rank <= 8:
      raise ValueError(f"rank must be in [1, 8], got {self.rank}")
    if self.num_rows < criteo.KAGGLE_DAYS * 2:
      raise ValueError(f"num_rows must be >= {criteo.KAGGLE_DAYS * 2}, got {self.num_rows}")
    if not 0 <= self.num_pairs <= criteo.NUM_SPARSE * (criteo.NUM_SPARSE - 1) // 2:
      raise ValueError(f"num_pairs must be in [0, 325], got {self.num_pairs}")
    if not 0.5 < self.target_auc < 0.99:
      raise ValueError(f"target_auc must be in (0.5, 0.99), got {self.target_auc}")

  def cardinalities(self) -> tuple[int, ...]:
    """Rows of each table: the Kaggle counts times `scale`, at least `min_rows`."""
    return tuple(max(self.min_rows, round(c * self.scale)) for c in criteo.KAGGLE_CARDINALITIES)

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "version": _GENERATOR_VERSION}


# ----------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class PlantedModel:
  """The hidden model. Arrays are per table, indexed by popularity rank."""

  cards: tuple[int, ...]
  multipliers: np.ndarray  # uint32[26], odd: raw value = rank * m + offset (mod 2^32)
  offsets: np.ndarray  # uint32[26]
  first: list[np.ndarray]  # float32[card_t] per table
  factors: list[np.ndarray]  # float32[card_t, rank] per table
  pairs: np.ndarray  # int[P, 2] table pairs
  dense_beta: np.ndarray  # float64[13]
  scales: np.ndarray  # float64[3]: multipliers of the first-order, pair and dense parts
  bias: float = 0.0

  def parts(self, ranks: np.ndarray, missing: np.ndarray, dense_log: np.ndarray) -> np.ndarray:
    """Unscaled parts of the logit, float64[n, 3]. ranks: int[n, 26]; dense_log: [n, 13]."""
    n = ranks.shape[0]
    out = np.zeros((n, 3))
    present = ~missing
    for t in range(criteo.NUM_SPARSE):
      out[:, 0] += np.where(present[:, t], self.first[t][ranks[:, t]], 0.0)
    for i, j in self.pairs:
      fi = self.factors[i][ranks[:, i]] * present[:, i, None]
      fj = self.factors[j][ranks[:, j]] * present[:, j, None]
      out[:, 1] += np.einsum("nk,nk->n", fi, fj)
    out[:, 2] = np.einsum("nk,k->n", dense_log, self.dense_beta)  # no BLAS threads
    return out

  def logits(self, ranks, missing, dense_log) -> np.ndarray:
    return self.bias + np.einsum("np,p->n", self.parts(ranks, missing, dense_log), self.scales)


def _amp(card: int, head: float, decay: float) -> np.ndarray:
  return (1.0 + np.arange(card) / head) ** -decay


def _draw_model(cfg: SyntheticConfig) -> PlantedModel:
  rng = np.random.default_rng([cfg.seed, 0])
  cards = cfg.cardinalities()
  first, factors = [], []
  for c in cards:
    amp = _amp(c, cfg.head, cfg.effect_decay)
    first.append((rng.uniform(0.3, 1.0) * amp * rng.standard_normal(c)).astype(np.float32))
    f = rng.standard_normal((c, cfg.rank)) * (amp / np.sqrt(cfg.rank))[:, None]
    factors.append(f.astype(np.float32))
  all_pairs = np.array(
    [(i, j) for i in range(criteo.NUM_SPARSE) for j in range(i + 1, criteo.NUM_SPARSE)]
  )
  pairs = all_pairs[np.sort(rng.choice(len(all_pairs), cfg.num_pairs, replace=False))]
  beta = rng.standard_normal(criteo.NUM_DENSE) * (rng.random(criteo.NUM_DENSE) < 0.5)
  multipliers = (rng.integers(0, 2**31, criteo.NUM_SPARSE, dtype=np.uint64) * 2 + 1).astype(
    np.uint32
  )
  offsets = rng.integers(0, 2**32, criteo.NUM_SPARSE, dtype=np.uint64).astype(np.uint32)
  return PlantedModel(
    cards=cards,
    multipliers=multipliers,
    offsets=offsets,
    first=first,
    factors=factors,
    pairs=pairs,
    dense_beta=beta,
    scales=np.ones(3),
  )


def _draw_rows(cfg: SyntheticConfig, model: PlantedModel, rng: np.random.Generator, n: int):
  """Features of n rows: (ranks int64[n, 26], missing bool[n, 26], dense int64[n, 13],
  dense_missing bool[n, 13])."""
  a = cfg.zipf_exponent
  u = rng.random((n, criteo.NUM_SPARSE))
  ranks = np.empty((n, criteo.NUM_SPARSE), np.int64)
  for t, c in enumerate(model.cards):
    # Inverse CDF of the continuous power law x^-a on [1, c + 1), floored: Zipf-like ranks.
    hi = (c + 1.0) ** (1.0 - a)
    x = (1.0 + u[:, t] * (hi - 1.0)) ** (1.0 / (1.0 - a))
    ranks[:, t] = np.minimum(x.astype(np.int64) - 1, c - 1)
  missing = rng.random((n, criteo.NUM_SPARSE)) < np.asarray(SPARSE_MISSING)
  mu, sigma = np.asarray(DENSE_LOGNORMAL).T
  dense = np.floor(np.exp(mu + sigma * rng.standard_normal((n, criteo.NUM_DENSE))))
  dense = np.minimum(dense, 10**9 - 1).astype(np.int64)
  dense[:, 1] -= 3  # I2 has small negatives in Kaggle
  dense_missing = rng.random((n, criteo.NUM_DENSE)) < np.asarray(DENSE_MISSING)
  return ranks, missing, dense, dense_missing


def _dense_log(dense: np.ndarray, dense_missing: np.ndarray) -> np.ndarray:
  """What the reader makes of the dense fields: log(max(x, 0) + 1), empty -> 0."""
  return np.where(dense_missing, 0.0, np.log1p(np.maximum(dense, 0).astype(np.float32)))


def _calibrate(cfg: SyntheticConfig, model: PlantedModel) -> PlantedModel:
  """Scale the parts to their variance shares, then solve the global scale for `target_auc`
  and the bias for `ctr`, on a sample drawn apart from the rows."""
  rng = np.random.default_rng([cfg.seed, 1])
  ranks, missing, dense, dmiss = _draw_rows(cfg, model, rng, cfg.calibration_rows)
  parts = model.parts(ranks, missing, _dense_log(dense, dmiss))
  shares = np.array([cfg.first_order_share, cfg.pair_share, cfg.dense_share])
  unit = np.sqrt(shares / np.maximum(parts.var(axis=0), 1e-12))
  base = np.einsum("np,p->n", parts, unit)
  # The AUC of a score does not change under increasing maps: sort once for every s.
  base = np.sort(base)

  def bias_for(s):
    b = 0.0
    for _ in range(30):  # Newton on mean(sigmoid(b + s * base)) = ctr
      p = scipy.special.expit(b + s * base)
      step = (p.mean() - cfg.ctr) / max(np.mean(p * (1 - p)), 1e-9)
      b -= step
      if abs(step) < 1e-9:
        break
    return b

  lo, hi = 0.01, 20.0
  for _ in range(30):
    s = 0.5 * (lo + hi)
    auc = expected_auc(scipy.special.expit(bias_for(s) + s * base), presorted=True)
    lo, hi = (s, hi) if auc < cfg.target_auc else (lo, s)
  s = 0.5 * (lo + hi)
  return dataclasses.replace(model, scales=s * unit, bias=bias_for(s))


def _raw_values(model: PlantedModel, ranks: np.ndarray) -> np.ndarray:
  r = ranks.astype(np.uint64)
  v = (r * model.multipliers.astype(np.uint64) + model.offsets.astype(np.uint64)) & np.uint64(
    0xFFFFFFFF
  )
  return v.astype(np.uint32)


def generate_tsv(
  path: str,
  cfg: SyntheticConfig,
  progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
  """Write `cfg.num_rows` lines to `path`, the true click probabilities to
  `path + '.oracle.npy'` (float32[N]) and the description to `path + '.synthetic.json'`.

  Deterministic given `cfg`. Returns the description (config, calibration, oracle AUCs of the
  Kaggle-split test and valid rows, cardinalities).
  """
  t0 = time.perf_counter()
  model = _calibrate(cfg, _draw_model(cfg))
  probs = np.lib.format.open_memmap(path + _SIDE_PROBS + ".tmp", "w+", np.float32, (cfg.num_rows,))
  all_labels = np.empty(cfg.num_rows, np.int8)
  with open(path + ".tmp", "wb") as f:
    for c, lo in enumerate(range(0, cfg.num_rows, _ROWS_PER_CHUNK)):
      n = min(_ROWS_PER_CHUNK, cfg.num_rows - lo)
      rng = np.random.default_rng([cfg.seed, 2, c])
      ranks, missing, dense, dmiss = _draw_rows(cfg, model, rng, n)
      p = scipy.special.expit(model.logits(ranks, missing, _dense_log(dense, dmiss)))
      labels = (rng.random(n) < p).astype(np.int8)
      all_labels[lo : lo + n] = labels
      probs[lo : lo + n] = p
      f.write(format_tsv(labels, dense, dmiss, _raw_values(model, ranks), missing))
  probs.flush()
  splits = criteo.kaggle_split(cfg.num_rows)
  oracle = {}
  for name in ("test", "valid"):
    lo, hi = splits[name]
    oracle[name] = roc_auc(np.asarray(probs[lo:hi]), all_labels[lo:hi])
  info = {
    "config": cfg.to_json(),
    "cardinalities": list(cfg.cardinalities()),
    "num_rows": cfg.num_rows,
    "positives": int(all_labels.sum(dtype=np.int64)),
    "oracle_auc": oracle,
    "calibration": {
      "bias": model.bias,
      "scales": model.scales.tolist(),
      "pairs": model.pairs.tolist(),
      "dense_beta": model.dense_beta.tolist(),
    },
    "generation_seconds": time.perf_counter() - t0,
  }
  del probs
  os.replace(path + _SIDE_PROBS + ".tmp", path + _SIDE_PROBS)
  os.replace(path + ".tmp", path)
  # Written last, with the files' sizes and head checksums: a description whose files do not
  # match (truncated, half-written) makes `default_synthetic_dataset` generate them again.
  info["files"] = file_check.file_records(os.path.dirname(path) or ".", _side_files(path))
  file_check.write_manifest(path + _SIDE_JSON, info)
  if progress is not None:
    progress(
      f"criteo synthetic: wrote {cfg.num_rows:,} rows to {path} in "
      f"{info['generation_seconds']:.1f} s; oracle AUC test {oracle['test']:.4f}, "
      f"valid {oracle['valid']:.4f}"
    )
  return info


def _side_files(path: str) -> list[str]:
  """The generated files whose sizes and checksums the description records (beside it)."""
  name = os.path.basename(path)
  return [name, name + _SIDE_PROBS]


def load_info(path: str) -> dict[str, Any] | None:
  """The description written beside a generated TSV, or None."""
  return file_check.read_manifest(path + _SIDE_JSON)


def files_problem(path: str, info: dict[str, Any] | None) -> str | None:
  """None if the generated TSV and its probabilities are what `info` records, else what
  differs (naming the file)."""
  if info is None:
    return f"{path + _SIDE_JSON} is missing or unreadable"
  return file_check.check_files(os.path.dirname(path) or ".", info, _side_files(path))


def oracle_probabilities(path: str) -> np.ndarray:
  """True click probability of every line of a generated TSV, float32[N] (memmap); refused
  when the file is not the one its description records."""
  bad = files_problem(path, load_info(path))
  if bad is not None:
    raise ValueError(
      f"synthetic data {path} is damaged: {bad}. Delete {os.path.dirname(path) or '.'} and "
      "open it again (default_synthetic_dataset generates it anew)."
    )
  return np.load(path + _SIDE_PROBS, mmap_mode="r")


# ----------------------------------------------------------------------------- default


@dataclasses.dataclass(frozen=True)
class SyntheticDataset:
  """The embedded default: the converted dataset and what the hidden model says about it.

  Attributes:
    dataset: the converted data (Kaggle split).
    tsv_path: the generated TSV.
    info: the generator's description (config, cardinalities, calibration).
    oracle_auc: {"test": AUC, "valid": AUC} of the true probabilities.
  """

  dataset: criteo.CriteoDataset
  tsv_path: str
  info: dict[str, Any]
  oracle_auc: dict[str, float]

  def oracle_probabilities(self) -> np.ndarray:
    return oracle_probabilities(self.tsv_path)

  def describe(self) -> str:
    c = self.info["config"]
    return (
      f"synthetic Criteo-format data, {c['num_rows']:,} rows, cardinality scale {c['scale']}, "
      f"seed {c['seed']}; oracle AUC test {self.oracle_auc['test']:.4f}"
    )


def default_synthetic_dataset(
  cache_dir: str,
  *,
  num_rows: int = SyntheticConfig.num_rows,
  scale: float = SyntheticConfig.scale,
  seed: int = 0,
  config: SyntheticConfig | None = None,
  reader: criteo.ReaderConfig | None = None,
  progress: Callable[[str], None] | None = print,
) -> SyntheticDataset:
  """Generate (once) the synthetic TSV under `cache_dir` and open it through the reader.

  `config` overrides num_rows / scale / seed. The TSV lives in a directory named after the
  config's hash, so different configs never collide and a finished one is reused.
  """
  cfg = config or SyntheticConfig(num_rows=num_rows, scale=scale, seed=seed)
  digest = hashlib.sha1(json.dumps(cfg.to_json(), sort_keys=True).encode()).hexdigest()[:12]
  root = os.path.join(cache_dir, f"synthetic-{digest}")
  os.makedirs(root, exist_ok=True)
  tsv = os.path.join(root, "train.txt")
  info = load_info(tsv)
  why = "not generated yet" if info is None else None
  if why is None and info.get("config") != cfg.to_json():
    why = "another config"
  if why is None:
    why = files_problem(tsv, info)  # a damaged file is generated again, never read
  if why is not None:
    if progress is not None and info is not None:
      progress(f"criteo synthetic: generating {tsv} again ({why})")
    info = generate_tsv(tsv, cfg, progress)
  dataset = criteo.open_criteo(tsv, cache_dir, reader=reader, split="kaggle", progress=progress)
  return SyntheticDataset(dataset=dataset, tsv_path=tsv, info=info, oracle_auc=info["oracle_auc"])
