"""Health and GetLoads latency through a flood of connections that never handshake (loopback only).

  python benchmarks/connection_flood.py [--quick] [--connections 20000] [--seconds 20] [--max-connections N] \
      [--handshake-timeout-s 10] [--out benchmarks/results/connection_flood]

Serves the tests' tiny model with TLS (a self-signed certificate; needs `openssl`) and
the given connection limits, opens one client channel, then starts a flooder process that holds
``--connections`` raw TCP connections (replacing each the server closes) for ``--seconds``. Meanwhile the channel
calls Health.Check and GetLoads in a loop; prints their p50 / p99 / max latency before and during the flood, the
server's descriptors at most, and how many connections the flooder opened in all; writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cli import OUT_HELP, default_out, out_path, write_results  # noqa: E402


def _latencies(health, stub, seconds: float) -> list[float]:
  from grpc_health.v1 import health_pb2

  from hisparse_jax.proto import hisparse_pb2

  out, end = [], time.monotonic() + seconds
  while time.monotonic() < end:
    t = time.perf_counter()
    health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
    out.append((time.perf_counter() - t) * 1e3)
    time.sleep(0.02)
  return out


def _summary(ms: list[float]) -> dict:
  return {
    "calls": len(ms),
    "p50_ms": float(np.percentile(ms, 50)),
    "p99_ms": float(np.percentile(ms, 99)),
    "max_ms": float(max(ms)),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="300 connections for 2 s against --max-connections 100 and a 1 s handshake timeout (CI smoke)",
  )
  parser.add_argument("--connections", type=int, default=20000)
  parser.add_argument("--seconds", type=float, default=20.0)
  parser.add_argument("--max-connections", type=int, default=None)
  parser.add_argument("--handshake-timeout-s", type=float, default=10.0)
  parser.add_argument("--out", type=out_path, help=OUT_HELP)
  args = parser.parse_args()
  if args.quick:
    args.connections, args.seconds, args.max_connections, args.handshake_timeout_s = 300, 2.0, 100, 1.0
  args.out = args.out or default_out("connection_flood", args.quick)
  t0 = time.perf_counter()
  if args.connections < 1 or args.seconds <= 0:
    parser.error("--connections must be >= 1 and --seconds > 0")
  import grpc
  from grpc_health.v1 import health_pb2_grpc

  from hisparse_jax.engine import Engine
  from hisparse_jax.proto import hisparse_pb2_grpc
  from hisparse_jax.serving.server import ServerLimits, TLSConfig, raise_descriptor_limit, serve
  from tests.multiprocess import flood_connections, self_signed
  from tests.tiny_model import tiny_model_dir

  raise_descriptor_limit()
  key, cert = self_signed(pathlib.Path(tempfile.mkdtemp()))
  limits = ServerLimits(max_connections=args.max_connections, handshake_timeout_s=args.handshake_timeout_s)
  engine = Engine(tiny_model_dir(), max_running_requests=4, max_seq_len=128, page_size=16)
  srv, loop, port = serve(engine, None, "127.0.0.1", 0, tls=TLSConfig(cert, key), limits=limits)
  channel = grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(cert))
  health, stub = health_pb2_grpc.HealthStub(channel), hisparse_pb2_grpc.HiSparseInferenceStub(channel)
  descriptors = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
  idle = _latencies(health, stub, 3.0)
  baseline = descriptors()
  flood = flood_connections(port, args.connections, args.seconds)
  during, most = [], baseline
  while flood.poll() is None:
    during += _latencies(health, stub, 0.5)
    most = max(most, descriptors())
  opened = int(flood.stdout.read().strip() or 0)
  result = {
    "connections": args.connections,
    "seconds": args.seconds,
    "max_connections": limits.connections(),
    "handshake_timeout_s": args.handshake_timeout_s,
    "descriptor_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
    "flooder_opened": opened,
    "server_descriptors_baseline": baseline,
    "server_descriptors_max": most,
    "idle": _summary(idle),
    "during_flood": _summary(during),
  }
  lines = [
    f"A flood of {args.connections} connections for {args.seconds:g} s (the flooder opened {opened} in all) "
    f"against --max-connections {limits.connections()}, --handshake-timeout-s {args.handshake_timeout_s:g}; "
    f"server descriptors {baseline} before, {most} at most.",
    "",
    "| Health + GetLoads on an open channel | calls | p50 ms | p99 ms | max ms |",
    "|---|---|---|---|---|",
  ]
  lines += [
    f"| {name} | {r['calls']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} |"
    for name, r in (("idle", result["idle"]), ("during the flood", result["during_flood"]))
  ]
  result["seconds"] = time.perf_counter() - t0
  write_results(args.out, result, "\n".join(lines))
  channel.close()
  srv.stop(0).wait()
  loop.stop()


if __name__ == "__main__":
  main()
