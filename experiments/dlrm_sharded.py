"""DLRM (the Kaggle reference model and data of `dlrm_kaggle`) with every table `sharded`:
model-parallel tables over the mesh's MODEL axis, the embedding all-to-all uncompressed.

The mesh puts every device on MODEL (`mesh.model=-1`: pure model parallelism, the batch split
over every device too); on one device it is the 1 x 1 case. On CPU, simulate devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python run.py --experiment=dlrm_sharded --workdir=/tmp/dlrm_sharded

The placement (table-wise for tables under 1 / k of the bytes, row-wise above) and bytes per
device are printed before allocating. Arg (optional): the backend's options, e.g.
`--experiment=dlrm_sharded:kind=row` or `:codec=bf16`.
"""

from experiments import _options, dlrm_kaggle
from recgnn import planner
from recgnn.embeddings import base


def backend(arg: str | None, default: str = "", name: str = "dlrm_sharded") -> str:
  """The plan string: `sharded` with `default` and ARG's options (text the backend checks)."""
  given = _options.parse(arg, {}, name=name, rest=True, usage="sharded(...)'s options")
  options = ", ".join(x for x in (default, *(f"{k}={v}" for k, v in given.items())) if x)
  return f"sharded({options})" if options else "sharded"


def check_backend(text: str) -> None:
  """Fail now, not after the data is loaded, on an option the backend refuses."""
  planner.make_backend(text, base.TableSpec(name="C1", num_rows=1000, dim=16))


def get_config(arg=None):
  c = dlrm_kaggle.get_config()
  c.embeddings.plan = ((".*", backend(arg)),)
  check_backend(c.embeddings.plan[0][1])
  c.mesh.model = -1
  return c
