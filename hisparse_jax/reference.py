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
  for t in distinct:
    if t != newest and not 0 <= host_rows[t] < H:
      raise SwapInError(f"position {t} has host row {host_rows[t]} outside [0, {H})")
  if sorted(int(s) for s in lru) != list(range(D)):
    raise SwapInError("LRU order is not a permutation of the slots")

  slot_of = {}
  for s in range(D):
    t = int(slot_tokens[s])
    if t in distinct and t != newest and t not in slot_of:
      slot_of[t] = s
  hit_slots = set(slot_of.values())
  misses = [t for t in distinct if t != newest and t not in slot_of]
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
