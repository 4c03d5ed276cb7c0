"""Prometheus metrics of the server (prometheus-client), on their own registry.

Exposed at http://--metrics-host:--metrics-port/metrics by run_server.py (loopback unless --metrics-host says
otherwise):

  hisparse_running_requests, hisparse_queued_requests           gauges
  hisparse_generated_tokens_total                                counter
  hisparse_time_to_first_token_seconds                           histogram (arrival -> first token)
  hisparse_inter_token_latency_seconds                           histogram (between a request's tokens)
  hisparse_swap_in_hits_total{layer}, hisparse_swap_in_misses_total{layer}
                                                                 counters (distinct positions per step)
  hisparse_swap_in_bytes_total{layer}                            counter (misses x latent row bytes)
  hisparse_prefetch_rows_total{layer}                            counter (rows the cross-layer prefetch copied)
  hisparse_host_pool_rows{state="used"|"free"}                   gauge (host-pool tokens)
  hisparse_device_kv_bytes{state="used"|"total"}                 gauge (every device KV pool, all DP groups: the
                                                                 pools sized from the budget, not the budget)
  hisparse_kv_pool_pages{pool, memory, state="used"|"free"}      gauge (every KV pool, Engine.loads()["pools"])
  hisparse_kv_pool_bytes{pool, memory, state="used"|"free"}      gauge
  hisparse_preemptions_total                                     counter (requests preempted)
  hisparse_resident_requests                                     gauge (dynamic residency: requests whose whole
                                                                 latent KV is on device now)
  hisparse_offloads_total                                        counter (resident requests moved to their hot
                                                                 buffers)
  hisparse_pd_prefill_seconds, hisparse_pd_kv_transfer_seconds   histograms (decode server: prefill server's time
                                                                 to first token; pulling the prompt KV)
  hisparse_pd_kv_transfer_bytes_total                            counter
  hisparse_pd_kv_transfer_gigabytes_per_second                   gauge (the last pull)
  (those hisparse_pd_* metrics exist on a decode server only: --disaggregation-mode decode)
  hisparse_pd_offered_kv_bytes{state="held"|"limit"}            gauge (prefill server: prompt KV held for decode
                                                                 servers, offers not pulled yet and prefills in
                                                                 flight; --max-offered-kv-bytes)
  hisparse_pd_offers_taken_back_total                            counter (prefill server: offers not
                                                                 acknowledged, taken back)

Gauges are set from the engine's published loads when the engine loop starts and after every step, abort or
release, so an idle server shows its idle state from the start; each layer's counters exist at 0 from the
start (given ``num_layers``).
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily

# The metrics endpoint serves scrapers, not the public: bounded so that no client can take the server's threads
# and file descriptors (a break-it run held 1,000 half-open connections, one thread and descriptor each, until
# gRPC could accept nothing) or its CPU (16 clients scraping in a loop slowed decoding 2-4x).
METRICS_CONNECTIONS = 16  # connections served at once; more are closed on arrival
METRICS_CONNECTION_S = 10.0  # a connection is closed this long after it opened, whatever it has sent
METRICS_CACHE_S = 0.5  # a page is rendered at most this often (per query, format and encoding)
METRICS_MIN_INTERVAL_S = 0.05  # requests are answered one at a time, at most one per this interval (waiting
# ones sleep): 20 a second, far above what Prometheus asks (one per 15 s)
METRICS_PATHS = ("/", "/metrics")

# hisparse_requests_total's outcomes, each created at 0: the finish reasons, "cancelled", and every status a
# Generate stream can fail with (server.py's aborts; "unknown": an exception the handler did not expect).
REQUEST_OUTCOMES = (
  "stop",
  "length",
  "abort",
  "stop_token",
  "stop_string",
  "cancelled",
  "invalid_argument",
  "resource_exhausted",
  "unavailable",
  "internal",
  "deadline_exceeded",
  "unauthenticated",
  "unknown",
)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServerMetrics:
  """Metrics of one engine; call the on_* hooks from the engine loop thread."""

  def __init__(self, row_bytes: int, num_layers: int = 0, disaggregation_mode: str = "null"):
    """row_bytes: bytes of one latent KV row (a miss's copy); num_layers: the model's layers, whose swap-in
    and prefetch counters are created at 0 (0: each appears with its first finished request);
    disaggregation_mode: the server's --disaggregation-mode ("decode": with the hisparse_pd_* metrics of the
    prompts it pulls; a prefill or colocated server has none)."""
    self.registry = CollectorRegistry()
    r = self.registry
    self.row_bytes = row_bytes
    self.running = Gauge("hisparse_running_requests", "Admitted requests (prefilling or decoding)", registry=r)
    self.queued = Gauge("hisparse_queued_requests", "Requests waiting for admission", registry=r)
    self.tokens = Counter("hisparse_generated_tokens", "Tokens generated", registry=r)
    self.ttft = Histogram(
      "hisparse_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
    )
    self.itl = Histogram(
      "hisparse_inter_token_latency_seconds", "Time between a request's tokens", buckets=_LATENCY_BUCKETS, registry=r
    )
    self.hits = Counter("hisparse_swap_in_hits", "Swap-in hits (distinct positions)", ["layer"], registry=r)
    self.misses = Counter("hisparse_swap_in_misses", "Swap-in misses (rows copied host->device)", ["layer"], registry=r)
    self.miss_bytes = Counter(
      "hisparse_swap_in_bytes", "Bytes copied host->device by the swap-in", ["layer"], registry=r
    )
    self.prefetched = Counter(
      "hisparse_prefetch_rows",
      "Rows the cross-layer prefetch copied ahead of the layer's swap-in",
      ["layer"],
      registry=r,
    )
    self.host_rows = Gauge("hisparse_host_pool_rows", "HiSparse host-pool rows", ["state"], registry=r)
    self.device_kv = Gauge(
      "hisparse_device_kv_bytes", "Device KV memory: allocated / all pools (every DP group's)", ["state"], registry=r
    )
    self.pool_pages = Gauge("hisparse_kv_pool_pages", "KV pool pages", ["pool", "memory", "state"], registry=r)
    self.pool_bytes = Gauge("hisparse_kv_pool_bytes", "KV pool bytes", ["pool", "memory", "state"], registry=r)
    self.preemptions = Counter("hisparse_preemptions", "Requests preempted (KV freed, recomputed)", registry=r)
    self.resident = Gauge(
      "hisparse_resident_requests", "Dynamic residency: requests whose whole latent KV is on device", registry=r
    )
    self.offloads = Counter(
      "hisparse_offloads", "Dynamic residency: resident requests moved to their hot buffers", registry=r
    )
    self._totals: dict[str, int] = {}  # the engine's totals these counters were last advanced to
    self.requests = Counter(
      "hisparse_requests",
      "Generate streams ended, by outcome: the finish reason (stop, "
      "length, abort, stop_token, stop_string) or the gRPC status the stream failed with "
      "(resource_exhausted, invalid_argument, unavailable, internal, deadline_exceeded, "
      "unauthenticated, unknown; unavailable also for a stream cut by the server's stop; "
      "cancelled: the client went away or its deadline passed first)",
      ["outcome"],
      registry=r,
    )
    for outcome in REQUEST_OUTCOMES:
      self.requests.labels(outcome=outcome)
    self.pd = disaggregation_mode == "decode"
    if self.pd:
      self._pd_metrics(r)
    self._last_token: dict[str, float] = {}
    self._arrival: dict[str, float] = {}
    for layer in range(num_layers):
      for counter in (self.hits, self.misses, self.miss_bytes, self.prefetched):
        counter.labels(layer=str(layer))

  def _pd_metrics(self, r) -> None:
    self.prefill_seconds = Histogram(
      "hisparse_pd_prefill_seconds", "Prefill server: arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
    )
    self.transfer_seconds = Histogram(
      "hisparse_pd_kv_transfer_seconds",
      "Pulling a prompt's KV from a prefill server",
      buckets=_LATENCY_BUCKETS,
      registry=r,
    )
    self.transfer_bytes = Counter(
      "hisparse_pd_kv_transfer_bytes", "Prompt KV bytes pulled from prefill servers", registry=r
    )
    self.transfer_rate = Gauge(
      "hisparse_pd_kv_transfer_gigabytes_per_second", "The last prompt KV pull's rate (GB/s)", registry=r
    )

  def watch_offers(self, prefill) -> None:
    """A prefill server's offers (``disaggregation.PrefillServicer``), read at each scrape."""
    held = Gauge(
      "hisparse_pd_offered_kv_bytes",
      "Prefill server: prompt KV bytes held for decode servers (offers "
      "not pulled yet, prefills in flight), and their limit (--max-offered-kv-bytes x DP groups)",
      ["state"],
      registry=self.registry,
    )
    held.labels(state="held").set_function(lambda: prefill.offered_bytes)
    held.labels(state="limit").set_function(lambda: prefill.max_offered_bytes)
    self.registry.register(
      _CountOf(
        "hisparse_pd_offers_taken_back",
        "Prefill server: offers not acknowledged, taken back, since start",
        lambda: prefill.offers_taken_back,
      )
    )

  def serve(self, port: int, host: str = "127.0.0.1") -> int:
    """Serves the metrics at /metrics (and /) of host:port (port 0: a free one) on a daemon thread; returns the
    bound port. OSError if it cannot bind. At most METRICS_CONNECTIONS connections at once, each closed
    METRICS_CONNECTION_S after it opened; requests answered one at a time, at most one per
    METRICS_MIN_INTERVAL_S, a page rendered at most every METRICS_CACHE_S (``_CachedPage``)."""
    host = host.strip("[]")  # (an IPv6 address bare)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("_MetricsServerOf", (_MetricsServer,), {"address_family": family})
    httpd = make_server(host, port, _CachedPage(make_wsgi_app(self.registry)), server_class, _MetricsHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd.server_port

  def on_submit(self, request_id: str, arrival: float | None = None) -> None:
    self._arrival[request_id] = arrival or time.monotonic()

  def on_token(self, request_id: str) -> None:
    now = time.monotonic()
    self.tokens.inc()
    last = self._last_token.get(request_id)
    if last is None:
      arrival = self._arrival.pop(request_id, None)
      if arrival is not None:
        self.ttft.observe(now - arrival)
    else:
      self.itl.observe(now - last)
    self._last_token[request_id] = now

  def on_finish(self, req) -> None:
    self._last_token.pop(req.request_id, None)
    self._arrival.pop(req.request_id, None)
    if self.pd and req.transfer_bytes:  # a decode server's request, prefilled elsewhere
      self.prefill_seconds.observe(req.prefill_seconds)
      self.transfer_seconds.observe(req.transfer_seconds)
      self.transfer_bytes.inc(req.transfer_bytes)
      self.transfer_rate.set(req.transfer_bytes / max(req.transfer_seconds, 1e-9) / 1e9)
    for layer, (h, m, p) in enumerate(zip(req.layer_hits, req.layer_misses, req.layer_prefetched)):
      self.hits.labels(layer=str(layer)).inc(int(h))
      self.misses.labels(layer=str(layer)).inc(int(m))
      self.miss_bytes.labels(layer=str(layer)).inc(int(m) * self.row_bytes)
      self.prefetched.labels(layer=str(layer)).inc(int(p))

  def update(self, loads: dict) -> None:
    self.running.set(loads["running"])
    self.queued.set(loads["queued"])
    total, free = loads["host_rows_total"], loads["free_host_rows"]
    self.host_rows.labels(state="used").set(total - free)
    self.host_rows.labels(state="free").set(free)
    self.device_kv.labels(state="used").set(loads["device_kv_bytes_used"])
    self.device_kv.labels(state="total").set(loads["device_kv_bytes_budget"])
    for p in loads["pools"]:
      used = p["pages_total"] - p["pages_free"]
      for state, pages in (("used", used), ("free", p["pages_free"])):
        self.pool_pages.labels(pool=p["name"], memory=p["memory"], state=state).set(pages)
        self.pool_bytes.labels(pool=p["name"], memory=p["memory"], state=state).set(pages * p["bytes_per_page"])
    self.resident.set(loads["resident"])
    for counter, key in ((self.preemptions, "preemptions"), (self.offloads, "offloads")):
      value, last = loads[key], self._totals.get(key, 0)
      counter.inc(value - last if value >= last else value)  # (an Engine.reset() starts its totals at 0 again)
      self._totals[key] = value


class _CountOf:
  """A counter read from a number something else keeps (``value()``: a total since start), at each scrape."""

  def __init__(self, name: str, documentation: str, value):
    self.name, self.documentation, self.value = name, documentation, value

  def collect(self):
    yield CounterMetricFamily(self.name, self.documentation, value=self.value())

  def describe(self):  # (the registry's name filter, ?name[]=, finds a collector by what it describes)
    yield CounterMetricFamily(self.name, self.documentation)


class _MetricsHandler(WSGIRequestHandler):
  def log_message(self, *args) -> None:  # (no line on stderr per scrape)
    pass


class _MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
  """wsgiref's server, a thread per connection, at most METRICS_CONNECTIONS of them."""

  daemon_threads = True
  request_queue_size = 64  # the listen backlog (socketserver's default of 5 made connects retry for ~1 s)

  def __init__(self, *args, **kwargs):
    self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)
    # A deadline for each whole connection, kept by one thread (a socket timeout restarts with every byte: a
    # client sending one byte every few seconds held its connection for good).
    self._deadlines: dict[socket.socket, float] = {}
    self._deadlines_lock = threading.Lock()
    super().__init__(*args, **kwargs)
    threading.Thread(target=self._reap, name="metrics-deadlines", daemon=True).start()

  def _reap(self) -> None:
    while True:
      time.sleep(0.25)
      now = time.monotonic()
      with self._deadlines_lock:
        late = [c for c, t in self._deadlines.items() if t < now]
      for connection in late:  # its thread's blocked read returns; that thread closes it
        try:
          connection.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass

  def process_request(self, request, client_address) -> None:
    if not self._slots.acquire(blocking=False):
      self.shutdown_request(request)  # over the cap: closed at once
      return
    try:
      super().process_request(request, client_address)
    except BaseException:
      self._slots.release()
      raise

  def process_request_thread(self, request, client_address) -> None:
    with self._deadlines_lock:
      self._deadlines[request] = time.monotonic() + METRICS_CONNECTION_S
    try:
      super().process_request_thread(request, client_address)
    finally:
      with self._deadlines_lock:
        del self._deadlines[request]
      self._slots.release()

  def handle_error(self, request, client_address) -> None:  # (a client that timed out or reset: no traceback)
    pass


class _CachedPage:
  """WSGI app: prometheus-client's, at /metrics and / only (404 elsewhere), GET and HEAD (OPTIONS as it answers),
  each page rendered at most every METRICS_CACHE_S and shared by the scrapes that ask for it meanwhile; one
  request at a time, at most one per METRICS_MIN_INTERVAL_S (a varied query string or Accept header, each a
  fresh render, cannot make it render more often than that)."""

  def __init__(self, app):
    self.app = app
    self._lock = threading.Lock()
    self._pages: dict[tuple, tuple[float, str, list, bytes]] = {}
    self._next = 0.0  # when the next request may be answered (METRICS_MIN_INTERVAL_S)

  def __call__(self, environ, start_response):
    if environ.get("PATH_INFO", "/") not in METRICS_PATHS:
      start_response("404 Not Found", [("Content-Type", "text/plain")])
      return [b"not found: the metrics are at /metrics\n"]
    method = environ.get("REQUEST_METHOD", "GET")
    if method not in ("GET", "HEAD"):
      return self.app(environ, start_response)  # (OPTIONS, and 405 for the rest)
    key = (environ.get("QUERY_STRING", ""), environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""))
    with self._lock:
      time.sleep(max(0.0, self._next - time.monotonic()))
      self._next = time.monotonic() + METRICS_MIN_INTERVAL_S
      page = self._pages.get(key)
      if page is None or time.monotonic() - page[0] > METRICS_CACHE_S:
        got = {}

        def keep(status, headers, exc_info=None):
          got["status"], got["headers"] = status, headers

        body = b"".join(self.app({**environ, "REQUEST_METHOD": "GET"}, keep))
        if len(self._pages) > 64:  # (one key per query / format / encoding a client sent)
          self._pages.clear()
        page = self._pages[key] = (time.monotonic(), got["status"], got["headers"], body)
    _, status, headers, body = page
    headers = [(k, v) for k, v in headers if k.lower() != "content-length"]  # (a copy: wsgiref adds to the list)
    start_response(status, headers + [("Content-Length", str(len(body)))])
    return [b""] if method == "HEAD" else [body]
