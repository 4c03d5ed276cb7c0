"""Prefill/decode disaggregation: the KV transfer's throughput, and what arriving prefills do to running decodes.

  python benchmarks/disaggregation.py [--quick] [--sections transfer,latency] [--out benchmarks/results/disaggregation]

transfer  one process offers float32 arrays on its jax.experimental.transfer server (TransferEndpoint, as a
          prefill server does), another pulls them, over loopback: in its own process (--noisolate-kv-pulls)
          and through the pull worker a decode server uses by default (pull_worker.PullWorker: a child
          process, a memfd, a device_put), alternated; GB/s per size, median of 3 pulls each, next to a plain
          memcpy (numpy copyto into a warm buffer) of the same bytes in the pulling process, in the same run.
latency   the default model (float32) behind real servers, on this 2-core machine with each server pinned to a
          core (taskset): colocated = one server on core 1; PD = a prefill server on core 0 and a decode server
          on core 1 (so PD has twice the hardware, as a deployment with prefill machines does). 8 streams with
          2100-token prompts decode (ignore_eos; every decode step scores one 4096-key indexer window, so no new
          shape compiles while measuring); once each has 20 tokens and 3 s later, 4 long prompts (1k-4k tokens)
          arrive at once. Reported: the streams' inter-token latency p50 / p99 while the long prompts prefill (from their
          arrival to the last one's first token) and before they arrive, and the long prompts' time to first
          token. Each setup runs the scenario twice untimed first (every shape compiles), then measured; a
          timed run in which a stream ended before the last long prompt's first token (a stall on a loaded
          machine) is run again, up to 3 times.
          Modes: colocated and PD, each with a dense and a HiSparse decode server (the prefill server is dense;
          HiSparse: the model's sizes, with a host pool holding every request of the scenario).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from cli import OUT_HELP, default_out, out_path, sections, write_results  # noqa: E402

SECTIONS = ("transfer", "latency")
STREAMS, WARM_TOKENS = 8, 20
TIMED_ATTEMPTS = 3  # timed runs tried before a scenario is called too short for this machine (run_latency)


# -------------------------------------------------------------------------------------------- transfer
def _offer_worker(sizes_mib: list[int], reps: int) -> None:
  """Offers reps arrays of each size under uuids 1, 2, ...; prints its transfer address; waits for stdin EOF."""
  import jax.numpy as jnp

  from hisparse_jax.serving.disaggregation import TransferEndpoint

  t = TransferEndpoint()
  uuid = 0
  for mib in sizes_mib:
    for _ in range(2 * (reps + 1)):  # in process and through the worker, each + a warm-up pull
      uuid += 1
      x = jnp.full((mib << 18,), float(uuid), jnp.float32)
      x.block_until_ready()
      t.offer(uuid, [x])
  print(t.address, flush=True)
  sys.stdin.read()


def run_transfer(sizes_mib: list[int], reps: int = 3) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from hisparse_jax.serving.disaggregation import TransferEndpoint
  from hisparse_jax.serving.pull_worker import PullWorker

  worker = subprocess.Popen(
    [sys.executable, os.path.abspath(__file__), "--offer-worker", ",".join(map(str, sizes_mib)), str(reps)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  address = worker.stdout.readline().strip()
  here, isolated = TransferEndpoint(), PullWorker()
  device = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
  rows, uuid = [], 0
  try:
    for mib in sizes_mib:
      spec = jax.ShapeDtypeStruct((mib << 18,), jnp.float32, sharding=device)
      times, worker_times = [], []
      for rep in range(reps + 1):
        for puller, out in ((here, times), (isolated, worker_times)):
          uuid += 1
          t0 = time.perf_counter()
          [x] = puller.pull(address, uuid, [spec])
          x.block_until_ready()
          dt = time.perf_counter() - t0
          assert float(x[-1]) == float(uuid)
          if rep:
            out.append(dt)
      src = np.ones(mib << 18, np.float32)
      dst = np.empty_like(src)
      np.copyto(dst, src)  # warm
      copies = []
      for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
      nbytes = mib << 20
      pull_gbs, copy_gbs = nbytes / np.median(times) / 1e9, nbytes / np.median(copies) / 1e9
      rows.append(
        dict(
          mib=mib,
          pull_ms=1e3 * float(np.median(times)),
          pull_gbs=pull_gbs,
          worker_pull_ms=1e3 * float(np.median(worker_times)),
          worker_cost=float(np.median(worker_times) / np.median(times)),
          memcpy_ms=1e3 * float(np.median(copies)),
          memcpy_gbs=copy_gbs,
          ratio=pull_gbs / copy_gbs,
        )
      )
      print(rows[-1], flush=True)
  finally:
    isolated.close()
    worker.stdin.close()
    worker.wait(30)
  return rows


# --------------------------------------------------------------------------------------------- latency
def _prompt(n: int, seed: int, vocab: int) -> list[int]:
  import numpy as np

  return np.random.default_rng(seed).integers(2, vocab, n).tolist()


def _scenario(
  stub, long_prompts: list[int], seed: int, new_tokens: int, vocab: int, before_s: float, stream_prompt: int
) -> dict:
  """One run of the scenario (module docstring) against a server's stub: stamps and TTFTs."""
  import grpc

  from hisparse_jax.proto import hisparse_pb2 as pb

  stamps = {i: [] for i in range(STREAMS)}
  ready = threading.Barrier(STREAMS + 1)
  calls = []

  def stream(i):
    req = pb.GenerateRequest(
      input_ids=pb.TokenIds(ids=_prompt(stream_prompt, seed + i, vocab)), max_new_tokens=new_tokens, ignore_eos=True
    )
    call = stub.Generate(req, timeout=3600)
    calls.append(call)
    n = 0
    try:
      for msg in call:
        for _ in msg.token_ids:
          stamps[i].append(time.monotonic())
          n += 1
          if n == WARM_TOKENS:
            ready.wait()
    except grpc.RpcError as e:  # cancelled once the scenario is over
      if e.code() != grpc.StatusCode.CANCELLED:
        raise

  def long(n, j):
    t0 = time.monotonic()
    req = pb.GenerateRequest(
      input_ids=pb.TokenIds(ids=_prompt(n, seed + 100 + j, vocab)), max_new_tokens=2, ignore_eos=True
    )
    call = stub.Generate(req, timeout=3600)
    next(call)
    ttft = time.monotonic() - t0
    *_, final = call
    return ttft, final.prefill_seconds, final.transfer_seconds

  with concurrent.futures.ThreadPoolExecutor(STREAMS + len(long_prompts)) as pool:
    streams = [pool.submit(stream, i) for i in range(STREAMS)]
    ready.wait(timeout=600)
    t_ready = time.monotonic()
    time.sleep(before_s)  # the streams alone: the "before" latencies
    t_arrive = time.monotonic()
    longs = [f.result() for f in [pool.submit(long, n, j) for j, n in enumerate(long_prompts)]]
    ttfts = [t for t, _, _ in longs]
    t_done = t_arrive + max(ttfts)
    for call in calls:
      call.cancel()
    for f in streams:
      f.result()
    return dict(
      stamps=stamps,
      t_ready=t_ready,
      t_arrive=t_arrive,
      t_done=t_done,
      ttfts=ttfts,
      prefill_s=[p for _, p, _ in longs],
      transfer_s=[x for _, _, x in longs],
    )


def _itl(stamps: dict, lo: float, hi: float):
  import numpy as np

  gaps = []
  for ts in stamps.values():
    ts = np.asarray(ts)
    inside = ts[(ts > lo) & (ts <= hi)]
    before = ts[ts <= lo][-1:]
    gaps += np.diff(np.concatenate([before, inside])).tolist()
  return np.asarray(gaps)


def run_latency(
  long_prompts: list[int],
  model_flags: list[str],
  new_tokens: int,
  vocab: int,
  before_s: float,
  hisparse_sizes: dict,
  stream_prompt: int = 300,
  setups=None,
  warm_runs: int = 2,
) -> list[dict]:
  import grpc
  import numpy as np

  from hisparse_jax.proto import hisparse_pb2_grpc
  from tests.multiprocess import start_server, stop

  pin = lambda core: ["taskset", "-c", str(core)]  # noqa: E731
  # (new_tokens: enough for the streams to outlive the scenario; they are cancelled after it)
  rows = []
  # HiSparse: a host pool that holds every request of the scenario at once (the model's own ratio sizes it for
  # far shorter requests; admission would then queue the streams).
  slots = int(next(f.split("=")[1] for f in model_flags if f.startswith("--max-running-requests=")))
  tokens = STREAMS * (stream_prompt + new_tokens) + sum(long_prompts) + len(long_prompts) * 64
  hisparse = dict(
    hisparse_sizes, host_to_device_ratio=-(-tokens // (slots * (hisparse_sizes["device_buffer_size"] + 1)))
  )
  for mode, decode in setups or [(m, d) for m in ("colocated", "pd") for d in ("dense", "hisparse")]:
    hs = ["--enable-hisparse", f"--hisparse-config={json.dumps(hisparse)}"] if decode == "hisparse" else []
    procs = []
    try:
      if mode == "colocated":
        server, port = start_server([*model_flags, *hs], prefix=pin(1))
        procs.append(server)
      else:
        prefill, pport = start_server([*model_flags, "--disaggregation-mode=prefill"], prefix=pin(0))
        procs.append(prefill)
        server, port = start_server(
          [*model_flags, *hs, "--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{pport}"], prefix=pin(1)
        )
        procs.append(server)
      stub = hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
      for seed in range(1, warm_runs + 1):  # untimed: every shape the scenario meets compiles (twice: the order
        _scenario(stub, long_prompts, seed, new_tokens, vocab, before_s, stream_prompt)  # of joins varies)
        time.sleep(2)  # the cancelled streams leave
      for attempt in range(TIMED_ATTEMPTS):
        run = _scenario(stub, long_prompts, warm_runs + 1 + attempt, new_tokens, vocab, before_s, stream_prompt)
        ended = min(ts[-1] for ts in run["stamps"].values())
        if ended > run["t_done"]:
          break
        # No inter-token gap to measure "during": a stream ended before the last long prompt's first token. On a
        # loaded machine this is a stall (a late compile, another process on the core); the next run is timed
        # afresh. Every run failing means the scenario is too short for this machine.
        print(
          f"timed run {attempt + 1}: a stream finished {ended - run['t_arrive']:+.3f} s after the long prompts "
          f"arrived, before their last first token (+{run['t_done'] - run['t_arrive']:.3f} s)",
          flush=True,
        )
        time.sleep(2)
      else:
        raise RuntimeError(
          f"in each of {TIMED_ATTEMPTS} timed runs a stream finished before the long prompts' last "
          "first token: give the streams more new tokens or a shorter wait before the arrival"
        )
      during = _itl(run["stamps"], run["t_arrive"], run["t_done"])
      before = _itl(run["stamps"], run["t_ready"], run["t_arrive"])
      ttfts = np.asarray(run["ttfts"])
      rows.append(
        dict(
          mode=mode,
          decode=decode,
          long_prompts=long_prompts,
          itl_before_p50_ms=1e3 * float(np.percentile(before, 50)),
          itl_before_p99_ms=1e3 * float(np.percentile(before, 99)),
          itl_p50_ms=1e3 * float(np.percentile(during, 50)),
          itl_p99_ms=1e3 * float(np.percentile(during, 99)),
          itl_samples=int(len(during)),
          ttft_mean_s=float(ttfts.mean()),
          ttft_max_s=float(ttfts.max()),
          pd_prefill_mean_s=float(np.mean(run["prefill_s"])),
          pd_transfer_mean_s=float(np.mean(run["transfer_s"])),
        )
      )
      print(rows[-1], flush=True)
    finally:
      stop(procs)
  return rows


def markdown(res: dict) -> str:
  out = []
  if "transfer" in res:
    out += [
      "KV transfer (jax.experimental.transfer over loopback) vs memcpy of the same bytes:",
      "",
      "| MiB | pull ms | pull GB/s | memcpy ms | memcpy GB/s | pull / memcpy | pull through the worker ms | "
      "worker / in process |",
      "|---|---|---|---|---|---|---|---|",
    ]
    out += [
      f"| {r['mib']} | {r['pull_ms']:.1f} | {r['pull_gbs']:.2f} | {r['memcpy_ms']:.1f} | {r['memcpy_gbs']:.2f} | "
      f"{r['ratio']:.2f} | {r['worker_pull_ms']:.1f} | {r['worker_cost']:.2f}x |"
      for r in res["transfer"]
    ]
    out.append("")
  if "latency" in res:
    r0 = res["latency"][0]
    out += [
      f"{STREAMS} streams decoding while {len(r0['long_prompts'])} prompts of {r0['long_prompts']} tokens "
      "arrive (default model, float32; colocated: 1 core; PD: prefill 1 core + decode 1 core):",
      "",
      "| setup | decode server | ITL p50 / p99 before (ms) | ITL p50 / p99 during (ms) | p99 during / before | "
      "long prompts' TTFT mean / max (s) | of which prefill server / transfer (s, mean) |",
      "|---|---|---|---|---|---|---|",
    ]
    out += [
      f"| {r['mode']} | {r['decode']} | {r['itl_before_p50_ms']:.1f} / {r['itl_before_p99_ms']:.1f} | "
      f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['itl_p99_ms'] / r['itl_before_p99_ms']:.1f}x | "
      f"{r['ttft_mean_s']:.2f} / {r['ttft_max_s']:.2f} | "
      + (f"{r['pd_prefill_mean_s']:.2f} / {r['pd_transfer_mean_s']:.3f} |" if r["mode"] == "pd" else "- |")
      for r in res["latency"]
    ]
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke)")
  ap.add_argument("--sections", type=sections(SECTIONS), default=",".join(SECTIONS))
  ap.add_argument("--out", type=out_path, help=OUT_HELP)
  ap.add_argument("--offer-worker", nargs=2, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  args.out = args.out or default_out("disaggregation", args.quick)
  if args.offer_worker:
    _offer_worker([int(x) for x in args.offer_worker[0].split(",")], int(args.offer_worker[1]))
    return 0
  t0 = time.perf_counter()
  res = {}
  if "transfer" in args.sections:
    res["transfer"] = run_transfer([1, 4] if args.quick else [4, 16, 64, 256])
  if "latency" in args.sections:
    if args.quick:
      from tests.tiny_model import tiny_model_dir
      from tests.tiny_model import TINY_HISPARSE

      flags = [
        f"--model-path={tiny_model_dir()}",
        "--max-seq-len=512",
        "--page-size=16",
        "--chunked-prefill-size=32",
        "--max-running-requests=16",
      ]
      # 60 + 440 tokens fill the tiny model's 512 positions: the streams (~1.5 ms a token here) outlive the
      # arrival 50 ms after their warm-up and the long prompts' prefill (~15 ms) on a fast machine too.
      res["latency"] = run_latency(
        [100, 200],
        flags,
        440,
        512,
        0.05,
        TINY_HISPARSE,
        stream_prompt=60,
        setups=[("colocated", "dense"), ("pd", "hisparse")],
        warm_runs=1,
      )
    else:
      flags = ["--dtype=float32", "--max-seq-len=8192", "--chunked-prefill-size=512", "--max-running-requests=16"]
      from hisparse_jax.default_model import DEFAULT_HISPARSE_CONFIG

      res["latency"] = run_latency(
        [1024, 2048, 3072, 4096], flags, 1900, 129280, 3.0, DEFAULT_HISPARSE_CONFIG, stream_prompt=2100
      )
  write_results(args.out, {**res, "seconds": time.perf_counter() - t0}, markdown(res))
  return 0


if __name__ == "__main__":
  sys.exit(main())
