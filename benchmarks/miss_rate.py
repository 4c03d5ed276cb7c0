r"""Swap-in miss rates by eviction policy and hot-buffer size, replayed on the same top-k traces.

  python benchmarks/miss_rate.py [--quick] [--context 65536] [--steps 500] [--top-k 2048] [--layers 8] \
      [--buffers 2048,4096,6144] [--seed 0] [--out benchmarks/results/miss_rate]
  python benchmarks/miss_rate.py --trace-model synthetic --context 16384 --steps 1000 --out ...
  python benchmarks/miss_rate.py --trace trace.npz --buffers 2048,4096 --out ...

Traces:
  calibrated (default)  ``calibrated_trace.py``: each of ``--layers`` layers is one stream of ``--steps``
                        decode steps after a ``--context``-token prompt, with the locality measured on
                        DeepSeek-V3.2's indexer (its docstring cites the sources and the bands) and the
                        indexer scores of every position, which the score policies read.
  synthetic             ``synthetic_trace`` (one stream: sinks, a recent window, drifting recurring
                        clusters, uniform noise); no scores.
  --trace FILE          the top-k recorded from a model's own indexer (``python -m hisparse_jax.generate
                        --dump-topk``): every (request, layer) is one stream; no scores.
Tables and plots average over streams. Policies, replayed per step with the kernel's semantics (D slots + a
reserved slot for the newest token; the tokens needed this step are never evicted; each distinct missing
position costs one copy):

  lru, clock        the real CPU swap-in handler (``eviction`` "lru" / "clock"; columns lru-kernel and
                    clock-kernel in OUT.json) AND the same policies in Python: they must agree step for
                    step (exit 1 otherwise); the table shows them once
  score             the handler's "score" policy fed each step's indexer scores of the resident tokens
  score-ema         the engine's ``"eviction": "score_ema"``: the same policy fed each slot's moving average of
                    its token's scores since it entered the hot buffer (memory/views.py ``slot_score_ema``,
                    ``restart_score_ema``; ``KernelReplay``); calibrated traces only, as score
  position-ema      the same policy fed a moving average of every position's scores over the whole decode,
                    resident or not (what a per-position score pool beside the indexer keys would hold; the
                    engine has none); calibrated traces only
  content-oracle    evict the token with the lowest expected next-step score given the calibrated trace's
                    true content field, which no system can read (``ContentOracleReplay``): where the best
                    online policy could get to on that trace; reported, never counted as "best online"
  fifo              evict the slot filled longest ago
  lfu               evict the least frequently used slot (ties: least recently used)
  belady            offline optimum: evict the slot whose token is needed furthest in the future

Writes OUT.json (per-step misses, the measured overlaps, a summary), OUT.md (table: mean misses per step,
LRU's, the best online policy's and the content oracle's excess over Belady) and OUT.png (misses per step,
rolling mean over 100 steps, one line per policy x size).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
import zipfile
import zlib

import numpy as np

MAX_POSITIONS = 1 << 22  # context + steps and hot-buffer sizes a replay accepts (4M tokens; DSA models: 160k)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli import OUT_HELP, default_out, out_path, positive_ints  # noqa: E402


def synthetic_trace(
  context: int,
  steps: int,
  top_k: int,
  seed: int = 0,
  *,
  sinks: int = 16,
  window: int | None = None,
  clusters: int = 24,
  cluster_width: int | None = None,
  drift: float = 2.0,
  revisit: float = 0.35,
  noise: float = 0.1,
):
  """Top-k positions per decode step: list of int32 arrays (distinct, < seq_len).

  Locality model (fractions of top_k; parameters are keyword args):
    * the first ``sinks`` positions (attention sinks) and the last ``window``
      positions (recent window, default top_k / 8) every step;
    * ``clusters`` recurring clusters of ``cluster_width`` (default top_k / 21) positions whose
      centres random-walk by N(0, drift) positions per step; each step visits
      a random ``revisit`` share of them (so a cluster leaves the top-k and
      comes back, the case an LRU hot buffer has to hold);
    * a ``noise`` share of uniformly random older positions;
    * the rest filled with more positions drawn near the visited clusters.

  Raises ValueError if context < top_k + sinks + window (the clusters' range would be empty).
  """
  window = top_k // 8 if window is None else window  # 256 at top_k 2048
  if context < top_k + sinks + window:
    raise ValueError(
      f"context {context} < top_k + {sinks} sinks + a {window}-position recent window ({top_k + sinks + window})"
    )
  cluster_width = max(4, top_k // 21) if cluster_width is None else cluster_width  # 97 at top_k 2048
  rng = np.random.default_rng(seed)
  centres = rng.uniform(sinks, context, clusters)
  trace = []
  for t in range(steps):
    seq_len = context + t + 1
    centres = np.clip(centres + rng.normal(0, drift, clusters), sinks, seq_len - window - 1)
    picked = set(range(min(sinks, seq_len)))
    picked.update(range(max(0, seq_len - window), seq_len))
    visit = centres[rng.random(clusters) < revisit]
    for c in visit:
      lo = int(c) - cluster_width // 2
      picked.update(range(max(0, lo), min(seq_len, lo + cluster_width)))
    n_noise = int(noise * top_k)
    picked.update(rng.integers(0, seq_len, n_noise).tolist())
    while len(picked) < min(top_k, seq_len):
      c = visit[rng.integers(len(visit))] if len(visit) else rng.uniform(0, seq_len)
      picked.add(int(np.clip(c + rng.normal(0, cluster_width), 0, seq_len - 1)))
    arr = np.fromiter(picked, np.int32)
    if len(arr) > top_k:  # keep sinks + window, drop a random part of the rest
      fixed = arr[(arr < sinks) | (arr >= seq_len - window)]
      rest = rng.permutation(arr[(arr >= sinks) & (arr < seq_len - window)])[: max(0, top_k - len(fixed))]
      arr = np.concatenate([fixed[-top_k:], rest])
    trace.append(np.sort(arr).astype(np.int32))
  return trace


def load_recorded(path: str):
  """Streams of a ``--dump-topk`` file: list of (name, context, trace), one per (request, layer);
  trace = list of int32 arrays (the step's top-k positions without the -1 padding).

  Requests without decode steps (max_new_tokens 1, or EOS at once) have nothing to replay and are
  skipped. Raises ValueError for a file that is not such a trace.
  """
  try:
    with open(path, "rb") as f:
      magic = f.read(4)
  except OSError as e:
    raise ValueError(f"{path}: {e.strerror}") from None
  if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # .npz files are zip archives (the second: an empty one)
    raise ValueError(f"{path}: not an .npz archive (write one with --dump-topk)")
  try:
    return _load_recorded(path)
  except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # a damaged archive or member
    raise ValueError(f"{path}: not a readable .npz trace ({e})") from None


def _load_recorded(path: str):
  try:
    z = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: not a readable .npz trace ({e})") from None
  streams = []
  keys = [k for k in z.files if k.startswith("topk_")]
  if not keys or not all(k[5:].isascii() and k[5:].isdigit() and f"prompt_tokens_{k[5:]}" in z.files for k in keys):
    raise ValueError(
      f"{path}: expected topk_<line> and prompt_tokens_<line> arrays (from --dump-topk), found {sorted(z.files)[:6]}"
    )
  for key in sorted(keys, key=lambda k: int(k[5:])):
    line = key[5:]
    steps, context = z[key], z[f"prompt_tokens_{line}"]  # [steps, L, K], a scalar
    if not isinstance(steps, np.ndarray) or steps.ndim != 3 or not np.issubdtype(steps.dtype, np.integer):
      raise ValueError(
        f"{path}: {key} must be an integer array [steps, layers, top_k], got "
        f"{getattr(steps, 'dtype', type(steps).__name__)}{getattr(steps, 'shape', '')}"
      )
    if (
      not isinstance(context, np.ndarray)
      or context.shape
      or not np.issubdtype(context.dtype, np.integer)
      or not 1 <= int(context) <= MAX_POSITIONS - len(steps)
    ):
      raise ValueError(
        f"{path}: prompt_tokens_{line} must be an integer in [1, {MAX_POSITIONS} - decode steps], got {context!r}"
      )
    context = int(context)
    # Decode step t attends at seq_len = context + t + 1: its positions are in [0, context + t] (-1: padding).
    limit = context + np.arange(len(steps), dtype=np.int64)[:, None, None]
    if steps.size and ((steps < -1) | (steps > limit)).any():
      raise ValueError(
        f"{path}: {key} has a position outside [-1, prompt_tokens + step] (step t attends at "
        f"prompt_tokens + t + 1 positions)"
      )
    steps = steps.astype(np.int32)
    for layer in range(steps.shape[1] if len(steps) else 0):
      streams.append((f"line {line} layer {layer}", context, [t[t >= 0] for t in steps[:, layer]]))
  if not streams:
    raise ValueError(f"{path}: no request has a decode step to replay")
  return streams


class _HotBuffer:
  """One stream's hot buffer as a replay sees it: D slots, slot i holding token i until the sequence outgrows
  them (a prompt shorter than D fills its own slots as it decodes)."""

  def __init__(self, D: int):
    self.slot_of = {t: t for t in range(D)}  # token -> slot
    self.token_in = list(range(D))  # slot -> token

  def step(self, step, topk, newest, choose_victims, on_hit=None, on_fill=None) -> int:
    """One decode step's swap-in with the kernel's semantics; returns its misses. choose_victims(n, hit
    slots, token_in, step, needed set) -> n slots, none of them a hit."""
    if newest < len(self.token_in):  # the kernel's fast path (seq_len <= D): no I/O, the policy's state unchanged
      return 0
    slot_of, token_in = self.slot_of, self.token_in
    needed = [int(t) for t in topk if t != newest and t >= 0]
    hit_slots = {slot_of[t] for t in needed if t in slot_of}
    for s in hit_slots:
      if on_hit:
        on_hit(s, step)
    missing = [t for t in needed if t not in slot_of]
    victims = choose_victims(len(missing), hit_slots, token_in, step, set(needed))
    for t, s in zip(missing, victims):
      del slot_of[token_in[s]]
      slot_of[t], token_in[s] = s, t
      if on_fill:
        on_fill(s, step)
    return len(missing)


def _replay(trace, context, D, choose_victims, on_hit=None, on_fill=None):
  """Generic replay of one stream; returns misses per step."""
  buf = _HotBuffer(D)
  return [buf.step(step, topk, context + step, choose_victims, on_hit, on_fill) for step, topk in enumerate(trace)]


def replay_lru(trace, context, D):
  order = collections.OrderedDict((s, None) for s in range(D))  # oldest first

  def choose(n, hits, token_in, step, need):
    victims = [s for s in order if s not in hits][:n]
    for s in victims:
      order.move_to_end(s)
    for s in [s for s in order if s in hits]:
      order.move_to_end(s)
    return victims

  return _replay(trace, context, D, choose)


def replay_fifo(trace, context, D):
  filled = collections.OrderedDict((s, None) for s in range(D))

  def choose(n, hits, token_in, step, need):
    victims = [s for s in filled if s not in hits][:n]
    for s in victims:
      filled.move_to_end(s)
    return victims

  return _replay(trace, context, D, choose)


def replay_clock(trace, context, D):
  ref = np.zeros(D, bool)
  hand = [0]

  def choose(n, hits, token_in, step, need):
    for s in hits:
      ref[s] = True
    victims = []
    while len(victims) < n:
      s = hand[0]
      hand[0] = (s + 1) % D
      if s in hits or s in victims:
        continue
      if ref[s]:
        ref[s] = False
      else:
        victims.append(s)
    return victims

  return _replay(trace, context, D, choose)


def replay_lfu(trace, context, D):
  freq = np.zeros(D, np.int64)
  last = np.zeros(D, np.int64)

  def choose(n, hits, token_in, step, need):
    for s in hits:
      freq[s] += 1
      last[s] = step
    cand = [s for s in range(D) if s not in hits]
    cand.sort(key=lambda s: (freq[s], last[s]))
    victims = cand[:n]
    for s in victims:
      freq[s], last[s] = 1, step
    return victims

  return _replay(trace, context, D, choose)


def replay_belady(trace, context, D):
  # next_use[step][token] = next step > step that needs token (inf if none)
  INF = 1 << 60
  nxt = {}
  next_use = [None] * len(trace)
  for step in range(len(trace) - 1, -1, -1):
    next_use[step] = nxt
    nxt = dict(nxt)
    for t in trace[step]:
      nxt[int(t)] = step

  def choose(n, hits, token_in, step, need):
    fut = next_use[step]
    cand = [s for s in range(D) if s not in hits]
    cand.sort(key=lambda s: -fut.get(token_in[s], INF))
    return cand[:n]

  return _replay(trace, context, D, choose)


class KernelReplay:
  """The real CPU swap-in handler replaying N streams at once, one request slot (and batch row) each, with
  1-element latent rows and page size 1 (the page table is the host-row table). Slots hold tokens 0..D-1
  after the prefill, as in ``_replay``. ``step`` takes the step's top-k of every stream and, for the score
  policies, the indexer scores of every position; ``misses`` collects misses per step per stream.

  eviction "score-ema" is the engine's "score_ema": the kernel's score policy fed each slot's moving average of
  its token's scores since the token entered the hot buffer, with the engine's functions (``slot_score_ema``,
  weight ``ema`` on the past; ``restart_score_ema``); "position-ema" feeds it the moving average of every
  position's scores since the decode began. Both clip the trace's infinite scores of sinks / the recent window
  to +-EMA_CLIP (a real indexer's scores are finite)."""

  EMA_CLIP = 8.0

  def __init__(self, streams: int, context: int, steps: int, D: int, K: int, eviction: str, ema: float = 0.8):
    import jax
    import jax.numpy as jnp
    from hisparse_jax.kernels import ops

    self.n, self.context, self.K, self.D = streams, context, K, D
    self.kernel_policy = "score" if eviction in ("score-ema", "position-ema") else eviction
    self.eviction, self.ema_weight = eviction, ema
    S = context + steps + 1
    self.pool = jax.jit(lambda: jax.device_put(jnp.zeros((1, S, 1), jnp.float32), jax.memory.Space.Host))()
    self.hot = jnp.zeros((1, streams, D + 1, 1), jnp.float32)
    self.slots = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (1, streams, D)) + 0
    self.lru = self.slots + 0
    self.stats = jnp.zeros((1, streams, 2), jnp.int32)
    self.host_pages = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (streams, S)) + 0
    self.req_ids = jnp.arange(streams, dtype=jnp.int32)
    self.newest = jnp.zeros((streams, 1), jnp.float32)
    self.ema = np.zeros((streams, S), np.float32) if eviction == "position-ema" else None
    self.slot_ema = jnp.full((streams, D), jnp.nan, jnp.float32) if eviction == "score-ema" else None
    self.fn = jax.jit(
      functools.partial(ops.swap_in, page_size=1, eviction=self.kernel_policy), donate_argnums=(6, 7, 8, 9, 10)
    )
    self.check_status = ops.check_status
    self.misses = [[] for _ in range(streams)]
    self._prev = np.zeros(streams, np.int64)

  def step(self, step: int, top_k, scores=None, forecast=None):
    """top_k: int32[N, <= K] distinct positions (a list of arrays or an array); scores: float32[N, seq_len];
    forecast: unused (``ContentOracleReplay``'s)."""
    import jax.numpy as jnp
    from hisparse_jax.memory.views import restart_score_ema, slot_score_ema

    seq_len = self.context + step + 1
    tk = np.full((self.n, self.K), -1, np.int32)
    for b, row in enumerate(top_k):
      tk[b, : len(row)] = row
    slot_scores = None
    if self.kernel_policy == "score":
      before = np.asarray(self.slots)[0]  # [N, D] positions (the call donates the slot table)
      if scores is None:
        raise ValueError(f"eviction {self.eviction} needs the indexer scores of the trace")
      if self.eviction != "score":
        scores = np.clip(scores, -self.EMA_CLIP, self.EMA_CLIP)
      if self.ema is not None:
        old = self.ema[:, :seq_len]
        fresh = np.zeros(seq_len, bool)
        fresh[seq_len - 1] = True  # a new position starts at its own score
        old[:] = np.where(fresh, scores, self.ema_weight * old + (1 - self.ema_weight) * scores)
        scores = old
      # Slots past seq_len (D > seq_len: the kernel's fast path reads no score) read the last position's.
      slot_scores = jnp.asarray(np.take_along_axis(scores, np.minimum(before, seq_len - 1), axis=1), jnp.float32)
      if self.slot_ema is not None:
        slot_scores = slot_score_ema(self.slot_ema, slot_scores, self.ema_weight)
    _, self.pool, self.hot, self.slots, self.lru, self.stats, status = self.fn(
      0,
      jnp.asarray(tk),
      jnp.full((self.n,), seq_len, jnp.int32),
      self.req_ids,
      self.host_pages,
      self.newest,
      self.pool,
      self.hot,
      self.slots,
      self.lru,
      self.stats,
      slot_scores,
    )
    self.check_status(status, "miss_rate replay")  # every stream's row done
    if self.slot_ema is not None:
      self.slot_ema = restart_score_ema(slot_scores, before, self.slots[0], jnp.full((self.n,), seq_len))
    total = np.asarray(self.stats)[0, :, 1].astype(np.int64)
    for b, m in enumerate(total - self._prev):
      self.misses[b].append(int(m))
    self._prev = total


class ContentOracleReplay:
  """The content oracle (calibrated traces only): evicts the resident token with the lowest expected score at
  the next step given the trace's true content field (``calibrated_trace(with_forecast=True)``). No system can
  read that field; a policy that knew it exactly and ranked by it is what the best online policy could hope
  for on this trace, since the part of each step's scores drawn afresh (the query) is independent of the past
  (calibrated_trace.py's model). Its excess over Belady is therefore what is out of reach of any policy that
  cannot see the future, whatever it reads. Python, N streams stepped together like ``KernelReplay``."""

  def __init__(self, streams: int, context: int, D: int):
    self.context = context
    self.buffers = [_HotBuffer(D) for _ in range(streams)]
    self.misses = [[] for _ in range(streams)]

  def step(self, step: int, top_k, scores=None, forecast=None):
    """top_k: the N streams' positions; forecast: float32[N, seq_len] (``calibrated_trace``'s)."""
    if forecast is None:
      raise ValueError("the content oracle needs the calibrated trace's forecast (with_forecast=True)")
    for b, (buf, row) in enumerate(zip(self.buffers, top_k)):
      value = forecast[b]

      def choose(n, hits, token_in, _step, _need):
        if not n:
          return []
        cand = np.array([s for s in range(len(token_in)) if s not in hits], np.int64)
        keep = value[np.minimum(np.asarray(token_in, np.int64)[cand], len(value) - 1)]
        return cand[np.argsort(keep, kind="stable")[:n]].tolist()

      self.misses[b].append(buf.step(step, row, self.context + step, choose))


def replay_kernel(trace, context, D, eviction="lru"):
  """One stream's misses per step under the real kernel (no scores: lru or clock)."""
  replay = KernelReplay(1, context, len(trace), D, max(1, max(len(t) for t in trace)), eviction)
  for step, topk in enumerate(trace):
    replay.step(step, [topk])
  return replay.misses[0]


def replay_kernel_lru(trace, context, D):
  """The real CPU swap-in handler, one request, one layer, 1-element rows."""
  return replay_kernel(trace, context, D, "lru")


# Policies replayed in Python on the stored top-k (clock and lru also check the kernel step for step), and
# the kernel's own policies driven step by step (the score policies need the trace's indexer scores).
POLICIES = {"lru": replay_lru, "fifo": replay_fifo, "clock": replay_clock, "lfu": replay_lfu, "belady": replay_belady}
KERNEL_POLICIES = ("lru-kernel", "clock-kernel", "score-kernel", "score-ema-kernel", "position-ema-kernel")


def calibrated_streams(context, steps, top_k, layers, seed, replays):
  """Generates a calibrated trace (calibrated_trace.py) once, feeding each step (top-k, scores, forecast) to
  every replay in ``replays`` (``KernelReplay``, ``ContentOracleReplay``); returns the streams (one per layer)
  for the Python policies."""
  from calibrated_trace import TraceModel, calibrated_trace

  per_layer = [[] for _ in range(layers)]
  trace = calibrated_trace(context, steps, top_k, TraceModel(layers=layers), seed=seed, with_forecast=True)
  for step, (picked, scores, forecast) in enumerate(trace):
    for replay in replays:
      replay.step(step, picked, scores, forecast)
    for layer in range(layers):
      per_layer[layer].append(picked[layer])
  return [(f"layer {layer}", context, per_layer[layer]) for layer in range(layers)]


def _mean_curve(per_stream):
  """Per-step mean over streams (streams may differ in length: each step averages those that have it)."""
  n = max(len(m) for m in per_stream)
  total, count = np.zeros(n), np.zeros(n)
  for m in per_stream:
    total[: len(m)] += m
    count[: len(m)] += 1
  return total / np.maximum(count, 1)


def stream_overlaps(streams):
  """Mean top-k overlap of consecutive steps per stream, and of streams i and i + 1 at the same step (the
  adjacent-layer overlap when the streams are a calibrated trace's layers)."""
  temporal = [
    float(np.mean([len(np.intersect1d(a, b)) / max(len(a), 1) for a, b in zip(tr[1:], tr)]))
    if len(tr) > 1
    else float("nan")
    for _, _, tr in streams
  ]
  adjacent = [
    float(np.mean([len(np.intersect1d(a, b)) / max(len(a), 1) for a, b in zip(s1[2], s2[2])]))
    for s1, s2 in zip(streams, streams[1:])
  ]
  return temporal, adjacent


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--context", type=int, default=65536)
  ap.add_argument("--steps", type=int, default=500)
  ap.add_argument("--top-k", type=int, default=2048)
  ap.add_argument("--layers", type=int, default=8, help="layers of the calibrated trace (each one stream)")
  ap.add_argument(
    "--trace-model",
    choices=["calibrated", "synthetic"],
    default="calibrated",
    help="calibrated: calibrated_trace.py (DeepSeek-V3.2's measured locality, with indexer "
    "scores); synthetic: the older cluster model (no scores: no score policies)",
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
    "--buffers",
    default=None,
    type=positive_ints,
    help="hot-buffer sizes D (comma-separated, each >= top_k; default: 1, 2 and 3 x top_k, the "
    "trace's with --trace: 2048,4096,6144 at top_k 2048)",
  )
  ap.add_argument("--trace", default=None, help="replay a --dump-topk .npz instead (no scores: no score policies)")
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
  if ap.parse_known_args(argv)[0].quick:  # small sizes as defaults: flags given explicitly still win
    ap.set_defaults(context=1024, steps=40, top_k=128, layers=3)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("miss_rate_trace" if args.trace else "miss_rate", args.quick)
  for name in ("context", "steps", "top_k", "layers"):
    if getattr(args, name) < 1:
      print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
      return 2
  if args.context + args.steps > MAX_POSITIONS or max(args.buffers or [0]) > MAX_POSITIONS:
    print(f"error: --context + --steps and --buffers must be <= {MAX_POSITIONS} positions", file=sys.stderr)
    return 2
  try:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  except OSError as e:
    print(f"error: --out {args.out}: {e.strerror}", file=sys.stderr)
    return 2
  if args.layers > 64:
    print("error: --layers must be <= 64", file=sys.stderr)
    return 2
  if args.seed < 0:
    print("error: --seed must be >= 0", file=sys.stderr)
    return 2
  t0 = time.perf_counter()
  per_stream = {}  # "policy@D" -> list over streams of misses per step
  if args.trace is not None:
    try:
      streams = load_recorded(args.trace)
    except ValueError as e:
      print(f"error: --trace {e}", file=sys.stderr)
      return 2
    top_k = max(max((len(t) for t in tr), default=0) for _, _, tr in streams)
    contexts = sorted({c for _, c, _ in streams})
    steps = max(len(tr) for _, _, tr in streams)
    source = (
      f"Recorded trace {os.path.basename(args.trace)}: {len(streams)} streams (request x layer), "
      f"prompts of {contexts[0]}..{contexts[-1]} tokens, up to {steps} decode steps, top_k {top_k}"
    )
  else:
    top_k, steps = args.top_k, args.steps
    if args.trace_model == "calibrated" and args.top_k >= args.context:  # (every position picked: no misses)
      print(f"error: the calibrated trace needs --top-k ({args.top_k}) < --context ({args.context})", file=sys.stderr)
      return 2
    if args.trace_model == "synthetic":
      try:
        streams = [("synthetic", args.context, synthetic_trace(args.context, args.steps, args.top_k))]
      except ValueError as e:
        print(
          f"error: --trace-model synthetic needs --context >= top_k + its sinks and recent window: {e}", file=sys.stderr
        )
        return 2
      source = f"Synthetic trace: context {args.context}, {args.steps} decode steps, top_k {args.top_k}"
  buffers = args.buffers = args.buffers or [m * top_k for m in ((1, 2) if args.quick else (1, 2, 3))]
  if min(buffers) < top_k:
    print(f"error: --buffers: every hot-buffer size must be >= top_k ({top_k}); got {min(buffers)}", file=sys.stderr)
    return 2
  longest = max((c + len(tr) for _, c, tr in streams), default=0) if args.trace is not None else 0
  if longest and min(buffers) >= longest:
    print(
      f"note: every hot buffer ({', '.join(map(str, buffers))}) holds the trace's longest sequence ({longest} "
      "tokens) whole, so no policy ever misses; pass --buffers below it (the engine's default D is 2 x top_k = "
      f"{2 * top_k})",
      file=sys.stderr,
    )
  if args.trace is None and args.trace_model == "calibrated":
    replays = {
      f"{p}@{D}": KernelReplay(args.layers, args.context, steps, D, top_k, p.removesuffix("-kernel"))
      for D in buffers
      for p in KERNEL_POLICIES
    }
    replays.update({f"content-oracle@{D}": ContentOracleReplay(args.layers, args.context, D) for D in buffers})
    streams = calibrated_streams(args.context, steps, top_k, args.layers, args.seed, replays.values())
    per_stream.update({k: r.misses for k, r in replays.items()})
    source = (
      f"Calibrated trace (calibrated_trace.py, seed {args.seed}): {args.layers} layers (one stream each), "
      f"context {args.context}, {steps} decode steps, top_k {top_k}"
    )
  else:
    for D in buffers:
      for p in ("lru-kernel", "clock-kernel"):
        per_stream[f"{p}@{D}"] = [replay_kernel(tr, c, D, p.removesuffix("-kernel")) for _, c, tr in streams]
  for D in buffers:
    for name, fn in POLICIES.items():
      per_stream[f"{name}@{D}"] = [fn(trace, context, D) for _, context, trace in streams]
  # The Python LRU and CLOCK are the kernel's policies: they must agree step by step on every stream.
  for D in buffers:
    for p in ("lru", "clock"):
      if per_stream[f"{p}@{D}"] != per_stream[f"{p}-kernel@{D}"]:
        print(f"error: Python {p} and the kernel disagree at D={D}", file=sys.stderr)
        return 1
  policies = [
    p
    for p in (
      "lru",
      "clock",
      "fifo",
      "lfu",
      "score-kernel",
      "score-ema-kernel",
      "position-ema-kernel",
      "content-oracle",
      "belady",
    )
    if f"{p}@{buffers[0]}" in per_stream
  ]
  online = [p for p in policies if p not in ("belady", "content-oracle")]  # what a system can run
  results = {k: _mean_curve(v).tolist() for k, v in per_stream.items()}
  temporal, adjacent = stream_overlaps(streams)
  label = {"score-kernel": "score", "score-ema-kernel": "score-ema", "position-ema-kernel": "position-ema"}
  oracle = "content-oracle" in policies
  lines = [
    f"{source} ({time.perf_counter() - t0:.1f} s).",
    "",
    "| D | "
    + " | ".join(label.get(p, p) for p in policies)
    + " | LRU vs Belady | best online vs Belady |"
    + (" content oracle vs Belady |" if oracle else ""),
    "|---" * (len(policies) + 3 + oracle) + "|",
  ]
  summary = {}
  for D in buffers:
    means = {p: float(np.mean(np.concatenate(per_stream[f"{p}@{D}"]))) for p in policies}
    best = min(online, key=lambda p: means[p])
    gapped = ("lru", best) + (("content-oracle",) if oracle else ())
    if means["belady"] > 0:
      gaps = {p: means[p] / means["belady"] - 1 for p in gapped}
      shown = {p: f"+{100 * gaps[p]:.0f}%" for p in gapped}
    else:  # nothing misses even with perfect foresight (D covers the whole context)
      gaps, shown = {}, dict.fromkeys(gapped, "n/a")
    summary[D] = {
      "means": means,
      "best": best,
      "best_gap": gaps.get(best),
      "lru_gap": gaps.get("lru"),
      "content_oracle_gap": gaps.get("content-oracle"),
    }
    tied = [p for p in online if means[p] == means[best]]  # (all of them: which one min() picked means nothing)
    lines.append(
      f"| {D} | "
      + " | ".join(f"{means[p]:.1f}" for p in policies)
      + f" | {shown['lru']} | {' = '.join(label.get(p, p) for p in tied)} {shown[best]} |"
      + (f" {shown['content-oracle']} |" if oracle else "")
    )
  if "position-ema-kernel" in policies:
    lines += [
      "",
      "position-ema (a moving average of every position's scores) is not an engine option; the "
      'engine\'s policies are lru, clock, score and score-ema (`"eviction": "score_ema"`).',
    ]
  if args.trace is None and args.trace_model == "calibrated":
    lines += [
      "",
      "Measured locality: consecutive steps' top-k overlap per layer "
      + ", ".join(f"{x:.2f}" for x in temporal)
      + "; adjacent layers "
      + (", ".join(f"{x:.2f}" for x in adjacent) or "n/a (one layer)")
      + ".",
    ]
  table = "\n".join(lines)
  print(table)
  what = "one request, one layer" if len(streams) == 1 else "mean over the streams"
  with open(args.out + ".md", "w") as f:
    f.write(f"Mean misses per decode step ({what}).\n\n" + table + "\n")
  with open(args.out + ".json", "w") as f:
    json.dump(
      {
        "args": vars(args),
        "streams": len(streams),
        "misses": results,
        "overlap": {"temporal": temporal, "adjacent": adjacent},
        "summary": {str(D): v for D, v in summary.items()},
      },
      f,
    )
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(10, 5))
  w = max(1, min(100, steps))
  colors = dict(zip(policies, plt.get_cmap("tab10").colors))
  styles = {D: ["-", "--", ":", "-."][i % 4] for i, D in enumerate(buffers)}
  for key, m in results.items():
    policy, D = key.split("@")
    if policy not in policies:  # lru-kernel / clock-kernel: identical to lru / clock (checked above)
      continue
    roll = np.convolve(m, np.ones(w) / w, mode="valid")
    ax.plot(
      np.arange(len(roll)) + w - 1,
      roll,
      label=f"{label.get(policy, policy)}@{D}",
      color=colors[policy],
      linestyle=styles[int(D)],
    )
  ax.set_xlabel("decode step")
  ax.set_ylabel(f"misses per step (rolling mean, {w} steps)")
  ax.set_title(f"Swap-in misses by policy and hot-buffer size ({source.split(':')[0].lower()}, top_k {top_k})")
  ax.legend(ncol=4, fontsize=7)
  fig.tight_layout()
  fig.savefig(args.out + ".png", dpi=110)
  return 0


if __name__ == "__main__":
  sys.exit(main())
