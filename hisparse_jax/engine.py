"""Decode engine: continuous batching of greedy decoding over a dense or HiSparse KV cache.

One engine owns the model, the KV cache (``kv_cache.DenseKVCache`` or
``kv_cache.HiSparseKVCache``) and ``max_running_requests`` decode lanes. Each
``step()``:

  1. admits waiting requests into free lanes (allocating host-pool pages in
     HiSparse mode) and prefills each (one jitted call per prompt, padded to a
     power-of-two bucket), which also yields its first token;
  2. runs one jitted decode step for all lanes at a fixed batch shape (idle
     lanes have seq_len 0 and cost no swap-in I/O), so a request's numerics do
     not depend on its neighbours;
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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.kv_cache import DenseKVCache, HiSparseKVCache
from hisparse_jax.ops import ExtensionHostPool
from models.convert import load_model

log = logging.getLogger(__name__)

MIN_PREFILL_BUCKET = 16
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
    output_ids: generated ids (new tokens only).
    finish_reason: None while running, then "stop" (EOS) or "length".
    hits / misses: swap-in hits and misses summed over layers and steps
      (distinct positions per step and layer; 0 in dense mode).
  """

  request_id: str
  prompt_ids: list[int]
  max_new_tokens: int
  on_token: Callable[[int], None] | None = None
  output_ids: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  hits: int = 0
  misses: int = 0
  lane: int = -1
  pages: list[int] = dataclasses.field(default_factory=list)

  @property
  def done(self) -> bool:
    return self.finish_reason is not None


class Engine:
  """Greedy continuous-batching decoder.

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

  Raises:
    FileNotFoundError / ValueError: unreadable model directory or config.
  """

  def __init__(self, model_dir, *, dtype: str | None = None, hisparse: HiSparseConfig | None = None,
               max_running_requests: int = 8, max_seq_len: int | None = None, host_pool: str = "jax",
               fp8_numerics: bool = False):
    if max_running_requests < 1:
      raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
    if host_pool not in HOST_POOL_KINDS:
      raise ValueError(f"host_pool must be one of {HOST_POOL_KINDS}, got {host_pool!r}")
    self.host_pool_kind = host_pool
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

    # Host pool = host_to_device_ratio x the device hot-buffer rows (SGLang's sizing).
    self.num_pages = 0 if hisparse is None else (
        hisparse.host_to_device_ratio * self.num_lanes * (hisparse.device_buffer_size + 1) // HOST_PAGE_SIZE)
    self.reset()

    @functools.partial(jax.jit, donate_argnums=(3,))
    def decode(state, tokens, seq_lens, cache):
      logits, cache = nnx.merge(graphdef, state).decode(tokens, seq_lens, cache)
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=(3,))
    def prefill(state, tokens, length, cache, lane, host_rows):
      logits, latents, index_keys = nnx.merge(graphdef, state).prefill(tokens, length[None], last_only=True)
      cache = cache.insert(lane, latents[:, 0], index_keys[:, 0], host_rows)
      return jnp.argmax(logits[0]).astype(jnp.int32), cache

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

  def submit(self, req: Request) -> None:
    """Validates and queues a request (RequestError if it can never be served)."""
    self.validate(req)
    self.waiting.append(req)

  @property
  def running(self) -> list[Request]:
    return [r for r in self._lanes if r is not None]

  def has_work(self) -> bool:
    return bool(self.waiting) or any(r is not None for r in self._lanes)

  def _pages_needed(self, req: Request) -> int:
    return math.ceil((len(req.prompt_ids) + req.max_new_tokens) / HOST_PAGE_SIZE)

  def _bucket(self, n: int) -> int:
    return min(max(MIN_PREFILL_BUCKET, 1 << (n - 1).bit_length()), self.max_seq_len)

  # --------------------------------------------------------------------- loop
  def step(self) -> list[Request]:
    """Admit, prefill, decode one token for every running request. Returns requests finished."""
    finished = []
    self._admit(finished)
    if any(r is not None for r in self._lanes):
      tokens, self.cache = self._decode(self._state, jnp.asarray(self._next), jnp.asarray(self._seq_lens),
                                        self.cache)
      tokens = np.asarray(tokens)
      for lane, req in enumerate(self._lanes):
        if req is not None:
          self._emit(req, int(tokens[lane]), finished)
    return finished

  def run(self) -> None:
    """Steps until every submitted request has finished."""
    while self.has_work():
      self.step()

  def abort(self, request_id: str) -> bool:
    """Stops a waiting or running request (finish_reason "abort"). Returns whether it was found."""
    for req in list(self.waiting):
      if req.request_id == request_id:
        self.waiting.remove(req)
        req.finish_reason = "abort"
        return True
    for req in self._lanes:
      if req is not None and req.request_id == request_id:
        req.finish_reason = "abort"
        self._release(req)
        return True
    return False

  def _admit(self, finished: list[Request]) -> None:
    while self.waiting and self._free_lanes:
      req = self.waiting[0]
      pages_needed = self._pages_needed(req) if self.hisparse is not None else 0
      if pages_needed > len(self._free_pages):
        return  # waits for running requests to free host-pool pages
      self.waiting.popleft()
      req.lane = self._free_lanes.popleft()
      req.pages = [self._free_pages.popleft() for _ in range(pages_needed)]
      n = len(req.prompt_ids)
      bucket = self._bucket(n)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :n] = req.prompt_ids
      first, self.cache = self._prefill(self._state, jnp.asarray(tokens), jnp.int32(n), self.cache,
                                        jnp.int32(req.lane), jnp.asarray(self._page_table(req)))
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

  def _emit(self, req: Request, token: int, finished: list[Request]) -> None:
    req.output_ids.append(token)
    if req.on_token is not None:
      req.on_token(token)
    if token in self.eos_ids:
      req.finish_reason = "stop"
    elif len(req.output_ids) >= req.max_new_tokens:
      req.finish_reason = "length"
    if req.done:
      self._release(req)
      finished.append(req)
    else:
      # The token just produced is fed next step at position seq_len.
      self._next[req.lane] = token
      self._seq_lens[req.lane] += 1

  def _release(self, req: Request) -> None:
    if self.hisparse is not None:
      stats = np.asarray(self.cache.stats[:, req.lane]).sum(axis=0)
      req.hits, req.misses = int(stats[0]), int(stats[1])
    self._lanes[req.lane] = None
    self._seq_lens[req.lane] = 0
    self._next[req.lane] = 0
    self._free_lanes.append(req.lane)
    self._free_pages.extend(req.pages)
    req.pages = []
