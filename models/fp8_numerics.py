"""FP8 deployment numerics of DeepSeek-V3.2 (optional; off by default).

DeepSeek's own V3.2 inference code (``inference/model.py`` + ``kernel.py`` of
DeepSeek-V3.2-Exp) runs two parts of the attention in FP8, and this mode
reproduces their numerics with fake quantization (quantize, then dequantize
back to the compute dtype) so that logits match a deployment that stores FP8:

* Lightning indexer: after RoPE, queries and keys are rotated by a normalized
  Walsh-Hadamard transform over the head dim (``rotate_activation``:
  ``H_d x / sqrt(d)``), then quantized to e4m3 in blocks of 128 with
  power-of-two ("ue8m0") scales (``act_quant(x, 128, "ue8m0")``). The index
  score is the unquantized formula applied to the dequantized q and k (the
  FP8 kernel folds the q scale into the head weights and the k scale into the
  key, which is the same product).
* MLA latent KV: the normalized compressed KV (kv_lora_rank part; not the
  RoPE part) is fake-quantized the same way before it is used and cached
  ("we use fp8 kv cache in actual deployment, so here we simulate the
  precision by casting kv to fp8 and then back").

Quantizer, per block of ``block`` elements along the last axis (a last
partial block is allowed here; DeepSeek's dims are multiples of 128):
    amax  = max(|x|), floored at 1e-4
    scale = amax / 448                       (448 = largest e4m3 value)
    scale = 2 ** ceil(log2(scale))            (ue8m0: power of two, rounds up)
    q     = e4m3(clip(x / scale, -448, 448))  (round to nearest even)
    x'    = q * scale
Because the ue8m0 scale rounds up, |x / scale| <= 448 always; the clip only
matters for non-power-of-two scales and keeps e4m3fn (which has no infinity)
from overflowing to NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
BLOCK = 128


def _blocks(x: jax.Array, block: int):
  """[..., n] -> ([..., nb, block] zero-padded, n)."""
  n = x.shape[-1]
  nb = -(-n // block)
  pad = nb * block - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], nb, block), n


def quantize_e4m3(x: jax.Array, block: int = BLOCK, scale_fmt: str | None = "ue8m0"):
  """Block-wise e4m3 quantization along the last axis.

  Args:
    x: [..., n] float array.
    block: elements per scale (the last block may be partial).
    scale_fmt: "ue8m0" (power-of-two scales, DeepSeek-V3.2) or None (amax / 448).

  Returns:
    (q float8_e4m3fn[..., n], scale float32[..., ceil(n / block)]).
  """
  xb, n = _blocks(x.astype(jnp.float32), block)
  amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), AMAX_FLOOR)
  scale = amax / E4M3_MAX
  if scale_fmt == "ue8m0":
    # 2 ** ceil(log2(scale)), exactly: scale = m * 2**e with m in [0.5, 1) (exp2/log2 are approximate).
    m, e = jnp.frexp(scale)
    scale = jnp.ldexp(jnp.ones_like(scale), e - (m == 0.5).astype(e.dtype))
  elif scale_fmt is not None:
    raise ValueError(f"unsupported scale_fmt {scale_fmt!r} (only 'ue8m0' or None)")
  q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
  q = q.reshape(*q.shape[:-2], q.shape[-2] * block)[..., :n]  # not -1: zero-row arrays have no inferable axis
  return q, scale[..., 0]


def dequantize_e4m3(q: jax.Array, scale: jax.Array, dtype, block: int = BLOCK) -> jax.Array:
  """dtype[..., n]: q float8_e4m3fn[..., n] times its block's scale float32[..., ceil(n / block)] (the product
  in float32, then cast): the inverse of ``quantize_e4m3`` up to its rounding."""
  qb, n = _blocks(q.astype(jnp.float32), block)
  return (qb * scale[..., None]).reshape(*qb.shape[:-2], qb.shape[-2] * block)[..., :n].astype(dtype)


def fake_quant_e4m3(x: jax.Array, block: int = BLOCK, scale_fmt: str | None = "ue8m0") -> jax.Array:
  """quantize_e4m3 then dequantize: x rounded to what an FP8 store keeps, in x's dtype."""
  q, scale = quantize_e4m3(x, block, scale_fmt)
  return dequantize_e4m3(q, scale, x.dtype, block)


@functools.lru_cache(maxsize=8)
def _hadamard(d: int) -> np.ndarray:
  if d < 1 or d & (d - 1):
    raise ValueError(f"the Hadamard rotation needs a power-of-two dim, got {d}")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < d:  # Sylvester construction
    h = np.block([[h, h], [h, -h]])
  return h / np.sqrt(d, dtype=np.float32)


def hadamard_rotate(x: jax.Array) -> jax.Array:
  """Normalized Walsh-Hadamard transform over the last axis (orthogonal: dot products are kept).

  x: [..., d] with d a power of two -> [..., d] in x's dtype, computed in float32.
  Source: DeepSeek-V3.2 ``rotate_activation`` (fast_hadamard_transform with scale d**-0.5).
  """
  h = jnp.asarray(_hadamard(x.shape[-1]))
  return jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def indexer_fp8(x: jax.Array) -> jax.Array:
  """Indexer q / k as the FP8 indexer sees them: rotate, then e4m3 with ue8m0 scales per 128."""
  return fake_quant_e4m3(hadamard_rotate(x), BLOCK, "ue8m0")
