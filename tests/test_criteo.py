"""Criteo reader, cache, splits, batches and the synthetic generator, against references."""

import math
import os
import re

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from recgnn.data import criteo
from recgnn.data import criteo_synthetic as cs
from tests.trainer_lib import flip_byte

quiet = None  # progress sink for tests

# Hand-written lines: empty fields, negatives, an uppercase hex value, CRLF, no final newline.
HAND = (
  "1\t5\t-3\t\t0\t123456789\t7\t\t\t\t\t\t\t12\t68fd1e64\t\t0000000a\tFFFFFFFF" + "\t" * 22 + "\n"
  "0\t\t\t\t\t\t\t\t\t\t\t\t\t\t" + "\t".join(["deadbeef"] * 26) + "\r\n"
  "1\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + "\t".join(["0123abcd"] * 26)
)


def read(path, mode="r"):
  with open(path, mode) as f:
    return f.read()


def write(path, text):
  with open(path, "w", newline="") as f:
    f.write(text)
  return str(path)


def parse_file(path, block_bytes=1 << 20):
  """All blocks of a file through the vectorized parser, concatenated."""
  parts = [criteo.parse_block(buf, size) for buf, size, _ in criteo.iter_blocks(path, block_bytes)]
  bad, offset = [], 0
  for p in parts:
    bad += [(offset + i + 1, r) for i, r in p.bad]
    offset += p.num_lines
  cat = lambda k: np.concatenate([getattr(p, k) for p in parts])
  return cat("labels"), cat("dense"), cat("raw"), cat("missing"), bad


def reference_parse(path):
  """Line-by-line pure-Python reading of the same format (the DLRM rules)."""
  labels, dense, raw, missing, bad = [], [], [], [], []
  with open(path, "rb") as f:
    for no, line in enumerate(f.read().decode("latin1").splitlines(), 1):
      cols = line.split("\t")
      if len(cols) != 40:
        bad.append((no, "columns"))
        continue
      if cols[0] not in ("0", "1"):
        bad.append((no, "label"))
        continue
      if not all(c == "" or re.fullmatch(r"-?[0-9]+", c) for c in cols[1:14]):
        bad.append((no, "dense"))
        continue
      if not all(c == "" or re.fullmatch(r"[0-9a-fA-F]{8}", c) for c in cols[14:]):
        bad.append((no, "categorical"))
        continue
      labels.append(int(cols[0]))
      dense.append([math.log(max(int(c or 0), 0) + 1) for c in cols[1:14]])
      raw.append([int(c, 16) if c else 0 for c in cols[14:]])
      missing.append([c == "" for c in cols[14:]])
  return np.array(labels), np.array(dense), np.array(raw), np.array(missing), bad


@pytest.fixture(scope="module")
def small_tsv(tmp_path_factory):
  """3000 generated lines with malformed lines of every kind mixed in."""
  root = tmp_path_factory.mktemp("small")
  path = str(root / "train.txt")
  cs.generate_tsv(
    path, cs.SyntheticConfig(num_rows=3000, scale=1e-3, seed=3, calibration_rows=10_000), quiet
  )
  lines = read(path).splitlines(keepends=True)
  good = lines[10]
  cols = good.rstrip("\n").split("\t")
  broken = {
    5: "\t".join(cols[:-1]) + "\n",  # 38 tabs
    100: good.rstrip("\n") + "\textra\n",  # 40 tabs
    200: "2" + good[1:],  # bad label
    300: "\t".join([cols[0], "1x", *cols[2:]]) + "\n",  # non-integer dense
    400: "\t".join([*cols[:14], "68fd1e6g", *cols[15:]]) + "\n",  # bad hex
    500: "\t".join([*cols[:14], "68fd1e6", *cols[15:]]) + "\n",  # 7 hex chars
    600: "\n",  # empty line
    700: "\t".join([cols[0], "-", *cols[2:]]) + "\n",  # a lone minus
  }
  for i, text in broken.items():
    lines[i] = text
  with open(path, "w") as f:
    f.writelines(lines)
  return path, {i + 1 for i in broken}


# ----------------------------------------------------------------------------- parsing


def test_hand_written_lines(tmp_path):
  path = write(tmp_path / "hand.txt", HAND)
  labels, dense, raw, missing, bad = parse_file(path)
  assert bad == []
  np.testing.assert_array_equal(labels, [1, 0, 1])
  expect0 = np.log1p(np.float32([5, 0, 0, 0, 123456789, 7, 0, 0, 0, 0, 0, 0, 12]))
  np.testing.assert_allclose(dense[0], expect0, rtol=1e-6)
  np.testing.assert_array_equal(dense[1], np.zeros(13))
  np.testing.assert_allclose(dense[2], np.log1p(np.arange(1, 14, dtype=np.float32)), rtol=1e-6)
  np.testing.assert_array_equal(raw[0, :4], [0x68FD1E64, 0, 0xA, 0xFFFFFFFF])
  np.testing.assert_array_equal(missing[0], [False, True, False, False] + [True] * 22)
  np.testing.assert_array_equal(raw[1], [0xDEADBEEF] * 26)  # the \r is not part of C26
  np.testing.assert_array_equal(raw[2], [0x0123ABCD] * 26)


def test_matches_python_reference(small_tsv):
  path, _ = small_tsv
  got = parse_file(path, block_bytes=1 << 16)  # many blocks: lines cross block edges
  ref = reference_parse(path)
  np.testing.assert_array_equal(got[0], ref[0])
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-6)
  np.testing.assert_array_equal(got[2], ref[2])
  np.testing.assert_array_equal(got[3], ref[3])
  assert got[4] == ref[4]
  assert len(ref[0]) == 3000 - 8


def test_long_and_odd_integers(tmp_path):
  cats = "\t".join(["00000001"] * 26)
  lines = ["1\t123456789012\t-99999999999\t00" + "\t" * 11 + cats, "0\t+5" + "\t" * 13 + cats]
  path = write(tmp_path / "long.txt", "\n".join(lines) + "\n")
  labels, dense, _, _, bad = parse_file(path)
  assert bad == [(2, "dense")]  # '+5' is not how Criteo writes integers
  np.testing.assert_allclose(dense[0, :3], np.log1p(np.float32([123456789012, 0, 0])))


def test_not_a_tsv_file(tmp_path):
  path = write(tmp_path / "blob", "x" * 300_000)  # no newline at all
  with pytest.raises(criteo.MalformedDataError, match="no newline.*block_bytes"):
    parse_file(path, block_bytes=1 << 16)
  assert parse_file(path, block_bytes=1 << 20)[4] == [(1, "columns")]  # one long bad line


# ----------------------------------------------------------------------------- malformed


def test_malformed_lines_reported(small_tsv, tmp_path):
  path, bad_lines = small_tsv
  reader = criteo.ReaderConfig(categorical="hash", hash_sizes=1000, max_bad_lines=8)
  ds = criteo.open_criteo(path, str(tmp_path), reader=reader, progress=quiet)
  rec = ds.manifest["bad_lines"][os.path.abspath(path)]
  assert rec["count"] == 8 == ds.manifest["num_bad_lines"]
  assert {e["line"] for e in rec["examples"]} == bad_lines
  assert rec["by_reason"] == {"columns": 3, "label": 1, "dense": 2, "categorical": 2}
  assert ds.num_rows == 3000 - 8


def test_error_budget(small_tsv, tmp_path):
  path, _ = small_tsv
  reader = criteo.ReaderConfig(categorical="hash", hash_sizes=1000, max_bad_lines=7)
  with pytest.raises(criteo.MalformedDataError, match=r"8 malformed lines.*max_bad_lines") as e:
    criteo.open_criteo(path, str(tmp_path), reader=reader, progress=quiet)
  assert os.path.abspath(path) in str(e.value) and "line 6 (columns)" in str(e.value)
  # The fraction budget: 8 of 3000 lines is < 0.3 %.
  ok = criteo.ReaderConfig(
    categorical="hash", hash_sizes=1000, max_bad_lines=0, max_bad_fraction=0.003
  )
  assert criteo.open_criteo(path, str(tmp_path), reader=ok, progress=quiet).num_rows == 2992
  # A cached conversion is re-checked against a stricter budget.
  with pytest.raises(criteo.MalformedDataError):
    criteo.open_criteo(path, str(tmp_path), reader=reader, progress=quiet)


def test_worker_processes_match_in_process(small_tsv, tmp_path):
  path, _ = small_tsv
  kw = dict(categorical="frequency", max_bad_lines=8, block_bytes=1 << 16)
  one = criteo.open_criteo(
    path, str(tmp_path / "a"), reader=criteo.ReaderConfig(**kw), progress=quiet
  )
  two = criteo.open_criteo(
    path, str(tmp_path / "b"), reader=criteo.ReaderConfig(num_workers=2, **kw), progress=quiet
  )
  for name in ("labels", "dense", "sparse"):
    np.testing.assert_array_equal(getattr(one, name), getattr(two, name))
  assert one.cardinalities == two.cardinalities
  assert one.manifest["bad_lines"] == two.manifest["bad_lines"]


# ----------------------------------------------------------------------------- splits


def reference_kaggle_split(n, days=7):
  """facebookresearch/dlrm data_utils.getCriteoAdData, split part."""
  per, extras = divmod(n, days)
  total_per_file = [per] * days
  for j in range(extras):
    total_per_file[j] += 1
  offsets = np.cumsum([0] + total_per_file)
  indices = np.array_split(np.arange(n), offsets[1:-1])
  train = np.concatenate(indices[:-1])
  test, val = np.array_split(indices[-1], 2)
  return train, test, val


@pytest.mark.parametrize("n", [14, 100, 45840617, 45840617 + 3, 7 * 1000 + 6])
def test_kaggle_split_matches_reference(n):
  got = criteo.kaggle_split(n)
  if n > 10**6:  # the reference materialises indices: compare the formula only
    per, extras = divmod(n, 7)
    last = n - per
    assert got["train"] == (0, last) and got["test"][0] == last
    assert got["test"][1] - last == -(-per // 2) and got["valid"][1] == n
    return
  train, test, val = reference_kaggle_split(n)
  for name, ref in (("train", train), ("test", test), ("valid", val)):
    assert got[name] == (ref[0], ref[-1] + 1), name


def test_terabyte_days_last_file_split(small_tsv, tmp_path):
  path, bad_lines = small_tsv
  lines = read(path).splitlines(keepends=True)
  days = [lines[:600], lines[600:1500], lines[1500:]]
  paths = [write(tmp_path / f"day_{d}", "".join(part)) for d, part in enumerate(days)]
  reader = criteo.ReaderConfig(categorical="hash", hash_sizes=1000, max_bad_lines=8)
  ds = criteo.open_criteo(paths, str(tmp_path / "c"), reader=reader, split="last_file")
  one = criteo.open_criteo(path, str(tmp_path / "c"), reader=reader)
  np.testing.assert_array_equal(ds.sparse, one.sparse)
  assert sorted(bad_lines) == [6, 101, 201, 301, 401, 501, 601, 701]
  assert ds.manifest["file_rows"] == [600 - 6, 900 - 2, 1500]
  last = 594 + 898
  assert ds.splits == {
    "train": (0, last),
    "test": (last, last + 750),
    "valid": (last + 750, last + 1500),
  }
  # Line numbers restart in each file.
  day1 = ds.manifest["bad_lines"][os.path.abspath(paths[1])]
  assert {e["line"] for e in day1["examples"]} == {1, 101}


# ----------------------------------------------------------------------------- ids


def test_frequency_and_hash_ids(small_tsv, tmp_path):
  path, _ = small_tsv
  _, _, raw, missing, _ = reference_parse(path)
  budget = {"max_bad_lines": 8}
  freq = criteo.open_criteo(
    path,
    str(tmp_path),
    reader=criteo.ReaderConfig(categorical="frequency", min_count=2, **budget),
    progress=quiet,
  )
  hashed = criteo.open_criteo(
    path,
    str(tmp_path),
    reader=criteo.ReaderConfig(categorical="hash", hash_sizes=tuple(range(50, 76)), **budget),
    progress=quiet,
  )
  for t in range(26):
    vals, counts = np.unique(raw[~missing[:, t], t], return_counts=True)
    order = np.lexsort((vals, -counts))
    kept = counts[order] >= 2
    expect = {int(v): criteo.FIRST_ID + i for i, v in enumerate(vals[order][kept])}
    ids = np.array(
      [
        criteo.MISSING_ID if m else expect.get(int(v), criteo.UNKNOWN_ID)
        for v, m in zip(raw[:, t], missing[:, t])
      ]
    )
    np.testing.assert_array_equal(freq.sparse[:, t], ids)
    assert freq.cardinalities[t] == criteo.FIRST_ID + kept.sum()
    size = 50 + t
    hid = np.where(missing[:, t], 0, 2 + raw[:, t] % (size - 2))
    np.testing.assert_array_equal(hashed.sparse[:, t], hid)
    assert hashed.cardinalities[t] == size
    assert hashed.sparse[:, t].max() < size and freq.sparse[:, t].max() < freq.cardinalities[t]
  assert (freq.sparse == criteo.UNKNOWN_ID).any() and (freq.sparse == criteo.MISSING_ID).any()
  files = ["dense.npy", "labels.npy", "manifest.json", "sparse.npy"]
  assert sorted(os.listdir(freq.path)) == files  # the raw-value temporaries are gone


def test_vocab_lookup_sorted_path(monkeypatch):
  rng = np.random.default_rng(0)
  vals = np.unique(rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32))
  ids = rng.permutation(vals.size).astype(np.int32) + criteo.FIRST_ID
  raw = np.where(rng.random((3000, 26)) < 0.5, vals[rng.integers(0, vals.size, (3000, 26))], 7)
  raw = raw.astype(np.uint32)
  missing = rng.random((3000, 26)) < 0.1
  vocab = [(vals, ids)] * 26
  plain = criteo._vocab_ids(raw, missing, vocab)
  monkeypatch.setattr(criteo, "_SORTED_LOOKUP", 0)
  np.testing.assert_array_equal(criteo._vocab_ids(raw, missing, vocab), plain)
  monkeypatch.setattr(criteo, "_SORTED_LOOKUP", 1 << 30)
  np.testing.assert_array_equal(criteo._vocab_ids(raw, missing, vocab), plain)
  lookup = dict(zip(vals.tolist(), ids.tolist()))
  expect = [[lookup.get(int(v), criteo.UNKNOWN_ID) for v in row] for row in raw]
  np.testing.assert_array_equal(plain, np.where(missing, criteo.MISSING_ID, expect))


# ----------------------------------------------------------------------------- cache


def test_cache_reuse_and_invalidation(tmp_path):
  cfg = cs.SyntheticConfig(num_rows=700, scale=1e-4, seed=1, calibration_rows=10_000)
  path = str(tmp_path / "train.txt")
  cs.generate_tsv(path, cfg, quiet)
  cache = str(tmp_path / "cache")
  first = criteo.open_criteo(path, cache, progress=quiet)
  assert not first.reused_cache
  stamp = os.stat(os.path.join(first.path, "sparse.npy")).st_mtime_ns
  second = criteo.open_criteo(path, cache, progress=quiet)
  assert second.reused_cache and second.path == first.path
  assert os.stat(os.path.join(second.path, "sparse.npy")).st_mtime_ns == stamp
  np.testing.assert_array_equal(second.sparse, first.sparse)
  assert isinstance(second.dense, np.memmap)
  # Different reader settings: another cache beside it.
  other = criteo.open_criteo(
    path, cache, reader=criteo.ReaderConfig(categorical="hash", hash_sizes=99), progress=quiet
  )
  assert not other.reused_cache and other.path != first.path
  # A changed source: rebuilt, with the new contents.
  lines = read(path).splitlines(keepends=True)
  with open(path, "w") as f:
    f.writelines(lines[:350])
  third = criteo.open_criteo(path, cache, progress=quiet)
  assert not third.reused_cache and third.num_rows == 350


def test_a_damaged_cache_is_refused_or_rebuilt_never_read(tmp_path):
  """A converted dataset's array truncated to half its bytes (a copy cut short, a full disk),
  or swapped with another cache's: opening the dataset with its source at hand rebuilds the
  cache (and says why); opening the cache alone refuses it naming the file and the fix. It
  was `ValueError: mmap length is greater than file size` and nothing else, or, for a
  same-sized file, wrong data read silently."""
  cfg = cs.SyntheticConfig(num_rows=700, scale=1e-4, seed=1, calibration_rows=10_000)
  path = str(tmp_path / "train.txt")
  cs.generate_tsv(path, cfg, quiet)
  cache = str(tmp_path / "cache")
  good = criteo.open_criteo(path, cache, progress=quiet)
  want = np.array(good.sparse)
  sparse = os.path.join(good.path, "sparse.npy")
  size = os.path.getsize(sparse)
  del good
  with open(sparse, "r+b") as f:
    f.truncate(size // 2)
  with pytest.raises(ValueError, match=r"sparse\.npy has .* bytes where its manifest records"):
    criteo.CriteoDataset(os.path.dirname(sparse))
  said = []
  again = criteo.open_criteo(path, cache, progress=said.append)
  assert not again.reused_cache and any("the cache is damaged" in m for m in said), said
  np.testing.assert_array_equal(again.sparse, want)
  # The same bytes, other contents (another cache's array): refused too.
  labels = os.path.join(again.path, "labels.npy")
  del again
  with open(labels, "r+b") as f:
    f.seek(200)
    f.write(bytes([1 - f.read(1)[0] % 2]))
  with pytest.raises(ValueError, match="first bytes differ"):
    criteo.CriteoDataset(os.path.dirname(labels))
  # A damaged manifest: refused naming it (it was a bare JSONDecodeError), then rebuilt.
  manifest = os.path.join(os.path.dirname(labels), "manifest.json")
  with open(manifest, "r+b") as f:
    f.truncate(os.path.getsize(manifest) // 2)
  with pytest.raises(ValueError, match=r"manifest\.json is missing or damaged\. Delete"):
    criteo.CriteoDataset(os.path.dirname(labels))
  third = criteo.open_criteo(path, cache, progress=quiet)
  assert not third.reused_cache
  np.testing.assert_array_equal(third.sparse, want)


def test_damaged_synthetic_files_are_generated_again(tmp_path):
  """The generated TSV cut short (which the CTR cache would take for a changed source and
  convert silently) and the oracle probabilities with a flipped byte: the oracle read refuses
  naming the file, and opening the default dataset generates both again, saying why."""
  cfg = cs.SyntheticConfig(num_rows=700, scale=1e-4, seed=1, calibration_rows=10_000)
  root = str(tmp_path)
  first = cs.default_synthetic_dataset(root, config=cfg, progress=quiet)
  tsv, want = first.tsv_path, read(first.tsv_path, "rb")
  probs = tsv + ".oracle.npy"
  want_probs = np.array(first.oracle_probabilities())
  flip_byte(probs, 150)
  with pytest.raises(ValueError, match=r"oracle\.npy's first bytes differ.*Delete"):
    cs.oracle_probabilities(tsv)
  with open(tsv, "r+b") as f:
    f.truncate(len(want) // 2)
  said = []
  again = cs.default_synthetic_dataset(root, config=cfg, progress=said.append)
  assert any("generating" in m and "train.txt has" in m for m in said), said
  assert read(tsv, "rb") == want and again.dataset.num_rows == first.dataset.num_rows
  np.testing.assert_array_equal(again.oracle_probabilities(), want_probs)


# ----------------------------------------------------------------------------- batches


SYNTHETIC = cs.SyntheticConfig(num_rows=120_000, scale=1e-3, seed=0, calibration_rows=50_000)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("synthetic"))
  return cs.default_synthetic_dataset(root, config=SYNTHETIC, progress=quiet)


def same_batch(a, b):
  for k in ("dense", "label", "weight"):
    np.testing.assert_array_equal(a[k], b[k])
  assert a["ids"].keys() == b["ids"].keys()
  for k in a["ids"]:
    np.testing.assert_array_equal(a["ids"][k], b["ids"][k])


def test_batches_resume_and_cover(synthetic):
  ds = synthetic.dataset
  kw = dict(shuffle_seed=7, num_epochs=2)
  per_epoch = ds.num_batches("train", 4096)
  full = list(ds.batches("train", 4096, **kw))
  assert len(full) == 2 * per_epoch
  resumed = list(ds.batches("train", 4096, start_step=per_epoch - 2, **kw))
  for a, b in zip(full[per_epoch - 2 :], resumed, strict=True):
    same_batch(a, b)
  b = full[0]
  assert b["dense"].shape == (4096, 13) and b["dense"].dtype == np.float32
  assert b["label"].shape == b["weight"].shape == (4096,)
  assert list(b["ids"]) == list(criteo.TABLE_NAMES)
  assert all(v.shape == (4096, 1) and v.dtype == np.int32 for v in b["ids"].values())
  # One epoch visits distinct rows; the two epochs are ordered differently.
  rows0 = np.concatenate([ds.batch_rows("train", s, 4096, shuffle_seed=7) for s in range(5)])
  assert np.unique(rows0).size == rows0.size
  e0 = ds.batch_rows("train", 0, 4096, shuffle_seed=7)
  e1 = ds.batch_rows("train", per_epoch, 4096, shuffle_seed=7)
  assert not np.array_equal(e0, e1)
  # The batch holds exactly the rows it names.
  rows = ds.batch_rows("train", 3, 4096, shuffle_seed=7)
  np.testing.assert_array_equal(full[3]["label"], ds.labels[rows])
  np.testing.assert_array_equal(full[3]["ids"]["C5"][:, 0], ds.sparse[rows, 4])


def test_eval_batches_padded(synthetic):
  ds = synthetic.dataset
  n = ds.split_size("test")
  batches = list(ds.batches("test", 1000, drop_remainder=False))
  assert len(batches) == -(-n // 1000)
  assert all(b["label"].shape == (1000,) for b in batches)
  assert sum(b["weight"].sum() for b in batches) == n
  last = batches[-1]
  pad = last["weight"] == 0
  assert pad.sum() == len(batches) * 1000 - n and (last["ids"]["C1"][pad] == 0).all()
  lo, hi = ds.splits["test"]
  labels = np.concatenate([b["label"][b["weight"] > 0] for b in batches])
  np.testing.assert_array_equal(labels, ds.labels[lo:hi])


def test_process_slices_make_up_the_batch(synthetic):
  """Each of 4 processes reads its contiguous quarter of every batch (train, and the last,
  padded eval batch); together they are the batch."""
  ds = synthetic.dataset
  n = ds.split_size("test")
  for split, step, kw in (("train", 3, {"shuffle_seed": 7}),
                          ("test", -(-n // 1000) - 1, {"drop_remainder": False})):  # fmt: skip
    whole = ds.batch(split, step, 1000, **kw)
    parts = [ds.batch(split, step, 1000, shard=(i, 4), **kw) for i in range(4)]
    assert all(p["label"].shape == (250,) for p in parts)
    cat = {k: np.concatenate([p[k] for p in parts]) for k in ("dense", "label", "weight")}
    cat["ids"] = {t: np.concatenate([p["ids"][t] for p in parts]) for t in whole["ids"]}
    same_batch(whole, cat)
  with pytest.raises(ValueError, match="does not split over 3 processes"):
    ds.batch("train", 0, 1000, shard=(0, 3))


# ----------------------------------------------------------------------------- synthetic


def test_generator_deterministic(tmp_path):
  cfg = cs.SyntheticConfig(num_rows=500, scale=1e-4, seed=5, calibration_rows=10_000)
  a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
  cs.generate_tsv(a, cfg, quiet)
  cs.generate_tsv(b, cfg, quiet)
  assert read(a, "rb") == read(b, "rb")
  c = str(tmp_path / "c.txt")
  cs.generate_tsv(
    c, cs.SyntheticConfig(num_rows=500, scale=1e-4, seed=6, calibration_rows=10_000), quiet
  )
  assert read(a, "rb") != read(c, "rb")


def test_oracle_auc_matches_sklearn(synthetic):
  ds = synthetic.dataset
  probs = synthetic.oracle_probabilities()
  assert probs.shape == (ds.num_rows,)  # generated files have no malformed lines
  for split in ("test", "valid"):
    lo, hi = ds.splits[split]
    ref = roc_auc_score(ds.labels[lo:hi], probs[lo:hi])
    assert synthetic.oracle_auc[split] == pytest.approx(ref, abs=1e-9)
  # The labels are drawn from the stored probabilities.
  assert abs(ds.labels[:].mean() - probs.mean()) < 0.01
  assert 0.75 < synthetic.oracle_auc["test"] < 0.85


def test_default_dataset_reused(synthetic):
  stamp = os.stat(synthetic.tsv_path).st_mtime_ns
  root = os.path.dirname(os.path.dirname(synthetic.tsv_path))
  again = cs.default_synthetic_dataset(root, config=SYNTHETIC, progress=quiet)
  assert again.dataset.reused_cache and again.oracle_auc == synthetic.oracle_auc
  assert os.stat(again.tsv_path).st_mtime_ns == stamp  # not regenerated
  assert again.dataset.cardinalities == synthetic.dataset.cardinalities


def test_dense_only_baseline_below_oracle(synthetic):
  dense_auc = cs.dense_only_baseline_auc(synthetic.dataset)
  assert 0.5 < dense_auc < synthetic.oracle_auc["test"] - 0.05


def test_roc_auc_matches_sklearn():
  rng = np.random.default_rng(0)
  scores = rng.integers(0, 20, 2000).astype(float)  # many ties
  labels = rng.random(2000) < 0.3
  weights = rng.integers(0, 3, 2000).astype(float)
  assert cs.roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))
  assert cs.roc_auc(scores, labels, weights) == pytest.approx(
    roc_auc_score(labels, scores, sample_weight=weights)
  )


def test_expected_auc_matches_sampling():
  rng = np.random.default_rng(1)
  p = 1 / (1 + np.exp(-rng.normal(-1, 1.5, 200_000)))
  y = rng.random(p.size) < p
  assert cs.expected_auc(p) == pytest.approx(roc_auc_score(y, p), abs=0.005)
