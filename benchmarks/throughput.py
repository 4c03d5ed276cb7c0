r"""Throughput of dense vs HiSparse decoding under one fixed device KV budget.

  python benchmarks/throughput.py [--quick] [--sections concurrency,grpc,context,overhead] \
      [--out benchmarks/results/throughput]

Model: ``bench_models.serving_model()`` (DeepSeek-V3.2 architecture, float32, latent row 8.25x its
indexer key as in the real model) with ``bench_models.SERVING_HISPARSE``: top_k 32, hot buffer
D = 64, the HiSparse configuration (2048 / 4096) scaled by 1/64, so a context of 512 tokens stands
for 32k; host ratio 16 so the host pool never caps admission.

Device KV budget: 4 x the device KV bytes of one dense request of the concurrency sweep's full
context (prompt 480 + 32 new tokens), i.e. the dense baseline fits only 4 such requests. A request's
device bytes are ``Engine.device_kv_bytes``: dense holds its whole latent KV and indexer keys;
HiSparse holds its hot buffer ((D+1) rows) and the indexer keys. Each mode gets an engine with
``min(concurrency, requests that fit the budget)`` decode lanes (as SGLang captures one CUDA graph per
batch size), the budget enforced by the engine's admission (``--max-device-kv-bytes``).

Sections (each point: a warmed-up engine, so no compilation is timed; every request generates
exactly its max_new_tokens, ``ignore_eos``):

  concurrency  C = 1 ... 256 requests submitted at once to the engine (closed batch); tokens/s =
               new tokens / wall time (prefill included), decode tokens/s = tokens of decode steps /
               time in decode steps, admitted = most requests running at once, TTFT = first token
               time - submit time.
  grpc         the same through the gRPC server (in this process) with a load generator in a
               subprocess on loopback (grpc.aio, C concurrent streaming Generate calls).
  context      contexts 128 ... 1024 tokens (8k ... 64k at scale) at concurrency 32, same budget.
  overhead     one lane: mean decode step time, HiSparse / dense, prompts below (D/2) and above
               (4 D, 16 D) the hot buffer size.

Writes OUT.json (all numbers), OUT.md (tables) and OUT.png (tokens/s vs concurrency and vs context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from miss_rate import positive_ints  # noqa: E402  (argparse type shared by the benchmark scripts)

MODES = ("dense", "hisparse")
PROMPT, NEW = 480, 32  # the concurrency sweep's request: context 512 = 8 x D
DENSE_FITS = 4
MAX_ENGINES = 12


class Bench:
  """Engines of both modes on one model and budget, built once per lane count and warmed up."""

  def __init__(self, hisparse: dict):
    import bench_models
    from hisparse_jax.config import HiSparseConfig
    self.model_dir = bench_models.serving_model()
    self.hisparse = HiSparseConfig(**hisparse)
    self._engines = {}
    self.budget = None
    self.budget = DENSE_FITS * self.engine("dense", 1, PROMPT + NEW).device_kv_bytes(self.request(PROMPT, NEW))
    self._engines.clear()  # that probe engine had no budget

  def request(self, prompt_len: int, new: int, rid: str = "r", seed: int = 0):
    from hisparse_jax.engine import Request
    ids = np.random.default_rng(seed).integers(2, 100_000, prompt_len).tolist()
    return Request(rid, ids, new, ignore_eos=True)

  def fits(self, mode: str, prompt_len: int, new: int) -> int:
    """How many requests of this size the budget admits in this mode."""
    # device_kv_bytes depends on the request, not on the engine's lanes or max_seq_len.
    need = self.engine(mode, 1, PROMPT + NEW).device_kv_bytes(self.request(prompt_len, new))
    return self.budget // need

  def engine(self, mode: str, lanes: int, max_seq_len: int):
    """The engine of this mode with `lanes` decode lanes sized for `max_seq_len`-token requests (every
    decode step scores max_seq_len indexer positions: fixed shapes), built on first use."""
    from hisparse_jax.engine import Engine
    key = (mode, lanes, max_seq_len)
    if key not in self._engines:
      if len(self._engines) >= MAX_ENGINES:  # each holds its own copy of the weights (~0.3 GB)
        self._engines.pop(next(iter(self._engines)))
      self._engines[key] = Engine(self.model_dir, hisparse=self.hisparse if mode == "hisparse" else None,
                                  max_running_requests=lanes, max_seq_len=max_seq_len,
                                  max_device_kv_bytes=self.budget)
    return self._engines[key]

  def warm(self, engine, prompt_len: int, new: int) -> None:
    """Compiles the prefill bucket and the decode step (one request), then zeroes the counters."""
    engine.submit(self.request(prompt_len, min(new, 2), "warm"))
    engine.run()
    engine.prefill_seconds = engine.decode_seconds = 0.0
    engine.decode_steps = 0


def _summary(wall, ttft, tokens, peak, engine) -> dict:
  decode_tokens = tokens - len(ttft)  # the first token of each request comes from prefill
  return dict(wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall, admitted=peak,
              ttft_mean_ms=1e3 * float(np.mean(ttft)), ttft_p90_ms=1e3 * float(np.percentile(ttft, 90)),
              prefill_s=engine.prefill_seconds, decode_s=engine.decode_seconds, decode_steps=engine.decode_steps,
              decode_tokens_per_s=decode_tokens / max(engine.decode_seconds, 1e-9),
              step_ms=1e3 * engine.decode_seconds / max(engine.decode_steps, 1))


def run_engine_point(bench: Bench, mode: str, concurrency: int, prompt_len: int, new: int) -> dict:
  """C requests submitted at once straight to the engine; returns the point's numbers."""
  lanes = max(1, min(concurrency, bench.fits(mode, prompt_len, new)))
  engine = bench.engine(mode, lanes, prompt_len + new)
  bench.warm(engine, prompt_len, new)
  first = {}
  reqs = []
  for i in range(concurrency):
    req = bench.request(prompt_len, new, f"{mode}-{i}", seed=i + 1)
    req.on_token = lambda _t, i=i: first.setdefault(i, time.perf_counter())
    reqs.append(req)
  t0 = time.perf_counter()
  for req in reqs:
    engine.submit(req)
  peak = 0
  while engine.has_work():
    engine.step()
    peak = max(peak, len(engine.running))
  wall = time.perf_counter() - t0
  assert all(len(r.output_ids) == new for r in reqs), "a request ended early"
  ttft = [first[i] - t0 for i in range(concurrency)]
  return dict(mode=mode, concurrency=concurrency, lanes=lanes, context=prompt_len + new,
              **_summary(wall, ttft, concurrency * new, peak, engine))


def run_grpc_point(bench: Bench, mode: str, concurrency: int, prompt_len: int, new: int) -> dict:
  """C concurrent streaming Generate calls from a load-generator subprocess to a server in this process."""
  from hisparse_jax import server as srv
  lanes = max(1, min(concurrency, bench.fits(mode, prompt_len, new)))
  engine = bench.engine(mode, lanes, prompt_len + new)
  bench.warm(engine, prompt_len, new)
  peak = [0]
  stop = threading.Event()

  def watch():  # samples how many requests run at once (the loop thread owns the engine)
    while not stop.is_set():
      peak[0] = max(peak[0], len(engine.running))
      time.sleep(0.002)

  grpc_server, loop, port = srv.serve(engine, None, "127.0.0.1", 0)
  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  try:
    prompts = [bench.request(prompt_len, new, seed=i + 1).prompt_ids for i in range(concurrency)]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--load-generator", f"127.0.0.1:{port}",
                          "--new", str(new)], input=json.dumps(prompts), capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
      raise RuntimeError(f"load generator failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout)
  finally:
    stop.set()
    grpc_server.stop(grace=None)
    loop.stop()
  assert res["tokens"] == concurrency * new, res
  return dict(mode=mode, concurrency=concurrency, lanes=lanes, context=prompt_len + new,
              **_summary(res["wall_s"], res["ttft_s"], res["tokens"], peak[0], engine))


def load_generator(target: str, new: int) -> None:
  """Subprocess side of run_grpc_point: prompts (JSON list of id lists) on stdin, numbers on stdout."""
  import grpc
  from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
  prompts = json.loads(sys.stdin.read())

  async def one(stub, ids, t0):
    req = hisparse_pb2.GenerateRequest(max_new_tokens=new, ignore_eos=True)
    req.input_ids.ids.extend(ids)
    first, n = None, 0
    async for msg in stub.Generate(req, timeout=1800):
      if msg.token_ids and first is None:
        first = time.perf_counter() - t0
      n += len(msg.token_ids)
    return first, n

  async def main():
    async with grpc.aio.insecure_channel(target) as channel:
      stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
      await channel.channel_ready()
      t0 = time.perf_counter()
      res = await asyncio.gather(*(one(stub, ids, t0) for ids in prompts))
      return time.perf_counter() - t0, res

  wall, res = asyncio.run(main())
  print(json.dumps(dict(wall_s=wall, ttft_s=[r[0] for r in res], tokens=sum(r[1] for r in res))))


def run_overhead(bench: Bench, prompts: list[int], new: int) -> list[dict]:
  """One lane, one request at a time: mean decode step time per mode and prompt length (median of 3)."""
  rows = []
  for prompt_len in prompts:
    steps = {}
    for mode in MODES:
      engine = bench.engine(mode, 1, prompt_len + new)
      bench.warm(engine, prompt_len, new)
      times = []
      for rep in range(3):
        engine.decode_seconds, engine.decode_steps = 0.0, 0
        engine.submit(bench.request(prompt_len, new, f"o{rep}", seed=rep))
        engine.run()
        times.append(engine.decode_seconds / engine.decode_steps)
      steps[mode] = float(np.median(times))
    rows.append(dict(prompt=prompt_len, dense_step_ms=1e3 * steps["dense"], hisparse_step_ms=1e3 * steps["hisparse"],
                     ratio=steps["hisparse"] / steps["dense"]))
    print(f"overhead prompt {prompt_len}: {rows[-1]}", flush=True)
  return rows


def _ratio_rows(points: list[dict], key: str) -> list[dict]:
  by = {}
  for p in points:
    by.setdefault(p[key], {})[p["mode"]] = p
  return [dict(x=x, dense=m["dense"], hisparse=m["hisparse"],
               ratio=m["hisparse"]["tokens_per_s"] / m["dense"]["tokens_per_s"])
          for x, m in sorted(by.items()) if len(m) == 2]


def _table(title: str, points: list[dict], key: str) -> list[str]:
  lines = [title, "", f"| {key} | mode | lanes | admitted | tokens/s | decode tok/s | step ms | TTFT mean ms | "
           "TTFT p90 ms | HiSparse/dense |", "|---" * 10 + "|"]
  for r in _ratio_rows(points, key):
    for mode in MODES:
      p = r[mode]
      ratio = f"**{r['ratio']:.2f}x**" if mode == "hisparse" else ""
      lines.append(f"| {r['x']} | {mode} | {p['lanes']} | {p['admitted']} | {p['tokens_per_s']:.1f} | "
                   f"{p['decode_tokens_per_s']:.1f} | {p['step_ms']:.1f} | {p['ttft_mean_ms']:.0f} | "
                   f"{p['ttft_p90_ms']:.0f} | {ratio} |")
  return lines + [""]


def _plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [(k, x) for k, x in (("concurrency", "concurrency"), ("grpc", "concurrency"), ("context", "context"))
            if results.get(k)]
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
  for ax, (section, key) in zip(axes[0], panels):
    rows = _ratio_rows(results[section], key)
    xs = [r["x"] for r in rows]
    for mode, color in zip(MODES, ("tab:gray", "tab:blue")):
      ax.plot(xs, [r[mode]["tokens_per_s"] for r in rows], "o-", color=color, label=f"{mode} (end to end)")
      ax.plot(xs, [r[mode]["decode_tokens_per_s"] for r in rows], "x:", color=color, label=f"{mode} (decode steps)")
    for r in rows:
      ax.annotate(f"{r['ratio']:.1f}x", (r["x"], r["hisparse"]["tokens_per_s"]), textcoords="offset points",
                  xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(key + (" (tokens; x64 = real scale)" if key == "context" else " (requests in flight)"))
    ax.set_ylabel("new tokens / s")
    ax.set_title({"concurrency": "engine", "grpc": "gRPC server, loopback load generator",
                  "context": "long context, concurrency 32"}[section])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle("Dense vs HiSparse under one device KV budget (dense fits 4 requests of 512 tokens)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


SECTIONS = ("concurrency", "grpc", "context", "overhead")


def _sections(text: str) -> list[str]:
  names = [x.strip() for x in text.split(",") if x.strip()]
  bad = [x for x in names if x not in SECTIONS]
  if bad or not names:
    raise argparse.ArgumentTypeError(f"unknown section(s) {bad or [text]}; choose from {','.join(SECTIONS)}")
  return names


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="a few small points (CI smoke)")
  ap.add_argument("--sections", default=",".join(SECTIONS), type=_sections,
                  help=f"comma-separated subset of {','.join(SECTIONS)}")
  ap.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256", type=positive_ints)
  ap.add_argument("--grpc-concurrency", default="1,4,16,64,256", type=positive_ints)
  ap.add_argument("--contexts", default="128,256,512,1024", type=positive_ints,
                  help=f"request contexts in tokens (each > {NEW}, the new tokens per request)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "throughput"))
  ap.add_argument("--load-generator", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--new", type=int, default=NEW, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.load_generator:
    load_generator(args.load_generator, args.new)
    return 0
  import jax
  import bench_models
  hisparse = bench_models.SERVING_HISPARSE
  new = NEW
  if args.quick:
    args.concurrency, args.grpc_concurrency, args.contexts, new = [1, 8], [8], [128, 512], 4
  if min(args.contexts) <= NEW:
    ap.error(f"--contexts: each context must be > {NEW} (prompt + {NEW} new tokens)")
  sections = args.sections
  t_start = time.perf_counter()
  bench = Bench(hisparse)
  results = dict(machine=dict(cpus=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend()),
                 hisparse=hisparse, budget_bytes=bench.budget, prompt=PROMPT, new_tokens=new)
  context_concurrency = 8 if args.quick else 32
  sweeps = {  # section: (points, run one point in one mode)
      "concurrency": (args.concurrency, lambda c, mode: run_engine_point(bench, mode, c, PROMPT, new)),
      "grpc": (args.grpc_concurrency, lambda c, mode: run_grpc_point(bench, mode, c, PROMPT, new)),
      "context": (args.contexts,
                  lambda ctx, mode: run_engine_point(bench, mode, context_concurrency, ctx - new, new)),
  }
  for section, (points, run_point) in sweeps.items():
    if section in sections:
      results[section] = []
      for x in points:
        for mode in MODES:
          results[section].append(run_point(x, mode))
          print(f"{section} {x} {mode}: {results[section][-1]['tokens_per_s']:.1f} tok/s", flush=True)
  if "overhead" in sections:
    D = hisparse["device_buffer_size"]
    results["overhead"] = run_overhead(bench, [D // 2, 4 * D] if args.quick else [D // 2, 4 * D, 16 * D - new],
                                       new)
  results["seconds"] = time.perf_counter() - t_start
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  lines = [f"Budget {bench.budget / 2**20:.2f} MiB of device KV (dense fits {DENSE_FITS} requests of "
           f"{PROMPT}+{new} tokens); HiSparse {hisparse}; {results['seconds']:.0f} s.", ""]
  if results.get("concurrency"):
    lines += _table("Engine, prompt {PROMPT} + {new} new tokens:".format(PROMPT=PROMPT, new=new),
                    results["concurrency"], "concurrency")
  if results.get("grpc"):
    lines += _table("gRPC server + loopback load generator:", results["grpc"], "concurrency")
  if results.get("context"):
    lines += _table(f"Context sweep at concurrency {context_concurrency}:", results["context"], "context")
  if results.get("overhead"):
    lines += ["Low concurrency (1 lane): mean decode step", "", "| prompt | dense ms | HiSparse ms | ratio |",
              "|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['dense_step_ms']:.2f} | {r['hisparse_step_ms']:.2f} | {r['ratio']:.2f} |"
              for r in results["overhead"]]
  text = "\n".join(lines) + "\n"
  print(text)
  with open(args.out + ".md", "w") as f:
    f.write(text)
  if any(results.get(k) for k in ("concurrency", "grpc", "context")):
    _plot(results, args.out + ".png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
