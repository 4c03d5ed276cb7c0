"""The greedy path's argmax: exactly jnp.argmax, faster on XLA:CPU (benchmarks/step_floor.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.engine.sampling import ARGMAX_ROWS, argmax



@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3000), st.integers(0, 2**31))
def test_greedy_argmax_is_jnp_argmax_exactly(rows, vocab, seed):
  """The greedy path's argmax (two plain reductions, rows in chunks) equals jnp.argmax on ties, +-inf and NaN."""
  rng = np.random.default_rng(seed)
  x = np.round(rng.standard_normal((rows, vocab)) * 2).astype(np.float32)  # many exact ties
  special = rng.random(x.shape)
  x[special < 0.01] = np.inf
  x[(special > 0.01) & (special < 0.02)] = -np.inf
  x[special > 0.995] = np.nan
  x[rng.random(rows) < 0.2] = -np.inf  # whole rows at -inf
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  assert got.dtype == np.int32


def test_argmax_chunks_rows_and_keeps_the_first_maximum():
  x = np.zeros((4 * ARGMAX_ROWS, 129280), np.float32)
  x[:, 100] = x[:, 129279] = 1.0  # a tie: the first wins
  x[3, 50] = np.nan
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  assert got[3] == 50 and (np.delete(got, 3) == 100).all()
