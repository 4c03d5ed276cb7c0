"""Decode engine: continuous batching of greedy decoding over a dense or HiSparse KV cache.

One engine owns the model, the KV cache (``kv_cache.DenseKVCache`` or
``kv_cache.HiSparseKVCache``) and ``max_running_requests`` decode lanes. Each
``step()``:

  1. admits waiting requests into free lanes (allocating host-pool pages in
     HiSparse mode) and prefills each (one jitted call per prompt, padded to a
     power-of-two bucket), which also yields its first token;
  2. runs one jitted decode step for all lanes at a fixed batch shape (idle
     lanes have seq_len 0 and cost no swap-in I/O), so a request's numerics do
     not depend on its neighbours; the indexer scores only a power-of-two window
     covering the longest running sequence, not all max_seq_len positions;
  3. finishes requests on an EOS id or at max_new_tokens and frees their lane
     and pages. The freed pages are reused only by later calls, which XLA
     orders after every call that could still write them (the cache is one
     donated value threaded through all calls).

Not thread-safe: drive it from one thread (the gRPC server runs it in its own
loop thread and talks to it through queues).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.kv_cache import DenseKVCache, HiSparseKVCache
from hisparse_jax.ops import ExtensionHostPool
from hisparse_jax.sampling import sample
from models.convert import load_model

log = logging.getLogger(__name__)

MIN_PREFILL_BUCKET = 16
# Smallest indexer window of a decode step (tokens); see Engine._index_window.
MIN_INDEX_WINDOW = 256
DEFAULT_MAX_SEQ_LEN = 4096
# Host-pool allocation granularity (tokens per page).
HOST_PAGE_SIZE = 16
HOST_POOL_KINDS = ("jax", "extension")


class RequestError(ValueError):
  """A request that cannot be served; ``code`` is "INVALID_ARGUMENT" or "RESOURCE_EXHAUSTED"."""

  def __init__(self, code: str, message: str):
    super().__init__(message)
    self.code = code


@dataclasses.dataclass
class Request:
  """One generation request and its results.

  Attributes:
    request_id: caller's id.
    prompt_ids: prompt token ids.
    max_new_tokens: tokens to generate at most (>= 1).
    on_token: called from the engine's thread with each new token id.
    temperature / top_k / top_p / seed: sampling (``hisparse_jax.sampling``);
      temperature 0 (default) is greedy; seed None draws one at random.
    stop_token_ids: tokens that end the request besides the model's EOS ids.
    stop: strings that end the request once the output text contains one
      (needs the engine's tokenizer).
    ignore_eos: keep generating past the model's EOS ids (benchmarks: every request produces
      exactly max_new_tokens unless a stop token/string matches).
    output_ids: generated ids (new tokens only).
    finish_reason: None while running, then "stop" (EOS), "stop_token",
      "stop_string", "length" or "abort".
    matched_stop: the stop token id (as text) or stop string that matched.
    topk_trace: with ``Engine(record_topk=True)``, int32[L, K] top-k positions per decode step
      (the first token comes from prefill and has none).
    hits / misses: swap-in hits and misses summed over layers and steps
      (distinct positions per step and layer; 0 in dense mode); layer_hits /
      layer_misses the same per layer.
  """

  request_id: str
  prompt_ids: list[int]
  max_new_tokens: int
  on_token: Callable[[int], None] | None = None
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  output_ids: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  matched_stop: str = ""
  hits: int = 0
  misses: int = 0
  layer_hits: tuple[int, ...] = ()
  layer_misses: tuple[int, ...] = ()
  topk_trace: list[np.ndarray] = dataclasses.field(default_factory=list)
  lane: int = -1
  pages: list[int] = dataclasses.field(default_factory=list)

  @property
  def done(self) -> bool:
    return self.finish_reason is not None


class Engine:
  """Continuous-batching decoder (greedy by default, per-request sampling).

  Args:
    model_dir: HF-format model directory (config.json + safetensors) or an orbax
      directory written by `python -m models.convert`.
    dtype: compute/KV dtype name ("float32", "bfloat16"); None = the
      checkpoint's own dtype.
    hisparse: HiSparse sizes, or None for the dense (all KV on device) mode.
    max_running_requests: decode lanes (the fixed decode batch).
    max_seq_len: longest prompt + output per request (tokens); defaults to
      min(max_position_embeddings, 4096).
    host_pool: where HiSparse keeps the host pool: "jax" (a ``pinned_host``
      JAX array, the default) or "extension" (``ops.ExtensionHostPool``,
      memory owned by the FFI extension; the fallback for GPUs where XLA does
      not pass ``pinned_host`` operands to custom calls as host pointers).
    fp8_numerics: DeepSeek-V3.2's FP8 deployment numerics for the indexer and
      the latent KV (``models/fp8_numerics.py``); off by default.
    max_device_kv_bytes: device KV budget (bytes) for admission: a request is
      admitted only while the sum of ``device_kv_bytes(request)`` of running
      requests fits (None: no budget beyond the lanes).
    max_queued_requests: bound on waiting requests; submit() beyond it raises
      RESOURCE_EXHAUSTED (None: unbounded).
    tokenizer: a ``tokenizers.Tokenizer``, needed for stop strings.
    record_topk: keep, in each ``Request.topk_trace``, the top-k positions of every layer at every
      decode step (int32[L, index_topk] per step; -1 padding) — the indexer's real access trace,
      replayed by ``benchmarks/miss_rate.py --trace``. Costs a device->host copy per step.

  Raises:
    FileNotFoundError / ValueError: unreadable model directory or config.
  """

  def __init__(self, model_dir, *, dtype: str | None = None, hisparse: HiSparseConfig | None = None,
               max_running_requests: int = 8, max_seq_len: int | None = None, host_pool: str = "jax",
               fp8_numerics: bool = False, max_device_kv_bytes: int | None = None,
               max_queued_requests: int | None = None, tokenizer=None, record_topk: bool = False):
    if max_running_requests < 1:
      raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
    if host_pool not in HOST_POOL_KINDS:
      raise ValueError(f"host_pool must be one of {HOST_POOL_KINDS}, got {host_pool!r}")
    self.host_pool_kind = host_pool
    self.max_device_kv_bytes = max_device_kv_bytes
    self.max_queued_requests = max_queued_requests
    self.tokenizer = tokenizer
    self.config, model = load_model(model_dir, dtype=dtype, fp8_numerics=fp8_numerics)
    cfg = self.config
    self.hisparse = hisparse
    if hisparse is not None and hisparse.top_k != cfg.index_topk:
      raise ValueError(f"hisparse top_k ({hisparse.top_k}) differs from the model's index_topk ({cfg.index_topk})")
    self.max_seq_len = int(max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN))
    if self.max_seq_len > cfg.max_position_embeddings:
      raise ValueError(f"max_seq_len ({self.max_seq_len}) > the model's max_position_embeddings "
                       f"({cfg.max_position_embeddings})")
    self.num_lanes = max_running_requests
    self.dtype = jnp.dtype(dtype or cfg.dtype)
    self.eos_ids = frozenset(cfg.eos_token_ids)
    graphdef, self._state = nnx.split(model)

    self.num_pages = 0 if hisparse is None else hisparse.host_pool_rows(self.num_lanes) // HOST_PAGE_SIZE
    self.reset()
    # Wall-clock split of step() (seconds, cumulative; each phase ends with its tokens on the host).
    self.prefill_seconds = 0.0
    self.decode_seconds = 0.0
    self.decode_steps = 0

    @functools.partial(jax.jit, donate_argnums=(3,), static_argnames=("index_len",))
    def decode(state, tokens, seq_lens, cache, params, index_len):
      out = nnx.merge(graphdef, state).decode(tokens, seq_lens, cache, return_topk=record_topk,
                                              index_len=index_len)
      return sample(out[0], *params, seq_lens), *out[1:]

    @functools.partial(jax.jit, donate_argnums=(3,))
    def prefill(state, tokens, length, cache, lane, host_rows, params):
      logits, latents, index_keys = nnx.merge(graphdef, state).prefill(tokens, length[None], last_only=True)
      cache = cache.insert(lane, latents[:, 0], index_keys[:, 0], host_rows)
      return sample(logits, *params, length[None])[0], cache

    self._decode, self._prefill = decode, prefill

  def reset(self) -> None:
    """Drops every request and starts from an empty KV cache (after a failed step)."""
    cfg = self.config
    shape = dict(num_layers=cfg.num_hidden_layers, batch=self.num_lanes, max_seq_len=self.max_seq_len,
                 latent_dim=cfg.latent_dim, index_dim=cfg.index_head_dim, dtype=self.dtype)
    if self.hisparse is None:
      self.cache = DenseKVCache.create(**shape)
    else:
      rows = self.num_pages * HOST_PAGE_SIZE
      self.external_pool = (ExtensionHostPool(cfg.num_hidden_layers, rows, cfg.latent_dim, self.dtype)
                            if self.host_pool_kind == "extension" else None)
      self.cache = HiSparseKVCache.create(**shape, device_buffer_size=self.hisparse.device_buffer_size,
                                          host_pool_rows=rows, external_pool=self.external_pool)
    self._free_pages = collections.deque(range(self.num_pages))
    self._free_lanes = collections.deque(range(self.num_lanes))
    self._lanes: list[Request | None] = [None] * self.num_lanes
    self._seq_lens = np.zeros(self.num_lanes, np.int32)
    self._next = np.zeros(self.num_lanes, np.int32)
    # Per-lane sampling parameters (temperature, top_k, top_p, seed), fed to every decode step.
    self._temperature = np.zeros(self.num_lanes, np.float32)
    self._top_k = np.zeros(self.num_lanes, np.int32)
    self._top_p = np.ones(self.num_lanes, np.float32)
    self._seed = np.zeros(self.num_lanes, np.uint32)
    self.device_kv_bytes_used = 0
    self.waiting: collections.deque[Request] = collections.deque()

  # ----------------------------------------------------------------- requests
  def validate(self, req: Request) -> None:
    """Raises RequestError if req can never be served (checked before queueing)."""
    n = len(req.prompt_ids)
    if n == 0:
      raise RequestError("INVALID_ARGUMENT", "empty prompt")
    if req.max_new_tokens <= 0:
      raise RequestError("INVALID_ARGUMENT", f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
    bad = [t for t in req.prompt_ids if not 0 <= t < self.config.vocab_size]
    if bad:
      raise RequestError("INVALID_ARGUMENT",
                         f"token id {bad[0]} outside the vocabulary [0, {self.config.vocab_size})")
    if n + req.max_new_tokens > self.max_seq_len:
      raise RequestError("INVALID_ARGUMENT",
                         f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the "
                         f"model context of {self.max_seq_len} tokens")
    if self.hisparse is not None and self._pages_needed(req) > self.num_pages:
      raise RequestError("RESOURCE_EXHAUSTED",
                         f"request needs {self._pages_needed(req) * HOST_PAGE_SIZE} host-pool rows; "
                         f"the host pool holds {self.num_pages * HOST_PAGE_SIZE}")
    if self.max_device_kv_bytes is not None and self.device_kv_bytes(req) > self.max_device_kv_bytes:
      raise RequestError("RESOURCE_EXHAUSTED",
                         f"request needs {self.device_kv_bytes(req)} bytes of device KV memory; the "
                         f"budget is {self.max_device_kv_bytes}")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
      raise RequestError("INVALID_ARGUMENT", f"temperature must be >= 0, got {req.temperature}")
    if not (math.isfinite(req.top_p) and 0 <= req.top_p <= 1):
      raise RequestError("INVALID_ARGUMENT", f"top_p must be in [0, 1], got {req.top_p}")
    if req.top_k < 0:
      raise RequestError("INVALID_ARGUMENT", f"top_k must be >= 0, got {req.top_k}")
    if req.seed is not None and not 0 <= req.seed < 2**32:
      raise RequestError("INVALID_ARGUMENT", f"seed must be in [0, 2**32), got {req.seed}")
    bad = [t for t in req.stop_token_ids if not 0 <= t < self.config.vocab_size]
    if bad:
      raise RequestError("INVALID_ARGUMENT", f"stop token id {bad[0]} outside the vocabulary")
    if any(not isinstance(x, str) or not x for x in req.stop):
      raise RequestError("INVALID_ARGUMENT", "stop strings must be non-empty")
    if req.stop and self.tokenizer is None:
      raise RequestError("INVALID_ARGUMENT", "stop strings need a model with a tokenizer")

  def device_kv_bytes(self, req: Request) -> int:
    """Device KV memory a request holds while running (bytes): dense mode its full latent KV and
    indexer keys; HiSparse its hot buffer ((D+1) slots x layers) and indexer keys; both for
    prompt + max_new_tokens positions. Source: the cache layouts in kv_cache.py."""
    cfg = self.config
    positions = len(req.prompt_ids) + req.max_new_tokens
    index = positions * cfg.index_head_dim * 4
    if self.hisparse is None:
      latent = positions * cfg.latent_dim * self.dtype.itemsize
    else:
      latent = (self.hisparse.device_buffer_size + 1) * cfg.latent_dim * self.dtype.itemsize
    return cfg.num_hidden_layers * (latent + index)

  def loads(self) -> dict:
    """Current load (the GetLoads RPC): running, queued, free lanes, device budget, host rows."""
    return dict(running=len(self.running), queued=len(self.waiting), free_lanes=len(self._free_lanes),
                device_kv_bytes_used=self.device_kv_bytes_used,
                device_kv_bytes_budget=self.max_device_kv_bytes or 0,
                free_host_rows=len(self._free_pages) * HOST_PAGE_SIZE,
                host_rows_total=self.num_pages * HOST_PAGE_SIZE)

  def submit(self, req: Request) -> None:
    """Validates and queues a request (RequestError if it can never be served)."""
    self.validate(req)
    if self.max_queued_requests is not None and len(self.waiting) >= self.max_queued_requests:
      raise RequestError("RESOURCE_EXHAUSTED", f"queue full ({self.max_queued_requests} requests waiting)")
    if req.seed is None:
      req.seed = int.from_bytes(os.urandom(4), "little")
    self.waiting.append(req)

  @property
  def running(self) -> list[Request]:
    return [r for r in self._lanes if r is not None]

  def has_work(self) -> bool:
    return bool(self.waiting) or any(r is not None for r in self._lanes)

  def _pages_needed(self, req: Request) -> int:
    return math.ceil((len(req.prompt_ids) + req.max_new_tokens) / HOST_PAGE_SIZE)

  def _index_window(self) -> int:
    """Indexer positions this decode step scores: the longest running sequence rounded up to a power
    of two, at least MIN_INDEX_WINDOW, at most max_seq_len (one compiled decode step per window;
    the top-k does not depend on it, so neither do the tokens)."""
    n = int(self._seq_lens.max())
    return min(self.max_seq_len, max(MIN_INDEX_WINDOW, 1 << max(n - 1, 0).bit_length()))

  def _bucket(self, n: int) -> int:
    return min(max(MIN_PREFILL_BUCKET, 1 << (n - 1).bit_length()), self.max_seq_len)

  # --------------------------------------------------------------------- loop
  def step(self) -> list[Request]:
    """Admit, prefill, decode one token for every running request. Returns requests finished."""
    finished = []
    t0 = time.perf_counter()
    self._admit(finished)
    t1 = time.perf_counter()
    self.prefill_seconds += t1 - t0
    if any(r is not None for r in self._lanes):
      self.decode_steps += 1
      tokens, self.cache, *topk = self._decode(self._state, jnp.asarray(self._next),
                                               jnp.asarray(self._seq_lens), self.cache, self._sampling_params(),
                                               index_len=self._index_window())
      tokens = np.asarray(tokens)
      if topk:
        topk = np.asarray(topk[0])  # [L, B, K]
        for lane, req in enumerate(self._lanes):
          if req is not None:
            req.topk_trace.append(topk[:, lane])
      for lane, req in enumerate(self._lanes):
        if req is not None:
          self._emit(req, int(tokens[lane]), finished)
      self.decode_seconds += time.perf_counter() - t1
    return finished

  def run(self) -> None:
    """Steps until every submitted request has finished."""
    while self.has_work():
      self.step()

  def abort(self, request_id: str) -> Request | None:
    """Stops a waiting or running request (finish_reason "abort") and returns it (None if unknown).

    Called between steps, so no kernel of this engine is still writing the request's slots or
    host rows; whatever reuses them later is ordered after every earlier step by the cache's
    data dependencies (it is one donated value threaded through all jitted calls).
    """
    for req in list(self.waiting):
      if req.request_id == request_id:
        self.waiting.remove(req)
        req.finish_reason = "abort"
        return req
    for req in self._lanes:
      if req is not None and req.request_id == request_id:
        req.finish_reason = "abort"
        self._release(req)
        return req
    return None

  def _admit(self, finished: list[Request]) -> None:
    while self.waiting and self._free_lanes:
      req = self.waiting[0]
      pages_needed = self._pages_needed(req) if self.hisparse is not None else 0
      if pages_needed > len(self._free_pages):
        return  # waits for running requests to free host-pool pages
      need = self.device_kv_bytes(req)
      if self.max_device_kv_bytes is not None and self.device_kv_bytes_used + need > self.max_device_kv_bytes:
        return  # waits for running requests to free device KV memory
      self.waiting.popleft()
      self.device_kv_bytes_used += need
      req.lane = self._free_lanes.popleft()
      lane = req.lane
      self._temperature[lane], self._top_k[lane], self._top_p[lane] = req.temperature, req.top_k, req.top_p
      self._seed[lane] = req.seed
      req.pages = [self._free_pages.popleft() for _ in range(pages_needed)]
      n = len(req.prompt_ids)
      bucket = self._bucket(n)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :n] = req.prompt_ids
      params = tuple(a[lane:lane + 1] for a in self._sampling_params())
      first, self.cache = self._prefill(self._state, jnp.asarray(tokens), jnp.int32(n), self.cache,
                                        jnp.int32(lane), jnp.asarray(self._page_table(req)), params)
      self._lanes[req.lane] = req
      self._seq_lens[req.lane] = n
      self._emit(req, int(first), finished)

  def _page_table(self, req: Request) -> np.ndarray:
    """int32[max_seq_len]: position -> host-pool row for req's pages, -1 beyond them."""
    table = np.full(self.max_seq_len, -1, np.int32)
    if req.pages:
      rows = (np.asarray(req.pages, np.int32)[:, None] * HOST_PAGE_SIZE
              + np.arange(HOST_PAGE_SIZE, dtype=np.int32)).reshape(-1)
      m = min(len(rows), self.max_seq_len)
      table[:m] = rows[:m]
    return table

  def _sampling_params(self):
    return (jnp.asarray(self._temperature), jnp.asarray(self._top_k), jnp.asarray(self._top_p),
            jnp.asarray(self._seed))

  def _emit(self, req: Request, token: int, finished: list[Request]) -> None:
    req.output_ids.append(token)
    if req.on_token is not None:
      req.on_token(token)
    if token in self.eos_ids and not req.ignore_eos:
      req.finish_reason = "stop"
    elif token in req.stop_token_ids:
      req.finish_reason, req.matched_stop = "stop_token", str(token)
    elif req.stop and (hit := self._stop_string(req)) is not None:
      req.finish_reason, req.matched_stop = "stop_string", hit
    elif len(req.output_ids) >= req.max_new_tokens:
      req.finish_reason = "length"
    if req.done:
      self._release(req)
      finished.append(req)
    else:
      # The token just produced is fed next step at position seq_len.
      self._next[req.lane] = token
      self._seq_lens[req.lane] += 1

  def _stop_string(self, req: Request) -> str | None:
    """The first stop string the decoded output contains, looking only at its newest characters."""
    text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
    tail = text[-(max(map(len, req.stop)) + 64):]
    return next((s for s in req.stop if s in tail), None)

  def _release(self, req: Request) -> None:
    if self.hisparse is not None:
      per_layer = np.asarray(self.cache.stats[:, req.lane])  # [L, 2]
      req.layer_hits, req.layer_misses = tuple(per_layer[:, 0].tolist()), tuple(per_layer[:, 1].tolist())
      req.hits, req.misses = int(per_layer[:, 0].sum()), int(per_layer[:, 1].sum())
    self._lanes[req.lane] = None
    self._seq_lens[req.lane] = 0
    self._next[req.lane] = 0
    self._temperature[req.lane] = 0.0
    self._free_lanes.append(req.lane)
    self._free_pages.extend(req.pages)
    self.device_kv_bytes_used -= self.device_kv_bytes(req)
    req.pages = []
