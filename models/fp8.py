"""FP8 block-quantized weights (DeepSeek-V3 / V3.2, GLM-5 FP8 checkpoints).

Such a checkpoint stores a quantized Linear weight ``X.weight`` (HF layout [out, in]) as float8_e4m3fn
together with ``X.weight_scale_inv``: float32[ceil(out / 128), ceil(in / 128)], one scale per 128x128
block (the last block row / column is partial when a dimension is not a multiple of 128).  The
dequantized weight is ``W[i, j] = float(fp8[i, j]) * scale_inv[i // 128, j // 128]``.  Tensors that are
not quantized (norms, router weight and bias, embeddings, lm_head, the indexer's weights_proj) carry
no ``weight_scale_inv`` and load as they are.

Stacked weights ([..., out, in], e.g. fused experts) are quantized per trailing 2-D matrix, with
scales [..., ceil(out / 128), ceil(in / 128)].
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)
# Block-scale dtypes real checkpoints use: float32 (DeepSeek-V3/V3.2), bfloat16, and float8_e8m0fnu
# (power-of-two scales, as in MX formats); each converts to float32 exactly.
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e8m0fnu))


def scale_key(weight_key: str) -> str:
  """HF key of the block scales of ``weight_key``."""
  return weight_key + SCALE_SUFFIX


def is_fp8(array: np.ndarray) -> bool:
  return array.dtype in FP8_DTYPES


def scale_shape(weight_shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, ...]:
  """Expected shape of the scales of a weight of ``weight_shape``."""
  br, bc = block_size
  *lead, rows, cols = weight_shape
  return (*lead, math.ceil(rows / br), math.ceil(cols / bc))


def dequantize_block_fp8(
  weight: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int] = (128, 128), *, name: str = "weight"
) -> np.ndarray:
  """float8_e4m3fn[..., R, C] weight and [..., ceil(R/br), ceil(C/bc)] scales (a ``SCALE_DTYPES`` dtype:
  float32, bfloat16 or float8_e8m0fnu) -> float32[..., R, C].

  Raises ValueError (naming ``name``) when the weight is not float8_e4m3fn, the scales have another
  dtype, or the scale shape does not match the block size.
  """
  if weight.ndim < 2:
    raise ValueError(f"FP8 tensor {name!r} must have at least 2 dimensions, got shape {weight.shape}")
  if not is_fp8(weight):
    raise ValueError(
      f"tensor {name!r} has a {scale_key('')!r} companion but dtype {weight.dtype} (expected float8_e4m3fn)"
    )
  if scale_inv.dtype not in SCALE_DTYPES:
    raise ValueError(
      f"scales {scale_key(name)!r} have dtype {scale_inv.dtype}; expected one of "
      f"{', '.join(str(d) for d in SCALE_DTYPES)}"
    )
  want = scale_shape(weight.shape, block_size)
  if tuple(scale_inv.shape) != want:
    raise ValueError(
      f"scales {scale_key(name)!r} have shape {tuple(scale_inv.shape)}, expected {want} for a "
      f"weight of shape {tuple(weight.shape)} with block size {tuple(block_size)}"
    )
  br, bc = block_size
  rows, cols = weight.shape[-2:]
  out = weight.astype(np.float32)
  s = scale_inv.astype(np.float32)
  # Multiply block row by block row (no full-size expanded scale array).
  for i in range(want[-2]):
    r0, r1 = i * br, min((i + 1) * br, rows)
    expanded = np.repeat(s[..., i : i + 1, :], bc, axis=-1)[..., :cols]  # [..., 1, C]
    out[..., r0:r1, :] *= expanded
  return out


def dequantize_jax(weight, scale, dtype, block_size: tuple[int, int] = (128, 128)):
  """The same dequantization inside jit: float8_e4m3fn[..., R, C] weight, float32[..., ceil(R/br),
  ceil(C/bc)] scales -> dtype[..., R, C] = (float32(weight) * scale of its block).astype(dtype).

  Bit for bit what ``dequantize_block_fp8`` followed by a cast to dtype gives (one float32 product per
  element, then one rounding), so a model keeping FP8 weights on device computes with exactly the
  weights of a model that dequantized them at load."""
  import jax.numpy as jnp

  br, bc = block_size
  rows, cols = weight.shape[-2:]
  s = jnp.repeat(jnp.repeat(scale, br, axis=-2), bc, axis=-1)[..., :rows, :cols]
  return (weight.astype(jnp.float32) * s).astype(dtype)
