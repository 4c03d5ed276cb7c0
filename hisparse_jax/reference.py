"""Pure NumPy reference of the HiSparse swap-in: the executable spec and test oracle.

Written for clarity (Python dicts and lists, one request and one layer at a
time), independently of the C++ core in ``xla_ffi/swap_in_core.h``.

Semantics per request and layer (HiSparse, SGLang ``hisparse.cuh``):
  * The hot buffer has D slots plus a reserved slot D for the newest token,
    position seq_len - 1. Device row of (request b, slot s) = b * (D + 1) + s.
  * seq_len <= D (fast path): slot i holds token i; no I/O; LRU unchanged.
  * Otherwise: hits keep their slots; misses take the least-recently-used
    slots holding no token needed this step; the newest token is served from
    the reserved slot; each distinct missing position is copied once.
  * New LRU (oldest first) = untouched slots (old order) + filled slots (in the
    order they were taken) + hit slots (old order).
  * Padding (-1) maps to row -1. Hits and misses count distinct positions; the
    newest token counts as a hit.
  * Errors (nothing is modified): a position >= seq_len or < -1, K > D, a
    seq_len outside [0, S], a MISSING position whose page-table row is outside
    [0, H), an LRU order that is not a permutation (slow path only).
"""

from __future__ import annotations

import numpy as np


class SwapInError(ValueError):
  """Input the kernel must reject (it returns an FFI INVALID_ARGUMENT error)."""


def swap_in_request(top_k, seq_len, host_rows, host_pool_l, hot_l, slot_tokens, lru, row_base, D):
  """Swap-in of one request at one layer, in place on the given NumPy views.

  Args:
    top_k: int[K] positions, -1 padding.
    seq_len: int, tokens of the request.
    host_rows: int[S] position -> host row.
    host_pool_l: T[H, W] host pool of this layer.
    hot_l: T[B*(D+1), W] hot buffers of this layer (flattened rows), modified.
    slot_tokens: int[D], modified. lru: int[D], modified.
    row_base: device row of slot 0 of this request.
    D: hot-buffer slots.

  Returns:
    (rows int[K], hits, misses).

  Raises:
    SwapInError: as the kernel (position out of range, bad host row, bad LRU).
  """
  K = len(top_k)
  if K > D:
    raise SwapInError(f"top_k ({K}) > device_buffer_size ({D})")
  if not 0 <= seq_len <= len(host_rows):
    raise SwapInError(f"seq_len {seq_len} outside [0, {len(host_rows)}]")
  positions = [int(t) for t in top_k]
  for t in positions:
    if t < -1 or t >= seq_len:
      raise SwapInError(f"top-k position {t} outside [-1, {seq_len})")
  distinct = list(dict.fromkeys(t for t in positions if t >= 0))
  if seq_len <= D:
    return np.array([-1 if t < 0 else row_base + t for t in positions], np.int32), len(distinct), 0

  newest = seq_len - 1
  H = host_pool_l.shape[0]
  if sorted(int(s) for s in lru) != list(range(D)):
    raise SwapInError("LRU order is not a permutation of the slots")

  slot_of = {}
  for s in range(D):
    t = int(slot_tokens[s])
    if t in distinct and t != newest and t not in slot_of:
      slot_of[t] = s
  hit_slots = set(slot_of.values())
  misses = [t for t in distinct if t != newest and t not in slot_of]
  for t in misses:  # only rows that are read need a valid page-table entry
    if not 0 <= host_rows[t] < H:
      raise SwapInError(f"position {t} has host row {host_rows[t]} outside [0, {H})")
  old_lru = [int(s) for s in lru]
  victims = [s for s in old_lru if s not in hit_slots][: len(misses)]
  for t, s in zip(misses, victims):
    slot_of[t] = s
    slot_tokens[s] = t
    hot_l[row_base + s] = host_pool_l[host_rows[t]]
  untouched = [s for s in old_lru if s not in hit_slots and s not in victims]
  lru[:] = untouched + victims + [s for s in old_lru if s in hit_slots]

  rows = []
  for t in positions:
    if t < 0:
      rows.append(-1)
    elif t == newest:
      rows.append(row_base + D)
    else:
      rows.append(row_base + slot_of[t])
  return np.array(rows, np.int32), len(distinct) - len(misses), len(misses)


def swap_in(layer, top_k, seq_lens, host_rows, host_pool, hot, slot_tokens, lru, stats):
  """Batched reference with the shapes and results of ``hisparse_jax.ops.swap_in``.

  Works on copies; returns (rows, host_pool, hot, slot_tokens, lru, stats) as
  NumPy arrays. Raises SwapInError where the kernel returns an FFI error (the
  kernel then modifies nothing).
  """
  hot = np.array(hot, copy=True)
  slot_tokens = np.array(slot_tokens, copy=True)
  lru = np.array(lru, copy=True)
  stats = np.array(stats, copy=True)
  host_pool = np.asarray(host_pool)
  L, B, D1, W = hot.shape
  D = D1 - 1
  if not 0 <= layer < L:
    raise SwapInError(f"layer {layer} outside [0, {L})")
  hot_l = hot[layer].reshape(B * D1, W)
  rows = np.zeros(np.shape(top_k), np.int32)
  for b in range(B):
    rows[b], hits, misses = swap_in_request(
        np.asarray(top_k[b]), int(seq_lens[b]), np.asarray(host_rows[b]), host_pool[layer],
        hot_l, slot_tokens[layer, b], lru[layer, b], b * D1, D)
    stats[layer, b] += (hits, misses)
  return rows, host_pool, hot, slot_tokens, lru, stats


def random_case(rng: np.random.Generator, *, L=2, B=3, D=8, K=6, S=40, W=4, dtype=np.float32):
  """A random valid swap-in input (the argument list of ``swap_in``) for cross-checks.

  Each lane gets a random seq_len in [0, S], distinct resident tokens (some
  empty slots) consistent with its KV, a random LRU permutation, a random page
  table into a shared pool, and top-k positions with padding and duplicates.
  """
  H = B * S + 3
  layer = int(rng.integers(L))
  seq_lens = rng.integers(0, S + 1, B).astype(np.int32)
  host_rows = rng.permutation(H)[: B * S].astype(np.int32).reshape(B, S)
  pool = (rng.standard_normal((L, H, W)) * 10).astype(dtype)
  hot = np.zeros((L, B, D + 1, W), dtype)
  slot_tokens = np.tile(np.arange(D, dtype=np.int32), (L, B, 1))
  lru = np.stack([np.stack([rng.permutation(D) for _ in range(B)]) for _ in range(L)]).astype(np.int32)
  top_k = np.full((B, K), -1, np.int32)
  for b in range(B):
    n = int(seq_lens[b])
    for l in range(L):
      if n > D:
        resident = rng.choice(n - 1, size=min(D, n - 1), replace=False)
        tokens = np.full(D, -1, np.int32)
        tokens[: len(resident)] = resident
        tokens[rng.random(D) < 0.1] = -1
        slot_tokens[l, b] = rng.permutation(tokens)
        for s, t in enumerate(slot_tokens[l, b]):
          if t >= 0:
            hot[l, b, s] = pool[l, host_rows[b, t]]
        hot[l, b, D] = pool[l, host_rows[b, n - 1]]
      else:
        for t in range(n):
          hot[l, b, t] = pool[l, host_rows[b, t]]
    if n:
      top_k[b] = np.where(rng.random(K) < 0.2, -1, rng.integers(0, n, K))
  stats = np.zeros((L, B, 2), np.int32)
  return [layer, top_k, seq_lens, host_rows, pool, hot, slot_tokens, lru, stats]


def worked_example():
  """The issue's worked example as ``swap_in`` arguments (request 4 of 5; the others idle).

  D=4; slots 0..3 of request 4 hold tokens [10, 3, 7, 12] in device rows
  20..23; the newest token 15 sits in the reserved row 24; seq_len 16; LRU
  oldest-first [0, 1, 2, 3]. Top-k [3, 15, 8, -1] -> rows [21, 24, 20, -1];
  slot 0 then holds token 8, device row 20 its host row, LRU [2, 3, 0, 1].
  """
  L, B, D, W, S, H = 1, 5, 4, 3, 16, 32
  hot = np.arange(L * B * (D + 1) * W, dtype=np.float32).reshape(L, B, D + 1, W) + 1000
  slot_tokens = np.tile(np.arange(D, dtype=np.int32), (L, B, 1))
  slot_tokens[0, 4] = [10, 3, 7, 12]
  lru = np.tile(np.arange(D, dtype=np.int32), (L, B, 1))
  pool = np.arange(L * H * W, dtype=np.float32).reshape(L, H, W)
  host_rows = np.tile(np.arange(S, dtype=np.int32)[::-1] + 2, (B, 1))  # a non-identity page table
  top_k = np.full((B, 4), -1, np.int32)
  top_k[4] = [3, 15, 8, -1]
  seq_lens = np.zeros(B, np.int32)
  seq_lens[4] = 16
  stats = np.zeros((L, B, 2), np.int32)
  return [0, top_k, seq_lens, host_rows, pool, hot, slot_tokens, lru, stats]
