"""Per-request token sampling inside the jitted decode step.

Each row (request) has its own temperature, top-k, top-p and random stream,
so a request's tokens never depend on its neighbours in the batch:

* temperature <= 0: greedy (argmax), the default.
* otherwise logits / temperature, then keep the top_k most likely tokens
  (top_k <= 0: all), then the smallest prefix of those (by probability) whose
  mass reaches top_p (top_p <= 0 or >= 1: all), and draw one by the Gumbel-max
  trick with the key fold_in(PRNGKey(seed), position): the same seed and the
  same prompt give the same tokens whatever the batch.

Sorting the vocabulary costs O(V log V) per row, so it runs only in steps
where some row samples (lax.cond); all-greedy steps are a plain argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ARGMAX_ROWS = 8  # rows per pass of the exact path: their logits stay in cache between its two reductions
ARGMAX_CHUNK = 128  # vocabulary entries per chunk of argmax()'s chunked pass


def _argmax_rows(x):
  """Exactly jnp.argmax over the last axis of float32[R, V] (V < 2**22) by two plain max-reductions."""
  V = x.shape[-1]
  nan = jnp.isnan(x)
  best = jnp.max(jnp.where(nan, -jnp.inf, x), axis=-1, keepdims=True)
  pos = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)  # exact: V < 2**23
  # One max-reduction finds the first NaN (2V - pos > V) or else the first maximum (V - pos <= V).
  r = jnp.max(jnp.where(nan, 2 * V - pos, jnp.where(x == best, V - pos, -jnp.inf)), axis=-1)
  return jnp.where(r > V, 2 * V - r, V - r).astype(jnp.int32)


def _chunked_argmax_rows(x):
  """(int32[R] first maximum of each row of float32[R, V], bool[R] the row may hold a NaN or +inf).

  One plain max-reduction per ARGMAX_CHUNK entries, then jnp.argmax over the R x V / C chunk maxima (the first
  chunk holding the row's maximum) and over that one chunk. XLA:CPU's vectorized max-reduction may drop a NaN,
  so a second reduction sums each row: the sum is below +inf exactly when the row holds no NaN and no +inf
  (a NaN makes any sum NaN; a +inf makes it +inf, or NaN beside a -inf), or when finite values overflow to
  +inf. A row whose sum is below +inf gets its exact first maximum (-inf and +-0 included); the others are
  flagged (also those that only overflow) and the caller recomputes them."""
  R, V = x.shape
  C = ARGMAX_CHUNK
  chunks = x.reshape(R, V // C, C)
  chunk_max = jnp.max(chunks, axis=-1)
  c = jnp.argmax(chunk_max, axis=-1).astype(jnp.int32)
  chunk = jnp.take_along_axis(chunks, c[:, None, None], axis=1)[:, 0]
  return c * C + jnp.argmax(chunk, axis=-1).astype(jnp.int32), ~(jnp.sum(x, axis=-1) < jnp.inf)


def _by_row_blocks(fn, x):
  """fn over blocks of ARGMAX_ROWS rows of float32[B, V] (lax.map), or over all rows at once."""
  B, V = x.shape
  if B <= ARGMAX_ROWS or B % ARGMAX_ROWS:
    return fn(x)
  out = jax.lax.map(fn, x.reshape(B // ARGMAX_ROWS, ARGMAX_ROWS, V))
  return jax.tree.map(lambda a: a.reshape(B), out)


def argmax(logits: jax.Array) -> jax.Array:
  """Exactly ``jnp.argmax(logits, axis=-1)`` (int32[B] for float32[B, V], V < 2**22): the first NaN of a row if
  it has one, else its first maximum.

  XLA:CPU lowers jnp.argmax to a variadic (value, index) reduction that is not vectorized (9.3 ms for 32 rows
  of V = 129280, 73 ms for 256). Here, when V is a multiple of ARGMAX_CHUNK, two plain reductions over the
  whole batch (chunk maxima and row sums, ``_chunked_argmax_rows``) find each row's first maximum (0.8 ms
  for 32 rows, 6.4 ms for 256); if some row of the batch may hold a NaN or +inf, the batch instead takes two
  masked max-reductions per block of ARGMAX_ROWS rows (the exact path for those values; 2.5-2.9 and 19-20
  ms), as does a V that is not a multiple. benchmarks/step_floor.py measures the decode step this is part
  of."""
  B, V = logits.shape
  if V >= 2**22:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  exact = lambda x: _by_row_blocks(_argmax_rows, x)  # noqa: E731
  if V % ARGMAX_CHUNK:
    return exact(logits)
  first_max, special = _chunked_argmax_rows(logits)
  return jax.lax.cond(jnp.any(special), exact, lambda x: first_max, logits)


def sample(logits, temperature, top_k, top_p, seed, position):
  """Next tokens for a batch.

  Args:
    logits: float32[B, V].
    temperature: float32[B]; <= 0 means greedy.
    top_k: int32[B]; <= 0 disables.
    top_p: float32[B]; <= 0 or >= 1 disables.
    seed: uint32[B] per-request seed.
    position: int32[B] position of the token being drawn (the key's counter).

  Returns:
    int32[B] token ids.
  """
  greedy = argmax(logits)
  do_sample = temperature > 0

  def draw():
    B, V = logits.shape
    t = jnp.where(do_sample, temperature, 1.0)[:, None]
    order = jnp.argsort(-logits, axis=-1)  # descending
    vals = jnp.take_along_axis(logits, order, axis=-1) / t
    rank = jnp.arange(V)[None, :]
    keep = jnp.where((top_k > 0)[:, None], rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    use_p = (top_p > 0) & (top_p < 1)
    keep &= jnp.where(use_p[:, None], before < top_p[:, None], True)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, position)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    choice = argmax(jnp.where(keep, vals + gumbel, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  sampled = jax.lax.cond(jnp.any(do_sample), draw, lambda: greedy)
  return jnp.where(do_sample, sampled, greedy)
