"""A generation request, its life in the engine, and the typed errors a request can fail with."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

import numpy as np


class RequestError(Exception):
  """A request that cannot be served. ``code`` is the gRPC status name the server answers with."""

  code = "INVALID_ARGUMENT"

  def __init__(self, message: str):
    super().__init__(message)


class InvalidRequest(RequestError):
  """Bad input: it can never be served as given (INVALID_ARGUMENT)."""

  code = "INVALID_ARGUMENT"


class ResourceExhausted(RequestError):
  """Valid, but larger than the server's memory, or the queue is full (RESOURCE_EXHAUSTED)."""

  code = "RESOURCE_EXHAUSTED"


class Unavailable(RequestError):
  """The server is shutting down (UNAVAILABLE)."""

  code = "UNAVAILABLE"


class DeadlineExceeded(RequestError):
  """The caller's deadline passed before the request could start (DEADLINE_EXCEEDED): a decode server's wait for
  the prompt KV from a prefill server."""

  code = "DEADLINE_EXCEEDED"


class InternalError(RequestError):
  """A step of the engine failed; the requests it was running fail with it (INTERNAL)."""

  code = "INTERNAL"


class Phase(enum.Enum):
  WAITING = "waiting"  # queued (or preempted and re-queued)
  PREFILLING = "prefilling"  # admitted: a request slot and prompt pages; prompt chunks being computed
  DECODING = "decoding"  # prompt done; one token per decode step
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
  """One generation request and its results.

  Attributes:
    request_id: caller's id: unique among the engine's unfinished requests (``submit`` raises InvalidRequest for
      one in use; it is free again once its request has finished).
    prompt_ids: prompt token ids.
    max_new_tokens: tokens to generate at most (>= 1).
    on_token: called from the engine's thread with each new token id and the text it completes (a delta:
      "" while a character or a possible stop string is incomplete; the rest comes in ``text`` at the end).
    temperature / top_k / top_p / seed: sampling (``hisparse_jax.engine.sampling``); temperature 0 (default)
      is greedy, top_k 0 and top_p 1 disable those filters; seed None draws one at random.
    stop_token_ids: tokens that end the request besides the model's EOS ids (one int, Python's or numpy's: that token alone).
    stop: strings that end the request once the output text contains one (needs the engine's tokenizer);
      the returned text ends before the stop string unless include_stop_str_in_output. One str is one stop
      string (as vLLM's and OpenAI's ``stop``), not its characters.
    ignore_eos: keep generating past the model's EOS ids (benchmarks).
    output_ids: generated ids (new tokens only).
    text: the output text (with a tokenizer): complete once finished, truncated at a stop string.
    text_sent: characters of ``text`` already handed to on_token.
    finish_reason: None while running, then "stop" (EOS), "stop_token", "stop_string", "length", "abort", or
      "error": a kernel left the request's row unchanged (``error`` says why; the other requests go on), its
      on_token raised (the exception is logged and named in ``error``; the others go on), or ``Engine.reset()``
      dropped it. A Request runs once: submitting it again is an InvalidRequest.
    error: with finish_reason "error", the kernel's INVALID_ARGUMENT message (``ops.KernelStatusError``), or
      that ``Engine.reset()`` dropped it.
    matched_stop: the stop token id (as text) or stop string that matched.
    topk_trace: with ``Engine(record_topk=True)``, int32[L, K] top-k positions per decode step.
    hits / misses: swap-in hits and misses summed over layers and steps (HiSparse); layer_hits /
      layer_misses the same per layer. prefetched / layer_prefetched: the rows the cross-layer prefetch
      (``"prefetch": "next_layer"``) copied ahead of their layer's swap-in, likewise (a prefetched row the
      layer then needs counts as a hit, one it does not need is a wasted copy).
    num_preemptions: times the request was preempted (its KV freed and recomputed on re-admission) because
      memory ran out while it ran.
    arrival / first_token_time / finish_time: time.monotonic() stamps.
    prompt_kv: the prompt's KV computed elsewhere (a prefill server), (latent T[L, P, W], indexer keys
      I[L, P, Di]: the rows as its KV cache stores them, ``models/kv_format.py``) for positions 0..P-1 (P >=
      the prompt's tokens: a padded bucket; rows past the prompt are ignored), with its first generated token
      given as first_token: the engine writes them into its pools
      instead of prefilling, and continues decoding from there. With export_kv (a prefill server's request) the
      engine sets it instead, from its own pools, when the prompt's prefill ends.
    prefill_seconds / transfer_seconds / transfer_bytes: with prefill/decode disaggregation, the prefill
      server's time to the first token, the time to pull the prompt KV from it, and the bytes pulled.
    dp_group: the DP group (``--dp-size``) the request must run in, in [0, dp_size); None (the default): the
      scheduler's choice. A prefill server pins each request to the group whose devices hold room for its KV
      offer (the offer stays on that group's first device).
    client: who submitted it, for fair admission (the server's client identity; ``Engine`` docstring, step
      2): waiting requests are ordered so that each client's next request takes its turn with the others'.
      None (the default): one anonymous client, whose requests run in arrival order.
  """

  request_id: str
  prompt_ids: list[int]
  max_new_tokens: int
  on_token: Callable[[int, str], None] | None = None
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  stop_token_ids: frozenset[int] | tuple[int, ...] = ()
  stop: tuple[str, ...] = ()
  include_stop_str_in_output: bool = False
  ignore_eos: bool = False
  prompt_kv: tuple | None = None
  first_token: int | None = None
  export_kv: bool = False
  dp_group: int | None = None
  client: str | None = None
  prefill_seconds: float = 0.0
  transfer_seconds: float = 0.0
  transfer_bytes: int = 0
  output_ids: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  text_sent: int = 0
  finish_reason: str | None = None
  error: str = ""
  matched_stop: str = ""
  hits: int = 0
  misses: int = 0
  layer_hits: tuple[int, ...] = ()
  layer_misses: tuple[int, ...] = ()
  prefetched: int = 0
  layer_prefetched: tuple[int, ...] = ()
  topk_trace: list[np.ndarray] = dataclasses.field(default_factory=list)
  num_preemptions: int = 0
  times_passed: int = 0  # admissions of later requests while this one waited and did not fit
  arrival: float = 0.0
  first_token_time: float | None = None
  finish_time: float | None = None
  # Engine-owned state.
  phase: Phase = Phase.WAITING
  kv: object = None  # memory.backend.RequestKV while admitted
  prefill_ids: list[int] = dataclasses.field(default_factory=list)  # prompt (+ output after a preemption)
  prefilled: int = 0  # tokens of prefill_ids already in the KV
  fair_tag: int = 0  # its turn among the waiting requests (Engine.submit: start-time fair queueing)
  _detok: object = None
  _stops: object = None
  _submitted: bool = False  # set by Engine.submit: a Request runs once

  def __post_init__(self):
    if isinstance(self.stop, str):
      self.stop = (self.stop,)
    if isinstance(self.stop_token_ids, (int, np.integer)):
      self.stop_token_ids = (self.stop_token_ids,)

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def seq_len(self) -> int:
    """Tokens of the request so far: prompt + output."""
    return len(self.prompt_ids) + len(self.output_ids)
