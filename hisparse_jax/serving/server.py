"""gRPC inference server: a streaming ``Generate`` RPC over one continuous-batching engine.

Threads: gRPC's worker pool runs the RPC handlers; one ``EngineLoop`` thread
owns the engine and runs the decode loop. They talk through queues: a handler
validates its request (bad input fails alone with INVALID_ARGUMENT or
RESOURCE_EXHAUSTED; ``Engine.validate`` reads only start-up sizes), hands it to
the loop, and streams the events the loop puts on the request's own queue (each
token with its text delta, made by the request's incremental detokenizer on the
loop thread). A cancelled RPC aborts its request at the next step boundary.
``GetLoads`` answers from the snapshot the loop publishes after every step. The
standard ``grpc.health.v1`` service reports SERVING while the loop runs.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hisparse_jax.engine import Engine, InternalError, Request, RequestError, Unavailable
from hisparse_jax.engine.detokenizer import encode_prompt
from hisparse_jax.proto import hisparse_pb2, hisparse_pb2_grpc
from hisparse_jax.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = "hisparse.HiSparseInference"
_FINISH = {"stop": hisparse_pb2.STOP, "length": hisparse_pb2.LENGTH, "abort": hisparse_pb2.ABORT,
           "stop_token": hisparse_pb2.STOP_TOKEN, "stop_string": hisparse_pb2.STOP_STRING}


@dataclasses.dataclass
class _Event:
  token: int | None = None             # a new token
  text: str = ""                       # the text it completes
  done: Request | None = None          # the request finished
  error: RequestError | None = None    # the engine failed this request (error.code: its gRPC status)


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
      metrics.on_submit(req.request_id)
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
            events.put(_Event(error=e))
        elif kind == "abort" and item in listeners:
          req = self.engine.abort(item)
          if req is not None and self.metrics is not None:
            self.metrics.on_finish(req)
          listeners.pop(item).put(_Event(done=req))
          self._update_metrics()  # gauges follow a release even when the server then sits idle
      if not self.engine.has_work():
        continue
      try:
        finished = self.engine.step()
      except Exception as e:  # noqa: BLE001 - keep serving: fail the affected requests
        log.exception("decode step failed; failing running requests")
        for rid in list(listeners):
          listeners.pop(rid).put(_Event(error=InternalError(f"internal error: {e}")))
        self.engine.reset()
        self._update_metrics()
        continue
      for req in finished:
        if self.metrics is not None:
          self.metrics.on_finish(req)
        q = listeners.pop(req.request_id, None)
        if q is not None:
          q.put(_Event(done=req))
      self._update_metrics()
    for q in listeners.values():  # stopped with requests in flight
      q.put(_Event(error=Unavailable("server shutting down")))

  def _update_metrics(self) -> None:
    if self.metrics is not None:
      self.metrics.update(self.engine.loads_snapshot)


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


def _reject_malformed(context, request) -> None:
  if isinstance(request, _Malformed):
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)


class InferenceServicer(hisparse_pb2_grpc.HiSparseInferenceServicer):

  def __init__(self, loop: EngineLoop, tokenizer):
    self.loop = loop
    self.engine = loop.engine
    self.tokenizer = tokenizer
    self._lock = threading.Lock()
    self._by_client_id: dict[str, set[str]] = {}  # client request_id -> engine request ids

  def _prompt_ids(self, request, context) -> list[int]:
    which = request.WhichOneof("prompt")
    if which == "text":
      if self.tokenizer is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text prompt given but the model has no tokenizer")
      return encode_prompt(self.tokenizer, request.text, self.engine.config.bos_token_id)
    if which == "input_ids":
      return list(request.input_ids.ids)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt: set text or input_ids")

  def Generate(self, request, context):
    _reject_malformed(context, request)
    ids = self._prompt_ids(request, context)
    # The engine keys requests by a server-side id: client ids need not be unique.
    rid = request.request_id or uuid.uuid4().hex
    req = Request(request_id=uuid.uuid4().hex, prompt_ids=ids, max_new_tokens=request.max_new_tokens,
                  temperature=request.temperature, top_k=request.top_k,
                  top_p=request.top_p if request.top_p > 0 else 1.0,
                  seed=request.seed if request.HasField("seed") else None,
                  stop_token_ids=tuple(request.stop_token_ids), stop=tuple(request.stop),
                  include_stop_str_in_output=request.include_stop_str_in_output,
                  ignore_eos=request.ignore_eos)
    try:
      self.engine.validate(req)
    except RequestError as e:
      context.abort(grpc.StatusCode[e.code], str(e))
    events: queue.Queue = queue.Queue()
    with self._lock:
      self._by_client_id.setdefault(rid, set()).add(req.request_id)
    context.add_callback(lambda: self.loop.abort(req.request_id))
    self.loop.submit(req, events)
    try:
      yield from self._stream(req, rid, events, context)
    finally:
      with self._lock:
        ids = self._by_client_id.get(rid)
        if ids is not None:
          ids.discard(req.request_id)
          if not ids:
            del self._by_client_id[rid]

  def Abort(self, request, context):
    _reject_malformed(context, request)
    with self._lock:
      ids = list(self._by_client_id.get(request.request_id, ()))
    for engine_id in ids:
      self.loop.abort(engine_id)
    return hisparse_pb2.AbortResponse(aborted=len(ids))

  def GetLoads(self, request, context):
    _reject_malformed(context, request)
    return loads_message(self.engine.loads_snapshot)

  def _stream(self, req, rid, events, context):
    sent = 0  # characters of the output text streamed so far
    while True:
      ev = events.get()
      if ev.error is not None:
        context.abort(grpc.StatusCode[ev.error.code], str(ev.error))
      if ev.token is not None:
        sent += len(ev.text)
        yield hisparse_pb2.GenerateResponse(request_id=rid, token_ids=[ev.token], text=ev.text)
        continue
      done = ev.done
      if done is None:  # already gone from the engine (finished as the abort arrived)
        return
      yield hisparse_pb2.GenerateResponse(
          request_id=rid, finished=True, finish_reason=_FINISH[done.finish_reason], text=done.text[sent:],
          prompt_tokens=len(done.prompt_ids), completion_tokens=len(done.output_ids),
          swap_in_hits=done.hits, swap_in_misses=done.misses, matched_stop=done.matched_stop,
          num_preemptions=done.num_preemptions)
      return


def loads_message(loads: dict) -> hisparse_pb2.Loads:
  """The GetLoads answer for an ``Engine.loads()`` dict."""
  fields = {k: v for k, v in loads.items() if k != "pools"}
  return hisparse_pb2.Loads(**fields, pools=[hisparse_pb2.PoolUsage(**p) for p in loads["pools"]])


def _add_servicer(servicer: InferenceServicer, server) -> None:
  """Like the generated add_HiSparseInferenceServicer_to_server, but unparsable request bytes reach
  the method (which answers INVALID_ARGUMENT) instead of failing inside gRPC as INTERNAL."""
  pb = hisparse_pb2
  handlers = {
      "Generate": grpc.unary_stream_rpc_method_handler(
          servicer.Generate, request_deserializer=_tolerant(pb.GenerateRequest),
          response_serializer=pb.GenerateResponse.SerializeToString),
      "Abort": grpc.unary_unary_rpc_method_handler(
          servicer.Abort, request_deserializer=_tolerant(pb.AbortRequest),
          response_serializer=pb.AbortResponse.SerializeToString),
      "GetLoads": grpc.unary_unary_rpc_method_handler(
          servicer.GetLoads, request_deserializer=_tolerant(pb.GetLoadsRequest),
          response_serializer=pb.Loads.SerializeToString),
  }
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
  server.add_registered_method_handlers(SERVICE_NAME, handlers)


def serve(engine: Engine, tokenizer, host: str, port: int, max_workers: int = 512,
          metrics: ServerMetrics | None = None):
  """Starts the server; returns (grpc.Server, EngineLoop, bound port).

  max_workers bounds the concurrent RPCs (each open stream holds a worker thread while it waits).
  """
  loop = EngineLoop(engine, metrics)
  loop.start()
  # No SO_REUSEPORT: a second server on a taken port must fail, not silently share it.
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=[("grpc.so_reuseport", 0)])
  _add_servicer(InferenceServicer(loop, tokenizer), server)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  try:
    bound = server.add_insecure_port(f"{host}:{port}")
  except RuntimeError as e:  # grpc raises RuntimeError for a port in use or a bad address
    bound, reason = 0, str(e)
  else:
    reason = "bind failed"
  if bound == 0:
    loop.stop()
    raise OSError(f"cannot bind {host}:{port}: {reason}")
  server.start()
  for name in ("", SERVICE_NAME):
    health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
  return server, loop, bound
