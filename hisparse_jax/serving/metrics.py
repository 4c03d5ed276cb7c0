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
  hisparse_preemptions                                           gauge (requests preempted since start)
  hisparse_resident_requests                                     gauge (dynamic residency: requests whose whole
                                                                 latent KV is on device now)
  hisparse_offloads                                              gauge (resident requests moved to their hot
                                                                 buffers since start)
  hisparse_pd_prefill_seconds, hisparse_pd_kv_transfer_seconds   histograms (decode server: prefill server's time
                                                                 to first token; pulling the prompt KV)
  hisparse_pd_kv_transfer_bytes_total                            counter
  hisparse_pd_kv_transfer_gigabytes_per_second                   gauge (the last pull)
  (those hisparse_pd_* metrics exist on a decode server only: --disaggregation-mode decode)
  hisparse_pd_offered_kv_bytes{state="held"|"limit"}            gauge (prefill server: prompt KV held for decode
                                                                 servers, offers not pulled yet and prefills in
                                                                 flight; --max-offered-kv-bytes)
  hisparse_pd_offers_taken_back                                  gauge (prefill server: offers not acknowledged,
                                                                 taken back, since start)

Gauges are set from the engine's published loads when the engine loop starts and after every step, abort or
release, so an idle server shows its idle state from the start; each layer's counters exist at 0 from the
start (given ``num_layers``).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# hisparse_requests_total's outcomes, each created at 0: the finish reasons, "cancelled", and every status a
# Generate stream can fail with (server.py's aborts; "unknown": an exception the handler did not expect).
REQUEST_OUTCOMES = ("stop", "length", "abort", "stop_token", "stop_string", "cancelled", "invalid_argument",
                    "resource_exhausted", "unavailable", "internal", "deadline_exceeded", "unauthenticated",
                    "unknown")
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
    self.ttft = Histogram("hisparse_time_to_first_token_seconds", "Arrival to first token",
                          buckets=_LATENCY_BUCKETS, registry=r)
    self.itl = Histogram("hisparse_inter_token_latency_seconds", "Time between a request's tokens",
                         buckets=_LATENCY_BUCKETS, registry=r)
    self.hits = Counter("hisparse_swap_in_hits", "Swap-in hits (distinct positions)", ["layer"], registry=r)
    self.misses = Counter("hisparse_swap_in_misses", "Swap-in misses (rows copied host->device)", ["layer"],
                          registry=r)
    self.miss_bytes = Counter("hisparse_swap_in_bytes", "Bytes copied host->device by the swap-in", ["layer"],
                              registry=r)
    self.prefetched = Counter("hisparse_prefetch_rows", "Rows the cross-layer prefetch copied ahead of the "
                              "layer's swap-in", ["layer"], registry=r)
    self.host_rows = Gauge("hisparse_host_pool_rows", "HiSparse host-pool rows", ["state"], registry=r)
    self.device_kv = Gauge("hisparse_device_kv_bytes", "Device KV memory: allocated / all pools (every DP group's)", ["state"],
                           registry=r)
    self.pool_pages = Gauge("hisparse_kv_pool_pages", "KV pool pages", ["pool", "memory", "state"], registry=r)
    self.pool_bytes = Gauge("hisparse_kv_pool_bytes", "KV pool bytes", ["pool", "memory", "state"], registry=r)
    self.preemptions = Gauge("hisparse_preemptions", "Requests preempted (KV freed, recomputed) since start",
                             registry=r)
    self.resident = Gauge("hisparse_resident_requests", "Dynamic residency: requests whose whole latent KV is "
                          "on device", registry=r)
    self.offloads = Gauge("hisparse_offloads", "Dynamic residency: resident requests moved to their hot buffers "
                          "since start", registry=r)
    self.requests = Counter("hisparse_requests", "Generate streams ended, by outcome: the finish reason (stop, "
                            "length, abort, stop_token, stop_string) or the gRPC status the stream failed with "
                            "(resource_exhausted, invalid_argument, unavailable, internal, deadline_exceeded, "
                            "unauthenticated, unknown; cancelled: the client went away or its deadline passed "
                            "first)", ["outcome"], registry=r)
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
    self.prefill_seconds = Histogram("hisparse_pd_prefill_seconds", "Prefill server: arrival to first token",
                                     buckets=_LATENCY_BUCKETS, registry=r)
    self.transfer_seconds = Histogram("hisparse_pd_kv_transfer_seconds", "Pulling a prompt's KV from a prefill "
                                      "server", buckets=_LATENCY_BUCKETS, registry=r)
    self.transfer_bytes = Counter("hisparse_pd_kv_transfer_bytes", "Prompt KV bytes pulled from prefill servers",
                                  registry=r)
    self.transfer_rate = Gauge("hisparse_pd_kv_transfer_gigabytes_per_second", "The last prompt KV pull's rate "
                               "(GB/s)", registry=r)

  def watch_offers(self, prefill) -> None:
    """A prefill server's offers (``disaggregation.PrefillServicer``), read at each scrape."""
    held = Gauge("hisparse_pd_offered_kv_bytes", "Prefill server: prompt KV bytes held for decode servers (offers "
                 "not pulled yet, prefills in flight), and their limit (--max-offered-kv-bytes)", ["state"],
                 registry=self.registry)
    held.labels(state="held").set_function(lambda: prefill.offered_bytes)
    held.labels(state="limit").set_function(lambda: prefill.max_offered_bytes)
    Gauge("hisparse_pd_offers_taken_back", "Prefill server: offers not acknowledged, taken back since start",
          registry=self.registry).set_function(lambda: prefill.offers_taken_back)

  def serve(self, port: int, host: str = "127.0.0.1") -> int:
    """Serves /metrics on host:port (port 0: a free one); returns the bound port. OSError if it cannot bind."""
    httpd, _ = start_http_server(port, addr=host.strip("[]"), registry=self.registry)  # (an IPv6 one bare)
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
    self.preemptions.set(loads["preemptions"])
    self.resident.set(loads["resident"])
    self.offloads.set(loads["offloads"])
