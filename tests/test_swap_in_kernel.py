"""The swap-in and backup FFI handlers against the NumPy reference, the worked example and bad input."""

import dataclasses
import functools
import os
import subprocess
import sys

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_jax.kernels import ops, reference
from hisparse_jax.kernels.reference import WORKED_EXAMPLE_PAGE_SIZE as PAGE
from hisparse_jax.kernels.reference import host_rows_of, worked_example

# An FFI INVALID_ARGUMENT (what the compiled shapes decide) surfaces as JaxRuntimeError, or ValueError when the
# call is dispatched eagerly; what the data decides is a per-row status (the 7th result).
FFI_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
NAMES = ["rows", "pool", "hot", "slot_tokens", "lru", "stats", "status"]
# Argument positions: layer, top_k, seq_lens, req_ids, host_pages, newest | host_pool, hot, slot_tokens, lru, stats.
NEWEST, POOL, HOT, SLOTS, LRU, STATS = 5, 6, 7, 8, 9, 10
STATE = (POOL, HOT, SLOTS, LRU, STATS)


@functools.lru_cache(maxsize=None)
def swap_in_jit(page_size, eviction="lru"):
  return jax.jit(functools.partial(ops.swap_in, page_size=page_size, eviction=eviction), donate_argnums=STATE)


backup_jit = jax.jit(ops.backup, donate_argnums=(3,))


def to_host(x):
  return jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host))(jnp.asarray(x))


def device_args(case):
  """jnp arrays of a case, its host pool in pinned_host memory."""
  return [case[0], *map(jnp.asarray, case[1:POOL]), to_host(case[POOL]), *map(jnp.asarray, case[POOL + 1 :])]


def run_kernel(*case, page_size=PAGE, eviction="lru"):
  return [np.asarray(x) for x in swap_in_jit(page_size, eviction)(*device_args(case))]


def run_reference(*case, page_size=PAGE, eviction="lru"):
  return reference.swap_in(*case, page_size=page_size, eviction=eviction)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_worked_example(impl):
  args = worked_example()
  fn = run_kernel if impl == "kernel" else run_reference
  rows, pool, hot, slot_tokens, lru, stats, status = fn(*args)
  assert status.tolist() == [0]
  np.testing.assert_array_equal(rows[0], [21, 24, 20, -1])
  np.testing.assert_array_equal(slot_tokens[0, 4], [8, 3, 7, 12])
  np.testing.assert_array_equal(lru[0, 4], [2, 3, 0, 1])
  host_row_of_8 = host_rows_of(args[4][0], PAGE)[8]
  assert host_row_of_8 == 7 * PAGE  # page 2 of the table is host page 7
  np.testing.assert_array_equal(hot[0].reshape(-1, 3)[20], args[POOL][0, host_row_of_8])
  # Only device row 20 (the miss) and row 24 (the reserved slot, given the newest row) changed.
  changed = np.flatnonzero((hot != args[HOT]).any(-1).reshape(-1))
  np.testing.assert_array_equal(changed, [20, 24])
  np.testing.assert_array_equal(hot[0].reshape(-1, 3)[24], args[NEWEST][0])
  np.testing.assert_array_equal(stats[0, 4], [2, 1])  # hits: 3 and newest 15; miss: 8
  assert not stats[:, :4].any()  # other request slots untouched


def test_worked_example_is_in_place():
  args = device_args(worked_example())
  pool, hot = args[POOL], args[HOT]
  pool_ptr, hot_ptr = pool.unsafe_buffer_pointer(), hot.unsafe_buffer_pointer()
  out = swap_in_jit(PAGE)(*args)
  assert out[1].sharding.memory_kind == "pinned_host"
  assert out[1].unsafe_buffer_pointer() == pool_ptr
  assert out[2].unsafe_buffer_pointer() == hot_ptr


@st.composite
def swap_in_cases(draw):
  """(case, page_size): B batch rows over R >= B request slots (rows may be idle), random page tables."""
  L = draw(st.integers(1, 2))
  B = draw(st.integers(1, 3))
  R = B + draw(st.integers(0, 2))
  D = draw(st.integers(1, 12))
  K = draw(st.integers(1, D))
  S = draw(st.integers(1, 40))
  W = draw(st.integers(1, 4))
  page = draw(st.sampled_from([1, 3, 4, 16]))
  P = -(-S // page)
  H = (P * B + draw(st.integers(0, 3))) * page
  layer = draw(st.integers(0, L - 1))
  req_ids = np.array(draw(st.permutations(range(R)))[:B], np.int32)
  seq_lens = np.array([draw(st.integers(0, S)) for _ in range(B)], np.int32)
  for b in range(B):
    if seq_lens[b] == 0 and draw(st.booleans()):
      req_ids[b] = -1  # an idle row
  # Each row owns distinct host pages (a random page table).
  perm = draw(st.permutations(range(H // page)))
  host_pages = np.array(perm[: B * P], np.int32).reshape(B, P)
  slot_tokens = np.tile(np.arange(D, dtype=np.int32), (L, R, 1))
  lru = np.stack([np.stack([np.array(draw(st.permutations(range(D)))) for _ in range(R)]) for _ in range(L)]).astype(
    np.int32
  )
  top_k = np.full((B, K), -1, np.int32)
  for b in range(B):
    n, r = int(seq_lens[b]), int(req_ids[b])
    if r < 0:
      continue
    for l in range(L):
      if n > D:  # a consistent resident set: distinct tokens older than the newest, some empty
        tokens = draw(st.lists(st.integers(-1, n - 2), min_size=D, max_size=D))
        seen = set()
        for i, t in enumerate(tokens):
          if t in seen:
            tokens[i] = -1
          seen.add(t)
        slot_tokens[l, r] = tokens
    if n:
      top_k[b] = draw(hnp.arrays(np.int32, K, elements=st.integers(-1, n - 1)))
  pool = np.arange(L * H * W, dtype=np.float32).reshape(L, H, W) * 0.5
  hot = -np.arange(L * R * (D + 1) * W, dtype=np.float32).reshape(L, R, D + 1, W)
  # Rows already resident hold their token's KV, as the engine guarantees.
  for b in range(B):
    r, n = int(req_ids[b]), int(seq_lens[b])
    if r < 0 or not n:
      continue
    rows = host_rows_of(host_pages[b], page)
    for l in range(L):
      for s in range(D):
        t = slot_tokens[l, r, s]
        if 0 <= t < n:
          hot[l, r, s] = pool[l, rows[t]]
      hot[l, r, D] = pool[l, rows[n - 1]]
      if n <= D:
        for t in range(n):
          hot[l, r, t] = pool[l, rows[t]]
  stats = np.zeros((L, R, 2), np.int32)
  # Each row's newest latent row, as the engine computes it: what backup just wrote to its host row.
  newest = np.zeros((B, W), np.float32)
  for b in range(B):
    if req_ids[b] >= 0 and seq_lens[b]:
      newest[b] = pool[layer, host_rows_of(host_pages[b], page)[seq_lens[b] - 1]]
  return [layer, top_k, seq_lens, req_ids, host_pages, newest, pool, hot, slot_tokens, lru, stats], page


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swap_in_cases())
def test_kernel_matches_reference_and_invariants(case_page):
  case, page = case_page
  got = run_kernel(*case, page_size=page)
  want = run_reference(*case, page_size=page)
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)

  layer, top_k, seq_lens, req_ids, host_pages, _, pool = case[:7]
  rows, _, hot, slot_tokens, lru, stats, status = got
  assert not status.any()  # a valid case: every row done
  R, D1, W = hot.shape[1], hot.shape[2], hot.shape[3]
  flat = hot[layer].reshape(R * D1, W)
  for b, r in enumerate(int(x) for x in req_ids):
    if r < 0:
      assert (rows[b] == -1).all()
      continue
    host_rows = host_rows_of(host_pages[b], page)
    needed = {int(t) for t in top_k[b] if t >= 0}
    for k, t in enumerate(top_k[b]):
      if t < 0:
        assert rows[b, k] == -1
        continue
      # Every output row is in the request's own hot buffer and holds exactly its token's KV.
      assert r * D1 <= rows[b, k] < (r + 1) * D1
      np.testing.assert_array_equal(flat[rows[b, k]], pool[layer, host_rows[t]])
    if seq_lens[b] > D1 - 1:
      # No needed token was evicted: each sits in exactly one slot (the newest in the reserved one).
      resident = [int(x) for x in slot_tokens[layer, r]]
      for t in needed - {int(seq_lens[b]) - 1}:
        assert resident.count(t) == 1
      assert sorted(lru[layer, r]) == list(range(D1 - 1))
    # Each distinct position is counted once: hits + misses = distinct needed.
    assert stats[layer, r].sum() == len(needed)
  # Request slots without a row are untouched.
  idle = sorted(set(range(R)) - {int(x) for x in req_ids})
  np.testing.assert_array_equal(hot[:, idle], case[HOT][:, idle])
  np.testing.assert_array_equal(lru[:, idle], case[LRU][:, idle])
  assert not stats[:, idle].any()


def test_fast_path_no_io_lru_unchanged():
  case = worked_example()
  case[2][0] = 4  # seq_len <= D
  case[1][0] = [0, 3, 3, -1]
  rows, _, hot, slot_tokens, lru, stats, _ = run_kernel(*case)
  np.testing.assert_array_equal(rows[0], [20, 23, 23, -1])
  want = case[HOT].copy()
  want[0, 4, 3] = case[NEWEST][0]  # the newest token (position 3) goes to its own slot: no I/O
  np.testing.assert_array_equal(hot, want)
  np.testing.assert_array_equal(lru, case[LRU])
  np.testing.assert_array_equal(slot_tokens, case[SLOTS])
  np.testing.assert_array_equal(stats[0, 4], [2, 0])


def test_duplicates_and_padding_copy_once():
  case = worked_example()
  case[1][0] = [8, 8, -1, 8]
  rows, _, hot, _, _, stats, _ = run_kernel(*case)
  np.testing.assert_array_equal(rows[0], [20, 20, -1, 20])
  np.testing.assert_array_equal(stats[0, 4], [0, 1])
  assert (hot != case[HOT]).any(-1).sum() == 2  # the miss, and the newest row in the reserved slot


def _with_idle_row(case):
  """The worked example with a second, idle batch row (request id -1)."""
  case[1] = np.concatenate([case[1], np.full((1, 4), -1, np.int32)])
  case[2] = np.append(case[2], 0).astype(np.int32)
  case[3] = np.append(case[3], -1).astype(np.int32)
  case[4] = np.concatenate([case[4], np.full((1, 4), -1, np.int32)])
  case[NEWEST] = np.concatenate([case[NEWEST], np.zeros((1, 3), np.float32)])
  return case


@pytest.mark.parametrize(
  "mutate, code, rows",
  [
    (lambda c: c[1].__setitem__((0, 0), 16), reference.POSITION_OUT_OF_RANGE, [0]),
    (lambda c: c[1].__setitem__((0, 0), -2), reference.POSITION_OUT_OF_RANGE, [0]),
    (lambda c: c[4].__setitem__((0, 2), 999), reference.HOST_ROW_OUT_OF_RANGE, [0]),
    (lambda c: c[4].__setitem__((0, 2), -1), reference.HOST_ROW_OUT_OF_RANGE, [0]),
    (lambda c: c[4].__setitem__((0, 2), 2**30), reference.HOST_ROW_OUT_OF_RANGE, [0]),  # page * page_size wraps
    (lambda c: c[LRU].__setitem__((0, 4, 0), 1), reference.LRU_NOT_PERMUTATION, [0]),
    (lambda c: c[2].__setitem__(0, 17), reference.BAD_SEQ_LEN, [0]),
    (lambda c: c.__setitem__(0, 1), reference.LAYER_OUT_OF_RANGE, [0]),
    (lambda c: c[3].__setitem__(0, 5), reference.BAD_REQUEST_ID, [0]),
    (lambda c: c[3].__setitem__(0, -2), reference.BAD_REQUEST_ID, [0]),
    (lambda c: c[3].__setitem__(0, -1), reference.BAD_REQUEST_ID, [0]),  # idle row with seq_len > 0
    # The same request twice: the later row fails, the first is done.
    (lambda c: _with_idle_row(c)[3].__setitem__(1, 4) or c[2].__setitem__(1, 16), reference.BAD_REQUEST_ID, [1]),
  ],
)
def test_bad_input_is_a_row_status_and_changes_nothing(mutate, code, rows):
  case = worked_example()
  mutate(case)
  args = device_args(case)  # not donated here: the inputs stay readable
  got = [np.asarray(x) for x in ops.swap_in(*args, page_size=PAGE)]
  status = got[6]
  assert [b for b in range(len(status)) if status[b]] == rows and set(status[rows]) == {code}
  assert (got[0][rows] == -1).all()
  want = run_reference(*case)
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)
  if rows == [0]:  # the only row failed: nothing changed
    for i, name in zip((HOT, SLOTS, LRU, STATS), ("hot", "slot_tokens", "lru", "stats")):
      np.testing.assert_array_equal(got[NAMES.index(name)], case[i], err_msg=name)
  with pytest.raises(ops.KernelStatusError, match=f"INVALID_ARGUMENT: swap_in: row {rows[0]}: ") as e:
    ops.check_status(status)
  assert e.value.rows == rows and e.value.codes == [code] * len(rows)
  assert ops.status_message(code) in str(e.value)


def test_status_codes_and_messages():
  """The reference's codes are the kernel's (xla_ffi/swap_in_core.h), each with its own message."""
  want = {
    reference.BAD_SEQ_LEN: "seq_len",
    reference.POSITION_OUT_OF_RANGE: "top-k position",
    reference.HOST_ROW_OUT_OF_RANGE: "host-pool row",
    reference.LRU_NOT_PERMUTATION: "not a permutation",
    reference.LAYER_OUT_OF_RANGE: "layer index",
    reference.BAD_REQUEST_ID: "request id",
    reference.BAD_SCORE: "NaN",
    reference.BACKUP_ROW_OUT_OF_RANGE: "backup destination",
    reference.PREFETCH_STALE: "prefetch dropped",
  }
  assert sorted(want) == list(range(1, ops._ffi_cpu.num_statuses))
  for code, text in want.items():
    assert text in ops.status_message(code)
  assert ops.status_message(0) == "ok"
  for code in (ops._ffi_cpu.num_statuses, 42, -reference.PREFETCH_STALE):  # (it read "ok")
    assert ops.status_message(code).startswith("not a status code")
  ops.check_status(np.zeros(3, np.int32))  # all done: no error


def test_a_bad_row_fails_alone():
  """Three requests; the middle one's LRU row is corrupt: the other two get exactly what they get alone."""
  rng = np.random.default_rng(3)
  case = reference.random_case(rng, L=1, B=3, R=4, D=8, K=6, S=40)
  case[2][:] = [30, 35, 38]  # every row on the slow path (seq_len > D)
  for b in range(3):
    case[1][b] = rng.integers(0, case[2][b], 6)
  case[3][:] = [0, 1, 2]
  good = run_kernel(*case)
  assert not good[6].any()
  bad = [c.copy() if isinstance(c, np.ndarray) else c for c in case]
  bad[LRU][case[0], 1, 0] = bad[LRU][case[0], 1, 1]  # request 1: not a permutation
  got = run_kernel(*bad)
  assert got[6].tolist() == [0, reference.LRU_NOT_PERMUTATION, 0]
  for name in ("rows", "hot", "slot_tokens", "lru", "stats"):
    i = NAMES.index(name)
    g, w = got[i], good[i]
    if name == "rows":
      np.testing.assert_array_equal(g[[0, 2]], w[[0, 2]])
      assert (g[1] == -1).all()
    else:  # request slots 0 and 2 as when all were good; slot 1 as it came in
      np.testing.assert_array_equal(g[:, [0, 2]], w[:, [0, 2]], err_msg=name)
      np.testing.assert_array_equal(
        g[:, 1], bad[POOL + 1 + ("hot", "slot_tokens", "lru", "stats").index(name)][:, 1], err_msg=name
      )


def test_newest_of_the_wrong_shape_is_an_ffi_error():
  case = worked_example()
  case[NEWEST] = np.zeros((1, 2), np.float32)
  with pytest.raises(FFI_ERRORS, match="newest must be"):
    jax.block_until_ready(ops.swap_in(*device_args(case), page_size=PAGE))
  with pytest.raises(reference.SwapInError):
    run_reference(*case)


def test_idle_rows_and_slot_indirection():
  """Rows may come in any order of request slots; idle rows (-1) cost nothing and write -1."""
  case = _with_idle_row(worked_example())
  order = [1, 0]  # the idle row first
  for i in (1, 2, 3, 4, NEWEST):
    case[i] = case[i][order]
  rows, *_ = got = run_kernel(*case)
  np.testing.assert_array_equal(rows, [[-1] * 4, [21, 24, 20, -1]])
  want = run_reference(*case)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)


def test_top_k_larger_than_buffer_is_an_error():
  case = worked_example()
  case[1] = np.full((1, 5), -1, np.int32)  # K = 5 > D = 4
  with pytest.raises(FFI_ERRORS, match=r"top_k \(5\) > device_buffer_size \(4\)"):
    run_kernel(*case)
  with pytest.raises(reference.SwapInError):
    run_reference(*case)
  # A hot buffer with only the newest token's slot (D = 0) says so, for the swap-in and the prefetch.
  case = worked_example()
  L, R, _, W = case[HOT].shape
  case[1] = np.zeros((1, 0), np.int32)
  case[HOT] = np.zeros((L, R, 1, W), case[HOT].dtype)
  case[SLOTS] = case[LRU] = np.zeros((L, R, 0), np.int32)
  with pytest.raises(FFI_ERRORS, match=r"swap_in: hot \[L, R, D\+1, W\] has D\+1 = 1: it needs D >= 1 slots"):
    run_kernel(*case)
  with pytest.raises(FFI_ERRORS, match=r"prefetch: hot \[L, R, D\+1, W\] has D\+1 = 1"):
    jax.block_until_ready(
      ops.prefetch_start(
        0, *map(jnp.asarray, case[1:NEWEST]), to_host(case[POOL]), *map(jnp.asarray, case[HOT:STATS]), page_size=PAGE
      )
    )


def test_backup_writes_rows_in_place():
  L, H, W = 3, 10, 4
  pool = to_host(np.zeros((L, H, W), np.float32))
  ptr = pool.unsafe_buffer_pointer()
  rows = jnp.arange(2 * 3 * W, dtype=jnp.float32).reshape(2, 3, W) + 1
  out, status = backup_jit(1, rows, jnp.array([7, -1, 0], jnp.int32), pool)
  assert out.unsafe_buffer_pointer() == ptr and out.sharding.memory_kind == "pinned_host"
  assert np.asarray(status).tolist() == [0, 0, 0]
  want = np.zeros((L, H, W), np.float32)
  want[1, 7], want[2, 7] = rows[0, 0], rows[1, 0]
  want[1, 0], want[2, 0] = rows[0, 2], rows[1, 2]
  np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize(
  "layer, dst, status",
  [
    (2, [0, 0, 0], [reference.LAYER_OUT_OF_RANGE] * 3),  # layers [2, 4) of 3: nothing written
    (0, [0, 10, 5], [0, reference.BACKUP_ROW_OUT_OF_RANGE, 0]),  # that column alone is skipped
    (0, [-2, -1, 3], [reference.BACKUP_ROW_OUT_OF_RANGE, 0, 0]),
  ],
)
def test_backup_bad_input_is_a_column_status(layer, dst, status):
  before = np.arange(3 * 10 * 4, dtype=np.float32).reshape(3, 10, 4)
  rows = np.ones((2, 3, 4), np.float32) * 7
  out, got = ops.backup(layer, jnp.asarray(rows), jnp.array(dst, jnp.int32), to_host(before))
  assert np.asarray(got).tolist() == status
  want_pool, want_status = reference.backup(layer, rows, dst, before)
  np.testing.assert_array_equal(np.asarray(out), want_pool)
  assert want_status.tolist() == status
  with pytest.raises(ops.KernelStatusError, match="INVALID_ARGUMENT: backup: row"):
    ops.check_status(got, "backup")


def test_in_place_inside_a_jitted_step_has_no_pool_or_hot_buffer_copy():
  """backup then swap-in (given the newest row) over two layers, as a decode step does: the compiled step
  holds no copy of the pinned_host pool nor of the hot buffer."""
  case = worked_example()
  L, H, W = case[POOL].shape
  newest_row = host_rows_of(case[4][0], PAGE)[15]

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(pool, hot, slot_tokens, lru, stats, new_row, dst):
    for layer in (0, 0):
      pool, _ = ops.backup(layer, new_row, dst, pool)
      rows, pool, hot, slot_tokens, lru, stats, _ = ops.swap_in(
        layer, *map(jnp.asarray, case[1:NEWEST]), new_row[0], pool, hot, slot_tokens, lru, stats, page_size=PAGE
      )
      new_row = new_row + hot[layer].reshape(-1, W)[rows[0, 0]]  # the next layer depends on this one's rows
    return rows, pool, hot

  args = (
    to_host(case[POOL]),
    *map(jnp.asarray, case[POOL + 1 :]),
    jnp.ones((1, 1, W), jnp.float32),
    jnp.array([newest_row], jnp.int32),
  )
  hlo = step.lower(*args).compile().as_text()
  for shape in (f"f32[{L},{H},{W}]", "f32[{},{},{},{}]".format(*case[HOT].shape)):
    copies = [l for l in hlo.splitlines() if " copy(" in l and shape in l]
    assert not copies, copies
  rows, pool, hot = step(*args)
  np.testing.assert_array_equal(np.asarray(rows)[0], [21, 24, 20, -1])
  np.testing.assert_array_equal(np.asarray(hot)[0].reshape(-1, W)[24], np.asarray(pool)[0, newest_row])


def test_loaded_handler_is_the_requested_build():
  """Under `make test-asan` the instrumented module must really be the one registered."""
  import os

  path = os.environ.get("HISPARSE_FFI_CPU_LIB")
  if path:
    assert os.path.samefile(ops._ffi_cpu.__file__, path)
    assert b"__asan_report" in open(path, "rb").read()
  else:
    assert ops._ffi_cpu.__name__ == "hisparse_jax._ffi_cpu"


def test_extension_pool_matches_reference_and_rejects_unknown_pools():
  case = worked_example()
  pool = ops.ExtensionHostPool(*case[POOL].shape, np.float32)
  pool.write(case[POOL])
  fn = jax.jit(functools.partial(ops.swap_in, page_size=PAGE, external=pool.ref), donate_argnums=STATE)
  out = fn(0, *map(jnp.asarray, case[1:POOL]), pool.token(), *map(jnp.asarray, case[POOL + 1 :]))
  want = run_reference(*case)
  for i in (0, 2, 3, 4, 5):
    np.testing.assert_array_equal(np.asarray(out[i]), want[i])
  new_rows = jnp.full((1, 1, 3), 7.0, jnp.float32)
  jax.block_until_ready(ops.backup(0, new_rows, jnp.array([5], jnp.int32), pool.token(), external=pool.ref))
  assert (pool.read()[0, 5] == 7).all()
  # A forged or freed address is an error, never a wild access.
  forged = ops.ExternalPoolRef(pool.address + 64, 1, 32, np.float32, 3, pool.ref.serial)
  with pytest.raises(FFI_ERRORS, match="not a live extension pool"):
    jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), pool.token(), external=forged))
  too_big = ops.ExternalPoolRef(pool.address, 1, 10**6, np.float32, 3, pool.ref.serial)
  with pytest.raises(FFI_ERRORS, match="not a live extension pool"):
    jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), pool.token(), external=too_big))
  # A pool of other rows: fewer rows than it holds, rows of another byte size (the handler's exact check),
  # or the same bytes as another dtype / width (the ref's trace-time check); nothing is written.
  before = pool.read()
  for ref, rows, error, match in (
    (
      ops.ExternalPoolRef(pool.address, 1, 16, np.float32, 3, pool.ref.serial),
      new_rows,
      FFI_ERRORS,
      r"the pool has 1 x 32 rows, 384 bytes",
    ),
    (
      ops.ExternalPoolRef(pool.address, 2, 16, np.float32, 3, pool.ref.serial),
      new_rows,
      FFI_ERRORS,
      r"not a live extension pool of 2 x 16 rows",
    ),  # the same bytes split into other layers and rows
    (
      ops.ExternalPoolRef(pool.address, 1, 32, np.float32, 3, pool.ref.serial + 1),
      new_rows,
      FFI_ERRORS,
      r"freed, or never allocated",
    ),
    (
      ops.ExternalPoolRef(pool.address, 1, 32, np.float16, 3, pool.ref.serial),
      new_rows.astype(jnp.float16),
      FFI_ERRORS,
      "32 rows of 3 x 2",
    ),
    (pool.ref, new_rows.astype(jnp.int32), ValueError, "holds rows of 3 x float32, but the rows written"),
    (pool.ref, jnp.full((1, 1, 6), 7.0, jnp.float16), ValueError, "are 6 x float16"),
  ):
    with pytest.raises(error, match=match):
      jax.block_until_ready(ops.backup(0, rows, jnp.array([1], jnp.int32), pool.token(), external=ref))
  with pytest.raises(ValueError, match="swap_in: the extension host pool holds rows of 3 x float32"):
    ops.swap_in(
      0,
      *map(jnp.asarray, case[1:NEWEST]),
      jnp.zeros((1, 3), jnp.int32),
      pool.token(),
      jnp.zeros(case[HOT].shape, jnp.int32),
      *map(jnp.asarray, case[HOT + 1 :]),
      page_size=PAGE,
      external=pool.ref,
    )
  np.testing.assert_array_equal(pool.read(), before)
  with pytest.raises(ValueError, match="expected dtype float32, got float64 \\(convert it first\\)"):
    pool.write(np.full(pool.shape, 1e300))  # (it was cast: inf)
  np.testing.assert_array_equal(pool.read(), before)
  ref = pool.ref
  pool.close()
  for use in (pool.read, lambda: pool.write(before)):
    with pytest.raises(ValueError, match="this ExtensionHostPool is closed"):
      use()
  with pytest.raises(FFI_ERRORS, match="not a live extension pool"):
    jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), jnp.zeros((1,), jnp.int32), external=ref))
  # A new pool at the freed pool's address (the allocator reuses it soon) is not reached by the old ref.
  pools = [ops.ExtensionHostPool(*case[POOL].shape, np.float32) for _ in range(32)]
  again = [p for p in pools if p.address == ref.address]
  for p in again:
    with pytest.raises(FFI_ERRORS, match="freed, or never allocated"):
      jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), p.token(), external=ref))
    assert not p.read().any()
  for p in pools:
    p.close()


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.float4_e2m1fn])
def test_sub_byte_dtypes_are_rejected(dtype):
  pool = to_host(jnp.zeros((1, 64, 256), dtype))
  with pytest.raises(FFI_ERRORS, match="below one byte"):
    jax.block_until_ready(ops.backup(0, jnp.ones((1, 1, 256), dtype), jnp.array([63], jnp.int32), pool))
  case = worked_example()
  with pytest.raises(FFI_ERRORS, match="below one byte"):
    jax.block_until_ready(
      ops.swap_in(
        0,
        *map(jnp.asarray, case[1:NEWEST]),
        jnp.zeros((1, 4), dtype),
        to_host(jnp.zeros((1, 32, 4), dtype)),
        jnp.zeros((1, 5, 5, 4), dtype),
        *map(jnp.asarray, case[HOT + 1 :]),
        page_size=PAGE,
      )
    )
  with pytest.raises(TypeError, match="below one byte"):
    ops.ExtensionHostPool(1, 4, 4, dtype)


@pytest.mark.parametrize(
  "shape,dtype,error,match",
  [
    ((2, -4, -4), np.float32, ValueError, "rows must be an integer >= 1, got -4"),
    ((2, 0, 4), np.float32, ValueError, "rows must be an integer >= 1, got 0"),
    ((0, 4, 4), np.float32, ValueError, "layers must be an integer >= 1, got 0"),
    ((2.5, 4, 4), np.float32, ValueError, "layers must be an integer"),
    ((True, 4, 4), np.float32, ValueError, "layers must be an integer"),
    ((1, 4, 4), np.bool_, TypeError, "must be a float or integer type, got bool"),
    ((1, 4, 4), np.complex64, TypeError, "must be a float or integer type"),
    ((1, 4, 4), object, TypeError, "must be a float or integer type"),
  ],
)
def test_extension_pool_refuses_bad_geometry_and_dtypes(shape, dtype, error, match):
  with pytest.raises(error, match=match):
    ops.ExtensionHostPool(*shape, dtype)


def test_indices_are_never_silently_truncated():
  case = worked_example()
  args = list(case)
  with pytest.raises(TypeError, match="layer must be an integer"):
    ops.swap_in(0.9, *args[1:], page_size=PAGE)
  with pytest.raises(TypeError, match="layer must be an integer"):
    ops.backup(True, jnp.ones((1, 1, 3)), jnp.array([0], jnp.int32), to_host(case[POOL]))
  seq = np.array(case[2], np.int64)
  seq[0] = 2**32 + 16  # would wrap to 16 in int32
  with pytest.raises(ValueError, match="seq_lens has values outside the int32 range"):
    ops.swap_in(0, case[1], seq, *args[3:], page_size=PAGE)
  with pytest.raises(TypeError, match="top_k must be an integer array"):
    ops.swap_in(0, case[1].astype(np.float32), *args[2:], page_size=PAGE)
  with pytest.raises(ValueError, match="page_size must be a positive integer"):
    ops.swap_in(*args, page_size=0)
  with pytest.raises(ValueError, match="top_k must have 2 dimensions .* got shape \\[4\\]"):
    ops.swap_in(0, case[1][0], *args[2:], page_size=PAGE)
  for layer in (np.zeros(1, np.int32), jnp.zeros((1, 1), jnp.int32)):  # (taken as layer 0)
    with pytest.raises(ValueError, match="layer must be a scalar, got shape"):
      ops.swap_in(layer, *args[1:], page_size=PAGE)
  # Traced (values unknown): a narrower integer type converts exactly, as it does eagerly; a wider one is refused.
  jitted = jax.jit(functools.partial(ops.swap_in, page_size=PAGE))
  want = run_reference(*case)
  got = jitted(0, jnp.asarray(case[1], jnp.int16), *device_args(case)[2:])
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
  with pytest.raises(TypeError, match="top_k must be int32 \\(or an integer type int32 holds\\), got uint32"):
    jitted(0, jnp.asarray(case[1], jnp.uint32), *device_args(case)[2:])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swap_in_cases(), st.data())
def test_kernel_and_reference_agree_on_corrupt_state(case_page, data):
  """Corrupt a page-table entry, an LRU entry or a request id: kernel and reference give the same row statuses
  and results (a failed row unchanged, the others done)."""
  case, page = case_page
  case = [c.copy() if isinstance(c, np.ndarray) else c for c in case]
  layer = case[0]
  B, P = case[4].shape
  R, D = case[SLOTS].shape[1], case[SLOTS].shape[2]
  what = data.draw(st.sampled_from(["page", "lru", "req"]))
  b = data.draw(st.integers(0, B - 1))
  if what == "page":
    case[4][b, data.draw(st.integers(0, P - 1))] = data.draw(
      st.sampled_from([-1, case[POOL].shape[1] // page, 2**31 - 1])
    )
  elif what == "lru":
    i = data.draw(st.integers(0, D - 1))
    r = data.draw(st.integers(0, R - 1))
    case[LRU][layer, r, i] = data.draw(st.sampled_from([-1, D, int(case[LRU][layer, r, (i + 1) % D])]))
  else:
    case[3][b] = data.draw(st.sampled_from([-2, -1, R, int(case[3][(b + 1) % B])]))
  want = run_reference(*case, page_size=page)
  for name, g, w in zip(NAMES, run_kernel(*case, page_size=page), want):
    np.testing.assert_array_equal(g, w, err_msg=name)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.integers(1, 300), st.data())
def test_top_k_kernel_equals_lax_top_k_exactly(rows, n, data):
  """The indexer's CPU top-k handler returns exactly jax.lax.top_k: values, order, ties to the lower index."""
  k = data.draw(st.integers(1, n))
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
  x = np.round(rng.standard_normal((rows, 2, n)) * 4) / 4  # many exact ties
  x[rng.random(x.shape) < 0.2] = -np.inf
  x = jnp.asarray(x, jnp.float32)
  got = jax.jit(lambda a: ops.top_k(a, k))(x)
  want = jax.lax.top_k(x, k)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert got[1].dtype == jnp.int32 and got[0].shape == (rows, 2, k)


def test_top_k_kernel_bad_input():
  with pytest.raises(ValueError, match=r"k = 5 outside \[1, 4\]"):
    ops.top_k(jnp.zeros((2, 4), jnp.float32), 5)
  with pytest.raises(TypeError, match="float32"):
    ops.top_k(jnp.zeros((2, 4), jnp.bfloat16), 2)
  # A long row, many rows (the multi-threaded path): still exact.
  x = jax.random.normal(jax.random.key(0), (64, 40_000), jnp.float32)
  for g, w in zip(jax.jit(lambda a: ops.top_k(a, 2048))(x), jax.lax.top_k(x, 2048)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ---------------------------------------------------------------------------------------------- eviction
REF = reference.CLOCK_REF


def with_policy(case, eviction, data):
  """The case made valid for `eviction`: CLOCK reference bits drawn on every LRU entry, or float32[B, D]
  slot scores with many exact ties and some infinities appended (the score policy's operand)."""
  case = [c.copy() if isinstance(c, np.ndarray) else c for c in case]
  if eviction == "clock":
    bits = np.array(data.draw(hnp.arrays(np.bool_, case[LRU].shape)), np.int32)
    case[LRU] = case[LRU] | (bits * REF)
  elif eviction == "score":
    B, D = len(case[3]), case[SLOTS].shape[2]
    scores = data.draw(
      hnp.arrays(
        np.float32, (B, D), elements=st.sampled_from([-np.inf, -1.0, -0.0, 0.0, 1e-40, 0.5, 0.5, 2.0, 3.0, np.inf])
      )
    )
    case.append(scores)
  return case


@pytest.mark.parametrize("eviction", ["clock", "score"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case_page=swap_in_cases(), data=st.data())
def test_policy_kernel_matches_reference_and_invariants(eviction, case_page, data):
  case, page = case_page
  case = with_policy(case, eviction, data)
  got = run_kernel(*case, page_size=page, eviction=eviction)
  want = run_reference(*case, page_size=page, eviction=eviction)
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)
  layer, top_k, seq_lens, req_ids, host_pages = case[:5]
  rows, _, hot, slot_tokens, lru, stats, status = got
  assert not status.any()
  R, D1, W = hot.shape[1], hot.shape[2], hot.shape[3]
  flat = hot[layer].reshape(R * D1, W)
  for b, r in enumerate(int(x) for x in req_ids):
    if r < 0:
      continue
    host_rows = host_rows_of(host_pages[b], page)
    for k, t in enumerate(top_k[b]):
      if t >= 0:  # every policy serves exactly the token's KV
        np.testing.assert_array_equal(flat[rows[b, k]], case[POOL][layer, host_rows[t]])
    assert sorted(lru[layer, r] & ~REF) == list(range(D1 - 1))
    assert stats[layer, r].sum() == len({int(t) for t in top_k[b] if t >= 0})


@pytest.mark.parametrize("eviction", ["lru", "clock", "score"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), D=st.integers(2, 12), data=st.data())
def test_policy_state_carried_over_decode_steps(eviction, seed, D, data):
  """Eight decode steps of one request with the state carried over (the CLOCK ring and hand, the LRU order,
  the resident set): kernel and reference agree at every step and every served row is its token's KV."""
  rng = np.random.default_rng(seed)
  K = data.draw(st.integers(1, D))
  S, W, page = D + 12, 2, 4
  P = -(-S // page)
  pool = rng.standard_normal((1, P * page, W)).astype(np.float32)
  host_pages = rng.permutation(P).astype(np.int32)[None]
  host_rows = host_rows_of(host_pages[0], page)
  hot = np.zeros((1, 1, D + 1, W), np.float32)
  hot[0, 0, :D] = pool[0, host_rows[:D]]
  state = [
    pool,
    hot,
    np.arange(D, dtype=np.int32)[None, None],
    np.arange(D, dtype=np.int32)[None, None],
    np.zeros((1, 1, 2), np.int32),
  ]
  for seq_len in range(D + 1, D + 9):
    # A drifting working set: positions near a moving centre, plus the newest token.
    centre = rng.integers(0, seq_len)
    top_k = np.clip(centre + rng.integers(-D, D, K), 0, seq_len - 1).astype(np.int32)[None]
    top_k[0, 0] = seq_len - 1
    newest = pool[0, host_rows[seq_len - 1]][None]
    case = [0, top_k, np.array([seq_len], np.int32), np.array([0], np.int32), host_pages, newest, *state]
    scores = None
    if eviction == "score":
      scores = rng.integers(-3, 3, (1, D)).astype(np.float32)
      case.append(scores)
    got = run_kernel(*case, eviction=eviction, page_size=page)
    want = run_reference(*case, eviction=eviction, page_size=page)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
    rows = got[0][0]
    for k, t in enumerate(top_k[0]):
      np.testing.assert_array_equal(got[2][0].reshape(-1, W)[rows[k]], pool[0, host_rows[t]])
    state = got[1:6]


def test_clock_worked_example():
  """Slots [10, 3, 7, 12], ring [0*, 1, 2, 3] (* = reference bit), top-k [3, 15, 8]: 3 hits slot 1 (its bit
  set); the hand clears slot 0's bit, skips slot 1, takes slot 2 for token 8 and stops at slot 3. New ring
  from the hand: [3, 0, 1*, 2]."""
  case = worked_example()
  case[LRU][0, 4] = [0 | REF, 1, 2, 3]
  for fn in (run_kernel, run_reference):
    rows, _, _, slot_tokens, lru, stats, _ = fn(*case, eviction="clock")
    np.testing.assert_array_equal(rows[0], [21, 24, 22, -1])
    np.testing.assert_array_equal(slot_tokens[0, 4], [10, 3, 8, 12])
    np.testing.assert_array_equal(lru[0, 4], [3, 0, 1 | REF, 2])
    np.testing.assert_array_equal(stats[0, 4], [2, 1])


@pytest.mark.parametrize(
  "tokens, scores, victim, new_lru",
  [
    ([10, 3, 7, 12], [5.0, 9.0, 1.0, 1.0], 2, [0, 3, 2, 1]),  # lowest score; the tie goes to the older slot
    ([10, 3, 7, -1], [5.0, 9.0, 1.0, 100.0], 3, [0, 2, 3, 1]),  # an empty slot counts as -inf
    ([10, 3, 7, 12], [-np.inf, np.nan, 1.0, 1.0], 0, [2, 3, 0, 1]),  # a hit slot's NaN is never read
    ([10, 3, 7, 12], [1e-39, 5.0, 0.0, 5.0], 2, [0, 3, 2, 1]),  # a subnormal is above 0 (no flush to zero)
    ([10, 3, 7, 12], [0.0, 5.0, -0.0, 5.0], 2, [0, 3, 2, 1]),  # -0 before +0 (IEEE total order)
    ([10, 3, 7, -1], [5.0, 9.0, -np.inf, 1.0], 3, [0, 2, 3, 1]),  # an empty slot before even -inf
  ],
)
def test_score_worked_examples(tokens, scores, victim, new_lru):
  case = worked_example()
  case[SLOTS][0, 4] = tokens
  case.append(np.array([scores], np.float32))
  for fn in (run_kernel, run_reference):
    rows, _, _, slot_tokens, lru, _, _ = fn(*case, eviction="score")
    np.testing.assert_array_equal(rows[0], [21, 24, 20 + victim, -1])
    assert slot_tokens[0, 4, victim] == 8
    np.testing.assert_array_equal(lru[0, 4], new_lru)


@pytest.mark.parametrize(
  "eviction, mutate, code",
  [
    ("score", lambda c: c[-1].__setitem__((0, 2), np.nan), reference.BAD_SCORE),
    ("clock", lambda c: c[LRU].__setitem__((0, 4, 0), 1 | REF), reference.LRU_NOT_PERMUTATION),
    ("clock", lambda c: c[LRU].__setitem__((0, 4, 0), 1 << 29), reference.LRU_NOT_PERMUTATION),
    ("lru", lambda c: c[LRU].__setitem__((0, 4, 0), 0 | REF), reference.LRU_NOT_PERMUTATION),  # bits only in CLOCK
  ],
)
def test_policy_bad_input_changes_nothing(eviction, mutate, code):
  case = worked_example()
  if eviction == "score":
    case.append(np.array([[0.0, 1.0, 2.0, 3.0]], np.float32))
  mutate(case)
  got = [np.asarray(x) for x in ops.swap_in(*device_args(case), page_size=PAGE, eviction=eviction)]
  assert got[6].tolist() == [code] and (got[0] == -1).all()
  np.testing.assert_array_equal(got[3], case[SLOTS])
  np.testing.assert_array_equal(got[4], case[LRU])
  np.testing.assert_array_equal(got[2], case[HOT])
  assert run_reference(*case, eviction=eviction)[6].tolist() == [code]


def test_score_operand_of_the_wrong_shape_is_an_ffi_error():
  case = worked_example()
  case.append(np.zeros((1, 3), np.float32))
  with pytest.raises(FFI_ERRORS, match=r"needs slot_scores f32\[B, D\]"):
    jax.block_until_ready(ops.swap_in(*device_args(case), page_size=PAGE, eviction="score"))


def test_policy_arguments_are_checked_at_trace_time():
  case = worked_example()
  with pytest.raises(ValueError, match="eviction must be one of"):
    ops.swap_in(*case, page_size=PAGE, eviction="mru")
  with pytest.raises(ValueError, match="exactly when eviction is"):
    ops.swap_in(*case, page_size=PAGE, eviction="score")
  with pytest.raises(ValueError, match="exactly when eviction is"):
    ops.swap_in(*case, np.zeros((1, 4), np.float32), page_size=PAGE, eviction="clock")
  with pytest.raises(TypeError, match="slot_scores must be float32"):
    ops.swap_in(*case, np.zeros((1, 4), np.int32), page_size=PAGE, eviction="score")


def test_copy_blocks_is_checked_and_changes_no_result(monkeypatch):
  """copy_blocks (the CUDA miss copy's blocks per row) is range-checked in Python and by the handler itself;
  the CPU handler's results do not depend on it."""
  case = worked_example()
  for bad in (-1, ops.MAX_COPY_BLOCKS + 1, True, 2.0):
    with pytest.raises(ValueError, match=r"copy_blocks must be an integer in \[0, 1024\]"):
      ops.swap_in(*case, page_size=PAGE, copy_blocks=bad)
  want = run_kernel(*case)
  got = [np.asarray(x) for x in ops.swap_in(*device_args(case), page_size=PAGE, copy_blocks=ops.MAX_COPY_BLOCKS)]
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)
  monkeypatch.setattr(ops, "MAX_COPY_BLOCKS", 2 * ops.MAX_COPY_BLOCKS)  # past Python's check: the handler's own
  with pytest.raises(FFI_ERRORS, match=r"swap_in: copy_blocks must be in \[0, 1024\], got 1025"):
    jax.block_until_ready(ops.swap_in(*device_args(case), page_size=PAGE, copy_blocks=1025))


# ---------------------------------------------------------------------------------------- cross-layer prefetch
# prefetch_start argument positions: layer, top_k, seq_lens, req_ids, host_pages | host_pool, hot, slot_tokens, lru.
@functools.lru_cache(maxsize=None)
def prefetch_jit(page_size, eviction="lru"):
  def run(layer, top_k, seq_lens, req_ids, host_pages, pool, hot, slot_tokens, lru):
    pool, ticket = ops.prefetch_start(
      layer, top_k, seq_lens, req_ids, host_pages, pool, hot, slot_tokens, lru, page_size=page_size, eviction=eviction
    )
    hot, slot_tokens, lru, n = ops.prefetch_wait(ticket, hot, slot_tokens, lru, layer, batch=top_k.shape[0])
    return pool, hot, slot_tokens, lru, n

  return jax.jit(run, donate_argnums=(5, 6, 7, 8))


def run_prefetch(case, page_size, eviction="lru"):
  """(hot, slot_tokens, lru, prefetched) of the kernel's prefetch of case's top_k (a swap-in case)."""
  layer, top_k, seq_lens, req_ids, host_pages, _, pool, hot, slot_tokens, lru, _ = case
  out = prefetch_jit(page_size, eviction)(
    layer,
    *map(jnp.asarray, (top_k, seq_lens, req_ids, host_pages)),
    to_host(pool),
    *map(jnp.asarray, (hot, slot_tokens, lru)),
  )
  np.testing.assert_array_equal(np.asarray(out[0]), pool)  # the pool is only read
  return [np.asarray(x) for x in out[1:]]


@pytest.mark.parametrize("eviction", ["lru", "clock"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case_page=swap_in_cases(), predicted=st.data())
def test_prefetch_then_swap_in_matches_reference_and_is_lossless(eviction, case_page, predicted):
  """A prefetch of predicted positions (some right, some wrong) then the real swap-in: kernel and reference
  agree on every array after each, and every served row is its token's KV (as without a prefetch)."""
  case, page = case_page
  case = with_policy(case, eviction, predicted)
  top_k, seq_lens = case[1], case[2]
  guess = top_k.copy()  # the prediction: the real top-k with some entries moved to other valid positions
  for b in range(len(seq_lens)):
    for k in range(guess.shape[1]):
      if seq_lens[b] and predicted.draw(st.booleans()):
        guess[b, k] = predicted.draw(st.integers(-1, int(seq_lens[b]) - 1))
  pf_case = [case[0], guess, *case[2:]]
  got = run_prefetch(pf_case, page, eviction)
  want = reference.prefetch(*pf_case[:NEWEST], *pf_case[POOL:STATS], page_size=page, eviction=eviction)
  for name, g, w in zip(["hot", "slot_tokens", "lru", "prefetched"], got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)
  assert (got[3] >= 0).all()
  after = [*case[:HOT], *got[:3], case[STATS]]
  got2 = run_kernel(*after, page_size=page, eviction=eviction)
  want2 = run_reference(*after, page_size=page, eviction=eviction)
  for name, g, w in zip(NAMES, got2, want2):
    np.testing.assert_array_equal(g, w, err_msg=name)
  plain = run_kernel(*case, page_size=page, eviction=eviction)  # the same swap-in without a prefetch
  layer, _, _, req_ids, host_pages = case[:5]
  rows, hot = got2[0], got2[2]
  R, D1, W = hot.shape[1:]
  for b, r in enumerate(int(x) for x in req_ids):
    for k, t in enumerate(top_k[b]):
      if r >= 0 and t >= 0:
        want_row = case[POOL][layer, host_rows_of(host_pages[b], page)[t]]
        np.testing.assert_array_equal(hot[layer].reshape(R * D1, W)[rows[b, k]], want_row)
        np.testing.assert_array_equal(plain[2][layer].reshape(R * D1, W)[plain[0][b, k]], want_row)
  # The stats count what the swap-in found: a prefetched row is a hit. Hits + misses are the same.
  np.testing.assert_array_equal(got2[5].sum(-1), plain[5].sum(-1))


def test_prefetch_worked_example():
  """The worked example (slots [10, 3, 7, 12], LRU [0, 1, 2, 3], seq_len 16) with predicted [3, 15, 8]: 3
  hits, 15 is the newest (never copied), 8 takes the LRU slot 0; then the real top-k [3, 15, 8] hits all."""
  case = worked_example()
  hot, slot_tokens, lru, n = run_prefetch(case, PAGE)
  assert n.tolist() == [1]  # one row copied
  np.testing.assert_array_equal(slot_tokens[0, 4], [8, 3, 7, 12])
  np.testing.assert_array_equal(lru[0, 4], [2, 3, 0, 1])
  rows, _, _, _, _, stats, status = run_kernel(*case[:HOT], hot, slot_tokens, lru, case[STATS])
  np.testing.assert_array_equal(rows[0], [21, 24, 20, -1])
  assert stats[0, 4].tolist() == [3, 0] and not status.any()


def test_prefetch_bad_row_is_left_alone_and_score_is_refused():
  """A row with a position past its seq_len is skipped (-status, nothing changed), the others prefetched;
  eviction "score" (it needs the layer's own scores) and unknown policies are errors at trace time."""
  case = worked_example()
  case[1] = case[1].copy()
  case[1][0, 0] = 99
  hot, slot_tokens, lru, n = run_prefetch(case, PAGE)
  assert n.tolist() == [-reference.POSITION_OUT_OF_RANGE]
  np.testing.assert_array_equal(hot, case[HOT])
  np.testing.assert_array_equal(slot_tokens, case[SLOTS])
  np.testing.assert_array_equal(lru, case[LRU])
  out_of_range = [5, *case[1:]]  # the layer (an int32 operand inside jit) past the pool's one layer
  hot, slot_tokens, lru, n = run_prefetch(out_of_range, PAGE)
  assert n.tolist() == [-reference.LAYER_OUT_OF_RANGE]
  np.testing.assert_array_equal(slot_tokens, case[SLOTS])
  for eviction in ("score", "fifo"):
    with pytest.raises(ValueError, match="eviction"):
      ops.prefetch_start(
        0, *case[1:NEWEST], case[POOL], case[HOT], case[SLOTS], case[LRU], page_size=PAGE, eviction=eviction
      )
  with pytest.raises(FFI_ERRORS, match="top_k"):  # K > D: a shape error of the whole call
    big = np.zeros((1, 5), np.int32)
    ops.prefetch_start(0, big, *case[2:NEWEST], to_host(case[POOL]), *map(jnp.asarray, case[HOT:STATS]), page_size=PAGE)


def test_prefetch_commits_into_whatever_arrays_the_wait_gets():
  """The background never writes an XLA buffer: the wait commits into its own operands. Eagerly (every
  operand a fresh buffer), with the wait's `after` aliasing its operands, or with the ticket lost (a fresh one:
  nothing to commit), the results are the reference's or unchanged; a slot table changed between start and
  wait drops that row's prefetch (PREFETCH_STALE) and leaves it as the wait got it."""
  case = worked_example()
  want = reference.prefetch(*case[:NEWEST], *case[POOL:STATS], page_size=PAGE)
  pool, hot, slots, order = to_host(case[POOL]), *map(jnp.asarray, case[HOT:STATS])
  head = [jnp.asarray(x) for x in case[:NEWEST]]
  for after in ("slots", "hot", "ticket"):
    _, ticket = ops.prefetch_start(*head, pool, hot, slots, order, page_size=PAGE)  # eager: no donation
    anchor = {"slots": slots, "hot": hot, "ticket": ticket}[after]
    got = [np.asarray(x) for x in ops.prefetch_wait(ticket, hot, slots, order, anchor, batch=1)]
    for name, g, w in zip(["hot", "slot_tokens", "lru", "prefetched"], got, want):
      np.testing.assert_array_equal(g, w, err_msg=f"{name}, after={after}")
  _, ticket = ops.prefetch_start(*head, pool, hot, slots, order, page_size=PAGE)
  got = ops.prefetch_wait(jnp.zeros((1, 2), jnp.int32), hot, slots, order, 0, batch=1)  # an unknown ticket
  for g, w in zip(got, (case[HOT], case[SLOTS], case[LRU], [0])):
    np.testing.assert_array_equal(np.asarray(g), w)
  ops.prefetch_wait(ticket, hot, slots, order, 0, batch=1)  # the real one, left over: taken and committed
  moved = slots.at[0, 4, 0].set(11)  # request 4's slot table changed after the start
  _, ticket = ops.prefetch_start(*head, pool, hot, slots, order, page_size=PAGE)
  got = [np.asarray(x) for x in ops.prefetch_wait(ticket, hot, moved, order, 0, batch=1)]
  assert got[3].tolist() == [-reference.PREFETCH_STALE]
  np.testing.assert_array_equal(got[0], case[HOT])
  np.testing.assert_array_equal(got[1], np.asarray(moved))
  assert "changed between prefetch start and wait" in ops.status_message(reference.PREFETCH_STALE)
  for batch in (-1, 1.0, True):
    with pytest.raises(ValueError, match="batch must be an integer >= 0"):
      ops.prefetch_wait(ticket, hot, slots, order, 0, batch=batch)
  # A wait handed a hot buffer of another dtype (same bytes a row, or the same shape) is an error; so are slot
  # tables of another dtype (int8 ones were read past their end as int32; float32 ones got int32 slot ids).
  for other in (hot.astype(jnp.int32), jnp.zeros(hot.shape[:3] + (2 * hot.shape[3],), jnp.float16)):
    _, ticket = ops.prefetch_start(*head, pool, hot, slots, order, page_size=PAGE)
    with pytest.raises(FFI_ERRORS, match="do not match the prefetch_start of the ticket"):
      jax.block_until_ready(ops.prefetch_wait(ticket, other, slots, order, 0, batch=1))
  for dtype in (jnp.int8, jnp.float32, jnp.uint32):
    for tables in ((slots.astype(dtype), order), (slots, order.astype(dtype))):
      _, ticket = ops.prefetch_start(*head, pool, hot, slots, order, page_size=PAGE)
      with pytest.raises(FFI_ERRORS, match=r"slot_tokens / lru s32\[L, R, D\]"):
        jax.block_until_ready(ops.prefetch_wait(ticket, hot, *tables, 0, batch=1))
  for bad in (ticket.astype(jnp.float32), ticket[0]):
    with pytest.raises(ValueError, match=r"ticket must be prefetch_start's int32\[1, 2\]"):
      ops.prefetch_wait(bad, hot, slots, order, 0, batch=1)


@pytest.mark.parametrize(
  "eviction, change",
  [
    ("lru", lambda order: order.at[0, 4].set(jnp.int32([1, 0, 2, 3]))),  # the order permuted
    ("clock", lambda order: order.at[0, 4, 3].set(3 | REF)),
  ],  # one slot's reference bit set, nothing else
  ids=["lru-order", "clock-bit"],
)
def test_prefetch_is_stale_when_only_the_lru_array_changed(eviction, change):
  """The worked example's prefetch with its slot table untouched but its LRU array changed between start and
  wait is dropped (PREFETCH_STALE; the row left as the wait got it); with nothing changed it commits."""
  case = worked_example()
  pool, hot, slots, order = to_host(case[POOL]), *map(jnp.asarray, case[HOT:STATS])
  head = [jnp.asarray(x) for x in case[:NEWEST]]
  changed = change(order)
  committed = reference.prefetch(*case[:NEWEST], *case[POOL:STATS], page_size=PAGE, eviction=eviction)
  assert committed[3].tolist() == [1]
  for lru, want in ((order, committed), (changed, (case[HOT], case[SLOTS], changed, [-reference.PREFETCH_STALE]))):
    _, ticket = ops.prefetch_start(*head, pool, hot, slots, order, page_size=PAGE, eviction=eviction)
    got = ops.prefetch_wait(ticket, hot, slots, lru, 0, batch=1)
    for name, g, w in zip(["hot", "slot_tokens", "lru", "prefetched"], got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_prefetch_in_a_jitted_step_copies_no_pool_or_hot_buffer():
  """swap-in of layer 0, gather, prefetch of layer 1 ordered before the compute by an optimization barrier,
  then the wait and layer 1's swap-in (a decode step's structure): no copy of the pool or the hot buffer in
  the compiled step, buffers updated in place, rows exact."""
  case = worked_example()
  L, H, W = 2, *case[POOL].shape[1:]
  pool = np.concatenate([case[POOL], case[POOL] + 100])
  state = [np.concatenate([x, x]) for x in case[HOT:]]
  head = [jnp.asarray(x) for x in case[1:NEWEST]]

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4))
  def step(pool, hot, slot_tokens, lru, stats):
    x = jnp.zeros((1, W), jnp.float32)
    for layer in range(L):
      if layer:
        hot, slot_tokens, lru, n = ops.prefetch_wait(ticket, hot, slot_tokens, lru, x, batch=1)
      rows, pool, hot, slot_tokens, lru, stats, _ = ops.swap_in(
        layer, *head, hot[layer, 4, 3][None], pool, hot, slot_tokens, lru, stats, page_size=PAGE
      )
      out = hot[layer].reshape(-1, W)[jnp.maximum(rows[0], 0)]
      if layer + 1 < L:
        pool, ticket = ops.prefetch_start(layer + 1, head[0], *head[1:], pool, hot, slot_tokens, lru, page_size=PAGE)
        out, ticket = jax.lax.optimization_barrier((out, ticket))
      x = x + jnp.tanh(out).sum(0, keepdims=True)
    return rows, pool, hot, stats, slot_tokens, lru, n

  args = (to_host(pool), *map(jnp.asarray, state))
  hlo = step.lower(*args).compile().as_text()
  for shape in (f"f32[{L},{H},{W}]", "f32[{},{},{},{}]".format(*state[0].shape)):
    copies = [l for l in hlo.splitlines() if " copy(" in l and shape in l]
    assert not copies, copies
  hot_ptr = args[1].unsafe_buffer_pointer()
  rows, pool_out, hot, stats, _, _, n = step(*args)
  assert np.asarray(n).tolist() == [1]  # token 8 prefetched for layer 1
  assert hot.unsafe_buffer_pointer() == hot_ptr
  np.testing.assert_array_equal(np.asarray(rows)[0], [21, 24, 20, -1])
  flat = np.asarray(hot)[1].reshape(-1, W)
  np.testing.assert_array_equal(flat[20], pool[1, host_rows_of(case[4][0], PAGE)[8]])  # prefetched for layer 1
  assert np.asarray(stats)[1, 4].tolist() == [3, 0]  # layer 1's swap-in: all hits (8 was prefetched)
  assert np.asarray(stats)[0, 4].tolist() == [2, 1]


def test_a_decode_view_with_a_prefetch_in_flight_is_refused():
  """HiSparseState.create checks prefetch_depth; absorbing a decode view whose last prefetch was never waited for
  (a layer gathered, the next not) is a trace-time error, not rows landing in a buffer XLA may free."""
  from hisparse_jax.memory.views import HiSparseState

  kw = dict(
    num_layers=2,
    page_size=4,
    latent_dim=3,
    index_dim=2,
    dtype=jnp.float32,
    index_pages=4,
    staging_pages=2,
    request_slots=2,
    device_buffer_size=4,
    host_pages=4,
  )
  for bad in (-1, True, 1.5):
    with pytest.raises(ValueError, match="prefetch_depth"):
      HiSparseState.create(**kw, prefetch_depth=bad)
  for eviction in ("score", "score_ema"):
    with pytest.raises(ValueError, match="prefetch_depth"):
      HiSparseState.create(**kw, eviction=eviction, prefetch_depth=2)
  with pytest.raises(ValueError, match="eviction must be one of"):
    HiSparseState.create(**kw, eviction="score-ema")
  assert HiSparseState.create(**kw).score_ema is None  # only "score_ema" keeps the averages
  assert np.isnan(np.asarray(HiSparseState.create(**kw, eviction="score_ema").score_ema)).all()
  state = HiSparseState.create(**kw, prefetch_depth=2)
  tables = {
    "index_pages": jnp.zeros((1, 2), jnp.int32),
    "host_pages": jnp.zeros((1, 2), jnp.int32),
    "req_ids": jnp.zeros((1,), jnp.int32),
  }
  view = state.view(tables)
  assert view.prefetch_depth == 2 and view.prefetch_ticket is None
  state.absorb(view)
  with pytest.raises(ValueError, match="prefetch is still in flight"):
    state.absorb(dataclasses.replace(view, prefetch_ticket=jnp.zeros((1, 2), jnp.int32)))


def test_layer_and_prefetch_thread_settings_are_checked():
  """A NumPy layer outside [0, 2^31) is an error, not a wrap; a HISPARSE_PREFETCH_THREADS that is not an
  integer in [0, 64] stops the first prefetch_start with a message naming it (0 works: the work runs in the
  wait, or when the pool it reads is closed)."""
  for layer in (np.int64(2**32), np.int64(-1)):
    with pytest.raises(ValueError, match="layer"):
      ops._layer(layer)
  # With 0 threads a start never waited for stays queued: closing an extension pool runs it (it reads the pool).
  script = (
    "import numpy as np; from hisparse_jax.kernels import ops, reference as r; c = r.worked_example(); "
    "p = ops.ExtensionHostPool(*c[6].shape, np.float32); p.write(c[6]); "
    "ops.prefetch_start(*c[:5], p.token(), *c[7:10], page_size=r.WORKED_EXAMPLE_PAGE_SIZE, external=p.ref); "
    "p.close(); print(ops.prefetch_threads())"
  )
  for value, ok in (("abc", False), ("100000", False), ("\u00b2", False), ("1\u0663", False), ("0", True)):
    r = subprocess.run(
      [sys.executable, "-c", script],
      capture_output=True,
      text=True,
      timeout=120,
      env={**os.environ, "HISPARSE_PREFETCH_THREADS": value},
    )
    assert (r.returncode == 0) == ok, r.stderr[-500:]
    assert ok and r.stdout.strip() == "0" or "HISPARSE_PREFETCH_THREADS must be an integer" in r.stderr


def test_closing_an_extension_pool_waits_for_the_swap_in_reading_it():
  """ExtensionHostPool.close() racing a swap-in that reads the pool: the swap-in either finishes first (close
  waits for it) or is refused (not a live pool), and the freed pool is never read (before the handlers pinned
  their pool, this crashed in about one close in four: heap-use-after-free in the miss copy under ASan)."""
  r = subprocess.run(
    [sys.executable, os.path.join(os.path.dirname(__file__), "close_race.py")],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  outcomes = r.stdout.split()
  assert len(outcomes) == 8 and set(outcomes) <= {"done", "refused"}, r.stdout


def _rss_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_plan_memory_follows_the_sequence_not_the_page_table_span():
  """The CPU plan's position map is sized by each row's sequence, not by its page table's span (pages x
  page_size): a 1-token request with a page of 2^30 tokens took 4.2 GiB of resident memory per planning thread,
  and 2^31 - 1 crashed the process. A sequence past 2^22 tokens plans with the hash map the CUDA handler uses
  (O(top_k) memory): the same results as the reference."""
  # 1. A huge page, one token: the fast path (every token in its own slot), no large allocation.
  L, R, D, W, page = 1, 2, 4, 2, 1 << 30
  pool = np.arange(L * 8 * W, dtype=np.float32).reshape(L, 8, W)
  hot = np.zeros((L, R, D + 1, W), np.float32)
  tables = np.tile(np.arange(D, dtype=np.int32), (L, R, 1))
  case = [
    0,
    np.array([[0, -1]], np.int32),
    np.array([1], np.int32),
    np.array([1], np.int32),
    np.array([[0]], np.int32),
    np.full((1, W), 5, np.float32),
    pool,
    hot,
    tables,
    tables.copy(),
    np.zeros((L, R, 2), np.int32),
  ]
  before = _rss_bytes()
  rows, _, hot_out, _, _, stats, status = run_kernel(*case, page_size=page)
  assert _rss_bytes() - before < 256 << 20
  assert status.tolist() == [0] and rows.tolist() == [[1 * (D + 1) + 0, -1]]
  np.testing.assert_array_equal(hot_out[0, 1, 0], [5, 5])  # the newest token (position 0) in its own slot
  # 2. Past 2^22 tokens: the hash map; hits, misses and LRU victims as the reference's. Every page of the
  # table maps to host page 0 (a 2^20-row pool), so the reference's position -> row table stays 8M entries.
  rng = np.random.default_rng(7)
  page, P, seq_len, K, D = 1 << 20, 8, 5_000_000, 8, 16
  pool = rng.standard_normal((1, page, W)).astype(np.float32)
  resident = rng.choice(seq_len - 1, D, replace=False).astype(np.int32)
  top_k = np.concatenate([resident[:3], rng.choice(seq_len, K - 3, replace=False)]).astype(np.int32)[None]
  slot_tokens = np.full((1, 1, D), -1, np.int32)
  slot_tokens[0, 0] = resident
  case = [
    0,
    top_k,
    np.array([seq_len], np.int32),
    np.array([0], np.int32),
    np.zeros((1, P), np.int32),
    rng.standard_normal((1, W)).astype(np.float32),
    pool,
    np.zeros((1, 1, D + 1, W), np.float32),
    slot_tokens,
    rng.permutation(D).astype(np.int32)[None, None],
    np.zeros((1, 1, 2), np.int32),
  ]
  got = run_kernel(*case, page_size=page)
  want = run_reference(*case, page_size=page)
  for name, g, w in zip(NAMES, got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)
  assert got[6].tolist() == [0] and got[5][0, 0].tolist() == [3, K - 3]


def test_hash_map_plans_in_a_row_match_the_reference():
  """Past 2^22 tokens the CPU plans with the hash map, which every plan must leave empty: six decode steps of
  three requests (a call plans its rows one after another on one thread) give the reference's results. Each
  top-k starts with a position whose home is the map's last entry (HashPositionMap::Home, swap_in_core.h), so
  each next plan inserts it where the last one left it. Top-k 48: a 128-entry map, larger than other tests'
  (a thread's map is then new, so what a plan leaves behind is this test's own)."""
  page, P, K, D, W, B, H = 1 << 20, 5, 48, 64, 2, 3, 128
  rng = np.random.default_rng(3)
  candidates = np.array([i * page + r for i in range(P - 1) for r in range(H)], np.int64)  # host row r < H
  last = next(int(t) for t in candidates if (int(t) * 2654435769) % 2**32 & 127 == 127)
  working = rng.choice(candidates, 96, replace=False)  # a working set: hits and misses
  pool = rng.standard_normal((1, H, W)).astype(np.float32)
  host_pages = np.zeros((B, P), np.int32)  # every page on host page 0: position t's row is t % page
  slot_tokens = np.stack([rng.choice(working, D, replace=False) for _ in range(B)]).astype(np.int32)[None]
  hot = np.zeros((1, B, D + 1, W), np.float32)
  hot[0, :, :D] = pool[0, slot_tokens[0] % page]
  state = [
    pool,
    hot,
    slot_tokens,
    np.stack([rng.permutation(D) for _ in range(B)]).astype(np.int32)[None],
    np.zeros((1, B, 2), np.int32),
  ]
  for step in range(6):
    top_k = rng.choice(working, (B, K)).astype(np.int32)
    top_k[:, 0] = last
    top_k[:, -4:] = np.where(rng.random((B, 4)) < 0.5, -1, top_k[:, -4:])
    case = [
      0,
      top_k,
      np.full(B, (1 << 22) + 100 + step, np.int32),
      np.arange(B, dtype=np.int32),
      host_pages,
      rng.standard_normal((B, W)).astype(np.float32),
      *state,
    ]
    got = run_kernel(*case, page_size=page)
    want = run_reference(*case, page_size=page)
    for name, g, w in zip(NAMES, got, want):
      np.testing.assert_array_equal(g, w, err_msg=f"{name}, step {step}")
    assert not got[6].any()
    state = got[1:6]
  assert state[-1][0, :, 1].sum() > 0 and state[-1][0, :, 0].sum() > 0  # misses and hits


ON_AN_EXPLICIT_MESH = """
import functools, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from hisparse_jax.kernels import ops, reference
from hisparse_jax.kernels.reference import WORKED_EXAMPLE_PAGE_SIZE as PAGE, worked_example
case = worked_example()
want = reference.swap_in(*case, page_size=PAGE)
mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(mesh):
  put = lambda i, x, spec=P(): jax.device_put(np.asarray(x), NamedSharding(mesh, spec, memory_kind="pinned_host" if i == 6 else None))
  args = [0, *(put(i, x) for i, x in enumerate(case) if i)]
  for name, fn in (("eager", functools.partial(ops.swap_in, page_size=PAGE)),
                   ("jit", jax.jit(functools.partial(ops.swap_in, page_size=PAGE)))):
    got = fn(*args)
    print(name, all(np.array_equal(np.asarray(g), w) for g, w in zip(got, want)))
  args[7] = put(7, np.zeros((1, 6, 5, 3), np.float32), P(None, "tp"))  # a hot buffer split over R
  try:
    ops.swap_in(*args, page_size=PAGE)
  except ValueError as e:
    print("refused", "jax.sharding.reshard them first" in str(e))
"""


def test_operands_on_a_mesh_with_explicit_axes():
  """Under a context mesh with Explicit axes: an eager call runs (an eager shard_map refused the arrays with a
  jax-internal error) and equals the reference, as the jitted one does; an operand split over the mesh, which
  the kernels take replicated, is refused naming the remedy (it was shard_map's in_specs error). An operand in
  unpinned_host memory is refused too (XLA models it as device memory; donated, it aborted the process)."""
  from tests.xla_env import with_devices

  r = subprocess.run(
    [sys.executable, "-c", ON_AN_EXPLICIT_MESH],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    env={**os.environ, "XLA_FLAGS": with_devices(2)},
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.split() == ["eager", "True", "jit", "True", "refused", "True"], r.stdout
  case = device_args(worked_example())
  unpinned = jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind="unpinned_host")
  case[POOL] = jax.device_put(np.asarray(case[POOL]), unpinned)
  with pytest.raises(ValueError, match="in unpinned_host memory: the kernels take device arrays and a pinned_host"):
    ops.swap_in(*case, page_size=PAGE)
