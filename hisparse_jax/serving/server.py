"""gRPC inference server (``grpc.aio``): a streaming ``Generate`` RPC over one continuous-batching engine.

Threads: one asyncio thread runs every RPC handler (``grpc.aio``: an open stream is a suspended coroutine,
not a thread, so any number of streams leaves ``Health``, ``GetLoads`` and ``Abort`` answering at once);
one ``EngineLoop`` thread owns the engine and runs the decode loop; a small pool tokenizes text prompts
(never on the decode loop). A handler checks every limit before doing work (``ServerLimits``: open streams,
streams per client, prompt bytes before tokenizing, request id, sampling values as sent; the engine's
``validate`` for the rest), so a bad request fails alone with INVALID_ARGUMENT or RESOURCE_EXHAUSTED; then it
hands the request to the loop and streams the events the loop posts to the request's own asyncio queue (each
token with its text delta, made by the request's incremental detokenizer on the loop thread). A cancelled RPC
aborts its request at the next step boundary. ``GetLoads`` answers from the snapshot the loop publishes after
every step. The standard ``grpc.health.v1`` service reports SERVING while the loop runs and needs no
credentials.

Security (``serve`` arguments, ``run_server.py`` flags): TLS with grpcio's own credentials (optionally
mutual, with a client CA) and a bearer token every HiSparseInference call must carry as
``authorization: Bearer KEY`` metadata (UNAUTHENTICATED otherwise).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import dataclasses
import functools
import hmac
import ipaddress
import logging
import math
import os
import queue
import threading
import time
import urllib.parse
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2  # health.aio: the asyncio servicer

from hisparse_jax.engine import Engine, InternalError, InvalidRequest, Request, RequestError, Unavailable
from hisparse_jax.engine.engine import check_stop_counts
from hisparse_jax.engine.detokenizer import GIL_FREE_ENCODE_CHARS, encode_prompt
from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving import credentials
from hisparse_jax.serving.addresses import join_host_port
from hisparse_jax.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)


class _QuietClientGone(logging.Filter):
  """Drops grpc.aio's "ExecuteBatchError raised in core by servicer method" record (ERROR, with a traceback):
  a stream's write after its client went away (cancelled, deadline, disconnected) fails so, which the handler
  already treats as a cancel (its request is aborted at the next step); a client could otherwise grow the log
  by a traceback per stream it drops."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (
      record.exc_info
      and record.exc_info[0] is not None
      and record.exc_info[0].__name__ == "ExecuteBatchError"
      and str(record.msg).startswith("ExecuteBatchError raised in core by servicer method")
    )


logging.getLogger("grpc._cython.cygrpc").addFilter(_QuietClientGone())

SERVICE_NAME = "hisparse.HiSparseInference"
PREFILL_SERVICE_NAME = "hisparse.PrefillService"
_FINISH = {
  "stop": hisparse_pb2.STOP,
  "length": hisparse_pb2.LENGTH,
  "abort": hisparse_pb2.ABORT,
  "stop_token": hisparse_pb2.STOP_TOKEN,
  "stop_string": hisparse_pb2.STOP_STRING,
}


@dataclasses.dataclass
class _Event:
  token: int | None = None  # a new token
  text: str = ""  # the text it completes
  done: Request | None = None  # the request finished
  error: RequestError | None = None  # the engine failed this request (error.code: its gRPC status)


class EngineLoop(threading.Thread):
  """Runs ``engine.step()`` while there is work; accepts submissions and aborts from any thread."""

  def __init__(self, engine: Engine, metrics: ServerMetrics | None = None):
    super().__init__(name="engine-loop", daemon=True)
    self.engine = engine
    self.metrics = metrics
    self._inbox: queue.Queue = queue.Queue()
    self._stopped = threading.Event()

  def submit(self, req: Request, events: queue.Queue) -> None:
    metrics = self.metrics

    def on_token(token: int, text: str) -> None:
      if metrics is not None:
        metrics.on_token(req.request_id)
      events.put(_Event(token=token, text=text))

    req.on_token = on_token
    if metrics is not None:
      metrics.on_submit(req.request_id, req.arrival or None)
    self._inbox.put(("submit", req, events))

  def abort(self, request_id: str) -> None:
    self._inbox.put(("abort", request_id, None))

  def stop(self, timeout: float | None = None) -> None:
    """Stops the loop after the current step and waits for it (a daemon thread still
    running at interpreter exit can abort the process inside XLA)."""
    self._stopped.set()
    self._inbox.put(("wake", None, None))
    if self.is_alive() and threading.current_thread() is not self:
      self.join(timeout)

  def run(self) -> None:
    listeners: dict[str, queue.Queue] = {}
    self._update_metrics()  # the idle state before the first request
    while not self._stopped.is_set():
      block = not self.engine.has_work()
      while True:
        try:
          kind, item, events = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
          break
        block = False
        if kind == "submit":
          try:
            self.engine.submit(item)
            listeners[item.request_id] = events
          except RequestError as e:  # e.g. the queue is full: fails this request alone
            if self.metrics is not None:
              self.metrics.on_finish(item)  # (drops the arrival on_submit noted)
            events.put(_Event(error=e))
        elif kind == "abort" and item in listeners:
          req = self.engine.abort(item)
          if req is not None and self.metrics is not None:
            self.metrics.on_finish(req)
          listeners.pop(item).put(_Event(done=req))
          self._update_metrics()  # gauges follow a release even when the server then sits idle
      if not self.engine.has_work():
        self.engine.idle()  # several processes: a heartbeat to the followers now and then
        continue
      try:
        finished = self.engine.step()
      except Exception as e:  # noqa: BLE001 - keep serving: fail the affected requests
        log.exception("decode step failed; failing running requests")
        for rid in list(listeners):
          listeners.pop(rid).put(_Event(error=InternalError(f"internal error: {e}")))
        for req in self.engine.reset():  # every request in flight, finished as an error
          if self.metrics is not None:
            self.metrics.on_finish(req)  # (drops its per-request timing entries)
        self._update_metrics()
        continue
      for req in finished:
        if self.metrics is not None:
          self.metrics.on_finish(req)
        q = listeners.pop(req.request_id, None)
        if q is not None:  # a request a kernel refused fails alone (INTERNAL: the engine built its input)
          q.put(_Event(error=InternalError(req.error)) if req.finish_reason == "error" else _Event(done=req))
      self._update_metrics()
    for q in listeners.values():  # stopped with requests in flight
      q.put(_Event(error=Unavailable("server shutting down")))

  def _update_metrics(self) -> None:
    if self.metrics is not None:
      self.metrics.update(self.engine.loads_snapshot)


# Request fields a client controls the size of, checked before any work.
MAX_REQUEST_ID_BYTES = 256
# Text prompts are tokenized on TOKENIZER_THREADS threads (never the decode loop's; the tokenizer releases
# the GIL for them) at TOKENIZER_NICE, so on a busy machine they take only CPU the engine leaves idle; short
# ones (<= GIL_FREE_ENCODE_CHARS characters, microseconds) inline. The tokenizers library's own thread pool
# (rayon) is switched off (a worker it spawned would run at normal priority).
TOKENIZER_THREADS = 2
TOKENIZER_NICE = 15
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tokenizer_thread_init() -> None:
  try:  # Linux: a thread's nice value is per thread (its TID)
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
  except (AttributeError, OSError):
    pass


def _tokenize_off_loop(tokenizer, text: str, bos: int | None) -> list[int]:
  """encode_prompt on a tokenizer thread; then hands the freed transient memory (a 1 MB text's encoding
  takes ~300 MB) back to the OS, so a burst of long prompts does not leave the server's RSS inflated."""
  try:
    return encode_prompt(tokenizer, text, bos)
  finally:
    _malloc_trim()


def _malloc_trim() -> None:
  trim = _glibc_malloc_trim()
  if trim is not None:
    trim(0)


@functools.cache
def _glibc_malloc_trim():
  """glibc's malloc_trim, or None (another libc)."""
  try:
    return ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):
    return None


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """What one client may ask of the server (each checked before the work it bounds).

  max_streams: Generate (and a prefill server's Prefill) streams open at once (admitted + queued + being
    tokenized, or holding a KV offer); more get RESOURCE_EXHAUSTED at once. None: the engine's request slots
    + its max_queued_requests (unbounded when that is None).
  max_prompt_bytes: UTF-8 bytes of a text prompt, checked before tokenizing; None: the engine's.
  max_streams_per_client: Generate streams one client (``client_of``) may hold open at once, so that one client
    cannot take every stream ``max_streams`` allows; more get RESOURCE_EXHAUSTED at once. None: half of
    ``max_streams`` with ``fair_sharing`` (clients behind one proxy or NAT are one client here), else no bound.
  fair_sharing: each Generate's request carries its client (``Request.client``), so the engine admits clients'
    requests in turn and gives a client holding no request slot one at the next step (``Engine`` docstring,
    step 2). False (a single-tenant deployment): arrival order, and no default per-client bound.
  max_connections: TCP connections the gRPC server holds at once (handshaking or not); more are closed as they
    arrive, so a flood of connections cannot take the process's descriptors. None: ``default_max_connections``.
  handshake_timeout_s: seconds a connection may take to finish its TLS handshake before it is closed (gRPC's
    default is 120 s). A plain-text connection has no handshake: ``max_connections`` alone bounds those.
  """

  max_streams: int | None = None
  max_prompt_bytes: int | None = None
  max_streams_per_client: int | None = None
  max_connections: int | None = None
  handshake_timeout_s: float = 10.0
  fair_sharing: bool = True

  def __post_init__(self):
    for name in ("max_streams", "max_prompt_bytes", "max_streams_per_client", "max_connections"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f"ServerLimits.{name} must be >= 1 or None, got {value}")
    if not MIN_HANDSHAKE_TIMEOUT_S <= self.handshake_timeout_s <= 3600:  # (NaN fails too)
      raise ValueError(
        f"ServerLimits.handshake_timeout_s must be in [{MIN_HANDSHAKE_TIMEOUT_S}, 3600] seconds, got "
        f"{self.handshake_timeout_s}"
      )
    if self.max_connections is not None and self.max_connections > (most := max_connections()):
      raise ValueError(
        f"ServerLimits.max_connections {self.max_connections}: more than the {most} this process's "
        f"descriptor limit leaves (RLIMIT_NOFILE less {RESERVED_DESCRIPTORS} for the rest)"
      )

  def connections(self) -> int:
    """``max_connections``, or its default for this process's descriptor limit."""
    return self.max_connections if self.max_connections is not None else default_max_connections()


# Descriptors a server keeps for everything but its gRPC connections (model files, the KV transfer's sockets, the
# metrics endpoint, threads' pipes), and the most connections it holds by default.
RESERVED_DESCRIPTORS = 1024
DEFAULT_MAX_CONNECTIONS = 16384
# The shortest TLS handshake timeout taken, seconds (gRPC counts it in whole milliseconds: 1e-9 s was 0 ms, and
# every handshake failed).
MIN_HANDSHAKE_TIMEOUT_S = 0.1


def max_connections() -> int:
  """The most connections this process's descriptors allow: ``RLIMIT_NOFILE``'s soft limit less
  RESERVED_DESCRIPTORS (at least 16; 2^31 - 1, gRPC's largest, when unlimited)."""
  import resource

  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft == resource.RLIM_INFINITY:
    return 2**31 - 1
  return max(16, min(2**31 - 1, soft - RESERVED_DESCRIPTORS))


def default_max_connections() -> int:
  """Half of ``max_connections()``, at most DEFAULT_MAX_CONNECTIONS, at least 16."""
  return max(16, min(DEFAULT_MAX_CONNECTIONS, max_connections() // 2))


def raise_descriptor_limit() -> int:
  """Raises this process's soft ``RLIMIT_NOFILE`` to its hard limit (which needs no privilege); the new soft."""
  import resource

  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != hard:
    try:
      resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
      soft = hard
    except (ValueError, OSError):
      pass
  return soft


OPERATOR = "operator"  # the identity of a call with the operator's key (``ApiKeys.operator``)


@dataclasses.dataclass(frozen=True)
class ApiKeys:
  """The bearer tokens a server accepts: every call but grpc.health.v1 must carry one of them.

  shared: ``--api-key``, one key for every caller, who are told apart by certificate or address
    (``client_of``); a decode server sends its own to its prefill servers.
  clients: name -> key (``--client-keys-file``): a caller with one is client "key:NAME" for the per-client
    limits, fair sharing and the scope of its Aborts.
  operator: ``--operator-key-file``: its Abort reaches every client's requests of that id.
  """

  shared: str | None = None
  clients: dict[str, str] = dataclasses.field(default_factory=dict)
  operator: str | None = None

  def __bool__(self) -> bool:
    return bool(self.shared or self.clients or self.operator)

  def identities(self) -> dict[bytes, str]:
    """The ``authorization`` value (bytes) -> identity of every key that names its caller."""
    out = {credentials.bearer(key).encode(): f"key:{name}" for name, key in self.clients.items()}
    if self.operator is not None:
      out[credentials.bearer(self.operator).encode()] = OPERATOR
    return out

  def bearers(self) -> list[bytes]:
    """Every accepted ``authorization`` value."""
    shared = [credentials.bearer(self.shared).encode()] if self.shared else []
    return shared + list(self.identities())


def _bearer(metadata) -> bytes | None:
  """The call's one ``authorization`` value, its scheme written "Bearer " (case-insensitive, RFC 6750 / RFC 9110
  section 11.1); None for none or several (no value of several is taken over another)."""
  values = [v for k, v in metadata or () if k == "authorization"]
  if len(values) != 1:
    return None
  got = values[0].encode("utf-8", "surrogatepass") if isinstance(values[0], str) else values[0]
  return b"Bearer " + got[7:] if got[:7].lower() == b"bearer " else got


def client_of(context, identities: dict[bytes, str] | None = None) -> str:
  """Who a call comes from, for the per-client limits (``ServerLimits.max_streams_per_client``, health Watch
  streams), fair sharing and the scope of Aborts: the name its API key gives it ("key:NAME", or OPERATOR;
  ``identities`` from ``ApiKeys.identities``); else the common name of its client certificate under mutual TLS
  ("cert:NAME"); else its IPv4 address
  ("ipv4:10.0.0.5"), or for IPv6 its /64 network ("ipv6:[2001:db8:1:2::]/64": a host is commonly given a whole
  /64, so one client could otherwise take 2^64 shares; the loopback address as itself, "ipv6:[::1]"); a Unix
  socket's peer as gRPC names it."""
  if identities and (who := identities.get(_bearer(context.invocation_metadata()))) is not None:
    return who
  names = (context.auth_context() or {}).get("x509_common_name")
  if names:
    return "cert:" + names[0].decode("utf-8", "replace")
  peer = urllib.parse.unquote(context.peer() or "unknown")  # gRPC writes an IPv6 peer as ipv6:%5B::1%5D:PORT
  if peer.startswith("ipv4:"):
    return peer.rpartition(":")[0]
  if peer.startswith("ipv6:"):
    host = peer.rpartition(":")[0]
    try:
      address = ipaddress.IPv6Address(host[len("ipv6:") :].strip("[]").partition("%")[0])  # (no zone id)
    except ValueError:
      return host
    if address.ipv4_mapped is not None:
      return f"ipv4:{address.ipv4_mapped}"
    if address.is_loopback:
      return f"ipv6:[{address}]"
    return f"ipv6:[{ipaddress.IPv6Network((address, 64), strict=False).network_address}]/64"
  return peer


def _gone(deadline: float | None) -> str:
  """The outcome of a stream whose RPC had ended under its handler (an abort then fails sending its status, with
  an error of gRPC's own that was counted "unknown"): "deadline_exceeded" past its deadline (a time.monotonic()
  instant), else "cancelled" (the client went away)."""
  return "deadline_exceeded" if deadline is not None and time.monotonic() >= deadline else "cancelled"


class _AsyncEvents:
  """A request's event queue: the engine loop thread puts, the request's handler coroutine awaits."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self._loop = loop
    self._queue: asyncio.Queue = asyncio.Queue()

  def put(self, event: _Event) -> None:  # any thread
    try:
      self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
    except RuntimeError:  # the server's event loop is closed (shut down): nobody is listening
      pass

  async def get(self) -> _Event:
    return await self._queue.get()


@dataclasses.dataclass
class _Malformed:
  """A request whose bytes did not parse (gRPC would otherwise answer INTERNAL)."""

  error: str


def _tolerant(message_cls):
  def parse(data: bytes):
    try:
      return message_cls.FromString(data)
    except Exception as e:  # noqa: BLE001 - google.protobuf.message.DecodeError and friends
      return _Malformed(f"malformed {message_cls.DESCRIPTOR.name}: {e}")

  return parse


def check_request_id(request_id: str) -> None:
  """InvalidRequest unless request_id is at most MAX_REQUEST_ID_BYTES of printable ASCII."""
  if len(request_id) > MAX_REQUEST_ID_BYTES:
    raise InvalidRequest(
      f"request_id of {len(request_id)} characters; at most {MAX_REQUEST_ID_BYTES} (printable ASCII)"
    )
  if not (request_id.isascii() and request_id.isprintable()):
    raise InvalidRequest("request_id must be printable ASCII")


def _sampling(request) -> dict:
  """The request's sampling fields as sent (the engine validates the values); an unset top_p is 1 (off)."""
  top_p = request.top_p if request.HasField("top_p") else 1.0
  for name, value in (("temperature", request.temperature), ("top_p", top_p)):
    if not math.isfinite(value):
      raise InvalidRequest(f"{name} must be finite, got {value}")
  return dict(
    temperature=request.temperature,
    top_k=request.top_k,
    top_p=top_p,
    seed=request.seed if request.HasField("seed") else None,
  )


class InferenceServicer(hisparse_pb2_grpc.HiSparseInferenceServicer):
  """The HiSparseInference RPCs (coroutines on the server's asyncio thread: its state needs no lock)."""

  def __init__(
    self,
    loop: EngineLoop,
    tokenizer,
    limits: ServerLimits | None = None,
    prefill_client=None,
    keys: ApiKeys | None = None,
  ):
    """keys: the API keys whose callers they name (``ApiKeys.identities``; checking them is the interceptor's)."""
    self.identities = keys.identities() if keys else {}
    self.loop = loop
    self.engine = loop.engine
    self.tokenizer = tokenizer
    self.prefill_client = prefill_client  # a decode server's link to its prefill servers (disaggregation.py)
    limits = limits or ServerLimits()
    queued = self.engine.max_queued_requests
    self.max_streams = (
      limits.max_streams
      if limits.max_streams is not None
      else None
      if queued is None
      else self.engine.num_slots + queued
    )
    self.max_prompt_bytes = limits.max_prompt_bytes or self.engine.max_prompt_bytes
    self.max_streams_per_client = limits.max_streams_per_client
    if self.max_streams_per_client is None and limits.fair_sharing and self.max_streams is not None:
      self.max_streams_per_client = max(1, self.max_streams // 2)
    self.fair_sharing = limits.fair_sharing
    self.open_streams = 0
    self._client_streams: collections.Counter[str] = collections.Counter()  # client_of -> open Generate streams
    self._tokenize_pool = futures.ThreadPoolExecutor(
      TOKENIZER_THREADS, thread_name_prefix="tokenize", initializer=_tokenizer_thread_init
    )
    # (client_of, the client's request_id) -> engine request ids: an Abort reaches its own client's requests only.
    self._by_client_id: dict[tuple[str, str], set[str]] = {}
    self._not_submitted: dict[str, bool] = {}  # engine id -> aborted, until Generate submits it to the engine
    self._prefilling: dict[str, asyncio.Task] = {}  # engine id -> its prefill at a prefill server (decode server)
    self.cutting = False  # RunningServer.stop's grace is ending: a stream cut now ends UNAVAILABLE for its client

  def close(self) -> None:
    self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

  async def _prompt_ids(self, request) -> list[int]:
    which = request.WhichOneof("prompt")
    if which == "text":
      if self.tokenizer is None:
        raise InvalidRequest("text prompt given but the model has no tokenizer")
      text = request.text
      # Characters <= UTF-8 bytes: the exact count is taken only for texts that may be within the limit.
      if len(text) > self.max_prompt_bytes or len(text.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes:
        raise InvalidRequest(f"text prompt over {self.max_prompt_bytes} bytes (--max-prompt-bytes)")
      bos = self.engine.config.bos_token_id
      if len(text) <= GIL_FREE_ENCODE_CHARS:  # microseconds: no queueing behind large prompts
        return encode_prompt(self.tokenizer, text, bos)
      return await asyncio.get_running_loop().run_in_executor(
        self._tokenize_pool, _tokenize_off_loop, self.tokenizer, text, bos
      )
    if which == "input_ids":
      ids = request.input_ids.ids
      if len(ids) > self.engine.max_seq_len:
        raise InvalidRequest(
          f"prompt of {len(ids)} tokens exceeds the model context of {self.engine.max_seq_len} tokens (--max-seq-len)"
        )
      return list(ids)
    raise InvalidRequest("empty prompt: set text or input_ids")

  def streams_busy(self, client: str | None = None) -> str | None:
    """The RESOURCE_EXHAUSTED message when ``max_streams`` streams are open (Generate's, and a prefill server's
    Prefill streams, which share the limit), or ``client`` holds ``max_streams_per_client`` Generate streams;
    else None."""
    if self.max_streams is not None and self.open_streams >= self.max_streams:
      return f"server busy: {self.open_streams} streams open (limit {self.max_streams})"
    if (
      client is not None
      and self.max_streams_per_client is not None
      and self._client_streams.get(client, 0) >= self.max_streams_per_client
    ):
      return (
        f"client {client} has {self._client_streams[client]} streams open (limit "
        f"{self.max_streams_per_client} per client, --max-streams-per-client)"
      )
    return None

  async def Generate(self, request, context):
    """The stream (``_generate``), counted by outcome in ``ServerMetrics.requests`` when the server has
    metrics."""
    metrics = self.loop.metrics
    # (read now: the context's call may be freed once the RPC has ended; its peer() then crashed the process)
    peer, left = context.peer(), context.time_remaining()
    deadline = None if left is None else time.monotonic() + left
    stream = self._generate(request, context)
    outcome = "cancelled"  # ended by the client or its deadline before a status ("unavailable": the server's stop)
    try:
      async for message in stream:
        if message.finished:
          outcome = hisparse_pb2.FinishReason.Name(message.finish_reason).lower()
        yield message
    except grpc.aio.AbortError:  # context.abort: the status it set
      code = context.code()
      outcome = code.name.lower() if isinstance(code, grpc.StatusCode) else _gone(deadline)
      raise
    except Exception:  # grpc answers UNKNOWN (a cancel, a BaseException, stays "cancelled")
      # (done / cancelled read the RPC's state in Python: safe once it has ended, unlike peer())
      if context.done() or context.cancelled():  # an abort or write failed: the RPC had ended under it
        outcome = _gone(deadline)
      else:
        outcome = "unknown"
        log.warning("Generate stream from %s failed", peer, exc_info=True)
      raise
    finally:
      try:
        # Closed here, not when collected: a stream closed while it waits at a yield (the client went away)
        # releases its stream count and aborts its request now.
        await stream.aclose()
      finally:
        if metrics is not None:
          if outcome == "cancelled" and self.cutting:  # cut at the end of the grace: the client got UNAVAILABLE
            outcome = "unavailable"
          metrics.requests.labels(outcome=outcome).inc()
        log.debug("Generate stream from %s ended: %s", peer, outcome)

  async def _generate(self, request, context):
    if isinstance(request, _Malformed):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    client = client_of(context, self.identities)
    if (busy := self.streams_busy(client)) is not None:
      await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
    self.open_streams += 1
    self._client_streams[client] += 1
    # The engine keys requests by a server-side id: client ids need not be unique. The client's id is known to
    # Abort from here on: while the prompt is tokenized (0.75 s for 1 MB of text) or prefilled elsewhere, an
    # Abort is recorded, and the request ends as ABORT before it reaches the engine.
    engine_id, rid = uuid.uuid4().hex, None
    try:
      try:
        check_request_id(request.request_id)
        check_stop_counts(len(request.stop), len(request.stop_token_ids))  # before copying them
        sampling = _sampling(request)
        rid = request.request_id or uuid.uuid4().hex
        self._by_client_id.setdefault((client, rid), set()).add(engine_id)
        self._not_submitted[engine_id] = False
        ids = await self._prompt_ids(request)
        req = Request(
          request_id=engine_id,
          prompt_ids=ids,
          max_new_tokens=request.max_new_tokens,
          stop_token_ids=frozenset(request.stop_token_ids),
          stop=tuple(request.stop),
          include_stop_str_in_output=request.include_stop_str_in_output,
          ignore_eos=request.ignore_eos,
          client=client if self.fair_sharing else None,
          **sampling,
        )
        if not self._not_submitted[engine_id]:  # (aborted meanwhile: it ends as ABORT, whatever it holds)
          self.engine.validate(req)
      except RequestError as e:
        await context.abort(grpc.StatusCode[e.code], str(e))
      events = _AsyncEvents(asyncio.get_running_loop())
      done = False
      try:
        if self.prefill_client is not None and not self._not_submitted[engine_id]:
          req.arrival = time.monotonic()  # decode server: a prefill server computes the prompt's KV
          # A task of its own, so that an Abort stops it (cancelling it stops the prefill there).
          task = asyncio.ensure_future(self.prefill_client.prefill(req, context.time_remaining()))
          self._prefilling[engine_id] = task
          try:
            await task
          except RequestError as e:
            done = True
            await context.abort(grpc.StatusCode[e.code], str(e))
          except asyncio.CancelledError:
            if asyncio.current_task().cancelling() or not self._not_submitted.get(engine_id):
              raise  # this stream itself was cancelled (the client went away, the server stops)
          finally:  # (an Abort cancelled the prefill: it ends as ABORT below)
            self._prefilling.pop(engine_id, None)
        if self._not_submitted.pop(engine_id):  # aborted before it reached the engine
          done = True
          yield hisparse_pb2.GenerateResponse(
            request_id=rid, finished=True, finish_reason=_FINISH["abort"], prompt_tokens=len(ids)
          )
          return
        self.loop.submit(req, events)
        first, sent = True, 0  # sent: characters of the output text streamed so far
        while True:
          ev = await events.get()
          if ev.error is not None:
            done = True
            await context.abort(grpc.StatusCode[ev.error.code], str(ev.error))
          if ev.token is not None:  # the request id is echoed once, on the first message
            yield hisparse_pb2.GenerateResponse(request_id=rid if first else "", token_ids=[ev.token], text=ev.text)
            first, sent = False, sent + len(ev.text)
            continue
          done = True
          fin = ev.done
          if fin is None:  # already gone from the engine (finished as the abort arrived)
            return
          yield hisparse_pb2.GenerateResponse(
            request_id=rid if first else "",
            finished=True,
            finish_reason=_FINISH[fin.finish_reason],
            text=fin.text[sent:],
            prompt_tokens=len(fin.prompt_ids),
            completion_tokens=len(fin.output_ids),
            swap_in_hits=fin.hits,
            swap_in_misses=fin.misses,
            swap_in_prefetched=fin.prefetched,
            matched_stop=fin.matched_stop,
            num_preemptions=fin.num_preemptions,
            prefill_seconds=fin.prefill_seconds,
            transfer_seconds=fin.transfer_seconds,
            transfer_bytes=fin.transfer_bytes,
            decode_seconds=(fin.finish_time or 0.0) - (fin.first_token_time or fin.finish_time or 0.0),
          )
          return
      finally:
        if not done:  # cancelled, deadline, or the client went away: free its slot at the next step
          self.loop.abort(req.request_id)
    finally:
      self.open_streams -= 1
      self._client_streams[client] -= 1
      if not self._client_streams[client]:
        del self._client_streams[client]
      self._not_submitted.pop(engine_id, None)
      engine_ids = self._by_client_id.get((client, rid))
      if engine_ids is not None:
        engine_ids.discard(engine_id)
        if not engine_ids:
          del self._by_client_id[(client, rid)]

  async def Abort(self, request, context):
    if isinstance(request, _Malformed):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    try:
      check_request_id(request.request_id)
    except RequestError as e:
      await context.abort(grpc.StatusCode[e.code], str(e))
    caller = client_of(context, self.identities)
    if caller == OPERATOR:  # every client's requests of that id
      ids = [e for (_, rid), engine_ids in self._by_client_id.items() if rid == request.request_id for e in engine_ids]
    else:
      ids = list(self._by_client_id.get((caller, request.request_id), ()))
    for engine_id in ids:
      if engine_id in self._not_submitted:  # still tokenizing or prefilling: Generate ends it before submitting
        self._not_submitted[engine_id] = True
        if (task := self._prefilling.get(engine_id)) is not None:
          task.cancel()  # waiting on a prefill server: stop that at once
      else:
        self.loop.abort(engine_id)
    return hisparse_pb2.AbortResponse(aborted=len(ids))

  async def GetLoads(self, request, context):
    if isinstance(request, _Malformed):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    return loads_message(self.engine.loads_snapshot)


def loads_message(loads: dict) -> hisparse_pb2.Loads:
  """The GetLoads answer for an ``Engine.loads()`` dict."""
  fields = {k: v for k, v in loads.items() if k != "pools"}
  return hisparse_pb2.Loads(**fields, pools=[hisparse_pb2.PoolUsage(**p) for p in loads["pools"]])


def _handlers(servicer: InferenceServicer) -> dict:
  """Like the generated add_HiSparseInferenceServicer_to_server, but unparsable request bytes reach
  the method (which answers INVALID_ARGUMENT) instead of failing inside gRPC as INTERNAL."""
  pb = hisparse_pb2
  return {
    "Generate": grpc.unary_stream_rpc_method_handler(
      servicer.Generate,
      request_deserializer=_tolerant(pb.GenerateRequest),
      response_serializer=pb.GenerateResponse.SerializeToString,
    ),
    "Abort": grpc.unary_unary_rpc_method_handler(
      servicer.Abort,
      request_deserializer=_tolerant(pb.AbortRequest),
      response_serializer=pb.AbortResponse.SerializeToString,
    ),
    "GetLoads": grpc.unary_unary_rpc_method_handler(
      servicer.GetLoads,
      request_deserializer=_tolerant(pb.GetLoadsRequest),
      response_serializer=pb.Loads.SerializeToString,
    ),
  }


# grpc.health.v1 needs no credentials, so its requests are bounded on their own: a service name's bytes (ours
# are the package-qualified service names, under 64) and the Watch streams open at once (one per client channel
# that health-checks; each held ~13 KB, and ~4 MB with a 1 MB service name: 800 such streams took 3.7 GB).
MAX_HEALTH_SERVICE_BYTES = 256
MAX_HEALTH_WATCHES = 1024
# Watch streams one client (``client_of``) may hold: Watch needs no API key, so without a share one client
# could take every slot and leave a load balancer's health checks RESOURCE_EXHAUSTED.
MAX_HEALTH_WATCHES_PER_CLIENT = 64
# At shutdown, how long the health Watch streams get to send NOT_SERVING before they are ended (each is a write
# to its own stream's queue on this event loop).
WATCH_END_DELAY_S = 0.1
# A Generate stream that ends this close to the end of a stop's grace is counted as cut by the stop
# ("unavailable"), not as cancelled by its client (the cut is gRPC's own timer, so the two cannot be told apart).
CUT_MARGIN_S = 0.05


# Bytes a GenerateRequest takes besides its prompt: MAX_STOP_STRINGS stop strings of MAX_STOP_STRING_BYTES,
# MAX_STOP_TOKEN_IDS varint ids, the request id and the scalars, each with its field tag and length (~6 KB),
# rounded up.
REQUEST_FIELDS_BYTES = 16 << 10
# Calls in flight beyond the streams (``ServerLimits.max_streams``) and health Watch streams: Check, GetLoads,
# Abort, Info.
CONTROL_CALLS = 256


def receive_bounds(servicer: InferenceServicer) -> tuple[int, int | None]:
  """(the largest request message the server accepts, the calls it serves at once) for ``servicer``'s limits.

  Message: the largest legitimate request, a text prompt of ``max_prompt_bytes`` or a context of
  ``max_seq_len`` token ids (at most 5 bytes each as varints), plus REQUEST_FIELDS_BYTES; a larger one is
  refused by gRPC (RESOURCE_EXHAUSTED) as it arrives. 1.3 MB at DeepSeek-V3.2's 163840-token context (gRPC's
  default is 4 MB). Calls: ``max_streams`` + MAX_HEALTH_WATCHES + CONTROL_CALLS (None, unbounded, when
  ``max_streams`` is); more get RESOURCE_EXHAUSTED from gRPC. Together they bound what request messages being
  received can hold, to about calls x message (3.1 GB at 256 request slots, 1024 queued and that context)."""
  engine = servicer.engine
  message = max(servicer.max_prompt_bytes, 5 * engine.max_seq_len) + REQUEST_FIELDS_BYTES
  calls = None if servicer.max_streams is None else servicer.max_streams + MAX_HEALTH_WATCHES + CONTROL_CALLS
  return message, calls


def _add_health(servicer, server) -> asyncio.Event:
  """grpc.health.v1.Health with the library's servicer, but unparsable request bytes or a service name over
  MAX_HEALTH_SERVICE_BYTES answer INVALID_ARGUMENT (the generated registration lets the parse error escape as
  UNKNOWN with a logged traceback), and a Watch beyond MAX_HEALTH_WATCHES open ones, or beyond
  MAX_HEALTH_WATCHES_PER_CLIENT of its client's, RESOURCE_EXHAUSTED. Returns the event that ends every Watch
  stream (set once NOT_SERVING has been sent at shutdown: an open Watch, which a load balancer keeps, would
  otherwise hold a drain for its whole grace)."""
  pb = health_pb2
  watches = collections.Counter()  # client_of -> open Watch streams (on the server's one event loop: no lock)
  closing = asyncio.Event()

  async def refuse_malformed(request, context):
    if isinstance(request, _Malformed):
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    if len(request.service.encode("utf-8")) > MAX_HEALTH_SERVICE_BYTES:
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"service name over {MAX_HEALTH_SERVICE_BYTES} bytes")

  async def check(request, context):
    await refuse_malformed(request, context)
    return await servicer.Check(request, context)

  async def watch(request, context):  # the servicer streams with context.write
    await refuse_malformed(request, context)
    client = client_of(context)
    if watches.total() >= MAX_HEALTH_WATCHES:
      await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_HEALTH_WATCHES} health Watch streams open; use Check, or close one"
      )
    if watches[client] >= MAX_HEALTH_WATCHES_PER_CLIENT:
      await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"client {client} has {MAX_HEALTH_WATCHES_PER_CLIENT} health Watch streams open (the "
        "limit per client); use Check, or close one",
      )
    watches[client] += 1
    streaming = asyncio.ensure_future(servicer.Watch(request, context))
    ended = asyncio.ensure_future(closing.wait())
    try:
      await asyncio.wait((streaming, ended), return_when=asyncio.FIRST_COMPLETED)
      if streaming.done():
        streaming.result()  # (its exception, if any)
    finally:
      for task in (streaming, ended):
        task.cancel()
      watches[client] -= 1
      if not watches[client]:
        del watches[client]

  handlers = {
    "Check": grpc.unary_unary_rpc_method_handler(
      check,
      request_deserializer=_tolerant(pb.HealthCheckRequest),
      response_serializer=pb.HealthCheckResponse.SerializeToString,
    ),
    "Watch": grpc.unary_stream_rpc_method_handler(
      watch,
      request_deserializer=_tolerant(pb.HealthCheckRequest),
      response_serializer=pb.HealthCheckResponse.SerializeToString,
    ),
  }
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.health.v1.Health", handlers),))
  return closing


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
  """Every call except grpc.health.v1 needs exactly one ``authorization: Bearer KEY`` metadata value with one of
  the keys (each compared in constant time). A Generate call refused so counts as outcome "unauthenticated" in
  ``metrics``."""

  def __init__(self, keys: ApiKeys, metrics: ServerMetrics | None = None):
    self._want = keys.bearers()
    self._metrics = metrics

    async def deny(request, context):
      await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata 'authorization: Bearer KEY')"
      )

    self._deny = grpc.unary_unary_rpc_method_handler(deny)

  async def intercept_service(self, continuation, details):
    if details.method.startswith("/grpc.health.v1.Health/"):
      return await continuation(details)
    got = _bearer(details.invocation_metadata)
    # (every key compared: the time taken does not tell which one a guess came close to)
    if got is None or not any([hmac.compare_digest(got, want) for want in self._want]):
      return self._refuse(details)
    return await continuation(details)

  def _refuse(self, details):
    if self._metrics is not None and details.method == f"/{SERVICE_NAME}/Generate":
      self._metrics.requests.labels(outcome="unauthenticated").inc()
    return self._deny


@dataclasses.dataclass(frozen=True)
class TLSConfig:
  """PEM bytes: the server's certificate chain and private key; client_ca set: clients must present a
  certificate it signed (mutual TLS)."""

  cert_chain: bytes
  private_key: bytes
  client_ca: bytes | None = None

  def credentials(self) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
      [(self.private_key, self.cert_chain)],
      root_certificates=self.client_ca,
      require_client_auth=self.client_ca is not None,
    )


class RunningServer:
  """A started server: the grpc.aio server on its own asyncio thread and the engine loop.

  ``stop(grace)`` stops accepting RPCs, gives in-flight ones `grace` seconds (then cancels them), and returns
  an object whose ``wait()`` blocks until the server is down (grpc.Server's shape)."""

  def __init__(self, aio_loop, thread, server, servicer, health_servicer, on_close=(), end_watches=None):
    """on_close: callables run at the end of a stop (after the RPCs): cutting the KV transfer's pulls.
    end_watches: ``_add_health``'s event, set to end the health Watch streams once they were told NOT_SERVING."""
    self._aio_loop, self._thread, self._server = aio_loop, thread, server
    self.servicer, self.health = servicer, health_servicer
    self._end_watches = end_watches
    self._on_close = tuple(on_close)
    self.prefill = None  # a prefill server's PrefillServicer (set by serve)

  def stop(self, grace: float | None):
    async def shutdown():
      if grace is not None:  # (a stream its client cancels during the grace stays "cancelled")
        asyncio.get_running_loop().call_later(max(0.0, grace - CUT_MARGIN_S), setattr, self.servicer, "cutting", True)
      await self.health.enter_graceful_shutdown()
      if self._end_watches is not None:
        await asyncio.sleep(WATCH_END_DELAY_S)  # (the servicer's Watch tasks write NOT_SERVING first)
        self._end_watches.set()
      await self._server.stop(grace)

    fut = asyncio.run_coroutine_threadsafe(shutdown(), self._aio_loop)
    server = self

    class _Stopping:
      def wait(self, timeout: float | None = None) -> bool:
        try:
          fut.result(timeout)
        except futures.TimeoutError:
          return False
        server._close()
        return True

    return _Stopping()

  def _close(self) -> None:
    self.servicer.close()
    for close in self._on_close:
      close()
    if self._aio_loop.is_running():
      self._aio_loop.call_soon_threadsafe(self._aio_loop.stop)
    self._thread.join(10)


def serve(
  engine: Engine,
  tokenizer,
  host: str,
  port: int,
  metrics: ServerMetrics | None = None,
  *,
  limits: ServerLimits | None = None,
  tls: TLSConfig | None = None,
  api_key: str | ApiKeys | None = None,
  disaggregation=None,
):
  """Starts the server; returns (RunningServer, EngineLoop, bound port).

  limits: per-request and open-stream bounds (``ServerLimits``; defaults from the engine). tls: serve TLS
  (else plain text). api_key: the bearer token every HiSparseInference and PrefillService call needs, or
  several (``ApiKeys``: per-client keys and an operator's).
  disaggregation: a ``disaggregation.DisaggregationConfig``: "prefill" also serves ``PrefillService``,
  "decode" gets every prompt's KV from the prefill servers (checked first: ValueError naming the flag).
  Raises OSError if host:port cannot be bound.
  """
  from hisparse_jax.serving import disaggregation as pd

  mode = disaggregation.mode if disaggregation is not None else "null"
  transfer, prefill_client = None, None
  if mode == "decode":
    credentials = disaggregation.channel_credentials()
    infos = pd.check_prefill_servers(engine, disaggregation)
    if disaggregation.isolate_pulls:
      from hisparse_jax.serving.pull_worker import PullWorker

      transfer = PullWorker(disaggregation.transfer_host, disaggregation.transfer_port)
    else:
      transfer = pd.TransferEndpoint(disaggregation.transfer_host, disaggregation.transfer_port)
    prefill_client = pd.PrefillClient(
      engine,
      disaggregation.prefill_servers,
      transfer,
      disaggregation.transfer_timeout_s,
      disaggregation.api_key,
      disaggregation.prefill_timeout_s,
      infos,
      credentials,
    )
  elif mode == "prefill":
    transfer = pd.TransferEndpoint(disaggregation.transfer_host, disaggregation.transfer_port)
  loop = EngineLoop(engine, metrics)
  loop.start()
  on_close = []  # the transfer endpoint's pulls (a prefill server's take-backs among them)
  aio_loop = asyncio.new_event_loop()
  thread = threading.Thread(target=aio_loop.run_forever, name="grpc-aio", daemon=True)
  thread.start()

  async def start():
    keys = ApiKeys(shared=api_key) if isinstance(api_key, str) else api_key or ApiKeys()
    interceptors = [_ApiKeyInterceptor(keys, metrics)] if keys else []
    servicer = InferenceServicer(loop, tokenizer, limits, prefill_client, keys)
    connection_limits = limits or ServerLimits()
    # No SO_REUSEPORT: a second server on a taken port must fail, not silently share it. gRPC buffers a call's
    # whole request message before any handler (or the API-key check) runs: the receive limit and the bound on
    # calls in flight (``receive_bounds``) bound the memory clients can make the server hold.
    max_message, max_calls = receive_bounds(servicer)
    server = grpc.aio.server(
      interceptors=interceptors,
      maximum_concurrent_rpcs=max_calls,
      options=[
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_allowed_incoming_connections", connection_limits.connections()),
        ("grpc.server_handshake_timeout_ms", int(connection_limits.handshake_timeout_s * 1000)),
      ],
    )
    prefill = None
    handlers = _handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    if mode == "prefill":
      prefill = pd.PrefillServicer(
        loop,
        transfer,
        disaggregation.transfer_timeout_s,
        _AsyncEvents,
        streams=servicer,
        max_offered_bytes=disaggregation.max_offered_kv_bytes,
      )
      if metrics is not None:
        metrics.watch_offers(prefill)
      pb = hisparse_pb2
      prefill_handlers = {
        "Prefill": grpc.stream_stream_rpc_method_handler(
          prefill.Prefill,
          request_deserializer=_tolerant(pb.PrefillMessage),
          response_serializer=pb.PrefillOffer.SerializeToString,
        ),
        "Info": grpc.unary_unary_rpc_method_handler(
          prefill.Info,
          request_deserializer=_tolerant(pb.InfoRequest),
          response_serializer=pb.InfoResponse.SerializeToString,
        ),
      }
      server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PREFILL_SERVICE_NAME, prefill_handlers),))
    health_servicer = health.aio.HealthServicer()
    end_watches = _add_health(health_servicer, server)
    address = join_host_port(host, port)
    try:
      bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises RuntimeError for a port in use or a bad address
      bound, reason = 0, str(e)
    else:
      reason = "bind failed"
    if bound == 0:
      servicer.close()
      # (gRPC reports credentials it cannot use, a DSA key say, as a failed bind: TSI_INVALID_ARGUMENT in its log)
      hint = (
        (
          " (or gRPC refused the --tls-cert-file / --tls-key-file pair that Python's ssl accepted: it takes RSA "
          "and ECDSA keys)"
        )
        if tls
        else ""
      )
      raise OSError(f"cannot bind {address}: {reason}{hint}")
    await server.start()
    for name in ("", SERVICE_NAME) + ((PREFILL_SERVICE_NAME,) if mode == "prefill" else ()):
      await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, servicer, health_servicer, bound, prefill, end_watches

  try:
    server, servicer, health_servicer, bound, prefill, end_watches = asyncio.run_coroutine_threadsafe(
      start(), aio_loop
    ).result()
  except BaseException:
    loop.stop()
    aio_loop.call_soon_threadsafe(aio_loop.stop)
    thread.join(10)
    raise
  if transfer is not None:
    on_close.append(transfer.close)
  running = RunningServer(aio_loop, thread, server, servicer, health_servicer, on_close, end_watches)
  running.prefill = prefill  # a prefill server's PrefillServicer (None otherwise)
  return running, loop, bound
