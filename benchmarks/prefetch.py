r"""Cross-layer prefetch: a decode step with misses against the same step with all hits, with and without it.

  python benchmarks/prefetch.py [--quick] [--batches 1,8,64] [--context 6144] [--layers 4] [--steps 12] \
      [--heads 2] [--mlp 1024,2048] [--depth 2048] [--host-pool jax|extension] [--out benchmarks/results/prefetch]

The real-size kernel configuration: top_k 2048, device_buffer_size 4096, latent rows of W = 576 bfloat16
(DeepSeek-V3.2's 512 + 64), a ``--context``-token prompt per request (> D: every step is on the slow path)
in a ``pinned_host`` pool (``--host-pool extension``: the extension's own pinned memory, the GPU path where XLA
refuses a ``pinned_host`` operand to a custom call; see scripts/gpu_check.py). The access pattern is the calibrated DeepSeek-V3.2 indexer trace
(``calibrated_trace.py``: consecutive steps share 35-50% of their top-k on deep layers, adjacent layers 70-100%),
two seeds alternating over the batch's requests.

One jitted decode-like step per mode, ``--layers`` layers each: backup of the newest row, swap-in, gather of the
K rows, then the layer's compute on them: the absorbed MLA attention of ``--heads`` heads over the K latent
rows (scores, softmax, values) and a dense MLP of ``--mlp`` H -> F -> H (default 1024 -> 2048 -> 1024) on the batch
(a stand-in for the MoE; H is also the residual width). The default layer is light, so that copies are a visible
share of the step; ``--heads 128 --mlp 7168,49152`` reads about as many weight bytes per layer as one GPU's share
of a DeepSeek-V3.2 layer under 8-way expert parallelism (256 experts x 3 x 7168 x 2048 FP8 bytes / 8 = 1.41 GB;
here 2 x 7168 x 49152 bf16 = 1.41 GB, plus 1.06 GB of the 128 heads' query weights), which is what a step's
compute costs at these batches on a GPU: weight reads.
The next layer's input depends on this layer's output. Three states, stepped in a rotated order each step:
  hits        the trace's first top-k repeated every step: after the first step every row is resident (no copy);
  misses      the trace as it is, no prefetch;
  prefetch    the trace, with ``prefetch`` "next_layer" (layer l's top-k starts layer l+1's swap-in while layer
              l computes; the copies run on the extension's copy threads); --depth: how many of layer l's top-k (its
              top-scored) are prefetched.
Reported per batch: median step time of each mode after ``SKIP`` warm-up steps; misses / hits and prefetch / hits,
each the median (and interquartile range) over steps of the step's own ratio (the goal of issue 14 section 3:
prefetch / hits <= 1.05), the share of the miss cost the prefetch hides, (misses - prefetch) / (misses - hits)
from those medians (None when the miss cost is under MIN_MISS_COST of the step), and the rows copied per step (by the real swap-ins and by the prefetch).
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibrated_trace import TraceModel, calibrated_trace  # noqa: E402
from cli import OUT_HELP, default_out, int_in, out_path, positive_ints_at_most, write_results  # noqa: E402

TOP_K, D, W = 2048, 4096, 576
SKIP = 3
MODES = ("hits", "misses", "prefetch")
MLP = (1024, 2048)  # default --mlp: hidden, intermediate
MIN_MISS_COST = 0.02  # misses / hits - 1 below which the hidden share is not reported (None)


def traces(context: int, steps: int, layers: int, seeds=(0, 1)) -> np.ndarray:
  """int32[seeds, steps, layers, TOP_K] calibrated top-k positions (step t at seq_len context + t + 1), each
  layer's in descending score order, as the model's indexer returns them."""
  model = TraceModel(layers=layers)
  out = []
  for s in seeds:
    steps_ = []
    for tk, sc in calibrated_trace(context, steps, TOP_K, model, seed=s):
      steps_.append(np.stack([t[np.argsort(-sc[l][t], kind="stable")] for l, t in enumerate(tk)]))
    out.append(np.stack(steps_))
  return np.stack(out).astype(np.int32)


def build(
  B: int,
  context: int,
  layers: int,
  heads: int,
  steps: int,
  depth: int = TOP_K,
  host_pool: str = "jax",
  mlp: tuple[int, int] = MLP,
):
  """(step functions by mode, initial states by mode, per-step inputs by mode, the step's weights and tables,
  x0, the extension pools).

  host_pool "jax": each mode's pool is a ``pinned_host`` JAX array; "extension": an ops.ExtensionHostPool
  (the state holds its ordering token), which the caller closes when done."""
  import jax
  import jax.numpy as jnp

  from hisparse_jax.kernels import ops

  dt = jnp.bfloat16
  L, S = layers, context + steps + 1
  key = jax.random.key(0)
  k_pool, k_q, k_w1, k_w2, k_x = jax.random.split(key, 5)

  exts = {}

  def fresh_state(mode):
    # As after a prefill of the first D positions: slot s holds token s.
    slot_rows = jnp.arange(B)[:, None] * S + jnp.arange(D + 1)[None]
    if host_pool == "extension":
      full = jax.random.normal(k_pool, (L, B * S, W), dt)
      exts[mode] = ext = ops.ExtensionHostPool(L, B * S, W, dt)
      ext.write(np.asarray(full))
      pool, hot = ext.token(), jax.jit(lambda p, r: p[:, r])(full, slot_rows)
      del full
    else:
      pool = jax.jit(lambda: jax.device_put(jax.random.normal(k_pool, (L, B * S, W), dt), jax.memory.Space.Host))()
      hot = jax.jit(lambda p, r: jax.device_put(p, jax.memory.Space.Device)[:, r])(pool, slot_rows)
    slots = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (L, B, D))
    return dict(pool=pool, hot=hot, slot_tokens=slots + 0, lru=slots + 1 - 1, stats=jnp.zeros((L, B, 2), jnp.int32))

  H, F = mlp

  def weight(k, shape, fan_in):  # drawn in bf16 (the largest, 7168 x 73728, is 1 GiB; 2 GiB in float32)
    return jax.jit(lambda: jax.random.normal(k, shape, dt) * jnp.asarray(fan_in**-0.5, dt))()

  # Arguments of the step, not constants it closes over: XLA would embed them in the program (the real-size
  # layer's 2.5 GB of weights), and JAX's persistent compilation cache would hash and store them.
  consts = dict(
    wq=weight(k_q, (H, heads * W), H),
    w1=weight(k_w1, (H, F), H),
    w2=weight(k_w2, (F, H), F),
    wkv=weight(k_x, (H, W), H),
    req_ids=jnp.arange(B, dtype=jnp.int32),
    host_pages=jnp.asarray(np.arange(B)[:, None] * S + np.arange(S)[None], jnp.int32),
  )

  def layer_compute(c, x, rows):
    """x [B, H], rows [B, K, W] -> x: absorbed MLA attention of `heads` heads over the rows, then the MLP."""
    q = (x @ c["wq"]).reshape(B, heads, W)
    s = jnp.einsum("bhw,bkw->bhk", q, rows, preferred_element_type=jnp.float32) * W**-0.5
    p = jax.nn.softmax(s, axis=-1).astype(dt)
    o = jnp.einsum("bhk,bkw->bhw", p, rows).mean(1)  # [B, W]
    h = x + jnp.pad(o, ((0, 0), (0, H - W)))
    return h + jax.nn.gelu(h @ c["w1"]) @ c["w2"]

  def step(prefetch, mode, state, c, x, top_k, seq_lens):
    ext = exts[mode].ref if mode in exts else None
    host_pages, req_ids = c["host_pages"], c["req_ids"]
    pool, hot, slots, lru, stats = (state[k] for k in ("pool", "hot", "slot_tokens", "lru", "stats"))
    started, ticket = [], None
    dst = host_pages[:, 0] + seq_lens - 1  # host row of each newest token
    for l in range(L):
      newest = (x @ c["wkv"]).astype(dt)
      pool, _ = ops.backup(l, newest[None], dst, pool, external=ext)
      if prefetch and l:
        hot, slots, lru, n = ops.prefetch_wait(ticket, hot, slots, lru, newest, batch=B)
        started.append(n)
      rows, pool, hot, slots, lru, stats, _ = ops.swap_in(
        l, top_k[l], seq_lens, req_ids, host_pages, newest, pool, hot, slots, lru, stats, page_size=1, external=ext
      )
      out = hot[l].reshape(B * (D + 1), W)[rows]
      if prefetch and l + 1 < L:
        pool, ticket = ops.prefetch_start(
          l + 1, top_k[l][:, :depth], seq_lens, req_ids, host_pages, pool, hot, slots, lru, page_size=1, external=ext
        )
        out, ticket = jax.lax.optimization_barrier((out, ticket))
      x = layer_compute(c, x, out)
    fetched = jnp.stack(started).sum() if started else jnp.zeros((), jnp.int32)
    return dict(pool=pool, hot=hot, slot_tokens=slots, lru=lru, stats=stats), x, fetched

  states = {m: fresh_state(m) for m in MODES}
  fns = {m: jax.jit(functools.partial(step, m == "prefetch", m), donate_argnums=(0,)) for m in MODES}
  tr = traces(context, steps, L)  # [2, steps, L, K]
  per_req = tr[np.arange(B) % tr.shape[0]]  # [B, steps, L, K]
  inputs = {}
  for m in MODES:
    src = per_req[:, :1].repeat(steps, 1) if m == "hits" else per_req
    inputs[m] = [jnp.asarray(src[:, t].transpose(1, 0, 2)) for t in range(steps)]  # [L, B, K] per step
  x0 = jax.random.normal(k_x, (B, H), jnp.float32).astype(dt)
  return fns, states, inputs, consts, x0, exts


def mlp_widths(text: str) -> tuple[int, int]:
  """argparse type: "7168,49152" -> (7168, 49152), the MLP's hidden and intermediate widths (in that order)."""
  try:
    h, f = (int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected two comma-separated integers H,F, got {text!r}") from None
  if h <= 0 or f <= 0:
    raise argparse.ArgumentTypeError(f"expected positive widths, got {text!r}")
  return h, f


def measure(
  B: int,
  context: int,
  layers: int,
  heads: int,
  steps: int,
  depth: int = TOP_K,
  host_pool: str = "jax",
  mlp: tuple[int, int] = MLP,
) -> dict:
  import jax
  import jax.numpy as jnp

  fns, states, inputs, consts, x0, exts = build(B, context, layers, heads, steps, depth, host_pool, mlp)
  times = {m: [] for m in MODES}
  fetched = {m: 0 for m in MODES}
  misses = {m: [] for m in MODES}
  for t in range(steps):
    seq_lens = jnp.full((B,), context + t + 1, jnp.int32)
    order = MODES[t % 3 :] + MODES[: t % 3]
    for m in order:
      before = np.asarray(states[m]["stats"])[..., 1].sum()
      t0 = time.perf_counter()
      states[m], x, n = fns[m](states[m], consts, x0, inputs[m][t], seq_lens)
      jax.block_until_ready((states[m], x))
      times[m].append(time.perf_counter() - t0)
      if t >= SKIP:
        misses[m].append(int(np.asarray(states[m]["stats"])[..., 1].sum() - before))
        fetched[m] += int(n)
  row = {"batch": B, "steps": steps - SKIP}
  for m in MODES:
    row[f"{m}_ms"] = 1e3 * float(np.median(times[m][SKIP:]))
    row[f"{m}_copied_per_step"] = float(np.mean(misses[m]))
  row["prefetched_per_step"] = fetched["prefetch"] / (steps - SKIP)
  hits = np.array(times["hits"][SKIP:])
  for m in ("misses", "prefetch"):  # per-step ratios: the three modes of a step run back to back
    ratio = np.array(times[m][SKIP:]) / hits
    row[f"{m}_over_hits"] = float(np.median(ratio))
    row[f"{m}_over_hits_iqr"] = [float(np.percentile(ratio, 25)), float(np.percentile(ratio, 75))]
  cost = row["misses_over_hits"] - 1
  # A miss cost inside the run-to-run noise gives no share worth reporting (a few % of a tiny cost).
  row["hidden_share"] = (row["misses_over_hits"] - row["prefetch_over_hits"]) / cost if cost >= MIN_MISS_COST else None
  del states, fns
  for ext in exts.values():
    ext.close()
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", type=positive_ints_at_most(256), default=[1, 8, 64], help="concurrent requests")
  ap.add_argument(
    "--context", type=int_in(D + 1, 2**24), default=6144, help=f"prompt tokens per request (> the hot buffer's {D})"
  )
  ap.add_argument("--layers", type=int_in(2, 256), default=4)
  ap.add_argument("--steps", type=int_in(SKIP + 1, 10**6), default=12, help=f"decode steps (the first {SKIP} untimed)")
  ap.add_argument("--heads", type=int_in(1, 1024), default=2)
  ap.add_argument(
    "--mlp",
    type=mlp_widths,
    default=MLP,
    help=f"the MLP's hidden (>= {W}, also the residual width) and intermediate widths: H,F",
  )
  ap.add_argument(
    "--depth", type=int_in(1, TOP_K), default=TOP_K, help="positions prefetched: the top-scored of each top-k"
  )
  ap.add_argument(
    "--host-pool",
    choices=("jax", "extension"),
    default="jax",
    help="the pool: a pinned_host JAX array, or the extension's own pinned memory (ops.ExtensionHostPool)",
  )
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--quick", action="store_true")
  if ap.parse_known_args(argv)[0].quick:
    ap.set_defaults(batches=[1, 4], steps=6, layers=3)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("prefetch", args.quick)
  if args.mlp[0] < W:
    ap.error(f"--mlp H,F: H must be >= {W}, got {args.mlp[0]}")
  from hisparse_jax.kernels import ops

  t0 = time.perf_counter()
  rows = [
    measure(B, args.context, args.layers, args.heads, args.steps, args.depth, args.host_pool, args.mlp)
    for B in args.batches
  ]
  lines = [
    f"top_k {TOP_K}, D {D}, W {W} bf16, {args.host_pool} host pool, {args.context}-token prompts, "
    f"{args.layers} layers of {args.heads} heads and an MLP {args.mlp[0]} -> {args.mlp[1]}, prefetch depth "
    f"{args.depth}, calibrated "
    f"DeepSeek-V3.2 trace; {os.cpu_count()} cores, {ops.prefetch_threads()} copy thread(s); median of "
    f"{args.steps - SKIP} steps after {SKIP}; the ratios are medians of each step's own ratio to the hits step "
    "of its round, so they need not equal the ratio of the median times.",
    "",
    "| batch | hits ms | misses ms | prefetch ms | misses / hits (IQR) | prefetch / hits (IQR) | miss cost hidden "
    "| rows copied / step (no prefetch) | by swap-in / by prefetch (prefetch) |",
    "|---" * 9 + "|",
  ]
  for r in rows:
    mi, pi = r["misses_over_hits_iqr"], r["prefetch_over_hits_iqr"]
    lines.append(
      f"| {r['batch']} | {r['hits_ms']:.1f} | {r['misses_ms']:.1f} | {r['prefetch_ms']:.1f} | "
      f"{r['misses_over_hits']:.3f} ({mi[0]:.2f}-{mi[1]:.2f}) | {r['prefetch_over_hits']:.3f} "
      f"({pi[0]:.2f}-{pi[1]:.2f}) | "
      f"{'–' if r['hidden_share'] is None else format(100 * r['hidden_share'], '.0f') + '%'} | "
      f"{r['misses_copied_per_step']:.0f} | {r['prefetch_copied_per_step']:.0f} / "
      f"{r['prefetched_per_step']:.0f} |"
    )
  write_results(
    args.out,
    {"args": vars(args), "prefetch_threads": ops.prefetch_threads(), "rows": rows, "seconds": time.perf_counter() - t0},
    "\n".join(lines),
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
