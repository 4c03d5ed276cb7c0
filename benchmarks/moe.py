r"""Routed-expert FFN: grouped dispatch (models/moe.py, what the model runs) vs dense evaluation of every expert.

  python benchmarks/moe.py [--quick] [--experts 64] [--active 8] [--tokens 1,8,64,256,1024] \
      [--hidden 1024] [--inter 512] [--ep 8] [--out benchmarks/results/moe]

One jitted call of each evaluation on the same random tokens, routing (k distinct experts per token, uniform)
and float32 weights; median of repeated calls. ``dense / grouped`` is the speed-up; the ideal is E / k (the
dense evaluation does E / k times the FLOPs). ``max |diff|`` compares the two results, relative to the
largest output.

``--ep N`` also times expert parallelism with DP attention on N simulated CPU devices (``run_ep``): the
all-to-all dispatch the engine runs vs every device seeing every token and a psum, in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from cli import OUT_HELP, check_memory, default_out, int_in, out_path, positive_ints, write_results  # noqa: E402


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
    rows.append(
      dict(
        tokens=T,
        experts=experts,
        active=active,
        hidden=hidden,
        inter=inter,
        block=block_rows(T, active, experts),
        dense_ms=times["dense"][0],
        grouped_ms=times["grouped"][0],
        speedup=times["dense"][0] / times["grouped"][0],
        ideal=experts / active,
        rel_diff=diff,
      )
    )
    print(rows[-1], flush=True)
  return rows


def run_ep(
  tokens: list[int], devices: int, experts: int, active: int, hidden: int, inter: int, repeats: int
) -> list[dict]:
  """Expert parallelism with DP attention on `devices` simulated CPU devices (mesh dp = ep = devices, tp 1):
  each group's tokens sent to their experts by all-to-all (``all_to_all_ffn``, what the engine runs) vs every
  device seeing every token and a psum (``expert_parallel_ffn`` without a token axis). T tokens in all, T /
  devices per group. Bytes: what one device sends per call, in float32 activations (the all-gather and ring
  all-reduce of [T, H] vs two [N, T / N, H] exchanges)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from hisparse_jax.sharding import MeshConfig
  from models.moe import expert_parallel_ffn

  hi = jax.lax.Precision.HIGHEST
  mesh_cfg = MeshConfig(devices, 1, devices)
  mesh = mesh_cfg.make_mesh()
  rng = np.random.default_rng(0)
  w_spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("dp",)))
  gate, up = (
    jax.device_put(rng.standard_normal((experts, hidden, inter)).astype(np.float32) * 0.05, w_spec) for _ in range(2)
  )
  down = jax.device_put(rng.standard_normal((experts, inter, hidden)).astype(np.float32) * 0.05, w_spec)
  rows = []
  for T in tokens:
    T = -(-T // devices) * devices
    x = jnp.asarray(rng.standard_normal((T, hidden)), jnp.float32)
    expert = jnp.asarray(np.stack([rng.choice(experts, active, replace=False) for _ in range(T)]), jnp.int32)
    weight = jnp.asarray(rng.random((T, active)), jnp.float32)
    tok = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    x, expert, weight = (jax.device_put(a, tok) for a in (x, expert, weight))
    times, outs = {}, {}
    for name, axis in (("psum", None), ("all_to_all", "dp")):
      with jax.set_mesh(mesh):
        fn = jax.jit(lambda *a, axis=axis: expert_parallel_ffn(*a, expert_axes=("dp",), token_axis=axis, precision=hi))
        outs[name] = np.asarray(fn(x, expert, weight, gate, up, down))
        ts = []
        for _ in range(repeats):
          t0 = time.perf_counter()
          fn(x, expert, weight, gate, up, down).block_until_ready()
          ts.append(time.perf_counter() - t0)
      times[name] = 1e3 * float(np.median(ts))
    N, f = devices, (devices - 1) / devices
    rows.append(
      dict(
        tokens=T,
        devices=N,
        psum_ms=times["psum"],
        all_to_all_ms=times["all_to_all"],
        speedup=times["psum"] / times["all_to_all"],
        psum_bytes=int(3 * f * T * hidden * 4),
        all_to_all_bytes=int(2 * f * T * hidden * 4),
        rel_diff=float(np.abs(outs["psum"] - outs["all_to_all"]).max() / np.abs(outs["psum"]).max()),
      )
    )
    print(rows[-1], flush=True)
  return rows


def markdown_ep(rows: list[dict]) -> str:
  lines = [
    f"Expert parallelism over {rows[0]['devices']} simulated CPU devices (DP attention, dp = ep):",
    "",
    "| tokens (all groups) | psum ms | all-to-all ms | psum / all-to-all | bytes sent per device: psum | "
    "all-to-all | max rel. diff |",
    "|---|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {r['tokens']} | {r['psum_ms']:.2f} | {r['all_to_all_ms']:.2f} | {r['speedup']:.2f}x | "
    f"{r['psum_bytes'] / 2**10:.1f} KiB | {r['all_to_all_bytes'] / 2**10:.1f} KiB | {r['rel_diff']:.1e} |"
    for r in rows
  ]
  return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
  r0 = rows[0]
  lines = [
    f"Routed experts: {r0['experts']} experts, {r0['active']} per token, hidden {r0['hidden']}, "
    f"expert FFN {r0['inter']}, float32:",
    "",
    "| tokens | block rows | dense ms | grouped ms | dense / grouped | ideal (E / k) | max rel. diff |",
    "|---|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {r['tokens']} | {r['block']} | {r['dense_ms']:.2f} | {r['grouped_ms']:.2f} | {r['speedup']:.2f}x | "
    f"{r['ideal']:.0f}x | {r['rel_diff']:.1e} |"
    for r in rows
  ]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
  ap.add_argument("--experts", type=int_in(1, 4096), default=64, help="routed experts")
  ap.add_argument("--active", type=int_in(1, 4096), default=8, help="experts per token (<= --experts)")
  ap.add_argument(
    "--tokens", type=positive_ints, default="1,8,64,256,1024", help="tokens per call (the grouped-vs-dense comparison)"
  )
  ap.add_argument("--hidden", type=int_in(1, 2**16), default=1024, help="model width")
  ap.add_argument("--inter", type=int_in(1, 2**16), default=512, help="expert intermediate width")
  ap.add_argument("--repeats", type=int_in(1, 10**4), default=5, help="timed calls per point (median)")
  ap.add_argument(
    "--ep",
    type=int_in(0, 256),
    default=0,
    help="also time expert parallelism over this many "
    "simulated CPU devices (DP attention): all-to-all dispatch vs psum, at 64, 256 and 1024 "
    "tokens (its own sizes: --tokens is the comparison's)",
  )
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("moe", args.quick)
  if not 0 < args.active <= args.experts:
    ap.error(f"--active must be in 1..--experts ({args.experts}), got {args.active}")
  if args.quick:
    args.tokens, args.hidden, args.inter, args.repeats = [1, 32], 64, 32, 3
  # The dense evaluation's float32 activations: every token through every expert (gate, up, their product).
  check_memory(
    ap,
    max(args.tokens) * (3 * args.experts * args.inter + 2 * args.hidden) * 4 * 2,
    "the dense evaluation's activations (--tokens x --experts x --inter)",
  )
  if args.ep:
    if args.experts % args.ep:
      ap.error(f"--ep {args.ep} does not divide --experts {args.experts}")
    os.environ["XLA_FLAGS"] = (  # (before JAX starts; the caller's flags kept)
      f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.ep}".strip()
    )
  t0 = time.perf_counter()
  rows = run(args.tokens, args.experts, args.active, args.hidden, args.inter, args.repeats)
  results, text = {"rows": rows}, markdown(rows)
  if args.ep:
    results["ep"] = run_ep(
      args.tokens if args.quick else [64, 256, 1024],
      args.ep,
      args.experts,
      args.active,
      args.hidden,
      args.inter,
      args.repeats,
    )
    text += "\n" + markdown_ep(results["ep"])
  write_results(args.out, {**results, "seconds": time.perf_counter() - t0}, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
