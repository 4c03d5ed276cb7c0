"""JAX wrappers of the HiSparse XLA FFI kernels (swap-in and backup).

The handlers live in ``xla_ffi/`` (``cpu_handlers.cc``, ``cuda_handlers.cu``, sharing ``swap_in_core.h``)
and are registered here on import: the CPU handler always, the CUDA handler
when the extension was built with nvcc. Both wrappers are callable inside
``jax.jit``; the state they update (host pool, hot buffer, slot table, LRU,
stats) is aliased input -> output, so donated arguments are updated in place.

On a device mesh (a function traced under ``jax.set_mesh``) every FFI call runs through ``shard_map``: each
device runs the handler on its own copy of the operands and of the KV state it updates. The operands are
replicated over the mesh (``PartitionSpec()``), so every tensor-parallel rank gets the same top-k and makes
the same hot-buffer updates: their copies of the hot buffers never diverge.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

# The swap-in kernel's eviction policies, by the index its `eviction` attribute takes (swap_in_core.h).
from hisparse_jax.config import KERNEL_EVICTIONS as EVICTIONS, check_prefetch_threads_env


def _load_cpu_module():
  # HISPARSE_FFI_CPU_LIB points at another build of the same module (e.g. the
  # AddressSanitizer build of `make test-asan`); the default is the installed one.
  path = os.environ.get("HISPARSE_FFI_CPU_LIB")
  if not path:
    from hisparse_jax import _ffi_cpu

    return _ffi_cpu
  spec = importlib.util.spec_from_file_location("_ffi_cpu", path)
  if spec is None:
    raise ImportError(f"HISPARSE_FFI_CPU_LIB={path!r} is not a loadable extension module")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_ffi_cpu = _load_cpu_module()

try:  # Built only where nvcc was found at install time.
  from hisparse_jax import _ffi_cuda
except ImportError:  # pragma: no cover - depends on the build machine
  _ffi_cuda = None

SWAP_IN_TARGET = "hisparse_swap_in"
TOP_K_TARGET = "hisparse_top_k"
ARGMAX_TARGET = "hisparse_argmax"
ARGMAX_COLUMNS_TARGET = "hisparse_argmax_columns"
BACKUP_TARGET = "hisparse_backup"
# Variants over a host pool owned by the extension (ExtensionHostPool).
SWAP_IN_EXT_TARGET = "hisparse_swap_in_ext"
BACKUP_EXT_TARGET = "hisparse_backup_ext"
PREFETCH_START_TARGET = "hisparse_prefetch_start"
PREFETCH_START_EXT_TARGET = "hisparse_prefetch_start_ext"
PREFETCH_WAIT_TARGET = "hisparse_prefetch_wait"
MAX_COPY_BLOCKS = 1024  # swap_in's copy_blocks (xla_ffi/bindings.h kMaxCopyBlocks)


def _is_int(value) -> bool:
  """A Python or NumPy integer, not a bool: what a static size, count or axis argument must be."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _register() -> None:
  for name, capsule in _ffi_cpu.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _ffi_cuda is not None:
    for name, capsule in _ffi_cuda.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


_register()


def cuda_handler_built() -> bool:
  """True when the CUDA handlers were compiled into this installation."""
  return _ffi_cuda is not None


def inside_shard_map() -> bool:
  """True while tracing the body of a ``shard_map`` (the context mesh has manual axes): arrays are local."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def per_device(fn, batch_axis: str | None = None):
  """``fn`` (a function of arrays calling one FFI handler) run once per device of the context mesh
  (``shard_map``): on replicated operands (``PartitionSpec()`` in and out; results are identical on every
  device), or, with batch_axis naming a mesh axis of size > 1, on operands split along their leading
  (batch) dimension over it. ``fn`` itself without a mesh of more than one device or inside a shard_map."""

  def call(*args):
    for a in args:  # (XLA models unpinned_host as device memory: a donated such pool aborts the process)
      if (
        isinstance(a, jax.Array)
        and not isinstance(a, jax.core.Tracer)
        and getattr(a.sharding, "memory_kind", None) not in (None, "device", "pinned_host")
      ):
        raise ValueError(
          f"an operand of shape {list(a.shape)} is in {a.sharding.memory_kind} memory: the kernels "
          "take device arrays and a pinned_host host pool"
        )
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or inside_shard_map():
      return fn(*args)
    split = batch_axis is not None and mesh.shape.get(batch_axis, 1) > 1
    spec = jax.sharding.PartitionSpec(batch_axis) if split else jax.sharding.PartitionSpec()
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      for a in args:  # (shard_map's own error names neither the kernel nor the remedy)
        have = tuple(getattr(jax.typeof(a).sharding, "spec", ()))
        want = tuple(spec)[:1] + (None,) * (max(len(have), 1) - 1)
        if any(x is not None for x in have) and have != want:
          layout = f"split on {batch_axis} along their batch dimension" if split else "replicated"
          raise ValueError(
            f"a kernel operand {jax.typeof(a).str_short()} is sharded {have} on the mesh's Explicit "
            f"axes; the kernels take their operands {layout} (jax.sharding.reshard them first)"
          )
    mapped = jax.shard_map(fn, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)
    if not any(isinstance(a, jax.core.Tracer) for a in args):  # eager: under jit (an eager shard_map refuses
      mapped = jax.jit(mapped)  # arrays on a mesh's Explicit axes)
    return mapped(*args)

  return call


def _like(x: jax.Array):
  # The aliased result keeps the operand's own type (memory space included):
  # a plain ShapeDtypeStruct for a pinned_host pool aborts the process.
  return jax.typeof(x)


def _layer(layer) -> jax.Array:
  """The layer index as int32; a float or bool is a TypeError, not a silent truncation."""
  dtype = getattr(layer, "dtype", None)
  if isinstance(layer, (bool, float)) or (dtype is not None and not jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"layer must be an integer, got {layer!r}")
  if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < 2**31:
    raise ValueError(f"layer {layer} is outside [0, 2^31)")
  if jnp.ndim(layer) != 0:
    raise ValueError(f"layer must be a scalar, got shape {list(jnp.shape(layer))}")
  return jnp.asarray(layer, jnp.int32)


def _int32(name: str, x):
  """Integer indices as int32; concrete values outside the int32 range are an error, not a wrap. A traced
  array's values are unknown: int32 or a narrower integer type (int8, uint16, ...), which converts exactly."""
  if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and x.dtype == jnp.int32):
    if x.dtype == jnp.int32:
      return x
    if not (jnp.issubdtype(x.dtype, jnp.integer) and np.can_cast(x.dtype, np.int32, "safe")):
      raise TypeError(f"{name} must be int32 (or an integer type int32 holds), got {x.dtype}")
    return x.astype(jnp.int32)
  a = np.asarray(x)
  if not (np.issubdtype(a.dtype, np.integer) and not np.issubdtype(a.dtype, np.bool_)):
    raise TypeError(f"{name} must be an integer array, got {a.dtype}")
  if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
    raise ValueError(f"{name} has values outside the int32 range")
  return jnp.asarray(a, jnp.int32)


def byte_addressable(dtype) -> bool:
  """Whether XLA stores dtype in whole bytes (int4, fp4 and the like are packed)."""
  d = jnp.dtype(dtype)
  if jnp.issubdtype(d, jnp.floating):
    return jnp.finfo(d).bits >= 8
  if jnp.issubdtype(d, jnp.integer):
    return jnp.iinfo(d).bits >= 8
  return d.itemsize >= 1


@dataclasses.dataclass(frozen=True)
class ExternalPoolRef:
  """Static description of an ExtensionHostPool, passed to the "_ext" handlers as attributes.

  dtype and width (its rows' element dtype and W) are checked at trace time against the hot buffer or the
  rows a call passes (``attrs_for``); the handlers themselves refuse an address that is not a live pool of
  exactly L x H rows of the passed rows' byte size."""

  address: int
  layers: int
  rows: int
  dtype: np.dtype
  width: int
  serial: int  # the registry's number for this allocation: a ref to a freed pool never reaches a new one

  def __post_init__(self):
    object.__setattr__(self, "dtype", np.dtype(self.dtype))

  def attrs_for(self, like, op: str) -> dict:
    """``attrs()`` after checking that ``like`` (an array [..., W]) has this pool's dtype and row width.

    Raises: ValueError naming both when it has not (the handler would view the pool's bytes as other rows).
    """
    if jnp.dtype(like.dtype) != self.dtype or like.shape[-1] != self.width:
      raise ValueError(
        f"{op}: the extension host pool holds rows of {self.width} x {self.dtype}, but the "
        f"{'hot buffer' if op != 'backup' else 'rows written'} are {like.shape[-1]} x "
        f"{jnp.dtype(like.dtype)}"
      )
    return self.attrs()

  def attrs(self) -> dict:
    return dict(
      pool_address=np.uint64(self.address),
      pool_serial=np.uint64(self.serial),
      pool_layers=np.int64(self.layers),
      pool_rows=np.int64(self.rows),
    )


class ExtensionHostPool:
  """A host pool owned by the extension: the fallback to a ``pinned_host`` JAX array.

  On CPU it is page-aligned host memory; on a GPU it is pinned, mapped host
  memory (``cudaHostAlloc``) that the CUDA kernels read directly. JAX sees only
  ``token()``, an int32[1] array threaded through the swap-in and backup calls
  to order them; the handlers accept only live pools of this registry of
  exactly the bytes of the rows they are told it holds.

  Args:
    layers, rows, width: L, H, W of the pool (rows of W elements).
    dtype: element dtype (must be whole bytes: not int4 / fp4).
    platform: "cpu" or "gpu" (default: JAX's default backend).

  Raises:
    ValueError: layers, rows or width < 1, or one of them not an integer.
    TypeError: a dtype that is not a float or integer type, or packs below one byte.
    RuntimeError: the CUDA handlers are not built but a GPU pool is asked for.
    MemoryError: the allocation failed.
  """

  def __init__(self, layers: int, rows: int, width: int, dtype, platform: str | None = None):
    platform = platform or ("gpu" if jax.default_backend() == "gpu" else "cpu")
    if platform == "gpu" and _ffi_cuda is None:
      raise RuntimeError("a GPU host pool needs the CUDA handlers, which this build lacks")
    self._module = _ffi_cuda if platform == "gpu" else _ffi_cpu
    self.dtype = np.dtype(dtype)
    if not (jnp.issubdtype(self.dtype, jnp.floating) or jnp.issubdtype(self.dtype, jnp.integer)):
      raise TypeError(f"host pool dtype must be a float or integer type, got {self.dtype}")
    if not byte_addressable(self.dtype):
      raise TypeError(f"host pool dtype {self.dtype} packs below one byte per element (unsupported)")
    for name, v, low in (("layers", layers, 1), ("rows", rows, 1), ("width", width, 1)):
      if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError(f"host pool {name} must be an integer >= {low}, got {v!r}")
    self.shape = (int(layers), int(rows), int(width))
    self.nbytes = self.shape[0] * self.shape[1] * self.shape[2] * self.dtype.itemsize  # Python ints: no wrap
    self.address, serial = self._module.alloc_host_pool(
      self.shape[0], self.shape[1], self.shape[2] * self.dtype.itemsize
    )
    self.ref = ExternalPoolRef(self.address, self.shape[0], self.shape[1], self.dtype, self.shape[2], serial)

  def token(self) -> jax.Array:
    """A fresh int32[1] ordering token for a cache that uses this pool."""
    return jnp.zeros((1,), jnp.int32)

  def _check_open(self) -> None:
    if not self.address:
      raise ValueError("this ExtensionHostPool is closed")

  def read(self) -> np.ndarray:
    """A copy of the whole pool as a NumPy array [L, H, W] (tests, debugging). ValueError once closed."""
    self._check_open()
    raw = self._module.read_host_pool(self.address, 0, self.nbytes)
    return np.frombuffer(raw, self.dtype).reshape(self.shape).copy()

  def write(self, array) -> None:
    """Overwrites the whole pool from an array of its shape and dtype (ValueError for another shape or dtype, or
    once closed: a conversion could round or overflow the rows)."""
    self._check_open()
    a = np.asarray(array)
    if a.dtype != self.dtype:
      raise ValueError(f"expected dtype {self.dtype}, got {a.dtype} (convert it first)")
    if a.shape != self.shape:
      raise ValueError(f"expected shape {self.shape}, got {a.shape}")
    self._module.write_host_pool(self.address, 0, a.tobytes())

  def close(self) -> None:
    """Frees the pool. A call naming it that has not started by then fails (INVALID_ARGUMENT: not a live
    extension pool); close waits for the calls already reading or writing it (on a GPU, for each device's queued
    work) and for the prefetch copies they queued, so the freed memory is never touched."""
    if self.address:
      self._module.free_host_pool(self.address)
      self.address = 0

  def __del__(self):
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass


def _plan_args(top_k, seq_lens, req_ids, host_pages, page_size, eviction):
  """The swap-in's and the prefetch's shared arguments checked: the index arrays as int32 (ValueError /
  TypeError as ``_int32``), page_size a positive integer and eviction a policy (ValueError)."""
  arrays = tuple(
    _int32(n, x)
    for n, x in (("top_k", top_k), ("seq_lens", seq_lens), ("req_ids", req_ids), ("host_pages", host_pages))
  )
  for name, a, rank in zip(("top_k", "seq_lens", "req_ids", "host_pages"), arrays, (2, 1, 1, 2)):
    if a.ndim != rank:
      raise ValueError(
        f"{name} must have {rank} dimension{'s' if rank > 1 else ''} ([B, K], [B], [B], [B, P] for "
        f"top_k, seq_lens, req_ids, host_pages), got shape {list(a.shape)}"
      )
  if not _is_int(page_size) or page_size < 1:
    raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
  if eviction not in EVICTIONS:
    raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
  return arrays


def swap_in(
  layer,
  top_k,
  seq_lens,
  req_ids,
  host_pages,
  newest,
  host_pool,
  hot,
  slot_tokens,
  lru,
  stats,
  slot_scores=None,
  *,
  page_size: int,
  eviction: str = "lru",
  external: ExternalPoolRef | None = None,
  target: str | None = None,
  copy_blocks: int = 0,
):
  """Make the latent rows of each batch row's top-k positions resident in its request's hot buffer.

  Args:
    layer: int32 scalar, the layer index l in [0, L).
    top_k: int32[B, K] token positions chosen by the indexer, -1 = padding.
    seq_lens: int32[B] tokens of each row's request; the newest token is at seq_len - 1.
    req_ids: int32[B] hot buffer (request slot) of each row, in [0, R); -1 marks an idle row
      (seq_len must be 0). No id may appear twice.
    host_pages: int32[B, P] each row's host page table: logical page p (positions
      [p * page_size, (p + 1) * page_size)) -> host-pool page; -1 = none.
    newest: T[B, W] each row's newest latent row (position seq_len - 1, computed this step), which the
      kernel writes to its slot (seq_len - 1 while seq_len <= D, else the reserved slot D). The kernel,
      not XLA, writes it: an XLA update of the hot buffer feeding this aliased call is not done in
      place (XLA copies the whole buffer).
    host_pool: T[L, H, W] latent KV of all tokens (``pinned_host`` memory; H = host pages x
      page_size), or with ``external`` the int32[1] ordering token of an ExtensionHostPool.
    hot: T[L, R, D+1, W] hot buffers of R request slots; slot D of each is reserved for its newest
      token.
    slot_tokens: int32[L, R, D] token position held by each slot (-1 empty).
    lru: int32[L, R, D] slot ids of each request, least recently used first; with eviction "clock" the
      clock ring read from the hand, each entry slot | 2**30 while the slot's reference bit is set.
    stats: int32[L, R, 2] cumulative (hits, misses) per request slot and layer, counted over
      distinct non-padding positions.
    slot_scores: float32[B, D], with eviction "score" only: the indexer's score this step of the token in
      each slot of the row's request (``slot_tokens[layer, req_ids[b]]``; empty slots count as -inf
      whatever their score). Must be None for the other policies.
    page_size: tokens per host page (static; an FFI attribute).
    eviction: the victim policy (static): "lru" (HiSparse's), "clock" (second-chance CLOCK) or "score"
      (the resident tokens the indexer ranks lowest this step, scores compared in IEEE total order: -0
      before +0, subnormals kept; ties to the older slot in LRU order).
      ``hisparse_jax.kernels.reference`` defines each exactly.
    copy_blocks: CUDA only (static; the CPU handler ignores it): thread blocks per batch row that copy its
      missing rows, in [0, 1024]. 1: the block that planned the row (one kernel); n > 1: a second kernel
      of B x n blocks, fed by a miss list the plan kernel writes to a scratch result (int32[B, K + 1]); 0
      (the default): 1 once B reaches the device's multiprocessor count, else min(32, ceil(2 x
      multiprocessors / B)). One block reading mapped host memory is latency-bound (2.4 GB/s on an H200
      at B 1, against ~35-50 GB/s for the link at B >= 64: BENCHMARKS.md, GPU). Results are the same for
      every value.

  Returns:
    (rows, host_pool, hot, slot_tokens, lru, stats, status): rows is int32[B, K], the row of
    ``hot[l].reshape(R * (D + 1), W)`` holding each top-k entry (-1 for padding); then the updated state
    (aliased to the inputs); status is int32[B], 0 for each row done, else the code of what was wrong
    with that row's input (``status_message``), and that row is left unchanged (its rows are -1; the
    other rows are done). Read it with the step's other results: ``check_status``.

  Row statuses (the kernel never reads out of bounds, clamps or synchronizes for them): a position
  >= seq_len or < -1, seq_len outside [0, P x page_size], a needed position with no host row in [0, H),
  an LRU row that is not a permutation, a request id out of range, repeated (the later row fails) or -1
  on an active row, (eviction "score") a resident slot's score that is NaN; the layer out of range fails
  every row.

  Raises:
    jax.errors.JaxRuntimeError with INVALID_ARGUMENT (ValueError when the call is dispatched eagerly)
    for what the compiled shapes decide: K > D, newest not [B, W] of the hot buffer's dtype, operand
    shapes that do not fit, a sub-byte dtype, an address that is not a live extension pool of exactly
    L x H rows of the hot buffer's row size. ValueError (at trace time) for copy_blocks outside [0, 1024],
    an unknown eviction,
    slot_scores given without eviction "score" / missing with it, or an ``external`` pool whose dtype or
    row width is not the hot buffer's.

  ``external`` selects the handler over an ExtensionHostPool; ``target`` names another
  registration of the same handler (e.g. the Bazel build's).

  Semantics: ``hisparse_jax.kernels.reference.swap_in`` (HiSparse, SGLang).
  """
  top_k, seq_lens, req_ids, host_pages = _plan_args(top_k, seq_lens, req_ids, host_pages, page_size, eviction)
  B, K = top_k.shape
  if not _is_int(copy_blocks) or not 0 <= copy_blocks <= MAX_COPY_BLOCKS:
    raise ValueError(f"copy_blocks must be an integer in [0, {MAX_COPY_BLOCKS}], got {copy_blocks!r}")
  if (slot_scores is None) != (eviction != "score"):
    raise ValueError('slot_scores (float32[B, D]) are given exactly when eviction is "score"')
  if slot_scores is None:
    slot_scores = jnp.zeros((B, 0), jnp.float32)
  elif jnp.result_type(slot_scores) != jnp.float32:
    raise TypeError(f"slot_scores must be float32, got {jnp.result_type(slot_scores)}")
  call = jax.ffi.ffi_call(
    target or (SWAP_IN_EXT_TARGET if external else SWAP_IN_TARGET),
    (
      jax.ShapeDtypeStruct((B, K), jnp.int32),
      _like(host_pool),
      _like(hot),
      _like(slot_tokens),
      _like(lru),
      _like(stats),
      jax.ShapeDtypeStruct((B,), jnp.int32),
      jax.ShapeDtypeStruct((B, K + 1), jnp.int32),  # miss_list: the CUDA handler's scratch, dropped
    ),
    input_output_aliases={6: 1, 7: 2, 8: 3, 9: 4, 10: 5},
  )
  attrs = external.attrs_for(hot, "swap_in") if external else {}
  return per_device(
    lambda *a: call(
      *a,
      page_size=np.int64(page_size),
      eviction=np.int64(EVICTIONS.index(eviction)),
      copy_blocks=np.int64(copy_blocks),
      **attrs,
    )[:7]
  )(_layer(layer), top_k, seq_lens, req_ids, host_pages, newest, host_pool, hot, slot_tokens, lru, stats, slot_scores)


def prefetch_start(
  layer,
  top_k,
  seq_lens,
  req_ids,
  host_pages,
  host_pool,
  hot,
  slot_tokens,
  lru,
  *,
  page_size: int,
  eviction: str = "lru",
  external: ExternalPoolRef | None = None,
):
  """Cross-layer prefetch, first half: start making layer ``layer``'s PREDICTED top-k resident.

  A swap-in of the predicted positions top_k (typically the previous layer's top-k: adjacent layers pick
  mostly the same tokens; IndexCache, arXiv 2603.12201, measures 70-100% overlap on DeepSeek-V3.2) with no
  newest row and no stats, run in the background: the call checks its input, snapshots what it reads (the
  rows' slot tables and LRU orders of the layer included) and queues the work; planning (hits move to the
  recent end of the LRU order, each missing position takes a victim slot) and reading the missing rows from
  the host pool into staging memory then run on the CPU extension's copy threads (``prefetch_threads``) or,
  on a GPU, in a kernel on a side stream. Nothing in the background writes ``hot``, ``slot_tokens`` or
  ``lru``: ``prefetch_wait`` commits the prefetch into the arrays it is given, so whatever XLA does between
  the two calls cannot corrupt them, and the layer's real ``swap_in`` after the wait still makes every needed
  row resident: results are bit for bit those without a prefetch. The background reads the host pool until
  the wait: keep the returned pool alive and wait for every start (``ExtensionHostPool.close`` waits for all).

  Args: as ``swap_in`` (top_k int32[B, K] the predicted positions, each < seq_len; seq_lens, req_ids,
    host_pages, host_pool, hot (read for its shape only), slot_tokens, lru, page_size), with eviction "lru"
    or "clock" ("score" needs the layer's indexer scores, which do not exist yet: ValueError).

  Returns:
    (host_pool, ticket): the pool, aliased (orders the next backup after this call: that backup writes only
    the newest rows, which a prefetch never reads), and int32[1, 2], the job for ``prefetch_wait`` (each
    device's own; on a GPU zeros: a device has one prefetch in flight).

  Raises: as ``swap_in`` for shapes; ValueError for eviction "score" or an unknown one; ConfigError (a
    ValueError) for a HISPARSE_PREFETCH_THREADS that is not an integer in [0, 64].
  """
  check_prefetch_threads_env()  # before the extension's copy threads read it
  top_k, seq_lens, req_ids, host_pages = _plan_args(top_k, seq_lens, req_ids, host_pages, page_size, eviction)
  if eviction == "score":
    raise ValueError(
      'prefetch: eviction "score" ranks slots by the layer\'s own indexer scores, which a '
      'prefetch (before the layer runs) does not have; use "lru" or "clock"'
    )
  call = jax.ffi.ffi_call(
    PREFETCH_START_EXT_TARGET if external else PREFETCH_START_TARGET,
    (_like(host_pool), jax.ShapeDtypeStruct((1, 2), jnp.int32)),
    input_output_aliases={5: 0},
  )
  attrs = external.attrs_for(hot, "prefetch_start") if external else {}
  return tuple(
    per_device(
      lambda *a: call(*a, page_size=np.int64(page_size), eviction=np.int64(EVICTIONS.index(eviction)), **attrs)
    )(_layer(layer), top_k, seq_lens, req_ids, host_pages, host_pool, hot, slot_tokens, lru)
  )


def prefetch_threads() -> int:
  """The CPU extension's copy threads for ``prefetch_start`` (``HISPARSE_PREFETCH_THREADS``, read once per
  process; default a quarter of the cores, 1 to 4). 0: the work runs inside ``prefetch_wait`` (no overlap).
  ConfigError (a ValueError) for a setting that is not an integer in [0, 64]."""
  check_prefetch_threads_env()
  return int(_ffi_cpu.prefetch_threads())


def prefetch_wait(ticket, hot, slot_tokens, lru, after, *, batch: int):
  """Cross-layer prefetch, second half: (hot, slot_tokens, lru, prefetched) with the ``prefetch_start`` of
  ``ticket`` committed.

  Waits for the job (the CPU runs its queued tasks here; a GPU's stream waits for the side stream's event,
  no host synchronization), then commits each row whose slot table and LRU order of the layer are still
  those the start saw: the planned tables, and the staged rows into their slots of ``hot``. ``after`` (any
  array, not read) orders the wait: XLA runs it once ``after`` exists, so give it a value computed after the
  work the prefetch should overlap (in a decode step: the layer's newest latent rows). batch: B, the start's
  batch rows (static).

  Returns: hot, slot_tokens, lru aliased to the inputs (updated in place), and prefetched int32[B]: the rows
  each batch row placed, 0 for an idle row or an unknown ticket, or -status for a row left unchanged (its
  input was bad: its swap-in reports it; or ``PREFETCH_STALE``: its tables changed after the start).

  Raises: JaxRuntimeError (INVALID_ARGUMENT) when the arrays do not match the start's shapes (the job is
  still consumed and its staged rows dropped, nothing committed: a later wait on the ticket finds it unknown,
  and the layer's swap-in copies what the prefetch would have); ValueError for a batch that is not an
  integer >= 0."""
  if not _is_int(batch) or batch < 0:
    raise ValueError(f"prefetch_wait: batch must be an integer >= 0 (the start's batch rows), got {batch!r}")
  if jnp.ndim(ticket) != 2 or jnp.shape(ticket)[1] != 2 or jnp.result_type(ticket) != jnp.int32:
    raise ValueError(
      f"prefetch_wait: ticket must be prefetch_start's int32[1, 2] (a row per device), got "
      f"{jnp.result_type(ticket)}{list(jnp.shape(ticket))}"
    )
  call = jax.ffi.ffi_call(
    PREFETCH_WAIT_TARGET,
    (_like(hot), _like(slot_tokens), _like(lru), jax.ShapeDtypeStruct((batch,), jnp.int32)),
    input_output_aliases={1: 0, 2: 1, 3: 2},
  )
  return tuple(per_device(call)(ticket, hot, slot_tokens, lru, after))


def backup(layer, rows, dst, host_pool, *, external: ExternalPoolRef | None = None):
  """Write latent rows into the host pool: ``pool[layer + i, dst[n]] = rows[i, n]``.

  Args:
    layer: int32 scalar, first layer written.
    rows: T[Lr, N, W] rows on device (Lr consecutive layers).
    dst: int32[N] host-pool row of each column; -1 skips it.
    host_pool: T[L, H, W] (``pinned_host``), aliased to the result; or with
      ``external`` the int32[1] ordering token of an ExtensionHostPool.

  Returns:
    (host_pool, status): the updated host pool (or token), and int32[N] with 0 for each column written or
    skipped (dst -1), else its ``status_message`` code: a dst outside [-1, H) (that column is not
    written), or [layer, layer + Lr) outside [0, L) (on every column; nothing is written).

  Raises:
    jax.errors.JaxRuntimeError (INVALID_ARGUMENT) on mismatched dtype / row width or a dtype packed below
    one byte per element, or (``external``) an address that is not a live pool of exactly L x H such rows;
    ValueError for an ``external`` pool of another dtype or row width; TypeError for a non-integer layer.
  """
  dst = _int32("dst", dst)
  call = jax.ffi.ffi_call(
    BACKUP_EXT_TARGET if external else BACKUP_TARGET,
    (_like(host_pool), jax.ShapeDtypeStruct(dst.shape, jnp.int32)),
    input_output_aliases={3: 0},
  )
  attrs = external.attrs_for(rows, "backup") if external else {}
  return tuple(per_device(lambda *a: call(*a, **attrs))(_layer(layer), rows, dst, host_pool))


def status_message(code: int) -> str:
  """The text of a swap-in / backup status code (``xla_ffi/swap_in_core.h`` SwapInStatus; "ok" for 0, "not a
  status code ..." for any other number: ``prefetch_wait``'s counts carry a status negated)."""
  return _ffi_cpu.status_message(int(code))


class KernelStatusError(ValueError):
  """Input a swap-in or backup call left unchanged (its INVALID_ARGUMENT), found by ``check_status``.

  Attributes: op (the call's name), rows (int indices whose status is not 0), codes (their codes)."""

  def __init__(self, op: str, rows, codes):
    self.op, self.rows, self.codes = op, list(rows), list(codes)
    first = f"row {self.rows[0]}: {status_message(self.codes[0])}"
    more = f" (and {len(self.rows) - 1} more rows)" if len(self.rows) > 1 else ""
    left = "those rows were" if more else "that row was"
    super().__init__(f"INVALID_ARGUMENT: {op}: {first}{more}; {left} left unchanged")


def check_status(status, op: str = "swap_in") -> None:
  """Raises KernelStatusError if any entry of a swap-in / backup status (int array, read to the host here:
  call it where the results are read anyway) is not 0."""
  s = np.asarray(status).reshape(-1)
  bad = np.flatnonzero(s)
  if bad.size:
    raise KernelStatusError(op, bad.tolist(), s[bad].tolist())


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exactly ``jax.lax.top_k(x, k)`` for float32 x[..., N] without NaN: (values float32[..., k], indices
  int32[..., k]), the k largest values of each row in descending order, equal values by ascending index.

  On CPU an FFI handler (``xla_ffi/top_k.cc``: introselect then a sort of the k winners, O(N + k log k) per
  row, rows over XLA's thread pool) replaces XLA's CPU top-k, which sorts whole rows; other platforms use
  ``jax.lax.top_k``. Raises ValueError unless 1 <= k <= N; TypeError for a dtype other than float32.
  """
  if x.dtype != jnp.float32:
    raise TypeError(f"top_k takes float32 scores, got {x.dtype}")
  n = x.shape[-1]
  if not 1 <= k <= n:
    raise ValueError(f"top_k: k = {k} outside [1, {n}]")

  def local(x):  # shapes of this device's rows
    call = jax.ffi.ffi_call(
      TOP_K_TARGET,
      (jax.ShapeDtypeStruct((*x.shape[:-1], k), jnp.float32), jax.ShapeDtypeStruct((*x.shape[:-1], k), jnp.int32)),
    )
    return jax.lax.platform_dependent(
      x, cpu=lambda x: tuple(call(x, k=np.int64(k))), default=lambda x: tuple(jax.lax.top_k(x, k))
    )

  # Rows are independent: under data-parallel attention each group takes the top-k of its own rows.
  return per_device(local, batch_axis="dp")(x)


def argmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """Exactly ``jnp.argmax(x, axis=axis)`` as int32, for float32 x: per row (axis -1: x[..., N], 1 <= N < 2**31)
  or per column (axis 0: x[N, C] only, N * C < 2**31, e.g. logits held [vocab, batch]), the index of its first
  NaN if it holds one, else of its first maximum (-0.0 equals +0.0; all -inf gives 0). Differentiable as
  ``jnp.argmax`` is: the tangent of the (integer) result is a float0 zero.

  On CPU FFI handlers (``xla_ffi/argmax.cc``; rows: one vectorized pass of chunk maxima and NaN flags per row,
  then a pass over the one chunk that holds the first maximum; columns: one vectorized pass keeping each
  lane's maximum, its first index and its first NaN, then a merge of each column's lanes; the work over XLA's
  thread pool) replace XLA:CPU's argmax, a variadic reduction it does not vectorize (5.9 ms for 32 rows of a
  129280-entry vocabulary against 0.43 ms); other platforms use ``jnp.argmax``. Under a context mesh of
  several devices the handler runs per device (``per_device``: rows split over a ``dp`` axis when it divides
  the leading dimension, else whole on every device); a mesh with Explicit axes takes ``jnp.argmax``. Raises
  TypeError for a dtype other than float32, ValueError for another axis or shapes outside those bounds.
  """
  if not (hasattr(x, "dtype") and hasattr(x, "shape")):
    raise TypeError(f"argmax takes a float32 array, got {type(x).__name__}")
  if x.dtype != jnp.float32:
    raise TypeError(f"argmax takes float32, got {x.dtype}")
  if x.ndim < 1:
    raise ValueError(f"argmax needs at least one dimension, got shape {x.shape}")
  if not _is_int(axis) or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"argmax: axis {axis!r} out of range for shape {x.shape}")
  axis = int(axis) % x.ndim
  if axis == 0 and x.ndim == 2:
    if not (x.shape[0] >= 1 and x.shape[1] >= 1 and x.size < 2**31):
      raise ValueError(f"argmax over axis 0 needs [N, C] with N, C >= 1 and N * C < 2**31, got shape {x.shape}")
  elif axis != x.ndim - 1:
    raise ValueError(f"argmax takes the last axis, or axis 0 of a 2-D array; got axis {axis} of shape {x.shape}")
  elif not 1 <= x.shape[-1] < 2**31:
    raise ValueError(f"argmax needs rows of 1 .. 2**31 - 1 entries, got shape {x.shape}")
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jnp.argmax(x, axis=axis).astype(jnp.int32)  # shard_map would need x's own sharding as its spec
  return _argmax(x, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _argmax(x: jax.Array, axis: int) -> jax.Array:
  """``argmax`` on checked arguments (axis 0 of a 2-D x, or its last axis)."""
  if axis == 0 and x.ndim == 2:
    call = jax.ffi.ffi_call(
      ARGMAX_COLUMNS_TARGET, jax.ShapeDtypeStruct(x.shape[1:], jnp.int32), vmap_method="sequential"
    )
    local = lambda x: jax.lax.platform_dependent(  # noqa: E731
      x, cpu=call, default=lambda x: jnp.argmax(x, axis=0).astype(jnp.int32)
    )
    return per_device(local)(x)  # on a mesh: the whole array on every device (columns are not split)

  def local(x):  # this device's rows
    call = jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32), vmap_method="broadcast_all")
    return jax.lax.platform_dependent(x, cpu=call, default=lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))

  # Rows are independent: under data-parallel attention each group takes the argmax of its own rows (when the
  # groups divide them; otherwise every device takes all of them).
  mesh = jax.sharding.get_abstract_mesh()
  dp = 1 if mesh.empty else mesh.shape.get("dp", 1)
  split = x.ndim >= 2 and x.shape[0] % dp == 0
  return per_device(local, batch_axis="dp" if split else None)(x)


@_argmax.defjvp
def _argmax_jvp(axis, primals, tangents):
  del tangents
  out = _argmax(primals[0], axis)
  return out, np.zeros(out.shape, jax.dtypes.float0)
