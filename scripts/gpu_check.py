r"""One prepared run on a lent GPU: which host-pool path works, CUDA == reference, timings.

  python scripts/gpu_check.py [--out gpu_check.json] [--quick] [--platform gpu|cpu] [--cases N] [--budget 300]

Run by scripts/gpu_check.sh after it has built the extension with CUDA. Needs
only jax and numpy (the lent image has no flax / orbax / network). Steps:

  1. Host-pool paths, each probed in its own subprocess (a bad path may crash):
     "pinned_host": the pool is a JAX array in pinned_host memory passed to the
     CUDA handler as an operand; "extension": ops.ExtensionHostPool (cudaHostAlloc,
     mapped) named by attributes. A path works if the worked example gives the
     reference's rows, slot table, LRU and hot-buffer contents.
  2. Correctness: the worked example, random cases (reference.random_case;
     four of them at K 2048 / D 4096 and K 300 / D 600) and an empty batch
     through every working path, each with the swap-in's copy_blocks 0, 1 and 3
     (the miss copy by a second kernel, by the planning block, unevenly split),
     compared with reference.swap_in bit for bit (statuses included);
     plus bad input (a position >= seq_len) that must come back as that row's
     status with nothing changed; and the cross-layer prefetch (prefetch_start +
     prefetch_wait, side stream + events) of each case's top-k with some entries
     moved, compared with reference.prefetch.
  3. Graph capture: a decode-like step (per layer: backup of the newest rows,
     swap-in, a gather of the top-k rows and a matmul on them; 8 layers, B 32,
     K 2048, D 4096, 32k context) timed with XLA's command buffers off and with
     fusions and custom calls captured (the handlers declare themselves
     command-buffer compatible), each in its own process (XLA_FLAGS), on the
     first working path; with top-k positions uniform over the context (~87%
     misses) and drawn from the resident tokens (all hits: launch-bound).
  4. Cross-layer prefetch: benchmarks/prefetch.py (top_k 2048, D 4096, W 576
     bf16, the calibrated trace; B 1, 8, 64): the step with misses / all hits,
     without and with the prefetch, and the share of the miss cost hidden (its
     --host-pool the first working path); with its default light layer, then
     with a layer that reads one GPU's share of a DeepSeek-V3.2 layer's weight
     bytes (--heads 128 --mlp 7168,49152: 2.5 GB per layer), the compute a
     prefetch has to hide the copies behind.
  5. Timing: first B 1, 8, 64 at D 4096, W 656 B and 20% / 100% misses with
     copy_blocks 1 and then 0 (the planning block's copy against the handler's
     choice, in the same run); then the benchmarks/swap_in.py sweep (B in {1, 64, 256}, K 2048,
     D in {4096, 2048}, W in {656, 1152} B, miss fraction in {0.001, 0.05, 0.2,
     1.0}, 2 layers per call; the real-size points first) on the first working
     path, next to the measured pinned host -> device bandwidth of the same
     number of bytes, until --budget seconds from the start.
  6. End to end: hisparse_jax.generate on the embedded default model, dense and
     with HiSparse (the demo's configuration, so rows really miss; --host-pool
     auto, what a user gets), with the default and the FP8 KV cache
     (--kv-cache-dtype fp8_e4m3): the greedy tokens of each pair must agree.

PASS needs a working host-pool path, every correctness case, both graph-step
modes of each kind, both prefetch benchmarks and the end-to-end check.

Writes one JSON (rewritten after each step, so a run stopped by its time limit
still leaves what it measured) and prints a summary. ``--platform cpu`` runs
the same script on the CPU handlers (a dry run for CI).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

PATHS = ("pinned_host", "extension")
HOST_POOL_FLAG = {"pinned_host": "jax", "extension": "extension"}  # --host-pool of each path


def _non_negative(kind):
  """argparse type: a finite number >= 0 of `kind` (int or float)."""

  def parse(text):
    value = kind(text)
    if not (value >= 0 and value != float("inf")):
      raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value

  return parse


def _jax(platform):
  if platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  return jax


def _run_path(path, case, jax, platform, page_size, copy_blocks=0):
  """Runs ops.swap_in on `case` through host-pool path `path` (with `copy_blocks`); returns numpy results."""
  import jax.numpy as jnp
  from hisparse_jax.kernels import ops

  layer, top_k, seq_lens, req_ids, host_pages, newest, pool, hot, slot_tokens, lru, stats = case
  dev = jax.devices()[0]
  put = lambda x: jax.device_put(jnp.asarray(x), dev)
  args = [put(top_k), put(seq_lens), put(req_ids), put(host_pages), put(newest)]
  state = [put(hot), put(slot_tokens), put(lru), put(stats)]
  donate = (6, 7, 8, 9, 10)
  if path == "pinned_host":
    host = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host))(put(pool))
    fn = jax.jit(functools.partial(ops.swap_in, page_size=page_size, copy_blocks=copy_blocks), donate_argnums=donate)
    return [np.asarray(x) for x in fn(layer, *args, host, *state)]
  ext = ops.ExtensionHostPool(*pool.shape, pool.dtype, platform="gpu" if platform == "gpu" else "cpu")
  ext.write(pool)
  fn = jax.jit(
    functools.partial(ops.swap_in, page_size=page_size, external=ext.ref, copy_blocks=copy_blocks),
    donate_argnums=donate,
  )
  out = [np.asarray(x) for x in fn(layer, *args, ext.token(), *state)]
  out[1] = ext.read()
  ext.close()
  return out


def _run_prefetch(path, case, jax, platform, page_size):
  """ops.prefetch_start + prefetch_wait of `case`'s top_k (a swap-in case) through `path`: numpy (hot,
  slot_tokens, lru, prefetched)."""
  import jax.numpy as jnp
  from hisparse_jax.kernels import ops

  layer, top_k, seq_lens, req_ids, host_pages, _, pool, hot, slot_tokens, lru, _ = case
  dev = jax.devices()[0]
  put = lambda x: jax.device_put(jnp.asarray(x), dev)
  ext = None
  if path == "pinned_host":
    host = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Host))(put(pool))
  else:
    ext = ops.ExtensionHostPool(*pool.shape, pool.dtype, platform="gpu" if platform == "gpu" else "cpu")
    ext.write(pool)
    host = ext.token()

  def run(host, hot, slots, order, top_k, seq_lens, req_ids, host_pages):
    host, ticket = ops.prefetch_start(
      layer,
      top_k,
      seq_lens,
      req_ids,
      host_pages,
      host,
      hot,
      slots,
      order,
      page_size=page_size,
      external=ext and ext.ref,
    )
    return ops.prefetch_wait(ticket, hot, slots, order, top_k, batch=top_k.shape[0])

  out = jax.jit(run, donate_argnums=(0, 1, 2, 3))(
    host, put(hot), put(slot_tokens), put(lru), put(top_k), put(seq_lens), put(req_ids), put(host_pages)
  )
  out = [np.asarray(x) for x in out]
  if ext is not None:
    ext.close()
  return out


def _guess(case, rng):
  """case with about a third of its top-k entries moved to other valid positions (a prediction)."""
  case = list(case)
  top_k, seq_lens = case[1].copy(), case[2]
  for b in range(len(seq_lens)):
    if seq_lens[b]:
      move = rng.random(top_k.shape[1]) < 0.35
      top_k[b, move] = rng.integers(-1, int(seq_lens[b]), int(move.sum()))
  case[1] = top_k
  return case


def _compare(got, want) -> str | None:
  for name, g, w in zip(("rows", "pool", "hot", "slot_tokens", "lru", "stats", "status"), got, want):
    if not np.array_equal(g, w):
      return f"{name} differs"
  return None


def probe(path, platform) -> dict:
  """Worked example through one path (run in a subprocess by the parent)."""
  jax = _jax(platform)
  from hisparse_jax.kernels import reference
  from hisparse_jax.kernels.reference import WORKED_EXAMPLE_PAGE_SIZE as page, worked_example

  case = worked_example()
  got = _run_path(path, case, jax, platform, page)
  err = _compare(got, reference.swap_in(*case, page_size=page))
  return {"path": path, "ok": err is None, "error": err, "device": str(jax.devices()[0])}


def correctness(paths, platform, n_random) -> dict:
  jax = _jax(platform)
  from hisparse_jax.kernels import reference
  from hisparse_jax.kernels.reference import WORKED_EXAMPLE_PAGE_SIZE, worked_example

  rng = np.random.default_rng(0)
  report = {}
  for path in paths:
    failures = []
    cases = [(worked_example(), WORKED_EXAMPLE_PAGE_SIZE)]
    for _ in range(n_random):
      page, B = int(rng.choice([1, 4, 64])), int(rng.integers(1, 9))
      cases.append(
        (
          reference.random_case(
            rng,
            L=2,
            B=B,
            R=B + int(rng.integers(0, 3)),
            D=int(rng.integers(4, 64)),
            K=4,
            S=int(rng.integers(1, 200)),
            W=int(rng.choice([1, 3, 8, 288])),
            page_size=page,
          ),
          page,
        )
      )
    # real sizes (K 2048, D 4096) and one between: the plan's block-wide passes over many chunks of threads
    for kw in (dict(D=4096, K=2048, S=12000, W=16, page_size=64), dict(D=600, K=300, S=2000, W=8, page_size=1)) * 2:
      cases.append((reference.random_case(rng, L=2, B=4, R=5, **kw), kw["page_size"]))
    empty = worked_example()  # an empty batch: nothing to do, no launch
    for i in (1, 2, 3, 4, 5):  # top_k, seq_lens, req_ids, host_pages, newest
      empty[i] = empty[i][:0]
    cases.append((empty, WORKED_EXAMPLE_PAGE_SIZE))
    for i, (case, page) in enumerate(cases):
      want = reference.swap_in(*case, page_size=page)
      # The miss copy by a second kernel (copy_blocks 0: the batch here is below the multiprocessor count;
      # 3: an uneven share per block) and by the planning block itself (1).
      for copy_blocks in (0, 1, 3):
        err = _compare(_run_path(path, case, jax, platform, page, copy_blocks), want)
        if err:
          failures.append({"case": i, "copy_blocks": copy_blocks, "error": err})
      guess = _guess(case, rng)
      got = _run_prefetch(path, guess, jax, platform, page)
      want = reference.prefetch(*guess[:5], *guess[6:10], page_size=page)
      for name, g, w in zip(("hot", "slot_tokens", "lru", "prefetched"), got, want):
        if not np.array_equal(g, w):
          failures.append({"case": i, "error": f"prefetch: {name} differs"})
          break
    bad = worked_example()
    bad[1][0, 0] = 16  # position >= seq_len: the row's status, nothing changed, no host synchronization
    try:
      got = _run_path(path, bad, jax, platform, WORKED_EXAMPLE_PAGE_SIZE)
      error_ok = (
        int(got[6][0]) == reference.POSITION_OUT_OF_RANGE
        and (got[0] == -1).all()
        and all(np.array_equal(g, w) for g, w in zip(got[2:6], bad[7:11]))
      )
    except Exception as e:  # noqa: BLE001
      print(f"  bad input raised instead of a status: {e}")
      error_ok = False
    report[path] = {"cases": len(cases), "failures": failures, "bad_input_is_error": error_ok}
  return report


def h2d_gbps(jax, nbytes, repeats=5) -> float:
  """Pinned host -> device bandwidth for nbytes (jax.device_put of a pinned_host array)."""
  import jax.numpy as jnp

  nbytes = max(int(nbytes), 1 << 16)
  host = jax.jit(lambda: jax.device_put(jnp.ones((nbytes,), jnp.uint8), jax.memory.Space.Host))()
  dev = jax.devices()[0]
  times = []
  for _ in range(repeats + 1):
    t0 = time.perf_counter()
    jax.block_until_ready(jax.device_put(host, jax.memory.Space.Device))
    times.append(time.perf_counter() - t0)
  del dev
  return nbytes / statistics.median(times[1:]) / 1e9


def sweep(path, platform, quick, deadline=float("inf")) -> list[dict]:
  """benchmarks/swap_in.py's timing on `path`, next to the pinned H2D bandwidth of the same bytes; first the
  miss copy by the planning block alone (copy_blocks 1) against the handler's choice (0) at the real size
  (D 4096, W 656) and batches below the multiprocessor count, then the sweep at copy_blocks 0 (its real-size
  points first); no new point after `deadline` (time.time())."""
  jax = _jax(platform)
  from swap_in import summarize, time_point

  rng = np.random.default_rng(0)
  if quick:
    grid = [(4, 2048, 656, 1.0, 1)] + [(4, 2048, 656, f, 0) for f in (0.05, 1.0)]
  else:
    grid = [(B, 4096, 656, f, c) for B in (1, 8, 64) for f in (0.2, 1.0) for c in (1, 0)]
    grid += [
      p
      for p in (
        (B, D, W, f, 0)
        for W in (656, 1152)
        for D in (4096, 2048)
        for B in (1, 64, 256)
        for f in (0.001, 0.05, 0.2, 1.0)
      )
      if p not in grid
    ]
  L, repeats = 2, 3 if quick else 7
  results = []
  for B, D, W, f, copy_blocks in grid:
    if time.time() > deadline:
      print(f"  stopped at the time budget after {len(results)} of {len(grid)} points", flush=True)
      break
    t = time_point(
      B, D, W, L, f, repeats, rng, host_pool=HOST_POOL_FLAG[path], platform=platform, copy_blocks=copy_blocks
    )
    ext = t.pop("ext")
    t.pop("pool"), t.pop("hot")
    if ext is not None:
      ext.close()
    bw = h2d_gbps(jax, t["miss_bytes"])
    r = {**summarize(B, D, W, L, f, t, t["miss_bytes"] / (bw * 1e9), "h2d_GBps"), "copy_blocks": copy_blocks}
    results.append(r)
    fmt = lambda v: f"{v:7.2f}" if v is not None else f"{'-':>7}"
    print(
      f"  B={B:>3} D={D} W={W:>4} miss={f:<5} copy_blocks={copy_blocks} call {r['call_ms']:8.3f} ms  book {r['bookkeeping_us']:7.2f} us"
      f"  miss {fmt(r['miss_GBps'])} GB/s  h2d {bw:7.2f} GB/s  ratio {fmt(r['ratio'])}",
      flush=True,
    )
  return results


def generate_check(path, platform, out_dir, env, new_tokens=16) -> dict:
  """hisparse_jax.generate on the embedded default model, dense and with HiSparse (--host-pool auto; the demo's
  configuration: top_k 32, 64 hot slots, so the prompts miss), with the default KV cache and with the FP8 one
  (--kv-cache-dtype fp8_e4m3: uint8 rows through the kernels): the greedy tokens of each pair must agree.
  `path` (the first working host-pool path) is recorded with the result."""
  outputs, result = {}, {"path": path}
  # --host-pool auto: what a user gets on this platform (on a GPU the extension's pool; see EngineArgs)
  fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
  for mode, extra in (
    ("dense", []),
    ("hisparse", ["--enable-hisparse", "--host-pool", "auto"]),
    ("dense_fp8", fp8),
    ("hisparse_fp8", ["--enable-hisparse", "--host-pool", "auto", *fp8]),
  ):
    outputs[mode] = os.path.join(out_dir, f"generate_{mode}.jsonl")
    cmd = [
      sys.executable,
      "-m",
      "hisparse_jax.generate",
      "--prompts",
      os.path.join(REPO, "examples", "prompts.jsonl"),
      "--max-new-tokens",
      str(new_tokens),
      "--output",
      outputs[mode],
      *extra,
    ]
    t0 = time.time()
    try:
      r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
        env={**env, **({"JAX_PLATFORMS": "cpu"} if platform == "cpu" else {})},
      )
    except subprocess.TimeoutExpired:
      return {**result, "error": f"{mode}: timed out"}
    result[f"{mode}_seconds"] = round(time.time() - t0, 1)
    if r.returncode != 0:
      return {**result, "error": f"{mode}: exit {r.returncode}: {r.stderr.strip()[-800:]}"}
  lines = {m: [json.loads(x) for x in open(f)] for m, f in outputs.items()}
  ok = True
  for kv in ("", "_fp8"):
    dense, hisparse = lines["dense" + kv], lines["hisparse" + kv]
    result["same_tokens" + kv] = [a["output_ids"] == b["output_ids"] for a, b in zip(dense, hisparse)]
    result["misses" + kv] = [b["misses"] for b in hisparse]
    ok = ok and len(dense) == len(hisparse) > 0 and all(result["same_tokens" + kv])
  result["ok"] = ok
  return result


# XLA_FLAGS of the two graph-step modes (flags must be set before JAX starts: one process each).
GRAPH_MODES = {
  "eager": "--xla_gpu_enable_command_buffer=",
  "graph": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
}
GRAPH_MODES.update({m + "_hits": f for m, f in list(GRAPH_MODES.items())})  # the all-hits step (graph_step hits)


def graph_step(platform, quick, path="pinned_host", hits=False) -> dict:
  """One decode-like step per call, timed (in the process XLA_FLAGS configured): ms per step, median.
  The pool through host-pool path `path` (PATHS). Top-k positions uniform over the context (~87% misses:
  the copies dominate), or with `hits` drawn from the resident tokens (no copy: launches and bookkeeping)."""
  jax = _jax(platform)
  import jax.numpy as jnp
  from hisparse_jax.kernels import ops

  L, B, K, D, S, W = (2, 4, 64, 128, 1024, 64) if quick else (8, 32, 2048, 4096, 32768, 656)
  rng = np.random.default_rng(0)
  R, H = B + 1, B * S
  dev = jax.devices()[0]
  ext = external = None
  if path == "extension":
    ext = ops.ExtensionHostPool(L, H, W, np.uint8, platform=platform)
    pool, external = ext.token(), ext.ref
  else:
    pool = jax.jit(lambda: jax.device_put(jnp.ones((L, H, W), jnp.uint8), jax.memory.Space.Host))()
  slot_tokens = np.stack([np.stack([rng.permutation(S - 1)[:D] for _ in range(R)]) for _ in range(L)])
  lru = np.stack([np.stack([rng.permutation(D) for _ in range(R)]) for _ in range(L)])
  state = [
    jax.device_put(jnp.asarray(x), dev)
    for x in (
      np.zeros((L, R, D + 1, W), np.uint8),
      slot_tokens.astype(np.int32),
      lru.astype(np.int32),
      np.zeros((L, R, 2), np.int32),
    )
  ]
  host_pages = jnp.asarray(np.arange(B * S, dtype=np.int32).reshape(B, S))  # page size 1
  req_ids = jnp.arange(B, dtype=jnp.int32)
  seq_lens = jnp.full((B,), S, jnp.int32)
  weight = jnp.ones((W, 256), jnp.bfloat16)

  # host_pages (4 MiB at the real size) is an argument: a constant the step closed over would be embedded in it.
  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3, 4))
  def step(pool, hot, slots, order, stats, top_k, newest, host_pages):
    status = jnp.zeros((B,), jnp.int32)
    acc = jnp.zeros((B, 256), jnp.float32)
    for l in range(L):
      pool, st = ops.backup(l, newest[None], host_pages[:, -1], pool, external=external)
      rows, pool, hot, slots, order, stats, st2 = ops.swap_in(
        l,
        top_k[l],
        seq_lens,
        req_ids,
        host_pages,
        newest,
        pool,
        hot,
        slots,
        order,
        stats,
        page_size=1,
        external=external,
      )
      status = jnp.maximum(status, jnp.maximum(st, st2))
      kv = hot[l].reshape(-1, W)[jnp.maximum(rows, 0)].astype(jnp.bfloat16)  # [B, K, W]
      acc = acc + jnp.einsum("bkw,wn->bn", kv, weight, preferred_element_type=jnp.float32)
      newest = newest + acc[:, :1].astype(jnp.uint8)  # the next layer depends on this one
    return pool, hot, slots, order, stats, acc, status

  steps = 5 if quick else 30
  if hits:  # K of each request-layer's resident tokens: every position a hit, the slot tables unchanged
    top_ks = [
      jnp.asarray(np.take_along_axis(slot_tokens[:, :B], np.argsort(rng.random((L, B, D)), -1)[..., :K], -1), jnp.int32)
      for _ in range(steps + 3)
    ]
  else:
    top_ks = [jnp.asarray(rng.integers(0, S - 1, (L, B, K)), jnp.int32) for _ in range(steps + 3)]
  newest = jnp.zeros((B, W), jnp.uint8)
  times = []
  for tk in top_ks:
    t0 = time.perf_counter()
    *state_out, acc, status = step(pool, *state, tk, newest, host_pages)
    jax.block_until_ready(acc)
    times.append(time.perf_counter() - t0)
    pool, state = state_out[0], state_out[1:]
    ops.check_status(status, "graph step")
  if ext is not None:
    del pool, state
    ext.close()
  return {
    "ms_per_step": statistics.median(times[3:]) * 1e3,
    "steps": steps,
    "path": path,
    "hits": hits,
    "shape": dict(L=L, B=B, K=K, D=D, S=S, W=W),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or os.path.join(REPO, "out"), "gpu_check.json"))
  ap.add_argument("--quick", action="store_true", help="a few points only (dry runs)")
  ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
  ap.add_argument(
    "--cases", type=_non_negative(int), help="random correctness cases per path (default: 16, 10 with --quick)"
  )
  ap.add_argument(
    "--budget",
    type=_non_negative(float),
    default=300,
    help="seconds from the start after which the sweep (the last step) stops adding points",
  )
  ap.add_argument("--probe", choices=PATHS, help=argparse.SUPPRESS)
  ap.add_argument("--graph-step", choices=PATHS, help=argparse.SUPPRESS)
  ap.add_argument("--hits", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.probe:
    print(json.dumps(probe(args.probe, args.platform)))
    return 0
  if args.graph_step:
    print(json.dumps(graph_step(args.platform, args.quick, args.graph_step, args.hits)))
    return 0

  start = time.time()
  report = {"platform": args.platform, "probes": {}, "section_seconds": {}}

  def save(section, t0):
    """Writes what has been measured so far (a run cut short by its time limit still leaves its JSON)."""
    report["section_seconds"][section] = round(time.time() - t0, 1)
    report["seconds"] = time.time() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)

  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
  t0 = time.time()
  print("== 1. host-pool paths", flush=True)
  for path in PATHS:
    try:
      r = subprocess.run(
        [sys.executable, __file__, "--probe", path, "--platform", args.platform],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
      )
      line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
      res = (
        json.loads(line)
        if line.startswith("{")
        else {"path": path, "ok": False, "error": f"exit {r.returncode}: {r.stderr.strip()[-800:]}"}
      )
    except subprocess.TimeoutExpired:
      res = {"path": path, "ok": False, "error": "timed out"}
    report["probes"][path] = res
    print(f"  {path:12s} {'works' if res['ok'] else 'FAILS: ' + str(res['error'])}", flush=True)
  working = [p for p in PATHS if report["probes"][p]["ok"]]
  report["working_paths"] = working
  report["chosen_path"] = working[0] if working else None
  save("probes", t0)
  if working:
    t0 = time.time()
    print(f"== 2. {'CUDA' if args.platform == 'gpu' else 'CPU'} handler vs reference", flush=True)
    cases = args.cases if args.cases is not None else 10 if args.quick else 16
    report["correctness"] = correctness(working, args.platform, cases)
    for path, c in report["correctness"].items():
      print(
        f"  {path:12s} {c['cases']} cases, {len(c['failures'])} failures, bad input is an error: "
        f"{c['bad_input_is_error']}",
        flush=True,
      )
    save("correctness", t0)
    t0 = time.time()
    print("== 3. decode-like step, command buffers (CUDA graphs) off / on", flush=True)
    report["graph_step"] = {}
    for mode, flags in GRAPH_MODES.items():
      genv = {**env, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
      cmd = [sys.executable, __file__, "--graph-step", working[0], "--platform", args.platform] + (
        ["--quick"] if args.quick else []
      )
      cmd += ["--hits"] if mode.endswith("_hits") else []
      try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=genv)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        res = json.loads(line) if line.startswith("{") else {"error": f"exit {r.returncode}: {r.stderr.strip()[-800:]}"}
      except subprocess.TimeoutExpired:
        res = {"error": "timed out"}
      report["graph_step"][mode] = res
      print(
        f"  {mode:6s} " + (f"{res['ms_per_step']:.3f} ms per step" if "ms_per_step" in res else res["error"]),
        flush=True,
      )
    g = report["graph_step"]
    for suffix in ("", "_hits"):
      if all("ms_per_step" in g[m + suffix] for m in ("eager", "graph")):
        g["graph_over_eager" + suffix] = g["graph" + suffix]["ms_per_step"] / g["eager" + suffix]["ms_per_step"]
        print(f"  graph / eager{suffix}: {g['graph_over_eager' + suffix]:.3f}", flush=True)
    save("graph_step", t0)
    # The light layer (copies a visible share of the step), then a layer that reads one GPU's share of a real
    # DeepSeek-V3.2 layer's weight bytes (the compute a prefetch can hide copies behind; benchmarks/prefetch.py).
    real_layer = ["--heads", "4", "--mlp", "2048,4096"] if args.quick else ["--heads", "128", "--mlp", "7168,49152"]
    for section, extra in (("prefetch", []), ("prefetch_real_layer", real_layer)):
      t0 = time.time()
      print(f"== 4. cross-layer prefetch ({' '.join(['benchmarks/prefetch.py', *extra])})", flush=True)
      out = os.path.join(os.path.dirname(os.path.abspath(args.out)), section)
      cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "prefetch.py"),
        "--out",
        out,
        "--host-pool",
        HOST_POOL_FLAG[working[0]],
        *extra,
      ]
      cmd += ["--quick"] if args.quick else ["--batches", "1,8,64", "--steps", "12"]
      try:
        r = subprocess.run(
          cmd,
          capture_output=True,
          text=True,
          timeout=300,
          env={**env, **({"JAX_PLATFORMS": "cpu"} if args.platform == "cpu" else {})},
        )
        report[section] = (
          json.load(open(out + ".json"))["rows"]
          if r.returncode == 0
          else {"error": f"exit {r.returncode}: {r.stderr.strip()[-800:]}"}
        )
        print(r.stdout.strip()[-1500:] if r.returncode == 0 else "  " + report[section]["error"], flush=True)
      except subprocess.TimeoutExpired:
        report[section] = {"error": "timed out"}
        print("  timed out", flush=True)
      save(section, t0)
    t0 = time.time()
    print(f"== 5. timing sweep on the {working[0]} path (until {args.budget:.0f} s)", flush=True)
    report["sweep"] = sweep(working[0], args.platform, args.quick, deadline=start + args.budget)
    save("sweep", t0)
    t0 = time.time()
    print("== 6. end to end: greedy decoding of examples/prompts.jsonl, dense vs HiSparse, both KV caches", flush=True)
    report["generate"] = generate_check(
      working[0], args.platform, os.path.dirname(os.path.abspath(args.out)), env, 4 if args.quick else 16
    )
    print("  " + json.dumps(report["generate"])[:1500], flush=True)
    save("generate", t0)
  save("total", start)
  failed = [] if working else ["no host-pool path works"]
  if working:
    failed += [
      f"correctness on {p}" for p, c in report["correctness"].items() if c["failures"] or not c["bad_input_is_error"]
    ]
    failed += [f"graph step {m}" for m in GRAPH_MODES if "ms_per_step" not in report["graph_step"][m]]
    failed += [f"{s} benchmark" for s in ("prefetch", "prefetch_real_layer") if not isinstance(report[s], list)]
    failed += ["end-to-end generate"] if not report["generate"].get("ok") else []
  ok = not failed
  if working and not report["sweep"]:
    print("  (the sweep measured no point within --budget)")
  print(f"== {'PASS' if ok else 'FAIL: ' + ', '.join(failed)} in {report['seconds']:.0f} s; results in {args.out}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
