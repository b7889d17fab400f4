"""Knowledge graphs as (head, relation, tail) triples: reader, vocabularies, filter index.

Files: one triple per line, `head<TAB>relation<TAB>tail`, plain or gzip (by magic bytes, not
by name), `\\n` or `\\r\\n` line ends; blank lines are skipped. A folder holds `train.txt`,
`valid.txt` and `test.txt` (each optionally `.gz`). With no path, the bundled FB15k-237
(Toutanova & Chen 2015; the ConvE release, third_party/fb15k-237, MIT licence beside it).

Malformed lines (not UTF-8, or not exactly three non-empty tab-separated fields) are counted
per file and reported with their line numbers, as the Criteo reader does; past
`max_bad_lines` the load stops with an error naming the file. Valid / test triples whose
entity or relation never occurs in train cannot be embedded: they are dropped and counted
(`KG.unseen`).

Ids: entities and relations are numbered in order of first appearance in train (then valid,
test), so ids are a function of the files alone. With `reciprocal=True` every relation r gets
an inverse r + R and every triple (h, r, t) the reciprocal (t, r + R, h): a head query
(?, r, t) becomes the tail query (t, r + R, ?) (Lacroix et al. 2018; Dettmers et al. 2018).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import zlib

import numpy as np

BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "third_party", "fb15k-237")
SPLITS = ("train", "valid", "test")
_MAX_EXAMPLES = 5


class MalformedDataError(ValueError):
  """Too many malformed lines in a triples file."""


@dataclasses.dataclass
class BadLines:
  """Malformed lines of one file: the count and the first few (line number, text)."""

  path: str
  count: int = 0
  examples: list[tuple[int, str]] = dataclasses.field(default_factory=list)

  def describe(self) -> str:
    first = "; ".join(f"line {n}: {t!r}" for n, t in self.examples)
    return f"{self.path}: {self.count} malformed lines (first: {first})"


def _read_lines(path: str) -> list[bytes]:
  """The file's lines (plain or gzip by magic bytes), split on b"\\n" only."""
  with open(path, "rb") as f:
    magic = f.read(2)
  try:
    if magic == b"\x1f\x8b":
      with gzip.open(path, "rb") as f:
        data = f.read()
    else:
      with open(path, "rb") as f:
        data = f.read()
  except (OSError, EOFError, zlib.error) as e:  # a truncated / damaged gzip stream
    raise MalformedDataError(
      f"{os.path.abspath(path)}: not a readable gzip file ({type(e).__name__}: {e})"
    ) from None
  lines = data.split(b"\n")
  if lines and lines[-1] == b"":
    lines.pop()
  return lines


def read_triples(
  path: str, max_bad_lines: int = 100
) -> tuple[list[tuple[str, str, str]], BadLines]:
  """The string triples of one file and its malformed-line report.

  A line is malformed when it is not UTF-8 or not three non-empty (after str.strip)
  tab-separated fields; lines that are only whitespace are skipped, uncounted.
  Raises MalformedDataError past `max_bad_lines` malformed lines, naming the first ones,
  or for a damaged gzip stream.
  """
  triples: list[tuple[str, str, str]] = []
  bad = BadLines(os.path.abspath(path))
  for number, raw in enumerate(_read_lines(path), start=1):
    try:
      line = raw.decode("utf-8").removesuffix("\r")
    except UnicodeDecodeError:
      line, parts = raw.decode("utf-8", "replace"), []
    else:
      if not line.strip():
        continue
      parts = line.split("\t")
    if len(parts) != 3 or not all(p.strip() for p in parts):
      bad.count += 1
      if len(bad.examples) < _MAX_EXAMPLES:
        bad.examples.append((number, line[:200]))
      if bad.count > max_bad_lines:
        raise MalformedDataError(
          f"{bad.describe()}: over the budget of {max_bad_lines}. Lines must be "
          "head<TAB>relation<TAB>tail in UTF-8. If the file is right, raise "
          "--config.data.max_bad_lines."
        )
      continue
    triples.append((parts[0].strip(), parts[1].strip(), parts[2].strip()))
  return triples, bad


def find_split_file(folder: str, split: str) -> str:
  for name in (f"{split}.txt", f"{split}.txt.gz", f"{split}.tsv", f"{split}.tsv.gz", split):
    p = os.path.join(folder, name)
    if os.path.isfile(p):
      return p
  raise FileNotFoundError(
    f"No {split} file in {folder}: expected {split}.txt or {split}.txt.gz "
    "(head<TAB>relation<TAB>tail per line)"
  )


@dataclasses.dataclass
class KG:
  """A knowledge graph with integer ids.

  Attributes:
    name: for logs.
    entities / relations: vocabularies; id = position. `relations` lists the R original
      relations only; with `reciprocal`, id r + R is the inverse of r.
    splits: {'train' | 'valid' | 'test': int32[n, 3]} (head, relation, tail), ORIGINAL
      relations only (reciprocals are added where used: `training_triples`, `queries`).
    reciprocal: whether inverse relations exist (num_relations counts them).
    bad_lines: malformed-line reports of the files that had any.
    unseen: valid / test triples dropped because their relation is not in train.
  """

  name: str
  entities: list[str]
  relations: list[str]
  splits: dict[str, np.ndarray]
  reciprocal: bool = True
  bad_lines: list[BadLines] = dataclasses.field(default_factory=list)
  unseen: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def num_entities(self) -> int:
    return len(self.entities)

  @property
  def num_base_relations(self) -> int:
    return len(self.relations)

  @property
  def num_relations(self) -> int:
    return len(self.relations) * (2 if self.reciprocal else 1)

  def training_triples(self) -> np.ndarray:
    """int32[n, 3] train triples, with their reciprocals appended when `reciprocal`."""
    t = self.splits["train"]
    return np.concatenate([t, self.inverse(t)]) if self.reciprocal else t

  def inverse(self, triples: np.ndarray) -> np.ndarray:
    """(h, r, t) -> (t, r + R, h)."""
    R = self.num_base_relations
    return np.stack([triples[:, 2], triples[:, 1] + R, triples[:, 0]], axis=1).astype(np.int32)

  def describe(self) -> str:
    n = {s: len(v) for s, v in self.splits.items()}
    lines = [
      f"{self.name}: {self.num_entities:,} entities, {self.num_base_relations} relations"
      f"{' (+ reciprocals)' if self.reciprocal else ''}, triples train {n['train']:,} "
      f"valid {n['valid']:,} test {n['test']:,}"
    ]
    for b in self.bad_lines:
      lines.append("  skipped " + b.describe())
    for s, k in self.unseen.items():
      if k:
        lines.append(f"  dropped {k} {s} triples with a relation not in train")
    return "\n".join(lines)


def load(
  path: str | None = None,
  *,
  reciprocal: bool = True,
  max_bad_lines: int = 100,
  name: str | None = None,
) -> KG:
  """The KG in folder `path` (train / valid / test files), the bundled FB15k-237 if None."""
  folder = path or BUNDLED
  if not os.path.isdir(folder):
    raise FileNotFoundError(
      f"{folder} is not a folder; --config.data.path must name a folder holding "
      "train.txt, valid.txt and test.txt (gzip allowed)"
    )
  raw, bad = {}, []
  for s in SPLITS:
    raw[s], b = read_triples(find_split_file(folder, s), max_bad_lines)
    if b.count:
      bad.append(b)
  ent: dict[str, int] = {}
  rel: dict[str, int] = {}
  # Entities of every split get a row (published FB15k-237 figures rank against all 14,541,
  # and score the test triples whose entity never occurs in train); relations come from train.
  for s in SPLITS:
    for h, r, t in raw[s]:
      ent.setdefault(h, len(ent))
      if s == "train":
        rel.setdefault(r, len(rel))
      ent.setdefault(t, len(ent))
  splits, unseen = {}, {}
  for s in SPLITS:
    rows = [(ent.get(h, -1), rel.get(r, -1), ent.get(t, -1)) for h, r, t in raw[s]]
    arr = np.asarray(rows, np.int64).reshape(-1, 3)
    keep = (arr >= 0).all(axis=1)
    unseen[s] = int((~keep).sum())
    splits[s] = arr[keep].astype(np.int32)
  if not len(splits["train"]):
    raise ValueError(f"{folder}: no training triples")
  default = "fb15k-237" if path is None else os.path.basename(os.path.normpath(folder))
  return KG(
    name=name or default,
    entities=list(ent),
    relations=list(rel),
    splits=splits,
    reciprocal=reciprocal,
    bad_lines=bad,
    unseen=unseen,
  )


def from_triples(
  triples: dict[str, np.ndarray], num_entities: int, num_relations: int, *, reciprocal=True
) -> KG:
  """A KG from integer triples (tests, synthetic graphs)."""
  return KG(
    name="triples",
    entities=[str(i) for i in range(num_entities)],
    relations=[str(i) for i in range(num_relations)],
    splits={s: np.asarray(triples[s], np.int32).reshape(-1, 3) for s in SPLITS},
    reciprocal=reciprocal,
  )


def planted(
  *,
  communities: int = 8,
  bits: int = 10,
  num_relations: int = 16,
  valid: float = 0.05,
  test: float = 0.05,
  cross: float = 0.002,
  reciprocal: bool = True,
  seed: int = 0,
) -> KG:
  """A synthetic KG with planted communities: METIS finds them, and a partition's 1-hop halo
  is a small part of the graph (FB15k-237's hubs put ~every entity in every halo).

  Each of `communities` communities is a hypercube of 2^bits entities (ids shuffled, so
  nothing shows in the ids): relation r links position x to x XOR m_r (m_r a random non-zero
  mask), in the same community, or with probability `cross` in another one chosen at random.
  XOR is an involution, so the facts are symmetric, and DistMult represents them exactly
  (entity = its position's bits as +-1, relation = its mask as +-1): every query has one
  answer and the best filtered MRR is 1, learnable from the hypercube's structure alone.
  Every (entity, relation) fact is drawn once and its reverse dropped; `valid` / `test` are
  fractions of the facts held out (their entities and relations all occur in train).
  """
  rng = np.random.default_rng(seed)
  size = 1 << bits
  num_entities = communities * size
  perm = rng.permutation(num_entities)  # position -> entity id
  masks = rng.choice(np.arange(1, size), num_relations, replace=False)
  pos = np.repeat(np.arange(num_entities), num_relations)
  r = np.tile(np.arange(num_relations), num_entities)
  comm, x = pos // size, pos % size
  other = (comm + rng.integers(1, max(communities, 2), pos.size)) % communities
  tcomm = np.where(rng.random(pos.size) < cross, other, comm)
  tpos = tcomm * size + (x ^ masks[r])
  # One fact per unordered pair and relation: drop (t, r, h) when (h, r, t) is kept.
  keep = pos <= tpos
  facts = np.stack([perm[pos[keep]], r[keep], perm[tpos[keep]]], 1)
  facts = facts[rng.permutation(len(facts))]
  n_valid, n_test = int(valid * len(facts)), int(test * len(facts))
  splits = {
    "valid": facts[:n_valid],
    "test": facts[n_valid : n_valid + n_test],
    "train": facts[n_valid + n_test :],
  }
  kg = from_triples(splits, num_entities, num_relations, reciprocal=reciprocal)
  kg.name = (
    f"planted(communities={communities}, bits={bits}, relations={num_relations}, "
    f"cross={cross}, seed={seed})"
  )
  return kg


# ----------------------------------------------------------------------------- filter index


class FilterIndex:
  """Every true triple of train, valid and test, as (anchor, relation) -> sorted answers.

  Keys are tail queries (h, r, ?) of the given triples and, as head queries, (t, r, ?) under
  key relation r + R (whether or not the model has reciprocal relations; that is just how the
  head side is keyed). CSR layout: `keys` sorted int64 (anchor * 2R + rel), `offsets`,
  `answers`.
  """

  def __init__(self, kg: KG):
    R = kg.num_base_relations
    self.num_keys_rel = 2 * R
    t = np.concatenate([kg.splits[s] for s in SPLITS]).astype(np.int64)
    both = np.concatenate([t, np.stack([t[:, 2], t[:, 1] + R, t[:, 0]], 1)])
    key = both[:, 0] * self.num_keys_rel + both[:, 1]
    order = np.lexsort((both[:, 2], key))
    key, ans = key[order], both[order, 2]
    # Duplicate triples (present in some datasets) would count twice in the filter lists.
    keep = np.ones(key.size, bool)
    keep[1:] = (key[1:] != key[:-1]) | (ans[1:] != ans[:-1])
    key, ans = key[keep], ans[keep]
    self.keys, starts = np.unique(key, return_index=True)
    self.offsets = np.append(starts, key.size).astype(np.int64)
    self.answers = ans.astype(np.int32)

  def lookup(self, anchors: np.ndarray, rels: np.ndarray) -> list[np.ndarray]:
    """The true answers of each query (anchor, rel in [0, 2R)), each a sorted int32 array."""
    k = anchors.astype(np.int64) * self.num_keys_rel + rels.astype(np.int64)
    pos = np.searchsorted(self.keys, k)
    out = []
    for p, kk in zip(pos, k):
      if p < self.keys.size and self.keys[p] == kk:
        out.append(self.answers[self.offsets[p] : self.offsets[p + 1]])
      else:
        out.append(np.zeros(0, np.int32))
    return out

  def counts(self, anchors: np.ndarray, rels: np.ndarray) -> np.ndarray:
    k = anchors.astype(np.int64) * self.num_keys_rel + rels.astype(np.int64)
    pos = np.minimum(np.searchsorted(self.keys, k), self.keys.size - 1)
    hit = self.keys[pos] == k
    return np.where(hit, self.offsets[pos + 1] - self.offsets[pos], 0)


def queries(kg: KG, split: str) -> dict[str, np.ndarray]:
  """Both sides of every triple of `split` as tail queries (anchor, rel, target, side).

  side 0: the tail query (h, r, ?) -> t; side 1: the head query (?, r, t), written as
  (t, r + R, ?) -> h. Relation ids r + R are the model's reciprocal relations when it has
  them; a model without them scores head queries with its head-side scorer.
  """
  t = kg.splits[split]
  R = kg.num_base_relations
  anchor = np.concatenate([t[:, 0], t[:, 2]])
  rel = np.concatenate([t[:, 1], t[:, 1] + R])
  target = np.concatenate([t[:, 2], t[:, 0]])
  side = np.concatenate([np.zeros(len(t), np.int32), np.ones(len(t), np.int32)])
  return {
    "anchor": anchor.astype(np.int32),
    "rel": rel.astype(np.int32),
    "target": target.astype(np.int32),
    "side": side,
  }
