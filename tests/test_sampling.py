"""The greedy path's argmax (the CPU FFI handler xla_ffi/argmax.cc): exactly jnp.argmax, as int32; the sampling
filters' boundaries."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.engine.sampling import argmax, sample
from hisparse_jax.kernels import ops
from tests.xla_env import with_devices

ROOT = pathlib.Path(__file__).parent.parent
CHUNK = 2048  # xla_ffi/argmax.cc kChunk: entries per chunk of the handler's first pass


def awkward(rng, shape, special_rate, *, min_neg_inf_rate, whole_lines):
  """float32[shape] with many exact ties, +0.0 and -0.0, +inf and NaN at special_rate (NaN at half of it), -inf at
  least at min_neg_inf_rate, and ~20% of the rows (whole_lines 0) or columns (1) entirely -inf."""
  x = np.round(rng.standard_normal(shape) * 2).astype(np.float32)
  x[x == 0] *= np.where(rng.random(int((x == 0).sum())) < 0.5, -1, 1).astype(np.float32)
  special = rng.random(x.shape)
  x[special < special_rate] = np.inf
  x[(special > 0.5) & (special < 0.5 + max(special_rate, min_neg_inf_rate))] = -np.inf
  x[special > 1 - special_rate / 2] = np.nan
  whole = rng.random(shape[whole_lines]) < 0.2
  if whole_lines == 0:
    x[whole] = -np.inf
  else:
    x[:, whole] = -np.inf
  return x


@settings(max_examples=80, deadline=None)
@given(
  st.integers(1, 40),
  st.one_of(
    st.integers(1, 3000),
    st.integers(1, 6).flatmap(lambda n: st.sampled_from([n * CHUNK - 1, n * CHUNK, n * CHUNK + 1])),
  ),
  st.sampled_from([0.0, 0.0, 0.0005, 0.01]),
  st.integers(0, 2**31),
)
def test_greedy_argmax_is_jnp_argmax_exactly(rows, vocab, special_rate, seed):
  """argmax equals jnp.argmax on exact ties (within and across chunks), +-0, +-inf, NaN and whole -inf rows, for
  vocabularies on both sides of the handler's chunk and lane multiples."""
  x = awkward(np.random.default_rng(seed), (rows, vocab), special_rate, min_neg_inf_rate=0.01, whole_lines=0)
  got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
  assert got.dtype == np.int32


def test_argmax_awkward_rows():
  """Each case where a chunked pass could go wrong: the first maximum in a later chunk than an equal one, a NaN
  after (and before) the maximum, in the last partial chunk, -0.0 before +0.0, values near the float32 maximum."""
  V = 3 * CHUNK + 5  # a partial last chunk, and not a multiple of the 16 lanes
  x = np.zeros((10, V), np.float32)
  x[0, [CHUNK - 1, CHUNK]] = 2.0  # a tie across a chunk boundary: the first wins
  x[1] = -np.inf
  x[2, :5] = -1.0
  x[2, 5:9] = -0.0  # -0.0 first, then +0.0: equal, so the first zero (5) wins
  x[3, [10, 2 * CHUNK + 3]] = [5.0, np.nan]  # a NaN in a later chunk than the maximum
  x[4, [CHUNK + 1, CHUNK + 2, 7]] = [np.nan, np.nan, 9.0]  # the first of two NaN, after the maximum's chunk
  x[5, V - 1] = np.nan  # in the partial chunk
  x[6, [V - 2, V - 1]] = [np.inf, np.inf]
  x[7, [9, 3 * CHUNK, 3 * CHUNK + 1]] = [3e38, 3.2e38, 3.2e38]  # finite; a row sum would overflow
  x[8] = np.nan
  x[9, [CHUNK + 100, 2 * CHUNK + 100]] = [-np.inf, 1e-30]  # a tiny positive value beats the zeros
  want = [CHUNK - 1, 0, 5, 2 * CHUNK + 3, CHUNK + 1, V - 1, V - 2, 3 * CHUNK, 0, 2 * CHUNK + 100]
  np.testing.assert_array_equal(np.argmax(x, axis=-1), want)  # the cases mean what they say
  np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), want)
  # A denormal: XLA:CPU runs with denormals as zero (so jnp.argmax sees a row of zeros), and so does the handler.
  d = jnp.asarray(np.where(np.arange(V) == 4000, np.float32(1e-45), np.float32(0))[None])
  np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(d)), np.asarray(jnp.argmax(d, axis=-1)))


def test_argmax_leading_dims_vmap_many_rows_and_bad_input():
  x = jax.random.normal(jax.random.key(0), (3, 4, 5000), jnp.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(ops.argmax)(x)), np.asarray(jnp.argmax(x, axis=-1)))
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(ops.argmax))(x)), np.asarray(jnp.argmax(x, axis=-1)))
  # 256 rows of the real vocabulary (the multi-threaded path), a tie at both ends of every row.
  y = jax.random.normal(jax.random.key(1), (256, 129280), jnp.float32)
  y = y.at[:, 0].set(9.0).at[:, -1].set(9.0).at[17, 70000].set(jnp.nan)
  got = np.asarray(jax.jit(ops.argmax)(y))
  assert got[17] == 70000 and (np.delete(got, 17) == 0).all()
  assert int(jax.jit(ops.argmax)(jnp.float32([7.0]))) == 0
  with pytest.raises(TypeError, match="float32"):
    ops.argmax(jnp.zeros((2, 4), jnp.bfloat16))
  with pytest.raises(TypeError, match="a float32 array, got list"):
    ops.argmax([1.0, 2.0])
  with pytest.raises(ValueError, match=r"rows of 1 \.\. 2\*\*31 - 1 entries, got shape \(2, 0\)"):
    ops.argmax(jnp.zeros((2, 0), jnp.float32))
  with pytest.raises(ValueError, match=r"at least one dimension, got shape \(\)"):
    ops.argmax(jnp.float32(1.0))


@settings(max_examples=80, deadline=None)
@given(
  st.integers(1, 300),
  st.one_of(st.integers(1, 70), st.sampled_from([128, 256, 257, 300])),
  st.sampled_from([0.0, 0.0, 0.002, 0.02]),
  st.integers(0, 2**31),
)
def test_argmax_over_columns_is_jnp_argmax_exactly(rows, columns, special_rate, seed):
  """axis 0 of [N, C] (logits held [vocab, batch]): exact first maximum / first NaN per column, for column counts
  that divide the 16 lanes, are multiples of them, are neither (periods of lcm(C, 16) lanes), and past the
  handler's largest period (257: every entry on the scalar pass); N not a whole number of periods."""
  x = awkward(np.random.default_rng(seed), (rows, columns), special_rate, min_neg_inf_rate=0.02, whole_lines=1)
  got = np.asarray(jax.jit(lambda a: argmax(a, vocab_major=True))(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.argmax(x, axis=0))
  assert got.dtype == np.int32 and got.shape == (columns,)


def test_argmax_over_columns_awkward_and_large():
  x = np.zeros((40, 32), np.float32)
  x[[3, 20], 0] = 2.0  # a tie in one lane's residue class... and across the two vectors of a period
  x[[20, 3], 1] = [2.0, 2.0]
  x[:, 2] = -np.inf
  x[[5, 7], 3] = [np.nan, np.nan]
  x[6, 3] = np.inf
  x[39, 4] = np.nan  # in the last period
  x[:10, 5] = -0.0  # -0.0 then +0.0: the first row
  x[[1, 2], 6] = [1e38, 3e38]
  want = np.argmax(x, axis=0)
  assert want[:7].tolist() == [3, 3, 0, 5, 39, 0, 2]
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: ops.argmax(a, axis=0))(jnp.asarray(x))), want)
  # The decode layout at batch 32 (many periods, the multi-threaded pass): the transposed row argmax.
  y = jax.random.normal(jax.random.key(2), (129280, 32), jnp.float32).at[100000, 9].set(jnp.nan)
  y = y.at[0, 4].set(9.0).at[-1, 4].set(9.0)
  got = np.asarray(jax.jit(lambda a: ops.argmax(a, axis=0))(y))
  np.testing.assert_array_equal(got, np.asarray(ops.argmax(jnp.asarray(y.T))))
  assert got[9] == 100000 and got[4] == 0
  with pytest.raises(ValueError, match="axis 0 of a 2-D array; got axis 1 of shape"):
    ops.argmax(jnp.zeros((2, 3, 4), jnp.float32), axis=1)
  with pytest.raises(ValueError, match=r"\[N, C\] with N, C >= 1"):
    ops.argmax(jnp.zeros((0, 4), jnp.float32), axis=0)


def test_sampling_vocab_major_matches_batch_major():
  """sample() on logits held [vocab, batch] draws exactly the tokens it draws from [batch, vocab], greedy rows
  (the argmax over columns) and sampling rows (the transposed logits) alike."""
  B, V = 6, 3000
  logits = jax.random.normal(jax.random.key(3), (B, V), jnp.float32) * 3
  temperature = jnp.float32([0, 0.7, 0, 1.0, 1.3, 0])
  top_k = jnp.int32([0, 50, 0, 0, 7, 0])
  top_p = jnp.float32([1, 0.9, 1, 0.5, 1, 1])
  seed, position = jnp.arange(B, dtype=jnp.uint32) + 11, jnp.arange(B, dtype=jnp.int32) + 40
  args = (temperature, top_k, top_p, seed, position)
  want = np.asarray(jax.jit(sample)(logits, *args))
  got = np.asarray(jax.jit(lambda lt, *a: sample(lt, *a, vocab_major=True))(logits.T, *args))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(want[[0, 2, 5]], np.argmax(np.asarray(logits), axis=-1)[[0, 2, 5]])


# Token ids from the most to the least likely, with probabilities 16/32, 8/32, 4/32, 3/32, 1/32: every prefix's mass
# (0.5, 0.75, 0.875, 0.96875) is exact in float32, so top_p can sit exactly on a boundary.
RANKED = np.array([3, 0, 4, 1, 2])
RANKED_PROBS = np.float32([16, 8, 4, 3, 1]) / 32


def test_sampling_filters_keep_exactly_the_tokens_at_their_boundaries():
  """The set of tokens drawn over 1024 seeds and positions per case is exactly the filters' set: top_p keeps the
  smallest most-likely prefix whose mass is >= top_p (vLLM's rule: a mass of exactly top_p is enough, one ulp
  more takes the next token); top_k = V keeps all V, V - 1 all but the least likely. The smallest positive
  temperatures (the engine accepts any finite temperature >= 0) draw only the argmax: float32's smallest normal
  (logits / t near or past float32's maximum) and smallest subnormal (XLA:CPU flushes it to 0: greedy)."""
  V, N = len(RANKED), 1024
  logp = np.zeros(V, np.float32)
  logp[RANKED] = np.log(RANKED_PROBS)
  exact = np.asarray(jax.jit(jax.nn.softmax)(jnp.asarray(logp)))[RANKED]
  assert exact.tolist() == RANKED_PROBS.tolist(), "the cases' premise: XLA's softmax gives these exact masses"

  def up(p):  # the next float32 above p
    return float(np.nextafter(np.float32(p), np.float32(2)))

  def down(p):
    return float(np.nextafter(np.float32(p), np.float32(0)))

  tiny, subnormal = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).smallest_subnormal)
  cases = [  # (temperature, top_k, top_p, added to the logits, how many of the most likely tokens may be drawn)
    (1, 0, 0.5, 0, 1),
    (1, 0, down(0.5), 0, 1),
    (1, 0, up(0.5), 0, 2),
    (1, 0, 0.75, 0, 2),
    (1, 0, up(0.75), 0, 3),
    (1, 0, 0.875, 0, 3),
    (1, 0, 0.96875, 0, 4),
    (1, 0, up(0.96875), 0, 5),
    (1, 0, 1, 0, 5),
    (1, V, 1, 0, 5),
    (1, V, 0.75, 0, 2),
    (1, V - 1, 1, 0, 4),
    (1, V + 1, 1, 0, 5),
    (tiny, 0, 1, 0, 1),
    (tiny, 0, 1, 5, 1),
    (tiny, V, 0.75, 5, 1),
    (tiny, 2, 0.5, 0, 1),
    (subnormal, 0, 1, 0, 1),
  ]
  t, k, p, shift, _ = (np.repeat(np.array(c), N) for c in zip(*cases))
  logits = logp[None] + shift[:, None].astype(np.float32)
  seed, position = np.arange(len(t), dtype=np.uint32) * 7 + 1, np.arange(len(t), dtype=np.int32) % 509
  got = np.asarray(
    jax.jit(sample)(
      jnp.asarray(logits), jnp.float32(t), jnp.int32(k), jnp.float32(p), jnp.asarray(seed), jnp.asarray(position)
    )
  ).reshape(len(cases), N)
  for case, drawn in zip(cases, got):
    assert set(drawn.tolist()) == set(RANKED[: case[-1]].tolist()), f"(temperature, top_k, top_p, shift, n) {case}"


def test_argmax_over_columns_across_pieces_and_axis_forms():
  """Arrays large enough to be split into several pieces scanned in parallel (1 MiB each), with the first
  maximum and the first NaN of a column in different pieces; the generic period (255 columns: 255 vectors a
  period); axis given as -2; vmap over the column handler; bad axes."""
  rng = np.random.default_rng(5)
  x = np.round(rng.standard_normal((300_000, 8)) * 3).astype(np.float32)  # ~9 pieces
  x[[10, 250_000], 0] = 50.0  # a tie across pieces: the first wins
  x[[270_000, 280_000], 1] = np.nan  # NaN only in late pieces
  x[5, 1] = 60.0
  x[:, 2] = -np.inf
  x[299_999, 3] = np.inf
  y = np.round(rng.standard_normal((3000, 255)) * 3).astype(np.float32)  # 2 pieces of the 255-vector period
  y[2990, 7] = np.nan
  for a in (x, y):
    got = np.asarray(jax.jit(lambda v: ops.argmax(v, axis=-2))(jnp.asarray(a)))
    np.testing.assert_array_equal(got, np.argmax(a, axis=0))
  assert np.asarray(jax.jit(lambda v: ops.argmax(v, axis=0))(jnp.asarray(x)))[:4].tolist() == [10, 270_000, 0, 299_999]
  z = jnp.asarray(np.round(rng.standard_normal((3, 50, 6)) * 2), jnp.float32)
  np.testing.assert_array_equal(
    np.asarray(jax.jit(jax.vmap(lambda v: ops.argmax(v, axis=0)))(z)), np.argmax(np.asarray(z), axis=1)
  )
  for bad in (2, -3, True):
    with pytest.raises(ValueError, match="out of range"):
      ops.argmax(jnp.zeros((2, 3), jnp.float32), axis=bad)


def test_argmax_differentiates_like_jnp_argmax():
  """The index carries no derivative (a float0 zero tangent), and a function that picks x at its argmax has the
  one-hot gradient jnp.argmax gives, over rows and over columns."""
  x = jnp.asarray(np.random.default_rng(6).standard_normal((5, 7)), jnp.float32)
  out, tangent = jax.jvp(ops.argmax, (x,), (jnp.ones_like(x),))
  np.testing.assert_array_equal(np.asarray(out), np.argmax(np.asarray(x), axis=-1))
  assert tangent.dtype == jax.dtypes.float0 and tangent.shape == (5,)
  for axis, pick in (
    (-1, lambda v, i: jnp.take_along_axis(v, i[:, None], 1)),
    (0, lambda v, i: jnp.take_along_axis(v, i[None, :], 0)),
  ):
    ours = jax.jit(jax.grad(lambda v: pick(v, ops.argmax(v, axis=axis)).sum()))(x)
    ref = jax.grad(lambda v: pick(v, jnp.argmax(v, axis=axis)).sum())(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))
    assert float(ours.sum()) == (x.shape[0] if axis == -1 else x.shape[1])  # one 1.0 per row / column


ON_A_MESH = """
import jax, jax.numpy as jnp, numpy as np
from hisparse_jax.kernels import ops
rng = np.random.default_rng(0)
arrays = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(10,), (3, 10), (4, 10), (2, 4, 10), (1, 4, 10)]]
bad = 0
for kind in ("Auto", "Explicit"):
  mesh = jax.make_mesh((2,), ("dp",), axis_types=(getattr(jax.sharding.AxisType, kind),))
  with jax.set_mesh(mesh):
    for x in arrays:
      bad += not np.array_equal(np.asarray(jax.jit(ops.argmax)(x)), np.argmax(np.asarray(x), axis=-1))
      if x.ndim == 2:
        bad += not np.array_equal(np.asarray(jax.jit(lambda v: ops.argmax(v, 0))(x)), np.argmax(np.asarray(x), 0))
print("mismatches", bad)
"""


def test_argmax_on_a_two_device_mesh():
  """Under a context mesh with a dp axis of 2 (Auto and Explicit axes): 1-D rows, leading dimensions dp does and
  does not divide, columns; every result is jnp.argmax's (rows split over dp only where it divides them)."""
  r = subprocess.run(
    [sys.executable, "-c", ON_A_MESH],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "XLA_FLAGS": with_devices(2)},
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1] == "mismatches 0"
