"""Bounded loopback load and fault tests: 256 concurrent streams, an abort storm, metrics."""

import concurrent.futures
import random
import socket
import time
import urllib.request

import grpc
import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, Request
from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving.client import generate
from hisparse_jax.serving.metrics import ServerMetrics
from hisparse_jax.serving.server import ServerLimits, serve
from tests.tiny_model import TINY_HISPARSE, tiny_model_dir

N_STREAMS = 256
N_PROMPTS = 32
MAX_NEW = 6
SLOTS = 10
# Deterministic engines: a stream's tokens do not depend on what else runs.
COMMON = dict(max_running_requests=SLOTS, max_seq_len=128, page_size=16, chunked_prefill_size=64, deterministic=True)


def prompts():
  rng = np.random.default_rng(11)
  return [rng.integers(2, 512, int(n)).tolist() for n in rng.integers(12, 60, N_PROMPTS)]


@pytest.fixture(scope="module")
def solo():
  """Each prompt decoded alone: the reference every concurrent stream must equal."""
  roomy = dict(TINY_HISPARSE, host_to_device_ratio=16)  # pool sizes do not change the numerics
  eng = Engine(tiny_model_dir(), hisparse=HiSparseConfig(**roomy), **COMMON)
  out = []
  for i, p in enumerate(prompts()):
    r = Request(str(i), p, MAX_NEW)
    eng.submit(r)
    eng.run()
    out.append(r.output_ids)
  return out


@pytest.fixture(scope="module")
def server():
  # 10 request slots: most of the 256 streams queue.
  engine = Engine(tiny_model_dir(), hisparse=HiSparseConfig(**TINY_HISPARSE), max_queued_requests=N_STREAMS, **COMMON)
  metrics = ServerMetrics(row_bytes=engine.config.latent_dim * engine.dtype.itemsize)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    metrics_port = s.getsockname()[1]
  metrics.serve(metrics_port)
  # One client opens all 256 streams: the per-client cap (half the streams by default) is lifted.
  srv, loop, port = serve(
    engine, None, "127.0.0.1", 0, metrics=metrics, limits=ServerLimits(max_streams_per_client=N_STREAMS + 8)
  )
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  yield engine, hisparse_pb2_grpc.HiSparseInferenceStub(channel), metrics, metrics_port
  channel.close()
  srv.stop(0).wait()
  loop.stop()


def stream(stub, prompt, rid, timeout=120):
  msgs = list(generate(stub, input_ids=prompt, max_new_tokens=MAX_NEW, request_id=rid, timeout=timeout))
  return [t for m in msgs for t in m.token_ids], msgs[-1]


def test_256_concurrent_streams_equal_solo_and_release_everything(server, solo):
  engine, stub, metrics, metrics_port = server
  base = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  ps = prompts()
  start = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(N_STREAMS) as pool:
    futures = [pool.submit(stream, stub, ps[i % N_PROMPTS], f"r{i}") for i in range(N_STREAMS)]
    results = [f.result() for f in futures]
  elapsed = time.monotonic() - start
  assert elapsed < 240, f"256 streams took {elapsed:.0f} s"
  lost = [i for i, (_, final) in enumerate(results) if not final.finished]
  assert not lost
  for i, (tokens, final) in enumerate(results):
    assert tokens == solo[i % N_PROMPTS], f"stream {i} differs from its solo decode"
    assert final.finish_reason in (hisparse_pb2.LENGTH, hisparse_pb2.STOP)
  loads = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  assert (loads.running, loads.queued, loads.free_lanes, loads.free_host_rows, loads.device_kv_bytes_used) == (
    0,
    0,
    base.free_lanes,
    base.free_host_rows,
    0,
  )
  # Metrics saw every token and the swap-in traffic.
  total = sum(len(t) for t, _ in results)
  assert metrics.registry.get_sample_value("hisparse_generated_tokens_total") >= total
  assert metrics.registry.get_sample_value("hisparse_time_to_first_token_seconds_count") >= N_STREAMS
  assert metrics.registry.get_sample_value("hisparse_swap_in_misses_total", {"layer": "0"}) > 0
  page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
  assert "hisparse_inter_token_latency_seconds_bucket" in page and 'hisparse_host_pool_rows{state="free"}' in page
  assert 'hisparse_kv_pool_pages{memory="device",pool="index",state="used"} 0.0' in page


def test_abort_storm_leaves_the_rest_unchanged(server, solo):
  engine, stub, _, _ = server
  base = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  ps = prompts()
  rng = random.Random(5)
  n = 96
  victims = set(rng.sample(range(n), n // 2))
  with concurrent.futures.ThreadPoolExecutor(n + 8) as pool:
    futures = {i: pool.submit(stream, stub, ps[i % N_PROMPTS], f"s{i}") for i in range(n)}

    def storm():
      for i in sorted(victims, key=lambda _: rng.random()):
        time.sleep(rng.random() * 0.01)  # some land before admission, some mid-decode
        stub.Abort(hisparse_pb2.AbortRequest(request_id=f"s{i}"), timeout=10)

    pool.submit(storm).result()
    results = {i: f.result() for i, f in futures.items()}
  for i, (tokens, final) in results.items():
    assert final.finished
    if final.finish_reason == hisparse_pb2.ABORT:
      assert i in victims and tokens == solo[i % N_PROMPTS][: len(tokens)]
    else:
      assert tokens == solo[i % N_PROMPTS]
  loads = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
  assert (loads.running, loads.queued, loads.free_host_rows, loads.device_kv_bytes_used) == (
    0,
    0,
    base.free_host_rows,
    0,
  )


def test_tiny_pools_under_a_burst_queue_or_refuse_then_recover():
  # One request slot and an index pool of 4 pages of 16 tokens: a 100-token request can never fit.
  hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4)
  staging, hot, index_page = 8 * 16 * 3 * 48 * 4, 17 * 3 * 48 * 4 + 3 * (8 * 16 + 12), 16 * 3 * 16 * 4
  eng = Engine(
    tiny_model_dir(),
    hisparse=hs,
    max_running_requests=1,
    max_seq_len=128,
    page_size=16,
    chunked_prefill_size=64,
    max_device_kv_bytes=staging + hot + 4 * index_page,
  )
  assert eng.memory_plan.pools["index"][1] == 4 and eng.memory_plan.request_slots == 1
  srv, loop, port = serve(eng, None, "127.0.0.1", 0)
  stub = hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
  try:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      big = [pool.submit(stream, stub, list(range(2, 102)), f"b{i}") for i in range(3)]
      small = [pool.submit(stream, stub, list(range(2, 30)), f"m{i}") for i in range(5)]
      for f in big:
        with pytest.raises(grpc.RpcError) as e:
          f.result()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
      outs = [f.result()[0] for f in small]
    assert all(o == outs[0] and len(o) == MAX_NEW for o in outs)
    assert stream(stub, list(range(2, 30)), "after")[0] == outs[0]
  finally:
    srv.stop(0).wait()
    loop.stop()


def test_gauges_return_to_idle_after_cancel_and_abort(server):
  """A cancelled stream and an aborted request on an otherwise idle server: the gauges come back to their idle
  values without another request running (as GetLoads does)."""
  engine, stub, metrics, _ = server
  gauge = lambda name, **labels: metrics.registry.get_sample_value(name, labels or None)
  for how in ("cancel", "abort"):
    call = stub.Generate(
      hisparse_pb2.GenerateRequest(
        input_ids=hisparse_pb2.TokenIds(ids=list(range(2, 60))), max_new_tokens=60, request_id=f"g-{how}"
      )
    )
    next(call)
    deadline = time.monotonic() + 10
    while gauge("hisparse_running_requests") != 1 and time.monotonic() < deadline:  # set after the step
      time.sleep(0.01)
    assert gauge("hisparse_running_requests") == 1
    if how == "cancel":
      call.cancel()
    else:
      stub.Abort(hisparse_pb2.AbortRequest(request_id=f"g-{how}"), timeout=10)
    deadline = time.monotonic() + 10
    while gauge("hisparse_running_requests") != 0 and time.monotonic() < deadline:
      time.sleep(0.02)
    assert gauge("hisparse_running_requests") == 0
    assert gauge("hisparse_host_pool_rows", state="used") == 0
    assert gauge("hisparse_kv_pool_pages", pool="index", memory="device", state="used") == 0
    assert gauge("hisparse_device_kv_bytes", state="total") == engine.loads()["device_kv_bytes_budget"] > 0


def test_burst_beyond_the_pools_preempts_keeps_serving_and_returns_to_baseline():
  """A burst of long requests through gRPC on a device pool that holds about two of them at their full length:
  requests queue, running ones are preempted when the pool runs out, every stream completes, and GetLoads'
  free pages return to the baseline."""
  eng = Engine(
    tiny_model_dir(),
    max_running_requests=4,
    max_seq_len=128,
    page_size=16,
    chunked_prefill_size=32,
    max_device_kv_bytes=12 * 16 * 768,
  )
  srv, loop, port = serve(eng, None, "127.0.0.1", 0)
  stub = hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
  try:
    base = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
    assert [(p.name, p.pages_total, p.pages_free) for p in base.pools] == [("kv", 12, 12)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      futures = [
        pool.submit(
          lambda i=i: list(
            generate(stub, input_ids=list(range(2 + i, 32 + i)), max_new_tokens=60, ignore_eos=True, timeout=300)
          )
        )
        for i in range(6)
      ]
      finals = [f.result()[-1] for f in futures]
    assert all(m.finished and m.completion_tokens == 60 for m in finals)
    after = stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10)
    assert after.preemptions > 0 and sum(m.num_preemptions for m in finals) == after.preemptions
    assert [(p.name, p.pages_total, p.pages_free) for p in after.pools] == [("kv", 12, 12)]
    assert (after.running, after.queued, after.device_kv_bytes_used) == (0, 0, 0)
    assert stream(stub, list(range(2, 30)), "after")[1].finished  # still serving
  finally:
    srv.stop(0).wait()
    loop.stop()
