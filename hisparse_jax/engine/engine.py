"""Decode engine: a continuous-batching scheduler over a KV backend (dense or HiSparse).

A request's life:
  1. ``submit`` validates it against sizes fixed at start-up (bad input -> ``InvalidRequest``; one that
     could never fit the pools -> ``ResourceExhausted``) and queues it (bounded queue).
  2. Each ``step()`` admits waiting requests in turn while the backend has a request slot and pages for the
     prompt (plus one growth page per decoding request that will still grow, so admission does not
     immediately force a preemption). The turn is arrival order among one client's requests
     (``Request.client``) and start-time fair queueing among clients: a client's request queues behind the
     requests of others submitted earlier but ahead of the client's own backlog, so one client's 300 queued
     requests do not delay another's one. When no slot is free and a waiting request's client holds none, the
     most recently admitted request of the client holding the most slots is preempted for it (one a step). A
     request that does not fit yet is passed by later ones
     that do, at most ``max_admission_skips`` times; after that nothing behind it is admitted until it is
     (no head-of-line blocking by one large request, no starvation of it either). An admitted request
     holds pages only for the tokens it has, growing as it decodes.
  3. Prefill: up to ``chunked_prefill_size`` prompt tokens per step, in chunks of the admitted prompts
     (those that end within a chunk first, then the others; oldest first within each), batched into one
     jitted call; a long prompt takes several steps, so running requests keep getting a token every step
     while it prefills, and a short prompt admitted meanwhile is prefilled at the next step. The chunk that
     ends a prompt samples its first token (and, in HiSparse mode, fills its hot buffer and frees its staging
     pages).
  4. Decode: one jitted step for the decoding requests, at a power-of-two batch bucket covering them
     (1, 2, 4, ... max_running_requests), each row naming its request's slot and page tables. A request
     that needs a new page grows by one; if memory ran out, the most recently admitted request (of its
     DP group) is preempted (its pages freed, re-queued at the front, recomputed on re-admission: vLLM's
     policy).
  5. A request finishes on an EOS id, a stop token or string, or max_new_tokens; its slot and pages go
     back to the free lists. Later calls that reuse them are ordered after every earlier call by the
     data dependencies of the donated KV state.

With data-parallel attention (--dp-size G > 1) each DP group has its own request slots and pools on its own
devices (memory/backend.py); a new request goes to the group with the most free slots that can take it, and
every batch is group-major: B / G rows per group, each group's bucket the power of two covering its largest
share (engine ``_batch_rows``).

``deterministic=True`` runs every decode step at the full max_running_requests batch with each request
in its own slot's row, and prefills one request per call in chunks at fixed offsets, so a request's
tokens never depend on what else runs (XLA's CPU matmuls are not batch-invariant: row results change by
~5e-5 between batch 1 and 2). Its cost is a full-batch step however few requests run.

Not thread-safe: one thread drives the engine (the gRPC server runs it in its own loop thread).
``validate`` reads only what is fixed at start-up, and ``loads()`` is published as a snapshot after
every step, so other threads may call ``validate`` and read ``loads_snapshot``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import numbers
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import distributed
from hisparse_jax.config import ConfigError, HiSparseConfig
from hisparse_jax.engine.args import DTYPES, EngineArgs, StartupError, check_host_memory
from hisparse_jax.engine.detokenizer import DetokenizerFactory, StopStringMatcher
from hisparse_jax.engine.model_runner import ModelRunner, pow2_at_least, pow2_at_most
from hisparse_jax.engine.request import InvalidRequest, Phase, Request, ResourceExhausted
from hisparse_jax.kernels import ops
from hisparse_jax.memory import backend as kvmem
from hisparse_jax.sharding import MeshError, bytes_per_device, placer
from models.convert import is_orbax_dir, load_model, model_fingerprint

log = logging.getLogger(__name__)


INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest normal float32: XLA:CPU flushes subnormals to 0.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _is_int(x) -> bool:
  """An integer (Python's or numpy's), not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


MIN_PREFILL_BUCKET = 16
# Request limits checked before any work (each bounds per-step work a client could otherwise inflate).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_STOP_TOKEN_IDS = 256


def check_stop_counts(stop_strings: int, stop_token_ids: int) -> None:
  """InvalidRequest if a request names more than MAX_STOP_STRINGS stop strings or MAX_STOP_TOKEN_IDS stop
  token ids (counts only: callable before the lists are copied; ``Engine.validate`` checks the values)."""
  if stop_strings > MAX_STOP_STRINGS:
    raise InvalidRequest(f"{stop_strings} stop strings; at most {MAX_STOP_STRINGS}")
  if stop_token_ids > MAX_STOP_TOKEN_IDS:
    raise InvalidRequest(f"{stop_token_ids} stop token ids; at most {MAX_STOP_TOKEN_IDS}")


@dataclasses.dataclass
class _Launched:
  """A decode call dispatched and not read yet: its rows (Request or None per row), the positions it feeds
  (int32[B], -1 idle) and its outputs (device arrays: (tokens int32[B], status int32[B]), the logits buffer or
  None, the top-k trace if recorded)."""

  order: list
  positions: np.ndarray
  out: tuple
  logits: jax.Array | None
  topk: list


class Engine:
  """Continuous-batching decoder over a dense or HiSparse KV backend (greedy by default, per-request sampling).

  Args:
    args: an ``EngineArgs``, or a model directory (then ``overrides`` are EngineArgs fields), or None (the
      embedded default model).
    hisparse: HiSparse sizes as an object (programmatic alternative to enable_hisparse + hisparse_config).
    tokenizer: a ``tokenizers.Tokenizer``; needed for text (stop strings, streamed text).
    record_topk: keep, in each ``Request.topk_trace``, the top-k positions of every layer at every decode
      step (int32[L, index_topk] per step; -1 padding) -- the indexer's real access trace, replayed by
      ``benchmarks/miss_rate.py --trace``. Costs a device->host copy per step.
    offer_kv_bytes: a prefill server's share of the device KV budget for the prompt KV it offers to decode servers
      (``serving/disaggregation.py``: copies outside the KV pools, on each DP group's first device, held until
      pulled; its ``--max-offered-kv-bytes``): the pools are sized from the rest, so pools and offers together
      stay within the budget. 0: half of the budget (a prompt's offer takes about the bytes its pages took). None (the
      default): nothing set aside (not a prefill server). Sets ``offer_kv_budget``; ``device_kv_budget`` is the
      pools' share.
    runner_class: the model runner's class (``ModelRunner``; scheduler tests pass a stand-in that runs no
      model: tests/fake_runner.py).
    overrides: EngineArgs fields.

  Raises:
    StartupError: a setting that cannot work (the message names the flag), an unreadable model.
  """

  def __init__(
    self,
    args: EngineArgs | str | None = None,
    *,
    hisparse: HiSparseConfig | None = None,
    tokenizer=None,
    record_topk: bool = False,
    offer_kv_bytes: int | None = None,
    runner_class=ModelRunner,
    **overrides,
  ):
    if offer_kv_bytes is not None and (not _is_int(offer_kv_bytes) or offer_kv_bytes < 0):
      raise StartupError(f"offer_kv_bytes (--max-offered-kv-bytes) must be an integer >= 0, got {offer_kv_bytes!r}")
    if not isinstance(args, EngineArgs):
      args = EngineArgs(model_path=args, **overrides)
    elif overrides:
      args = dataclasses.replace(args, **overrides)
    if hisparse is not None:
      if not isinstance(hisparse, HiSparseConfig):
        raise StartupError(
          f"hisparse= must be a HiSparseConfig (e.g. HiSparseConfig(top_k=2048)), got {type(hisparse).__name__}"
        )
      args = dataclasses.replace(args, enable_hisparse=True)
    args.validate()
    self.args = args
    self.host_pool = args.resolved_host_pool(jax.default_backend())  # "jax" or "extension"
    model_dir = args.model_dir()
    model_cfg = args.model_config(model_dir)
    self.hisparse = hisparse if hisparse is not None else args.resolve_hisparse(model_dir, model_cfg)
    if self.hisparse is not None and self.hisparse.top_k != model_cfg.index_topk:
      raise StartupError(
        f"hisparse top_k ({self.hisparse.top_k}) differs from the model's index_topk ({model_cfg.index_topk})"
      )
    if self.hisparse is not None:
      try:
        self.hisparse.check_model(model_cfg)
      except ConfigError as e:
        raise StartupError(str(e)) from None
    self.max_seq_len = args.resolve_max_seq_len(model_cfg)
    # The page tables (int32, a row of ceil(max_seq_len / page_size) per request slot and KV pool, at most three
    # pools) are the one host structure sized by max_seq_len: checked before anything is read or allocated.
    check_host_memory(
      3 * args.max_running_requests * -(-self.max_seq_len // args.page_size) * 4,
      f"--max-seq-len {self.max_seq_len}: the KV page table memory",
      "lower --max-seq-len (default: the model's max_position_embeddings) or --max-running-requests",
    )
    # Text prompts longer than this (UTF-8 bytes) are refused before tokenizing (see EngineArgs). A limit above
    # the most bytes a --max-seq-len context can hold would only let a client make the server tokenize a text
    # that cannot fit (a 200 MB line: 165 s and 15 GB), so it is refused here.
    self.max_prompt_bytes = args.resolve_max_prompt_bytes(self.max_seq_len, tokenizer)
    self.tokenizer = tokenizer
    self._detokenizers = DetokenizerFactory(tokenizer) if tokenizer is not None else None
    known = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else model_cfg.vocab_size
    if known < model_cfg.vocab_size:  # (a padded vocabulary has a few such ids; most of it missing is the wrong file)
      log.warning(
        "tokenizer.json knows %d token ids, the model's vocabulary has %d: ids %d to %d decode to no text",
        known,
        model_cfg.vocab_size,
        known,
        model_cfg.vocab_size - 1,
      )
    self.record_topk = record_topk
    # The mesh (hisparse_jax/sharding.py): one device, no mesh; several, parameters split by the rule table as
    # they load (no device holds the whole model), KV split over the DP groups.
    try:  # which model (other processes and servers compare)
      self.model_fingerprint = model_fingerprint(model_dir)
    except (OSError, ValueError) as e:
      raise StartupError(f"--model-path {model_dir!r}: cannot load the model: {type(e).__name__}: {e}") from None
    self.mesh_config = args.mesh_config()
    try:
      self.mesh_config.validate(model_cfg, len(jax.devices()), fp8_weights=args.weight_dtype == "fp8")
    except MeshError as e:
      raise StartupError(str(e)) from None
    if self.mesh_config.num_devices < len(jax.devices()):
      log.warning(
        "the mesh (--dp-size %d x --tp-size %d) uses %d of the %d devices; the others stay idle",
        self.mesh_config.dp_size,
        self.mesh_config.tp_size,
        self.mesh_config.num_devices,
        len(jax.devices()),
      )
    # Several processes (hisparse_jax/distributed.py): every process runs this engine on the schedule of
    # process 0; the mesh must cover every process's devices, and every process must have the same settings.
    self.lockstep = distributed.Lockstep() if jax.process_count() > 1 else None
    if self.lockstep is not None:
      if self.mesh_config.num_devices != len(jax.devices()):
        raise StartupError(
          f"--dp-size {self.mesh_config.dp_size} x --tp-size {self.mesh_config.tp_size} = "
          f"{self.mesh_config.num_devices} devices, but the {jax.process_count()} processes have "
          f"{len(jax.devices())}: with several processes the mesh covers every device"
        )
      settings = {k: v for k, v in dataclasses.asdict(args).items() if k != "model_path"}
      settings.update(record_topk=record_topk, model_fingerprint=self.model_fingerprint, **distributed.flags())
      distributed.check_same(settings)
    self._pending_ops: list = []  # leader: submits and aborts since the last step message
    self._pending_arrays: list = []
    self.mesh = self.mesh_config.make_mesh() if self.mesh_config.num_devices > 1 else None
    if args.dtype is None and model_cfg.dtype not in DTYPES:  # before any weight is read
      raise StartupError(
        f"--model-path {model_dir!r}: the checkpoint's dtype {model_cfg.dtype} is not a compute dtype "
        f"(one of {', '.join(DTYPES)}); pass --dtype bfloat16 or --dtype float32"
      )
    # Before any weight is read (the FP8 numerics and cache are applied at load; the config tells already).
    if (
      fp8_error := model_cfg.replace(
        fp8_numerics=bool(args.fp8_numerics), kv_cache_dtype=args.kv_cache_dtype
      ).fp8_indexer_error()
    ) is not None:
      raise StartupError(f"{fp8_error} ({model_dir})")
    if args.weight_dtype == "fp8" and model_cfg.fp8_block_size is None:
      raise StartupError(
        f"--weight-dtype fp8: {model_dir} is "
        + (
          "an orbax checkpoint, whose weights were dequantized when it was converted; FP8-resident weights load "
          "from the HF FP8 checkpoint"
          if is_orbax_dir(model_dir)
          else "not an FP8 block-quantized checkpoint (its config.json has no quantization_config; "
          "`python -m models.quantize_fp8` makes one from it)"
        )
      )
    try:
      self.config, model = load_model(
        model_dir,
        dtype=args.dtype,
        fp8_numerics=bool(args.fp8_numerics),
        kv_cache_dtype=args.kv_cache_dtype,
        sharding=None if self.mesh is None else placer(self.mesh_config, self.mesh),
        fp8_weights=args.weight_dtype == "fp8",
        top_k=ops.top_k,
        expert_parallel=None if self.mesh is None else self.mesh_config.expert_parallel(),
      )
    except MemoryError as e:
      raise StartupError(f"out of memory loading the model: {e}") from None
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is a start-up error
      raise StartupError(f"--model-path {model_dir!r}: cannot load the model: {type(e).__name__}: {e}") from None
    cfg = self.config
    self.dtype = jnp.dtype(args.dtype or cfg.dtype)
    self.eos_ids = frozenset(cfg.eos_token_ids)
    weight_bytes = bytes_per_device(self.mesh_config, nnx.state(model))  # what one device holds
    self.layout = kvmem.KVLayout.of(cfg, self.dtype)
    self.kv_dtype = cfg.kv_row(self.dtype)[1]  # a stored latent row's dtype (uint8 with --kv-cache-dtype fp8_e4m3)
    self.runner = runner_class(
      model,
      mesh=self.mesh,
      page_size=args.page_size,
      record_topk=record_topk,
      multiprocess=self.lockstep is not None,
      kv_dtype=self.kv_dtype,
      index_dtype=self.layout.index_dtype,
    )
    del model
    self.device_kv_budget = args.device_kv_budget(weight_bytes)  # (the pools' share: offer_kv_budget is not)
    self.offer_kv_budget = None
    if offer_kv_bytes is not None:
      self.offer_kv_budget = offer_kv_bytes or self.device_kv_budget // 2
      if self.offer_kv_budget >= self.device_kv_budget:
        raise StartupError(
          f"--max-offered-kv-bytes {offer_kv_bytes}: a prefill server's offers take their bytes "
          f"from the device KV budget ({self.device_kv_budget} bytes), which must keep some for its "
          "KV pools: lower it, or raise --max-device-kv-bytes / --mem-fraction-static"
        )
      self.device_kv_budget -= self.offer_kv_budget
    try:
      # One DP group's pools (each group's devices hold its own KV; one group without DP attention).
      self.groups = self.mesh_config.dp_size
      self.memory_plan = kvmem.plan(
        self.layout,
        budget=self.device_kv_budget,
        max_running_requests=args.max_running_requests // self.groups,
        max_seq_len=self.max_seq_len,
        page_size=args.page_size,
        hisparse=self.hisparse,
      )
    except kvmem.MemoryConfigError as e:
      raise StartupError(str(e)) from None
    # Each of this process's devices holds one group's pools (its group's block, replicated over tp).
    local_devices = 1 if self.mesh is None else len(self.mesh.local_devices)
    host_pool_bytes = 0
    if self.hisparse is not None:
      _, pages, per_page = self.memory_plan.pools["host"]
      host_pool_bytes = pages * per_page * local_devices
      check_host_memory(host_pool_bytes)
    if jax.local_devices()[0].platform == "cpu":  # CPU devices' KV is host memory too: all of it must fit
      check_host_memory(
        host_pool_bytes + self.memory_plan.device_bytes * local_devices,
        "the KV pools (on CPU devices, device KV is host memory)",
        "lower --max-device-kv-bytes, --max-seq-len or --max-running-requests",
      )
    if self.hisparse is not None:
      if self.memory_plan.request_slots * self.groups < args.max_running_requests:
        log.warning(
          "HiSparse: the device KV budget holds %d hot buffers per DP group; --max-running-requests %d lowered to %d",
          self.memory_plan.request_slots,
          args.max_running_requests,
          self.memory_plan.request_slots * self.groups,
        )
    self.page_size = args.page_size
    self.chunked_prefill_size = args.chunked_prefill_size
    self.deterministic = args.deterministic
    self.overlap_schedule = args.overlap_schedule
    self.max_queued_requests = args.max_queued_requests
    self.max_admission_skips = args.max_admission_skips
    self.num_offloads = 0  # dynamic residency: resident requests moved to their hot buffers
    self.residency_steps = collections.Counter()  # decode steps by batch residency (views.RESIDENCY)
    self._stepping = False  # inside step(): a second call (from an on_token callback) is refused
    self._interrupt = None  # an on_token's BaseException, raised when its step is complete
    self.reset()
    # Wall-clock split of step() (seconds, cumulative; each phase ends with its tokens on the host).
    self.prefill_seconds = 0.0
    self.decode_seconds = 0.0
    self.decode_steps = 0
    self.prefill_calls = 0
    self.last_decode_batch = 0  # rows of the last decode step (its batch bucket)

  # ----------------------------------------------------------------- state
  def reset(self) -> list[Request]:
    """Drops every request and starts from empty KV pools (after a failed step). Returns the requests it
    dropped (waiting first, then running, in order), each finished with finish_reason "error" and ``error``
    saying so; their pages and slots go with the old pools."""
    dropped = [*getattr(self, "waiting", ()), *getattr(self, "running", ())]  # none on the first call
    now = time.monotonic()
    for req in dropped:
      req.kv, req.phase, req.finish_time = None, Phase.FINISHED, now
      req.finish_reason, req.error = "error", "dropped by Engine.reset() (after a failed step)"
    self.runner.logits_buffers = {}
    self._next: _Launched | None = None  # overlap_schedule: the decode step launched ahead of its step()
    self.backend = self.runner.backend = None  # the old pools go before the new ones are allocated
    self.backend = self.runner.backend = (
      kvmem.DenseBackend(self.memory_plan, self.layout, self.kv_dtype, self.mesh, self.groups)
      if self.hisparse is None
      else kvmem.HiSparseBackend(
        self.memory_plan, self.layout, self.kv_dtype, self.hisparse, self.host_pool, self.mesh, self.groups
      )
    )
    R = self.backend.request_slots
    self.num_slots = R
    self.waiting: collections.deque[Request] = collections.deque()  # in fair_tag order (submit)
    self.running: list[Request] = []  # admitted, oldest first (prefilling or decoding)
    self._virtual_time = 0  # the largest fair_tag admitted so far
    self._client_tags: dict[str | None, int] = {}  # client -> its last submitted request's fair_tag
    # Per-slot sampling parameters (temperature, top_k, top_p, seed).
    self._temperature = np.zeros(R, np.float32)
    self._top_k = np.zeros(R, np.int32)
    self._top_p = np.ones(R, np.float32)
    self._seed = np.zeros(R, np.uint32)
    self.num_preemptions = 0
    self.num_fairness_preemptions = 0  # of num_preemptions, those for a client holding no slot
    self._step_failed = None  # what ended a step that did not complete (step() refuses to go on until reset())
    self._aborting: dict[str, None] = {}  # request ids an on_token callback aborted: applied after its step
    self._live: dict[str, Request] = {}  # request_id -> its submitted, unfinished request (ids are unique)
    self.loads_snapshot = self.loads()
    return dropped

  @property
  def external_pool(self):
    return getattr(self.backend, "external_pool", None)

  # -------------------------------------------------------------- requests
  def validate(self, req: Request) -> None:
    """Raises InvalidRequest / ResourceExhausted if req can never be served (reads only start-up sizes:
    callable from any thread)."""
    if not isinstance(req, Request):
      raise InvalidRequest(f"expected a Request, got {type(req).__name__}")
    if req._submitted:
      raise InvalidRequest(f"request {req.request_id!r} was already submitted (a Request runs once: submit a new one)")
    ids = req.prompt_ids
    if not (isinstance(ids, (list, tuple)) or getattr(ids, "ndim", None) == 1):
      raise InvalidRequest(
        f"prompt_ids must be a list of token ids (int), got {type(ids).__name__} (a text "
        "prompt is tokenized first: detokenizer.encode_prompt)"
      )
    bad = next((t for t in ids if not _is_int(t)), None)
    if bad is not None:
      raise InvalidRequest(f"prompt_ids must be token ids (int), got {bad!r}")
    n = len(req.prompt_ids)
    if n == 0:
      raise InvalidRequest("empty prompt")
    if not _is_int(req.max_new_tokens) or req.max_new_tokens <= 0:
      raise InvalidRequest(f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
    for name in ("temperature", "top_p"):
      if not isinstance(getattr(req, name), numbers.Real) or isinstance(getattr(req, name), bool):
        raise InvalidRequest(f"{name} must be a number, got {getattr(req, name)!r}")
      try:
        float(getattr(req, name))
      except OverflowError:  # (an int past a double: math.isfinite would raise below)
        raise InvalidRequest(f"{name} overflows float32") from None
    for name in ("ignore_eos", "include_stop_str_in_output"):
      if not isinstance(getattr(req, name), (bool, np.bool_)):  # ("no" would count as true)
        raise InvalidRequest(f"{name} must be True or False, got {getattr(req, name)!r}")
    if req.on_token is not None and not callable(req.on_token):
      raise InvalidRequest(f"on_token must be callable (token, text delta), got {type(req.on_token).__name__}")
    if not isinstance(req.request_id, str):
      raise InvalidRequest(f"request_id must be a string, got {type(req.request_id).__name__}")
    if not _is_int(req.top_k) or (req.seed is not None and not _is_int(req.seed)):
      raise InvalidRequest(f"top_k and seed must be integers, got {req.top_k!r} and {req.seed!r}")
    for name in ("stop", "stop_token_ids"):
      value = getattr(req, name)
      if not (isinstance(value, (list, tuple, set, frozenset)) or getattr(value, "ndim", None) == 1):
        raise InvalidRequest(f"{name} must be a list, got {type(value).__name__}")
    if not all(_is_int(t) for t in req.stop_token_ids):
      raise InvalidRequest("stop_token_ids must be token ids (int)")
    V = self.config.vocab_size
    bad = [t for t in req.prompt_ids if not 0 <= t < V]
    if bad:
      raise InvalidRequest(f"token id {bad[0]} outside the vocabulary [0, {V})")
    if n + req.max_new_tokens > self.max_seq_len:
      raise InvalidRequest(
        f"prompt ({n} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the model "
        f"context of {self.max_seq_len} tokens (--max-seq-len)"
      )
    why = self.backend.never_fits(n, n + req.max_new_tokens)
    if why is not None:
      raise ResourceExhausted(why)
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
      raise InvalidRequest(f"temperature must be >= 0, got {req.temperature}")
    if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
      raise InvalidRequest(f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_p < FLOAT32_TINY:
      raise InvalidRequest(
        f"top_p {req.top_p} is below float32's smallest normal ({FLOAT32_TINY:.3g}), which "
        "the sampler would flush to 0 (no filter); use a larger value"
      )
    if req.temperature > FLOAT32_MAX:
      raise InvalidRequest(f"temperature {req.temperature} overflows float32")
    if not 0 <= req.top_k <= INT32_MAX:
      raise InvalidRequest(f"top_k must be in [0, {INT32_MAX}], got {req.top_k}")
    if req.seed is not None and not 0 <= req.seed < 2**32:
      raise InvalidRequest(f"seed must be in [0, 2**32), got {req.seed}")
    check_stop_counts(len(req.stop), len(req.stop_token_ids))
    bad = [t for t in req.stop_token_ids if not 0 <= t < V]
    if bad:
      raise InvalidRequest(f"stop token id {bad[0]} outside the vocabulary")
    if any(not isinstance(x, str) or not x for x in req.stop):
      raise InvalidRequest("stop strings must be non-empty")
    long = [x for x in req.stop if len(x.encode("utf-8", "surrogatepass")) > MAX_STOP_STRING_BYTES]
    if long:
      raise InvalidRequest(
        f"a stop string of {len(long[0].encode('utf-8', 'surrogatepass'))} bytes; at most {MAX_STOP_STRING_BYTES}"
      )
    if any(0xD800 <= ord(c) <= 0xDFFF for x in req.stop for c in x):  # (decoded text never holds one)
      raise InvalidRequest("a stop string is not valid Unicode (a lone surrogate)")
    if req.stop and self.tokenizer is None:
      raise InvalidRequest("stop strings need a model with a tokenizer")
    if req.export_kv and self.lockstep is not None:  # (the followers would not run the export's program)
      raise InvalidRequest("export_kv (a prefill server's request) needs an engine of one process")
    if req.dp_group is not None and (not _is_int(req.dp_group) or not 0 <= req.dp_group < self.groups):
      raise InvalidRequest(f"dp_group must be None or a DP group in [0, {self.groups}), got {req.dp_group!r}")
    if req.client is not None and not (isinstance(req.client, str) and len(req.client) <= 1024):
      raise InvalidRequest(f"client must be None or a str of at most 1024 characters, got {type(req.client).__name__}")
    if req.output_ids or req.text or req.finish_reason is not None:
      raise InvalidRequest("output_ids, text and finish_reason are the engine's to fill: leave them empty")
    if req.prompt_kv is not None:
      cfg = self.config
      kv = req.prompt_kv
      if not (
        isinstance(kv, (tuple, list)) and len(kv) == 2 and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in kv)
      ):
        raise InvalidRequest(f"prompt_kv must be (latent, indexer keys): two arrays, got {type(kv).__name__}")
      latent, index = kv
      P = latent.shape[1] if len(latent.shape) == 3 else -1  # the prompt's tokens, or a padded bucket of them
      W, Di = self.layout.latent_dim, self.layout.index_dim  # the stored rows (--kv-cache-dtype)
      want = ((cfg.num_hidden_layers, P, W), (cfg.num_hidden_layers, P, Di))
      if (tuple(latent.shape), tuple(index.shape)) != want or P < n:
        raise InvalidRequest(
          f"prompt_kv shapes {tuple(latent.shape)}, {tuple(index.shape)}; expected "
          f"({cfg.num_hidden_layers}, P, {W}), ({cfg.num_hidden_layers}, P, "
          f"{Di}) with P >= the {n} prompt tokens (layers, positions, latent / "
          "indexer width)"
        )
      want = (np.dtype(self.kv_dtype), np.dtype(self.layout.index_dtype))
      if (np.dtype(latent.dtype), np.dtype(index.dtype)) != want:
        raise InvalidRequest(
          f"prompt_kv dtypes {latent.dtype}, {index.dtype}; expected {want[0]}, {want[1]} "
          "(the stored rows of this engine's --dtype and --kv-cache-dtype)"
        )
      if not _is_int(req.first_token) or not 0 <= req.first_token < V:
        raise InvalidRequest("a request with prompt_kv needs its first generated token (first_token) in the vocabulary")

  def submit(self, req: Request) -> None:
    """Validates and queues a request (RequestError if it can never be served or the queue is full).

    The queue bound counts the waiting requests beyond the free request slots: requests that arrive between
    two steps wait for the next step's admission even when slots are free, and up to that many of them take a
    slot there (a burst of max_running_requests + max_queued_requests on an idle engine is accepted whole)."""
    self.validate(req)
    other = self._live.get(req.request_id)
    if other is not None and other.phase is not Phase.FINISHED:  # (abort(id) and the caller's callbacks need one)
      raise InvalidRequest(f"request_id {req.request_id!r} is already in use by a request that has not finished")
    if self.max_queued_requests is not None and len(self.waiting) >= self.max_queued_requests + self.backend.free_slots:
      raise ResourceExhausted(
        f"queue full ({self.max_queued_requests} requests waiting beyond the "
        f"{self.backend.free_slots} free request slots)"
      )
    if req.seed is None:
      req.seed = int.from_bytes(os.urandom(4), "little")
    req._submitted = True
    req.stop_token_ids = frozenset(req.stop_token_ids)
    req.prompt_ids = list(req.prompt_ids)  # the engine's own copy: the caller's list may change after submit
    req.dp_group = None if req.dp_group is None else int(req.dp_group)  # (a numpy integer: a Python int)
    req.prefill_ids = list(req.prompt_ids)
    req.phase = Phase.WAITING
    req.arrival = req.arrival or time.monotonic()
    if self._detokenizers is not None:
      req._detok = self._detokenizers()
      req._stops = StopStringMatcher(req.stop, req.include_stop_str_in_output)
    self._live[req.request_id] = req
    self._enqueue(req)
    if self.lockstep is not None and self.lockstep.is_leader:  # the followers queue it with the next message
      self._pending_ops.append(["submit", _request_fields(req, self._pending_arrays)])

  def _enqueue(self, req: Request) -> None:
    """Queues a submitted request by its fair tag (start-time fair queueing, a request costing 2): its client's
    previous tag + 2, or, for a client with nothing waiting, the last admitted tag + 1, which puts it ahead of
    every backlog's next request; behind waiting requests of an equal or smaller tag (arrival order). With one
    client every tag is larger than all waiting ones: arrival order."""
    tag = max(self._virtual_time + 1, self._client_tags.get(req.client, -1) + 2)
    req.fair_tag = self._client_tags[req.client] = tag
    if len(self._client_tags) > 2 * len(self.waiting) + 64:  # (a client with nothing waiting starts anew)
      self._client_tags = {c: t for c, t in self._client_tags.items() if t >= self._virtual_time}
      self._client_tags[req.client] = tag
    i = len(self.waiting)
    while i and self.waiting[i - 1].fair_tag > tag:
      i -= 1
    self.waiting.insert(i, req)

  def _preempt_for_fairness(self) -> Request | None:
    """No slot free: the first waiting request whose client holds no slot (and can run in the victim's DP group)
    gets one from the client holding the most, if that client holds two or more: its most recently admitted
    request is preempted, the waiting one moves to the front and the preempted one right behind it. Returns the
    preempted request (not admitted again this step: a decode step launched ahead may hold its row, whose token
    must find it not decoding), or None."""
    held = collections.Counter(r.client for r in self.running)
    if not held:
      return None
    for i, req in enumerate(self.waiting):
      if held[req.client]:
        continue
      client, most = held.most_common(1)[0]
      if most < 2:
        return None
      victim = next(
        (
          r
          for r in reversed(self.running)
          if r.client == client and (req.dp_group is None or r.kv.group == req.dp_group)
        ),
        None,
      )
      if victim is None:
        return None
      log.info(
        "preempting request %s of client %s for a waiting request of client %s", victim.request_id, client, req.client
      )
      self._preempt(victim)  # (queued at the front, where req goes instead: the victim right behind it)
      self.num_fairness_preemptions += 1
      self.waiting.popleft()
      del self.waiting[i]
      self.waiting.extendleft((victim, req))
      self._drop_ended_next()
      return victim
    return None

  def has_work(self) -> bool:
    return bool(self.waiting) or bool(self.running)

  def abort(self, request_id: str) -> Request | None:
    """Stops a waiting or running request (finish_reason "abort") and returns it (None if unknown); ``step``
    does not return it again.

    Called between steps, or from an ``on_token`` callback: then it takes effect once that step is complete,
    since the step is still computing with the request (it may still get that step's token, without its own
    on_token call; its finish_reason is set, and it is released, then). A call may still be computing the
    request's row (with ``overlap_schedule``, the step launched ahead; its token for the request is dropped):
    whatever reuses its slot or pages later is ordered after every earlier call by the KV state's data
    dependencies.
    With several processes the leader tells the followers first (releasing a request reads its swap-in
    stats from the devices: every process must do that at the same point).
    """
    if self._stepping:
      req = next((r for r in (*self.waiting, *self.running) if r.request_id == request_id), None)
      if req is not None:
        self._aborting[request_id] = None
      return req
    if self.lockstep is not None and self.lockstep.is_leader:
      self._pending_ops.append(["abort", request_id])
      self._send("ops")
    for req in list(self.waiting):
      if req.request_id == request_id:
        self.waiting.remove(req)
        req.finish_reason, req.phase = "abort", Phase.FINISHED
        self._forget(req)
        self._publish()
        return req
    for req in self.running:
      if req.request_id == request_id:
        req.finish_reason = "abort"
        self._release(req)
        self._drop_ended_next()
        self._publish()
        return req
    return None

  def numerics_label(self) -> str:
    """The compute dtype, the weights' if FP8-resident, and how this engine stores and computes the KV, for the
    start-up and summary lines: ", bfloat16" then ", FP8 weights" (``--weight-dtype fp8``), then ", KV cache
    fp8_e4m3" (stored FP8, which implies the FP8 numerics), ", FP8 numerics" (simulated in the auto cache), or
    nothing."""
    label = f", {self.dtype.name}" + (", FP8 weights" if self.args.weight_dtype == "fp8" else "")
    if self.config.kv_cache_dtype != "auto":
      return f"{label}, KV cache {self.config.kv_cache_dtype}"
    return label + (", FP8 numerics" if self.config.fp8_numerics else "")

  def loads(self) -> dict:
    """Current load: requests, free request slots, and each KV pool's pages and bytes (call on the engine's
    thread; other threads read ``loads_snapshot``)."""
    pools = self.backend.usage()
    device = [p for p in pools if p.memory == "device"]
    host = [p for p in pools if p.memory == "host"]
    return dict(
      running=len(self.running),
      queued=len(self.waiting),
      free_lanes=self.backend.free_slots,
      device_kv_bytes_used=sum(p.bytes_used for p in device),
      device_kv_bytes_budget=sum(p.bytes_total for p in device),
      free_host_rows=sum(p.pages_free * p.page_size for p in host),
      host_rows_total=sum(p.pages_total * p.page_size for p in host),
      pools=[dataclasses.asdict(p) for p in pools],
      preemptions=self.num_preemptions,
      offloads=self.num_offloads,
      resident=sum(1 for r in self.running if r.kv is not None and r.kv.resident),
    )

  def _publish(self) -> None:
    self.loads_snapshot = self.loads()

  # ------------------------------------------------------------------ loop
  def step(self) -> list[Request]:
    """Admit, prefill (one chunk budget), decode one token for every decoding request. Returns the requests
    that finished. With several processes the leader first sends the followers this step's changes; a step
    that fails there ends the process (``distributed.Lockstep.lost``: the processes cannot recover
    together)."""
    if self._stepping:
      raise RuntimeError(
        "Engine.step() called inside a step (from an on_token callback?): submit or abort "
        "there, and step from the loop that drives the engine"
      )
    if self._step_failed is not None:
      raise RuntimeError(
        f"a previous step did not complete ({self._step_failed}): the engine's requests and KV "
        "pools may disagree; call Engine.reset() (it ends every request in flight) before stepping "
        "again"
      )
    self._stepping, self._interrupt = True, None
    try:
      if self.lockstep is None:
        finished = self._step()
      else:
        self._send("step")
        try:
          finished = self._step()
        except Exception as e:  # noqa: BLE001 - any failure leaves the processes out of step
          self.lockstep.lost(e)
    except BaseException as e:  # (a KeyboardInterrupt inside the step too: its state is half-updated)
      self._step_failed = type(e).__name__
      raise
    finally:
      self._stepping = False
    aborting, self._aborting = self._aborting, {}
    for request_id in aborting:  # aborted from on_token callbacks during the step: now, or ended in it anyway
      ended = next((r for r in finished if r.request_id == request_id), None)
      if ended is not None:
        finished.remove(ended)
        ended.finish_reason = "abort"
      else:
        self.abort(request_id)
    if self._interrupt is not None:  # an on_token's KeyboardInterrupt / SystemExit, after a consistent step
      interrupt, self._interrupt = self._interrupt, None
      raise interrupt
    return finished

  # ------------------------------------------------------------ processes
  def _send(self, kind: str) -> None:
    """Leader: one message to the followers with the changes since the last (kind "step", "ops", "idle",
    "stop") and the counters they check before stepping."""
    ops, arrays = self._pending_ops, self._pending_arrays
    self._pending_ops, self._pending_arrays = [], []
    try:
      self._settle()
      self.lockstep.publish(kind, ops, self._step_check(), arrays)
    except Exception as e:  # noqa: BLE001
      self.lockstep.lost(e)

  def _settle(self) -> None:
    """Waits for every call in flight (the decode step launched ahead among them) before a lock-step message.

    A message is a collective over every process's devices (``broadcast_one_to_all``), and on CPU two
    collectives of one process must never be in flight at once: XLA:CPU runs a program whose inputs are ready
    on the calling thread at once, even while one dispatched before it still runs on a worker thread, and
    XLA's gloo collectives all use one tag, so the other process may pair them the other way round. Measured
    without this wait (jax 0.12.1, 2 processes, tp 2): each process's message all-reduce, on its calling
    thread, and its step's all-gather, on a worker thread, both waited for data until killed; with jax 0.12.0,
    a stop message sent from another thread met a step's collective in the other order (gloo aborted the
    follower: "Received data size doesn't match expected size"). On a GPU the message's collective runs in
    stream order after the step anyway, so the wait costs nothing there. Raises the error of a call that
    failed."""
    self.runner.settle()

  def _step_check(self) -> list[int]:
    return [self.decode_steps, self.prefill_calls, len(self.running), len(self.waiting), self.num_preemptions]

  def idle(self) -> None:
    """Called by a leader's loop while it has nothing to do: a heartbeat message at most every
    ``distributed.IDLE_HEARTBEAT_S`` (a follower's collective never waits long; changes reach it)."""
    if self.lockstep is not None and self.lockstep.is_leader and self.lockstep.idle_due():
      self._send("idle")

  def close(self, error: str | None = None) -> None:
    """Leader: tells the followers to stop (their ``follow`` returns, or, with ``error``, raises
    ``DistributedError(error)``: process 0 is stopping on an error of its own, e.g. a port it cannot bind).
    Idempotent; nothing on one process.

    Like every message, the stop message first waits for the calls in flight (``_settle``). close() may run on
    another thread than the steps (the server's main thread, after its engine loop ended)."""
    if self.lockstep is not None and self.lockstep.is_leader and not self.lockstep.closed:
      if error is not None:
        self._pending_ops.append(["error", error])
      self._send("stop")

  def follow(self) -> int:
    """Follower: applies the leader's changes and takes its steps until it stops; returns the steps taken.
    Exits the process (``Lockstep.lost``) when the leader is gone or this engine fell out of step, and on
    SIGTERM / SIGINT (a follower cannot go on alone). Raises DistributedError when process 0 stopped on an
    error of its own (``close(error)``)."""
    if self.lockstep is None or self.lockstep.is_leader:
      raise RuntimeError("follow() is for processes other than process 0 of a multi-process engine")

    def stop(signum, _frame):  # (runs between two messages: at most IDLE_HEARTBEAT_S while process 0 idles)
      distributed.fatal(
        f"{signal.Signals(signum).name}: stopping; the other processes stop with this one (stop a "
        "deployment with SIGTERM or Ctrl-C to process 0)"
      )

    try:
      for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    except ValueError:  # not the main thread
      pass
    steps, stopped_with = 0, None
    while True:
      try:
        self._settle()
        msg, arrays = self.lockstep.receive()
      except Exception as e:  # noqa: BLE001
        self.lockstep.lost(e)
      try:
        for kind, item in msg["ops"]:
          if kind == "submit":
            self.submit(_request_from_fields(item, arrays))
          elif kind == "abort":
            self.abort(item)
          else:  # "error": process 0 stops on an error of its own
            stopped_with = item
        if msg["kind"] == "stop":
          break
        if msg["kind"] == "step":  # (the leader sends an abort before applying it: only a step is compared)
          if self._step_check() != msg["check"]:
            raise distributed.DistributedError(
              f"out of step with process 0: (decode steps, prefill calls, running, waiting, preemptions) "
              f"{self._step_check()} here, {msg['check']} there"
            )
          self._step()
          steps += 1
      except Exception as e:  # noqa: BLE001
        self.lockstep.lost(e)
    if stopped_with is not None:
      raise distributed.DistributedError(stopped_with)
    return steps

  def _step(self) -> list[Request]:
    finished: list[Request] = []
    t0 = time.perf_counter()
    self._admit()
    self._prefill(finished)
    t1 = time.perf_counter()
    self.prefill_seconds += t1 - t0
    if self._decode(finished):
      self.decode_seconds += time.perf_counter() - t1
    self._drop_ended_next()
    self._publish()
    return finished

  def run(self) -> None:
    """Steps until every submitted request has finished."""
    while self.has_work():
      self.step()

  def _decoding(self) -> list[Request]:
    return [r for r in self.running if r.phase is Phase.DECODING]

  def _admit(self) -> None:
    """Admits waiting requests in arrival order; one that does not fit is passed by later ones that do, until
    it has been passed max_admission_skips times (then admission waits for it)."""
    # One growth page per decoding request that will still grow (admission should not force a preemption).
    # (Per DP group: each group's requests grow in its own pools.)
    reserve = [0] * self.groups
    for r in self._decoding():
      reserve[r.kv.group] += self.backend.will_grow(r.kv, len(r.prompt_ids) + r.max_new_tokens)
    # Prompt-only pages the resident requests hold, per group: offloading them frees them for a prompt.
    reclaimable = self.backend.reclaimable_pages(r.kv for r in self.running if r.kv.resident)
    # Requests ahead of waiting[i] that did not fit this step, each with the admissions counted when it was
    # passed over; `lead` is the most times one of them had been passed before, less that count. Times are
    # added at the end, so a step costs O(waiting + running), whatever it admits.
    victim = self._preempt_for_fairness() if not self.backend.free_slots and self.waiting else None
    i, admitted, blocked, lead = 0, 0, [], -1
    try:
      while i < len(self.waiting) and self.backend.free_slots:
        if lead + admitted >= self.max_admission_skips:
          return  # one ahead has been passed often enough: nothing behind it goes ahead of it any more
        req = self.waiting[i]
        if req is victim:
          i += 1
          continue
        prefill = req.prompt_kv is None
        group = self.backend.pick_group(len(req.prefill_ids), reserve, prefill, reclaimable, only=req.dp_group)
        if group is None:
          blocked.append((req, admitted))
          lead = max(lead, req.times_passed - admitted)
          i += 1
          continue
        del self.waiting[i]
        admitted += 1
        self._virtual_time = max(self._virtual_time, req.fair_tag)
        if prefill and self.backend.residency_on:
          self._reclaim_staging(group, len(req.prefill_ids), reclaimable[group])
        req.kv = self.backend.admit(len(req.prefill_ids), prefill=prefill, group=group)
        req.phase, req.prefilled = Phase.PREFILLING, 0
        s = req.kv.slot
        self._temperature[s], self._top_k[s], self._top_p[s], self._seed[s] = (
          req.temperature,
          req.top_k,
          req.top_p,
          req.seed,
        )
        self.running.append(req)
    finally:
      for r, seen in blocked:
        r.times_passed += admitted - seen

  # ------------------------------------------------------ dynamic residency
  def _reclaim_staging(self, group: int, tokens: int, reclaimable: dict[str, int]) -> None:
    """Offloads `group`'s resident requests, the most recently admitted first, until a prompt of `tokens`
    tokens finds its staging pages free; takes the pages it frees off `reclaimable` (pool name -> pages that
    `group`'s resident requests hold, as ``backend.reclaimable_pages``)."""
    need = -(-tokens // self.page_size)
    for req in reversed(self.running):
      if self.backend.free_pages("staging", group) >= need:
        return
      if req.kv.resident and req.kv.group == group:
        for name in reclaimable:
          reclaimable[name] -= len(req.kv.pages.get(name, ()))
        self._offload(req)

  def _offload(self, req: Request) -> None:
    """Moves a resident request to its hot buffer (``HiSparseState.offload``) and frees its staging pages."""
    self.runner.offload(self.runner.put_tables(self.backend.offload_tables(req.kv)))
    self.backend.offloaded(req.kv)
    self.num_offloads += 1
    log.info("offloading request %s (%d tokens) to its hot buffer", req.request_id, req.seq_len)

  def _sampling(self, slots) -> tuple:
    idx = np.asarray(slots, np.int64)
    return (
      self.runner.put(self._temperature[idx]),
      self.runner.put(self._top_k[idx]),
      self.runner.put(self._top_p[idx]),
      self.runner.put(self._seed[idx]),
    )

  # --------------------------------------------------------------- prefill
  def _prefill(self, finished: list[Request]) -> None:
    """Computes up to chunked_prefill_size prompt tokens of the admitted prompts: one batched call, or
    (deterministic) one call per request with chunks at fixed offsets of its prompt.

    Prompts whose rest fits in one chunk go first, then the longer ones, each kind oldest first: a short prompt
    that arrives while a long one prefills gets its first token at the next step, not after the whole long
    prefill (a 60k-token prompt held every later request's first token for over a minute on this CPU), and the
    long one still computes a chunk every step, shortened to what the call's bucket leaves (vLLM's
    partial-prefill limits serve the same end)."""
    for req in [r for r in self.running if r.phase is Phase.PREFILLING and r.prompt_kv is not None]:
      self._import_kv(req, finished)
    budget, rows, longest, per_group = self.chunked_prefill_size, [], 0, collections.Counter()
    prefilling = [r for r in self.running if r.phase is Phase.PREFILLING]
    prefilling.sort(key=lambda r: len(r.prefill_ids) - r.prefilled > self.chunked_prefill_size)  # stable
    for req in prefilling:
      n = min(len(req.prefill_ids) - req.prefilled, self.chunked_prefill_size)
      if self.deterministic and n > budget:
        break  # a partial chunk would move its chunk boundaries: it waits for the next step
      n = min(n, budget)
      if n <= 0:
        break
      if rows and not self.deterministic:
        # The call computes a padded [B, C] bucket (_prefill_call): a row that would grow it past the chunk
        # budget waits for the next step (17 prompts of 120 tokens would take 32 x 128 slots, 16 take 2048),
        # or, a prompt longer than a chunk, computes a shorter chunk that fits. A row the bucket already holds
        # (another DP group's padding row) costs nothing and goes.
        fullest = max(per_group.values())
        cap = max(self._prefill_bucket(fullest, longest), self.chunked_prefill_size)
        rows_after = max(fullest, per_group[req.kv.group] + 1)
        if len(req.prefill_ids) - req.prefilled > self.chunked_prefill_size:
          while n > longest and self._prefill_bucket(rows_after, n) > cap:
            n = pow2_at_most(n - 1)
        if self._prefill_bucket(rows_after, max(longest, n)) > cap:
          break
      rows.append((req, n))
      budget -= n
      longest = max(longest, n)
      per_group[req.kv.group] += 1
    if self.deterministic:
      for row in rows:
        self._prefill_call([row], finished)
    elif rows:
      self._prefill_call(rows, finished)

  def _prefill_width(self, longest: int) -> int:
    """C, the token columns of a (non-deterministic) prefill call whose longest row computes `longest` tokens."""
    return min(max(MIN_PREFILL_BUCKET, pow2_at_least(longest)), self.chunked_prefill_size)

  def _prefill_bucket(self, fullest: int, longest: int) -> int:
    """Token slots B x C of a prefill call whose fullest DP group has `fullest` rows (B as ``_batch_rows``
    makes it) and whose longest row computes `longest` tokens."""
    return self.groups * pow2_at_least(fullest) * self._prefill_width(longest)

  def _prefill_call(self, rows, finished) -> None:
    """One jitted prefill call over rows [(request, tokens of its prompt to compute now)]."""
    longest = max(n for _, n in rows)
    C = self.chunked_prefill_size if self.deterministic else self._prefill_width(longest)
    order, B = self._batch_rows([req for req, _ in rows], 1 if self.deterministic else None)
    tokens = np.zeros((B, C), np.int32)
    positions = np.full((B, C), -1, np.int32)
    kvs, finishing, slots = [None] * B, [False] * B, [0] * B
    for b, (req, n) in zip(order, rows):
      start = req.prefilled
      tokens[b, :n] = req.prefill_ids[start : start + n]
      positions[b, :n] = np.arange(start, start + n)
      kvs[b], finishing[b], slots[b] = req.kv, start + n == len(req.prefill_ids), req.kv.slot
    out = self.runner.prefill(
      tokens,
      positions,
      self.runner.put_tables(self.backend.prefill_tables(kvs, finishing)),
      self._sampling(slots),
      first_token=any(finishing),
      query_block=self.runner.query_block(B, C),
      blocks=self.runner.index_blocks(B, C, int(positions.max())),
    )
    self.prefill_calls += 1
    out, status = jax.device_get(out)
    for b, (req, n) in zip(order, rows):
      if status[b]:
        self._fail(req, "prefill (backup)", b, status[b], finished)
        continue
      req.prefilled += n
      if finishing[b]:
        if req.export_kv:
          self._export_kv(req)
        self.backend.prefill_finished(req.kv)
        req.phase = Phase.DECODING
        self._emit(req, int(out[b]), finished)

  def export_positions(self, prompt_tokens: int) -> int:
    """Positions P of an exported prompt KV (``_export_kv``): the power of two, at least the page size, covering
    the prompt (one compiled read per P)."""
    return max(self.page_size, pow2_at_least(prompt_tokens))

  def _export_kv(self, req: Request) -> None:
    """A prefill server's output: the request's prompt KV, read from its pages before they are freed, into
    ``req.prompt_kv`` = (latent T[L, P, W], indexer keys I[L, P, Di]: the stored rows) on one device, P the power
    of two (>= the page size) covering the prompt (one compiled read per P; zeros past the prompt), on the first
    device of the request's DP group (``ModelRunner.group_device``)."""
    n = len(req.prefill_ids)
    size = self.export_positions(n)
    kvs = self.backend.group_rows(req.kv)  # one row per DP group: the request's group reads, the others idle
    tables = self.runner.put_tables(self.backend.prefill_tables(kvs, [False] * self.groups))
    req.prompt_kv = self.runner.export_kv(tables, n, size, req.kv.group)

  def _import_kv(self, req: Request, finished: list[Request]) -> None:
    """Writes a request's prompt KV computed elsewhere into its pages (the same views, hence the same
    layout, as a prefill) and emits its given first token."""
    kvs = self.backend.group_rows(req.kv)  # one row per DP group: the request's group writes, the others idle
    tables = self.runner.put_tables(self.backend.decode_tables(kvs))
    status = self.runner.import_kv(tables, *req.prompt_kv, len(req.prompt_ids))  # (read once per imported prompt)
    req.prompt_kv = None  # the arrays are in the pools now
    if status.any():
      self._fail(req, "import (backup)", int(np.flatnonzero(status)[0]), status.max(), finished)
      return
    req.prefilled = len(req.prompt_ids)
    req.phase = Phase.DECODING
    self._emit(req, int(req.first_token), finished)

  # ---------------------------------------------------------------- decode
  def _decode(self, finished: list[Request]) -> bool:
    """One decode step for every decoding request; False if there was none.

    With ``overlap_schedule`` the step may already be running: the previous step launched it (``_launch_next``)
    before reading its own tokens. Requests that started decoding since (their prefill ended this step) are
    not in it and join the next step."""
    launched, self._next = self._next, None  # (one whose every row ended was dropped: _drop_ended_next)
    if launched is None:
      for req in self._decoding():
        # The token to feed sits at position seq_len - 1: its page must exist.
        while req.phase is Phase.DECODING and not self.backend.ensure(req.kv, req.seq_len):
          # The most recently admitted request of its DP group (only that group's pools can free pages for it).
          self._preempt(next(r for r in reversed(self.running) if r.kv.group == req.kv.group))
      for req in self._decoding():
        # A resident request's newest token needs a staging page too; if none is free it leaves residency.
        if req.kv.resident and not self.backend.grow_resident(req.kv, req.seq_len):
          self._offload(req)
      rows = self._decoding()
      if not rows:
        return False
      order = self._decode_order(rows)
      B = len(order)
      tokens = np.zeros(B, np.int32)
      positions = np.full(B, -1, np.int32)
      for b, req in enumerate(order):
        if req is not None:
          tokens[b], positions[b] = req.output_ids[-1], req.seq_len - 1
      # Committed, as the tokens of a step launched ahead (``_launch_next``) are: one compiled program for both.
      launched = self._launch(order, self.runner.put(tokens, commit=True), positions, self.runner.logits_buffer(B))
    if self.overlap_schedule:
      self._next = self._launch_next(launched)
    self._read(launched, finished)
    return True

  def _decode_order(self, rows: list[Request]) -> list[Request | None]:
    """The batch of a decode step over ``rows``: the request in each row (None: an idle row), B = the batch
    bucket (``_batch_rows`` with the bucket capped at a group's slots; by slot when deterministic)."""
    rows_of, B = self._batch_rows(rows, cap=True, by_slot=self.deterministic)
    order = [None] * B
    for b, req in zip(rows_of, rows):
      order[b] = req
    return order

  def _launch(self, order: list, tokens, positions: np.ndarray, logits_buffer) -> _Launched:
    """Dispatches one decode call over rows ``order`` (Request, or None for an idle row) feeding ``tokens``
    (int32[B], host or device) at ``positions`` (int32[B], -1 idle); returns without waiting for it."""
    B = len(order)
    kvs = [None if r is None else r.kv for r in order]
    slots = [0 if r is None else r.kv.slot for r in order]
    blocks = self.runner.index_blocks(B, 1, int(positions.max()))
    # Every position the step reads or writes is inside its indexer window: the tables cover that window's
    # pages, not max_seq_len's (host work and transfer follow the batch's lengths; one shape per window).
    tables = self.runner.put_tables(self.backend.decode_tables(kvs, pages=-(-blocks["window"] // self.page_size)))
    residency = self.backend.residency(kvs)
    self.residency_steps[residency] += 1
    out, logits, topk = self.runner.decode(
      tokens, positions, tables, self._sampling(slots), logits_buffer, residency=residency, blocks=blocks
    )
    self.decode_steps += 1
    self.last_decode_batch = B
    return _Launched(order, positions, out, logits, topk)

  def _launch_next(self, launched: _Launched) -> _Launched | None:
    """``overlap_schedule``: launches the step after ``launched`` before launched's tokens are read, so that
    reading and delivering them (and this scheduling) overlap the device's compute. Its rows are what the next
    step would decode: every decoding request but those that launched's token ends by their length limit, in
    the rows ``_batch_rows`` gives them; a request in launched is fed launched's token for it on the device
    (``ModelRunner.merge_tokens``), one that started decoding since its last token from the host. A request that launched's
    token ends otherwise (stop token, stop string, kernel error) or that is aborted before the read computes a
    token that is dropped.

    None (the next step is scheduled after the read, as without overlap) where a row's next token needs a page
    that is not free (preemption) or a resident row's staging page that is not (offload), or with a recorded
    top-k trace."""
    if self.record_topk:
      return None
    src = {id(req): b for b, req in enumerate(launched.order) if self._alive(req)}
    rows = [req for req in self._decoding() if not (id(req) in src and len(req.output_ids) + 1 >= req.max_new_tokens)]
    if not rows:
      return None
    for req in rows:
      end = req.seq_len + 1 if id(req) in src else req.seq_len  # the fed token's position + 1
      if not self.backend.ensure(req.kv, end) or (req.kv.resident and not self.backend.grow_resident(req.kv, end)):
        return None  # (pages taken so far stay with their request: its next step needs them anyway)
    order = self._decode_order(rows)
    B = len(order)
    positions = np.full(B, -1, np.int32)
    from_launched = np.full(B, -1, np.int32)  # the row of launched whose token a row feeds (-1: host_tokens)
    host_tokens = np.zeros(B, np.int32)
    for b, req in enumerate(order):
      if req is None:
        continue
      if id(req) in src:
        from_launched[b], positions[b] = src[id(req)], req.seq_len
      else:
        host_tokens[b], positions[b] = req.output_ids[-1], req.seq_len - 1
    same_bucket = B == len(launched.order)
    if same_bucket and all(from_launched[b] == b for b in range(B) if order[b] is not None):
      tokens = launched.out[0]  # every row where it was (an idle row's token is not read): nothing to merge
    else:
      tokens = self.runner.merge_tokens(launched.out[0], from_launched, host_tokens)
    logits_buffer = launched.logits if same_bucket and launched.logits is not None else self.runner.logits_buffer(B)
    return self._launch(order, tokens, positions, logits_buffer)

  @staticmethod
  def _alive(req: Request | None) -> bool:
    return req is not None and req.phase is Phase.DECODING

  def _drop_ended_next(self) -> None:
    """Forgets a call launched ahead whose every row has ended (stop token, abort): nothing of it will be read,
    and an idle engine should not hold its requests and logits buffer. Its KV state is the engine's already."""
    if self._next is not None and not any(self._alive(req) for req in self._next.order):
      self._next = None

  def _read(self, launched: _Launched, finished: list[Request]) -> None:
    """Waits for a launched decode step and delivers its tokens (rows whose request ended since are dropped)."""
    out, status = jax.device_get(launched.out)
    self.runner.keep_logits_buffer(len(launched.order), launched.logits)  # (the step is known to have run)
    if launched.topk:
      trace = np.asarray(launched.topk[0])  # [L, B, K]
      for b, req in enumerate(launched.order):
        if self._alive(req) and not status[b]:
          req.topk_trace.append(trace[:, b])
    for b, req in enumerate(launched.order):
      if not self._alive(req):
        continue
      if status[b]:
        self._fail(req, "decode (swap-in / backup)", b, status[b], finished)
      else:
        self._emit(req, int(out[b]), finished)

  def _fail(self, req: Request, where: str, row: int, code: int, finished: list[Request]) -> None:
    """Ends a request whose batch row a kernel left unchanged (finish_reason "error"); the others go on."""
    req.error = str(ops.KernelStatusError(where, [row], [int(code)]))
    log.error("request %s failed: %s", req.request_id, req.error)
    req.finish_reason = "error"
    self._release(req)
    finished.append(req)

  def _batch_rows(
    self, reqs, per_group: int | None = None, cap: bool = False, by_slot: bool = False
  ) -> tuple[list[int], int]:
    """(row of each request, batch size B) of a batch. Rows are group-major: B / groups rows per DP group,
    each request in its own group's rows, in order. per_group None: the power of two covering the largest
    group (with cap, at most the request slots of a group). by_slot (deterministic decode): every slot has
    a row and each request sits at its own slot's (slots are numbered group-major)."""
    if by_slot:
      return [r.kv.slot for r in reqs], self.backend.request_slots
    if per_group is None:
      per_group = pow2_at_least(max(collections.Counter(r.kv.group for r in reqs).values()))
      if cap:
        per_group = min(per_group, self.backend.slots_per_group)
    seen = collections.Counter()
    rows = []
    for r in reqs:
      rows.append(r.kv.group * per_group + seen[r.kv.group])
      seen[r.kv.group] += 1
    return rows, self.groups * per_group

  def _preempt(self, req: Request) -> None:
    """Frees req's KV and re-queues it at the front; on re-admission it prefills prompt + output so far and
    continues (its next token comes from that prefill)."""
    log.info("preempting request %s (%d tokens) to free KV pages", req.request_id, req.seq_len)
    if req.phase is Phase.DECODING:
      self._collect_swap_stats(req)
    self.backend.release(req.kv)
    self.running.remove(req)
    req.kv, req.phase, req.prefilled = None, Phase.WAITING, 0
    req.prefill_ids = list(req.prompt_ids) + list(req.output_ids)
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(req)

  # -------------------------------------------------------------- tokens out
  def _emit(self, req: Request, token: int, finished: list[Request]) -> None:
    req.output_ids.append(token)
    if req.first_token_time is None:
      req.first_token_time = time.monotonic()
    delta, hit = "", None
    if req._detok is not None:
      delta, hit = req._stops.feed(req._detok.push(token))
    # A stop string completed by this token wins over the token itself being an end: the text is cut there.
    if hit is not None:
      req.finish_reason, req.matched_stop = "stop_string", hit
    elif token in self.eos_ids and not req.ignore_eos:
      req.finish_reason = "stop"
    elif token in req.stop_token_ids:
      req.finish_reason, req.matched_stop = "stop_token", str(token)
    elif len(req.output_ids) >= req.max_new_tokens:
      req.finish_reason = "length"
    if req._detok is not None:
      if req.done and hit is None:  # the end of the text: an incomplete trailing character comes out too
        tail, hit = req._stops.feed(req._detok.flush())
        delta += tail + req._stops.finish()
        if hit is not None:  # completed by that last character
          req.finish_reason, req.matched_stop = "stop_string", hit
      req.text = req._stops.text
    if req.on_token is not None and req.request_id not in self._aborting:  # (not after an abort in this step)
      try:
        req.on_token(token, delta)
      except BaseException as e:  # noqa: BLE001 - a caller's callback fails its own request, not the batch
        log.exception("request %r: on_token raised; the request ends with an error", req.request_id)
        req.finish_reason, req.error = "error", f"on_token raised {type(e).__name__}: {e}"
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: raised once the step is complete
          self._interrupt = self._interrupt or e
    req.text_sent += len(delta)
    if req.done:
      self._release(req)
      finished.append(req)

  def _collect_swap_stats(self, req: Request) -> None:
    stats = self.backend.swap_stats(req.kv)
    if stats is not None:
      if req.layer_hits:  # a preempted request adds its earlier admissions' counts
        stats = tuple(
          tuple(a + b for a, b in zip(old, new))
          for old, new in zip((req.layer_hits, req.layer_misses, req.layer_prefetched), stats)
        )
      req.layer_hits, req.layer_misses, req.layer_prefetched = stats
      req.hits, req.misses, req.prefetched = (sum(s) for s in stats)

  def _release(self, req: Request) -> None:
    if req.kv is not None:
      if req.phase is Phase.DECODING:  # a prefilling request's slot stats are not its own yet
        self._collect_swap_stats(req)
      self.backend.release(req.kv)
      self._temperature[req.kv.slot] = 0.0
      req.kv = None
    if req in self.running:
      self.running.remove(req)
    req.phase = Phase.FINISHED
    req.finish_time = time.monotonic()
    self._forget(req)

  def _forget(self, req: Request) -> None:
    """Frees req's request_id for a new request (req has finished)."""
    if self._live.get(req.request_id) is req:
      del self._live[req.request_id]


# Request fields a follower process needs to schedule it as the leader does (hisparse_jax/distributed.py).
_SHARED_FIELDS = (
  "request_id",
  "prompt_ids",
  "max_new_tokens",
  "temperature",
  "top_k",
  "top_p",
  "seed",
  "stop_token_ids",
  "stop",
  "include_stop_str_in_output",
  "ignore_eos",
  "first_token",
  "dp_group",
  "client",
)


def _request_fields(req: Request, arrays: list) -> dict:
  """The JSON-able fields of a submitted request (its prompt KV, if any, appended to ``arrays``)."""
  out = {f: getattr(req, f) for f in _SHARED_FIELDS}
  out["prompt_ids"] = [int(t) for t in req.prompt_ids]
  out["stop_token_ids"] = sorted(int(t) for t in req.stop_token_ids)
  out["stop"] = list(req.stop)
  if req.prompt_kv is not None:
    out["prompt_kv"] = [len(arrays), len(arrays) + 1]
    arrays.extend(np.asarray(a) for a in req.prompt_kv)
  return out


def _request_from_fields(fields: dict, arrays: list) -> Request:
  kv = fields.pop("prompt_kv", None)
  req = Request(**fields)
  req.stop = tuple(req.stop)
  if kv is not None:
    req.prompt_kv = (arrays[kv[0]], arrays[kv[1]])
  return req
