r"""Swap-in kernel benchmark: time per call, bookkeeping per request-layer, miss-copy bandwidth vs memcpy.

  python benchmarks/swap_in.py [--quick] [--batch 1,64,256] [--buffer 2048,4096] \
      [--row-bytes 656,1152] [--miss 0.001,0.05,0.2,1.0] [--layers 2] [--repeats 9] [--out benchmarks/results/swap_in_cpu]

For every (B, D, W, miss fraction) point, one jitted call runs the swap-in FFI
on ``--layers`` layers in a row (a Python loop inside jit, as a decode step
does), over a host pool in ``pinned_host`` memory. Rows are opaque bytes of
width W: 656 B is a DeepSeek-V3.2 FP8 latent row (512 e4m3 + 4 fp32 scales +
64 bf16 rope), 1152 B its bf16 row (576 bf16). Each request has a sequence of
D + K + 1 tokens, D resident; its top-k (K = 2048) takes round(f K) positions
that are not resident (misses) and the rest from resident ones (hits).

Reported per point (median of --repeats calls, fresh slot tables each call):
  call_ms          wall time of the call (all layers)
  idle_ms          the same call with every lane idle (dispatch + FFI call overhead)
  book_us          (zero-miss call - idle call) / (B x layers), in microseconds (OUT.json: bookkeeping_us):
                   hit detection, victim choice, LRU update, validation per request-layer
  miss_GBps        bytes of missing rows / (call time - zero-miss call time)
  memcpy_GBps      a bare memcpy loop over exactly the same (host row -> device
                   row) copies between the same two buffers, in the same run
  ratio            miss_GBps / memcpy_GBps ("-" where the copy time is under 10% of
                   the call or under 1 MiB: not measurable above the noise)
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from cli import (
  OUT_HELP,
  check_memory,
  default_out,
  floats_in,
  int_in,
  ints_in,
  out_path,  # benchmarks/
  write_results,
)

from hisparse_jax import _ffi_cpu
from hisparse_jax.kernels import ops

TOP_K = 2048
# Untimed calls first: compilation (and a recompile if an argument's placement changes
# after the first call) must not land in a median of few repeats.
WARMUP = 2


def make_case(B, D, K, W, L, miss_fraction, rng):
  """Host pool, hot buffer and tables for B requests of seq_len D + K + 1 with f*K misses each."""
  S = D + K + 1
  n_miss = int(round(miss_fraction * K))
  slot_tokens = np.empty((L, B, D), np.int32)
  top_k = np.empty((L, B, K), np.int32)
  for l in range(L):
    for b in range(B):
      order = rng.permutation(S - 1).astype(np.int32)  # positions older than the newest
      resident, absent = order[:D], order[D:]
      slot_tokens[l, b] = resident
      top_k[l, b] = np.concatenate(
        [rng.choice(absent, n_miss, replace=False), rng.choice(resident, K - n_miss, replace=False)]
      )
  lru = np.broadcast_to(np.arange(D, dtype=np.int32), (L, B, D)).copy()
  host_rows = (np.arange(B, dtype=np.int32)[:, None] * S + np.arange(S, dtype=np.int32)).astype(np.int32)
  return top_k, slot_tokens, lru, host_rows, S


def time_point(B, D, W, L, miss_fraction, repeats, rng, *, host_pool="jax", platform="cpu", copy_blocks=0):
  """Times the swap-in of one sweep point through one host-pool kind ("jax": a pinned_host array;
  "extension": ops.ExtensionHostPool on `platform`), with ops.swap_in's `copy_blocks` (CUDA only). Used by
  run_point and scripts/gpu_check.py.

  Returns a dict with the idle / zero-miss / full call times (seconds, medians of `repeats` after
  WARMUP untimed calls), the output rows of the full call, the case (top_k, host_rows, H), the bytes
  of missing rows, and the live `pool` / `hot` arrays (and `ext`, the extension pool, or None);
  the caller drops them (and closes `ext`) when done.
  """
  K = TOP_K
  top_k, slot_tokens, lru, host_rows, S = make_case(B, D, K, W, L, miss_fraction, rng)
  H = B * S
  ext, external = None, None
  if host_pool == "jax":
    pool = jax.jit(lambda: jax.device_put(jnp.ones((L, H, W), jnp.uint8), jax.memory.Space.Host))()
  else:
    ext = ops.ExtensionHostPool(L, H, W, np.uint8, platform=platform)
    pool, external = ext.token(), ext.ref
  dev = jax.devices()[0]
  hot = jax.device_put(jnp.zeros((L, B, D + 1, W), jnp.uint8), dev)
  stats = jax.device_put(jnp.zeros((L, B, 2), jnp.int32), dev)
  host_rows_d = jax.device_put(jnp.asarray(host_rows), dev)
  req_ids = jax.device_put(jnp.arange(B, dtype=jnp.int32), dev)
  newest = jax.device_put(jnp.zeros((B, W), jnp.uint8), dev)

  # Page size 1: the page table is the per-position host-row table (the same data layout at any page size).
  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4))
  def step(pool, hot, slots, order, stats, top_k, seq_lens, host_rows):
    rows = []
    for l in range(L):
      r, pool, hot, slots, order, stats, _ = ops.swap_in(
        l,
        top_k[l],
        seq_lens,
        req_ids,
        host_rows,
        newest,
        pool,
        hot,
        slots,
        order,
        stats,
        page_size=1,
        external=external,
        copy_blocks=copy_blocks,
      )
      rows.append(r)
    return jnp.stack(rows), pool, hot, slots, order, stats

  slots0, order0 = jax.device_put((jnp.asarray(slot_tokens), jnp.asarray(lru)), dev)
  fresh = jax.jit(lambda a, b: (a + 0, b + 0))  # new jnp buffers (donation of numpy-born ones is unreliable)

  def timed(tk, seq_len):
    nonlocal pool, hot, stats
    times = []
    tk, sl = jax.device_put((jnp.asarray(tk), jnp.full((B,), seq_len, jnp.int32)), dev)
    for _ in range(repeats + WARMUP):
      slots, order = fresh(slots0, order0)  # fresh state: the same misses every call
      jax.block_until_ready((slots, order))
      t0 = time.perf_counter()
      rows, pool, hot, slots, order, stats = step(pool, hot, slots, order, stats, tk, sl, host_rows_d)
      jax.block_until_ready(hot)
      times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:]), np.asarray(rows)

  # Idle lanes (seq_len 0, all padding): the cost of dispatch and the FFI calls themselves.
  t_idle, _ = timed(np.full_like(top_k, -1), 0)
  # Zero misses: the same shapes, every top-k position resident.
  hits_only = np.take_along_axis(slot_tokens, np.argsort(rng.random(slot_tokens.shape), -1)[..., :K], -1)
  t_book, _ = timed(hits_only, S)
  t_call, rows = timed(top_k, S)
  n_miss = int(round(miss_fraction * K))
  return dict(
    t_idle=t_idle,
    t_book=t_book,
    t_call=t_call,
    rows=rows,
    top_k=top_k,
    host_rows=host_rows,
    H=H,
    n_miss=n_miss,
    miss_bytes=L * B * n_miss * W,
    pool=pool,
    hot=hot,
    ext=ext,
  )


def summarize(B, D, W, L, miss_fraction, t, ref_seconds: float, ref_name: str) -> dict:
  """The reported numbers of one point (see the module docstring), against a reference copy time."""
  copy_s = t["t_call"] - t["t_book"]
  # Below ~10% of the call (or under 1 MiB) the copy time drowns in run-to-run noise: not reported.
  measurable = copy_s > 0.1 * t["t_call"] and t["miss_bytes"] >= 1 << 20
  return dict(
    batch=B,
    buffer=D,
    row_bytes=W,
    layers=L,
    top_k=TOP_K,
    miss_fraction=miss_fraction,
    misses_per_request_layer=t["n_miss"],
    call_ms=t["t_call"] * 1e3,
    idle_ms=t["t_idle"] * 1e3,
    bookkeeping_us=max(t["t_book"] - t["t_idle"], 0) / (B * L) * 1e6,
    miss_GBps=t["miss_bytes"] / copy_s / 1e9 if measurable else None,
    **{ref_name: t["miss_bytes"] / max(ref_seconds, 1e-9) / 1e9},
    ratio=ref_seconds / copy_s if measurable else None,
  )


def run_point(B, D, W, L, miss_fraction, repeats, rng):
  t = time_point(B, D, W, L, miss_fraction, repeats, rng)
  top_k, host_rows, rows, n, H = t["top_k"], t["host_rows"], t["rows"], t["n_miss"], t["H"]
  # Reference: a bare memcpy loop over exactly these rows between the same two buffers.
  src = np.concatenate([l * H + host_rows[b, top_k[l, b, :n]] for l in range(L) for b in range(B)])
  dst = np.concatenate([l * B * (D + 1) + rows[l, b, :n] for l in range(L) for b in range(B)])
  ref = statistics.median(
    _ffi_cpu.copy_rows_seconds(
      t["pool"].unsafe_buffer_pointer(), t["hot"].unsafe_buffer_pointer(), W, src.astype(np.int64), dst.astype(np.int64)
    )
    for _ in range(repeats)
  )
  return summarize(B, D, W, L, miss_fraction, t, ref, "memcpy_GBps")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=ints_in(1, 4096), default=[1, 64, 256])
  ap.add_argument("--buffer", type=ints_in(TOP_K, 1 << 20), default=[2048, 4096], help=f"hot buffer rows (>= {TOP_K})")
  ap.add_argument("--row-bytes", type=ints_in(1, 1 << 20), default=[656, 1152])
  ap.add_argument("--miss", type=floats_in(0.0, 1.0), default=[0.001, 0.05, 0.2, 1.0])
  ap.add_argument("--layers", type=int_in(1, 256), default=2)
  ap.add_argument("--repeats", type=int_in(1, 10000), default=9)
  ap.add_argument(
    "--quick",
    action="store_true",
    help="one small point per axis (CI smoke): replaces --batch, --buffer, --row-bytes, --miss and --repeats",
  )
  ap.add_argument("--out", type=out_path, help=OUT_HELP + "; OUT.json holds every point")
  args = ap.parse_args(argv)
  args.out = args.out or default_out("swap_in", args.quick)
  t0 = time.perf_counter()
  if args.quick:
    args.batch, args.buffer, args.row_bytes, args.miss, args.repeats = [4], [2048], [656], [0.05, 1.0], 2
  # Per request and layer, the host pool (a context of D + K + 1 rows: make_case) and the hot buffer (D + 1 rows).
  rows = max(args.batch) * (2 * max(args.buffer) + TOP_K + 2) * args.layers
  check_memory(
    ap, rows * max(args.row_bytes), "the host pool and hot buffers (--batch x --buffer x --row-bytes x --layers)"
  )
  rng = np.random.default_rng(0)
  print(
    f"# swap-in benchmark: {platform.processor() or platform.machine()}, "
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}, K={TOP_K}, layers/call={args.layers}"
  )
  header = (
    f"{'B':>4} {'D':>5} {'W':>5} {'miss':>6} {'call_ms':>9} {'idle_ms':>8} {'book_us':>8} "
    f"{'miss_GBps':>9} {'memcpy_GBps':>11} {'ratio':>6}"
  )
  print(header)
  results, lines = [], []
  for B in args.batch:
    for D in args.buffer:
      for W in args.row_bytes:
        for f in args.miss:
          r = run_point(B, D, W, args.layers, f, args.repeats, rng)
          results.append(r)
          fmt = lambda v, w: f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"
          lines.append(
            f"{B:>4} {D:>5} {W:>5} {f:>6.3f} {r['call_ms']:>9.3f} {r['idle_ms']:>8.3f} "
            f"{r['bookkeeping_us']:>8.2f} {fmt(r['miss_GBps'], 9)} {r['memcpy_GBps']:>11.2f} "
            f"{fmt(r['ratio'], 6)}"
          )
          print(lines[-1], flush=True)
  write_results(
    args.out, {"points": results, "seconds": time.perf_counter() - t0}, "\n".join(["```", header, *lines, "```"])
  )
  return results


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
