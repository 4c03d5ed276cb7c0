"""The calibrated decode-time indexer traces (benchmarks/calibrated_trace.py) and the eviction policies on them."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import calibrated_trace as ct  # noqa: E402
import miss_rate  # noqa: E402


def test_locality_is_in_the_published_bands():
  """At the measured prompt length (TensorRT-LLM's 68,665 tokens; here 65,536) with top_k 2048: consecutive
  steps share 35-50% of the top-k on deep layers and much less on the first ones (TensorRT-LLM tech blog 21);
  adjacent layers share 70-100% (IndexCache, arXiv:2603.12201)."""
  o = ct.overlaps(ct.calibrated_trace(65536, 12, 2048, seed=3))
  temporal, adjacent = o["temporal"], o["adjacent"]
  assert len(temporal) == 8 and len(adjacent) == 7
  assert temporal[0] < 0.2 and temporal[1] < 0.3, temporal
  assert all(0.35 <= x <= 0.50 for x in temporal[3:]), temporal
  assert all(a <= b + 0.01 for a, b in zip(temporal, temporal[1:])), temporal  # deeper layers: more locality
  assert all(0.70 <= x <= 1.0 for x in adjacent), adjacent


def test_trace_structure_and_determinism():
  model = ct.TraceModel(layers=3, sinks=4, recent=16)
  steps = list(ct.calibrated_trace(300, 5, 64, model, seed=7))
  assert len(steps) == 5
  for t, (picked, scores) in enumerate(steps):
    seq_len = 300 + t + 1
    assert picked.dtype == np.int32 and picked.shape == (3, 64)
    assert scores.dtype == np.float32 and scores.shape == (3, seq_len)
    for layer in range(3):
      row = picked[layer]
      assert (np.diff(row) > 0).all() and row.min() >= 0 and row.max() < seq_len  # sorted, distinct, causal
      assert {0, 1, 2, 3, seq_len - 1} <= set(row.tolist())  # sinks and the newest token
      assert set(range(seq_len - 16, seq_len)) <= set(row.tolist())  # the recent window
      rest = np.setdiff1d(np.arange(seq_len), row)
      assert scores[layer, row].min() >= scores[layer, rest].max()  # the top-k of its own scores
  again = list(ct.calibrated_trace(300, 5, 64, model, seed=7))
  assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(steps, again))
  other = next(ct.calibrated_trace(300, 5, 64, model, seed=8))
  assert (other[0] != steps[0][0]).any()


def test_forecast_is_the_expected_next_score():
  """with_forecast draws the same trace and adds E[next step's score | content]: regressing the next step's
  scores on it gives slope 1 and intercept 0 (the query and noise parts are fresh, mean 0), and it is +inf
  exactly on the sinks and the next step's recent window."""
  model = ct.TraceModel(layers=3, sinks=4, recent=16)
  plain = list(ct.calibrated_trace(20000, 4, 256, model, seed=5))
  steps = list(ct.calibrated_trace(20000, 4, 256, model, seed=5, with_forecast=True))
  for (p0, s0), (p1, s1, forecast) in zip(plain, steps):
    np.testing.assert_array_equal(p0, p1)
    np.testing.assert_array_equal(s0, s1)
    assert forecast.dtype == np.float32 and forecast.shape == s1.shape
  for t in range(3):
    forecast, after = steps[t][2], steps[t + 1][1]
    seq_len = forecast.shape[1]
    inf = ~np.isfinite(forecast)
    assert inf[:, :4].all() and inf[:, seq_len + 1 - 16 :].all() and not inf[:, 4 : seq_len + 1 - 16].any()
    for layer in range(3):
      f, s = forecast[layer, ~inf[layer]], after[layer, :seq_len][~inf[layer]]
      slope, intercept = np.polyfit(f, s, 1)
      assert abs(slope - 1) < 0.06 and abs(intercept) < 0.03, (layer, slope, intercept)


def test_short_context_takes_every_position():
  picked, scores = next(ct.calibrated_trace(10, 1, 64, ct.TraceModel(layers=2)))
  np.testing.assert_array_equal(picked, np.tile(np.arange(11, dtype=np.int32), (2, 1)))
  assert scores.shape == (2, 11)


@pytest.mark.parametrize("D", [512, 768])  # 2 and 3 x top_k (at D = top_k every policy misses alike)
def test_policies_on_a_calibrated_trace(D):
  """Every kernel policy replayed on the same calibrated trace: the kernel's LRU and CLOCK equal the Python
  replays step for step, Belady's optimum bounds every policy, and the score policies, which read the trace's
  indexer scores, miss less than LRU."""
  context, steps, top_k, layers = 4096, 60, 256, 4
  replays = {
    p: miss_rate.KernelReplay(layers, context, steps, D, top_k, p)
    for p in ("lru", "clock", "score", "score-ema", "position-ema")
  }
  replays["content-oracle"] = miss_rate.ContentOracleReplay(layers, context, D)
  streams = miss_rate.calibrated_streams(context, steps, top_k, layers, 0, replays.values())
  total = {p: sum(map(sum, r.misses)) for p, r in replays.items()}
  assert replays["lru"].misses == [miss_rate.replay_lru(tr, c, D) for _, c, tr in streams]
  assert replays["clock"].misses == [miss_rate.replay_clock(tr, c, D) for _, c, tr in streams]
  belady = sum(sum(miss_rate.replay_belady(tr, c, D)) for _, c, tr in streams)
  assert 0 < belady <= min(total.values())
  assert max(total["score"], total["score-ema"], total["position-ema"]) < total["lru"], total
  # Knowing the content part exactly beats estimating it from past scores (the EMAs); Belady, who also sees
  # the future queries, beats both.
  assert belady < total["content-oracle"] < min(total["score-ema"], total["position-ema"]), total


def test_score_ema_replay_is_the_reference_policy_on_slot_averages():
  """The engine's "score_ema" as miss_rate replays it (the CPU kernel's score policy fed ``slot_score_ema`` and
  ``restart_score_ema``, the decode view's functions) equals, step for step, the NumPy reference swap-in fed
  per-slot averages kept here by hand: a slot's average restarts (its first score) when the swap-in puts a new
  token in it, and otherwise moves by SCORE_EMA_WEIGHT. Its misses differ from the plain score policy's."""
  import jax.numpy as jnp

  from hisparse_jax.config import SCORE_EMA_WEIGHT
  from hisparse_jax.kernels import reference
  from hisparse_jax.memory.views import slot_score_ema

  context, steps, top_k, layers, D = 2048, 40, 128, 3, 320
  kernel = miss_rate.KernelReplay(layers, context, steps, D, top_k, "score-ema", ema=SCORE_EMA_WEIGHT)
  plain = miss_rate.KernelReplay(layers, context, steps, D, top_k, "score")
  S = context + steps + 1
  host_rows, pool = np.arange(S), np.zeros((S, 1), np.float32)
  slot_tokens = [np.arange(D, dtype=np.int64) for _ in range(layers)]
  lru = [np.arange(D, dtype=np.int64) for _ in range(layers)]
  ema = [np.full(D, np.nan, np.float32) for _ in range(layers)]
  want = [[] for _ in range(layers)]
  for step, (picked, scores) in enumerate(
    ct.calibrated_trace(context, steps, top_k, ct.TraceModel(layers=layers), seed=5)
  ):
    kernel.step(step, picked, scores)
    plain.step(step, picked, scores)
    clipped = np.clip(scores, -kernel.EMA_CLIP, kernel.EMA_CLIP)
    for l in range(layers):
      now = np.asarray(slot_score_ema(jnp.asarray(ema[l]), jnp.asarray(clipped[l, slot_tokens[l]])))
      cur, kept = clipped[l, slot_tokens[l]], ~np.isnan(ema[l])  # by hand: the first score, else the EMA step
      np.testing.assert_array_equal(now[~kept], cur[~kept])
      np.testing.assert_allclose(
        now[kept], SCORE_EMA_WEIGHT * ema[l][kept] + (1 - SCORE_EMA_WEIGHT) * cur[kept], rtol=1e-6, atol=1e-7
      )
      assert not step or (kept.any() and (~kept).any())  # both cases occur
      before = slot_tokens[l].copy()
      _, _, misses = reference.swap_in_request(
        picked[l],
        context + step + 1,
        host_rows,
        pool,
        np.zeros((D + 1, 1), np.float32),
        slot_tokens[l],
        lru[l],
        0,
        D,
        eviction="score",
        slot_scores=now,
      )
      ema[l] = np.where(before == slot_tokens[l], now, np.nan).astype(np.float32)
      want[l].append(misses)
  assert kernel.misses == want
  assert kernel.misses != plain.misses


@pytest.mark.parametrize("policy", ["lru", "clock"])
def test_python_replays_equal_the_kernel_when_the_prompt_is_shorter_than_the_hot_buffer(policy):
  """A sequence that starts shorter than D and outgrows it: while seq_len <= D the kernel takes its fast path
  (every token in its own slot; the policy's state untouched), and the Python replays must do the same, or they
  disagree with the kernel (and the engine) once the sequence passes D (a 5-token prompt's recorded trace did)."""
  context, D, K, steps = 5, 16, 6, 40
  for seed in range(4):
    rng = np.random.default_rng(seed)
    trace = [rng.choice(context + t + 1, min(K, context + t + 1), replace=False).astype(np.int32) for t in range(steps)]
    python = {"lru": miss_rate.replay_lru, "clock": miss_rate.replay_clock}[policy](trace, context, D)
    kernel = miss_rate.replay_kernel(trace, context, D, policy)
    assert python == kernel and sum(kernel) > 0 and kernel[: D - context] == [0] * (D - context), seed
