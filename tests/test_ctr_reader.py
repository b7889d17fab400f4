"""The generic CTR reader (any schema; TSV with a header, CSV without, Parquet), multi-hot
columns and planted malformed lines, against a plain Python reader written here."""

import csv
import math
import os
import re

import numpy as np
import pytest

from recgnn.data import criteo, ctr_reader, ctr_schema
from recgnn.data.ctr_cache import MalformedDataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

COLUMNS = ("click", "price", "age", "ignored", "site", "tags", "items", "user")
SCHEMA = dict(
  label="click",
  dense=["price", "age"],
  categorical=[
    "site",  # one-hot string, frequency ids
    {"name": "tags", "bag": 3, "separator": "|", "min_count": 2},  # multi-hot, truncated
    {"name": "items", "bag": 2, "separator": ";", "kind": "int", "vocab": "hash",
     "hash_size": 50, "overflow": "error"},
    {"name": "user", "kind": "hex", "vocab": "hash", "hash_size": 1000},
  ],
)  # fmt: skip
N = 600
DECIMAL = r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"


def rows(seed=0):
  """N records as lists of strings (COLUMNS order), with empty fields and long bags."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(N):
    ntags = int(rng.integers(0, 5))  # 4 > bag 3: truncated
    nitems = int(rng.integers(0, 3))
    out.append(
      [
        str(int(rng.random() < 0.3)),
        "" if rng.random() < 0.1 else f"{rng.normal(3, 4):.3f}",
        str(int(rng.integers(-2, 90))),
        "whatever",
        "" if rng.random() < 0.05 else f"site{int(rng.zipf(1.5)) % 40}",
        "|".join(f"t{int(rng.zipf(1.3)) % 30}" for _ in range(ntags)),
        ";".join(str(int(rng.integers(0, 10**6))) for _ in range(nitems)),
        f"{int(rng.integers(0, 2**40)):x}",
      ]
    )
  return out


# Planted malformed records: index -> (fields, reason). Line numbers come from the writer.
def plant(records, csv_quotes=False):
  recs = [list(r) for r in records]
  bad = {
    7: (recs[7][:-1], "columns"),
    50: ([*recs[50], "extra"], "columns"),
    120: (["2", *recs[120][1:]], "label"),
    200: ([recs[200][0], "abc", *recs[200][2:]], "dense"),
    260: ([*recs[260][:6], "1;2;3", recs[260][7]], "bag_length"),
    300: ([*recs[300][:6], "12;x4", recs[300][7]], "categorical"),
    400: ([*recs[400][:7], "zz"], "categorical"),
    450: ([recs[450][0], "inf", *recs[450][2:]], "dense"),
  }
  for i, (fields, _) in bad.items():
    recs[i] = fields
  return recs, {i: r for i, (_, r) in bad.items()}


def fnv_mix(data: bytes) -> int:
  """FNV-1a 64, then splitmix64's finalizer: the documented string key."""
  h = 0xCBF29CE484222325
  for b in data:
    h = ((h ^ b) * 0x100000001B3) % 2**64
  h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
  h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) % 2**64
  return h ^ (h >> 31)


def key(text, kind):
  if kind == "string":
    return fnv_mix(text.encode())
  return int(text, 16 if kind == "hex" else 10) % 2**64


def reference(records, line_of):
  """Plain Python: parse every record (lists of strings; None = a null), then ids."""
  schema = ctr_schema.Schema.from_dict({**SCHEMA, "columns": COLUMNS, "header": True})
  pos = {n: i for i, n in enumerate(COLUMNS)}
  good, bad = [], []
  for i, f in enumerate(records):
    line = line_of(i)
    if len(f) != len(COLUMNS):
      bad.append((line, "columns"))
      continue
    if f[0] not in ("0", "1"):
      bad.append((line, "label"))
      continue
    try:
      # The documented decimal grammar (Python's float() alone also takes '1_0', ' 1', 'nan').
      if not all(re.fullmatch(DECIMAL, f[pos[d]] or "0") for d in schema.dense):
        raise ValueError
      dense = [float(f[pos[d]]) if f[pos[d]] else 0.0 for d in schema.dense]
      if not all(math.isfinite(x) for x in dense):
        raise ValueError
    except ValueError:
      bad.append((line, "dense"))
      continue
    bags, reason = [], None
    for c in schema.categorical:
      items = [x for x in (f[pos[c.name]] or "").split(c.separator or "\0") if x]
      if len(items) > c.bag:
        if c.overflow == "error":
          reason = "bag_length"
          break
        items = items[: c.bag]
      try:
        bags.append([key(x, c.kind) for x in items])
      except ValueError:
        reason = "categorical"
        break
    if reason:
      bad.append((line, reason))
      continue
    dense = [math.log(max(x, 0) + 1) for x in dense]
    good.append((int(f[0]), dense, bags))
  ids = []
  for t, c in enumerate(schema.categorical):
    if c.vocab == "frequency":
      counts = {}
      for _, _, bags in good:
        for k in bags[t]:
          counts[k] = counts.get(k, 0) + 1
      kept = sorted((k for k in counts if counts[k] >= c.min_count), key=lambda k: (-counts[k], k))
      vocab = {k: 2 + r for r, k in enumerate(kept)}
      size = 2 + len(kept)
    col = []
    for _, _, bags in good:
      b = bags[t]
      if c.vocab == "frequency":
        got = [vocab.get(k, 1) for k in b]
      else:
        got = [2 + k % (c.hash_size - 2) for k in b]
      got = got or [0]  # an empty field: MISSING_ID
      col.append(got + [-1] * (c.bag - len(got)))
    ids.append((np.array(col, np.int32), size if c.vocab == "frequency" else c.hash_size))
  labels = np.array([g[0] for g in good])
  dense = np.array([g[1] for g in good])
  return labels, dense, ids, bad


def check(ds, ref, path):
  labels, dense, ids, bad = ref
  np.testing.assert_array_equal(ds.labels, labels)
  np.testing.assert_allclose(ds.dense, dense, rtol=1e-6, atol=1e-6)
  assert ds.bag_lengths == (1, 3, 2, 1)
  assert ds.table_names == ("site", "tags", "items", "user")
  o = np.cumsum([0, *ds.bag_lengths])
  for t, (col, size) in enumerate(ids):
    np.testing.assert_array_equal(ds.sparse[:, o[t] : o[t + 1]], col, err_msg=ds.table_names[t])
    assert ds.cardinalities[t] == size
  rec = ds.manifest["bad_lines"][os.path.abspath(path)]
  assert rec["count"] == len(bad) == ds.manifest["num_bad_lines"]
  assert sorted((e["line"], e["reason"]) for e in rec["examples"]) == sorted(bad)
  fill = [float((ds.sparse[:, o[t] : o[t + 1]] != -1).mean()) for t in range(4)]
  assert ds.manifest["bag_fill"] == pytest.approx(fill) and fill[0] == 1.0 and fill[1] < 1.0
  assert "of the padded id slots used" in ds.describe()
  # A batch: bags of each table's length, PAD after the ids.
  b = ds.batch("train", 0, 64)
  assert b["ids"]["tags"].shape == (64, 3) and b["ids"]["site"].shape == (64, 1)
  assert b["dense"].shape == (64, 2)
  np.testing.assert_array_equal(b["ids"]["items"], ds.sparse[:64, o[2] : o[3]])


def test_tsv_with_header(tmp_path):
  recs, _ = plant(rows(0))
  path = str(tmp_path / "clicks.tsv")
  with open(path, "w") as f:
    f.write("\t".join(COLUMNS) + "\n")
    f.writelines("\t".join(r) + "\n" for r in recs)
  schema = ctr_schema.Schema.from_dict({**SCHEMA, "format": "tsv", "header": True})
  opts = ctr_reader.ReadOptions(max_bad_lines=8, block_bytes=1 << 16)
  ds = ctr_reader.open_ctr(path, str(tmp_path / "c"), schema, options=opts, progress=None)
  check(ds, reference(recs, lambda i: i + 2), path)
  # Workers: the same cache.
  two = ctr_reader.open_ctr(
    path, str(tmp_path / "d"), schema,
    options=ctr_reader.ReadOptions(max_bad_lines=8, block_bytes=1 << 16, num_workers=2),
    progress=None,
  )  # fmt: skip
  np.testing.assert_array_equal(two.sparse, ds.sparse)
  assert two.manifest["bad_lines"] == ds.manifest["bad_lines"]
  # The budget refuses one fewer, naming the file and the first lines.
  with pytest.raises(MalformedDataError, match=r"8 malformed lines.*budget of 7") as e:
    ctr_reader.open_ctr(
      path, str(tmp_path / "c"), schema, options=ctr_reader.ReadOptions(max_bad_lines=7),
      progress=None,
    )  # fmt: skip
  assert path in str(e.value) and "line 9 (columns)" in str(e.value)


def test_csv_without_header(tmp_path):
  recs, _ = plant(rows(1))
  recs[500] = [*recs[500][:4], '"site,7', *recs[500][5:]]  # a broken quote
  recs[510] = [*recs[510][:4], "site,8", *recs[510][5:]]  # quoted: one field with a comma
  path = str(tmp_path / "clicks.csv")
  with open(path, "w", newline="") as f:
    w = csv.writer(f, lineterminator="\r\n")  # CRLF too
    for r in recs:
      if r[4].startswith('"'):
        f.write(",".join(r) + "\r\n")
      else:
        w.writerow(r)
  schema = ctr_schema.Schema.from_dict({**SCHEMA, "format": "csv", "columns": COLUMNS})
  ds = ctr_reader.open_ctr(
    path, str(tmp_path / "c"), schema, options=ctr_reader.ReadOptions(max_bad_lines=9),
    progress=None,
  )  # fmt: skip
  ref_recs = [list(r) for r in recs]
  ref_recs[500] = ["too", "few"]  # the reference counts a broken quote as malformed
  labels, dense, ids, bad = reference(ref_recs, lambda i: i + 1)
  bad = [(ln, "quoting" if ln == 501 else r) for ln, r in bad]
  check(ds, (labels, dense, ids, bad), path)


def test_parquet(tmp_path):
  recs, _ = plant(rows(2))
  keep = [i for i, r in enumerate(recs) if len(r) == len(COLUMNS)]  # Parquet has no ragged rows
  recs = [recs[i] for i in keep]
  line_of = lambda i: i + 1  # noqa: E731
  recs[10] = [None, *recs[10][1:]]  # a null label
  cols = {n: [r[k] for r in recs] for k, n in enumerate(COLUMNS)}
  table = pa.table(
    {
      "click": pa.array([None if v is None else int(v) for v in cols["click"]], pa.int64()),
      "price": pa.array(cols["price"], pa.string()),  # strings: "abc" and "" stay as written
      "age": pa.array([int(v) for v in cols["age"]], pa.int32()),
      "ignored": cols["ignored"],
      "site": pa.array([v or None for v in cols["site"]], pa.string()),  # null = empty
      "tags": pa.array([[x for x in v.split("|") if x] for v in cols["tags"]],
                       pa.list_(pa.string())),
      "items": cols["items"],
      "user": cols["user"],
    }
  )  # fmt: skip
  path = str(tmp_path / "clicks.parquet")
  pq.write_table(table, path, row_group_size=128)
  schema = ctr_schema.Schema.from_dict({**SCHEMA, "format": "parquet"})
  ds = ctr_reader.open_ctr(
    path, str(tmp_path / "c"), schema, options=ctr_reader.ReadOptions(max_bad_lines=8),
    progress=None,
  )  # fmt: skip
  ref_recs = [["x" if v is None else v for v in r] for r in recs]  # null label: malformed
  check(ds, reference(ref_recs, line_of), path)
  assert ds.manifest["bad_lines"][os.path.abspath(path)]["examples"][0]["line"] == 11
  with pytest.raises(MalformedDataError, match="budget of 5"):
    ctr_reader.open_ctr(
      path, str(tmp_path / "c"), schema, options=ctr_reader.ReadOptions(max_bad_lines=5),
      progress=None,
    )  # fmt: skip


def test_schema_errors_name_the_valid_choices(tmp_path):
  with pytest.raises(ValueError, match="Unknown schema key.*'lable'.*valid: label"):
    ctr_schema.Schema.from_dict({"lable": "click", "categorical": ["a"]})
  with pytest.raises(ValueError, match="categorical column 'a' key.*'bags'.*valid: name, bag"):
    ctr_schema.Schema.from_dict({"label": "y", "categorical": [{"name": "a", "bags": 2}]})
  with pytest.raises(ValueError, match="needs a separator"):
    ctr_schema.Schema.from_dict(
      {"label": "y", "header": True, "categorical": [{"name": "a", "bag": 2}]}
    )
  with pytest.raises(ValueError, match="Unknown categorical column 'a' vocab 'freq'.*frequency"):
    ctr_schema.Schema.from_dict({"label": "y", "header": True, "categorical": [
      {"name": "a", "vocab": "freq"}]})  # fmt: skip
  with pytest.raises(ValueError, match="neither a JSON file nor inline JSON"):
    ctr_schema.load("critео")
  path = str(tmp_path / "x.tsv")
  with open(path, "w") as f:
    f.write("y\tb\n1\tq\n")
  schema = ctr_schema.Schema.from_dict({"label": "y", "header": True, "categorical": ["a"]})
  with pytest.raises(ValueError, match=r"column\(s\) \['a'\] not in the header.*its columns: y, b"):
    ctr_reader.open_ctr(path, str(tmp_path / "c"), schema, progress=None)
  empty = str(tmp_path / "empty.tsv")
  open(empty, "w").close()
  with pytest.raises(MalformedDataError, match="starts with a header line, but the file is empty"):
    ctr_reader.open_ctr(empty, str(tmp_path / "c"), schema, progress=None)


def test_criteo_is_a_schema():
  s = criteo.schema()
  assert s.table_names == tuple(f"C{i}" for i in range(1, 27)) and s.bag_lengths == (1,) * 26
  assert len(s.dense) == 13 and s.format == "tsv" and not s.header


def test_tfds_build_of_a_schema_equals_the_memmap(tmp_path):
  """The `ctr` TFDS builder (array_record, no TensorFlow) holds the memmap cache's rows, and
  grain batches (multi-hot bags) equal the memmap batches for the same seed."""
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("grain")
  from recgnn.data import pipeline, tfds_builders

  recs, _ = plant(rows(3))
  path = str(tmp_path / "clicks.tsv")
  with open(path, "w") as f:
    f.write("\t".join(COLUMNS) + "\n")
    f.writelines("\t".join(r) + "\n" for r in recs)
  schema = ctr_schema.Schema.from_dict({**SCHEMA, "header": True})
  opts = ctr_reader.ReadOptions(max_bad_lines=8)
  mm = ctr_reader.open_ctr(path, str(tmp_path / "c"), schema, options=opts, progress=None)
  config = tfds_builders.ctr_config(schema, path, options=opts)
  builder = tfds_builders.build("ctr", str(tmp_path / "tfds"), config=config)
  tf = pipeline.TfdsCriteo(builder, num_threads=2)
  assert tf.table_names == mm.table_names and tf.bag_lengths == mm.bag_lengths
  assert tf.cardinalities == mm.cardinalities
  assert builder.info.metadata["num_bad_lines"] == 8
  for split in ("train", "valid", "test"):
    assert tf.split_size(split) == mm.split_size(split)
  a = tf.batches("train", 64, shuffle_seed=3, num_epochs=None)
  b = mm.batches("train", 64, shuffle_seed=3, num_epochs=None)
  for _ in range(3):
    x, y = next(a), next(b)
    for k in ("dense", "label", "weight"):
      np.testing.assert_array_equal(x[k], y[k])
    for t in mm.table_names:
      np.testing.assert_array_equal(x["ids"][t], y["ids"][t])
  last = list(tf.batches("test", 64, drop_remainder=False))[-1]
  pad = last["weight"] == 0
  assert pad.any() and (last["ids"]["tags"][pad][:, 1:] == -1).all()


def test_compiled_and_python_line_parsers_agree(tmp_path):
  """ctr_fast's compiled pass and the per-line Python reader give the same rows, keys and
  malformed reasons, odd decimals and integers included."""
  recs, _ = plant(rows(4))
  odd = ["1e3", ".5", "5.", "+2", "-0.0", "1_0", " 1", "nan", "1e", "--1", "1.2.3", "7E-2"]
  for i, v in enumerate(odd):
    recs[20 + i] = [recs[20 + i][0], v, *recs[20 + i][2:]]
  recs[40] = [*recs[40][:6], "-12;18446744073709551621", recs[40][7]]  # mod 2^64
  recs[41] = [*recs[41][:7], "DEADbeef00112233aa"]  # hex over 64 bits, mixed case
  path = str(tmp_path / "odd.tsv")
  with open(path, "w") as f:
    f.write("\t".join(COLUMNS) + "\n")
    f.writelines("\t".join(r) + "\r\n" for r in recs)
  schema = ctr_schema.Schema.from_dict({**SCHEMA, "header": True})
  fmt = ctr_reader.TextFormat(schema, 1 << 20)
  layout = fmt.layout(path)
  size = os.path.getsize(path)
  fast = fmt.parse(path, 0, size, layout)
  fmt.fast = False
  slow = fmt.parse(path, 0, size, layout)
  assert fast.bad == slow.bad and fast.examples == slow.examples
  for k in ("labels", "dense", "raw", "state"):
    np.testing.assert_array_equal(getattr(fast, k), getattr(slow, k), err_msg=k)
  labels, dense, _, bad = reference(recs, lambda i: i + 2)
  assert fast.bad == [(ln - 1, r) for ln, r in bad]  # task indices count the header as 0
  np.testing.assert_allclose(fast.dense, dense, rtol=1e-6, atol=1e-6)
  bad_dense = {ln for ln, r in bad if r == "dense"}
  assert {
    22 + i for i, v in enumerate(odd) if v in ("1_0", " 1", "nan", "1e", "--1", "1.2.3")
  } <= bad_dense
  o = np.cumsum([0, 1, 3, 2, 1])
  row = 41 - sum(1 for ln, _ in bad if ln < 42)  # well-formed rows before record 41
  assert fast.raw[row, o[3]] == int("DEADbeef00112233aa", 16) % 2**64
