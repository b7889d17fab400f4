"""Property tests (hypothesis) of every parser: Criteo TSV, KG triples, OGB CSV, Planetoid
pickles. Each input is checked against a slow reference reading of the documented format:
no exception but the documented one, every malformed line counted, and no value that differs
from what the text says. Examples are bounded and derandomized so CI is fast and repeatable.
"""

import gzip
import keyword
import os
import pickle
import re
import shutil
import string

import numpy as np
import pytest

pytest.importorskip("hypothesis")  # the [test] extra; absent on a --no-deps install

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from recgnn.data import criteo, kg, ogb, planetoid  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORA = os.path.join(ROOT, "third_party", "cora")


def fuzz(n):
  return settings(
    max_examples=n,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
  )


# ----------------------------------------------------------------------------- Criteo TSV


def _over(alphabet: bytes, min_size=0, max_size=10):
  """Byte strings over `alphabet` (short, so junk looks like the values it sits among)."""
  return st.binary(min_size=min_size, max_size=max_size).map(
    lambda b: bytes(alphabet[c % len(alphabet)] for c in b)
  )


_JUNK = _over(b"0123456789abcdefABCDEF-+ x\r\t\x00\xff")
_LABEL = st.one_of(st.sampled_from([b"0", b"1"]), _JUNK)
_DENSE = st.one_of(
  st.just(b""),
  st.integers(-(10**19), 10**19).map(lambda v: str(v).encode()),
  st.integers(0, 999).map(lambda v: b"00000000" + str(v).encode()),
  _JUNK,
)
_HEX = st.one_of(
  st.just(b""),
  st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}".encode()),
  st.integers(0, 2**32 - 1).map(lambda v: f"{v:08X}".encode()),
  _JUNK,
)


@st.composite
def _criteo_line(draw):
  fields = [draw(_LABEL)] + [draw(_DENSE) for _ in range(13)] + [draw(_HEX) for _ in range(26)]
  cut = draw(st.sampled_from([None, None, None, None, 0, 20, 39]))
  if cut is not None:  # a missing or an extra column
    fields = fields[:cut] + fields[cut + 1 :] if draw(st.booleans()) else fields + [b""]
  return b"\t".join(fields) + draw(st.sampled_from([b"", b"", b"\r"]))


_DEC_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{8}")


def _criteo_reference(line: bytes):
  """One line by the module docstring's grammar: None if malformed, else the values."""
  line = line.removesuffix(b"\r")
  f = line.split(b"\t")
  if len(f) != 40 or f[0] not in (b"0", b"1"):
    return None
  dense = []
  for x in f[1:14]:
    if x == b"":
      dense.append(0)
    elif _DEC_RE.fullmatch(x) and len(x) <= 18:
      dense.append(max(int(x), 0))
    else:
      return None
  raw, missing = [], []
  for x in f[14:]:
    if x == b"":
      raw.append(0)
      missing.append(True)
    elif _HEX_RE.fullmatch(x):
      raw.append(int(x, 16))
      missing.append(False)
    else:
      return None
  return int(f[0]), np.log1p(np.float32(dense)), raw, missing


def _check_parse(lines):
  text = b"\n".join(lines) + b"\n"
  buf = np.zeros(criteo._PAD + len(text) + criteo._PAD, np.uint8)
  buf[criteo._PAD : criteo._PAD + len(text)] = np.frombuffer(text, np.uint8)
  got = criteo.parse_block(buf, len(text))
  split = text.split(b"\n")[:-1]  # a junk field may hold a newline: lines are what \n cuts
  ref = [_criteo_reference(x) for x in split]
  assert got.num_lines == len(split)
  assert [i for i, _ in got.bad] == [i for i, r in enumerate(ref) if r is None]
  good = [r for r in ref if r is not None]
  assert got.labels.tolist() == [r[0] for r in good]
  np.testing.assert_array_equal(got.dense, np.asarray([r[1] for r in good]).reshape(-1, 13))
  assert got.raw.tolist() == [r[2] for r in good]
  assert got.missing.tolist() == [r[3] for r in good]
  return ref


@fuzz(200)
@given(st.lists(_criteo_line(), max_size=6))
def test_criteo_parse_block_matches_reference(lines):
  _check_parse(lines)


@fuzz(25)
@given(lines=st.lists(_criteo_line(), min_size=1, max_size=12), budget=st.integers(0, 4))
def test_criteo_conversion_counts_every_bad_line(tmp_path_factory, lines, budget):
  """Whole files through the cache: bad lines counted in the manifest, the error past the
  budget, ids of the good rows exactly the hash of their raw values."""
  d = tmp_path_factory.mktemp("criteo")
  path = d / "train.txt"
  path.write_bytes(b"\n".join(lines) + b"\n")
  ref = [_criteo_reference(x) for x in path.read_bytes().split(b"\n")[:-1]]
  good = [r for r in ref if r is not None]
  n_bad = len(ref) - len(good)
  reader = criteo.ReaderConfig(categorical="hash", hash_sizes=1000, max_bad_lines=budget)
  if n_bad > budget:
    with pytest.raises(criteo.MalformedDataError, match=rf"{n_bad} malformed|train.txt"):
      criteo.open_criteo(str(path), str(d / "cache"), reader=reader, progress=None)
    return
  if not good:
    return  # nothing to split: a documented error elsewhere, not a parser property
  ds = criteo.open_criteo(str(path), str(d / "cache"), reader=reader, progress=None)
  assert ds.manifest["num_bad_lines"] == n_bad and ds.num_rows == len(good)
  np.testing.assert_array_equal(ds.labels, [r[0] for r in good])
  raw, missing = np.asarray([r[2] for r in good]), np.asarray([r[3] for r in good])
  expect = np.where(missing, criteo.MISSING_ID, criteo.FIRST_ID + raw % (1000 - criteo.FIRST_ID))
  np.testing.assert_array_equal(ds.sparse, expect)


# ----------------------------------------------------------------------------- KG triples

_KG_TEXT = st.text(alphabet=string.ascii_letters[:6] + " \t\r/é", max_size=8)
_KG_LINE = st.one_of(
  st.tuples(_KG_TEXT, _KG_TEXT, _KG_TEXT).map(lambda t: "\t".join(t).encode()),
  _KG_TEXT.map(str.encode),
  st.binary(max_size=8),  # invalid UTF-8 among them
)


def _kg_reference(data: bytes):
  triples, bad = [], 0
  lines = data.split(b"\n")
  if lines and lines[-1] == b"":
    lines.pop()
  for raw in lines:
    try:
      line = raw.decode("utf-8").removesuffix("\r")
    except UnicodeDecodeError:
      bad += 1
      continue
    if not line.strip():
      continue
    p = line.split("\t")
    if len(p) == 3 and all(x.strip() for x in p):
      triples.append(tuple(x.strip() for x in p))
    else:
      bad += 1
  return triples, bad


@fuzz(200)
@given(
  lines=st.lists(_KG_LINE, max_size=8),
  budget=st.integers(0, 5),
  packing=st.sampled_from(["plain", "gzip", "truncated_gzip"]),
)
def test_kg_read_triples_matches_reference(tmp_path_factory, lines, budget, packing):
  data = b"\n".join(lines) + (b"\n" if lines else b"")
  path = tmp_path_factory.mktemp("kg") / "train.txt"
  blob = data if packing == "plain" else gzip.compress(data)
  # The reader tells gzip by its magic bytes (kg.py): a "plain" file that happens to start
  # with them (st.binary can draw them) is read as gzip and refused as a damaged one.
  if packing == "truncated_gzip" or (packing == "plain" and blob[:2] == b"\x1f\x8b"):
    # truncated: the CRC / size trailer and more gone
    path.write_bytes(blob[: len(blob) - 9] if packing == "truncated_gzip" else blob)
    with pytest.raises(kg.MalformedDataError, match="gzip"):
      kg.read_triples(str(path), budget)
    return
  path.write_bytes(blob)
  triples, n_bad = _kg_reference(data)
  if n_bad > budget:
    with pytest.raises(kg.MalformedDataError, match=rf"{budget + 1} malformed"):
      kg.read_triples(str(path), budget)
    return
  got, bad = kg.read_triples(str(path), budget)
  assert got == triples and bad.count == n_bad


# ----------------------------------------------------------------------------- OGB CSV


def _gz(path, text: bytes):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with gzip.open(path, "wb") as f:
    f.write(text)


_INT_LINE_RE = re.compile(rb"[0-9]{1,18}")
_FLOAT_RE = re.compile(rb"[0-9.eE+\-naifNAIF]+")


def _ref_table(text: bytes, kind: str, columns: int | None):
  """A CSV by the module docstring: a list of rows, or None if any line is malformed."""
  text = text.replace(b"\r\n", b"\n")
  if not text:
    return []
  lines = text.split(b"\n")
  if lines[-1] == b"":
    lines.pop()
  rows = []
  for line in lines:
    f = line.split(b",")
    if columns is None:
      columns = len(f)
    if len(f) != columns:
      return None
    row = []
    for x in f:
      if kind == "int":
        if not _INT_LINE_RE.fullmatch(x):
          return None
        row.append(int(x))
      else:
        if not _FLOAT_RE.fullmatch(x):
          return None
        try:
          row.append(float(x))
        except ValueError:
          return None
    rows.append(row)
  return rows


def _ref_labels(text: bytes):
  text = text.replace(b"\r\n", b"\n")
  lines = text.split(b"\n")
  if lines and lines[-1] == b"":
    lines.pop()
  out = []
  for line in lines:
    v = line.strip()
    if not v or v.lower() == b"nan":
      out.append(-1)
    elif re.fullmatch(rb"[0-9]{1,9}(\.0*)?", v):
      out.append(int(float(v)))
    else:
      return None
  return out


_OGB_JUNK = _over(b"0123456789,\n\r.-+eanx \x00", min_size=1, max_size=4)


@st.composite
def _ogb_files(draw):
  n = draw(st.integers(3, 8))
  e = draw(st.integers(0, 10))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  edges = rng.integers(0, n, (e, 2))
  labels = [draw(st.sampled_from([b"0", b"1", b"2", b"nan", b"", b"1.0"])) for _ in range(n)]
  feats = rng.normal(size=(n, 2))
  files = {
    "raw/edge.csv.gz": b"".join(b"%d,%d\n" % tuple(x) for x in edges),
    "raw/node-label.csv.gz": b"\n".join(labels) + b"\n",
    "raw/node-feat.csv.gz": b"".join(b"%r,%r\n" % tuple(x) for x in feats.tolist()),
    "raw/num-node-list.csv.gz": b"%d\n" % n,
    "split/time/train.csv.gz": b"0\n1\n",
    "split/time/valid.csv.gz": b"2\n",
    "split/time/test.csv.gz": b"".join(b"%d\n" % i for i in range(3, n)),
  }
  name = draw(st.sampled_from(sorted(files)))
  text = files[name]
  pos = draw(st.integers(0, len(text)))
  cut = draw(st.integers(0, 3))
  files[name] = text[:pos] + draw(_OGB_JUNK) + text[pos + cut :]
  if draw(st.booleans()):
    files = {k: v.replace(b"\n", b"\r\n") for k, v in files.items()}
  return files, name


def _ogb_reference(files):
  """(edges, labels, feats, splits) as the grammar reads the files, or None if refused."""
  tables = {
    "edge": _ref_table(files["raw/edge.csv.gz"], "int", 2),
    "feat": _ref_table(files["raw/node-feat.csv.gz"], "float", None),
    "count": _ref_table(files["raw/num-node-list.csv.gz"], "int", 1),
  }
  labels = _ref_labels(files["raw/node-label.csv.gz"])
  splits = {s: _ref_table(files[f"split/time/{s}.csv.gz"], "int", 1) for s in ogb.store.SPLITS}
  if labels is None or any(v is None for v in [*tables.values(), *splits.values()]):
    return None
  if len(tables["count"]) != 1:
    return None
  n = tables["count"][0][0]
  if n == 0 or len(labels) != n or len(tables["feat"]) != n:
    return None
  if any(max(r) >= n for r in tables["edge"]) or any(r[0] >= n for s in splits.values() for r in s):
    return None
  return tables["edge"], labels, tables["feat"], splits


@fuzz(120)
@given(case=_ogb_files())
def test_ogb_load_is_exact_or_refused(tmp_path_factory, case):
  files, _ = case
  root = str(tmp_path_factory.mktemp("ogb") / "ogbn_fuzz")
  for name, text in files.items():
    _gz(os.path.join(root, name), text)
  ref = _ogb_reference(files)
  if ref is None:
    # The message names a file: the mutated one, or one it no longer agrees with.
    with pytest.raises(ogb.MalformedDataError, match=re.escape(root)):
      ogb.load(root)
    return
  g = ogb.load(root, undirected=False)
  edges, labels, feats, splits = ref
  assert g.labels.tolist() == labels
  np.testing.assert_array_equal(g.features, np.asarray(feats, np.float32).reshape(-1, 2))
  for s, rows in splits.items():
    assert g.splits[s].tolist() == [r[0] for r in rows]
  e = np.asarray(edges, np.int64).reshape(-1, 2)
  expect = ogb.store.csr_from_edges(e[:, 0], e[:, 1], len(labels), undirected=False)
  assert (g.adj != expect).nnz == 0


def test_ogb_truncated_gzip_is_refused(tmp_path):
  root = str(tmp_path / "o")
  _gz(f"{root}/raw/edge.csv.gz", b"0,1\n" * 1000)
  os.makedirs(f"{root}/split/time")
  blob = open(f"{root}/raw/edge.csv.gz", "rb").read()  # noqa: SIM115
  with open(f"{root}/raw/edge.csv.gz", "wb") as f:
    f.write(blob[: len(blob) // 2])
  with pytest.raises(ogb.MalformedDataError, match="edge.csv.gz: not a readable gzip"):
    ogb.load(root)


# ----------------------------------------------------------------------------- Planetoid

_CORA_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph")


@pytest.fixture(scope="module")
def cora_bytes():
  out = {}
  for p in _CORA_PARTS:
    with open(os.path.join(CORA, f"ind.cora.{p}"), "rb") as f:
      out[p] = f.read()
  return out


@fuzz(150)
@given(part=st.sampled_from(_CORA_PARTS), frac=st.floats(0.0, 0.999))
def test_planetoid_truncated_pickle_refused(tmp_path_factory, cora_bytes, part, frac):
  """Every strict prefix of a Planetoid pickle is refused by the restricted unpickler."""
  data = cora_bytes[part]
  path = tmp_path_factory.mktemp("pl") / f"ind.cora.{part}"
  path.write_bytes(data[: int(len(data) * frac)])
  with pytest.raises(planetoid.MalformedDataError, match=re.escape(str(path))):
    planetoid.restricted_load(str(path))


@fuzz(60)
@given(
  part=st.sampled_from(("y", "ty", "graph", "tx", "test.index")),
  edits=st.lists(st.tuples(st.floats(0, 0.999), st.integers(0, 255)), min_size=1, max_size=3),
  append=st.binary(max_size=3),
)
def test_planetoid_damaged_files_load_or_are_refused(tmp_path_factory, part, edits, append):
  """Damaged bytes: the loader raises only its documented errors, and whatever it returns
  is a well-formed graph."""
  root = tmp_path_factory.mktemp("pl")
  shutil.copytree(CORA, root / "cora")
  path = root / "cora" / f"ind.cora.{part}"
  data = bytearray(path.read_bytes())
  for frac, value in edits:
    data[int(len(data) * frac)] = value
  path.write_bytes(bytes(data) + append)
  try:
    g = planetoid.load("cora", str(root))
  except pickle.UnpicklingError as e:  # MalformedDataError, or a type outside the list
    assert str(path) in str(e) or "restricted unpickler" in str(e)
    return
  n = g.num_nodes
  assert g.features.shape == (n, 1433) and np.isfinite(g.features).all()
  assert g.labels.min() >= -1 and g.labels.max() < g.num_classes
  for ids in g.splits.values():
    assert ids.min() >= 0 and ids.max() < n
  assert g.adj.indices.min() >= 0 and g.adj.indices.max() < n


def test_planetoid_refuses_code_and_trailing_bytes(tmp_path):
  path = tmp_path / "p"
  path.write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
  with pytest.raises(pickle.UnpicklingError, match="restricted unpickler"):
    planetoid.restricted_load(str(path))
  path.write_bytes(pickle.dumps([1, 2], protocol=2) + b"junk")
  with pytest.raises(planetoid.MalformedDataError, match="bytes after the end"):
    planetoid.restricted_load(str(path))


# ----------------------------------------------------------------------------- plan strings

_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(
  lambda s: not keyword.iskeyword(s) and s not in ("True", "False", "None")
)
_OPTION = st.one_of(
  st.integers(-(10**12), 10**12),
  st.floats(allow_nan=False, allow_infinity=False, width=32),
  st.booleans(),
  st.none(),
  _IDENT,  # a bare word: the string itself
  st.text(string.ascii_letters + string.digits + " .-/", max_size=8),  # quoted
  st.tuples(st.integers(0, 99), st.integers(0, 99)),
)


def _render(v, draw) -> str:
  if isinstance(v, str) and v.isidentifier() and draw(st.booleans()):
    return v  # bare word
  if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1000 and draw(st.booleans()):
    return f"{v:_}"  # `_` separators
  return repr(v)


@st.composite
def _plan_string(draw):
  name = draw(_IDENT)
  opts = draw(st.dictionaries(_IDENT, _OPTION, max_size=4))
  sp = st.sampled_from(["", " ", "  "])
  if not opts and draw(st.booleans()):
    return f"{draw(sp)}{name}{draw(sp)}", name, opts
  pairs = [f"{k}{draw(sp)}={draw(sp)}{_render(v, draw)}" for k, v in opts.items()]
  body = ("," + draw(sp)).join(pairs)
  return f"{name}{draw(sp)}({draw(sp)}{body}{draw(sp)})", name, opts


@fuzz(300)
@given(_plan_string())
def test_plan_string_parses_to_its_options(case):
  from recgnn import planner

  text, name, opts = case
  assert planner.parse_backend(text) == (name, opts)


@fuzz(400)
@given(
  st.one_of(
    st.text(alphabet="abtr_(),=' \"0123456789.-+[]{}:*\\\n\x00", max_size=40),
    _plan_string()
    .map(lambda c: c[0])
    .flatmap(
      lambda t: st.integers(0, len(t)).map(lambda i: t[:i])  # truncated
    ),
  )
)
def test_plan_string_is_parsed_or_refused_naming_it(text):
  """Anything: a (name, options) pair, or ValueError quoting the string; never another
  exception (SyntaxError, TypeError, ...) from deep inside the parser."""
  from recgnn import planner

  try:
    name, opts = planner.parse_backend(text)
  except ValueError as e:
    assert repr(text) in str(e), str(e)
    return
  assert name.isidentifier() and all(isinstance(k, str) for k in opts)


# ----------------------------------------------------------------------------- --config


def _leaves(config, prefix=""):
  for k, v in config.items():
    if hasattr(v, "items"):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def _get(config, key):
  for part in key.split("."):
    config = config[part]
  return config


@pytest.fixture(scope="module")
def smoke_cfg():
  import run

  return run.load_config("smoke")


def _typed_value(draw, v):
  """A value of the leaf's type and its command-line text."""
  if isinstance(v, bool):
    b = draw(st.booleans())
    return b, draw(st.sampled_from([str(b), str(b).lower()]))
  if isinstance(v, int):
    i = draw(st.integers(-(10**9), 10**9))
    return i, str(i)
  if isinstance(v, float):
    f = draw(st.floats(allow_nan=False, allow_infinity=False))
    return f, repr(f)
  if isinstance(v, tuple) and all(isinstance(x, int) for x in v):
    t = tuple(draw(st.lists(st.integers(1, 4096), min_size=1, max_size=4)))
    return t, draw(st.sampled_from([repr(t), repr(t).replace(" ", "")]))
  s = draw(st.text(string.ascii_letters + string.digits + "_-./:", max_size=12))
  return s, s


@fuzz(150)
@given(data=st.data())
def test_config_overrides_set_the_typed_value(smoke_cfg, data):
  import run

  def simple(v):  # (a tuple of strings or pairs, like the plan, has its own test above)
    if isinstance(v, tuple):
      return bool(v) and all(isinstance(x, int) for x in v)
    return isinstance(v, (bool, int, float, str))

  leaves = {k: v for k, v in _leaves(smoke_cfg) if simple(v)}
  key = data.draw(st.sampled_from(sorted(leaves)))
  value, text = _typed_value(data.draw, leaves[key])
  out = run.apply_overrides(smoke_cfg, [f"--config.{key}={text}"])
  assert _get(out, key) == value
  assert _get(smoke_cfg, key) == leaves[key]  # the experiment's config is not changed


@fuzz(300)
@given(
  key=st.one_of(
    st.sampled_from(
      [
        "train.steps",
        "model.bottom",
        "train.shuffle",
        "optimizer.learning_rate",
        "data.path",
        "seed",
        "embeddings.plan",
      ]
    ),
    st.from_regex(r"[a-z_.]{1,20}", fullmatch=True),
  ),
  text=st.text(alphabet="0123456789()[],.'\" abxTrueFalse-=e", max_size=16),
  bare=st.booleans(),
)
def test_config_override_is_applied_or_refused_in_one_line(smoke_cfg, key, text, bare):
  """Any `--config.KEY=TEXT` (or a bare `--config.KEY`): applied with the key's type, or
  SystemExit naming the unknown key, or ValueError naming the override; nothing else."""
  import run

  arg = f"--config.{key}" if bare else f"--config.{key}={text}"
  try:
    out = run.apply_overrides(smoke_cfg, [arg])
  except SystemExit as e:
    assert isinstance(e.code, str) and "Unknown config key" in e.code, e.code
    return
  except ValueError as e:
    msg = str(e)
    assert msg.startswith("Bad override: ") and "\n" not in msg, msg
    return
  old, new = _get(smoke_cfg, key), _get(out, key)
  assert type(new) is type(old) or (old is None), (key, old, new)
