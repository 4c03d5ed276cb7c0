r"""The gRPC server under hostile load, on loopback: what a small request and the control plane see while one
client floods the server, and whether its memory comes back.

  python benchmarks/server_load.py [--quick] [--out benchmarks/results/server_load]

Server: ``run_server.py`` in a subprocess on the embedded default model (HiSparse, --max-running-requests 8,
--max-queued-requests 1024, the default --max-prompt-bytes = 8 x its 163840-token context = 1.3 MB).

Phases (each measured against the idle server in the same run):
  idle    a small request (a 3-token text prompt, 8 new tokens) end to end, Health.Check and GetLoads.
  text    TEXT_FLOOD clients each send the largest text the server accepts (just under --max-prompt-bytes;
          it tokenizes past the context, so the work is tokenizing it, then INVALID_ARGUMENT), over and over;
          meanwhile the small request and Health run. Also a text just over the limit: refused untokenized.
  streams STREAMS long streams held open by one client (more than the 512 worker threads of the thread-pool
          server this replaced); meanwhile Health, GetLoads and Abort, and another client's (IPv6 loopback)
          small request's first token (fair sharing: within 2x its idle first token); then a burst past the
          queue bound (RESOURCE_EXHAUSTED at once); then every stream is cancelled.
  after   the server's resident memory once everything has ended vs before the phases (measured after a
          warm-up that compiles every batch bucket the phases use).

Writes OUT.json and OUT.md. Targets (BENCHMARKS.md): Health <= 100 ms, small request <= 2x idle, RSS back
within 10% of its baseline.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
from cli import OUT_HELP, default_out, out_path, write_results  # noqa: E402

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc  # noqa: E402


def _rss_mb(pid: int) -> float:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  raise RuntimeError("no VmRSS")


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def _stats(xs) -> dict:
  xs = np.asarray(xs) * 1e3
  return dict(
    n=len(xs), p50_ms=float(np.percentile(xs, 50)), p99_ms=float(np.percentile(xs, 99)), max_ms=float(xs.max())
  )


class Probe:
  def __init__(self, channel):
    self.stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
    self.health = health_pb2_grpc.HealthStub(channel)

  def first_token(self) -> None:
    """Until the small request's first token (the rest of the stream is cancelled)."""
    call = self.stub.Generate(
      hisparse_pb2.GenerateRequest(text="e e e", max_new_tokens=8, ignore_eos=True), timeout=120
    )
    assert next(call).token_ids
    call.cancel()

  def small(self) -> None:
    msgs = list(
      self.stub.Generate(hisparse_pb2.GenerateRequest(text="e e e", max_new_tokens=8, ignore_eos=True), timeout=120)
    )
    assert msgs[-1].completion_tokens == 8

  def check(self) -> None:
    assert (
      self.health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    )

  def loads(self):
    return self.stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=30)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="fewer clients and streams (CI smoke)")
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("server_load", args.quick)
  text_flood, streams, reps = (4, 60, 3) if args.quick else (24, 600, 10)
  t0 = time.perf_counter()
  # Bound to IPv4 and IPv6 loopback: two clients (127.0.0.1 and ::1). The flooding client may hold every stream
  # (the server-wide bounds are measured; by default it would get half).
  proc = subprocess.Popen(
    [
      sys.executable,
      "run_server.py",
      "--port",
      "0",
      "--host",
      "::",
      "--enable-hisparse",
      "--max-running-requests",
      "8",
      "--max-queued-requests",
      "1024",
      "--max-streams-per-client",
      "2000",
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  res: dict = {"text_flood_clients": text_flood, "streams": streams}
  try:
    line = proc.stdout.readline()
    while line and "listening on" not in line:
      line = proc.stdout.readline()
    port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)])
    p = Probe(channel)
    for _ in range(3):  # compile the small request's shapes
      p.small()
    # Compile what the phases run (batch buckets up to 8, the streams' windows), so the baseline RSS holds
    # the same compiled programs as the end.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      list(
        pool.map(
          lambda i: list(
            p.stub.Generate(hisparse_pb2.GenerateRequest(text="e e e", max_new_tokens=64, ignore_eos=True), timeout=600)
          ),
          range(16),
        )
      )
    from hisparse_jax.default_model import ensure_default_model
    from hisparse_jax.engine.args import DEFAULT_PROMPT_BYTES_PER_TOKEN
    from models.config import DSAConfig

    # The server's default --max-prompt-bytes: per token of the default model's context.
    context = DSAConfig.from_pretrained(ensure_default_model()).max_position_embeddings
    max_bytes = DEFAULT_PROMPT_BYTES_PER_TOKEN * context
    res["max_prompt_bytes"] = max_bytes
    other = Probe(grpc.insecure_channel(f"[::1]:{port}"))
    res["idle"] = dict(
      small=_stats([_timed(p.small) for _ in range(reps)]),
      other_first_token=_stats([_timed(other.first_token) for _ in range(reps)]),
      health=_stats([_timed(p.check) for _ in range(50)]),
      loads=_stats([_timed(p.loads) for _ in range(50)]),
    )
    rss0 = _rss_mb(proc.pid)
    print(f"idle: {res['idle']}, RSS {rss0:.0f} MB", flush=True)

    # ---- text flood
    big = ("e " * (max_bytes // 2))[:max_bytes]
    over = big + "e"
    t = time.perf_counter()
    code = None
    try:
      list(p.stub.Generate(hisparse_pb2.GenerateRequest(text=over, max_new_tokens=1), timeout=60))
    except grpc.RpcError as e:
      code = e.code().name
    res["over_limit"] = dict(code=code, ms=1e3 * (time.perf_counter() - t))
    stop = threading.Event()
    flood_codes: list[str] = []

    def flood():
      while not stop.is_set():
        try:
          list(p.stub.Generate(hisparse_pb2.GenerateRequest(text=big, max_new_tokens=1), timeout=120))
          flood_codes.append("OK")
        except grpc.RpcError as e:
          flood_codes.append(e.code().name)

    with concurrent.futures.ThreadPoolExecutor(text_flood) as pool:
      futs = [pool.submit(flood) for _ in range(text_flood)]
      time.sleep(2.0)
      small = [_timed(p.small) for _ in range(reps)]
      health = [_timed(p.check) for _ in range(50)]
      rss_peak = _rss_mb(proc.pid)
      stop.set()
      for f in futs:
        f.result()
    res["text"] = dict(
      small=_stats(small),
      health=_stats(health),
      flood_requests=len(flood_codes),
      flood_codes=sorted(set(flood_codes)),
      rss_mb=rss_peak,
    )
    print(f"text flood: {res['text']}", flush=True)

    # ---- open streams
    calls = [
      p.stub.Generate(
        hisparse_pb2.GenerateRequest(request_id=f"s{i}", text="e e e", max_new_tokens=64, ignore_eos=True), timeout=600
      )
      for i in range(streams)
    ]
    deadline = time.monotonic() + 120
    while p.loads().queued < streams - 8 - 4 and time.monotonic() < deadline:
      time.sleep(0.1)
    health = [_timed(p.check) for _ in range(50)]
    loads = [_timed(p.loads) for _ in range(50)]
    aborts = [
      _timed(lambda i=i: p.stub.Abort(hisparse_pb2.AbortRequest(request_id=f"s{streams - 1 - i}"), timeout=30))
      for i in range(10)
    ]
    other_first = [_timed(other.first_token) for _ in range(reps)]
    queued = p.loads().queued
    extra = [
      p.stub.Generate(hisparse_pb2.GenerateRequest(text="e", max_new_tokens=1), timeout=30)
      for _ in range(1024 + 8 - streams + 100)
    ]
    t = time.perf_counter()
    codes = []
    for c in extra[-20:]:
      try:
        next(c)
        codes.append("OK")
      except grpc.RpcError as e:
        codes.append(e.code().name)
    burst_ms = 1e3 * (time.perf_counter() - t)
    res["streams_phase"] = dict(
      health=_stats(health),
      loads=_stats(loads),
      abort=_stats(aborts),
      queued=queued,
      other_first_token=_stats(other_first),
      over_queue_codes=sorted(set(codes)),
      over_queue_ms=burst_ms,
      rss_mb=_rss_mb(proc.pid),
    )
    print(f"streams: {res['streams_phase']}", flush=True)
    for c in calls + extra:
      c.cancel()
    deadline = time.monotonic() + 120
    while (p.loads().running or p.loads().queued) and time.monotonic() < deadline:
      time.sleep(0.2)
    time.sleep(2.0)
    res["after"] = dict(
      rss_mb=_rss_mb(proc.pid), rss_before_mb=rss0, small=_stats([_timed(p.small) for _ in range(reps)])
    )
    print(f"after: {res['after']}", flush=True)
    channel.close()
  finally:
    proc.terminate()
    try:
      proc.wait(60)
    except subprocess.TimeoutExpired:
      proc.kill()
  res["seconds"] = time.perf_counter() - t0
  write_results(args.out, res, _markdown(res))
  return 0


def _markdown(r: dict) -> str:
  idle_small = r["idle"]["small"]["p50_ms"]
  rows = [
    ("idle", r["idle"]["small"], r["idle"]["health"]),
    (
      f"{r['text_flood_clients']} clients sending {r['max_prompt_bytes'] / 2**20:.2f} MB texts",
      r["text"]["small"],
      r["text"]["health"],
    ),
    ("after both", r["after"]["small"], None),
  ]
  lines = ["| phase | small request p50 ms | p99 ms | / idle p50 | Health p50 ms | Health max ms |", "|---" * 6 + "|"]
  for name, s, h in rows:
    hh = f"{h['p50_ms']:.1f} | {h['max_ms']:.1f}" if h else " | "
    lines.append(f"| {name} | {s['p50_ms']:.0f} | {s['p99_ms']:.0f} | {s['p50_ms'] / idle_small:.2f}x | {hh} |")
  sp = r["streams_phase"]
  lines += [
    "",
    f"{r['streams']} open streams of one client ({sp['queued']} queued in the engine):",
    "",
    "| call | p50 ms | max ms |",
    "|---|---|---|",
  ]
  lines += [f"| {k} | {sp[k]['p50_ms']:.1f} | {sp[k]['max_ms']:.1f} |" for k in ("health", "loads", "abort")]
  o, o0 = sp["other_first_token"], r["idle"]["other_first_token"]
  lines += [
    "",
    f"Another client's small request meanwhile (fair sharing): first token p50 {o['p50_ms']:.0f} ms, "
    f"max {o['max_ms']:.0f} ms, against {o0['p50_ms']:.0f} / {o0['max_ms']:.0f} ms idle "
    f"({o['p50_ms'] / o0['p50_ms']:.2f}x at p50).",
  ]
  lines += [
    "",
    f"Streams past the queue bound: {', '.join(sp['over_queue_codes'])} "
    f"({sp['over_queue_ms'] / 20:.1f} ms each). Text 1 byte over the limit: {r['over_limit']['code']} in "
    f"{r['over_limit']['ms']:.0f} ms. Flood requests: {r['text']['flood_requests']} "
    f"({', '.join(r['text']['flood_codes'])}).",
    "",
    f"Server RSS: {r['after']['rss_before_mb']:.0f} MB before, {r['text']['rss_mb']:.0f} MB during the text "
    f"flood, {sp['rss_mb']:.0f} MB with the streams open, {r['after']['rss_mb']:.0f} MB after "
    f"({100 * (r['after']['rss_mb'] / r['after']['rss_before_mb'] - 1):+.1f}%).",
  ]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  sys.exit(main())
