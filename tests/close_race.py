"""Closes an extension host pool while a jitted swap-in that copies 128 MiB out of it may be running (queued
behind a slow matmul by JAX's asynchronous dispatch, the close landing at several points of its run). Prints
one line per try: "done" (the swap-in finished first, every row ok) or "refused" (it started after the close:
the pool is no longer live). A read of the freed pool would crash the process (SIGSEGV, or an ASan report).
Run by tests/test_swap_in_kernel.py in its own process."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.kernels import ops

L, H, W, B, D, PAGE = 1, 1 << 18, 256, 64, 2048, 64  # a 256 MiB pool; 64 x 2048 misses of 1 KiB
seq_len = H // B
rng = np.random.default_rng(0)
top_k = jnp.asarray(np.stack([rng.choice(seq_len - 1, D, replace=False) for _ in range(B)]).astype(np.int32))
seq_lens = jnp.full(B, seq_len, jnp.int32)
req_ids = jnp.arange(B, dtype=jnp.int32)
pages = seq_len // PAGE
host_pages = jnp.asarray(np.arange(B * pages, dtype=np.int32).reshape(B, pages))
hot = jnp.zeros((L, B, D + 1, W), jnp.float32)
slots = jnp.full((L, B, D), -1, jnp.int32)
lru = jnp.asarray(np.broadcast_to(np.arange(D, dtype=np.int32), (L, B, D)).copy())
stats = jnp.zeros((L, B, 2), jnp.int32)
big = jnp.ones((1024, 1024), jnp.float32)


@jax.jit
def slow(x):
  for _ in range(8):
    x = x @ x / 1024.0
  return x


def swap(pool):
  @jax.jit
  def f(x, token):
    newest = jnp.zeros((B, W), jnp.float32) + x[0, 0] * 0  # waits for x
    return ops.swap_in(
      0, top_k, seq_lens, req_ids, host_pages, newest, token, hot, slots, lru, stats, page_size=PAGE, external=pool.ref
    )

  return f


def timed(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


pool = ops.ExtensionHostPool(L, H, W, np.float32)
f = swap(pool)
jax.block_until_ready(f(big, pool.token()))
t_slow = min(timed(lambda: slow(big)) for _ in range(3))
t_swap = min(timed(lambda: f(big, pool.token())) for _ in range(3))
pool.close()
for fraction in (-0.5, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2, 2.0):
  pool = ops.ExtensionHostPool(L, H, W, np.float32)
  f = swap(pool)
  jax.block_until_ready(f(big, pool.token()))  # compiled
  start = time.perf_counter()
  out = f(slow(big), pool.token())
  time.sleep(max(0.0, t_slow + fraction * t_swap - (time.perf_counter() - start)))
  pool.close()
  try:
    status = np.asarray(jax.block_until_ready(out)[6])
    assert not status.any(), status
    print("done", flush=True)
  except Exception as e:  # noqa: BLE001
    assert "not a live extension pool" in str(e), e
    print("refused", flush=True)
