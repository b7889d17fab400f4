"""Table init (recgnn/embeddings/specs.py): a chunk's draw of only the rows a table uses is the
first rows of the whole chunk's draw, so small tables start from the same values as before
(and as a table initialised a piece at a time)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from recgnn.embeddings import specs


@pytest.mark.parametrize("initializer", ["uniform", "normal"])
def test_a_chunk_drawn_short_is_the_whole_chunk_cut(initializer):
  if not jax.config.jax_threefry_partitionable:
    pytest.skip("the short draw is used only with partitionable threefry")
  key = jax.random.key(7)
  whole = np.asarray(specs._init_chunk(key, 1, 0.05, 13, initializer, specs.INIT_CHUNK))
  for needed in (1, 6, 256, 257, 5000, specs.INIT_CHUNK):
    rows = specs._chunk_rows(needed)
    assert needed <= rows <= specs.INIT_CHUNK and (rows < specs.INIT_CHUNK or needed > 32768)
    got = np.asarray(specs._init_chunk(key, 1, 0.05, 13, initializer, rows))[:needed]
    np.testing.assert_array_equal(got, whole[:needed], err_msg=f"{needed} rows")


def test_a_table_is_the_same_whole_or_in_pieces():
  """Offload's host tables initialise a range at a time: rows [a, b) of a table are the same
  values as those rows of the whole table, across a chunk boundary too."""
  spec = specs.TableSpec(name="t", num_rows=specs.INIT_CHUNK + 700, dim=4)
  key = jax.random.key(1)
  whole = specs.init_rows(key, spec, 0, spec.num_rows)
  for a, b in [(0, 5), (3, 300), (specs.INIT_CHUNK - 10, specs.INIT_CHUNK + 20)]:
    np.testing.assert_array_equal(specs.init_rows(key, spec, a, b), whole[a:b])
