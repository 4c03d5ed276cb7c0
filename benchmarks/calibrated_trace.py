"""Decode-time indexer traces with a trained DSA model's locality: top-k positions AND the indexer scores, per layer.

Our random-weight models' indexers pick positions with no temporal locality (consecutive steps share 25% of
their top-k: chance), so they cannot tell eviction policies apart. This generator reproduces what has been
measured on DeepSeek-V3.2's and GLM-5's real indexers:

  * consecutive decode steps: the top-k of one step shares 35-50% of its positions with the previous step's on
    deep layers, much less on the first layers (NVIDIA TensorRT-LLM, "Temporal Correlation Meets Sparse
    Attention: Guess-Verify-Refine Top-K for Blackwell", tech blog 21, and Cheng et al., arXiv:2604.22312:
    DeepSeek-V3.2, a 68,665-token prompt, 2,025 decode steps; the paper's +1-offset illustration keeps ~60%);
  * adjacent layers: 70-100% of the top-k shared between layer l and l + 1 (Bai et al., "IndexCache:
    Accelerating Sparse Attention via Cross-Layer Index Reuse", arXiv:2603.12201, the redundancy that lets it
    drop 75% of the indexers).

Model. The score of position p at layer l and decode step t is

    s[l, t, p] = sqrt(a_l) C[l, t, p] + sqrt(1 - a_l - n) Q[l, t, p] + sqrt(n) N[l, t, p]   (+ sinks, recency)

with three unit-variance Gaussian fields:
  C  "content": AR(1) over steps (correlation rho_content per step) and over layers (gamma_content): what a
     position is about changes slowly, and layers agree on it;
  Q  "query": drawn afresh every step (what this token asks for), correlated over layers (gamma_query);
  N  independent noise.
So consecutive steps correlate by a_l * rho_content (the temporal overlap), adjacent layers by
a_l * gamma_content + (1 - a_l - n) * gamma_query (the cross-layer overlap: high on every layer, as both
fields are shared by neighbouring layers). a_l, the content share, rises from ``content_first`` at layer 0 to
``content_deep`` over ``depth_scale`` layers; n is ``noise_share``. The first ``sinks`` positions
(attention sinks) and the ``recent`` newest ones are always in the top-k. Defaults are calibrated at the
measured prompt length: at a 65,536-token context with top_k 2048, consecutive steps overlap 0.15 on layer 0,
0.26 on layer 1 and 0.34-0.45 on layers 2-7, and adjacent layers 0.72-0.83 (``overlaps`` measures it;
tests/test_traces.py checks the bands). A shorter context makes the top-k a larger share of the positions, so
every overlap rises (at 16k: 0.29 on layer 0, 0.50-0.59 on layers 2-7, adjacent 0.79-0.88).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class TraceModel:
  """Parameters of ``calibrated_trace`` (module docstring)."""

  layers: int = 8
  sinks: int = 4
  recent: int = 64
  content_first: float = 0.35
  content_deep: float = 0.8
  depth_scale: float = 1.5
  noise_share: float = 0.01
  rho_content: float = 0.99
  gamma_content: float = 0.995
  gamma_query: float = 0.97

  def content_share(self, layer: int) -> float:
    return self.content_deep - (self.content_deep - self.content_first) * float(np.exp(-layer / self.depth_scale))


def calibrated_trace(
  context: int, steps: int, top_k: int, model: TraceModel = TraceModel(), seed: int = 0, *, with_forecast: bool = False
) -> Iterator[tuple[np.ndarray, ...]]:
  """Yields, for each of ``steps`` decode steps after a ``context``-token prompt (step t attends at seq_len =
  context + t + 1; position seq_len - 1 is the newest token): (top_k int32[layers, top_k] distinct positions
  < seq_len, sorted; scores float32[layers, seq_len], the indexer scores they were picked by: sinks and recent
  positions are +inf). Deterministic in ``seed``; ``with_forecast`` draws the same trace.

  With ``with_forecast`` each step also yields forecast float32[layers, seq_len]: the expectation of every
  position's score at the NEXT step given the true content field, E[s[l, t+1, p] | C[l, t]] =
  sqrt(a_l) rho_content C[l, t, p] (+inf for the sinks and the next step's recent window). No real system can
  read it: it is what an online policy would know if it had inferred the content part perfectly, while the
  next step's query part stays unknown (the content-oracle policy of miss_rate.py)."""
  m = model
  L = m.layers
  rng = np.random.default_rng(seed)
  total = context + steps
  shares = np.array([m.content_share(l) for l in range(L)], np.float32)
  query_share = np.maximum(1.0 - shares - m.noise_share, 0.0)

  def layered(n):
    """[L, n] unit Gaussians, AR(1) over layers with gamma (a function: one for each field)."""

    def draw(gamma):
      out = np.empty((L, n), np.float32)
      out[0] = rng.standard_normal(n, np.float32)
      for l in range(1, L):
        out[l] = gamma * out[l - 1] + np.sqrt(1 - gamma * gamma) * rng.standard_normal(n, np.float32)
      return out

    return draw

  content = layered(total)(m.gamma_content)
  rho = np.float32(m.rho_content)
  for t in range(steps):
    seq_len = context + t + 1
    if t:  # the content of every position drifts
      content = rho * content + np.sqrt(1 - rho * rho) * layered(total)(m.gamma_content)
    query = layered(seq_len)(m.gamma_query)
    noise = rng.standard_normal((L, seq_len), np.float32)
    scores = (
      np.sqrt(shares)[:, None] * content[:, :seq_len]
      + np.sqrt(query_share)[:, None] * query
      + np.float32(np.sqrt(m.noise_share)) * noise
    )
    scores[:, : min(m.sinks, seq_len)] = np.inf
    scores[:, max(0, seq_len - m.recent) :] = np.inf
    k = min(top_k, seq_len)
    picked = np.sort(np.argpartition(-scores, k - 1, axis=1)[:, :k], axis=1).astype(np.int32)
    if not with_forecast:
      yield picked, scores
      continue
    forecast = (np.sqrt(shares) * rho)[:, None] * content[:, :seq_len]
    forecast[:, : min(m.sinks, seq_len)] = np.inf
    forecast[:, max(0, seq_len + 1 - m.recent) :] = np.inf
    yield picked, scores, forecast


def overlaps(trace) -> dict:
  """Measured locality of a trace (an iterable of calibrated_trace's (top_k, scores)): per layer, the mean
  share of a step's top-k also in the previous step's ("temporal"), and per adjacent layer pair the mean share
  of layer l's top-k also in layer l + 1's ("adjacent")."""
  prev = None
  temporal, adjacent = [], []
  for picked, _ in trace:
    sets = [set(row.tolist()) for row in picked]
    adjacent.append([len(a & b) / len(a) for a, b in zip(sets, sets[1:])])
    if prev is not None:
      temporal.append([len(a & b) / len(a) for a, b in zip(sets, prev)])
    prev = sets
  return {"temporal": np.mean(temporal, axis=0).tolist(), "adjacent": np.mean(adjacent, axis=0).tolist()}


if __name__ == "__main__":
  raise SystemExit(
    f"{__file__}: a module of the benchmarks, not a benchmark: run benchmarks/miss_rate.py (the calibrated trace's replay)"
  )
