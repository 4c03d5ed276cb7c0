"""Prefill/decode (PD) disaggregation: prefill servers fill decode servers' KV (``run_server.py
--disaggregation-mode prefill | decode``).

    client ─Generate─▶ decode server ──PrefillService.Prefill──▶ prefill server: (chunked) prefill, samples the
                         │    ▲                                  first token, offers the prompt's KV [latent,
                         │    └──── pull (jax.experimental.transfer) ──┘  indexer keys] on its transfer server
                         └─ imports the KV (HiSparse: latent rows into its ``pinned_host`` host pool pages, indexer
                            keys into device pages; dense: device pages), decodes, streams the tokens

The decode server stays the client-facing endpoint (Generate / Abort / GetLoads / health). For each request it
picks a prefill server round-robin (``--prefill-servers``), opens a ``Prefill`` stream and sends the prompt
with its sampling; the prefill server runs the prompt through its own engine as a one-token request whose KV is
exported when its prefill ends (``Request.export_kv``), offers [latent T[L, P, W], index I[L, P, Di], proof
uint32[2]] (the rows as stored, ``models/kv_format.py``; P a power of two >= the prompt; proof 8 random bytes)
under a random uuid with ``TransferServer.await_pull`` and answers with a ``PrefillOffer`` (first token, uuid,
its transfer address, timings). The decode server pulls the arrays (a ``TransferConnection`` of its own per
pull), acknowledges with the proof it pulled (``KVReceived.pull_proof``) and submits the request with
``prompt_kv`` + ``first_token`` to its engine, which admits it, writes the KV into its pools
(``state.import_prompt``) and decodes from there: greedy tokens equal the colocated server's. The decode
server holds no pages until the KV has arrived, so a failure before that leaves nothing to free.

Faults (measured behaviour of jax.experimental.transfer 0.12 on CPU, which shapes this protocol): a pull from
a server that dies fails at once ("SocketServer: Connection closed"), but a pull of a uuid that is not
(or no longer) offered blocks until the server exits, whatever its timeout; and an offer that is never pulled
keeps its arrays forever (``await_pull``'s timeout does not free them) unless someone pulls it. Hence:
  - every pull has a deadline: a pull that has no data by then is cut by poisoning its connection (so each
    pull has a connection of its own; a fresh one costs ~0.07 ms on loopback), which ends it with an error;
  - the decode server pulls on a bounded thread pool and gives up after ``--transfer-timeout-s``; a failed or
    timed-out prefill or pull is retried once on another prefill server when there is one, else the request
    fails with UNAVAILABLE (the decode server keeps serving);
  - a pull in flight is not cancelled by an abort: the pull finishes in the background, is acknowledged and
    dropped (an abort leaves nothing offered, nothing half-imported);
  - the prefill server takes an offer back (pulls it from itself, which frees it) unless the caller
    acknowledges it with the offer's proof within its ``--transfer-timeout-s``: only a real pull knows the
    proof, so a caller that claims a pull it did not make cannot leave the KV held forever. A take-back of an
    offer that was pulled after all (a caller that pulled and then went away) has no data to wait for: it is
    cut at its deadline (TAKE_BACK_BASE_S + the bytes at TAKE_BACK_MIN_BYTES_PER_S). Take-backs are polled by
    one thread, so any number of them progress at once; a stream cancelled while the prompt is still
    prefilling aborts that prefill;
  - offers are copies outside the prefill server's KV pools: their bytes, and those of the prefills in flight at
    their offer's size, are bounded by ``--max-offered-kv-bytes``, checked before a prompt is prefilled, and
    taken from the device KV budget (default half of it), whose rest sizes the pools.
A decode server takes nothing from a prefill server on trust: an offer must name the transfer address that
server announced (Info), hold exactly the positions its prompt needs, and carry a first token in the vocabulary
(``offer_fault``), before anything is pulled; and it pulls in a worker process (``pull_worker.PullWorker``),
since jax's transfer library aborts the process that pulls when the peer answers with some malformed bytes (16
zero bytes): such a peer ends that pull, not the server. The transfer ports have no authentication, a prefill
server's transfer server can itself be aborted that way, and it keeps a descriptor for every pull of an unknown
uuid: only the deployment's own servers may reach them (docs/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import ssl
import threading
import time
import uuid as uuidlib

import grpc

from hisparse_jax.engine import DeadlineExceeded, InvalidRequest, Request, RequestError, ResourceExhausted, Unavailable
from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving.addresses import MAX_TIMEOUT_S, join_host_port

log = logging.getLogger(__name__)

MODES = ("null", "prefill", "decode")
# Pulls in flight on a decode server at once (each a blocking call on its own thread).
PULL_THREADS = 8
# A take-back (a pull of this process's own offer) that has no data after this long, plus its bytes at this rate
# (loopback moves ~0.9 GB/s), is cut: its offer had been pulled already.
TAKE_BACK_BASE_S = 10.0
TAKE_BACK_MIN_BYTES_PER_S = 100e6
# A decode server's default --prefill-timeout-s: how long a prefill server may take to offer a prompt's KV (its
# queue wait included) before the attempt is given up (SGLang's disaggregation waiting timeout is 300 s; a 160k
# prompt of a 700B model behind a queue needs more).
PREFILL_TIMEOUT_S = 600.0
# Seconds a decode server's start-up waits for each prefill server's Info.
CONNECT_TIMEOUT_S = 10.0
# A Prefill stream counts against the stream limit from its opening; a caller that opens one and sends nothing
# is cut off after this long, so it cannot hold a slot of the limit (decode servers write at once).
FIRST_MESSAGE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class DisaggregationConfig:
  """``--disaggregation-mode`` ("null": colocated prefill and decode; "prefill"; "decode"),
  ``--prefill-servers`` (decode: host:port of each prefill server's gRPC endpoint), ``--transfer-host`` (the
  address this process's transfer server binds and announces), ``--transfer-port`` (its port; 0: any free one;
  the bulk data moves over connections on ports the system picks) and ``--transfer-timeout-s`` (decode: how long a pull may take;
  prefill: how long an offer waits to be pulled) and ``--prefill-timeout-s`` (decode: how long a prefill server
  may take to offer a prompt's KV, queue wait included; past it the attempt fails and is retried once on the
  next prefill server). The servers of one deployment share one
  ``--api-key`` (a decode server sends its own to its prefill servers); their gRPC links are plain text unless
  the decode server has ``--prefill-tls-ca-file`` (``prefill_tls_*``), and the transfer sockets always are: a
  private network."""

  mode: str = "null"
  prefill_servers: tuple[str, ...] = ()
  transfer_host: str = "127.0.0.1"
  transfer_timeout_s: float = 60.0
  api_key: str | None = None  # sent to the prefill servers (a deployment shares one --api-key)
  transfer_port: int = 0
  prefill_timeout_s: float = PREFILL_TIMEOUT_S
  max_offered_kv_bytes: int = 0  # prefill: prompt KV held for decode servers at once (0: half the device KV budget)
  isolate_pulls: bool = True  # decode: pull prompt KV in a worker process (pull_worker.py); False: in this one
  # decode: TLS to the prefill servers (PEM bytes): the CA that signed their certificates, and this server's own
  # certificate and key for those that require mutual TLS (--prefill-tls-ca-file / -cert-file / -key-file).
  prefill_tls_ca: bytes | None = None
  prefill_tls_cert: bytes | None = None
  prefill_tls_key: bytes | None = None

  def channel_credentials(self) -> grpc.ChannelCredentials | None:
    """The credentials of a decode server's channels to its prefill servers; None: plain text."""
    if self.prefill_tls_ca is None:
      return None
    return grpc.ssl_channel_credentials(self.prefill_tls_ca, self.prefill_tls_key, self.prefill_tls_cert)

  def transfer_ports(self) -> tuple[int, ...]:
    """The fixed TCP port the transfer server listens on: (--transfer-port,), or () for any free one."""
    return (self.transfer_port,) if self.transfer_port else ()

  def validate(self) -> None:
    """ValueError naming the flag."""
    if self.mode not in MODES:
      raise ValueError(f"--disaggregation-mode {self.mode!r}: expected one of {', '.join(MODES)}")
    if self.mode == "decode" and not self.prefill_servers:
      raise ValueError("--disaggregation-mode decode needs --prefill-servers host:port[,host:port...]")
    if self.mode != "decode" and self.prefill_servers:
      raise ValueError(f"--prefill-servers is for --disaggregation-mode decode (got {self.mode})")
    for s in self.prefill_servers:
      host, sep, port = s.rpartition(":")
      if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prefill-servers {s!r}: expected host:port")
    from hisparse_jax.serving.addresses import check_bindable, check_timeout

    check_timeout("--transfer-timeout-s", self.transfer_timeout_s)
    check_timeout("--prefill-timeout-s", self.prefill_timeout_s)
    if not 0 <= self.transfer_port <= 65535:
      raise ValueError(f"--transfer-port {self.transfer_port}: expected 0 (any free port) or 1..65535")
    if (self.prefill_tls_cert is None) != (self.prefill_tls_key is None):
      raise ValueError("--prefill-tls-cert-file and --prefill-tls-key-file go together")
    if self.prefill_tls_cert is not None and self.prefill_tls_ca is None:
      raise ValueError("--prefill-tls-cert-file (mutual TLS to the prefill servers) needs --prefill-tls-ca-file")
    if self.mode != "decode" and self.prefill_tls_ca is not None:
      raise ValueError(f"--prefill-tls-ca-file is for --disaggregation-mode decode (got {self.mode})")
    if self.max_offered_kv_bytes < 0:
      raise ValueError(f"--max-offered-kv-bytes must be >= 0, got {self.max_offered_kv_bytes}")
    if self.mode != "prefill" and self.max_offered_kv_bytes:
      raise ValueError(f"--max-offered-kv-bytes is for --disaggregation-mode prefill (got {self.mode})")
    if self.mode == "null" and self.transfer_port:
      raise ValueError(
        "--transfer-port is for --disaggregation-mode prefill or decode (a colocated server has no KV transfer server)"
      )
    if self.mode != "null":  # the KV transfer server binds it (an address of another machine cannot be bound)
      check_bindable("--transfer-host", self.transfer_host, 0)
      for port in self.transfer_ports():
        check_bindable("--transfer-host/--transfer-port", self.transfer_host, port)


class TransferEndpoint:
  """This process's ``jax.experimental.transfer`` server (bound to ``host`` with explicit transport addresses:
  the defaults abort the process on CPU) and its pulls from other servers, each on a connection of
  its own (so that one can be cut without the others)."""

  def __init__(self, host: str = "127.0.0.1", port: int = 0):
    """port: the transfer server's TCP port (0: any free one). Its bulk transport's address keeps port 0: jax
    binds each outgoing bulk connection to it, so a fixed one aborted the process at its second pull
    (socket_bulk_transport.cc "Check failed: bind ... Address already in use").

    Raises:
      ValueError naming --transfer-host/--transfer-port: the port cannot be bound, or another server of this
        host holds it (jax listens with SO_REUSEPORT, so two servers could otherwise share it and get each
        other's pulls: a host-wide lock, an abstract Unix socket named after the port, refuses the second).
    """
    import socket

    import jax
    from jax.experimental import transfer

    self._port_lock = None
    if port:
      self._port_lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      try:
        self._port_lock.bind(f"\0hisparse-jax-transfer-port-{port}")
      except OSError:
        self._port_lock.close()
        raise ValueError(f"--transfer-port {port}: another server on this host uses it") from None
    try:
      self.server = transfer.start_transfer_server(
        jax.local_devices()[0].client, join_host_port(host, port), [join_host_port(host, 0)]
      )
    except jax.errors.JaxRuntimeError as e:
      raise ValueError(f"--transfer-host/--transfer-port {host}:{port}: {str(e).splitlines()[0]}") from None
    self.address = self.server.address()
    self._lock = threading.Lock()
    self._in_flight: set = set()  # connections of the pulls in flight (close() cuts them)
    self._closed = False

  def offer(self, uuid: int, arrays) -> None:
    """Schedules ``arrays`` to be pulled once under ``uuid`` (non-blocking)."""
    self.server.await_pull(uuid, list(arrays))

  def start_pull(self, address: str, uuid: int, specs):
    """(connection, arrays) of a pull started on a connection of its own (non-blocking: the arrays fill in the
    background; ``cut`` the connection to end a pull that will not)."""
    connection = self.server.connect(address)
    with self._lock:
      if self._closed:
        raise RuntimeError("the transfer endpoint is closed")
      self._in_flight.add(connection)
    return connection, connection.pull(uuid, list(specs))

  def cut(self, connection) -> None:
    """Ends a pull started by ``start_pull``: poisoned, its arrays fail (a pull of a uuid no longer offered
    would otherwise wait until that server exits); a finished pull's connection is just forgotten."""
    with self._lock:
      self._in_flight.discard(connection)
    connection._poison_connection()  # (jax.experimental.transfer's only way to end a pull)

  def done(self, connection) -> None:
    """Forgets the connection of a pull that ended (its arrays are ready or failed)."""
    with self._lock:
      self._in_flight.discard(connection)

  def pull(self, address: str, uuid: int, specs, timeout_s: float | None = None) -> list:
    """The arrays offered under uuid at address (blocking; ``specs``: ShapeDtypeStructs with shardings).

    Raises:
      TimeoutError: no data within timeout_s (the pull is cut: nothing of it stays).
      jax.errors.JaxRuntimeError: the transfer failed (the server died, or this endpoint was closed).
    """
    connection, out = self.start_pull(address, uuid, specs)
    timer, expired = None, threading.Event()
    if timeout_s is not None:

      def expire():
        expired.set()
        self.cut(connection)

      timer = threading.Timer(timeout_s, expire)
      timer.daemon = True
      timer.start()
    try:
      for x in out:
        x.block_until_ready()
    except Exception:
      if expired.is_set():
        raise TimeoutError(f"no KV data within {timeout_s:g} s") from None
      raise
    finally:
      if timer is not None:
        timer.cancel()
      self.done(connection)
    return out

  def close(self) -> None:
    """Cuts every pull in flight (their callers get errors at once) and refuses new ones."""
    with self._lock:
      self._closed = True
      connections, self._in_flight = list(self._in_flight), set()
    for c in connections:
      c._poison_connection()


def _specs(layers: int, positions: int, latent_dim: int, index_dim: int, dtype, index_dtype):
  """The offered arrays' specs: latent rows, indexer keys and the proof of the pull (uint32[2])."""
  import jax
  import jax.numpy as jnp

  device = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
  return (
    jax.ShapeDtypeStruct((layers, positions, latent_dim), jnp.dtype(dtype), sharding=device),
    jax.ShapeDtypeStruct((layers, positions, index_dim), jnp.dtype(index_dtype), sharding=device),
    jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=device),
  )


def _proof_value(proof) -> int:
  """The uint64 a KVReceived carries for a proof array (uint32[2])."""
  import numpy as np

  return int.from_bytes(np.asarray(proof, np.uint32).tobytes(), "little")


def _kv_layout(engine) -> tuple[int, int, int, str, str]:
  """A server's KV as InfoResponse and PrefillOffer describe it: (layers, stored latent row width, stored indexer
  key width, row dtype name, numerics: "fp8" or "")."""
  return (
    engine.config.num_hidden_layers,
    engine.layout.latent_dim,
    engine.layout.index_dim,
    engine.kv_dtype.name,
    "fp8" if engine.config.fp8_active else "",
  )


def _sampling(message) -> dict:
  top_p = message.top_p if message.HasField("top_p") else 1.0
  return dict(
    temperature=message.temperature,
    top_k=message.top_k,
    top_p=top_p,
    seed=message.seed if message.HasField("seed") else None,
  )


# --------------------------------------------------------------------------------------------- prefill
class PrefillServicer(hisparse_pb2_grpc.PrefillServiceServicer):
  """``PrefillService`` of a prefill server: prompts through its engine loop, KV offered for pulling.

  An offer's arrays are copies on the first device of the DP group that prefilled it (``ModelRunner.group_device``),
  outside the engine's KV pools (whose pages the prompt frees once read), held until the decode server
  acknowledges its pull or, unacknowledged, until it is taken back. So their bytes are bounded per DP group
  (``group_offer_bytes``, the share each device set aside): a Prefill is pinned (``Request.dp_group``) to the
  group with the fewest offered bytes among those its offer fits, counting the prefills in flight at their
  offer's size, and refused with RESOURCE_EXHAUSTED before it is prefilled when none has room."""

  def __init__(
    self, loop, transfer: TransferEndpoint, timeout_s: float, events_cls, streams=None, max_offered_bytes: int = 0
  ):
    """streams: the server's InferenceServicer, whose open-stream count and limit (``ServerLimits.max_streams``)
    Prefill streams share: each holds a queued or running prefill, then a KV offer, until it ends.
    max_offered_bytes: the most prompt KV bytes offered (or being prefilled for an offer) at once per DP group
    (on its first device; ``--max-offered-kv-bytes``); 0: the engine's share of each device's KV budget for
    offers (``Engine(..., offer_kv_bytes=...)``, as the server builds it: ``Engine.offer_kv_budget``), or, for an
    engine built without one, its device KV budget (the offers then use memory outside the budget: a warning).
    Sets ``group_offer_bytes`` (that bound) and ``max_offered_bytes`` (it times the DP groups: the server's).

    Raises:
      ValueError: max_offered_bytes above the engine's ``offer_kv_budget``."""
    self.streams = streams
    self.loop = loop
    self.engine = loop.engine
    self.transfer = transfer
    self.timeout_s = timeout_s
    self._events_cls = events_cls  # server._AsyncEvents
    self.take_backs = TakeBacks(transfer)
    share = self.engine.offer_kv_budget
    self.group_offer_bytes = max_offered_bytes or share or self.engine.device_kv_budget
    if share is None:
      log.warning(
        "prefill server: the engine sets no device KV budget aside for its offers (Engine(..., "
        "offer_kv_bytes=...)); up to %d bytes of them per DP group live in device memory outside the "
        "budget",
        self.group_offer_bytes,
      )
    elif self.group_offer_bytes > share:
      raise ValueError(
        f"--max-offered-kv-bytes {self.group_offer_bytes}: more than the {share} bytes of the device "
        "KV budget the engine set aside for offers (Engine(..., offer_kv_bytes=...))"
      )
    self.max_offered_bytes = self.group_offer_bytes * self.engine.groups
    # Held now per DP group: offers not acknowledged or taken back yet, and prefills in flight.
    self._group_offered = [0] * self.engine.groups
    self._offered_lock = threading.Lock()  # (take-backs release from their own thread)

  def offer_bytes(self, prompt_tokens: int) -> int:
    """The bytes of a prompt's offer (``Engine._export_kv``): latent rows and indexer keys of every layer, in their
    stored dtypes, for ``Engine.export_positions`` positions."""
    layout = self.engine.layout
    return self.engine.export_positions(prompt_tokens) * (layout.latent_bytes + layout.index_bytes)

  @property
  def offered_bytes(self) -> int:
    """Prompt KV bytes held now over all DP groups (offers not acknowledged or taken back, prefills in flight)."""
    return sum(self._group_offered)

  def _reserve(self, nbytes: int) -> tuple[int | None, str | None]:
    """(group, None): ``nbytes`` counted as held by that DP group, the one with the fewest held bytes (then the
    lowest index) of those it fits in ``group_offer_bytes``; or (None, the refusal's message)."""
    with self._offered_lock:
      if nbytes > self.group_offer_bytes:
        return None, (
          f"this prompt's KV offer ({nbytes} bytes) is larger than the prefill server's "
          f"--max-offered-kv-bytes {self.group_offer_bytes}"
        )
      held = self._group_offered
      group = min(range(len(held)), key=lambda g: (held[g], g))
      if held[group] + nbytes > self.group_offer_bytes:
        where = "" if len(held) == 1 else f" per DP group (its {len(held)} groups hold {held})"
        return None, (
          f"the prefill server holds {sum(held)} bytes of prompt KV for decode servers (offers not "
          f"pulled yet, prefills in flight); this prompt's {nbytes} would pass its --max-offered-kv-bytes "
          f"{self.group_offer_bytes}{where}: retry later or on another prefill server"
        )
      held[group] += nbytes
      return group, None

  def _release(self, group: int, nbytes: int) -> None:
    with self._offered_lock:
      self._group_offered[group] -= nbytes

  @property
  def offers_taken_back(self) -> int:
    return self.take_backs.taken_back

  def info(self) -> hisparse_pb2.InfoResponse:
    e = self.engine
    L, W, Di, dtype, numerics = _kv_layout(e)
    return hisparse_pb2.InfoResponse(
      model_fingerprint=e.model_fingerprint,
      num_layers=L,
      latent_dim=W,
      index_dim=Di,
      latent_dtype=dtype,
      numerics=numerics,
      transfer_address=self.transfer.address,
      max_seq_len=e.max_seq_len,
      page_size=e.page_size,
    )

  async def Info(self, request, context):
    return self.info()

  async def Prefill(self, request_iterator, context):
    streams = self.streams
    if streams is None:
      return await self._prefill(context, await self._first_message(context))
    if (busy := streams.streams_busy()) is not None:
      # Read the caller's first message (for a second at most) before refusing: its write then completes and
      # it sees this status, not the INTERNAL of a write into a finished call.
      with contextlib.suppress(Exception):
        await asyncio.wait_for(context.read(), timeout=1.0)
      await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
    streams.open_streams += 1
    try:
      return await self._prefill(context, await self._first_message(context))
    finally:
      streams.open_streams -= 1

  @staticmethod
  async def _first_message(context):
    """The stream's first message; DEADLINE_EXCEEDED after ``FIRST_MESSAGE_TIMEOUT_S`` without one."""
    try:
      return await asyncio.wait_for(context.read(), FIRST_MESSAGE_TIMEOUT_S)
    except asyncio.TimeoutError:
      await context.abort(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"no PrefillRequest within {FIRST_MESSAGE_TIMEOUT_S:g} s of opening the Prefill stream",
      )

  async def _prefill(self, context, first):
    if not isinstance(first, hisparse_pb2.PrefillMessage) or first.WhichOneof("message") != "request":
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Prefill stream starts with a PrefillRequest")
    message = first.request
    try:
      req = Request(
        request_id=uuidlib.uuid4().hex,
        prompt_ids=list(message.input_ids.ids),
        max_new_tokens=1,
        ignore_eos=True,
        export_kv=True,
        **_sampling(message),
      )
      self.engine.validate(req)
    except RequestError as e:
      await context.abort(grpc.StatusCode[e.code], str(e))
    held = self.offer_bytes(len(req.prompt_ids))
    group, refusal = self._reserve(held)
    if refusal is not None:  # before any work: its offer could not be held
      await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    req.dp_group = group  # (its offer stays on that group's device)
    release = functools.partial(self._release, group, held)
    handed = []  # [True] once a take-back holds the offer: it releases the bytes when the offer is freed
    try:
      await self._prefill_and_offer(context, req, release, handed)
    finally:
      if not handed:
        release()

  async def _prefill_and_offer(self, context, req: Request, release, handed: list) -> None:
    """Prefills ``req``, offers its KV and waits for the acknowledgement of its pull; an offer not acknowledged
    goes to the take-backs (``handed`` gets True: they call ``release``, which frees its reserved bytes). Aborts
    the call (raising) where the prefill fails, or where the caller breaks the protocol (after its offer went to
    the take-backs)."""
    arrival = time.monotonic()
    events = self._events_cls(asyncio.get_running_loop())
    self.loop.submit(req, events)
    done = False
    try:
      while True:
        ev = await events.get()
        if ev.error is not None:
          done = True
          await context.abort(grpc.StatusCode[ev.error.code], str(ev.error))
        if ev.token is None:
          done = True
          break
    finally:
      if not done:  # the decode server went away or cancelled: stop the prefill
        self.loop.abort(req.request_id)
    fin = ev.done
    if fin is None or fin.prompt_kv is None:
      await context.abort(grpc.StatusCode.CANCELLED, "the prefill was aborted")
    latent, index = fin.prompt_kv
    # Unguessable: a uuid is all a pull needs, and only a pull reveals the proof.
    import jax
    import numpy as np

    uuid = int.from_bytes(os.urandom(8), "little") >> 1
    proof = jax.device_put(np.frombuffer(os.urandom(8), np.uint32), latent.sharding)
    self.transfer.offer(uuid, (latent, index, proof))
    acknowledged, broken = False, None
    try:
      await context.write(
        hisparse_pb2.PrefillOffer(
          first_token=fin.output_ids[0],
          transfer_uuid=uuid,
          transfer_address=self.transfer.address,
          kv_positions=latent.shape[1],
          latent_dtype=latent.dtype.name,
          prefill_seconds=(fin.first_token_time or time.monotonic()) - arrival,
          kv_bytes=latent.nbytes + index.nbytes,
          num_layers=latent.shape[0],
          latent_dim=latent.shape[2],
          index_dim=index.shape[2],
          numerics=_kv_layout(self.engine)[4],
          model_fingerprint=self.engine.model_fingerprint,
        )
      )
      reply = await asyncio.wait_for(context.read(), self.timeout_s)
      kind = reply.WhichOneof("message") if isinstance(reply, hisparse_pb2.PrefillMessage) else None
      claimed = kind == "received" and reply.received.pulled
      acknowledged = claimed and reply.received.pull_proof == _proof_value(proof)
      if claimed and not acknowledged:
        log.warning("prefill offer %d: acknowledged without the proof of its pull: taken back", uuid)
        broken = (
          grpc.StatusCode.INVALID_ARGUMENT,
          "the acknowledgement's pull_proof is not the offer's (only its pull reveals it): the KV was taken back",
        )
      elif kind == "request":
        broken = (
          grpc.StatusCode.INVALID_ARGUMENT,
          "a Prefill stream carries one PrefillRequest; its offer was taken back",
        )
    except asyncio.TimeoutError:
      log.warning("prefill offer %d not acknowledged within %.0f s: taken back", uuid, self.timeout_s)
      broken = (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the offer was not acknowledged within --transfer-timeout-s {self.timeout_s:g}: the KV was taken back",
      )
    finally:
      if not acknowledged:
        specs = _specs(*latent.shape, index.shape[2], latent.dtype, index.dtype)
        if self.take_backs.add(uuid, specs, latent.nbytes + index.nbytes, on_done=release):
          handed.append(True)
    if broken is not None:
      await context.abort(*broken)  # (raises)


class TakeBacks:
  """A prefill server's unclaimed offers, pulled back from its own transfer server (which frees them: nothing
  else does). Each pull starts at once on a connection of its own; one thread (started while any is pending,
  gone when none is) polls them every POLL_S and cuts one with no data by its deadline (TAKE_BACK_BASE_S + its
  bytes at TAKE_BACK_MIN_BYTES_PER_S): its offer had been pulled already, by a caller that then went away, and a
  pull of a uuid no longer offered waits until the server exits. So any number of take-backs progress at once,
  and none outlives its deadline; ``TransferEndpoint.close`` (a server stop) cuts them with its other pulls,
  and the thread then ends."""

  POLL_S = 0.01

  def __init__(self, transfer: TransferEndpoint):
    self.transfer = transfer
    self._pending: list = []  # (deadline, uuid, connection, arrays, on_done)
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self.taken_back = 0  # offers freed
    self.already_pulled = 0  # cut at their deadline

  def add(self, uuid: int, specs, nbytes: int, on_done=None) -> bool:
    """Starts taking back the offer ``uuid`` (``specs``: ``_specs`` of its arrays; ``nbytes``: its KV bytes, which
    set its deadline); ``on_done()`` runs (on the take-back thread) once it is freed or cut. Non-blocking; returns
    False, starting nothing, once the endpoint is closed (the server is stopping)."""
    try:
      connection, arrays = self.transfer.start_pull(self.transfer.address, uuid, specs)
    except RuntimeError:  # closed: the server is stopping
      return False
    deadline = time.monotonic() + TAKE_BACK_BASE_S + nbytes / TAKE_BACK_MIN_BYTES_PER_S
    with self._lock:
      self._pending.append((deadline, uuid, connection, arrays, on_done))
      if self._thread is None:
        self._thread = threading.Thread(target=self._poll, name="take-back")
        self._thread.start()
    return True

  def pending(self) -> int:
    """Take-backs not finished or cut yet."""
    with self._lock:
      return len(self._pending)

  def _poll(self) -> None:
    while True:
      with self._lock:
        if not self._pending:
          self._thread = None
          return
        pending = list(self._pending)
      import jax

      now, ended = time.monotonic(), []
      for item in pending:
        deadline, uuid, connection, arrays, on_done = item
        if all(x.is_ready() for x in arrays):
          try:
            jax.block_until_ready(arrays)
            self.taken_back += 1
          except Exception as e:  # noqa: BLE001 - cut by close(), or the transfer failed
            log.warning("prefill offer %d: taking it back failed: %s", uuid, str(e).splitlines()[0])
          self.transfer.done(connection)
          ended.append(item)
        elif now >= deadline:
          self.transfer.cut(connection)
          self.already_pulled += 1
          log.warning(
            "prefill offer %d: taking it back found no data by its deadline (it had been pulled by a "
            "caller that did not acknowledge it); cut",
            uuid,
          )
          ended.append(item)
      ended_ids = {id(item) for item in ended}
      with self._lock:
        self._pending = [p for p in self._pending if id(p) not in ended_ids]
      for item in ended:
        if item[4] is not None:
          item[4]()
      time.sleep(self.POLL_S)


# ---------------------------------------------------------------------------------------------- decode
class PrefillFailed(Exception):
  """A prefill server or its transfer failed (another may succeed). exhausted: the server refused the request
  with RESOURCE_EXHAUSTED (busy, or the request cannot fit its memory); invalid: with INVALID_ARGUMENT, though
  this server's own checks took it (that server's limits are below this one's); expired: the caller's deadline
  passed first (no other server is tried)."""

  def __init__(self, message: str, exhausted: bool = False, expired: bool = False, invalid: bool = False):
    super().__init__(message)
    self.exhausted, self.expired, self.invalid = exhausted, expired, invalid


def _metadata(api_key: str | None) -> tuple:
  from hisparse_jax.serving import credentials

  return (("authorization", credentials.bearer(api_key)),) if api_key else ()


def prefill_error_text(code, details: str | None) -> str:
  """How a prefill server's failed call reads in the decode server's error: ``CODE: details``, with the likely
  cause where gRPC's own words hide it (a stream cut by the server's exit reads "Stream removed (Socket
  closed)"; one cut by its graceful stop, "Cancelling all calls")."""
  details = details or ""
  text = f"{code.name}: {details}"
  if code == grpc.StatusCode.UNAVAILABLE:
    if details == "Cancelling all calls":
      text += " (that prefill server is shutting down)"
    elif "Socket closed" in details or "Stream removed" in details:
      text += " (the connection was lost mid-call: did that prefill server exit?)"
  return text


def _channel(address: str, credentials: grpc.ChannelCredentials | None, aio: bool = False, options=None):
  module = grpc.aio if aio else grpc
  if credentials is None:
    return module.insecure_channel(address, options=options)
  return module.secure_channel(address, credentials, options=options)


def _tls_mismatch(address: str, ca: bytes | None) -> str | None:
  """Why a connection to ``address`` fails at the TLS layer, found by a TLS handshake of our own (gRPC's errors
  for it vary with timing and load); None if the handshake says nothing (e.g. nothing listens there). ca: the
  CA a decode server trusts (--prefill-tls-ca-file; None: it connects in plain text)."""
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
  if ca is None:  # any certificate: the question is only whether TLS answers
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
  else:
    context.load_verify_locations(cadata=ca.decode())
  context.set_alpn_protocols(["h2"])
  try:
    with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S) as raw:
      with context.wrap_socket(raw, server_hostname=host if ca is not None else None):
        pass  # the server answered the handshake: it speaks TLS
  except ssl.SSLCertVerificationError as e:
    return (
      f"; its TLS certificate does not pass --prefill-tls-ca-file ({e.verify_message}: it must be signed "
      f"by that CA and name the host {host})"
    )
  except (OSError, ValueError):
    return None  # not TLS, or nothing there: gRPC's own error says which
  if ca is None:
    return "; it serves TLS and this server connects in plain text: pass --prefill-tls-ca-file"
  return (
    "; its TLS certificate passes --prefill-tls-ca-file, yet gRPC could not connect: does it require a "
    "client certificate (--prefill-tls-cert-file / --prefill-tls-key-file)?"
  )


def check_prefill_servers(engine, config: DisaggregationConfig) -> list:
  """Each of ``config.prefill_servers``' InfoResponse (what ``PrefillClient`` checks its offers against).
  ValueError naming ``--prefill-servers`` unless every prefill server answers Info within CONNECT_TIMEOUT_S (a
  server not listening yet, e.g. still loading its model, is waited for that long) over ``config``'s TLS and API
  key, and serves the same model (``models.convert.model_fingerprint``) with the same KV layout and dtype (the
  stored latent row: --dtype and --kv-cache-dtype), and a context >= this engine's."""
  layout = _kv_layout(engine)
  credentials, api_key = config.channel_credentials(), config.api_key
  infos = []
  for address in config.prefill_servers:
    with _channel(address, credentials) as channel:
      try:
        info = hisparse_pb2_grpc.PrefillServiceStub(channel).Info(
          hisparse_pb2.InfoRequest(), timeout=CONNECT_TIMEOUT_S, metadata=_metadata(api_key), wait_for_ready=True
        )
      except grpc.RpcError as e:
        status, fix = f"({e.code().name}: {e.details()})", "; start it with --disaggregation-mode prefill"
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
          why = f"the server there is not a prefill server {status}{fix}"
        elif e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
          why = f"no prefill server answered within {CONNECT_TIMEOUT_S:.0f} s {status}"
          why += _tls_mismatch(address, config.prefill_tls_ca) or fix
        elif e.code() == grpc.StatusCode.UNAUTHENTICATED:
          why = f"the prefill server refused this server's --api-key {status}; both need the same one"
        else:
          why = f"its Info call failed {status}"
        raise ValueError(f"--prefill-servers {address}: {why}") from None
    theirs = (info.num_layers, info.latent_dim, info.index_dim, info.latent_dtype, info.numerics)
    if info.model_fingerprint != engine.model_fingerprint:
      raise ValueError(
        f"--prefill-servers {address}: serves another model (checkpoint fingerprint "
        f"{info.model_fingerprint[:12]}..., here {engine.model_fingerprint[:12]}...: its config.json "
        "and weight files differ); both need the same --model-path checkpoint"
      )
    if theirs != layout:
      raise ValueError(
        f"--prefill-servers {address}: serves another KV layout (layers, latent row and indexer key "
        f"widths in elements of the row dtype, row dtype, numerics: {theirs}; here {layout}); both "
        "need the same --dtype, --kv-cache-dtype and --fp8-numerics"
      )
    if info.max_seq_len < engine.max_seq_len:
      raise ValueError(
        f"--prefill-servers {address}: its --max-seq-len {info.max_seq_len} is below this server's {engine.max_seq_len}"
      )
    if not 0 < info.page_size <= max_offer_positions(engine):
      raise ValueError(
        f"--prefill-servers {address}: its --page-size {info.page_size} is not in [1, "
        f"{max_offer_positions(engine)}] (its offers would be larger than this server's prompts)"
      )
    infos.append(info)
  return infos


def max_offer_positions(engine) -> int:
  """The most positions a decode server pulls for one prompt: its longest prompt's power of two, or its page."""
  return engine.export_positions(engine.max_seq_len)


def offer_fault(engine, info, offer, prompt_tokens: int) -> str | None:
  """Why a decode server refuses ``offer`` (a PrefillOffer for a prompt of ``prompt_tokens``) before pulling it,
  given what its prefill server announced (``info``, its InfoResponse); None if it takes it. Checked: the
  transfer address is the announced one (a pull from any other could be a listener whose bytes crash jax's
  transfer library); the positions are exactly max(announced page size, the power of two >= the prompt) and
  within this engine's context (an offer of 2^20 positions for 40 tokens was pulled and decoded); the bytes are
  those positions' rows; the first token is in the vocabulary."""
  if offer.transfer_address != info.transfer_address:
    return (
      f"offer names transfer address {offer.transfer_address!r}; that prefill server announced "
      f"{info.transfer_address!r}"
    )
  want = max(info.page_size, 1 << max(prompt_tokens - 1, 0).bit_length())
  limit = max_offer_positions(engine)
  if offer.kv_positions != want or want > limit:
    return (
      f"offer of {offer.kv_positions} positions for a prompt of {prompt_tokens} tokens; expected {want} "
      f"(its --page-size {info.page_size}, at most {limit} here)"
    )
  layout = engine.layout
  if offer.kv_bytes != want * (layout.latent_bytes + layout.index_bytes):
    return (
      f"offer of {offer.kv_bytes} bytes; {want} positions of this KV layout hold "
      f"{want * (layout.latent_bytes + layout.index_bytes)}"
    )
  if not 0 <= offer.first_token < engine.config.vocab_size:
    return f"offer's first token {offer.first_token} is outside the vocabulary of {engine.config.vocab_size}"
  return None


class PrefillClient:
  """A decode server's side: picks a prefill server round-robin, runs ``Prefill`` there, pulls the KV, and
  retries once on another prefill server when one fails (module docstring)."""

  def __init__(
    self,
    engine,
    servers: tuple[str, ...],
    transfer,
    timeout_s: float,
    api_key: str | None = None,
    prefill_timeout_s: float = PREFILL_TIMEOUT_S,
    infos=None,
    credentials: grpc.ChannelCredentials | None = None,
  ):
    """transfer: what pulls (a ``TransferEndpoint``, or a ``pull_worker.PullWorker``: both have ``pull``);
    timeout_s: ``--transfer-timeout-s`` (the longest a pull may take); prefill_timeout_s:
    ``--prefill-timeout-s`` (the longest one attempt may wait for a prefill server's offer); infos: each
    server's InfoResponse from ``check_prefill_servers`` (None: asked at the first offer); credentials: TLS to
    the prefill servers (None: plain text)."""
    self.credentials = credentials
    self.engine = engine
    self.servers = servers
    self._infos = list(infos) if infos is not None else [None] * len(servers)
    self.metadata = _metadata(api_key)
    self.transfer = transfer
    self.timeout_s = timeout_s
    self.prefill_timeout_s = prefill_timeout_s
    self._stubs: list | None = None  # grpc.aio stubs, made on the server's event loop
    self._next = 0
    self._pulls = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-pull")
    self.layout = _kv_layout(engine)
    self.index_dtype = engine.layout.index_dtype  # FP8 keys go with FP8 latent rows (the same --kv-cache-dtype)

  def _stub(self, i: int):
    if self._stubs is None:
      # A prefill server that comes back is reconnected to within ~1 s (gRPC's default backoff grows to 120 s:
      # requests kept failing for 8 s after a 75 s outage had ended).
      options = [
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
      ]
      self._stubs = [
        hisparse_pb2_grpc.PrefillServiceStub(_channel(s, self.credentials, aio=True, options=options))
        for s in self.servers
      ]
    return self._stubs[i]

  async def prefill(self, req: Request, deadline_s: float | None = None) -> None:
    """Sets req.prompt_kv, first_token and its prefill / transfer timings from a prefill server (deadline_s:
    the seconds the caller's own deadline leaves, None: none; each attempt's wait for an offer ends at that
    deadline or after ``prefill_timeout_s``, whichever comes first; a pull that has begun is finished and
    acknowledged even past the deadline, so that the prefill server frees the offer).

    Raises:
      Unavailable: the prefill server(s) or the transfer failed (after one retry on another server).
      DeadlineExceeded: the caller's deadline passed before an offer came (after any failed attempt).
      InvalidRequest: every prefill server tried (two at most) refused the request as invalid. The caller
        validated it first (``Engine.validate``, the checks a prefill server runs), so such a refusal means
        that server runs with smaller limits than this one (a restart with a smaller --max-seq-len, which the
        start-up check cannot see): another server is tried.
      ResourceExhausted: every prefill server tried (two at most) refused it with RESOURCE_EXHAUSTED (busy, or
        a prompt its memory cannot hold), or some so and the others as invalid (none failed).
    """
    if req.seed is None:  # drawn here, so that the first token (sampled there) and the rest share it
      req.seed = int.from_bytes(os.urandom(4), "little")
    # (a client of another language may send a deadline gRPC here cannot represent: see MAX_TIMEOUT_S)
    end = None if deadline_s is None else time.monotonic() + min(deadline_s, MAX_TIMEOUT_S)
    errors, exhausted, invalid, expired = [], [], [], False
    for _ in range(min(2, len(self.servers))):
      left = None if end is None else end - time.monotonic()
      if left is not None and left <= 0:
        errors.append("the request's deadline passed")
        expired = True
        break
      i = self._next
      self._next = (self._next + 1) % len(self.servers)
      try:
        await self._prefill_on(i, req, left)
        return
      except PrefillFailed as e:
        errors.append(f"{self.servers[i]}: {e}")
        exhausted.append(e.exhausted)
        invalid.append(e.invalid)
        expired = e.expired
        if expired:
          break
    if expired:  # (the caller sees its own deadline's status, whatever failed before it)
      raise DeadlineExceeded("prefill failed: " + "; ".join(errors))
    if invalid and all(invalid):  # no server tried takes it: a retry of the same request would fail the same way
      raise InvalidRequest("prefill failed: " + "; ".join(errors))
    if exhausted and all(x or y for x, y in zip(exhausted, invalid)):  # refused for memory or load: not a failure
      raise ResourceExhausted("prefill failed: " + "; ".join(errors))
    raise Unavailable("prefill failed: " + "; ".join(errors))

  async def _prefill_on(self, i: int, req: Request, deadline_s: float | None) -> None:
    # The caller's deadline bounds the wait for the offer, not the call: once the KV is offered, its pull and
    # acknowledgement finish whatever the caller does (a call ended by a gRPC timeout between the pull and the
    # acknowledgement left the prefill server taking back an offer already pulled: it waits for that take-back's
    # deadline, then cuts it, and jax's transfer library keeps that connection's socket open).
    call = self._stub(i).Prefill(metadata=self.metadata)

    async def request_and_offer():
      await call.write(
        hisparse_pb2.PrefillMessage(
          request=hisparse_pb2.PrefillRequest(
            input_ids=hisparse_pb2.TokenIds(ids=req.prompt_ids),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            **({} if req.seed is None else {"seed": req.seed}),
          )
        )
      )
      return await call.read()

    by_deadline = deadline_s is not None and deadline_s < self.prefill_timeout_s
    try:  # --prefill-timeout-s bounds the wait for the offer only (a pull has --transfer-timeout-s)
      offer = await asyncio.wait_for(request_and_offer(), deadline_s if by_deadline else self.prefill_timeout_s)
    except asyncio.TimeoutError:  # cancelling the call stops the prefill there
      call.cancel()
      if by_deadline:
        raise PrefillFailed("the request's deadline passed before its KV was offered", expired=True) from None
      raise PrefillFailed(f"no KV offer within --prefill-timeout-s {self.prefill_timeout_s:g}") from None
    except asyncio.CancelledError:  # the client went away during the prefill: stop it there
      call.cancel()
      raise
    except grpc.aio.AioRpcError as e:
      text = prefill_error_text(e.code(), e.details())
      if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # (this server's checks took it: see prefill's Raises)
        text += (
          " (this server takes the request: does that prefill server run with a smaller --max-seq-len "
          "since this server started?)"
        )
      raise PrefillFailed(
        text,
        exhausted=e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED,
        invalid=e.code() == grpc.StatusCode.INVALID_ARGUMENT,
      ) from None
    if offer is grpc.aio.EOF:
      raise PrefillFailed("the stream ended without an offer")
    L, W, Di, dtype, _ = self.layout
    theirs = (offer.num_layers, offer.latent_dim, offer.index_dim, offer.latent_dtype, offer.numerics)
    if theirs != self.layout or offer.kv_positions < len(req.prompt_ids):
      call.cancel()  # nothing pulled: the prefill server takes its offer back
      raise PrefillFailed(
        f"offer of {offer.kv_positions} positions of layout {theirs} (layers, latent row and "
        f"indexer key widths, row dtype, numerics); expected >= {len(req.prompt_ids)} of "
        f"{self.layout}: did it restart with another --dtype, --kv-cache-dtype "
        "or --fp8-numerics?"
      )
    if offer.model_fingerprint != self.engine.model_fingerprint:
      call.cancel()
      raise PrefillFailed(
        f"offer from another model (fingerprint {offer.model_fingerprint[:12] or 'none'}..., "
        f"here {self.engine.model_fingerprint[:12]}...): did it restart with another "
        "--model-path?"
      )
    if (fault := await self._offer_fault(i, req, offer)) is not None:
      call.cancel()  # nothing pulled: the prefill server takes its offer back
      raise PrefillFailed(fault)
    specs = _specs(L, offer.kv_positions, W, Di, dtype, self.index_dtype)
    start = time.monotonic()
    # The pull and its acknowledgement are shielded from the caller's cancellation (an abort): a pull in
    # flight is finished and acknowledged, then dropped.
    task = asyncio.ensure_future(self._pull_and_acknowledge(call, offer, specs))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (an abandoned task's error is expected)
    try:
      latent, index, _ = await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
    except asyncio.TimeoutError:
      raise PrefillFailed(f"the KV transfer took over --transfer-timeout-s {self.timeout_s:g}") from None
    req.prompt_kv, req.first_token = (latent, index), offer.first_token
    req.prefill_seconds, req.transfer_seconds = offer.prefill_seconds, time.monotonic() - start
    req.transfer_bytes = latent.nbytes + index.nbytes

  async def _offer_fault(self, i: int, req: Request, offer) -> str | None:
    """``offer_fault`` against server i's InfoResponse; on a fault, asked again once (it may have restarted on
    another transfer port or page size) and checked again. A failed Info call is the fault."""
    for fresh in (self._infos[i] is None, True):
      if fresh:
        try:
          self._infos[i] = await self._stub(i).Info(
            hisparse_pb2.InfoRequest(), timeout=CONNECT_TIMEOUT_S, metadata=self.metadata
          )
        except grpc.aio.AioRpcError as e:
          return f"its Info call failed ({prefill_error_text(e.code(), e.details())})"
      fault = offer_fault(self.engine, self._infos[i], offer, len(req.prompt_ids))
      if fault is None:
        return None
    return fault

  def _pull_by(self, deadline: float, address: str, uuid: int, specs) -> list:
    """``transfer.pull`` with the time left until ``deadline`` (a time.monotonic() instant, set as the pull was
    queued); TimeoutError without pulling once it has passed. A request gives up its pull at that deadline, so a
    pull still queued behind others then (a peer whose pulls never answer filled the PULL_THREADS) must not
    hold a thread for a request that has failed: the backlog of such a burst ends by its deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError("no pull thread was free before --transfer-timeout-s passed")
    return self.transfer.pull(address, uuid, specs, left)

  async def _pull_and_acknowledge(self, call, offer, specs):
    loop = asyncio.get_running_loop()
    try:
      arrays = await loop.run_in_executor(
        self._pulls,
        self._pull_by,
        time.monotonic() + self.timeout_s,
        offer.transfer_address,
        offer.transfer_uuid,
        specs,
      )
    except Exception as e:  # noqa: BLE001 - the prefill server died or refused: it keeps nothing of ours
      call.cancel()
      raise PrefillFailed(
        f"KV transfer from {offer.transfer_address}: {(str(e) or type(e).__name__).splitlines()[0]}"
      ) from None
    try:  # the proof tells the prefill server this was a real pull (else it takes the offer back)
      await call.write(
        hisparse_pb2.PrefillMessage(received=hisparse_pb2.KVReceived(pulled=True, pull_proof=_proof_value(arrays[2])))
      )
      await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):  # (the latter: "RPC already finished")
      pass  # the KV is here; the prefill server's stream is gone (nothing is left offered)
    return arrays
