"""JAX wrappers of the HiSparse XLA FFI kernels (swap-in and backup).

The handlers live in ``xla_ffi/`` (``cpu_handlers.cc``, ``cuda_handlers.cu``)
and are registered here on import: the CPU handler always, the CUDA handler
when the extension was built with nvcc. Both wrappers are callable inside
``jax.jit``; the state they update (host pool, hot buffer, slot table, LRU,
stats) is aliased input -> output, so donated arguments are updated in place.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp


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
BACKUP_TARGET = "hisparse_backup"


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


def _like(x: jax.Array):
  # The aliased result keeps the operand's own type (memory space included):
  # a plain ShapeDtypeStruct for a pinned_host pool aborts the process.
  return jax.typeof(x)


def swap_in(layer, top_k, seq_lens, host_rows, host_pool, hot, slot_tokens, lru, stats, *,
            target: str = SWAP_IN_TARGET):
  """Make the latent rows of each request's top-k positions resident on device.

  Args:
    layer: int32 scalar, the layer index l in [0, L).
    top_k: int32[B, K] token positions chosen by the indexer, -1 = padding.
    seq_lens: int32[B] tokens per request; the newest token is at seq_len - 1.
    host_rows: int32[B, S] position -> row of the host pool (page table).
    host_pool: T[L, H, W] latent KV of all tokens (``pinned_host`` memory).
    hot: T[L, B, D+1, W] hot buffers; slot D of each request is reserved for
      its newest token.
    slot_tokens: int32[L, B, D] token position held by each slot (-1 empty).
    lru: int32[L, B, D] slot ids of each request, least recently used first.
    stats: int32[L, B, 2] cumulative (hits, misses) per request and layer,
      counted over distinct non-padding positions.

  Returns:
    (rows, host_pool, hot, slot_tokens, lru, stats): rows is int32[B, K], the
    row of ``hot[l].reshape(B * (D + 1), W)`` holding each top-k entry (-1 for
    padding); the rest are the updated state (aliased to the inputs).

  Raises:
    jax.errors.JaxRuntimeError with INVALID_ARGUMENT (ValueError when the
    failed result is first read through NumPy) when K > D, a position is
    >= seq_len or < -1, a needed position has no host row in [0, H), an LRU
    row is not a permutation, or the layer is out of range. Nothing is
    modified in that case.

  ``target`` names another registration of the same handler (e.g. the Bazel
  build's library).

  Semantics: ``hisparse_jax.reference.swap_in`` (HiSparse, SGLang).
  """
  B, K = top_k.shape
  call = jax.ffi.ffi_call(
      target,
      (
          jax.ShapeDtypeStruct((B, K), jnp.int32),
          _like(host_pool),
          _like(hot),
          _like(slot_tokens),
          _like(lru),
          _like(stats),
      ),
      input_output_aliases={4: 1, 5: 2, 6: 3, 7: 4, 8: 5},
  )
  return call(
      jnp.asarray(layer, jnp.int32),
      top_k,
      seq_lens,
      host_rows,
      host_pool,
      hot,
      slot_tokens,
      lru,
      stats,
  )


def backup(layer, rows, dst, host_pool):
  """Write latent rows into the host pool: ``pool[layer + i, dst[n]] = rows[i, n]``.

  Args:
    layer: int32 scalar, first layer written.
    rows: T[Lr, N, W] rows on device (Lr consecutive layers).
    dst: int32[N] host-pool row of each column; -1 skips it.
    host_pool: T[L, H, W] (``pinned_host``), aliased to the result.

  Returns:
    The updated host pool.

  Raises:
    jax.errors.JaxRuntimeError (INVALID_ARGUMENT) on a dst outside [-1, H), a
    layer range outside [0, L), or mismatched dtype / row width.
  """
  call = jax.ffi.ffi_call(BACKUP_TARGET, _like(host_pool), input_output_aliases={3: 0})
  return call(jnp.asarray(layer, jnp.int32), rows, dst, host_pool)
