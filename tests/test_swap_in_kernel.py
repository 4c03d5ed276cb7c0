"""The swap-in and backup FFI handlers against the NumPy reference, the worked example and bad input."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_jax import ops, reference
from hisparse_jax.reference import worked_example

# An FFI INVALID_ARGUMENT surfaces as JaxRuntimeError, or ValueError when the call is dispatched eagerly.
FFI_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
swap_in_jit = jax.jit(ops.swap_in, donate_argnums=(4, 5, 6, 7, 8))
backup_jit = jax.jit(ops.backup, donate_argnums=(3,))


def to_host(x):
  return jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host))(jnp.asarray(x))


def run_kernel(layer, top_k, seq_lens, host_rows, pool, hot, slot_tokens, lru, stats, fn=swap_in_jit):
  out = fn(layer, jnp.asarray(top_k), jnp.asarray(seq_lens), jnp.asarray(host_rows),
                    to_host(pool), jnp.asarray(hot), jnp.asarray(slot_tokens), jnp.asarray(lru),
                    jnp.asarray(stats))
  return [np.asarray(x) for x in out]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_worked_example(impl):
  args = worked_example()
  fn = run_kernel if impl == "kernel" else reference.swap_in
  rows, pool, hot, slot_tokens, lru, stats = fn(*args)
  np.testing.assert_array_equal(rows[4], [21, 24, 20, -1])
  np.testing.assert_array_equal(slot_tokens[0, 4], [8, 3, 7, 12])
  np.testing.assert_array_equal(lru[0, 4], [2, 3, 0, 1])
  host_row_of_8 = args[3][4, 8]
  np.testing.assert_array_equal(hot[0].reshape(-1, 3)[20], args[4][0, host_row_of_8])
  # Only device row 20 changed.
  changed = np.flatnonzero((hot != args[5]).any(-1).reshape(-1))
  np.testing.assert_array_equal(changed, [20])
  np.testing.assert_array_equal(stats[0, 4], [2, 1])  # hits: 3 and newest 15; miss: 8


def test_worked_example_is_in_place():
  args = worked_example()
  pool, hot = to_host(args[4]), jnp.asarray(args[5])
  pool_ptr, hot_ptr = pool.unsafe_buffer_pointer(), hot.unsafe_buffer_pointer()
  out = swap_in_jit(0, *map(jnp.asarray, args[1:4]), pool, hot, *map(jnp.asarray, args[6:]))
  assert out[1].sharding.memory_kind == "pinned_host"
  assert out[1].unsafe_buffer_pointer() == pool_ptr
  assert out[2].unsafe_buffer_pointer() == hot_ptr


@st.composite
def swap_in_cases(draw):
  L = draw(st.integers(1, 2))
  B = draw(st.integers(1, 3))
  D = draw(st.integers(1, 12))
  K = draw(st.integers(1, D))
  S = draw(st.integers(1, 40))
  W = draw(st.integers(1, 4))
  H = S * B + draw(st.integers(0, 5))
  layer = draw(st.integers(0, L - 1))
  seq_lens = np.array([draw(st.integers(0, S)) for _ in range(B)], np.int32)
  # Each lane owns distinct host rows (a random page table).
  perm = draw(st.permutations(range(H)))
  host_rows = np.array(perm[: B * S], np.int32).reshape(B, S)
  slot_tokens = np.zeros((L, B, D), np.int32)
  lru = np.zeros((L, B, D), np.int32)
  top_k = np.full((B, K), -1, np.int32)
  for b in range(B):
    n = int(seq_lens[b])
    for l in range(L):
      if n > D:  # a consistent resident set: distinct tokens older than the newest, some empty
        tokens = draw(st.lists(st.integers(-1, n - 2), min_size=D, max_size=D))
        seen = set()
        for i, t in enumerate(tokens):
          if t in seen:
            tokens[i] = -1
          seen.add(t)
        slot_tokens[l, b] = tokens
      else:
        slot_tokens[l, b] = np.arange(D)
      lru[l, b] = draw(st.permutations(range(D)))
    if n:
      top_k[b] = draw(hnp.arrays(np.int32, K, elements=st.integers(-1, n - 1)))
  pool = np.arange(L * H * W, dtype=np.float32).reshape(L, H, W) * 0.5
  hot = -np.arange(L * B * (D + 1) * W, dtype=np.float32).reshape(L, B, D + 1, W)
  # Rows already resident hold their token's KV, as the engine guarantees.
  for l in range(L):
    for b in range(B):
      for s in range(D):
        t = slot_tokens[l, b, s]
        if 0 <= t < seq_lens[b]:
          hot[l, b, s] = pool[l, host_rows[b, t]]
      if seq_lens[b]:
        hot[l, b, D] = pool[l, host_rows[b, seq_lens[b] - 1]]
        if seq_lens[b] <= D:
          for t in range(seq_lens[b]):
            hot[l, b, t] = pool[l, host_rows[b, t]]
  stats = np.zeros((L, B, 2), np.int32)
  return [layer, top_k, seq_lens, host_rows, pool, hot, slot_tokens, lru, stats]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swap_in_cases())
def test_kernel_matches_reference_and_invariants(case):
  got = run_kernel(*case)
  want = reference.swap_in(*case)
  for name, g, w in zip(["rows", "pool", "hot", "slot_tokens", "lru", "stats"], got, want):
    np.testing.assert_array_equal(g, w, err_msg=name)

  layer, top_k, seq_lens, host_rows, pool = case[:5]
  rows, _, hot, slot_tokens, lru, stats = got
  B, D1, W = hot.shape[1], hot.shape[2], hot.shape[3]
  flat = hot[layer].reshape(B * D1, W)
  for b in range(B):
    needed = {int(t) for t in top_k[b] if t >= 0}
    for k, t in enumerate(top_k[b]):
      if t < 0:
        assert rows[b, k] == -1
        continue
      # Every output row is in the request's own hot buffer and holds exactly its token's KV.
      assert b * D1 <= rows[b, k] < (b + 1) * D1
      np.testing.assert_array_equal(flat[rows[b, k]], pool[layer, host_rows[b, t]])
    if seq_lens[b] > D1 - 1:
      # No needed token was evicted: each sits in exactly one slot (the newest in the reserved one).
      resident = [int(x) for x in slot_tokens[layer, b]]
      for t in needed - {int(seq_lens[b]) - 1}:
        assert resident.count(t) == 1
      assert sorted(lru[layer, b]) == list(range(D1 - 1))
    # Each distinct position is counted once: hits + misses = distinct needed.
    assert stats[layer, b].sum() == len(needed)


def test_fast_path_no_io_lru_unchanged():
  case = worked_example()
  case[2][4] = 4  # seq_len <= D
  case[1][4] = [0, 3, 3, -1]
  rows, _, hot, slot_tokens, lru, stats = run_kernel(*case)
  np.testing.assert_array_equal(rows[4], [20, 23, 23, -1])
  np.testing.assert_array_equal(hot, case[5])
  np.testing.assert_array_equal(lru, case[7])
  np.testing.assert_array_equal(slot_tokens, case[6])
  np.testing.assert_array_equal(stats[0, 4], [2, 0])


def test_duplicates_and_padding_copy_once():
  case = worked_example()
  case[1][4] = [8, 8, -1, 8]
  rows, _, hot, _, _, stats = run_kernel(*case)
  np.testing.assert_array_equal(rows[4], [20, 20, -1, 20])
  np.testing.assert_array_equal(stats[0, 4], [0, 1])
  assert (hot != case[5]).any(-1).sum() == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c[1].__setitem__((4, 0), 16), "top-k position is >= seq_len"),
    (lambda c: c[1].__setitem__((4, 0), -2), "top-k position is >= seq_len or < -1"),
    (lambda c: c[3].__setitem__((4, 8), 999), "host-pool row"),
    (lambda c: c[3].__setitem__((4, 8), -1), "host-pool row"),
    (lambda c: c[7].__setitem__((0, 4, 0), 1), "not a permutation"),
    (lambda c: c[2].__setitem__(4, 17), "seq_len"),
    (lambda c: c.__setitem__(0, 1), "layer index"),
])
def test_bad_input_is_an_error_and_changes_nothing(mutate, message):
  case = worked_example()
  mutate(case)
  pool, hot = to_host(case[4]), jnp.asarray(case[5])
  state = [jnp.asarray(x) for x in case[6:]]
  with pytest.raises(FFI_ERRORS, match=message):
    jax.block_until_ready(ops.swap_in(case[0], *map(jnp.asarray, case[1:4]), pool, hot, *state))
  # Not donated here: the inputs are intact and a correct call still works afterwards.
  np.testing.assert_array_equal(np.asarray(hot), case[5])
  good = worked_example()
  rows = run_kernel(*good)[0]
  np.testing.assert_array_equal(rows[4], [21, 24, 20, -1])
  with pytest.raises(reference.SwapInError):
    reference.swap_in(*case)


def test_top_k_larger_than_buffer_is_an_error():
  case = worked_example()
  case[1] = np.full((5, 5), -1, np.int32)  # K = 5 > D = 4
  with pytest.raises(FFI_ERRORS, match=r"top_k \(5\) > device_buffer_size \(4\)"):
    run_kernel(*case)
  with pytest.raises(reference.SwapInError):
    reference.swap_in(*case)


def test_backup_writes_rows_in_place():
  L, H, W = 3, 10, 4
  pool = to_host(np.zeros((L, H, W), np.float32))
  ptr = pool.unsafe_buffer_pointer()
  rows = jnp.arange(2 * 3 * W, dtype=jnp.float32).reshape(2, 3, W) + 1
  out = backup_jit(1, rows, jnp.array([7, -1, 0], jnp.int32), pool)
  assert out.unsafe_buffer_pointer() == ptr and out.sharding.memory_kind == "pinned_host"
  want = np.zeros((L, H, W), np.float32)
  want[1, 7], want[2, 7] = rows[0, 0], rows[1, 0]
  want[1, 0], want[2, 0] = rows[0, 2], rows[1, 2]
  np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("layer, dst, message", [
    (2, [0, 0, 0], r"layers \[2, 4\) outside \[0, 3\)"),
    (0, [0, 10, 0], r"dst\[1\] = 10 outside \[-1, 10\)"),
    (0, [-2, 0, 0], r"dst\[0\] = -2"),
])
def test_backup_bad_input(layer, dst, message):
  pool = to_host(np.zeros((3, 10, 4), np.float32))
  with pytest.raises(FFI_ERRORS, match=message):
    jax.block_until_ready(ops.backup(layer, jnp.ones((2, 3, 4)), jnp.array(dst, jnp.int32), pool))


def test_in_place_inside_a_jitted_step_has_no_pool_copy():
  """backup then swap-in on a pinned_host pool: the compiled step holds no copy of the pool."""
  case = worked_example()
  L, H, W = case[4].shape

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(pool, hot, slot_tokens, lru, stats, new_row, dst):
    pool = ops.backup(0, new_row, dst, pool)
    rows, pool, hot, *_ = ops.swap_in(0, *map(jnp.asarray, case[1:4]), pool, hot, slot_tokens, lru, stats)
    return rows, pool, hot

  args = (to_host(case[4]), jnp.asarray(case[5]), *map(jnp.asarray, case[6:]),
          jnp.ones((1, 5, W), jnp.float32), jnp.full((5,), -1, jnp.int32).at[4].set(case[3][4, 15]))
  hlo = step.lower(*args).compile().as_text()
  pool_shape = f"f32[{L},{H},{W}]"
  copies = [l for l in hlo.splitlines() if " copy(" in l and pool_shape in l]
  assert not copies, copies
  rows, pool, _ = step(*args)
  np.testing.assert_array_equal(np.asarray(rows)[4], [21, 24, 20, -1])
  np.testing.assert_array_equal(np.asarray(pool)[0, case[3][4, 15]], np.ones(W))


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
  pool = ops.ExtensionHostPool(*case[4].shape, np.float32)
  pool.write(case[4])
  out = jax.jit(functools.partial(ops.swap_in, external=pool.ref), donate_argnums=(4, 5, 6, 7, 8))(
      0, *map(jnp.asarray, case[1:4]), pool.token(), *map(jnp.asarray, case[5:]))
  want = reference.swap_in(*case)
  for i in (0, 2, 3, 4, 5):
    np.testing.assert_array_equal(np.asarray(out[i]), want[i])
  new_rows = jnp.full((1, 1, 3), 7.0, jnp.float32)
  jax.block_until_ready(ops.backup(0, new_rows, jnp.array([5], jnp.int32), pool.token(), external=pool.ref))
  assert (pool.read()[0, 5] == 7).all()
  # A forged or freed address is an error, never a wild access.
  forged = ops.ExternalPoolRef(pool.address + 64, 1, 32)
  with pytest.raises(FFI_ERRORS, match="not a live extension pool"):
    jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), pool.token(), external=forged))
  too_big = ops.ExternalPoolRef(pool.address, 1, 10**6)
  with pytest.raises(FFI_ERRORS, match="not a live extension pool"):
    jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), pool.token(), external=too_big))
  ref = pool.ref
  pool.close()
  with pytest.raises(FFI_ERRORS, match="not a live extension pool"):
    jax.block_until_ready(ops.backup(0, new_rows, jnp.array([0], jnp.int32), jnp.zeros((1,), jnp.int32),
                                     external=ref))


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.float4_e2m1fn])
def test_sub_byte_dtypes_are_rejected(dtype):
  pool = to_host(jnp.zeros((1, 64, 256), dtype))
  with pytest.raises(FFI_ERRORS, match="below one byte"):
    jax.block_until_ready(ops.backup(0, jnp.ones((1, 1, 256), dtype), jnp.array([63], jnp.int32), pool))
  case = worked_example()
  with pytest.raises(FFI_ERRORS, match="below one byte"):
    jax.block_until_ready(ops.swap_in(0, *map(jnp.asarray, case[1:4]), to_host(jnp.zeros((1, 32, 4), dtype)),
                                      jnp.zeros((1, 5, 5, 4), dtype), *map(jnp.asarray, case[6:])))
  with pytest.raises(TypeError, match="below one byte"):
    ops.ExtensionHostPool(1, 4, 4, dtype)


def test_indices_are_never_silently_truncated():
  case = worked_example()
  args = list(case)
  with pytest.raises(TypeError, match="layer must be an integer"):
    ops.swap_in(0.9, *args[1:])
  with pytest.raises(TypeError, match="layer must be an integer"):
    ops.backup(True, jnp.ones((1, 1, 3)), jnp.array([0], jnp.int32), to_host(case[4]))
  seq = np.array(case[2], np.int64)
  seq[4] = 2**32 + 16  # would wrap to 16 in int32
  with pytest.raises(ValueError, match="seq_lens has values outside the int32 range"):
    ops.swap_in(0, case[1], seq, *args[3:])
  with pytest.raises(TypeError, match="top_k must be an integer array"):
    ops.swap_in(0, case[1].astype(np.float32), *args[2:])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swap_in_cases(), st.data())
def test_kernel_and_reference_agree_on_corrupt_state(case, data):
  """Corrupt a page-table row or an LRU entry: both reject it (changing nothing) or both accept it."""
  case = [c.copy() if isinstance(c, np.ndarray) else c for c in case]
  layer = case[0]
  B, S = case[3].shape
  D = case[6].shape[2]
  if data.draw(st.booleans()):
    b, t = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, S - 1))
    case[3][b, t] = data.draw(st.sampled_from([-1, case[4].shape[1], 2**31 - 1]))
  else:
    b, i = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, D - 1))
    case[7][layer, b, i] = data.draw(st.sampled_from([-1, D, int(case[7][layer, b, (i + 1) % D])]))
  try:
    want = reference.swap_in(*case)
  except reference.SwapInError:
    want = None
  if want is None:
    hot, slots, order = jnp.asarray(case[5]), jnp.asarray(case[6]), jnp.asarray(case[7])
    with pytest.raises(FFI_ERRORS):
      jax.block_until_ready(ops.swap_in(layer, *map(jnp.asarray, case[1:4]), to_host(case[4]), hot, slots, order,
                                        jnp.asarray(case[8])))
    np.testing.assert_array_equal(np.asarray(slots), case[6])
    np.testing.assert_array_equal(np.asarray(order), case[7])
  else:
    for g, w in zip(run_kernel(*case), want):
      np.testing.assert_array_equal(g, w)
