"""`dlrm_sharded` with the error-bounded codec on both all-to-alls (forward: pooled
embeddings; backward: their gradients), the bound adapted per table and per iteration
(recgnn/embeddings/codecs.py, `BoundRule`): 8-bit codes, 4x fewer bytes than f32, every value
within its table's bound; a message the codes cannot hold goes as f32 that step.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python run.py --experiment=dlrm_sharded_eb --workdir=/tmp/dlrm_sharded_eb

Arg (optional): more options, e.g. `:headroom=0.5`, `:eb=1e-3` (a fixed bound), `:bwd_codec=none`,
or `:widths=4, block=16`: 4-bit codes with block-wise steps (one header byte per 16 values:
4.5 bits per value, 7.1x fewer bytes than f32; docs/backends/sharded.md).
"""

from experiments import dlrm_sharded


def get_config(arg=None):
  c = dlrm_sharded.get_config()
  c.embeddings.plan = ((".*", dlrm_sharded.backend(arg, "codec=eb", name="dlrm_sharded_eb")),)
  dlrm_sharded.check_backend(c.embeddings.plan[0][1])
  return c
