r"""Long prompts on the embedded default model: prefill time and memory vs prompt length, inter-token latency
of running streams while a long prompt is admitted, and the decode step of one request.

  python benchmarks/long_context.py [--quick] [--sections prefill,itl,bucket] \
      [--out benchmarks/results/long_context]

Model: the embedded default model (``hisparse_jax.default_model``: DeepSeek-V3.2 architecture, bfloat16,
163840-token YaRN context, index_topk 32) with its HiSparse sizes (top_k 32, hot buffer 64).

Sections:
  prefill  One request of P prompt tokens + 32 new tokens, P = 4k ... 64k, each in a fresh process (so the
           peak resident memory is that run's), HiSparse and (up to 16k, to keep `make bench` short) dense. The engine's pools are sized to that one
           request (--max-device-kv-bytes, HiSparse host ratio), so resident memory holds the weights, pools
           that grow with P, and the prefill's transient tensors (a chunk of 2048 queries at a time). Reports
           prefill seconds, decode seconds, peak RSS, and the KV bytes per token the pools hold.
  itl      8 streams decode (prompts of 1100 tokens) while a 32k-token prompt is admitted; the streams'
           inter-token latency (p50 / p99 from the long prompt's arrival to its first token) for
           chunked prefill (--itl-chunks; default 16, the size that keeps p99 within 3x here; 64 and 2048
           are in BENCHMARKS.md from `--itl-chunks 2048,64,16`) and one-shot prefill (one chunk of the prompt),
           next to the same streams without the long prompt, and the long prompt's time to first token.
           HiSparse mode, float32 (the CPU's fast path; bfloat16 steps take ~2x as long here).
  bucket   One running request: the decode step with the batch sized to the running requests (batch bucket 1)
           vs the fixed-shape (--deterministic) engine at 8 and 256 rows, i.e. the engine before batch buckets.
           float32: XLA's CPU bfloat16 matmul is slower at one row than at two (the default model's output
           projection: 48 ms at batch 1, 33 ms at 2 and 8; float32: 4.3 / 7.9 / 9.5 ms), which would hide the
           effect measured here.

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
from cli import OUT_HELP, default_out, int_in, out_path, positive_ints, sections, write_results  # noqa: E402

NEW = 32
PAGE = 64
SECTIONS = ("prefill", "itl", "bucket")


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _prompt(n: int, seed: int = 0) -> list[int]:
  return np.random.default_rng(seed).integers(2, 100_000, n).tolist()


# ------------------------------------------------------------------------------------------ prefill
def prefill_child(mode: str, prompt: int) -> dict:
  """In a fresh process: one request of `prompt` + NEW tokens on pools sized for it."""
  from hisparse_jax.config import HiSparseConfig
  from hisparse_jax.default_model import DEFAULT_HISPARSE_CONFIG, ensure_default_model
  from hisparse_jax.engine import Engine, Request
  from hisparse_jax.memory import backend as kvmem
  from models.config import DSAConfig

  d = ensure_default_model()
  cfg = DSAConfig.from_pretrained(d)
  layout = kvmem.KVLayout.of(cfg, cfg.dtype)
  tokens = prompt + NEW
  pages = math.ceil(tokens / PAGE)
  hisparse = None
  if mode == "dense":
    budget = pages * PAGE * (layout.latent_bytes + layout.index_bytes)
  else:
    D = DEFAULT_HISPARSE_CONFIG["device_buffer_size"]
    hisparse = HiSparseConfig(
      top_k=DEFAULT_HISPARSE_CONFIG["top_k"],
      device_buffer_size=D,
      host_to_device_ratio=math.ceil(pages * PAGE / (D + 1)),
    )
    budget = pages * PAGE * (layout.latent_bytes + layout.index_bytes) + layout.hot_buffer_bytes(D)
  t0 = time.perf_counter()
  eng = Engine(d, hisparse=hisparse, max_running_requests=1, max_seq_len=pages * PAGE, max_device_kv_bytes=budget)
  warm = Request("warm", _prompt(100, 1), 2)  # compiles the decode step and a small prefill bucket
  eng.submit(warm)
  eng.run()
  eng.prefill_seconds = eng.decode_seconds = 0.0
  build_s = time.perf_counter() - t0
  rss_before = _rss_mb()
  req = Request("long", _prompt(prompt), NEW, ignore_eos=True)
  eng.submit(req)
  eng.run()
  assert len(req.output_ids) == NEW
  pools = eng.loads()["pools"]
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  per_token = {p["name"]: p["bytes_per_page"] / p["page_size"] for p in pools if p["name"] != "hot"}
  return dict(
    mode=mode,
    prompt=prompt,
    prefill_s=eng.prefill_seconds,
    decode_s=eng.decode_seconds,
    prefill_calls=eng.prefill_calls,
    build_s=build_s,
    rss_before_mb=rss_before,
    peak_rss_mb=peak,
    budget_bytes=budget,
    kv_bytes_per_token=per_token,
    hits=req.hits,
    misses=req.misses,
  )


def run_prefill(prompts: list[int], modes, dense_max: int) -> list[dict]:
  rows = []
  for mode in modes:
    for n in prompts:
      if mode == "dense" and n > dense_max:
        continue
      out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", f"prefill:{mode}:{n}"],
        capture_output=True,
        text=True,
        timeout=3600,
      )
      if out.returncode != 0:
        raise RuntimeError(f"prefill child {mode} {n} failed:\n{out.stderr[-3000:]}")
      rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
      r = rows[-1]
      print(f"prefill {mode} {n}: {r['prefill_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
  return rows


# ---------------------------------------------------------------------------------------------- itl
_COMPILES = [0]  # XLA compilations in this process (run_itl: none may fall in a measured window)


def _count_compile(event: str, _secs: float, **_kw) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


def run_itl(
  long_prompt: int,
  chunks: list[int],
  streams: int = 8,
  stream_prompt: int = 1100,
  warm_steps: int = 20,
  baseline_steps: int = 60,
) -> list[dict]:
  """ITL of `streams` running requests while one `long_prompt` prompt is prefilled, per chunk size (0: one
  shot), and without the long prompt (the baseline), from the long prompt's arrival to the streams' first
  token after its prefill. No compilation is timed: each variant first runs the same scenario once with other
  prompts of the same lengths (compiling its prefill chunks, and the decode batch buckets and indexer windows
  of the streams alone and with the long request), and the measured streams decode `warm_steps` steps before
  the long prompt arrives. The baseline measures `baseline_steps` steps. Each row counts the XLA compilations
  in its measured window (``compiles``: 0 unless the warm-up missed a shape)."""
  import jax
  from hisparse_jax.default_model import DEFAULT_HISPARSE_CONFIG, ensure_default_model
  from hisparse_jax.engine import Engine, Request

  d = ensure_default_model()
  jax.monitoring.register_event_duration_secs_listener(_count_compile)
  new = long_prompt // min(c for c in chunks if c) + 2 * warm_steps + 16  # (no stream ends while measured)
  D = DEFAULT_HISPARSE_CONFIG["device_buffer_size"]
  tokens = 2 * long_prompt + streams * (stream_prompt + new)  # host rows for everything at once
  hisparse = dict(DEFAULT_HISPARSE_CONFIG, host_to_device_ratio=math.ceil(tokens / ((streams + 1) * (D + 1))))
  rows = []
  for chunk in [None] + chunks:  # None: no long prompt (the baseline); 0: one shot
    size = 2048 if chunk is None else chunk or long_prompt
    eng = Engine(
      d,
      dtype="float32",
      enable_hisparse=True,
      hisparse_config=json.dumps(hisparse),
      max_running_requests=streams + 1,
      max_seq_len=max(long_prompt, stream_prompt + new) + 64,
      chunked_prefill_size=size,
      page_size=math.gcd(PAGE, size),
    )
    if chunk is not None:  # the scenario once, untimed: every shape it uses compiles here
      warm = [Request(f"warm-s{i}", _prompt(stream_prompt, 10 * i + 1), new, ignore_eos=True) for i in range(streams)]
      for r in warm:
        eng.submit(r)
      while any(len(r.output_ids) < 2 for r in warm):  # the streams decoding together
        eng.step()
      warm.append(Request("warm-long", _prompt(long_prompt - 32, 98), 3, ignore_eos=True))
      eng.submit(warm[-1])
      while len(warm[-1].output_ids) < 2:  # the long request decoded once with the streams
        eng.step()
      for r in warm:
        eng.abort(r.request_id)
    stamps = {i: [] for i in range(streams)}
    reqs = []
    for i in range(streams):
      r = Request(f"s{i}", _prompt(stream_prompt, 10 * i), new, ignore_eos=True)
      r.on_token = lambda _t, _x, i=i: stamps[i].append(time.monotonic())
      reqs.append(r)
      eng.submit(r)
    while any(len(r.output_ids) < warm_steps for r in reqs):  # all running, decode compiled
      eng.step()
    t_submit, compiles = time.monotonic(), _COMPILES[0]
    ttft = None
    if chunk is not None:
      long = Request("long", _prompt(long_prompt - 32, 99), 4, ignore_eos=True)
      eng.submit(long)
      while not long.output_ids:
        eng.step()
      ttft = long.first_token_time - long.arrival
      eng.step()  # the streams' token of the step that ended the prefill, and one step with the long request
      t_end = time.monotonic()
    else:
      for _ in range(baseline_steps):
        eng.step()
      t_end = time.monotonic()
    gaps = []
    for i in range(streams):
      ts = np.array(stamps[i])
      sel = ts[(ts > t_submit) & (ts <= t_end)]
      prev = ts[ts <= t_submit][-1:]
      gaps += np.diff(np.concatenate([prev, sel])).tolist()
    gaps = np.array(gaps)
    rows.append(
      dict(
        chunk=chunk,
        streams=streams,
        long_prompt=long_prompt if chunk is not None else 0,
        ttft_s=ttft,
        itl_p50_ms=1e3 * float(np.percentile(gaps, 50)),
        itl_p99_ms=1e3 * float(np.percentile(gaps, 99)),
        itl_max_ms=1e3 * float(gaps.max()),
        samples=len(gaps),
        compiles=_COMPILES[0] - compiles,
      )
    )
    print(f"itl chunk {chunk}: {rows[-1]}", flush=True)
  return rows


# ------------------------------------------------------------------------------------------- bucket
def run_bucket(prompt: int, steps: int, fixed=(8, 256), modes=("dense", "hisparse")) -> list[dict]:
  from hisparse_jax.default_model import ensure_default_model
  from hisparse_jax.engine import Engine, Request

  d = ensure_default_model()
  rows = []
  engines = [("bucket", dict(max_running_requests=max(fixed)))] + [
    (f"fixed {n}", dict(max_running_requests=n, deterministic=True)) for n in fixed
  ]
  for label, kw in engines:
    for mode in modes:
      eng = Engine(d, dtype="float32", enable_hisparse=mode == "hisparse", max_seq_len=4096, **kw)
      times = []
      for rep in range(3):
        eng.decode_seconds, eng.decode_steps = 0.0, 0
        eng.submit(Request(f"b{rep}", _prompt(prompt, rep), steps + 1, ignore_eos=True))
        eng.run()
        times.append(eng.decode_seconds / eng.decode_steps)
      rows.append(dict(engine=label, mode=mode, batch=eng.last_decode_batch, step_ms=1e3 * float(np.median(times[1:]))))
      print(f"bucket {label} {mode}: {rows[-1]}", flush=True)
  return rows


# --------------------------------------------------------------------------------------------- main
def _markdown(res: dict) -> str:
  lines = []
  if res.get("prefill"):
    lines += [
      "One request of P prompt + 32 new tokens, pools sized to it (fresh process each):",
      "",
      "| mode | prompt tokens | prefill s | prefill ms / token | decode s (32 tokens, incl. a compile) | "
      "peak RSS MB | RSS before MB | peak RSS growth / token since the previous row | KV bytes / token "
      "(pools) |",
      "|---" * 9 + "|",
    ]
    prev = {}
    for r in res["prefill"]:
      kv = ", ".join(f"{k} {v:.0f}" for k, v in r["kv_bytes_per_token"].items())
      p = prev.get(r["mode"])
      growth = (
        "" if p is None else f"{(r['peak_rss_mb'] - p['peak_rss_mb']) * 2**20 / (r['prompt'] - p['prompt']):.0f} B"
      )
      prev[r["mode"]] = r
      lines.append(
        f"| {r['mode']} | {r['prompt']} | {r['prefill_s']:.1f} | {1e3 * r['prefill_s'] / r['prompt']:.2f} | "
        f"{r['decode_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['rss_before_mb']:.0f} | {growth} | {kv} |"
      )
    lines.append("")
  if res.get("itl"):
    lines += [
      f"{res['itl'][0]['streams']} running streams while a {res['itl'][1]['long_prompt']}-token prompt is admitted (HiSparse):",
      "",
      "| long prompt prefill | ITL p50 ms | ITL p99 ms | ITL max ms | p99 / no long prompt | long prompt TTFT s |",
      "|---|---|---|---|---|---|",
    ]
    base = res["itl"][0]["itl_p99_ms"]
    for r in res["itl"]:
      name = "none (baseline)" if r["chunk"] is None else "one shot" if r["chunk"] == 0 else f"chunks of {r['chunk']}"
      ttft = "" if r["ttft_s"] is None else f"{r['ttft_s']:.1f}"
      lines.append(
        f"| {name} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['itl_max_ms']:.0f} | "
        f"{r['itl_p99_ms'] / base:.1f}x | {ttft} |"
      )
    lines.append("")
  if res.get("bucket"):
    lines += [
      "One running request (prompt 1000 tokens): decode step",
      "",
      "| engine | mode | batch rows | step ms |",
      "|---|---|---|---|",
    ]
    lines += [f"| {r['engine']} | {r['mode']} | {r['batch']} | {r['step_ms']:.2f} |" for r in res["bucket"]]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
  ap.add_argument("--sections", default=",".join(SECTIONS), type=sections(SECTIONS))
  ap.add_argument("--prompts", default="4096,8192,16384,32768,65536", type=positive_ints)
  ap.add_argument(
    "--dense-max-prompt",
    default=16384,
    type=int_in(0, 2**31 - 1),
    help="dense runs stop at this prompt length, in tokens (the 64k run is HiSparse's; 0: none)",
  )
  ap.add_argument(
    "--itl-prompt",
    default=32768,
    type=int_in(64, 2**31 - 1),
    help="the long prompt admitted while the streams decode, in tokens (>= 64)",
  )
  ap.add_argument("--itl-chunks", default="16", type=positive_ints)
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("long_context", args.quick)
  if args.child:
    kind, mode, n = args.child.split(":")
    print(json.dumps(prefill_child(mode, int(n))))
    return 0
  if args.quick:
    args.prompts, args.itl_prompt, args.itl_chunks = [512], 1024, [256]  # one child process per mode
  t0 = time.perf_counter()
  res = {}
  if "prefill" in args.sections:
    res["prefill"] = run_prefill(args.prompts, ("hisparse", "dense"), args.dense_max_prompt)
  if "itl" in args.sections:
    # --quick: 2 streams of 300 tokens, few steps (the scenario's shape, not its load).
    quick = {"streams": 2, "stream_prompt": 300, "warm_steps": 4, "baseline_steps": 8}
    res["itl"] = run_itl(args.itl_prompt, args.itl_chunks + [0], **(quick if args.quick else {}))
  if "bucket" in args.sections:
    res["bucket"] = run_bucket(100, 4, fixed=(8, 32), modes=("dense",)) if args.quick else run_bucket(1000, 16)
  res["seconds"] = time.perf_counter() - t0
  write_results(args.out, res, _markdown(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
