"""The model runner: everything the engine runs on the devices, and nothing it decides.

``ModelRunner`` owns the model's weights, the mesh, the jitted programs, the decode step's logits buffer and the
host -> device transfers of their operands, and it replaces the KV backend's device state (``backend.state``,
donated to every program that writes the KV) with what each program returns. The engine (the scheduler) picks
the rows, builds their page tables and sampling parameters on the host, and calls:

  prefill       a chunk of prompt rows: KV written, the first token sampled where a prompt ends
  decode        one token per row (dispatched without waiting: the engine reads its tokens later)
  import_kv     a prompt's KV computed elsewhere written into a request's pages
  export_kv     a request's prompt KV read out of its pages
  offload       resident requests moved to their hot buffers (dynamic residency)
  merge_tokens  the tokens of a step launched ahead, from the step before it and the host (overlap schedule)

One program is compiled per operand shape: a batch bucket, a prefill bucket, an indexer window (``index_blocks``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hisparse_jax.engine.sampling import sample
from hisparse_jax.memory.views import kernel_status

# Decode batches up to this many rows take their logits vocabulary-major ([vocab, batch]) on one CPU device:
# XLA:CPU's output projection runs 15-20% faster with that output layout at 2-64 rows, equal at 1, 2-5% slower
# at 128-256 (benchmarks/step_floor.py's GEMM columns), and greedy rows take the argmax over columns.
VOCAB_MAJOR_MAX_BATCH = 64
# Indexer windows (keys scored) are powers of two covering the newest position, at least this: one compiled
# step per window bucket, at most 2x the keys a step needs.
MIN_INDEX_WINDOW = 256
# Indexer keys read and scored at a time (tokens): bounds the [B, Q, heads, key block] intermediate.
MAX_KEY_BLOCK = 2048
INDEX_HEAD_ELEMENTS = 1 << 24
# Scores kept before a top-k ([B, Q, score block] float32, 64 MiB): one top-k over the whole window when it
# fits, else a running top-k merged once per score block. This bounds a prefill chunk's transient memory
# whatever the context (measured: ~38 KB per window token below the bound, from the score buffers XLA
# keeps); a merge costs a top-k over K + block elements, so larger blocks mean fewer, cheaper-per-key merges.
SCORE_ELEMENTS = 1 << 24
# Bound on the rows a prefill attention block gathers (bytes of [B, query block, K, W]).
PREFILL_GATHER_BYTES = 1 << 26


def pow2_at_least(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def pow2_at_most(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def index_blocks(batch: int, queries: int, newest: int, *, heads: int, top_k: int, page_size: int) -> dict:
  """Static indexer sizes of a call of `batch` rows x `queries` tokens whose newest position is `newest`:
  window (a power of two > newest, >= MIN_INDEX_WINDOW), key_block and score_block (powers of two within
  the window bounding the intermediates by INDEX_HEAD_ELEMENTS and SCORE_ELEMENTS; whole pages)."""
  window = max(MIN_INDEX_WINDOW, page_size, pow2_at_least(newest + 1))
  key_block = min(window, MAX_KEY_BLOCK, max(page_size, pow2_at_most(INDEX_HEAD_ELEMENTS // (batch * queries * heads))))
  score_block = max(key_block, pow2_at_least(top_k), pow2_at_most(SCORE_ELEMENTS // (batch * queries)))
  return dict(window=window, key_block=key_block, score_block=None if score_block >= window else score_block)


class ModelRunner:
  """Runs the model's programs on the engine's devices.

  Args:
    model: the loaded model (``models.deepseek_v32.DeepseekV32ForCausalLM``; its weights on the mesh already).
    mesh: the serving mesh, or None on one device.
    page_size: tokens per KV page (indexer key blocks are whole pages).
    record_topk: the decode program also returns every layer's top-k positions (int32[L, B, index_topk]).
    multiprocess: several processes run the same programs (operands always come from host copies).
    kv_dtype, index_dtype: how a stored latent row and indexer key are held (``--kv-cache-dtype``).

  ``backend`` (set by the engine, and again on each ``Engine.reset``) is the KV backend whose device state the
  programs update.
  """

  def __init__(self, model, *, mesh, page_size: int, record_topk: bool, multiprocess: bool, kv_dtype, index_dtype):
    self.config = model.config
    self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
    self.dtype = model.dtype
    self.mesh = mesh
    self.page_size = page_size
    self.multiprocess = multiprocess
    self.backend = None
    self.logits_buffers: dict[int, jax.Array] = {}
    graphdef, params = nnx.split(model)
    # The jitted calls take the weights as a flat list (C++ flattens it) and rebuild the nnx.State inside the
    # trace: flattening the State on every call runs a Python callback per variable (~0.08 ms per call for
    # the default model's 86, about 1% of a batch-1 decode step on this CPU).
    leaves, param_def = jax.tree_util.tree_flatten_with_path(params)
    self.params = [x for _, x in leaves]
    self.param_names = [jax.tree_util.keystr(path) for path, _ in leaves]  # each of params' nnx path
    del params, leaves

    blocks = ("window", "key_block", "score_block")

    def replicated(x):
      # What comes back to the host (tokens, top-k traces) is whole on every device, so that every process
      # can read it (a process reads only its own devices' data).
      return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))

    @functools.partial(jax.jit, donate_argnums=(3,), static_argnames=blocks + ("query_block", "first_token"))
    def prefill(params, tokens, positions, state, tables, sampling, *, first_token, **blocks):
      # first_token False (no row's prompt ends in this chunk): no lm_head, no sampling (XLA drops them).
      view = state.view(tables)
      params = jax.tree_util.tree_unflatten(param_def, params)
      logits, view = nnx.merge(graphdef, params).prefill(tokens, positions, view, **blocks)
      status = replicated(kernel_status(view, tokens.shape[0]))
      state = state.absorb(view).finish_prefill(tables)
      if not first_token:
        return (replicated(jnp.zeros(tokens.shape[:1], jnp.int32)), status), state
      return (replicated(sample(logits, *sampling, jnp.max(positions, axis=1) + 1)), status), state

    @functools.partial(jax.jit, donate_argnums=(3, 6), static_argnames=blocks + ("residency",))
    def decode(params, tokens, positions, state, tables, sampling, logits_buffer, *, residency, **blocks):
      # logits_buffer: None, or the previous step's logits at this bucket (``logits_buffer``), donated so that
      # this step's logits are written over it (returned in its place) rather than into a fresh temporary.
      view = state.view(tables, residency)
      params = jax.tree_util.tree_unflatten(param_def, params)
      vocab_major = self.vocab_major(tokens.shape[0])
      out = nnx.merge(graphdef, params).decode(
        tokens, positions, view, return_topk=record_topk, vocab_major=vocab_major, **blocks
      )
      status = replicated(kernel_status(out[1], tokens.shape[0]))
      # The logits written into the donated buffer (the update covers it all, so XLA computes them there).
      logits = None if logits_buffer is None else jax.lax.dynamic_update_slice(logits_buffer, out[0], (0, 0))
      return (
        (replicated(sample(out[0], *sampling, positions + 1, vocab_major=vocab_major)), status),
        state.absorb(out[1]),
        logits,
        *(replicated(x) for x in out[2:]),
      )

    @functools.partial(jax.jit, donate_argnums=(0,))
    def import_kv(state, tables, latent, index, length):
      state, status = state.import_prompt(tables, latent, index, length)
      return state, replicated(status)

    @functools.partial(jax.jit, static_argnames=("size",))
    def export_kv(state, tables, length, *, size):
      return state.export_prompt(tables, length, size)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def offload(state, tables):
      return state.offload(tables)

    @jax.jit
    def merge_tokens(launched_tokens, from_launched, host_tokens):
      # overlap_schedule: a step's tokens from the step before it (still on the device) and from the host.
      return replicated(jnp.where(from_launched >= 0, launched_tokens[jnp.maximum(from_launched, 0)], host_tokens))

    # The programs as the engine's methods call them (tests and benchmarks/step_floor.py wrap or lower them).
    self.prefill_fn, self.decode_fn, self.import_fn, self.export_fn, self.offload_fn, self.merge_fn = (
      self._compiling_alone(self._on_mesh(f), skip)
      for f, skip in ((prefill, 1), (decode, 1), (import_kv, 0), (export_kv, 0), (offload, 0), (merge_tokens, 0))
    )

  # ------------------------------------------------------------ programs
  def prefill(self, tokens, positions, tables: dict, sampling: tuple, *, first_token: bool, query_block, blocks):
    """One prefill call: tokens, positions int32[B, C] (-1 padding) with their page tables and per-row sampling
    (``sampling``). Returns (first tokens int32[B] (zeros unless ``first_token``), kernel status int32[B]) on the
    device."""
    out, self.backend.state = self.prefill_fn(
      self.params,
      self.put(tokens),
      self.put(positions),
      self.backend.state,
      tables,
      sampling,
      query_block=query_block,
      first_token=first_token,
      **blocks,
    )
    return out

  def decode(self, tokens, positions: np.ndarray, tables: dict, sampling: tuple, logits_buffer, *, residency, blocks):
    """Dispatches one decode call (returns without waiting): tokens int32[B] (host or device), positions
    int32[B] (-1: idle row). Returns ((tokens int32[B], status int32[B]), the logits buffer or None, the top-k
    trace if recorded), all on the device."""
    out, self.backend.state, logits, *topk = self.decode_fn(
      self.params,
      tokens,
      self.put(positions),
      self.backend.state,
      tables,
      sampling,
      logits_buffer,
      residency=residency,
      **blocks,
    )
    return out, logits, topk

  def import_kv(self, tables: dict, latent, index, length: int) -> np.ndarray:
    """Writes a prompt's stored rows (latent T[L, P, W], indexer keys I[L, P, Di]) into the pages of ``tables``;
    returns the kernel status per row (int32, on the host)."""
    self.backend.state, status = self.import_fn(
      self.backend.state,
      tables,
      self.put(latent, self.kv_dtype),
      self.put(index, self.index_dtype),
      self.put(np.int32(length)),
    )
    return np.asarray(status)

  def export_kv(self, tables: dict, length: int, size: int, group: int) -> tuple:
    """DP group ``group``'s prompt KV (its row of ``tables``, one row per group): (latent T[L, size, W], indexer
    keys I[L, size, Di]) as stored, zeros past ``length`` positions, on the group's first device
    (``group_device``). One compiled read per ``size``."""
    latent, index = self.export_fn(self.backend.state, tables, self.put(np.int32(length)), size=size)
    return tuple(jax.device_put(x[group], self.group_device(group)) for x in (latent, index))

  def offload(self, tables: dict) -> None:
    self.backend.state = self.offload_fn(self.backend.state, tables)

  def merge_tokens(self, launched_tokens, from_launched: np.ndarray, host_tokens: np.ndarray):
    return self.merge_fn(launched_tokens, self.put(from_launched), self.put(host_tokens))

  def settle(self) -> None:
    """Waits for every call in flight (raises the error of one that failed): their output is the KV state."""
    if self.backend is not None:
      jax.block_until_ready(self.backend.state)

  # -------------------------------------------------------------- shapes
  def index_blocks(self, B: int, Q: int, newest: int) -> dict:
    cfg = self.config
    return index_blocks(B, Q, newest, heads=cfg.index_n_heads, top_k=cfg.index_topk, page_size=self.page_size)

  def query_block(self, B: int, C: int) -> int | None:
    """Queries a prefill attention block takes (bounds its [B, block, K, W] gathered rows; divides C)."""
    cfg = self.config
    row_bytes = cfg.index_topk * cfg.latent_dim * np.dtype(self.dtype).itemsize
    query_block = pow2_at_most(max(1, PREFILL_GATHER_BYTES // (B * row_bytes)))
    if query_block >= C:
      return None
    while C % query_block:
      query_block //= 2
    return query_block

  def vocab_major(self, B: int) -> bool:
    """Whether the decode step at batch bucket B takes its logits [vocab, B] (VOCAB_MAJOR_MAX_BATCH)."""
    return self.mesh is None and jax.default_backend() == "cpu" and B <= VOCAB_MAJOR_MAX_BATCH

  def logits_buffer(self, B: int) -> jax.Array | None:
    """The float32[vocab, B] buffer the decode step at batch bucket B writes its logits into (donated: the step
    returns it, updated in place, and ``keep_logits_buffer`` keeps it for the next step), or None where the
    step's logits are not vocabulary-major (``vocab_major``).

    On CPU, XLA allocates each call's temporaries afresh: at batch 32 the logits (16 MiB) were new zero pages
    every step, ~4000 page faults that took the output projection from 14 to 17.6 ms. (At 128-256 rows the
    GEMM's own scratch of the logits' size faults the same way whatever this does, so larger buckets keep no
    buffer.) Only the current bucket's buffer is kept; a step that fails after taking it leaves it deleted,
    and a new one is made."""
    if not self.vocab_major(B):
      return None
    buf = self.logits_buffers.get(B)
    if buf is None or buf.is_deleted():  # a new bucket, or a failed step consumed it
      # Committed to the device, as the buffers the steps return are: jit compiles a program per combination
      # of committed and uncommitted operands (an uncommitted first buffer compiled every bucket twice).
      buf = jnp.zeros((self.config.vocab_size, B), jnp.float32, device=jax.local_devices()[0])
    return buf

  def keep_logits_buffer(self, B: int, buf) -> None:
    """Keeps a decode step's returned buffer for the next step at bucket B, once that step is known to have run
    (a failed step's outputs are errors, not buffers; a buffer the next step took is that step's)."""
    if buf is not None and not buf.is_deleted():
      self.logits_buffers = {B: buf}

  def group_device(self, group: int):
    """The first device of DP group ``group`` (the mesh's row of it; the one device without a mesh)."""
    return jax.local_devices()[0] if self.mesh is None else self.mesh.devices[group].flat[0]

  # ----------------------------------------------------------- transfers
  def put(self, x, dtype=None, commit: bool = False) -> jax.Array | np.ndarray:
    """A host array as a jitted call's operand: as a NumPy array (one device: the call puts it there; with
    ``commit``, put on the device here, where the same operand is at other times a committed device array), or
    whole on every device of the mesh (every process passes the same values: the schedule is the same
    everywhere)."""
    if isinstance(x, jax.Array) and not self.multiprocess:  # on a device (a pulled prompt KV): not via the host
      x = x if dtype is None else x.astype(dtype)
      return x if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, PartitionSpec()))
    # With several processes a pulled KV is on process 0's device only, and the others hold its host copy (the
    # step message's): every process puts its host copy, as for any operand (a device_put from one process's
    # device to the others' is a cross-host transfer, which the CPU backend refuses).
    x = np.asarray(x, None if dtype is None else np.dtype(dtype))
    if self.mesh is None:
      # The host array itself: the jitted call's C++ dispatch puts it on the device, ~10x cheaper per array
      # than jnp.asarray's Python path (a decode step passes 7-10 such tables and sampling arrays).
      return jax.device_put(x, jax.local_devices()[0]) if commit else x
    return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec()))

  def put_tables(self, tables: dict) -> dict:
    return {k: self.put(v) for k, v in tables.items()}

  # ------------------------------------------------------------- helpers
  def _on_mesh(self, fn):
    """fn traced and run with the mesh as the context mesh (the FFI calls run per device under it:
    kernels/ops.py ``per_device``); fn itself on one device."""
    if self.mesh is None:
      return fn

    def call(*args, **kwargs):
      with jax.set_mesh(self.mesh):
        return fn(*args, **kwargs)

    def lower(*args, **kwargs):
      with jax.set_mesh(self.mesh):
        return fn.lower(*args, **kwargs)

    call.lower = lower
    return call

  def _compiling_alone(self, fn, skip: int):
    """fn, first waiting for the calls in flight when it is about to compile: called with operands (past the
    first ``skip``, the weights) or static arguments it has not run with. With ``overlap_schedule`` a call is
    launched while the previous one computes; XLA:CPU compiling alongside a running call crashed a test process
    once (a segfault inside ``backend_compile_and_load``), so a compile waits for the KV state, the output of
    every earlier call. Costs one wait per new shape (batch bucket, prefill bucket, residency)."""
    seen = set()

    def call(*args, **kwargs):
      leaves, treedef = jax.tree_util.tree_flatten(args[skip:])
      key = (
        treedef,
        tuple((x.shape, x.dtype) if hasattr(x, "shape") else x for x in leaves),
        tuple(sorted(kwargs.items())),
      )
      if key not in seen:
        self.settle()
        seen.add(key)
      return fn(*args, **kwargs)

    call.lower = fn.lower
    return call
