r"""Dense vs HiSparse at the real HiSparse sizes, contexts 8k ... 64k, under one device KV budget per context.

  python benchmarks/throughput.py [--quick] [--sections e2e,decode] [--contexts 8192,16384,32768,65536] \
      [--out benchmarks/results/throughput]

Model: ``bench_models.realsize_model()`` (the default model's width, index_topk 2048, float32) with the
configuration HiSparse was published with: top_k 2048, hot buffer D = 4096, host_to_device_ratio 8.

Budget: per context, DENSE_FITS (4) dense requests of that context (tokens x the dense bytes per token,
from the engine's own page sizes: latent row + indexer key, all layers); both modes get that budget as
--max-device-kv-bytes and size their pools from it with the engine's own ``memory.backend.plan`` (HiSparse
spends it on one max-length prompt's staging pages, a hot buffer per request and indexer-key pages).
max_seq_len = the context, chunked prefill 2048, batch buckets; each mode's max_running_requests is
min(C, the requests of this context its budget holds), so HiSparse spends its budget on as many hot
buffers as its indexer-key pages can fill. Every request generates exactly NEW (32) tokens (ignore_eos);
its prompt is context - NEW tokens. Each point runs on a fresh engine warmed up first (every prefill
chunk shape and every decode batch bucket it uses compiled at its indexer window), so no compilation is
timed.

Sections:
  e2e     C requests with their prompts prefilled by the engine (random token ids) submitted at once:
          end-to-end tokens/s (prefill included), decode tokens/s (decode steps only), requests admitted (most
          running at once), TTFT mean / p90. A 64k prompt takes minutes to prefill on this CPU (every query
          gathers its 2048 top-k rows), so C is small: E2E_CONCURRENCY.
  decode  C requests whose prompt KV arrives with them (``Request.prompt_kv``, the path a prefill server's KV
          takes; random KV shared by all requests, written into each request's own pages, host rows and hot
          buffer as a prefill would): decode tokens/s, admitted, decode step ms, swap-in misses per step, for
          each --concurrency (default 1 and 16) -- the memory-bound regime HiSparse is for, measured without
          hours of prefill.

Writes OUT.json (all numbers) and OUT.md (tables).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cli import OUT_HELP, default_out, out_path, positive_ints, sections, write_results  # noqa: E402

MODES = ("dense", "hisparse")
NEW = 32
DENSE_FITS = 4
PAGE = 64
# e2e concurrency per context (prefill cost grows with C x context; a 64k prompt's prefill is measured on
# the default model by long_context.py, so e2e stops at 16k to keep `make bench` within 30 minutes; a 32k
# point, C = 1, is in BENCHMARKS.md from `--sections e2e --e2e-contexts 32768`).
E2E_CONCURRENCY = {8192: 4, 16384: 2}
# DeepSeek-V3.2's public config.json: its KV bytes per token under the runtime's FP8 KV cache
# (--kv-cache-dtype fp8_e4m3, models/kv_format.py: 656 B of latent row and 132 B of indexer key per layer,
# 61 layers), the capacity this budget would give the real model, from the same plan as the engine's.
DEEPSEEK_V32_CONFIG = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "deepseek_v32_config.json"
)


def deepseek_v32_layout():
  """The KVLayout of DeepSeek-V3.2 in bfloat16 with the FP8 KV cache."""
  import json

  from hisparse_jax.memory import backend as kvmem
  from models.config import DSAConfig

  with open(DEEPSEEK_V32_CONFIG) as f:
    cfg = DSAConfig.from_hf_config(json.load(f)).replace(kv_cache_dtype="fp8_e4m3")
  return kvmem.KVLayout.of(cfg, "bfloat16")


SECTIONS = ("e2e", "decode")


class Bench:
  def __init__(self):
    import bench_models
    from hisparse_jax.config import HiSparseConfig
    from hisparse_jax.memory import backend as kvmem
    from models.config import DSAConfig

    self.model_dir = bench_models.realsize_model()
    self.cfg = DSAConfig.from_pretrained(self.model_dir)
    self.hisparse = HiSparseConfig(**bench_models.REALSIZE_HISPARSE)
    self.layout = kvmem.KVLayout.of(self.cfg, self.cfg.dtype)

  def budget(self, context: int) -> int:
    """DENSE_FITS dense requests of `context` tokens (the backend's own per-request bytes)."""
    from hisparse_jax.memory import backend as kvmem

    return DENSE_FITS * kvmem.request_bytes(self.layout, None, PAGE, context)["device"]

  def fits(self, mode: str, context: int, real: bool = False) -> int:
    """Requests of `context` tokens the device budget holds in this mode (each with its pages for the whole
    context; HiSparse beside one context's staging pages): the engine's request slots, so that HiSparse spends
    its budget on as many hot buffers as it can fill with indexer keys. real: with DeepSeek-V3.2's per-token
    bytes (deepseek_v32_layout) and the budget of 4 of its dense requests."""
    from hisparse_jax.memory import backend as kvmem

    layout = deepseek_v32_layout() if real else self.layout
    budget = DENSE_FITS * kvmem.request_bytes(layout, None, PAGE, context)["device"]
    hisparse = self.hisparse if mode == "hisparse" else None
    if hisparse is not None:
      budget -= math.ceil(context / PAGE) * PAGE * layout.latent_bytes  # the staging pages
    return budget // kvmem.request_bytes(layout, hisparse, PAGE, context)["device"]

  def host_fits(self, context: int) -> int:
    """Requests of `context` tokens HiSparse's host pool holds with fits() request slots (ratio x (D + 1)
    tokens a slot, the seed configuration's sizing)."""
    return self.hisparse.host_pool_rows(self.fits("hisparse", context)) // context

  def engine(self, mode: str, concurrency: int, context: int):
    from hisparse_jax.engine import Engine

    return Engine(
      self.model_dir,
      hisparse=self.hisparse if mode == "hisparse" else None,
      max_running_requests=max(1, min(concurrency, self.fits(mode, context))),
      max_seq_len=context,
      max_device_kv_bytes=self.budget(context),
      page_size=PAGE,
    )

  def request(self, rid: str, prompt: int, seed: int, prompt_kv=None, new: int = NEW):
    from hisparse_jax.engine import Request

    ids = np.random.default_rng(seed).integers(2, 100_000, prompt).tolist()
    extra = {} if prompt_kv is None else dict(prompt_kv=prompt_kv, first_token=7)
    return Request(rid, ids, new, ignore_eos=True, **extra)


def _drive(engine, reqs) -> dict:
  """Submits reqs at once and steps until all finish; wall time, TTFTs, peak admitted, engine time split."""
  engine.prefill_seconds = engine.decode_seconds = 0.0
  engine.decode_steps = 0
  t0 = time.perf_counter()
  for r in reqs:
    engine.submit(r)
  peak = 0
  while engine.has_work():
    engine.step()
    peak = max(peak, len(engine.running))
  wall = time.perf_counter() - t0
  assert all(len(r.output_ids) == NEW for r in reqs), "a request ended early"
  ttft = np.array([r.first_token_time - r.arrival for r in reqs])
  tokens = len(reqs) * NEW
  decode_tokens = tokens - len(reqs)  # each request's first token comes from prefill / the import
  return dict(
    wall_s=wall,
    tokens=tokens,
    tokens_per_s=tokens / wall,
    admitted=peak,
    decode_s=engine.decode_seconds,
    decode_steps=engine.decode_steps,
    prefill_s=engine.prefill_seconds,
    decode_tokens_per_s=decode_tokens / max(engine.decode_seconds, 1e-9),
    step_ms=1e3 * engine.decode_seconds / max(engine.decode_steps, 1),
    ttft_mean_s=float(ttft.mean()),
    ttft_p90_s=float(np.percentile(ttft, 90)),
    misses_per_step=sum(r.misses for r in reqs) / max(engine.decode_steps, 1),
    preemptions=engine.num_preemptions,
  )


def run_point(bench: Bench, section: str, context: int, concurrency: int, mode: str, kv=None) -> dict:
  """One point: a fresh engine of this mode, warmed up (every shape the point uses compiled, untimed), then
  C requests at once -- prefilled by the engine (kv None) or arriving with their prompt KV."""
  eng = bench.engine(mode, concurrency, context)
  if kv is None:  # the prefill chunk shapes, on a short request
    eng.submit(bench.request("warm", min(2 * 2048 + 100, context - NEW), 1, new=2))
    eng.run()
  # The decode step at every batch bucket the point can use, at this context's indexer window.
  warm_kv = kv if kv is not None else _random_kv(bench, context - NEW)
  running = min(concurrency, eng.num_slots)
  for n in sorted({min(1 << (k - 1).bit_length(), eng.num_slots) for k in range(1, running + 1)}):
    for i in range(n):
      eng.submit(bench.request(f"warm{n}-{i}", context - NEW, 1, prompt_kv=warm_kv, new=3))
    eng.run()
  del warm_kv
  eng.num_preemptions = 0
  reqs = [bench.request(f"{mode}-{i}", context - NEW, 100 + i, prompt_kv=kv) for i in range(concurrency)]
  return dict(
    section=section, mode=mode, context=context, concurrency=concurrency, slots=eng.num_slots, **_drive(eng, reqs)
  )


def _random_kv(bench: Bench, prompt: int):
  """Random prompt KV of the model's shapes (latent like kv_a_layernorm's output, unit-norm-ish keys)."""
  import jax
  import jax.numpy as jnp

  cfg = bench.cfg
  k1, k2 = jax.random.split(jax.random.key(0))
  latent = jax.random.normal(k1, (cfg.num_hidden_layers, prompt, cfg.latent_dim), jnp.float32)
  index = jax.random.normal(k2, (cfg.num_hidden_layers, prompt, cfg.index_head_dim), jnp.float32)
  return latent, index


def _pairs(points, key):
  by = {}
  for p in points:
    by.setdefault((p["context"], p[key]), {})[p["mode"]] = p
  return [(ctx, x, m) for (ctx, x), m in sorted(by.items()) if len(m) == 2]


def _markdown(res: dict) -> str:
  lines = [
    f"Budget per context: {DENSE_FITS} dense requests of that context. HiSparse {res['hisparse']}.",
    "",
    "Requests of the context the budget holds (device pages; HiSparse also bounded by its host pool):",
    "",
    "| context | dense | HiSparse (device) | HiSparse (host pool) | ratio | with DeepSeek-V3.2's bytes per token: "
    "dense | HiSparse | ratio |",
    "|---" * 8 + "|",
  ]
  for c in res.get("capacity", []):
    r = c["deepseek_v32"]
    lines.append(
      f"| {c['context']} | {c['dense']} | {c['hisparse']} | {c['host_bound']} | "
      f"{min(c['hisparse'], c['host_bound']) / max(c['dense'], 1):.2f}x | {r['dense']} | {r['hisparse']} | "
      f"{r['hisparse'] / max(r['dense'], 1):.2f}x |"
    )
  lines.append("")
  if res.get("e2e"):
    lines += [
      "End to end (prompts prefilled by the engine):",
      "",
      "| context | C | mode | admitted | tokens/s | decode tok/s | step ms | TTFT mean s | TTFT p90 s | "
      "HiSparse/dense tok/s | HiSparse/dense decode tok/s |",
      "|---" * 11 + "|",
    ]
    for ctx, c, m in _pairs(res["e2e"], "concurrency"):
      for mode in MODES:
        p = m[mode]
        ratio = (
          f"**{m['hisparse']['tokens_per_s'] / m['dense']['tokens_per_s']:.2f}x** | "
          f"**{m['hisparse']['decode_tokens_per_s'] / m['dense']['decode_tokens_per_s']:.2f}x**"
          if mode == "hisparse"
          else " | "
        )
        lines.append(
          f"| {ctx} | {c} | {mode} | {p['admitted']} | {p['tokens_per_s']:.1f} | "
          f"{p['decode_tokens_per_s']:.1f} | {p['step_ms']:.0f} | {p['ttft_mean_s']:.1f} | "
          f"{p['ttft_p90_s']:.1f} | {ratio} |"
        )
    lines.append("")
  if res.get("decode"):
    lines += [
      "Decode phase (prompt KV imported with each request):",
      "",
      "| context | C | mode | slots | admitted | decode tok/s | step ms | misses / step | preempted | "
      "HiSparse/dense decode tok/s |",
      "|---" * 10 + "|",
    ]
    for ctx, c, m in _pairs(res["decode"], "concurrency"):
      for mode in MODES:
        p = m[mode]
        ratio = (
          f"**{m['hisparse']['decode_tokens_per_s'] / m['dense']['decode_tokens_per_s']:.2f}x**"
          if mode == "hisparse"
          else ""
        )
        lines.append(
          f"| {ctx} | {c} | {mode} | {p['slots']} | {p['admitted']} | {p['decode_tokens_per_s']:.1f} | "
          f"{p['step_ms']:.0f} | {p['misses_per_step']:.0f} | {p['preemptions']} | {ratio} |"
        )
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small contexts and counts (CI smoke)")
  ap.add_argument("--sections", default=",".join(SECTIONS), type=sections(SECTIONS))
  ap.add_argument("--contexts", default="8192,16384,32768,65536", type=positive_ints)
  ap.add_argument("--concurrency", default="1,16", type=positive_ints, help="decode-section concurrency")
  ap.add_argument(
    "--e2e-contexts",
    default=",".join(map(str, E2E_CONCURRENCY)),
    type=positive_ints,
    help="e2e-section contexts (concurrency from E2E_CONCURRENCY, else 1)",
  )
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("throughput", args.quick)
  e2e_c = {ctx: E2E_CONCURRENCY.get(ctx, 1) for ctx in args.e2e_contexts}
  if args.quick:
    args.contexts, args.concurrency = [4224], [8]
    e2e_c = {4224: 2}
  if min(args.contexts + list(e2e_c)) < 4096 + NEW or any(c % PAGE for c in args.contexts + list(e2e_c)):
    ap.error(f"--contexts: multiples of {PAGE}, at least {4096 + NEW} (longer than the hot buffer)")
  import jax

  t0 = time.perf_counter()
  bench = Bench()
  res = dict(
    machine=dict(cpus=os.cpu_count(), jax=jax.__version__, backend=jax.default_backend()),
    hisparse=dict(bench.hisparse.__dict__),
    new_tokens=NEW,
    dense_fits=DENSE_FITS,
    budgets={c: bench.budget(c) for c in args.contexts},
  )
  if "decode" in args.sections:
    res["decode"] = []
    for ctx in args.contexts:
      kv = _random_kv(bench, ctx - NEW)
      for c in args.concurrency:
        for mode in MODES:
          res["decode"].append(run_point(bench, "decode", ctx, c, mode, kv))
          p = res["decode"][-1]
          print(
            f"decode {ctx} C={c} {mode}: admitted {p['admitted']}, {p['decode_tokens_per_s']:.1f} decode tok/s",
            flush=True,
          )
      del kv
  res["capacity"] = [
    dict(
      context=ctx,
      **{m: bench.fits(m, ctx) for m in MODES},
      host_bound=bench.host_fits(ctx),
      deepseek_v32={m: bench.fits(m, ctx, real=True) for m in MODES},
    )
    for ctx in args.contexts
  ]
  if "e2e" in args.sections:
    res["e2e"] = []
    for ctx in e2e_c:
      c = e2e_c[ctx]
      for mode in MODES:
        res["e2e"].append(run_point(bench, "e2e", ctx, c, mode))
        p = res["e2e"][-1]
        print(f"e2e {ctx} C={c} {mode}: {p['tokens_per_s']:.1f} tok/s, admitted {p['admitted']}", flush=True)
  res["seconds"] = time.perf_counter() - t0
  write_results(args.out, res, _markdown(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
