"""Prefill/decode disaggregation (hisparse_jax/serving/disaggregation.py): prefill servers compute prompts' KV,
decode servers pull it (jax.experimental.transfer) and decode; servers as subprocesses on loopback."""

import asyncio
import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from hisparse_jax.proto import hisparse_pb2 as pb
from hisparse_jax.proto import hisparse_pb2_grpc
from tests.multiprocess import REPO, free_port, start_server, stop
from tests.tiny_model import tiny_model_dir

# Prompts shorter and longer than the hot buffer (16) and than a prefill chunk (32).
PROMPTS = [list(range(5, 10)), list(range(21, 41)), list(range(100, 150)), [7] * 33]
HS = '{"top_k": 8, "device_buffer_size": 16, "host_to_device_ratio": 4}'
COMMON = [
  "--max-seq-len=256",
  "--page-size=16",
  "--chunked-prefill-size=32",
  "--max-running-requests=4",
  "--deterministic",
]
NEW = 8


def _model():
  return [f"--model-path={tiny_model_dir()}", *COMMON]


@pytest.fixture(scope="module")
def colocated():
  """The tokens of the colocated engine (one device, full-batch steps) for PROMPTS."""
  from hisparse_jax.engine import Engine, Request

  e = Engine(
    tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4, deterministic=True
  )
  reqs = [Request(str(i), p, NEW) for i, p in enumerate(PROMPTS)]
  for r in reqs:
    e.submit(r)
  e.run()
  return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def servers():
  """A prefill server (dense) and two decode servers (dense, HiSparse) pulling from it; the prefill server and the
  HiSparse decode server (which pulls) have their KV transfer servers on fixed ports."""
  procs = []
  try:
    prefill, pport = start_server([*_model(), "--disaggregation-mode=prefill", f"--transfer-port={free_port()}"])
    procs.append(prefill)
    decode = {}
    for name, flags in (
      ("dense", []),
      ("hisparse", ["--enable-hisparse", f"--hisparse-config={HS}", f"--transfer-port={free_port()}"]),
    ):
      proc, port = start_server(
        [*_model(), *flags, "--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{pport}", "--metrics-port=0"]
      )
      procs.append(proc)
      decode[name] = port
      decode[name + " metrics"] = proc.listening_line.split("metrics at ")[1].strip()
    yield pport, decode
  finally:
    stop(procs)


def _stub(port):
  return hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _generate(stub, prompt, n=NEW, **kw):
  msgs = list(stub.Generate(pb.GenerateRequest(input_ids=pb.TokenIds(ids=prompt), max_new_tokens=n, **kw), timeout=120))
  assert msgs[-1].finished
  return [t for m in msgs for t in m.token_ids], msgs[-1]


def _idle(stub):
  """Every request slot and page of the server is free (GetLoads)."""
  loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=30)
  return loads.running == 0 and loads.queued == 0 and all(p.pages_free == p.pages_total for p in loads.pools)


@pytest.mark.parametrize("mode", ["dense", "hisparse"])
def test_pd_tokens_equal_the_colocated_server(servers, colocated, mode):
  """Concurrent requests through a decode server: the colocated greedy tokens; the final message gives the
  prefill server's time, the transfer's time and bytes; every page comes back on both servers."""
  pport, decode = servers
  # --transfer-port: the prefill server's transfer server announces and holds that port.
  info = hisparse_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(f"127.0.0.1:{pport}")).Info(
    pb.InfoRequest(), timeout=30
  )
  with socket.socket() as s, pytest.raises(OSError):
    s.bind(("127.0.0.1", int(info.transfer_address.rpartition(":")[2])))
  stub = _stub(decode[mode])
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(lambda p: _generate(stub, p), PROMPTS))
  assert [tokens for tokens, _ in results] == colocated
  for (_, final), prompt in zip(results, PROMPTS):
    assert final.prefill_seconds > 0 and final.transfer_seconds > 0 and final.decode_seconds > 0
    # latent (kv_lora 32 + rope 16) float32 + indexer keys (16) float32, 3 layers, positions padded to 2^k >= 16
    positions = max(16, 1 << (len(prompt) - 1).bit_length())
    assert final.transfer_bytes == 3 * positions * (48 + 16) * 4
    if mode == "hisparse" and len(prompt) > 16:
      assert final.swap_in_misses > 0
  assert _idle(stub) and _idle(_stub(pport))
  import urllib.request

  text = urllib.request.urlopen(decode[mode + " metrics"], timeout=30).read().decode()
  metrics = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
  assert metrics["hisparse_pd_kv_transfer_bytes_total"] >= sum(r[1].transfer_bytes for r in results)
  assert metrics["hisparse_pd_kv_transfer_seconds_count"] >= len(PROMPTS)
  assert metrics["hisparse_pd_kv_transfer_gigabytes_per_second"] > 0


def test_abort_while_the_kv_is_in_flight_leaves_nothing_stale(servers, colocated):
  """Streams cancelled at once (their prefill or transfer in flight): both servers return to idle, and later
  requests, which reuse the freed pages, get the colocated tokens."""
  pport, decode = servers
  stub = _stub(decode["hisparse"])
  for prompt in PROMPTS[1:3] * 2:
    call = stub.Generate(
      pb.GenerateRequest(input_ids=pb.TokenIds(ids=prompt), max_new_tokens=50, ignore_eos=True), timeout=120
    )
    time.sleep(0.05)
    call.cancel()
  deadline = time.monotonic() + 60
  while not (_idle(stub) and _idle(_stub(pport))) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert _idle(stub) and _idle(_stub(pport))
  assert [_generate(stub, p)[0] for p in PROMPTS] == colocated


def test_a_killed_prefill_server(colocated):
  """Two prefill servers, one killed: requests are retried once on the other and get the colocated tokens.
  The last one killed too: requests fail with UNAVAILABLE, the decode server's pages are all free and it
  keeps answering."""
  procs = []
  try:
    a, aport = start_server([*_model(), "--disaggregation-mode=prefill"])
    b, bport = start_server([*_model(), "--disaggregation-mode=prefill"])
    procs += [a, b]
    dec, dport = start_server(
      [
        *_model(),
        "--enable-hisparse",
        f"--hisparse-config={HS}",
        "--disaggregation-mode=decode",
        f"--prefill-servers=127.0.0.1:{aport},127.0.0.1:{bport}",
      ]
    )
    procs.append(dec)
    stub = _stub(dport)
    assert _generate(stub, PROMPTS[0])[0] == colocated[0]  # prefilled on a (round-robin: the next goes to b)
    # b killed while it prefills the next request (its first: it compiles, seconds): retried on a.
    call = stub.Generate(pb.GenerateRequest(input_ids=pb.TokenIds(ids=PROMPTS[2]), max_new_tokens=NEW), timeout=120)
    time.sleep(0.5)
    b.kill()
    b.communicate()
    assert [t for m in call for t in m.token_ids] == colocated[2]
    assert [_generate(stub, p)[0] for p in PROMPTS] == colocated  # round-robin reaches the dead one: retried
    a.kill()
    a.communicate()
    with pytest.raises(grpc.RpcError) as e:
      _generate(stub, PROMPTS[1])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "prefill failed" in e.value.details()
    assert _idle(stub)
    assert stub.GetLoads(pb.GetLoadsRequest(), timeout=30).free_lanes == 4
  finally:
    stop(procs)


def test_a_lost_prefill_call_is_told_apart_from_a_tls_mismatch():
  """gRPC's words for a prefill server that exits mid-call ("Stream removed (Socket closed)") or stops gracefully
  ("Cancelling all calls") get the likely cause in the decode server's error; the client's hint for "Socket
  closed" (a TLS server refusing plain text) is for its own connection as it connects, not for those relayed
  words nor for a server lost mid-stream."""
  from hisparse_jax.serving.client import _rpc_error
  from hisparse_jax.serving.disaggregation import prefill_error_text

  U = grpc.StatusCode.UNAVAILABLE
  assert prefill_error_text(U, "Stream removed (Socket closed)") == (
    "UNAVAILABLE: Stream removed (Socket closed) (the connection was lost mid-call: did that prefill server exit?)"
  )
  assert prefill_error_text(U, "Cancelling all calls") == (
    "UNAVAILABLE: Cancelling all calls (that prefill server is shutting down)"
  )
  assert prefill_error_text(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy") == "RESOURCE_EXHAUSTED: busy"

  class Failed(grpc.RpcError):
    def __init__(self, details):
      self._details = details

    def code(self):
      return U

    def details(self):
      return self._details

  tls_hint = "(a server with TLS closes a plain-text connection: pass --tls-ca-file)"
  refused = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:5: Socket closed"
  assert _rpc_error(Failed(refused), tls=False).endswith(tls_hint)  # (gRPC's words for a TLS port, test_server_limits)
  assert not _rpc_error(Failed(refused), tls=True).endswith(tls_hint)
  # A server that exits mid-stream (a two-process deployment losing a process) is not a TLS mismatch.
  assert _rpc_error(Failed("Stream removed (Socket closed)"), tls=False) == (
    "UNAVAILABLE: Stream removed (Socket closed) (the connection was lost mid-call: did the server exit?)"
  )
  relayed = "prefill failed: 127.0.0.1:5: " + prefill_error_text(U, "Stream removed (Socket closed)")
  assert _rpc_error(Failed(relayed), tls=False) == f"UNAVAILABLE: {relayed}"


class _SilentPrefill(hisparse_pb2_grpc.PrefillServiceServicer):
  """A prefill server whose offers never arrive: its Info is right, its PrefillOffer names a uuid its transfer
  server never offers (a pull of it blocks), and it records whether the caller acknowledged. With hang=True it
  sends no offer at all, as a prefill server hung alive, and records when the caller cancels the stream."""

  ROW_BYTES = 768  # the tiny model's KV bytes per position: 3 layers x (48 + 16) float32

  def __init__(self, info, address, hang=False, refuse=None, endpoint=None, **offer):
    announced = pb.InfoResponse(transfer_address=address, page_size=16)
    announced.MergeFrom(info)  # (the Info's own address and page size, where it names them)
    self.info, self.transfer_address, self.acks = announced, address, []
    self.hang, self.cancelled, self.refuse = hang, threading.Event(), refuse
    self.endpoint = endpoint  # a TransferEndpoint: each offer's arrays are really offered there (zeros)
    self.calls = self.info_calls = 0
    # The offer's layout: the Info's unless overridden (a prefill server restarted with other flags).
    self.offer = {
      **dict(
        num_layers=info.num_layers,
        latent_dim=info.latent_dim,
        index_dim=info.index_dim,
        latent_dtype=info.latent_dtype,
        numerics=info.numerics,
        model_fingerprint=info.model_fingerprint,
      ),
      **offer,
    }

  def Info(self, request, context):
    self.info_calls += 1
    return self.info

  def Prefill(self, request_iterator, context):
    first = next(request_iterator)
    self.calls += 1
    if self.refuse is not None:  # (code, message), as a prefill server's engine refuses a request
      context.abort(*self.refuse)
    if self.hang:
      while context.is_active():
        time.sleep(0.05)
      self.cancelled.set()
      return
    n = len(first.request.input_ids.ids)
    positions = max(16, 1 << (n - 1).bit_length())
    if self.endpoint is not None:
      import jax.numpy as jnp

      self.endpoint.offer(
        12345, (jnp.zeros((3, positions, 48)), jnp.zeros((3, positions, 16)), jnp.array([7, 0], jnp.uint32))
      )
    yield pb.PrefillOffer(
      **{
        **dict(
          first_token=1,
          transfer_uuid=12345,
          transfer_address=self.transfer_address,
          kv_positions=positions,
          prefill_seconds=0.01,
          kv_bytes=positions * self.ROW_BYTES,
        ),
        **self.offer,
      }
    )
    for message in request_iterator:
      self.acks.append(message.received.pulled)


@pytest.mark.parametrize("case", ["timeout", "other layout", "other model", "no offer", "abort", "exhausted"])
def test_a_transfer_that_times_out(case):
  """A pull that does not finish within --transfer-timeout-s, an offer of another KV layout than the start-up
  check saw (the prefill server restarted with FP8 rows of bfloat16: 68 bytes, not 48 float32; refused before
  any pull), an offer of another checkpoint (restarted with other weights of the same shapes, whose KV would
  decode into other tokens without an error; refused before any pull), or a prefill server that sends no offer
  within --prefill-timeout-s (hung alive, long before the client's deadline): the request fails with UNAVAILABLE naming the cause, nothing is held, the decode server keeps
  serving, and a hung prefill server's stream is cancelled. An Abort of a request waiting on a hung prefill
  server ends its stream as ABORT at once (it waited for --prefill-timeout-s) and cancels the prefill there; a
  prefill server that refuses a request with RESOURCE_EXHAUSTED (too large for its memory) gives the client
  RESOURCE_EXHAUSTED, not UNAVAILABLE (a client retries that)."""
  from hisparse_jax.engine import Engine
  from hisparse_jax.serving.disaggregation import TransferEndpoint

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )
  transfer = TransferEndpoint()
  server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
  servicer = _SilentPrefill(
    info,
    transfer.address,
    **{
      "timeout": {},
      "no offer": {"hang": True},
      "abort": {"hang": True},
      "exhausted": {"refuse": (grpc.StatusCode.RESOURCE_EXHAUSTED, "request needs 4 pages of the kv pool")},
      "other layout": {"latent_dim": 68, "latent_dtype": "uint8", "numerics": "fp8"},
      "other model": {"model_fingerprint": "f" * 64},
    }[case],
  )
  hisparse_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  procs = []
  try:
    dec, dport = start_server(
      [
        *_model(),
        "--disaggregation-mode=decode",
        f"--prefill-servers=127.0.0.1:{port}",
        "--transfer-timeout-s=2",
        f"--prefill-timeout-s={600 if case == 'abort' else 3}",
      ]
    )
    procs.append(dec)
    stub = _stub(dport)
    start = time.monotonic()
    if case == "abort":
      call = stub.Generate(
        pb.GenerateRequest(input_ids=pb.TokenIds(ids=PROMPTS[1]), max_new_tokens=NEW, request_id="waiting"), timeout=120
      )
      time.sleep(1)
      assert stub.Abort(pb.AbortRequest(request_id="waiting"), timeout=30).aborted == 1
      msgs = list(call)
      assert msgs[-1].finished and msgs[-1].finish_reason == pb.ABORT and not any(m.token_ids for m in msgs)
      assert time.monotonic() - start < 30 and servicer.cancelled.wait(10)
      assert _idle(stub)
      return
    with pytest.raises(grpc.RpcError) as err:
      _generate(stub, PROMPTS[1])  # (the client's own deadline, 120 s, is not the one that ends it)
    if case == "exhausted":
      assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details() == (
        f"prefill failed: 127.0.0.1:{port}: RESOURCE_EXHAUSTED: request needs 4 pages of the kv pool"
      )
      assert _idle(stub)
      return
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    if case == "timeout":
      assert "the KV transfer took over --transfer-timeout-s 2" in err.value.details(), err.value.details()
    elif case == "no offer":
      assert "no KV offer within --prefill-timeout-s 3" in err.value.details(), err.value.details()
      assert servicer.cancelled.wait(10)
    elif case == "other model":
      assert (
        "offer from another model (fingerprint ffffffffffff..., here" in err.value.details()
        and "--model-path" in err.value.details()
      ), err.value.details()
      assert servicer.acks == []  # nothing pulled or acknowledged
    else:
      assert (
        "(3, 68, 16, 'uint8', 'fp8')" in err.value.details()
        and "(3, 48, 16, 'float32', '')" in err.value.details()
        and "--kv-cache-dtype" in err.value.details()
      ), err.value.details()
    assert time.monotonic() - start < 30
    assert _idle(stub)
    assert stub.GetLoads(pb.GetLoadsRequest(), timeout=30).free_lanes == 4
    if case == "no offer":
      # A client deadline gRPC cannot represent here (a client in another language may send 10^10 s; the
      # attempt failed at once with DEADLINE_EXCEEDED) is capped at MAX_TIMEOUT_S: the offer's own timeout ends it.
      from hisparse_jax.engine import Request, Unavailable
      from hisparse_jax.serving.disaggregation import PrefillClient

      client = PrefillClient(e, (f"127.0.0.1:{port}",), transfer, 2, prefill_timeout_s=1)
      with pytest.raises(Unavailable, match="no KV offer within --prefill-timeout-s 1$"):
        asyncio.run(client.prefill(Request("far", [3, 4, 5], 2), deadline_s=1e10))
  finally:
    stop(procs)
    server.stop(0)


def _fake_prefill_servers(*servicers, threads: int = 4):
  """Starts a gRPC server for each fake PrefillService (``threads`` streams at once); (servers, their host:port
  addresses)."""
  servers, addresses = [], []
  for servicer in servicers:
    servers.append(grpc.server(concurrent.futures.ThreadPoolExecutor(threads)))
    hisparse_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, servers[-1])
    addresses.append(f"127.0.0.1:{servers[-1].add_insecure_port('127.0.0.1:0')}")
    servers[-1].start()
  return servers, addresses


class _RecordingTransfer:
  """Pulls nothing: records each pull's address and returns zeros with the fake's proof."""

  def __init__(self):
    self.pulls = []

  def pull(self, address, uuid, specs, timeout_s=None):
    import numpy as np

    self.pulls.append(address)
    return [np.zeros(s.shape, s.dtype) for s in specs[:2]] + [np.array([7, 0], np.uint32)]


@pytest.mark.parametrize("fault", ["address", "positions", "bytes", "first token", "page size"])
def test_an_offer_unlike_what_its_prefill_server_announced_is_refused_before_any_pull(fault):
  """A peer's offer is checked before any pull against what that server announced (Info) and this server's
  limits: a transfer address other than the announced one (a listener there could crash jax's transfer
  library), positions other than max(its page size, the prompt's power of two) (2^20 positions for a 40-token
  prompt were pulled and decoded), bytes other than those positions' rows, a first token outside the
  vocabulary, a page size beyond this server's longest prompt. Each is the prefill server's fault: the next
  server is tried (it succeeds), UNAVAILABLE when none is left (never INVALID_ARGUMENT: the client's request
  was fine); nothing is pulled from the bad offer, whose stream is cancelled. The bad server's Info is asked
  again once before refusing (it may have restarted on another transfer port)."""
  from hisparse_jax.engine import Engine, Request, Unavailable
  from hisparse_jax.serving.disaggregation import PrefillClient

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )
  bad_offer = {
    "address": {"transfer_address": "127.0.0.1:9"},
    "positions": {"kv_positions": 1 << 20},
    "bytes": {"kv_bytes": 64 * 768 + 1},
    "first token": {"first_token": 1 << 20},
    "page size": {"kv_positions": 512, "kv_bytes": 512 * 768},
  }[fault]
  bad = _SilentPrefill(info, "127.0.0.1:1", **bad_offer)
  if fault == "page size":
    bad.info.page_size = 512  # (this server's longest prompt is 256 tokens)
  good = _SilentPrefill(info, "127.0.0.1:2")
  servers, addresses = _fake_prefill_servers(bad, good)
  try:
    transfer = _RecordingTransfer()
    client = PrefillClient(e, tuple(addresses), transfer, 10, prefill_timeout_s=10)
    req = Request("r", list(range(3, 43)), 2)  # 40 tokens: an offer of 64 positions
    asyncio.run(client.prefill(req))
    assert transfer.pulls == ["127.0.0.1:2"] and req.prompt_kv[0].shape == (3, 64, 48)
    assert bad.calls == 1 and bad.acks == [] and bad.info_calls == 2
    client = PrefillClient(e, (addresses[0],), transfer, 10, prefill_timeout_s=10)
    with pytest.raises(Unavailable) as err:
      asyncio.run(client.prefill(Request("r", list(range(3, 43)), 2)))
    want = {
      "address": "offer names transfer address '127.0.0.1:9'; that prefill server announced '127.0.0.1:1'",
      "positions": "offer of 1048576 positions for a prompt of 40 tokens; expected 64 (its --page-size 16, "
      "at most 256 here)",
      "bytes": "offer of 49153 bytes; 64 positions of this KV layout hold 49152",
      "first token": "offer's first token 1048576 is outside the vocabulary of",
      "page size": "offer of 512 positions for a prompt of 40 tokens; expected 512 (its --page-size 512, "
      "at most 256 here)",
    }[fault]
    assert str(err.value).startswith(f"prefill failed: {addresses[0]}: {want}"), str(err.value)
    assert transfer.pulls == ["127.0.0.1:2"]
  finally:
    for server in servers:
      server.stop(0)


def test_pulls_that_never_answer_do_not_outlive_their_requests():
  """A peer whose pulls never answer, 24 requests at once on the decode server's 8 pull threads with
  --transfer-timeout-s 1: every request fails UNAVAILABLE by its timeout, and a pull still queued then is
  dropped, not run for a request that has failed: an honest server's request right after succeeds (the 16
  queued stalls held the threads 2 s more, and a break-it run saw honest requests fail for 21 s after 80
  stalled ones)."""
  import numpy as np

  from hisparse_jax.engine import Engine, Request, Unavailable
  from hisparse_jax.serving.disaggregation import PULL_THREADS, PrefillClient

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )

  class Stalling:
    timeouts = []  # of each stalled pull, as given

    def pull(self, address, uuid, specs, timeout_s=None):
      if address == "127.0.0.1:7":
        self.timeouts.append(timeout_s)
        time.sleep(timeout_s)
        raise TimeoutError(f"no KV data within {timeout_s:g} s")
      return [np.zeros(s.shape, s.dtype) for s in specs[:2]] + [np.array([7, 0], np.uint32)]

  servers, addresses = _fake_prefill_servers(
    _SilentPrefill(info, "127.0.0.1:7"), _SilentPrefill(info, "127.0.0.1:8"), threads=32
  )
  transfer = Stalling()
  try:
    stalled = PrefillClient(e, (addresses[0],), transfer, 1.0, prefill_timeout_s=30)
    honest = PrefillClient(e, (addresses[1],), transfer, 1.0, prefill_timeout_s=30)
    stalled._pulls = honest._pulls  # (one decode server: one pool of pull threads)

    async def burst_then_honest():
      results = await asyncio.gather(
        *(stalled.prefill(Request(f"s{i}", [3, 4, 5], 2)) for i in range(24)), return_exceptions=True
      )
      req = Request("honest", [3, 4, 5], 2)
      await honest.prefill(req)
      return results, req

    results, req = asyncio.run(burst_then_honest())
    assert all(isinstance(r, Unavailable) for r in results), results
    assert req.prompt_kv[0].shape == (3, 16, 48)
    # The first PULL_THREADS stalls got the whole timeout; those queued behind them only what their requests had
    # left (or were dropped), not a second.
    assert sum(t > 0.5 for t in transfer.timeouts) <= PULL_THREADS == 8, transfer.timeouts
  finally:
    for server in servers:
      server.stop(0)


def test_a_prefill_server_restarted_on_another_transfer_port_is_asked_again():
  """An offer naming another transfer address than the one recorded at start-up is taken when the server's Info,
  asked again, announces it (a prefill server restarted with --transfer-port 0 gets another port)."""
  from hisparse_jax.engine import Engine, Request
  from hisparse_jax.serving.disaggregation import PrefillClient

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )
  restarted = _SilentPrefill(info, "127.0.0.1:2")
  servers, addresses = _fake_prefill_servers(restarted)
  try:
    before = pb.InfoResponse(transfer_address="127.0.0.1:1", page_size=16)
    before.MergeFrom(info)
    transfer = _RecordingTransfer()
    asyncio.run(PrefillClient(e, tuple(addresses), transfer, 10, infos=[before]).prefill(Request("r", [3, 4], 2)))
    assert transfer.pulls == ["127.0.0.1:2"] and restarted.info_calls == 1
  finally:
    for server in servers:
      server.stop(0)


def test_a_peer_whose_transfer_bytes_crash_jax_fails_only_its_pull():
  """A listener that answers a pull with 16 zero bytes aborts the process that pulls, inside jax's transfer
  library (SIGABRT). The decode server pulls in a worker process (``PullWorker``): that worker dies, the request
  fails with UNAVAILABLE naming it, a new worker takes the next pull, and this process lives on. The proof of a
  pull through the worker is the offer's."""
  from hisparse_jax.engine import Engine, Request, Unavailable
  from hisparse_jax.serving.disaggregation import PrefillClient, TransferEndpoint
  from hisparse_jax.serving.pull_worker import PullWorker

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )
  garbage = socket.socket()
  garbage.bind(("127.0.0.1", 0))
  garbage.listen(16)
  garbage.settimeout(0.2)
  stop_garbage = threading.Event()

  def answer_zeros():
    while not stop_garbage.is_set():
      try:
        connection, _ = garbage.accept()
      except OSError:
        continue
      with connection:
        connection.sendall(bytes(16))
        time.sleep(0.5)

  threading.Thread(target=answer_zeros, daemon=True).start()
  endpoint = TransferEndpoint()
  hostile = _SilentPrefill(info, f"127.0.0.1:{garbage.getsockname()[1]}")  # (its Info announces the listener)
  honest = _SilentPrefill(info, endpoint.address, endpoint=endpoint)
  servers, addresses = _fake_prefill_servers(hostile, honest)
  worker = PullWorker()
  try:
    with pytest.raises(Unavailable, match="the KV pull worker process died .* during the pull"):
      asyncio.run(PrefillClient(e, (addresses[0],), worker, 20).prefill(Request("r", [3, 4, 5], 2)))
    req = Request("r", list(range(3, 23)), 2)
    asyncio.run(PrefillClient(e, (addresses[1],), worker, 20).prefill(req))
    assert worker.restarts == 1 and req.prompt_kv[0].shape == (3, 32, 48) and not req.prompt_kv[0].any()
    deadline = time.monotonic() + 10
    while not honest.acks and time.monotonic() < deadline:
      time.sleep(0.05)
    assert honest.acks == [True]
  finally:
    stop_garbage.set()
    worker.close()
    endpoint.close()
    garbage.close()
    for server in servers:
      server.stop(0)


def test_a_prefill_server_that_refuses_a_valid_request_as_invalid_is_retried_elsewhere():
  """A prefill server restarted with a smaller --max-seq-len (the start-up check saw the old one) refuses a
  request this server took as INVALID_ARGUMENT: the other prefill server is tried; the request fails
  INVALID_ARGUMENT only when every server tried refused it so (it failed at the first before), RESOURCE_EXHAUSTED
  when the other refused it for its memory or load, and UNAVAILABLE when the other failed."""
  from hisparse_jax.engine import Engine, InvalidRequest, Request, ResourceExhausted, Unavailable
  from hisparse_jax.serving.disaggregation import PrefillClient, TransferEndpoint

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )
  too_long = (grpc.StatusCode.INVALID_ARGUMENT, "prompt of 200 tokens exceeds the model context of 128 tokens")
  busy = (grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue full")
  down = (grpc.StatusCode.UNAVAILABLE, "shutting down")
  transfer = TransferEndpoint()
  servicers = [_SilentPrefill(info, transfer.address, refuse=r) for r in (too_long, too_long, busy, down)]
  servers, addresses = [], []
  try:
    for servicer in servicers:
      servers.append(grpc.server(concurrent.futures.ThreadPoolExecutor(2)))
      hisparse_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, servers[-1])
      addresses.append(f"127.0.0.1:{servers[-1].add_insecure_port('127.0.0.1:0')}")
      servers[-1].start()
    hint = "does that prefill server run with a smaller --max-seq-len since this server started?"
    client = PrefillClient(e, tuple(addresses[:2]), transfer, 2, prefill_timeout_s=10)
    with pytest.raises(InvalidRequest) as err:
      asyncio.run(client.prefill(Request("long", list(range(3, 203)), 2)))
    assert str(err.value) == "prefill failed: " + "; ".join(
      f"{a}: INVALID_ARGUMENT: {too_long[1]} (this server takes the request: {hint})" for a in addresses[:2]
    )
    assert [s.calls for s in servicers] == [1, 1, 0, 0]
    refused = f"prefill failed: {addresses[0]}: INVALID_ARGUMENT: {too_long[1]} (this server takes the request: {hint})"
    client = PrefillClient(e, (addresses[0], addresses[2]), transfer, 2, prefill_timeout_s=10)
    with pytest.raises(ResourceExhausted) as err:
      asyncio.run(client.prefill(Request("long", list(range(3, 203)), 2)))
    assert str(err.value) == f"{refused}; {addresses[2]}: RESOURCE_EXHAUSTED: {busy[1]}"
    client = PrefillClient(e, (addresses[0], addresses[3]), transfer, 2, prefill_timeout_s=10)
    with pytest.raises(Unavailable) as err:
      asyncio.run(client.prefill(Request("long", list(range(3, 203)), 2)))
    assert str(err.value) == f"{refused}; {addresses[3]}: UNAVAILABLE: {down[1]}"
    assert [s.calls for s in servicers] == [3, 1, 1, 1]
  finally:
    for server in servers:
      server.stop(0)
    transfer.close()


def test_an_offer_pulled_after_the_callers_deadline_is_still_acknowledged():
  """The caller's deadline bounds the wait for the offer, not the Prefill call: a pull that ends after the
  deadline is acknowledged (the prefill server frees the offer). When the deadline was the call's gRPC timeout,
  the call ended between the pull and its acknowledgement, and the prefill server took back an offer already
  pulled (it waited for the take-back's deadline and cut it, leaving a socket of jax's transfer library open:
  10 of 96 requests with 5-150 ms deadlines did, found by a break-it run). A deadline that passes before the
  offer still cancels the prefill there, and the caller gets DEADLINE_EXCEEDED (its own deadline's status)."""
  import numpy as np

  from hisparse_jax.engine import DeadlineExceeded, Engine, Request
  from hisparse_jax.serving.disaggregation import PrefillClient

  e = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, chunked_prefill_size=32, max_running_requests=4)
  info = pb.InfoResponse(
    model_fingerprint=e.model_fingerprint,
    num_layers=3,
    latent_dim=48,
    index_dim=16,
    latent_dtype="float32",
    max_seq_len=256,
  )

  class SlowTransfer:  # a pull that lands 0.6 s after it starts
    def pull(self, address, uuid, specs, timeout_s=None):
      time.sleep(0.6)
      return [np.zeros(s.shape, s.dtype) for s in specs[:2]] + [np.array([7, 0], np.uint32)]

  server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
  servicer = _SilentPrefill(info, "127.0.0.1:1")
  hung = _SilentPrefill(info, "127.0.0.1:1", hang=True)
  hisparse_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  hung_server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
  hisparse_pb2_grpc.add_PrefillServiceServicer_to_server(hung, hung_server)
  hung_port = hung_server.add_insecure_port("127.0.0.1:0")
  hung_server.start()
  try:
    client = PrefillClient(e, (f"127.0.0.1:{port}",), SlowTransfer(), 30)
    req = Request("late", [3, 4, 5], 2)
    asyncio.run(client.prefill(req, deadline_s=0.2))
    assert req.first_token == 1 and req.prompt_kv[0].shape == (3, 16, 48)
    deadline = time.monotonic() + 10
    while not servicer.acks and time.monotonic() < deadline:
      time.sleep(0.05)
    assert servicer.acks == [True]
    client = PrefillClient(e, (f"127.0.0.1:{hung_port}",), SlowTransfer(), 30)
    with pytest.raises(DeadlineExceeded, match="the request.s deadline passed before its KV was offered"):
      asyncio.run(client.prefill(Request("early", [3, 4, 5], 2), deadline_s=0.3))
    assert hung.cancelled.wait(10)  # the prefill there was stopped
  finally:
    server.stop(0)
    hung_server.stop(0)


def _startup_error(*flags):
  r = subprocess.run(
    [sys.executable, "run_server.py", "--port=0", *_model(), *flags],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
  return r.stderr


@pytest.mark.parametrize(
  "flags,message",
  [
    (["--disaggregation-mode=decode"], "--disaggregation-mode decode needs --prefill-servers"),
    (["--prefill-servers=127.0.0.1:1"], "--prefill-servers is for --disaggregation-mode decode"),
    (["--disaggregation-mode=decode", "--prefill-servers=nowhere"], "--prefill-servers 'nowhere': expected host:port"),
    (["--disaggregation-mode=prefill", "--transfer-timeout-s=0"], "--transfer-timeout-s must be in (0, 86400] seconds"),
    (["--disaggregation-mode=prefill", "--transfer-timeout-s=inf"], "--transfer-timeout-s must be in (0, 86400]"),
    (["--disaggregation-mode=prefill", "--transfer-timeout-s=1e300"], "got 1e+300"),  # (its timer never fired)
    (["--disaggregation-mode=prefill", "--prefill-timeout-s=nan"], "--prefill-timeout-s must be in (0, 86400]"),
    (
      ["--disaggregation-mode=prefill", "--transfer-host=999.9.9.9"],
      "--transfer-host 999.9.9.9: not an address of this machine",
    ),
    (["--disaggregation-mode=prefill", "--transfer-port=65536"], "--transfer-port 65536: expected 0 (any free port)"),
    (["--transfer-port=5000"], "--transfer-port is for --disaggregation-mode prefill or decode"),
    (
      ["--disaggregation-mode=prefill", "--max-device-kv-bytes=4000000", "--max-offered-kv-bytes=4000000"],
      "--max-offered-kv-bytes 4000000: a prefill server's offers take their bytes from the device KV budget "
      "(4000000 bytes), which must keep some for its KV pools",
    ),
  ],
)
def test_bad_disaggregation_flags(flags, message):
  assert message in _startup_error(*flags)


def test_transfer_ports_that_clash_with_the_server_ports_or_are_taken():
  from hisparse_jax.serving.disaggregation import TransferEndpoint

  p = free_port()
  err = _startup_error("--disaggregation-mode=prefill", f"--transfer-port={p}", f"--port={p}")
  assert f"--transfer-port {p} is --port {p}: give them different ports" in err
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", p))
    taken.listen()
    err = _startup_error("--disaggregation-mode=prefill", f"--transfer-port={p}")
  assert f"--transfer-host/--transfer-port 127.0.0.1:{p}: cannot bind" in err
  # Two servers of one host started together both pass that check; jax listens with SO_REUSEPORT, so both would
  # bind the port and get each other's pulls: the second is refused by a host-wide lock.
  first = TransferEndpoint(port=p)
  with pytest.raises(ValueError, match=f"--transfer-port {p}: another server on this host uses it"):
    TransferEndpoint(port=p)
  assert first.address.endswith(f":{p}")


def test_unreachable_or_mismatched_prefill_server_at_startup(servers):
  """A decode server whose prefill server does not answer, or serves another layout: exit 1 naming the flag."""
  err = _startup_error("--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{free_port()}")
  assert "--prefill-servers 127.0.0.1:" in err and "no prefill server answered within 10 s" in err
  pport, decode = servers
  # A server that answers but serves no PrefillService (here a decode server) is named as such, at once.
  start = time.monotonic()
  err = _startup_error("--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{decode['dense']}")
  assert (
    f"--prefill-servers 127.0.0.1:{decode['dense']}: the server there is not a prefill server (UNIMPLEMENTED" in err
    and err.rstrip().endswith("start it with --disaggregation-mode prefill")
  ), err[-2000:]
  assert "answered within" not in err and time.monotonic() - start < 60
  err = _startup_error("--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{pport}", "--dtype=bfloat16")
  assert "serves another KV layout" in err
  # Another checkpoint of the same shapes (other weights): the fingerprint differs, the layout does not.
  err = _startup_error(
    "--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{pport}", f"--model-path={tiny_model_dir(8)}"
  )
  assert "serves another model (checkpoint fingerprint" in err and "the same --model-path checkpoint" in err, err[
    -2000:
  ]
  # FP8 rows against its float32 rows: 100 + 20 uint8 against 48 + 16 float32 per token and layer.
  err = _startup_error(
    "--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{pport}", "--kv-cache-dtype=fp8_e4m3"
  )
  assert "serves another KV layout" in err and "(3, 48, 16, 'float32', '')" in err
  assert "(3, 100, 20, 'uint8', 'fp8')" in err and "--kv-cache-dtype" in err
  # The same rows computed with other numerics: the KV would not be the one this server computes.
  err = _startup_error("--disaggregation-mode=decode", f"--prefill-servers=127.0.0.1:{pport}", "--fp8-numerics")
  assert "(3, 48, 16, 'float32', '')" in err and "(3, 48, 16, 'float32', 'fp8')" in err and "--fp8-numerics" in err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_pd_over_mutual_tls_with_the_api_key_both_ways(colocated, tmp_path):
  """A prefill server serving TLS that requires client certificates (--tls-client-ca-file) and an API key; a
  decode server reaching it with --prefill-tls-ca-file / -cert-file / -key-file and the same key: the colocated
  greedy tokens. Without its client certificate, or in plain text, the decode server's start fails naming the
  flags to set."""
  from tests.multiprocess import self_signed

  self_signed(tmp_path)
  cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
  procs = []
  try:
    prefill, pport = start_server(
      [
        *_model(),
        "--disaggregation-mode=prefill",
        f"--tls-cert-file={cert}",
        f"--tls-key-file={key}",
        f"--tls-client-ca-file={cert}",
        "--api-key=pd-key",
      ]
    )
    procs.append(prefill)
    decode, dport = start_server(
      [
        *_model(),
        "--disaggregation-mode=decode",
        f"--prefill-servers=localhost:{pport}",
        f"--prefill-tls-ca-file={cert}",
        f"--prefill-tls-cert-file={cert}",
        f"--prefill-tls-key-file={key}",
        "--api-key=pd-key",
      ]
    )
    procs.append(decode)
    channel = grpc.insecure_channel(f"127.0.0.1:{dport}")
    stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
    msgs = list(
      stub.Generate(
        pb.GenerateRequest(input_ids=pb.TokenIds(ids=PROMPTS[1]), max_new_tokens=NEW),
        metadata=(("authorization", "Bearer pd-key"),),
        timeout=120,
      )
    )
    assert [t for m in msgs for t in m.token_ids] == colocated[1] and msgs[-1].transfer_bytes > 0
    err = _startup_error(
      "--disaggregation-mode=decode",
      f"--prefill-servers=localhost:{pport}",
      f"--prefill-tls-ca-file={cert}",
      "--api-key=pd-key",
    )
    assert f"--prefill-servers localhost:{pport}:" in err and "--prefill-tls-cert-file" in err, err[-2000:]
    err = _startup_error("--disaggregation-mode=decode", f"--prefill-servers=localhost:{pport}", "--api-key=pd-key")
    assert "pass --prefill-tls-ca-file" in err, err[-2000:]
  finally:
    stop(procs)


def test_pd_with_fp8_kv_rows():
  """--kv-cache-dtype fp8_e4m3 on both ends: the prefill server hands over FP8 rows (100 + 20 bytes of latent
  row and indexer key a token and layer, against 192 + 64 in float32), the HiSparse decode server swaps them
  in, and the tokens are the colocated FP8 engine's."""
  from hisparse_jax.engine import Engine, Request

  e = Engine(
    tiny_model_dir(),
    max_seq_len=256,
    page_size=16,
    chunked_prefill_size=32,
    max_running_requests=4,
    deterministic=True,
    kv_cache_dtype="fp8_e4m3",
  )
  prompts = PROMPTS[1:3]
  reqs = [Request(str(i), p, NEW) for i, p in enumerate(prompts)]
  for r in reqs:
    e.submit(r)
  e.run()
  del e
  procs = []
  try:
    fp8 = ["--kv-cache-dtype=fp8_e4m3"]
    prefill, pport = start_server([*_model(), *fp8, "--disaggregation-mode=prefill"])
    procs.append(prefill)
    proc, port = start_server(
      [
        *_model(),
        *fp8,
        "--enable-hisparse",
        f"--hisparse-config={HS}",
        "--disaggregation-mode=decode",
        f"--prefill-servers=127.0.0.1:{pport}",
      ]
    )
    procs.append(proc)
    stub = _stub(port)
    for prompt, req in zip(prompts, reqs):
      tokens, final = _generate(stub, prompt)
      assert tokens == req.output_ids
      positions = max(16, 1 << (len(prompt) - 1).bit_length())
      assert final.transfer_bytes == 3 * positions * (100 + 20)  # FP8 latent rows and indexer keys
      assert final.swap_in_misses > 0
    assert _idle(stub) and _idle(_stub(pport))
  finally:
    stop(procs)


def test_prefill_streams_count_against_the_stream_limit_and_refusals_leave_no_metrics_state(monkeypatch):
  """A prefill server's Prefill streams share Generate's open-stream limit (each holds a prefill, then a KV
  offer, until it ends): beyond it, RESOURCE_EXHAUSTED before any work; requests the engine's queue turns
  away leave no per-request entry in the server's metrics; streams that never send their request are cut off
  (DEADLINE_EXCEEDED) and give their places back; the server then serves as before."""
  from hisparse_jax.engine import Engine
  from hisparse_jax.serving import disaggregation as pd
  from hisparse_jax.serving.disaggregation import DisaggregationConfig
  from hisparse_jax.serving.metrics import ServerMetrics
  from hisparse_jax.serving.server import ServerLimits, serve

  engine = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, max_running_requests=1, max_queued_requests=0)
  metrics = ServerMetrics(row_bytes=engine.layout.row_bytes, num_layers=3, disaggregation_mode="prefill")
  # The pulled-KV metrics are a decode server's: a prefill server does not export them (they would stay 0).
  assert metrics.registry.get_sample_value("hisparse_pd_kv_transfer_bytes_total") is None
  assert metrics.registry.get_sample_value("hisparse_time_to_first_token_seconds_count") == 0
  srv, loop, port = serve(
    engine,
    None,
    "127.0.0.1",
    0,
    metrics,
    limits=ServerLimits(max_streams=4),
    disaggregation=DisaggregationConfig("prefill", transfer_timeout_s=30.0),
  )

  async def flood():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
      stub = hisparse_pb2_grpc.PrefillServiceStub(channel)

      async def prefill(i):
        call = stub.Prefill()
        try:  # (a refused stream may end before or after its request is written)
          await call.write(pb.PrefillMessage(request=pb.PrefillRequest(input_ids=pb.TokenIds(ids=[5 + i] * 20))))
          offer = await call.read()
          await asyncio.sleep(1.0)  # holding its offer (and its stream) unacknowledged
          call.cancel()
          return "offer" if offer is not grpc.aio.EOF else "eof"
        except grpc.aio.AioRpcError:  # the call's own status (a write after a refusal reports INTERNAL)
          return (await call.code()).name, await call.details()

      return await asyncio.gather(*[prefill(i) for i in range(10)])

  try:
    results = asyncio.run(flood())
    busy = [r for r in results if r[0] == "RESOURCE_EXHAUSTED" and "streams open (limit 4)" in r[1]]
    queue_full = [r for r in results if r[0] == "RESOURCE_EXHAUSTED" and "queue full" in r[1]]
    other = [r for r in results if r != "offer" and r not in busy and r not in queue_full]
    assert not other, other
    assert 1 <= len(busy) <= 6 and queue_full and results.count("offer") >= 1, results
    deadline = time.monotonic() + 60
    while (engine.has_work() or srv.servicer.open_streams) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not metrics._arrival and not metrics._last_token and srv.servicer.open_streams == 0

    # Four silent streams take every place of the limit, then lose them after the first-message timeout.
    monkeypatch.setattr(pd, "FIRST_MESSAGE_TIMEOUT_S", 1.0)

    async def silent():
      async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        calls = [hisparse_pb2_grpc.PrefillServiceStub(channel).Prefill() for _ in range(4)]
        start = time.monotonic()
        while srv.servicer.open_streams < 4 and time.monotonic() - start < 5:
          await asyncio.sleep(0.01)
        held = srv.servicer.open_streams
        codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), 20)  # (forever before)
        return held, codes, [await c.details() for c in calls], time.monotonic() - start

    held, codes, details, waited = asyncio.run(silent())
    assert held == 4 and codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 4, (held, codes, details)
    assert "no PrefillRequest within 1 s" in details[0] and waited < 10
    deadline = time.monotonic() + 10  # (each handler gives its place back just after its status is sent)
    while srv.servicer.open_streams and time.monotonic() < deadline:
      time.sleep(0.02)
    assert srv.servicer.open_streams == 0
    tokens, _ = _generate(
      hisparse_pb2_grpc.HiSparseInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}")), PROMPTS[0]
    )
    assert len(tokens) == NEW
  finally:
    srv.stop(0).wait()
    loop.stop()


def test_offered_kv_bytes_are_bounded_per_dp_group():
  """With --dp-size 2 a prefill server's offers stay on their DP group's first device, so the bound holds per
  group (each device set its share aside): a Prefill goes to the group with the fewest held bytes that has room
  (then the lowest), is refused when none has, and the metrics' limit is the groups' sum. (Every offer went to the
  first device, bounded by one device's share, while every device set it aside.) tests/engine_fuzz.py's
  check_exports runs pinned exports on a DP mesh."""
  from hisparse_jax.serving import disaggregation as pd

  servicer = pd.PrefillServicer(
    SimpleNamespace(engine=SimpleNamespace(offer_kv_budget=100, device_kv_budget=900, groups=2)), None, 1.0, None
  )
  assert (servicer.group_offer_bytes, servicer.max_offered_bytes) == (100, 200)
  assert [servicer._reserve(n)[0] for n in (60, 60, 30, 30)] == [0, 1, 0, 1] and servicer.offered_bytes == 180
  assert servicer._reserve(20) == (
    None,
    "the prefill server holds 180 bytes of prompt KV for decode servers (offers "
    "not pulled yet, prefills in flight); this prompt's 20 would pass its "
    "--max-offered-kv-bytes 100 per DP group (its 2 groups hold [90, 90]): retry "
    "later or on another prefill server",
  )
  assert servicer._reserve(101) == (
    None,
    "this prompt's KV offer (101 bytes) is larger than the prefill server's --max-offered-kv-bytes 100",
  )
  servicer._release(1, 60)
  assert servicer._reserve(20) == (1, None) and servicer.offered_bytes == 140


def test_offered_kv_bytes_are_bounded():
  """A prefill server's offers are copies outside its KV pools, held until pulled or taken back: with
  --max-offered-kv-bytes one offer's size, a second Prefill while the first offer waits for its pull is refused
  with RESOURCE_EXHAUSTED before it is prefilled, a prompt whose offer alone is larger always is, and once the
  offer is taken back the next is served; the metrics show the bytes held and their limit."""
  from hisparse_jax.engine import Engine
  from hisparse_jax.serving import disaggregation as pd
  from hisparse_jax.serving.metrics import ServerMetrics
  from hisparse_jax.serving.server import serve

  one = 3 * 32 * (48 * 4 + 16 * 4)  # layers x 32 positions (20 tokens, to a power of two) x (latent + key) float32
  # The offers' bound comes out of the device KV budget (CPU default 1 GiB) as run_server builds the engine.
  engine = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, max_running_requests=2, offer_kv_bytes=one)
  assert (engine.offer_kv_budget, engine.device_kv_budget) == (one, (1 << 30) - one)
  assert engine.loads()["device_kv_bytes_budget"] <= engine.device_kv_budget  # (the pools: sized from the rest)
  with pytest.raises(ValueError, match="--max-offered-kv-bytes is for --disaggregation-mode prefill"):
    pd.DisaggregationConfig("null", max_offered_kv_bytes=one).validate()
  with pytest.raises(ValueError, match=f"--max-offered-kv-bytes {2 * one}: more than the {one} bytes"):
    pd.PrefillServicer(SimpleNamespace(engine=engine), None, 1.0, None, max_offered_bytes=2 * one)
  metrics = ServerMetrics(row_bytes=engine.layout.row_bytes, num_layers=3, disaggregation_mode="prefill")
  srv, loop, port = serve(
    engine,
    None,
    "127.0.0.1",
    0,
    metrics,
    disaggregation=pd.DisaggregationConfig("prefill", transfer_timeout_s=2.0, max_offered_kv_bytes=one),
  )
  stub = hisparse_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
  sample = lambda state: metrics.registry.get_sample_value(
    "hisparse_pd_offered_kv_bytes",  # noqa: E731
    {"state": state},
  )
  request = lambda n: pb.PrefillMessage(request=pb.PrefillRequest(input_ids=pb.TokenIds(ids=list(range(5, 5 + n)))))

  def refusal(n):
    try:
      list(stub.Prefill(iter([request(n)]), timeout=60))
    except grpc.RpcError as e:
      return e.code(), e.details()

  try:
    assert srv.prefill.offer_bytes(20) == one and sample("limit") == one and sample("held") == 0
    held_open = threading.Event()

    def holder():  # takes the offer and holds its stream open, never acknowledging
      yield request(20)
      held_open.wait(30)

    first = stub.Prefill(holder(), timeout=60)
    offer = next(first)
    assert offer.kv_bytes == one and sample("held") == one
    code, details = refusal(20)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"holds {one} bytes of prompt KV" in details, details
    assert "--max-offered-kv-bytes" in details and engine.prefill_calls == 1  # refused before any prefill
    code, details = refusal(40)  # 64 positions: twice the limit, never
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "is larger than the prefill server's" in details
    # Unacknowledged past --transfer-timeout-s: DEADLINE_EXCEEDED, taken back, the bytes released.
    with pytest.raises(grpc.RpcError) as e:
      list(first)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "taken back" in e.value.details()
    held_open.set()
    deadline = time.monotonic() + 30
    while srv.prefill.offered_bytes and time.monotonic() < deadline:
      time.sleep(0.05)
    assert sample("held") == 0 and metrics.registry.get_sample_value("hisparse_pd_offers_taken_back_total") == 1
    assert next(stub.Prefill(iter([request(20)]), timeout=60)).kv_bytes == one  # served again
  finally:
    srv.stop(0).wait()
    loop.stop()


def test_an_offer_is_held_only_until_a_proven_pull_or_its_take_back(monkeypatch):
  """A prefill server frees every offer: one pulled and acknowledged with the offer's proof is the caller's; one
  acknowledged without the proof (no pull, or a guess) is taken back at once, so a caller that claims pulls it
  never made cannot pile up KV (each such offer stayed held for good before); one pulled and then left
  unacknowledged is cut at its take-back deadline instead of blocking a take-back thread forever (which wedged
  every later take-back and the server's exit); the take-back thread ends when nothing is pending."""
  import queue

  from hisparse_jax.engine import Engine
  from hisparse_jax.serving import disaggregation as pd
  from hisparse_jax.serving.server import serve

  monkeypatch.setattr(pd, "TAKE_BACK_BASE_S", 1.0)
  engine = Engine(tiny_model_dir(), max_seq_len=256, page_size=16, max_running_requests=2, offer_kv_bytes=0)
  # Both transfer servers on fixed ports (--transfer-port), each pulling several times (take-backs, the caller).
  srv, loop, port = serve(
    engine,
    None,
    "127.0.0.1",
    0,
    disaggregation=pd.DisaggregationConfig("prefill", transfer_timeout_s=30.0, transfer_port=free_port()),
  )
  take_backs = srv.prefill.take_backs
  mine = pd.TransferEndpoint(port=free_port())
  stub = hisparse_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

  def pull(offer):
    specs = pd._specs(
      offer.num_layers,
      offer.kv_positions,
      offer.latent_dim,
      offer.index_dim,
      offer.latent_dtype,
      engine.layout.index_dtype,
    )
    return mine.pull(offer.transfer_address, offer.transfer_uuid, specs, timeout_s=30)

  def prefill(reply):
    """One Prefill stream; reply(offer) -> the KVReceived sent back, or None (the stream ends without one)."""
    replies = queue.Queue()

    def messages():
      yield pb.PrefillMessage(request=pb.PrefillRequest(input_ids=pb.TokenIds(ids=list(range(5, 25)))))
      received = replies.get(timeout=60)
      if received is not None:
        yield pb.PrefillMessage(received=received)

    call = stub.Prefill(messages(), timeout=60)
    replies.put(reply(next(call)))
    try:
      list(call)
    except grpc.RpcError as e:
      return e.code(), e.details()
    return grpc.StatusCode.OK, None

  def settled():
    deadline = time.monotonic() + 30
    while take_backs.pending() and time.monotonic() < deadline:
      time.sleep(0.05)
    return take_backs.pending() == 0 and srv.prefill.offered_bytes == 0  # (every offer's bytes released)

  forged = (
    grpc.StatusCode.INVALID_ARGUMENT,
    "the acknowledgement's pull_proof is not the offer's (only its pull reveals it): the KV was taken back",
  )
  try:
    # (the default: half the device KV budget, 1 GiB on CPU; the pools are sized from the other half)
    assert srv.prefill.max_offered_bytes == engine.offer_kv_budget == engine.device_kv_budget == 1 << 29
    status = prefill(lambda offer: pb.KVReceived(pulled=True, pull_proof=pd._proof_value(pull(offer)[2])))
    assert status == (grpc.StatusCode.OK, None)
    assert settled() and (take_backs.taken_back, take_backs.already_pulled) == (0, 0)
    assert prefill(lambda offer: pb.KVReceived(pulled=True)) == forged  # the caller learns the KV is gone
    assert prefill(lambda offer: pb.KVReceived(pulled=True, pull_proof=12345)) == forged
    assert settled() and (take_backs.taken_back, take_backs.already_pulled) == (2, 0)
    start = time.monotonic()
    assert prefill(lambda offer: pull(offer) and None) == (grpc.StatusCode.OK, None)  # (it ended its stream)
    assert settled() and (take_backs.taken_back, take_backs.already_pulled) == (2, 1)
    assert time.monotonic() - start < 20
    deadline = time.monotonic() + 5
    while take_backs._thread is not None and time.monotonic() < deadline:
      time.sleep(0.05)
    assert take_backs._thread is None
  finally:
    srv.stop(0).wait()
    loop.stop()
