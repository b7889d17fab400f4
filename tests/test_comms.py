"""Bytes between devices read from compiled HLO, against hand-computed sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from recgnn import comms, sharding

P = sharding.P


def test_collective_bytes_of_a_known_program():
  mesh = sharding.make_mesh(8, 1)

  @jax.jit
  @functools.partial(
    jax.shard_map,
    mesh=mesh,
    in_specs=(P(sharding.BATCH, None), P(sharding.BATCH)),
    out_specs=(P(), P(), P(sharding.BATCH, None)),
    check_vma=False,
  )
  def f(x, i):  # local x: f32[3, 5], i: int32[2]
    g = jax.lax.all_gather(x, sharding.BATCH, tiled=True)  # f32[24, 5]
    s = jax.lax.psum(i, sharding.BATCH)  # int32[2]
    r = jax.lax.psum_scatter(jnp.ones((8 * 4, 5), jnp.float32) * x[0, 0], sharding.BATCH,
                             scatter_dimension=0, tiled=True)  # fmt: skip
    return g, s, r

  x = jax.device_put(np.ones((24, 5), np.float32), sharding.named(mesh, P(sharding.BATCH, None)))
  i = jax.device_put(np.ones(16, np.int32), sharding.named(mesh, P(sharding.BATCH)))
  got = comms.compiled_summary(f.lower(x, i).compile())["by_op"]
  assert got["all-gather"]["operand_bytes"] == 3 * 5 * 4
  assert got["all-gather"]["result_bytes"] == 24 * 5 * 4
  assert got["all-reduce"]["operand_bytes"] == 2 * 4 and got["all-reduce"]["dtypes"] == ["s32"]
  assert got["reduce-scatter"]["operand_bytes"] == 32 * 5 * 4
  assert got["reduce-scatter"]["result_bytes"] == 4 * 5 * 4


def test_parses_inline_operands_and_async_pairs_once():
  text = """
  %p = f32[4,2]{1,0} parameter(0)
  %ag-start = (f32[4,2]{1,0}, f32[16,2]{1,0}) all-gather-start(f32[4,2]{1,0} %p), replica_groups=[1,4]<=[4]
  %ag-done = f32[16,2]{1,0} all-gather-done(%ag-start)
  ROOT %a2a = s8[16]{0} all-to-all(s8[16]{0} %q), replica_groups={{0,1},{2,3}}
  """  # noqa: E501
  cs = comms.collectives(text)
  assert [c.op for c in cs] == ["all-gather", "all-to-all"]
  assert cs[0].operand_bytes == 32 and cs[0].group_size == 4
  assert cs[1].operand_bytes == 16 and cs[1].group_size == 2 and cs[1].dtypes == ("s8",)
