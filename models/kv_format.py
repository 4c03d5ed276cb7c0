"""How a latent KV-cache row is stored: ``--kv-cache-dtype`` (``auto`` or ``fp8_e4m3``).

A latent row is W = kv_lora_rank + qk_rope_head_dim values (C + dr): the normalized compressed KV and the
roped key. Every cache (``models/kv_protocol.py``, ``hisparse_jax/memory``) stores rows of some dtype and
width without looking inside them; the model encodes a row before ``cache.append`` and decodes what
``cache.gather`` returns (``MLAttention``), so dense KV, HiSparse's hot buffers, its host pool and the
prefill/decode hand-off all hold the same bytes.

* ``auto``: the row as it is, W values of the compute dtype.
* ``fp8_e4m3``: DeepSeek-V3.2's FP8 KV cache, the 656-byte row of its deployment (DeepSeek-V3.2-Exp
  ``inference/model.py``: "we use fp8 kv cache in actual deployment"; FlashMLA's FP8 sparse decoding
  kernels read the same layout) as one uint8 row:

      bytes [0, C)                 the C latent values in float8_e4m3fn, quantized in blocks of 128 with
                                   power-of-two scales (``models.fp8_numerics.quantize_e4m3``, "ue8m0")
      bytes [C, C + 4 * nb)        the nb = ceil(C / 128) block scales, float32 (little-endian)
      bytes [C + 4 * nb, end)      the dr roped key values in the compute dtype (bfloat16 in deployment)

  C 512, dr 64, bfloat16 (DeepSeek-V3.2, GLM-5): 512 + 16 + 128 = 656 bytes against 1,152 in bfloat16, so a
  host pool, a hot buffer and a dense KV cache hold 1.76x the tokens in the same bytes, and a swap-in miss
  moves 43% fewer bytes over PCIe. Decoding gives exactly ``fake_quant_e4m3`` of the latent part (the same
  float32 product, then the cast): what ``--fp8-numerics`` simulates, so the two agree bit for bit.

  The lightning indexer's keys are stored in FP8 too, as DeepSeek's FP8 indexer reads them (its key cache:
  the Hadamard-rotated key in e4m3 with one power-of-two scale per 128 values): Di + 4 ceil(Di / 128) bytes,
  132 against 512 in float32 for Di 128. HiSparse keeps every token's key on device, so this is most of
  what a HiSparse request holds there. The FP8 format implies the FP8 indexer numerics
  (``DSAConfig.fp8_active``): the model computes exactly what ``--fp8-numerics`` simulates, now stored.

Non-finite values: a block holding inf or NaN gets scale 1 (``quantize_e4m3``'s frexp of a non-finite amax),
so inf is stored as +-448 and NaN stays NaN, with the block's other values quantized at that scale; exactly
what ``--fp8-numerics`` computes.

Only whole-byte little-endian hosts are supported (every JAX platform); bytes cross processes and servers
unchanged (both ends must use the same format: the disaggregation handshake compares row width and dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .fp8_numerics import BLOCK, dequantize_e4m3, quantize_e4m3

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def check_kv_cache_dtype(kind: str) -> str:
  """kind, or ValueError naming the choices."""
  if kind not in KV_CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kind!r}")
  return kind


def row_spec(kind: str, kv_lora_rank: int, rope_dim: int, dtype) -> tuple[int, np.dtype]:
  """(width, storage dtype) of one stored row: (C + dr, dtype) for ``auto``; (C + 4 ceil(C / 128) + dr x
  itemsize, uint8) for ``fp8_e4m3``. Raises ValueError for an unknown kind."""
  dtype = np.dtype(dtype)
  if check_kv_cache_dtype(kind) == "auto":
    return kv_lora_rank + rope_dim, dtype
  return kv_lora_rank + 4 * -(-kv_lora_rank // BLOCK) + rope_dim * dtype.itemsize, np.dtype(np.uint8)


def index_spec(kind: str, index_dim: int) -> tuple[int, np.dtype]:
  """(width, storage dtype) of one stored indexer key: (Di, float32) for ``auto``; (Di + 4 ceil(Di / 128), uint8)
  for ``fp8_e4m3``. Raises ValueError for an unknown kind."""
  if check_kv_cache_dtype(kind) == "auto":
    return index_dim, np.dtype(np.float32)
  return index_dim + 4 * -(-index_dim // BLOCK), np.dtype(np.uint8)


def _bytes(x: jax.Array) -> jax.Array:
  """uint8[..., n * itemsize]: x's bytes, element by element."""
  b = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return b if b.ndim == x.ndim else b.reshape(*x.shape[:-1], b.shape[-2] * b.shape[-1])


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
  """dtype[..., n / itemsize] from uint8[..., n] (the inverse of ``_bytes``)."""
  size = np.dtype(dtype).itemsize
  if size > 1:
    b = b.reshape(*b.shape[:-1], b.shape[-1] // size, size)
  return jax.lax.bitcast_convert_type(b, dtype)


def encode(kind: str, latent: jax.Array, kv_lora_rank: int) -> jax.Array:
  """The stored form of latent rows dtype[..., C + dr]: themselves (``auto``) or uint8[..., width] (the module
  docstring's layout). Raises ValueError for an unknown kind."""
  check_kv_cache_dtype(kind)
  if kind == "auto":
    return latent
  c, pe = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]
  q, scale = quantize_e4m3(c)
  return jnp.concatenate([_bytes(q), _bytes(scale), _bytes(pe)], axis=-1)


def decode(kind: str, rows: jax.Array, kv_lora_rank: int, dtype) -> jax.Array:
  """dtype[..., C + dr]: latent rows from their stored form (``encode``'s; all-zero bytes decode to zeros).
  Raises ValueError for an unknown kind, or FP8 rows that are not uint8 or too narrow, or whose RoPE part is not
  whole dtype values."""
  check_kv_cache_dtype(kind)
  if kind == "auto":
    return rows.astype(dtype)
  C, nb = kv_lora_rank, -(-kv_lora_rank // BLOCK)
  rope_bytes = rows.shape[-1] - C - 4 * nb
  if rows.dtype != jnp.uint8 or rope_bytes < 0 or rope_bytes % np.dtype(dtype).itemsize:
    raise ValueError(
      f"FP8 latent rows must be uint8 of {C} + {4 * nb} + (RoPE values x {np.dtype(dtype).itemsize}) "
      f"bytes for kv_lora_rank {C}; got {rows.dtype} rows of {rows.shape[-1]}"
    )
  q = _from_bytes(rows[..., :C], jnp.float8_e4m3fn)
  scale = _from_bytes(rows[..., C : C + 4 * nb], jnp.float32)
  pe = _from_bytes(rows[..., C + 4 * nb :], dtype)
  return jnp.concatenate([dequantize_e4m3(q, scale, dtype), pe], axis=-1)


def encode_keys(kind: str, keys: jax.Array) -> jax.Array:
  """The stored form of indexer keys float32[..., Di]: themselves (``auto``), or uint8[..., Di + 4 nb]: the e4m3
  values, then the block scales (float32). Raises ValueError for an unknown kind."""
  check_kv_cache_dtype(kind)
  if kind == "auto":
    return keys
  q, scale = quantize_e4m3(keys)
  return jnp.concatenate([_bytes(q), _bytes(scale)], axis=-1)


def decode_keys(stored: jax.Array) -> jax.Array:
  """float32[..., Di]: indexer keys from their stored form, told apart by dtype (float32: as they are; uint8:
  ``encode_keys``' FP8 row, whose width Di + 4 ceil(Di / 128) gives Di back: nb = ceil(width / 132)). All-zero
  bytes decode to zeros. Raises TypeError for another dtype, ValueError for a width no Di gives."""
  if stored.dtype == jnp.float32:
    return stored
  if stored.dtype != jnp.uint8:
    raise TypeError(f"stored indexer keys must be float32 or uint8 (FP8 rows), got {stored.dtype}")
  nb = -(-stored.shape[-1] // (BLOCK + 4))
  Di = stored.shape[-1] - 4 * nb
  if Di < 1 or index_spec("fp8_e4m3", Di)[0] != stored.shape[-1]:
    raise ValueError(f"{stored.shape[-1]} bytes is not the width of an FP8 indexer key (Di + 4 ceil(Di / 128))")
  q = _from_bytes(stored[..., :Di], jnp.float8_e4m3fn)
  scale = _from_bytes(stored[..., Di:], jnp.float32)
  return dequantize_e4m3(q, scale, jnp.float32)
