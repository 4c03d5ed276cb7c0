r"""A decode step against its floor, measured in the same run: dense and HiSparse, batch 1 ... 256.

  python benchmarks/step_floor.py [--quick] [--batches 1,8,32,256] [--prompt-len 96] [--steps 40] \
      [--out benchmarks/results/step_floor]

Model: the embedded default model (``hisparse_jax.default_model``), float32, on this machine's JAX backend.
Per batch size B, B requests of ``--prompt-len`` random token ids are admitted and prefilled, then
``--steps`` decode steps of the whole batch are run (greedy, EOS ignored; a device KV budget that fits
every request), the first three untimed. Two times per step: the decode call (the engine's compiled step
from dispatch until its tokens are ready) and the engine step (``Engine.step()``: the scheduler, the step's
tables and the tokens' delivery around the call), the latter twice: without overlap (each step launches its
call and reads its tokens) and overlapped (``overlap_schedule``, the engine's default: each step launches the
next step's call before reading its own tokens, so that the host's work runs while the device computes; timed
over blocks of ``OVERLAP_BLOCK`` consecutive steps, which launch OVERLAP_BLOCK + 1 calls back to back, the last
waited for inside the block: a step is the block's time over its calls). HiSparse runs with the model's own
config (top_k 32, hot buffer 64; its host pool sized to hold every sequence whole) and prompts longer than the
hot buffer, so every step swaps in; "resident" is HiSparse with dynamic residency (resident_fraction 0.5): the budget holds every request's latent KV on
device, so no step swaps in (the run checks: no offload, every step "all" resident).

The floor of a step, from references measured in the same process, interleaved with the steps: each timed
step is one round with one run of each reference and one overlapped block, in an order rotated every round,
so that a shared
machine's drift moves a step and its floor together:
  * compute: the step's FLOPs (XLA's cost analysis of the compiled decode) at the rate a bare jitted GEMM of
    the output projection (float32[B, hidden] times the float32 weight, the step's largest matmul) reaches
    at that batch, the fastest of three forms XLA:CPU runs at different rates: the weight [hidden, vocab]
    or [vocab, hidden] (as the model holds it) with the output [B, vocab], and the weight [vocab, hidden]
    with the output [vocab, B] (the engine's decode layout up to ``VOCAB_MAJOR_MAX_BATCH`` rows on CPU);
  * memory: the bytes of the weights a step reads (every parameter but the input embedding table, of which
    it gathers B rows) at the bandwidth of a bare jitted read of as many bytes (``jnp.sum`` over a float32
    array of that size): every step must stream those weights once.
floor = max(compute, memory), from each round's own references; ratio = the median over rounds of step / floor
(interquartile range in brackets; the goal is <= 1.3). The times in the table are medians. Also reported: the bare GEMM's own
time (its share of the floor), the step's bytes accessed by XLA's count, and transformers' step at the same
batch from ``benchmarks/results/vs_transformers.json`` when that file exists (a 120-token prompt, the oracle
env; ``vs_transformers.py`` measures it).

Writes OUT.json and OUT.md. ``--quick``: batch 2, 6 steps, each mode (CI smoke: runs, sane numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli import OUT_HELP, default_out, int_in, out_path, positive_ints_at_most, write_results  # noqa: E402

SKIP = 3  # first decode steps left out of the median (compilation of the batch bucket, warm caches)
OVERLAP_BLOCK = 4  # consecutive overlapped engine steps per round
MODES = ("dense", "hisparse", "resident")
FP8_SUFFIX = "_fp8"  # a mode with --kv-cache-dtype fp8_e4m3 (dense_fp8, hisparse_fp8, resident_fp8)


def measure(model_dir: str, B: int, mode: str, prompt_len: int, steps: int) -> dict:
  """One engine at batch B: its decode step, its cost analysis, and the two floor references."""
  import jax
  import jax.numpy as jnp
  from hisparse_jax.default_model import DEFAULT_HISPARSE_CONFIG
  from hisparse_jax.engine import Engine, Request
  from hisparse_jax.engine.request import Phase

  # Room for the steps the first requests decode while the last prompts are admitted (HiSparse prefills
  # what its staging pool holds, one max_seq_len prompt's pages: here 2 prompts per step).
  extra = B + 32
  decode_steps = steps + (steps - SKIP) * (OVERLAP_BLOCK + 1)  # each round: one step, one block, one to drain it
  max_seq_len = prompt_len + decode_steps + extra
  # Every request fits the device KV budget and every prompt one prefill chunk: the whole batch decodes.
  kw = dict(
    dtype="float32",
    max_running_requests=B,
    max_seq_len=max_seq_len,
    overlap_schedule=False,
    max_device_kv_bytes=B * max_seq_len * 4096,
    chunked_prefill_size=max(2048, B * prompt_len),
  )
  label = mode
  if mode.endswith(FP8_SUFFIX):  # the FP8 KV cache: rows encoded on append, decoded on every gather
    mode, kw["kv_cache_dtype"] = mode[: -len(FP8_SUFFIX)], "fp8_e4m3"
  if mode != "dense":  # the model's HiSparse sizes, with a host pool that holds every request's whole sequence
    hisparse = dict(DEFAULT_HISPARSE_CONFIG)
    hisparse["host_to_device_ratio"] = max(
      hisparse["host_to_device_ratio"],  # ratio x (D + 1) tokens a slot
      -(-max_seq_len // (hisparse["device_buffer_size"] + 1)),
    )
    if mode == "resident":  # dynamic residency: every request keeps its latent KV on device
      hisparse["resident_fraction"] = 0.5
    kw["hisparse_config"] = json.dumps(hisparse)
  engine = Engine(model_dir, enable_hisparse=(mode != "dense"), **kw)
  cfg = engine.config
  rng = np.random.default_rng(B)
  for i in range(B):
    engine.submit(
      Request(f"r{i}", rng.integers(2, 100000, prompt_len).tolist(), decode_steps + extra - 8, ignore_eos=True)
    )
  reqs = list(engine.waiting)
  while len(engine._decoding()) < B:  # admit and prefill every prompt first
    engine.step()
    if any(r.phase is Phase.FINISHED for r in reqs):
      raise RuntimeError(f"a request finished before all {B} were decoding")
  decode, times, last = engine.runner.decode_fn, [], {}

  def timed(*args, **kwargs):
    t = time.perf_counter()
    out = decode(*args, **kwargs)
    jax.block_until_ready(out[0])
    times.append(time.perf_counter() - t)
    last["call"] = (args, kwargs)
    return out

  engine.runner.decode_fn = timed
  decode_steps0 = engine.decode_steps
  step_times = []

  def engine_step():
    t = time.perf_counter()
    engine.step()
    step_times.append(time.perf_counter() - t)

  overlapped_times = []

  def overlapped_block():
    # The engine's own call (not the timing wrapper, which waits for each call's tokens at its launch).
    engine.runner.decode_fn, engine.overlap_schedule = decode, True
    t = time.perf_counter()
    for _ in range(OVERLAP_BLOCK):
      engine.step()
    jax.block_until_ready(engine._next.out)  # the block's last launched call
    # The block ran OVERLAP_BLOCK + 1 calls back to back (its first step launched two: its own and the next).
    overlapped_times.append((time.perf_counter() - t) / (OVERLAP_BLOCK + 1))
    engine.overlap_schedule = False
    engine.step()  # reads that call, launches nothing (untimed)
    engine.runner.decode_fn = timed

  for _ in range(SKIP):  # the batch bucket's compilation, warm caches: not timed
    engine_step()
  args, kwargs = last["call"]
  cost = decode.lower(*args, **kwargs).compile().cost_analysis() or {}
  flops, step_bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  # The weights a step streams: all but the input embedding table, of which it gathers B rows.
  weight_bytes = sum(x.nbytes for name, x in zip(engine.runner.param_names, args[0]) if "embed_tokens" not in name)
  batch = int(args[1].shape[0])  # the step's batch bucket
  del args, kwargs

  H, V = cfg.hidden_size, cfg.vocab_size
  x = jnp.asarray(rng.standard_normal((batch, H)), jnp.float32)
  w_hv = jnp.asarray(rng.standard_normal((H, V)), jnp.float32)
  w_vh = jnp.asarray(w_hv.T)
  big = jnp.ones((weight_bytes // 4,), jnp.float32)
  # The weight in both layouts ([hidden, vocab], and [vocab, hidden] as the model and checkpoints hold it,
  # row-major) and the output both ways, which XLA:CPU's GEMM runs at different rates; the floor takes the
  # fastest.
  refs = {
    "gemm_hv": (jax.jit(lambda x, w: x @ w), (x, w_hv)),
    "gemm_vh": (jax.jit(lambda x, w: jnp.einsum("bh,vh->bv", x, w)), (x, w_vh)),
    "gemm_vb": (jax.jit(lambda x, w: jnp.einsum("vh,bh->vb", w, x)), (x, w_vh)),
    "read": (jax.jit(jnp.sum), (big,)),
  }
  ref_times = {name: [] for name in refs}
  for fn, fn_args in refs.values():
    jax.block_until_ready(fn(*fn_args))  # compiled before the rounds

  def reference(name):
    fn, fn_args = refs[name]
    t = time.perf_counter()
    jax.block_until_ready(fn(*fn_args))
    ref_times[name].append(time.perf_counter() - t)

  # Rounds of one engine step and one run of each reference, in an order rotated every round, so that the
  # machine's drift (this is a shared VM) moves a step and its floor together.
  order = ["step", "overlapped", *refs]
  for k in range(steps - SKIP):
    for name in order[k % len(order) :] + order[: k % len(order)]:
      engine_step() if name == "step" else overlapped_block() if name == "overlapped" else reference(name)
  if engine.decode_steps - decode_steps0 != decode_steps or len(times) != steps or len(engine._decoding()) != B:
    raise RuntimeError(
      f"{engine.decode_steps - decode_steps0} decode calls ({len(times)} timed) for {decode_steps} "
      f"({steps}), {len(engine._decoding())} of {B} decoding"
    )
  if mode == "resident" and (engine.num_offloads or set(engine.residency_steps) != {"all"}):
    raise RuntimeError(f"resident mode: {engine.num_offloads} offloads, steps by residency {engine.residency_steps}")
  for i in range(B):
    engine.abort(f"r{i}")
  engine.close()
  del engine, last, big, w_hv, w_vh, refs

  ms = lambda v: 1e3 * np.asarray(v)  # noqa: E731
  call, eng, over = ms(times[SKIP:]), ms(step_times[SKIP:]), ms(overlapped_times)
  hv, vh, vb = ms(ref_times["gemm_hv"]), ms(ref_times["gemm_vh"]), ms(ref_times["gemm_vb"])
  read = ms(ref_times["read"])
  gemm_flops = 2.0 * batch * H * V
  # Each round's floor from that round's references: the step's FLOPs at the fastest GEMM's rate, or the
  # weights' bytes at the bare read's bandwidth.
  round_floor = np.maximum(flops / (gemm_flops / np.minimum(np.minimum(hv, vh), vb)), read)
  quartiles = lambda v: [float(q) for q in np.percentile(v, [25, 75])]  # noqa: E731
  gemm_hv_ms, gemm_vh_ms, gemm_vb_ms = float(np.median(hv)), float(np.median(vh)), float(np.median(vb))
  read_ms = float(np.median(read))
  gemm_ms = min(gemm_hv_ms, gemm_vh_ms, gemm_vb_ms)
  compute_ms = flops / (gemm_flops / gemm_ms)
  memory_ms = read_ms  # the weights' bytes at the bare read's bandwidth
  return dict(
    batch=B,
    bucket=batch,
    mode=label,
    step_ms=float(np.median(call)),
    engine_step_ms=float(np.median(eng)),
    steps_timed=len(call),
    flops=flops,
    step_bytes=step_bytes,
    weight_bytes=weight_bytes,
    gemm_ms=gemm_ms,
    gemm_hv_ms=gemm_hv_ms,
    gemm_vh_ms=gemm_vh_ms,
    gemm_vb_ms=gemm_vb_ms,
    gemm_gflops_per_s=gemm_flops / gemm_ms / 1e6,
    read_gb_per_s=weight_bytes / read_ms / 1e6,
    compute_floor_ms=compute_ms,
    memory_floor_ms=memory_ms,
    floor_ms=max(compute_ms, memory_ms),
    ratio=float(np.median(call / round_floor)),
    ratio_iqr=quartiles(call / round_floor),
    engine_ratio=float(np.median(eng / round_floor)),
    engine_ratio_iqr=quartiles(eng / round_floor),
    overlapped_step_ms=float(np.median(over)),
    overlapped_ratio=float(np.median(over / round_floor)),
    overlapped_ratio_iqr=quartiles(over / round_floor),
    overlap_speedup=float(np.median(eng / over)),
    bound="compute" if compute_ms >= memory_ms else "memory",
  )


def _ratio(row: dict, key: str) -> str:
  lo, hi = row[f"{key}_iqr"]
  return f"{row[key]:.2f}x ({lo:.2f}-{hi:.2f})"


def transformers_steps(path: str) -> dict[int, float]:
  """batch -> transformers' ms per decode step from a vs_transformers.py result, if there is one."""
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return {}
  rows = data.get("rows") if isinstance(data, dict) else None
  return {
    int(b): float(r["transformers_step_ms"])
    for b, r in (rows or {}).items()
    if isinstance(r, dict) and "transformers_step_ms" in r
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", type=positive_ints_at_most(1024), default=[1, 8, 32, 256], help="batch sizes (requests)")
  ap.add_argument(
    "--prompt-len",
    type=int_in(1, 2**20),
    default=96,
    help="tokens per prompt (the default 96 exceeds the default model's hot buffer of 64, so HiSparse "
    "swaps in every step)",
  )
  ap.add_argument(
    "--steps", type=int_in(SKIP + 1, 10**6), default=40, help=f"decode steps per request (the first {SKIP} untimed)"
  )
  ap.add_argument(
    "--modes",
    default="dense,hisparse,resident",
    help="dense, hisparse (every step swaps in), resident (HiSparse with dynamic residency: "
    "resident_fraction 0.5, no swap-in while the KV fits); each with the suffix _fp8: with "
    "--kv-cache-dtype fp8_e4m3 (FP8 latent rows and indexer keys)",
  )
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--quick", action="store_true")
  if ap.parse_known_args(argv)[0].quick:  # small sizes as defaults: flags given explicitly still win
    ap.set_defaults(batches=[2], steps=6)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("step_floor", args.quick)
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  known = MODES + tuple(m + FP8_SUFFIX for m in MODES)
  if not modes or any(m not in known for m in modes):
    print(f"error: --modes: choose from {','.join(known)}, got {args.modes!r}", file=sys.stderr)
    return 2
  from hisparse_jax.default_model import ensure_default_model

  model_dir = ensure_default_model()
  t0 = time.perf_counter()
  from hisparse_jax.engine.args import StartupError

  try:
    rows = [measure(model_dir, B, mode, args.prompt_len, args.steps) for B in args.batches for mode in modes]
  except StartupError as e:  # a size the engine refuses (e.g. a prompt past the model's context)
    print(f"error: --prompt-len {args.prompt_len} / --steps {args.steps}: {e}", file=sys.stderr)
    return 2
  theirs = transformers_steps(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vs_transformers.json")
  )
  import jax

  lines = [
    f"Default model, float32, {jax.default_backend()}, {os.cpu_count()} cores; prompts of "
    f"{args.prompt_len} tokens, {args.steps} decode steps, the first {SKIP} untimed; each timed step one round "
    f"with the floor's references and a block of {OVERLAP_BLOCK} overlapped steps. Ratios: median over rounds of step / that round's floor (IQR).",
    "",
    "| batch | mode | decode call ms | engine step ms: no overlap / overlapped | floor ms (bound) | call / floor "
    "| engine step / floor: no overlap | overlapped | GFLOP / step | bare GEMM ms (GFLOP/s) "
    "| GEMM ms: w [H,V] / w [V,H] / out [V,B] | weight read GB/s | transformers step ms |",
    "|---" * 13 + "|",
  ]
  for r in rows:
    hf = theirs.get(r["batch"])
    lines.append(
      f"| {r['batch']} | {r['mode']} | {r['step_ms']:.2f} | {r['engine_step_ms']:.2f} / "
      f"{r['overlapped_step_ms']:.2f} | {r['floor_ms']:.2f} ({r['bound']}) | {_ratio(r, 'ratio')} | "
      f"{_ratio(r, 'engine_ratio')} | {_ratio(r, 'overlapped_ratio')} | {r['flops'] / 1e9:.3f} | {r['gemm_ms']:.2f} ({r['gemm_gflops_per_s']:.0f}) | "
      f"{r['gemm_hv_ms']:.2f} / {r['gemm_vh_ms']:.2f} / {r['gemm_vb_ms']:.2f} | {r['read_gb_per_s']:.1f} | {'' if hf is None else f'{hf:.2f}'} |"
    )
  write_results(
    args.out,
    {"args": vars(args), "rows": rows, "transformers_step_ms": theirs, "seconds": time.perf_counter() - t0},
    "\n".join(lines),
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
