"""hot_cold's next-batch prefetch (issue 24): step k gathers batch k + 1's cold rows from the
host tables as they came into it, into a device buffer step k + 1 reads.

  - exact: bit-equal to dense on 1x1, 8x1 and 2x4 over Zipf streams whose consecutive
    batches share cold rows (from_now: their host copy is stale during step k), with
    migrations (from_hot: rows leaving the hot set) and eval passes inside, and across a
    checkpoint resumed on another mesh; ignoring from_now breaks it (the test can fail);
  - the HLO: the next batch's host read depends on nothing the step computes, the write-back
    waits for it (no copy of the table), and neither micro-batch reads the host;
  - host-link bytes: the same rows, a step earlier (within 1.25x of the cold ids x row bytes,
    as on demand).
The warm-up's step programs: tests/test_tier_warmup.py (prefetch is on by default).
"""

import contract_lib as contract
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hot_cold import ADAGRAD, SGD, SPLIT_BATCH, _assert_same, _batches, _run_group, _specs
from test_hot_cold_tiers import _micro_step, restored

from recgnn import comms, hlo, planner, sharding
from recgnn.backends.hot_cold import HotCold
from recgnn.embeddings import base

TEXT = "hot_cold(budget=0.3, profile_batches=3, reprofile=5)"
MESHES = [(1, 1), (8, 1), (2, 4)]


def _mesh_id(m):
  return f"{m[0]}x{m[1]}"


@pytest.mark.parametrize("mesh_shape", MESHES, ids=_mesh_id)
def test_prefetch_matches_dense(mesh_shape):
  """14 batches (two tables, two row layouts), a pick and two re-picks, eval batches inside:
  bit-equal to single-device dense; the steps after the pick read prefetched rows, some of
  them updated by the step before (from_now) or just out of the hot set (from_hot)."""
  specs = _specs(SGD)
  batches = _batches(specs, n=14, batch=SPLIT_BATCH)
  mesh = contract.mesh_or_skip(*mesh_shape)
  ref = _run_group("dense", specs, batches, planner.default_mesh(), evals=(2, 6, 9))
  got = _run_group(TEXT, specs, batches, mesh, evals=(2, 6, 9))
  _assert_same(got[:2], ref[:2])
  s = got[2].stats()
  assert s["prefetched_fraction"] == 11 / 14  # every train step after the profile's 3
  assert s["next_from_now_per_step"] > 0 and s["next_from_hot_per_step"] > 0
  assert s["migrated_rows_per_step"] > 0 and s["micro_popular_size"] > 0


def test_prefetch_matches_dense_adagrad_mean():
  """Row-wise Adagrad (its accumulators travel with the rows) and mean pooling."""
  specs = _specs(ADAGRAD, "mean")
  batches = _batches(specs, n=12)
  ref = _run_group("dense", specs, batches, planner.default_mesh(), evals=(4,))
  got = _run_group(TEXT, specs, batches, sharding.make_mesh(1, 1), evals=(4,))
  _assert_same(got[:2], ref[:2])
  assert got[2].stats()["next_from_now_per_step"] > 0


def test_prefetch_off_is_the_same():
  specs = _specs(SGD)
  batches = _batches(specs, n=8, batch=SPLIT_BATCH)
  ref = _run_group("dense", specs, batches, planner.default_mesh())
  got = _run_group(TEXT[:-1] + ", prefetch=False)", specs, batches, sharding.make_mesh(1, 1))
  _assert_same(got[:2], ref[:2])
  assert got[2].lookahead == 0 and got[2].stats()["prefetched_fraction"] == 0


@pytest.mark.parametrize("save,resume", [((2, 4), (8, 1)), ((1, 1), (2, 4))], ids=str)
def test_resume_on_another_mesh(save, resume):
  """Stopped mid-stream (the next batch already prefetched into the state, and prepared
  ahead), the logical rows and the hot set checkpointed, resumed on another mesh: the
  buffer is not part of the checkpoint (the host tables are current after every step), the
  first resumed batch gathers its own rows, the later ones are prefetched again; bit-equal
  to an uninterrupted dense run."""
  specs = _specs(ADAGRAD)
  batches = _batches(specs, n=12)
  ref = _run_group("dense", specs, batches, planner.default_mesh())
  first = _run_group(TEXT, specs, batches, contract.mesh_or_skip(*save), stop=7)
  g1, s1 = first[2], first[3]
  assert g1.stats()["prefetched_fraction"] > 0
  g2, s2 = restored(g1, s1, TEXT, specs, contract.mesh_or_skip(*resume))
  rest = _run_group(TEXT, specs, batches, None, group=g2, state=s2, start=7)
  _assert_same((first[0] + rest[0], rest[1]), ref[:2])
  assert g2.stats()["prefetched_fraction"] == 4 / 5


def test_ignoring_from_now_is_caught(monkeypatch):
  """Mutation check: with every prefetched row read from its host copy (from_now ignored),
  the rows the step before updated come back stale and the run is no longer exact."""
  lists = HotCold._next_lists

  def stale(self, *a, **kw):
    out = lists(self, *a, **kw)
    if out is not None:
      for lst in out["prepared"]:
        lst["from_now"][:] = -1
    return out

  monkeypatch.setattr(HotCold, "_next_lists", stale)
  specs = _specs(SGD)
  batches = _batches(specs, n=8, batch=SPLIT_BATCH)
  ref = _run_group("dense", specs, batches, planner.default_mesh())
  got = _run_group(TEXT, specs, batches, sharding.make_mesh(1, 1))
  assert not all(np.array_equal(got[1][n], ref[1][n]) for n in ref[1])


def test_a_batch_prefetched_for_another_state_is_counted_stale():
  """A prepared batch marked prefetched run on a state whose buffer holds another batch's
  rows (its step skipped): `stale` counts it and sync refuses the state."""
  specs = _specs(SGD)
  group = planner.make_group(TEXT, specs, planner.default_mesh())
  state = group.init(jax.random.key(0))
  batches = _batches(specs, n=8)
  prepared = [group.prepare(batches[k], [batches[k + 1]]) for k in range(7)]
  assert "prefetched" in prepared[5] and "next" in prepared[4]
  lookup, update = jax.jit(group.lookup), jax.jit(group.update)

  def run(state, p, k):
    put = contract.put_prepared(group, p, group.mesh)
    pooled, res = lookup(state, put)
    return update(state, put, res, {n: contract.grads_for(k, v) for n, v in pooled.items()})

  for k in range(5):
    state = run(state, prepared[k], k)
  state = run(state, prepared[6], 6)  # batch 5 skipped: the buffer holds 5's rows, not 6's
  with pytest.raises(RuntimeError, match="out of order"):
    group.sync(state)


# ----------------------------------------------------------------------------- the HLO


def _steady(group, specs, n=6, batch=SPLIT_BATCH):
  """A prepared batch read from the buffer that prefetches the next one, with no migration,
  and the state its step would get (the buffer at its length)."""
  batches = _batches(specs, n=n + 1, batch=batch)
  state = group.init(jax.random.key(0))
  for k in range(n):
    p = group.prepare(batches[k], [batches[k + 1]])
  assert "prefetched" in p and "next" in p and p["tables"]["a"]["in_rows"].shape[0] == 0
  caps = [
    sum(min(p["tables"][m]["cold_ids"].size, group.specs[m].num_rows) for m in names)
    for names in group._stacks
  ]
  return _sized(group, state, caps), p


def _sized(group, state, caps):
  """The state with its prefetch buffers at the length a step gives them."""
  nxt = tuple(
    jax.tree.map(lambda x, c=c: jnp.zeros((c,) + x.shape[1:]), b)
    for b, c in zip(state["next"], caps)
  )
  return {**state, "next": nxt}


def _step(group, mesh, w):
  """The micro-batched step (test_hot_cold_tiers._micro_step) with a dense layer on the
  pooled rows per micro-batch (a dot the HLO checks can name)."""
  return _micro_step(
    group, mesh, lambda p: sum(jnp.tanh(v @ w[v.shape[1]]).sum() for v in p.values())
  )


def test_next_batch_read_depends_on_nothing_the_step_computes():
  """A steady step (its rows prefetched, the next batch's read): the host reads (one per row
  layout, the next batch's) depend on no dot, no scatter into the hot arrays and no
  write-back; every write-back depends on its row layout's host read; neither micro-batch's loss nor
  gradients use a host-resident value (the popular one never did; the non-popular one's
  rows now come from the buffer); the compiled step copies no host array. On one device,
  where the host computations are the entry's own (on a mesh they sit in the shard_map
  bodies; tests/test_hot_cold_tiers.py reads a mesh's link)."""
  specs = _specs(SGD)
  mesh = sharding.make_mesh(1, 1)
  group = planner.make_group("hot_cold(budget=0.3, profile_batches=2)", specs, mesh)
  if not group.host.offloaded:
    pytest.skip("no pinned_host memory on this platform")
  state, p = _steady(group, specs)
  assert len(p["micro"]) == 2
  put = contract.put_prepared(group, p, mesh)
  w = {s.dim: jnp.ones((s.dim, 4), jnp.float32) for s in specs}
  step = _step(group, mesh, w)
  lowered = jax.jit(step, donate_argnums=0).lower(state, put)
  module = hlo.parse(lowered.compiler_ir("hlo").as_hlo_text())
  entry = module.instrs()
  params = {i.parameter: n for n, i in entry.items() if i.op == "parameter"}
  host_params = {params[k] for k in comms.host_params_of(lowered)}
  assert host_params
  # Host computations: the ones returning a host table are write-backs, the others reads.
  table_shapes = {
    f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state["tables"]) if x.ndim
  }

  calls = [
    i.name for i in entry.values() if i.op == "call" and i.attr("_xla_compute_type") == "host"
  ]
  writes = [n for n in calls if any(s in entry[n].shape for s in table_shapes)]
  reads = [n for n in calls if n not in writes]
  assert reads and writes
  nxt_rows = [n for n in params.values() if "next" in n and "rows" in n]
  assert len(nxt_rows) == len(specs)  # one list per row layout (dims 8 and 4)
  for r in reads:
    assert any(module.depends(r, x) for x in nxt_rows), f"{r} reads something else"
  computed = [n for n, i in entry.items() if i.op == "dot" or i.op == "scatter"]
  assert any(entry[n].op == "dot" for n in computed)
  for r in reads:
    for c in computed + writes:
      assert not module.depends(r, c), f"the next batch's host read {r} waits for {c}"
  # One read and one write-back per row layout, each write-back after its layout's read
  # (the other layout's tables are other arrays: no order needed).
  assert len(reads) == len(writes) == len(group._stacks)
  after = [{r for r in reads if module.depends(wb, r)} for wb in writes]
  assert all(len(a) >= 1 for a in after) and set().union(*after) == set(reads), after
  root = module.root(module.entry)
  n_state = len(jax.tree.leaves(jax.eval_shape(step, state, put)[0]))
  sources = host_params | set(reads)
  for out in root.operands[n_state:]:  # both micro-batches' losses and gradients
    used = module.ancestors(out)
    assert not used & sources, f"{out} uses {sorted(used & sources)}"
  text = lowered.compile().as_text().replace(":S(5)", "")
  for s in table_shapes:
    assert f"{s}{{1,0}} copy(" not in text and f"{s}{{0}} copy(" not in text


# ----------------------------------------------------------------------------- host link


def _link(budget, prefetch, steps=50, measured=25):
  """A Zipf stream through one table (Adagrad, D = 16: 68 bytes a row), the hot set picked
  after 10 batches, each batch prepared with the next as the trainer does. Per measured
  step: its HLO's host link (lowered once per signature) and its batch's distinct cold ids.
  -> (to device bytes, to host bytes, cold ids) per step, row bytes."""
  spec = base.TableSpec(name="t", num_rows=100_000, dim=16, optimizer=ADAGRAD)
  mesh = sharding.make_mesh(1, 1)
  text = f"hot_cold(budget={budget}, profile_batches=10, split=False, prefetch={prefetch})"
  group = planner.make_group(text, [spec], mesh)
  if not group.host.offloaded:
    pytest.skip("no pinned_host memory on this platform")
  state = group.init(jax.random.key(0))
  state = _sized(group, state, [512 * 4])

  def step(state, prepared):
    pooled, res = group.lookup(state, prepared)
    return group.update(state, prepared, res, {"t": pooled["t"]})

  ids = contract.zipf_ids(0, steps + 1, 512, 4, spec.num_rows)
  seen, dev, host, cold = {}, [], [], []
  for k in range(steps):
    hot = group.hot_set()["t"]
    p = group.prepare({"t": ids[k]}, [{"t": ids[k + 1]}])
    if k < steps - measured:
      continue
    valid = ids[k][ids[k] >= 0]
    cold.append(np.unique(valid[~np.isin(valid, hot)]).size)
    sig = tuple(np.shape(x) for x in jax.tree.leaves(p)) + (tuple(sorted(p)),)
    if sig not in seen:
      put = contract.put_prepared(group, p, mesh)
      seen[sig] = comms.host_link_of(jax.jit(step).lower(state, put))
    dev.append(seen[sig].to_device_bytes)
    host.append(seen[sig].to_host_bytes)
  return np.array(dev), np.array(host), np.array(cold), spec.row_bytes


def test_prefetched_host_link_bytes_follow_the_cold_ids():
  """Budgets 1 %, 5 %, 20 %: with prefetch each steady step reads the next batch's list in
  place of its own (not beside it): to the device, the same bytes as on demand (within
  1.25x of the cold ids x row bytes); to the host, on demand's plus the write-back's row
  indices sent again (4 bytes a row: on demand the read leaves its list in host memory for
  the write-back; prefetched, the list read is the next batch's). Printed: before / after."""
  got = {}
  for budget in (0.01, 0.05, 0.2):
    for prefetch in (False, True):
      dev, host, cold, row = _link(budget, prefetch)
      need = cold.mean() * row
      got[budget, prefetch] = (dev.mean() / need, host.mean() / need, dev.mean(), host.mean())
    (d0, h0, b0, t0), (d1, _, _, t1) = got[budget, False], got[budget, True]
    assert 1 <= d0 <= 1.25 and 1 <= h0 <= 1.25 and d1 == d0, got
    # the indices again: 4 bytes per entry of the list (~1.13x the cold ids) and offsets
    assert 0 < t1 - t0 <= 4 * 1.25 * (b0 / row) + 8, got
  print("(budget, prefetch): (to device / need, to host / need, bytes each way)", got)
