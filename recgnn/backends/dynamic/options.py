"""`dynamic(...)`'s options (see recgnn/backends/dynamic/__init__.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from recgnn.backends.dynamic import id_map

#: What a reused row starts from (`DynamicOptions.reset`).
RESETS = ("rows", "none")


@dataclasses.dataclass(frozen=True)
class DynamicOptions(id_map.Policy):
  """`dynamic(...)`'s options: the id map's `Policy` (capacity, admit, k, evict, ttl,
  pending, bloom: its docstring and id_map's EVICTIONS / ADMISSIONS) and

  Attributes:
    inner: the backend string the rows live in (`dense`, `offload(cache_fraction=0.5)`,
      `hot_cold(budget=0.1)`, `sharded(kind=row)`, `tt(rank=8)`); its tables get `capacity`
      rows.
    reset: what a reused row starts from (every evict but `none` reuses rows): `rows` (fresh
      initial values and optimizer state, set by the inner backend in the step:
      `Capabilities.resets_rows`) or `none` (the row as the evicted id left it, any inner
      backend: the only choice for one whose rows are not independent parameters, tt).
    seed: the reused rows' initial values are drawn from (seed, table, reset number).
  """

  backend: ClassVar[str] = "dynamic"
  inner: str = "dense"
  reset: str = "rows"
  seed: int = 0

  def __post_init__(self):
    super().__post_init__()  # (the policy's checks: capacity, admit, k, evict, ttl)
    if self.reset not in RESETS:
      raise ValueError(f"dynamic: reset must be one of {', '.join(RESETS)}; got {self.reset!r}")
    if self.inner.split("(")[0].strip() == "dynamic":
      raise ValueError("dynamic: inner cannot be dynamic")

  def policy(self) -> id_map.Policy:
    """The id map's policy alone (every table of the group gets its own map with it)."""
    return id_map.Policy(
      **{f.name: getattr(self, f.name) for f in dataclasses.fields(id_map.Policy)}
    )

  def format(self) -> str:
    """The checkpoint format's words for what makes a saved map and table mean something:
    capacity, policy and reset (a resume with others is refused naming both)."""
    p = self.policy()
    admit = self.admit if self.admit == "always" else f"{self.admit}({self.k})"
    evict = f"ttl({self.ttl})" if self.evict == "ttl" else self.evict
    # reset=rows, the default, unwritten (the format checkpoints had before the option), and
    # no reset under evict=none (no row is reused, so it changes nothing).
    reset = ", reset=none" if self.reset == "none" and self.evict != "none" else ""
    return f"dynamic(capacity={p.capacity}, admit={admit}, evict={evict}{reset})"
