"""Routed-expert FFN: grouped dispatch (models/moe.py, what the model runs) vs dense evaluation of every expert.

  python benchmarks/moe.py [--quick] [--experts 64] [--active 8] [--tokens 1,8,64,256,1024] \
      [--hidden 1024] [--inter 512] [--out benchmarks/results/moe]

One jitted call of each evaluation on the same random tokens, routing (k distinct experts per token, uniform)
and float32 weights; median of repeated calls. ``dense / grouped`` is the speed-up; the ideal is E / k (the
dense evaluation does E / k times the FLOPs). ``max |diff|`` compares the two results, relative to the
largest output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from cli import positive_ints, write_results  # noqa: E402


def run(tokens: list[int], experts: int, active: int, hidden: int, inter: int, repeats: int) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from models.moe import block_rows, dense_expert_ffn, grouped_expert_ffn
  hi = jax.lax.Precision.HIGHEST
  rng = np.random.default_rng(0)
  gate, up = (jnp.asarray(rng.standard_normal((experts, hidden, inter)) * 0.05, jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((experts, inter, hidden)) * 0.05, jnp.float32)
  grouped = jax.jit(lambda *a: grouped_expert_ffn(*a, precision=hi))
  dense = jax.jit(lambda *a: dense_expert_ffn(*a, precision=hi))
  rows = []
  for T in tokens:
    x = jnp.asarray(rng.standard_normal((T, hidden)), jnp.float32)
    expert = jnp.asarray(np.stack([rng.choice(experts, active, replace=False) for _ in range(T)]), jnp.int32)
    weight = jnp.asarray(rng.random((T, active)), jnp.float32)
    args = (x, expert, weight, gate, up, down)
    times = {}
    for name, fn in (("dense", dense), ("grouped", grouped)):
      out = fn(*args).block_until_ready()  # compile
      ts = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
      times[name] = (1e3 * float(np.median(ts)), np.asarray(out))
    diff = float(np.abs(times["dense"][1] - times["grouped"][1]).max() / np.abs(times["dense"][1]).max())
    rows.append(dict(tokens=T, experts=experts, active=active, hidden=hidden, inter=inter,
                     block=block_rows(T, active, experts), dense_ms=times["dense"][0],
                     grouped_ms=times["grouped"][0], speedup=times["dense"][0] / times["grouped"][0],
                     ideal=experts / active, rel_diff=diff))
    print(rows[-1], flush=True)
  return rows


def markdown(rows: list[dict]) -> str:
  r0 = rows[0]
  lines = [f"Routed experts: {r0['experts']} experts, {r0['active']} per token, hidden {r0['hidden']}, "
           f"expert FFN {r0['inter']}, float32:", "",
           "| tokens | block rows | dense ms | grouped ms | dense / grouped | ideal (E / k) | max rel. diff |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['tokens']} | {r['block']} | {r['dense_ms']:.2f} | {r['grouped_ms']:.2f} | {r['speedup']:.2f}x | "
            f"{r['ideal']:.0f}x | {r['rel_diff']:.1e} |" for r in rows]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
  ap.add_argument("--experts", type=int, default=64)
  ap.add_argument("--active", type=int, default=8)
  ap.add_argument("--tokens", type=positive_ints, default="1,8,64,256,1024")
  ap.add_argument("--hidden", type=int, default=1024)
  ap.add_argument("--inter", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(HERE, "results", "moe"))
  args = ap.parse_args(argv)
  if not 0 < args.active <= args.experts:
    ap.error(f"--active must be in 1..--experts ({args.experts}), got {args.active}")
  if args.quick:
    args.tokens, args.hidden, args.inter, args.repeats = [1, 32], 64, 32, 3
  t0 = time.perf_counter()
  rows = run(args.tokens, args.experts, args.active, args.hidden, args.inter, args.repeats)
  write_results(args.out, {"rows": rows, "seconds": time.perf_counter() - t0}, markdown(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
