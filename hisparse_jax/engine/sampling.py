"""Per-request token sampling inside the jitted decode step.

Each row (request) has its own temperature, top-k, top-p and random stream,
so a request's tokens never depend on its neighbours in the batch:

* temperature <= 0: greedy (argmax), the default.
* otherwise logits / temperature, then keep the top_k most likely tokens
  (top_k <= 0: all), then the smallest prefix of those (by probability) whose
  mass reaches top_p (top_p <= 0 or >= 1: all), and draw one by the Gumbel-max
  trick with the key fold_in(PRNGKey(seed), position), one Gumbel draw per
  token id (not per rank): the same seed and the same prompt give the same
  tokens whatever the batch.

Sorting the vocabulary costs O(V log V) per row, so it runs only in steps
where some row samples (lax.cond); all-greedy steps are a plain argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.kernels import ops


def argmax(logits: jax.Array, *, vocab_major: bool = False) -> jax.Array:
  """Greedy decoding's token: exactly ``jnp.argmax(logits, axis=-1)`` as int32[B] for float32[B, V]
  (vocab_major: ``axis=0`` of float32[V, B]): the first NaN of a row if it has one, else its first maximum.

  ``kernels.ops.argmax``: on CPU an FFI handler (one vectorized pass; XLA:CPU's own argmax is a variadic
  reduction it does not vectorize, 5.9 ms for 32 rows of V = 129280 against 0.43 ms), elsewhere
  ``jnp.argmax``. benchmarks/step_floor.py measures the decode step this is part of."""
  return ops.argmax(logits, axis=0 if vocab_major else -1)


def sample(logits, temperature, top_k, top_p, seed, position, *, vocab_major: bool = False):
  """Next tokens for a batch.

  Args:
    logits: float32[B, V], or float32[V, B] with vocab_major (transposed only in a step where some row
      samples).
    temperature: float32[B]; <= 0 means greedy.
    top_k: int32[B]; <= 0 disables.
    top_p: float32[B]; <= 0 or >= 1 disables.
    seed: uint32[B] per-request seed.
    position: int32[B] position of the token being drawn (the key's counter).

  Returns:
    int32[B] token ids.
  """
  greedy = argmax(logits, vocab_major=vocab_major)
  do_sample = temperature > 0

  def draw():
    logits_bv = logits.T if vocab_major else logits
    B, V = logits_bv.shape
    t = jnp.where(do_sample, temperature, 1.0)[:, None]
    order = jnp.argsort(-logits_bv, axis=-1)  # descending
    vals = jnp.take_along_axis(logits_bv, order, axis=-1) / t
    rank = jnp.arange(V)[None, :]
    keep = jnp.where((top_k > 0)[:, None], rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    use_p = (top_p > 0) & (top_p < 1)
    keep &= jnp.where(use_p[:, None], before < top_p[:, None], True)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, position)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)  # one draw per token id
    # Noise by token id, not by rank: two near-tied tokens whose order flips on a last-bit difference of the
    # logits (another batch shape or mesh) keep their own draws.
    noise = jnp.take_along_axis(gumbel, order, axis=-1)
    choice = argmax(jnp.where(keep, vals + noise, -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

  sampled = jax.lax.cond(jnp.any(do_sample), draw, lambda: greedy)
  return jnp.where(do_sample, sampled, greedy)
