"""The built-in embedding backends: this package is their registry. Importing it registers
each (`@register_backend`); `recgnn.planner` imports it before the first look-up.

  dense      one array per table, replicated or row-sharded over the mesh (bit-exact ref.)
  tt         tensor-train compressed tables (TT-Rec), prefix-tree kernels, a hot-row cache
  offload    tables in host memory behind a device cache planned on the input thread
  hot_cold   hot rows row-sharded on the devices, cold rows on the host; micro-batches
  sharded    model-parallel tables (table-, row-, column-wise) with all-to-all codecs
  dynamic    raw 64-bit ids mapped to rows of any of these (admission, eviction), on the host

A backend of your own needs no file here: see tests/toy_backend.py and docs/architecture.md.
"""

from recgnn.backends import dense, dynamic, hot_cold, offload, sharded, tt

__all__ = ["dense", "dynamic", "hot_cold", "offload", "sharded", "tt"]
