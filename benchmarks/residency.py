r"""Dynamic residency: what HiSparse costs over dense KV at low concurrency, with and without it.

  python benchmarks/residency.py [--quick] [--batches 1,2,8,32] [--rounds 40] [--prompt-len 96] \
      [--out benchmarks/results/residency]

Model: the embedded default model (``hisparse_jax.default_model``), float32. Per batch size B, three engines
live in one process, each with B requests of ``--prompt-len`` random tokens decoding (greedy, EOS ignored):
  dense     the whole KV on device;
  hisparse  HiSparse with the model's top_k and hot buffer (64 < the prompt: every step swaps in) and a host pool
            that holds every request (host_to_device_ratio 16);
  resident  the same HiSparse config plus ``resident_fraction`` 0.5 and a budget that holds every request's
            latent KV on device: no step swaps in (checked: no offload, every step "all" resident).
Then ``--rounds`` rounds of one ``Engine.step()`` per engine, in an order rotated each round, so that the
machine's drift (this is a shared 2-core VM) hits every mode alike. The engines run the plain schedule
(``overlap_schedule=False``): with the overlapped one a step returns with its successor's decode call still
running, and that call's time would land on whichever engine is timed next in the rotation (ratios of
0.06-17 in one run). Reported per mode: the median step (ms)
and, against dense, the median over rounds of the per-round ratio step(mode) / step(dense) with its
interquartile range. The first 3 rounds are left out (compilation, warm caches).

The goal (issue 14 section 4): resident / dense <= 1.01 at concurrency 1-2, and at high concurrency no worse than
HiSparse without residency. Writes OUT.json and OUT.md.
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

SKIP = 3
MODES = ("dense", "hisparse", "resident")


def engines(model_dir: str, B: int, prompt_len: int, rounds: int) -> dict:
  """The three engines at batch B, every request decoding."""
  from hisparse_jax.engine import Engine, Request

  max_seq_len = prompt_len + rounds + B + 40
  out = {}
  for mode in MODES:
    kw = dict(
      dtype="float32",
      max_running_requests=B,
      max_seq_len=max_seq_len,
      overlap_schedule=False,
      max_device_kv_bytes=B * max_seq_len * 8192,
      chunked_prefill_size=max(2048, B * prompt_len),
    )
    if mode != "dense":  # the model's top_k and hot buffer; a host pool that holds every request
      kw["hisparse_config"] = json.dumps(
        {"host_to_device_ratio": 16, "resident_fraction": 0.5 if mode == "resident" else 0}
      )
    eng = Engine(model_dir, enable_hisparse=mode != "dense", **kw)
    rng = np.random.default_rng(B)  # the same prompts in every mode
    for i in range(B):
      eng.submit(Request(f"r{i}", rng.integers(2, 100000, prompt_len).tolist(), rounds + B + 32, ignore_eos=True))
    while len(eng._decoding()) < B:
      eng.step()
    out[mode] = eng
  return out


def measure(model_dir: str, B: int, prompt_len: int, rounds: int) -> dict:
  engs = engines(model_dir, B, prompt_len, rounds)
  times = {m: [] for m in MODES}
  for r in range(rounds):
    order = MODES[r % 3 :] + MODES[: r % 3]
    for m in order:
      t = time.perf_counter()
      engs[m].step()
      times[m].append(time.perf_counter() - t)
  res = engs["resident"]
  if res.num_offloads or set(res.residency_steps) != {"all"}:
    raise RuntimeError(f"resident: {res.num_offloads} offloads, steps by residency {dict(res.residency_steps)}")
  for m, e in engs.items():
    if len(e._decoding()) != B:
      raise RuntimeError(
        f"{m}: {len(e._decoding())} of {B} requests decoding after the rounds "
        f"({e.num_preemptions} preemptions, {len(e.waiting)} waiting)"
      )
  row = {"batch": B, "rounds": rounds - SKIP}
  dense = np.array(times["dense"][SKIP:])
  for m in MODES:
    t = np.array(times[m][SKIP:])
    row[f"{m}_ms"] = 1e3 * float(np.median(t))
    if m != "dense":
      ratio = t / dense
      row[f"{m}_over_dense"] = float(np.median(ratio))
      row[f"{m}_over_dense_iqr"] = [float(np.percentile(ratio, 25)), float(np.percentile(ratio, 75))]
  hs = engs["hisparse"]
  row["hisparse_misses_per_step"] = sum(sum(hs.backend.swap_stats(r.kv)[1]) for r in hs.running) / max(
    1, hs.decode_steps
  )
  for e in engs.values():
    e.close()
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", type=positive_ints_at_most(256), default=[1, 2, 8, 32], help="batch sizes (requests)")
  ap.add_argument(
    "--rounds",
    type=int_in(SKIP + 1, 10**6),
    default=40,
    help=f"rounds of one step per engine (the first {SKIP} untimed)",
  )
  ap.add_argument("--prompt-len", type=int_in(1, 2**20), default=96, help="tokens per prompt")
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--quick", action="store_true")
  if ap.parse_known_args(argv)[0].quick:
    ap.set_defaults(batches=[1], rounds=8)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("residency", args.quick)
  from hisparse_jax.default_model import ensure_default_model

  model_dir = ensure_default_model()
  t0 = time.perf_counter()
  rows = [measure(model_dir, B, args.prompt_len, args.rounds) for B in args.batches]
  lines = [
    f"Default model, float32, {os.cpu_count()} cores; prompts of {args.prompt_len} tokens; {args.rounds} rounds "
    f"of one step per engine (order rotated), median after the first {SKIP}.",
    "",
    "| batch | dense step ms | HiSparse step ms | resident step ms | HiSparse / dense (IQR) | resident / dense (IQR) |",
    "|---" * 6 + "|",
  ]
  for r in rows:
    h, s = r["hisparse_over_dense_iqr"], r["resident_over_dense_iqr"]
    lines.append(
      f"| {r['batch']} | {r['dense_ms']:.2f} | {r['hisparse_ms']:.2f} | {r['resident_ms']:.2f} | "
      f"{r['hisparse_over_dense']:.3f} ({h[0]:.2f}-{h[1]:.2f}) | "
      f"{r['resident_over_dense']:.3f} ({s[0]:.2f}-{s[1]:.2f}) |"
    )
  write_results(args.out, {"args": vars(args), "rows": rows, "seconds": time.perf_counter() - t0}, "\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
