"""The greedy path's argmax: exactly jnp.argmax, faster on XLA:CPU (benchmarks/step_floor.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.engine.sampling import ARGMAX_CHUNK, ARGMAX_ROWS, _chunked_argmax_rows, argmax


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.one_of(st.integers(1, 3000), st.integers(1, 24).map(lambda n: n * ARGMAX_CHUNK)),
       st.sampled_from([0.0, 0.0, 0.001, 0.01]), st.integers(0, 2**31))
def test_greedy_argmax_is_jnp_argmax_exactly(rows, vocab, special_rate, seed):
  """argmax equals jnp.argmax on ties, +-0, +-inf and NaN: the chunked pass (vocab a multiple of the chunk, no
  NaN or +inf in the batch), its fallback (some row holds one) and the two-reduction path (other vocab sizes)."""
  rng = np.random.default_rng(seed)
  x = np.round(rng.standard_normal((rows, vocab)) * 2).astype(np.float32)  # many exact ties, +0.0 and -0.0
  x[x == 0] *= np.where(rng.random(int((x == 0).sum())) < 0.5, -1, 1).astype(np.float32)
  special = rng.random(x.shape)
  x[special < special_rate] = np.inf
  x[(special > 0.5) & (special < 0.5 + max(special_rate, 0.01))] = -np.inf  # -inf does not leave the fast path
  x[special > 1 - special_rate / 2] = np.nan
  x[rng.random(rows) < 0.2] = -np.inf  # whole rows at -inf
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert got.dtype == np.int32


def test_chunked_pass_is_exact_without_nan_and_flags_the_rows_it_cannot_decide():
  """The chunked pass alone: the first maximum across and inside chunks for finite / -inf rows, and the flag
  set exactly for the rows with a NaN or +inf, or whose sum overflows (whose index the caller recomputes)."""
  V = 8 * ARGMAX_CHUNK
  x = np.zeros((7, V), np.float32)
  x[0, [ARGMAX_CHUNK - 1, ARGMAX_CHUNK]] = 2.0  # a tie across a chunk boundary: the first wins
  x[1] = -np.inf
  x[2, 5:] = -0.0  # +0.0 ties -0.0: the first zero wins
  x[2, :5] = -1.0
  x[3, 3 * ARGMAX_CHUNK + 7] = np.nan
  x[4, V - 1] = np.inf
  x[5, [700, 701]] = 1.0
  x[6, [9, 300, 301]] = [3e38, 3.2e38, 3.2e38]  # finite, but the row's sum overflows to +inf
  first, special = jax.jit(_chunked_argmax_rows)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(special), [False, False, False, True, True, False, True])
  np.testing.assert_array_equal(np.asarray(first)[[0, 1, 2, 5]], [ARGMAX_CHUNK - 1, 0, 5, 700])
  # The whole argmax takes the exact path for that batch: the NaN's index, the +inf's index, the first of the
  # two largest finite values.
  np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))),
                                [ARGMAX_CHUNK - 1, 0, 5, 3 * ARGMAX_CHUNK + 7, V - 1, 700, 300])


def test_argmax_chunks_rows_and_keeps_the_first_maximum():
  x = np.zeros((4 * ARGMAX_ROWS, 129280), np.float32)
  x[:, 100] = x[:, 129279] = 1.0  # a tie: the first wins
  x[3, 50] = np.nan
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  assert got[3] == 50 and (np.delete(got, 3) == 100).all()
