"""What a tabular CTR file holds: the schema the generic reader (`ctr_reader`) converts by.

A schema names the label column, the dense columns and the categorical columns of a file,
and says how each categorical column becomes ids:

  one-hot    bag=1: one value per field, id int32[N, 1].
  multi-hot  bag=L > 1: the field is a list of values joined by `separator` (text) or a
             list column (Parquet); ids int32[N, L], PAD (-1) after the bag's last id. Bags
             longer than L are cut to their first L values (overflow="truncate") or make the
             line malformed (overflow="error"). Empty items ("a||b") are skipped.
  An empty field (or a null, or an empty list) is MISSING_ID in the first slot: every bag has
  at least one id, so mean pooling never divides by zero.

Values become 64-bit keys by `kind`: "string" (FNV-1a 64 of the UTF-8 text, then splitmix64's
finalizer: `string_key`), "int" (a decimal integer, mod 2^64) or "hex" (a hexadecimal
integer, mod 2^64), then ids by `vocab`:
  "frequency": keys seen >= min_count times get ids FIRST_ID, FIRST_ID + 1, ... by decreasing
               count (ties by key), rarer keys UNKNOWN_ID; counted over every row.
  "hash":      FIRST_ID + key % (hash_size - FIRST_ID).
  "raw":       the key itself as the id, for a dynamic table (`dynamic(...)`, which maps ids
               to rows as they come): no counting pass, no modulo, no fold. The cache keeps
               raw columns' ids apart, as int64 (`raw_ids.npy`; `ctr_ids.raw_column_ids`):
               the key's 64 bits (Criteo's 8-hex-digit values their exact 32-bit value, a
               "string" key the whole 64-bit hash); an empty field RAW_MISSING, a bag's
               unused slot PAD. The two keys whose bits are those sentinels (2^63 and
               2^64 - 1, e.g. an "int" value -1) read as the key 2^63 + 1 (RAW_RESERVED):
               three of 2^64 keys share an id. The table's spec says raw_ids (its rows: the
               2^64 id space, RAW_ID_SPACE), and the plan refuses any backend but one that
               maps ids (a dynamic one) for it.

Dense fields: decimal numbers, empty -> 0, transformed by `dense_transform` ("log":
log(max(x, 0) + 1) as DLRM does for Criteo; "none"). The label is 0 or 1.

Schemas come from config (`data.schema`): a JSON file, inline JSON, or a dict
(`Schema.from_dict`); unknown keys and column names fail naming the valid ones. Criteo's own
schema is `recgnn.data.criteo.schema()` (data.schema="criteo" opens it through the Criteo
reader, `recgnn.tasks.ctr`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

MISSING_ID = 0  # an empty field, in both vocab modes
UNKNOWN_ID = 1  # "frequency": a value seen fewer than min_count times
FIRST_ID = 2  # first id of a real value (both modes, so the two id spaces line up)
PAD = -1  # an empty slot of a multi-hot bag (recgnn.embeddings.base.PAD)

FORMATS = ("tsv", "csv", "parquet")
KINDS = ("string", "int", "hex")
VOCABS = ("frequency", "hash", "raw")
#: The id space of a vocab="raw" column: any 64-bit key (its table's `TableSpec.num_rows`).
RAW_ID_SPACE = 2**64
#: A vocab="raw" column's id of an empty field (int64; PAD marks a bag's unused slot).
RAW_MISSING = -(2**63)
#: The id of a key whose bits are RAW_MISSING's or PAD's (keys 2^63 and 2^64 - 1).
RAW_RESERVED = RAW_MISSING + 1
OVERFLOWS = ("truncate", "error")
DENSE_TRANSFORMS = ("log", "none")
_DELIMITERS = {"tsv": "\t", "csv": ",", "parquet": ""}


def string_key(text: bytes) -> int:
  """The 64-bit key of a "string" value: FNV-1a 64 of its bytes, then splitmix64's finalizer
  (plain Python; ctr_fast hashes the same way compiled)."""
  m = (1 << 64) - 1
  h = 0xCBF29CE484222325
  for b in text:
    h = ((h ^ b) * 0x100000001B3) & m
  h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & m
  h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & m
  return h ^ (h >> 31)


def _fields(cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


def _check_keys(what: str, d: Mapping, cls) -> None:
  unknown = sorted(set(d) - set(_fields(cls)))
  if unknown:
    raise ValueError(f"Unknown {what} key(s) {unknown}; valid: {', '.join(_fields(cls))}")


def _choice(what: str, value, valid) -> None:
  if value not in valid:
    raise ValueError(f"Unknown {what} {value!r}; available: {', '.join(valid)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Categorical:
  """One categorical column: one embedding table.

  Attributes:
    name: the column (header name, or one of Schema.columns); also the table's name.
    bag: ids per example (1: one-hot; L > 1: multi-hot, padded with PAD to L).
    separator: between a multi-hot field's values (text formats; required when bag > 1,
      must differ from the file's delimiter).
    overflow: a bag longer than `bag`: "truncate" (keep the first `bag`) or "error".
    kind: how a value becomes a key: "string", "int" or "hex" (see the module docstring).
    vocab: "frequency" (min_count), "hash" (hash_size) or "raw" (for a dynamic table).
    min_count: "frequency": keys seen fewer times share UNKNOWN_ID.
    hash_size: "hash": rows of the table (>= FIRST_ID + 1).
    pooling: how the model reduces the bag, "sum" or "mean" ("" = the task's default).
  """

  name: str
  bag: int = 1
  separator: str = ""
  overflow: str = "truncate"
  kind: str = "string"
  vocab: str = "frequency"
  min_count: int = 1
  hash_size: int = 0
  pooling: str = ""

  def __post_init__(self):
    where = f"categorical column {self.name!r}"
    if self.bag < 1:
      raise ValueError(f"{where}: bag must be >= 1, got {self.bag}")
    _choice(f"{where} overflow", self.overflow, OVERFLOWS)
    _choice(f"{where} kind", self.kind, KINDS)
    _choice(f"{where} vocab", self.vocab, VOCABS)
    _choice(f"{where} pooling", self.pooling, ("", "sum", "mean"))
    if self.min_count < 1:
      raise ValueError(f"{where}: min_count must be >= 1, got {self.min_count}")
    if self.vocab == "hash" and self.hash_size < FIRST_ID + 1:
      raise ValueError(
        f"{where}: vocab='hash' needs hash_size >= {FIRST_ID + 1} (ids 0..{FIRST_ID - 1} are "
        f"reserved), got {self.hash_size}"
      )

  @property
  def multi_hot(self) -> bool:
    return self.bag > 1

  @property
  def raw(self) -> bool:
    """vocab="raw": the keys themselves are the ids (int64, `raw_ids.npy` in the cache)."""
    return self.vocab == "raw"

  def id_key(self) -> dict[str, Any]:
    """What changes this column's ids (the cache key's part)."""
    key = {"name": self.name, "bag": self.bag, "kind": self.kind, "vocab": self.vocab}
    if self.bag > 1:
      key.update(separator=self.separator, overflow=self.overflow)
    if self.vocab == "hash":
      key["hash_size"] = self.hash_size
    elif self.vocab == "frequency":
      key["min_count"] = self.min_count
    else:  # (the int64 ids: a cache whose raw ids were folded to 31 bits lacks it: rebuilt)
      key["ids"] = "int64"
    return key


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schema:
  """A tabular CTR file: which columns are the label, dense features and categorical tables.

  Attributes:
    label: the label column (0 / 1).
    dense: the dense columns, in model order.
    categorical: the categorical columns (tables), in model order.
    format: "tsv", "csv" or "parquet".
    header: text formats: the first line names the columns.
    columns: text without a header: every column of the file, in order (columns the schema
      does not use are read past). Parquet and headers name their own columns.
    delimiter: between text fields ("" = tab for tsv, comma for csv).
    dense_transform: "log" (log(max(x, 0) + 1)) or "none".
    name: a label for messages.
  """

  label: str
  dense: tuple[str, ...] = ()
  categorical: tuple[Categorical, ...] = ()
  format: str = "tsv"
  header: bool = False
  columns: tuple[str, ...] = ()
  delimiter: str = ""
  dense_transform: str = "log"
  name: str = "custom"

  def __post_init__(self):
    _choice("format", self.format, FORMATS)
    _choice("dense_transform", self.dense_transform, DENSE_TRANSFORMS)
    names = [self.label, *self.dense, *(c.name for c in self.categorical)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
      raise ValueError(f"schema {self.name!r}: columns used twice: {dup}")
    if not self.categorical:
      raise ValueError(f"schema {self.name!r}: no categorical columns (tables)")
    if self.format != "parquet" and not self.header:
      if not self.columns:
        raise ValueError(
          f"schema {self.name!r}: a {self.format} file without a header needs `columns` (every "
          "column of the file, in order), or header=True"
        )
      self.column_indices(self.columns, "the schema's `columns`")
    for c in self.categorical:
      if c.multi_hot and self.format != "parquet":
        if not c.separator:
          raise ValueError(f"multi-hot column {c.name!r} (bag={c.bag}) needs a separator")
        if c.separator == self.field_delimiter:
          raise ValueError(
            f"multi-hot column {c.name!r}: separator {c.separator!r} is the field delimiter"
          )

  @property
  def field_delimiter(self) -> str:
    return self.delimiter or _DELIMITERS[self.format]

  @property
  def table_names(self) -> tuple[str, ...]:
    return tuple(c.name for c in self.categorical)

  @property
  def bag_lengths(self) -> tuple[int, ...]:
    return tuple(c.bag for c in self.categorical)

  @property
  def num_slots(self) -> int:
    """Id slots per row: the sum of the bag lengths (columns of the cache's sparse.npy)."""
    return sum(self.bag_lengths)

  def column_indices(self, names, where: str) -> tuple[int, int, list[int], list[int]]:
    """(number of columns, label index, dense indices, categorical indices) in a file whose
    columns are `names`; a schema column missing from them fails listing them."""
    names = list(names)
    pos = {n: i for i, n in enumerate(names)}
    wanted = [self.label, *self.dense, *self.table_names]
    missing = [n for n in wanted if n not in pos]
    if missing:
      raise ValueError(
        f"schema {self.name!r}: column(s) {missing} not in {where}; its columns: "
        f"{', '.join(map(str, names))}"
      )
    return (
      len(names),
      pos[self.label],
      [pos[n] for n in self.dense],
      [pos[n] for n in self.table_names],
    )

  def cache_key(self) -> dict[str, Any]:
    """Everything that changes the converted arrays."""
    d = dataclasses.asdict(self)
    d["categorical"] = [c.id_key() for c in self.categorical]
    d.pop("name")
    # As JSON gives it back (lists, not tuples): it is compared with the cache's manifest.
    return json.loads(json.dumps(d))

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> Schema:
    """A schema from plain data (JSON / config). Categorical entries are names (one-hot,
    frequency ids) or dicts of Categorical's fields; `defaults` (a dict) fills fields that
    entries leave out."""
    d = dict(d)
    defaults = dict(d.pop("defaults", {}) or {})
    _check_keys("schema", d, cls)
    _check_keys("categorical defaults", defaults, Categorical)
    cats = []
    for c in d.get("categorical", ()):
      entry = {"name": c} if isinstance(c, str) else dict(c)
      _check_keys(f"categorical column {entry.get('name')!r}", entry, Categorical)
      cats.append(Categorical(**{**defaults, **entry}))
    d["categorical"] = tuple(cats)
    for k in ("dense", "columns"):
      if k in d:
        d[k] = tuple(d[k])
    if "label" not in d:
      raise ValueError("schema: `label` (the label column's name) is required")
    return cls(**d)


def load(spec: Any) -> Schema:
  """A schema from config: a Schema, a JSON file path, inline JSON (a string starting with
  "{"), or a dict (ml_collections.ConfigDict too)."""
  if isinstance(spec, Schema):
    return spec
  if hasattr(spec, "to_dict"):
    spec = spec.to_dict()
  if isinstance(spec, str):
    if spec.lstrip().startswith("{"):  # inline JSON (a config's string field, the CLI)
      return Schema.from_dict(json.loads(spec))
    if os.path.isfile(spec):
      with open(spec) as f:
        d = json.load(f)
      # Messages and the cache name it by its file unless it names itself.
      d.setdefault("name", os.path.splitext(os.path.basename(spec))[0])
      return Schema.from_dict(d)
    raise ValueError(
      f"Unknown schema {spec!r}: neither a JSON file nor inline JSON (Criteo's own: "
      "data.schema='criteo', recgnn.data.criteo.schema())"
    )
  return Schema.from_dict(spec)
