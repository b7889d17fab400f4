"""`offload(...)`'s plan-string options: one frozen dataclass, parsed by
`base.BackendOptions.parse` (an option it cannot honour is refused with the reason)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from recgnn.backends.offload.cache_plan import POLICIES
from recgnn.backends.offload.row_file import IO_MODES
from recgnn.embeddings import base

MAX_LOOKAHEAD = 4096  # batches (see `OffloadOptions.__post_init__`)

EXCHANGES = ("fixed", "bucket", "pow2")


@dataclasses.dataclass(frozen=True)
class OffloadOptions(base.BackendOptions):
  """`offload(...)`'s options: exactly one of `cache_rows` and `cache_fraction`.

  Attributes:
    cache_rows: device cache size in rows (capped at the table's rows).
    cache_fraction: the cache as a fraction of the rows, in (0, 1].
    min_cache_rows: a floor under `cache_fraction`'s rows (refused with `cache_rows`).
    policy: `lru`, `lfu` (per-row access counts since init/restore, ties by recency) or
      `lookahead` (never evicts a row needed within the look-ahead window while the cache
      can hold the window; then farthest next use first).
    lookahead: upcoming batches `prepare` wants (the trainer passes them). >= 1 prefetches
      batch k+1 inside step k; 0 loads every batch on demand inside its own step. At most
      MAX_LOOKAHEAD (4096).
    exchange: the length of the exchange lists, which are shapes of the step (each new
      one compiles it). Every table of the group with the same row layout (dim, optimizer)
      has its exchange in ONE list per direction ("now": on demand, "next": prefetched),
      table after table (`OffloadGroup`), so the step's shape is one length per list, not
      one per table. `bucket` (default): the list holds the group's real misses, rounded up
      to an eighth-octave length (8, 9, .., 15, 16, 18, .., 30, 32, 36, ..: at most 12.5%
      padding) with hysteresis (`cache_plan.Sizer`: grow at once, shrink every
      `cache_plan.PATIENCE` steps, once the misses are stable, straight to what the latest
      ones need): the host link carries ~1.05-1.2x the missed rows,
      fewer as the cache grows, and a 26-table group compiles a few shapes over a long
      stream (tests/test_offload_tiers.py). `fixed`: the sum over the tables of min(ids per
      batch, C): one shape, but that many rows move each step whatever the hit rate.
      `pow2`: the next power of two >= the misses, no hysteresis (more padding and more
      shape changes than `bucket`). Padding is dropped on the device and the host; stats
      count real rows and the lists' rows apart.
    storage: where the whole table and its optimizer state live. `ram` (default): numpy
      arrays in host RAM. `ssd:DIR` (quoted in a plan string: storage='ssd:/mnt/nvme/rows'):
      one row file per table in DIR (made if missing; refused when not writable or short
      of the files' bytes), a host-RAM cache of `host_cache` of the rows between it and the
      device cache (disk_rows.py): tables larger than RAM.
    host_cache: with storage=ssd:DIR, the host-RAM cache as a fraction of each table's rows,
      in (0, 1] (required there; refused with storage=ram, which keeps every row in RAM).
    io: with storage=ssd:DIR, how the row files are read: `direct` (default: O_DIRECT, rows
      padded to the disk's logical block: the disk reads the rows asked for and nothing
      else, and no page cache grows beside the host budget) or `buffered` (the page cache:
      each row costs a 4 KiB page read; benchmarks/ssd_io.py).
  """

  backend: ClassVar[str] = "offload"

  cache_rows: int | None = None
  cache_fraction: float | None = None
  min_cache_rows: int = 0
  policy: str = "lru"
  lookahead: int = 8
  exchange: str = "bucket"
  storage: str = "ram"
  host_cache: float | None = None
  io: str = "direct"

  @property
  def storage_dir(self) -> str | None:
    """The row files' directory (storage=ssd:DIR), None for storage=ram."""
    return self.storage[4:] if self.storage.startswith("ssd:") else None

  def host_cache_rows(self, num_rows: int) -> int:
    """A table's host-cache rows at the SSD level (`host_cache`: a fraction of its rows)."""
    return max(1, min(num_rows, math.ceil(self.host_cache * num_rows)))

  def __post_init__(self):
    if (self.cache_rows is None) == (self.cache_fraction is None):
      raise ValueError(
        "offload: give exactly one of cache_rows=ROWS or cache_fraction=F, e.g. "
        "offload(cache_rows=200_000)"
      )
    if self.cache_rows is not None:
      if self.min_cache_rows:
        raise ValueError(
          f"offload: min_cache_rows={self.min_cache_rows} is a floor under cache_fraction's "
          f"rows; with cache_rows={self.cache_rows} the size is given: drop min_cache_rows"
        )
      if self.cache_rows <= 0:
        raise ValueError(f"offload: cache_rows must be > 0, got {self.cache_rows}")
    elif not 0 < self.cache_fraction <= 1:
      raise ValueError(f"offload: cache_fraction must be in (0, 1], got {self.cache_fraction}")
    if self.policy not in POLICIES:
      raise ValueError(f"offload: unknown policy {self.policy!r}; available: {', '.join(POLICIES)}")
    if self.lookahead < 0:
      raise ValueError(f"offload: lookahead must be >= 0, got {self.lookahead}")
    if self.policy == "lookahead" and self.lookahead < 1:
      raise ValueError("offload: policy=lookahead needs lookahead>=1 (its window)")
    if self.lookahead > MAX_LOOKAHEAD:
      # (the compiled planner keeps a window position in the low 16 bits of a slot's mark,
      # `planner.MARK_BITS`, and the ring holds lookahead + 3 batches of every table's ids)
      raise ValueError(f"offload: lookahead must be <= {MAX_LOOKAHEAD}, got {self.lookahead}")
    if self.storage != "ram" and not (self.storage.startswith("ssd:") and self.storage[4:]):
      raise ValueError(
        f"offload: storage={self.storage!r} is not a storage; use storage=ram (default) or "
        "storage='ssd:/path/to/dir' (quoted) for row files on disk"
      )
    if self.storage_dir is None:
      given = [f"{k}={v!r}" for k, v in (("host_cache", self.host_cache),) if v is not None]
      given += [f"io={self.io!r}"] if self.io != "direct" else []
      if given:
        raise ValueError(
          f"offload: {', '.join(given)} sizes / reads the host cache of the SSD level, but "
          "storage=ram keeps every row in RAM: add storage='ssd:DIR' or drop it"
        )
    else:
      if self.host_cache is None:
        raise ValueError(
          "offload: storage=ssd:DIR needs host_cache=F, the fraction of each table's rows "
          "kept in host RAM, e.g. offload(cache_fraction=0.01, host_cache=0.05, "
          "storage='ssd:/mnt/nvme/rows')"
        )
      if not 0 < self.host_cache <= 1:
        raise ValueError(f"offload: host_cache must be in (0, 1], got {self.host_cache}")
      if self.io not in IO_MODES:
        raise ValueError(f"offload: unknown io {self.io!r}; available: {', '.join(IO_MODES)}")
    if self.exchange not in EXCHANGES:
      raise ValueError(
        f"offload: unknown exchange {self.exchange!r}; available: {', '.join(EXCHANGES)}"
      )
