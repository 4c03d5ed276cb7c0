"""DeepSeek-Sparse-Attention causal LMs in Flax NNX: DeepSeek-V3.2 and GLM-5 / GLM-5.1.

Numerically follows transformers 5.24 ``transformers/models/deepseek_v32/modeling_deepseek_v32.py`` and
``transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py`` (one implementation; the differences are conventions in
:class:`~models.config.DSAConfig`, see models/config.py):

* RMSNorm computes in float32 and casts back to the input dtype before the weight multiply.
* MLA: q_a_proj -> q_a_layernorm -> q_b_proj (heads split nope-first); kv_a_proj_with_mqa ->
  (kv_lora | k_pe), kv_a_layernorm on the kv_lora part; RoPE on the rope slices is the *interleaved*
  DeepSeek variant, written (as transformers does) as ``cat(x_even*cos - x_odd*sin, x_odd*cos + x_even*sin)``,
  i.e. the rotated rope slice comes out de-interleaved.  The same layout is stored in the KV cache,
  and q/k use the same layout, so dot products equal the reference.
* Indexer (lightning indexer): rope-first head split; RoPE *non-interleaved* (rotate-half) for
  DeepSeek-V3.2, interleaved (same layout as MLA) for GLM (``cfg.indexer_rope_interleave``);
  ``score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] * index_head_dim**-0.5)`` with
  ``w = weights_proj(x) * index_n_heads**-0.5``; causal top-k with k = min(index_topk, visible).
* Cross-layer top-k sharing (GLM ``indexer_types``): a "shared" layer has no indexer and attends to
  the top-k positions chosen by the nearest "full" layer before it.  It still goes through the same
  cache calls: ``append`` (with an all-zero indexer key, never read) and ``gather`` with the borrowed
  top-k; it skips the indexer.
* MoE: sigmoid router in float32, ``e_score_correction_bias`` for selection only, group-limited
  routing (group score = sum of the group's top-2), norm_topk_prob, routed_scaling_factor, shared
  experts.  Routed experts run only on their tokens (sorted, blocked grouped GEMM: ``models/moe.py``).
* Softmax in float32; logits returned as float32.

Linear weights are stored as ``kernel`` with shape [in, out] (HF stores [out, in]; the loader
transposes).  Router weight and bias and the indexer's ``weights_proj`` stay float32 whatever the
model dtype (transformers' ``_keep_in_fp32_modules``).

One forward path serves prefill and decode (``DeepseekV32ForCausalLM.forward``): Q tokens per batch row at
given positions, through the KV-cache protocol of ``models/kv_protocol.py``.  Attention is sparse in both:
every query attends only to its indexer top-k (``min(index_topk, position + 1)`` keys), with the MLA
queries absorbed into the latent space (DeepSeek's sparse MLA), so a prefill chunk of C tokens costs
O(C * index_topk) attention and O(C * context) indexer scoring (blockwise, running top-k) -- nothing is
quadratic in memory.  transformers computes the same selection with a dense causal mask and expanded
(non-absorbed) heads; the results agree to float32 rounding.  ``prefill`` runs a chunk (logits at each
row's last token), ``decode`` one token per row.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import kv_format
from .config import DSAConfig, RopeConfig
from .fp8_numerics import fake_quant_e4m3, hadamard_rotate, indexer_fp8
from .kv_protocol import ContiguousKVCache, KVCache, index_scores
from .fp8 import dequantize_jax
from .moe import ExpertParallel, expert_parallel_ffn, grouped_expert_ffn

_F32 = jnp.float32
_NEG = float(np.finfo(np.float32).min)

# (x float32[..., N], k) -> (values float32[..., k], indices int32[..., k]): the k largest of each row in
# descending order, equal values by ascending index, exactly as ``jax.lax.top_k``. The indexer's selection.
TopK = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]


def _precision(*arrays) -> jax.lax.Precision:
  """Full-precision matmuls for float32 operands (TF32 would break fp32 parity on GPUs)."""
  if all(a.dtype == _F32 for a in arrays):
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def _einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(spec, a, b, precision=_precision(a, b))


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  return (jax.random.normal(rngs.params(), shape, _F32) * std).astype(dtype)


# ----------------------------------------------------------------------------- RoPE
@functools.lru_cache(maxsize=64)
def _inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
  return rope.inv_freq(dim)


def rope_cos_sin(rope: RopeConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin: float32[*positions.shape, dim // 2] (already multiplied by the YaRN attention factor)."""
  inv = jnp.asarray(_inv_freq(rope, dim))
  freqs = positions.astype(_F32)[..., None] * inv
  scale = rope.cos_sin_scale
  return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """MLA RoPE. x: [..., d] with pairs (x0, x1), (x2, x3), ...; cos/sin: broadcastable to [..., d//2].
  Returns [..., d] = cat(x_even*cos - x_odd*sin, x_odd*cos + x_even*sin)."""
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Indexer RoPE (non-interleaved, rotate-half). x: [..., d]; cos/sin broadcastable to [..., d//2]."""
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  h = x.shape[-1] // 2
  x1, x2 = x[..., :h], x[..., h:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ----------------------------------------------------------------------------- basic layers
class Linear(nnx.Module):
  """y = x @ kernel, kernel: dtype[in, out] (no bias). The input is cast to the kernel dtype.

  FP8-resident (set by ``models.loader.load_hf(fp8_weights=True)``): kernel float8_e4m3fn[in, out] with
  kernel_scale float32[ceil(in / 128), ceil(out / 128)], dequantized to compute_dtype inside the jitted
  matmul (``models.fp8.dequantize_jax``)."""

  def __init__(self, d_in: int, d_out: int, *, dtype, std: float, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), std, dtype))
    self.kernel_scale = nnx.data(None)  # a data attribute: FP8 loading may put a Param here
    self.compute_dtype = None

  def weight(self) -> jax.Array:
    """The kernel [in, out] in the compute dtype (dequantized when FP8-resident)."""
    w = self.kernel[...]
    if self.kernel_scale is not None:
      w = dequantize_jax(w, self.kernel_scale[...], self.compute_dtype)
    return w

  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.weight()
    x = x.astype(w.dtype)
    return jnp.matmul(x, w, precision=_precision(x, w))


class RMSNorm(nnx.Module):
  """weight * (x / sqrt(mean(x^2) + eps)), the normalisation in float32. weight: dtype[d]."""

  def __init__(self, dim: int, eps: float, *, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(_F32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
  """torch.nn.LayerNorm (biased variance, affine), computed in float32. weight, bias: dtype[d]."""

  def __init__(self, dim: int, eps: float, *, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.bias = nnx.Param(jnp.zeros((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(_F32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
    y = y * self.weight[...].astype(_F32) + self.bias[...].astype(_F32)
    return y.astype(x.dtype)


class MLP(nnx.Module):
  """SwiGLU MLP: down(silu(gate(x)) * up(x)). Used for dense layers and the shared experts."""

  def __init__(self, hidden: int, inter: int, *, dtype, std: float, rngs: nnx.Rngs):
    self.gate_proj = Linear(hidden, inter, dtype=dtype, std=std, rngs=rngs)
    self.up_proj = Linear(hidden, inter, dtype=dtype, std=std, rngs=rngs)
    self.down_proj = Linear(inter, hidden, dtype=dtype, std=std, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- indexer
class Indexer(nnx.Module):
  """Lightning indexer: picks the top-k key positions per query for DSA.

  wq_b: [q_lora_rank, nI*Di]; wk: [H, Di]; k_norm: LayerNorm(Di, eps=1e-6);
  weights_proj: float32[H, nI]. Heads split rope-first (qk_rope_head_dim rotated, rest passed).
  top_k: the exact top-k the selection runs (``TopK``).
  """

  def __init__(self, cfg: DSAConfig, *, dtype, rngs: nnx.Rngs, top_k: TopK = jax.lax.top_k):
    std = cfg.initializer_range
    self.exact_top_k = top_k
    self.n_heads = cfg.index_n_heads
    self.head_dim = cfg.index_head_dim
    self.rope_dim = cfg.qk_rope_head_dim
    self.k = cfg.index_topk
    self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, std=std, rngs=rngs)
    self.wk = Linear(cfg.hidden_size, self.head_dim, dtype=dtype, std=std, rngs=rngs)
    self.k_norm = LayerNorm(self.head_dim, 1e-6, dtype=dtype)
    self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=_F32, std=std, rngs=rngs)
    self.softmax_scale = self.head_dim**-0.5
    self.interleave = cfg.indexer_rope_interleave
    self.fp8 = cfg.fp8_active  # Hadamard + e4m3 quantization of q and k (models/fp8_numerics.py)
    self.kv_cache_dtype = cfg.kv_cache_dtype  # an FP8 cache stores the keys quantized (models/kv_format.py)

  def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    r = self.rope_dim
    rope = apply_rope_interleaved if self.interleave else apply_rope_half
    return jnp.concatenate([rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)

  def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [..., H]; cos/sin: [..., r/2] -> float32[..., Di] (normed, roped)."""
    k = self._rope(self.k_norm(self.wk(x)), cos, sin)
    if self.fp8:  # an FP8 cache quantizes the rotated key itself (kv_format.encode_keys): the same values
      k = indexer_fp8(k) if self.kv_cache_dtype == "auto" else hadamard_rotate(k)
    return k.astype(_F32)

  def queries(self, q_resid: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """q_resid: [..., q_lora]; cos/sin: [..., r/2] -> float32[..., nI, Di]."""
    q = self.wq_b(q_resid)
    q = q.reshape(*q.shape[:-1], self.n_heads, self.head_dim)
    q = self._rope(q, cos[..., None, :], sin[..., None, :])
    return (indexer_fp8(q) if self.fp8 else q).astype(_F32)

  def head_weights(self, x: jax.Array) -> jax.Array:
    """x: [..., H] -> float32[..., nI]."""
    return self.weights_proj(x).astype(_F32) * (self.n_heads**-0.5)

  def select(
    self,
    x,
    q_resid,
    cos,
    sin,
    positions,
    layer: int,
    cache: KVCache,
    *,
    window: int,
    key_block: int,
    score_block: int | None = None,
  ) -> jax.Array:
    """Causal top-k key positions of every query, scored blockwise over the cached keys.

    x: [B, Q, H]; q_resid: [B, Q, q_lora]; cos/sin: [B, Q, r/2]; positions: int32[B, Q] (-1 padding).
    Static sizes: window, the keys scored (positions [0, window), covering every position; a multiple of
    key_block); key_block, keys read from the cache and scored at a time (bounds the [B, Q, heads, block]
    intermediate); score_block, scores kept before a top-k (a multiple of key_block; None: the window).
    ``score[q, t] = sum_h w[q, h] * relu(q_h . k_t * Di**-0.5)`` for t <= position(q). Each score block's
    scores are merged into a running top-k (one top-k over the whole window when it fits a score block),
    so memory is O(B * Q * (K + score_block)) whatever the context. The top-k is the one the model was built
    with (``TopK``; the engine gives its CPU kernel, XLA's sorts whole rows). Returns int32[B, Q, K]: the top
    min(K, position + 1) positions by score, ties to the lower position (``jax.lax.top_k``'s order on a
    whole row, which the merge reproduces exactly), -1 after them and for padding.
    """
    if window % key_block or (score_block is not None and (score_block % key_block or window % score_block)):
      raise ValueError(f"window {window} / score_block {score_block} / key_block {key_block} do not nest")
    q = self.queries(q_resid, cos, sin)  # [B, Q, nI, Di]
    w = self.head_weights(x)  # [B, Q, nI]
    B, Q = positions.shape
    K = self.k

    def scores(start):  # float32[B, Q, key_block], -inf where not causal
      keys = kv_format.decode_keys(cache.index_keys(layer, start, key_block))  # float32[B, T, Di]
      out = index_scores(q, w, keys)
      kpos = start + jnp.arange(key_block, dtype=jnp.int32)
      return jnp.where(kpos[None, None, :] <= positions[..., None], out, -jnp.inf)

    def block_scores(start, size):  # float32[B, Q, size], written in place block by block
      if size == key_block:
        return scores(start)

      def fill(j, out):
        return jax.lax.dynamic_update_slice_in_dim(out, scores(start + j * key_block), j * key_block, axis=2)

      return jax.lax.fori_loop(0, size // key_block, fill, jnp.zeros((B, Q, size), _F32))

    S = window if score_block is None else min(score_block, window)
    if S == window:  # one top-k over the whole window; positions are the indices
      k = min(K, window)
      vals, idx = self.exact_top_k(block_scores(0, window), k)
      vals = jnp.pad(vals, ((0, 0), (0, 0), (0, K - k)), constant_values=-jnp.inf)
      idx = jnp.pad(idx.astype(jnp.int32), ((0, 0), (0, 0), (0, K - k)), constant_values=-1)
    else:

      def step(i, carry):
        vals, idx = carry
        start = i * S
        merged = jnp.concatenate([vals, block_scores(start, S)], axis=-1)
        kpos = start + jnp.arange(S, dtype=jnp.int32)
        merged_idx = jnp.concatenate([idx, jnp.broadcast_to(kpos, (B, Q, S))], axis=-1)
        vals, pick = self.exact_top_k(merged, K)  # earlier (lower) positions first on ties
        return vals, jnp.take_along_axis(merged_idx, pick, axis=-1)

      init = (jnp.full((B, Q, K), -jnp.inf, _F32), jnp.full((B, Q, K), -1, jnp.int32))
      vals, idx = jax.lax.fori_loop(0, window // S, step, init)
    return jnp.where(vals > -jnp.inf, idx, -1)


# ----------------------------------------------------------------------------- attention
class MLAttention(nnx.Module):
  """Multi-head latent attention with a DSA indexer.

  q_a_proj [H, q_lora] -> q_a_layernorm -> q_b_proj [q_lora, nH*(dn+dr)];
  kv_a_proj_with_mqa [H, C+dr] -> (C | k_pe), kv_a_layernorm(C); kv_b_proj [C, nH*(dn+dv)];
  o_proj [nH*dv, H].  (C = kv_lora_rank, dn/dr/dv = nope/rope/v head dims.)
  """

  def __init__(self, cfg: DSAConfig, *, dtype, rngs: nnx.Rngs, has_indexer: bool = True, top_k: TopK = jax.lax.top_k):
    std = cfg.initializer_range
    self.n_heads = cfg.num_attention_heads
    self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    self.kv_lora = cfg.kv_lora_rank
    self.index_dim = cfg.index_head_dim
    self.scale = cfg.softmax_scale
    self.fp8 = cfg.fp8_active  # e4m3 quantization of the cached latent KV (models/fp8_numerics.py)
    self.kv_cache_dtype = cfg.kv_cache_dtype  # how the cache stores a latent row (models/kv_format.py)
    self.rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope_half
    self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype, std=std, rngs=rngs)
    self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype=dtype)
    self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * (self.dn + self.dr), dtype=dtype, std=std, rngs=rngs)
    self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora + self.dr, dtype=dtype, std=std, rngs=rngs)
    self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.latent_norm_eps, dtype=dtype)
    self.kv_b_proj = Linear(self.kv_lora, self.n_heads * (self.dn + self.dv), dtype=dtype, std=std, rngs=rngs)
    self.o_proj = Linear(self.n_heads * self.dv, cfg.hidden_size, dtype=dtype, std=std, rngs=rngs)
    # None on a "shared" layer (GLM cross-layer top-k sharing): it borrows an earlier layer's top-k.
    self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs, top_k=top_k) if has_indexer else None

  def _queries(self, x, cos, sin):
    """x: [..., H] -> q_resid [..., q_lora], q_nope [..., nH, dn], q_pe [..., nH, dr] (roped)."""
    q_resid = self.q_a_layernorm(self.q_a_proj(x))
    q = self.q_b_proj(q_resid)
    q = q.reshape(*q.shape[:-1], self.n_heads, self.dn + self.dr)
    q_nope, q_pe = q[..., : self.dn], q[..., self.dn :]
    q_pe = self.rope(q_pe, cos[..., None, :], sin[..., None, :])
    return q_resid, q_nope, q_pe

  def latent(self, x, cos, sin) -> jax.Array:
    """x: [..., H] -> dtype[..., C + dr] = cat(kv_a_layernorm(c_kv), rope(k_pe)) (the KV-cache row)."""
    ckv = self.kv_a_proj_with_mqa(x)
    c, k_pe = ckv[..., : self.kv_lora], ckv[..., self.kv_lora :]
    c = self.kv_a_layernorm(c)
    # DeepSeek-V3.2 deployment keeps this part of the KV cache in FP8; an FP8 cache quantizes it when it
    # stores the row (kv_format.encode), and what it gives back is exactly this fake quantization.
    if self.fp8 and self.kv_cache_dtype == "auto":
      c = fake_quant_e4m3(c)
    return jnp.concatenate([c, self.rope(k_pe, cos, sin)], axis=-1)

  def __call__(
    self,
    x,
    cos,
    sin,
    positions,
    layer: int,
    cache: KVCache,
    prev_topk=None,
    *,
    index_blocks: dict,
    query_block: int | None = None,
  ):
    """Sparse MLA for Q query tokens per row through the KV-cache protocol (``models/kv_protocol.py``).

    x: [B, Q, H]; cos/sin: [B, Q, dr/2]; positions: int32[B, Q] (-1 padding); prev_topk: int32[B, Q, K],
    the previous layer's top-k (used, and required, only when this layer has no indexer); index_blocks: the
    static window / key_block / score_block of ``Indexer.select``; query_block: static, attend this many
    queries at a time (bounds the gathered rows to B * query_block * K * W; Q must be a multiple; None: all
    at once).
    append -> indexer top-k over the cached keys -> gather the top-k latent rows -> absorbed MLA
    (queries absorbed into the latent space, as DeepSeek's sparse MLA kernels compute it).
    Returns out [B, Q, H], cache, this layer's top-k int32[B, Q, K].
    """
    B, Q = positions.shape
    q_resid, q_nope, q_pe = self._queries(x, cos, sin)  # [B, Q, q_lora], [B, Q, nH, dn], [B, Q, nH, dr]
    lat = self.latent(x, cos, sin)  # [B, Q, W]
    stored = kv_format.encode(self.kv_cache_dtype, lat, self.kv_lora)  # the cache's row ([B, Q, W'])
    index_q = index_w = None  # for a cache that scores positions itself (kv_protocol.index_scores)
    if self.indexer is not None:
      keys = kv_format.encode_keys(self.kv_cache_dtype, self.indexer.keys(x, cos, sin))
      cache = cache.append(layer, positions, stored, keys)
      topk = self.indexer.select(x, q_resid, cos, sin, positions, layer, cache, **index_blocks)
      index_q, index_w = self.indexer.queries(q_resid, cos, sin), self.indexer.head_weights(x)
    else:
      if prev_topk is None:
        raise ValueError("a layer without an indexer needs the previous layer's top-k")
      zeros = kv_format.encode_keys(self.kv_cache_dtype, jnp.zeros((B, Q, self.index_dim), _F32))
      cache = cache.append(layer, positions, stored, zeros)
      topk = prev_topk

    w = self.kv_b_proj.weight().reshape(self.kv_lora, self.n_heads, self.dn + self.dv)
    w_uk, w_uv = w[..., : self.dn], w[..., self.dn :]  # [C, nH, dn], [C, nH, dv]

    def attend(cache, q_nope, q_pe, pos, tk):  # one block of queries: [B, q, ...]
      rows, cache = cache.gather(layer, pos, tk, index_q, index_w)  # [B, q, K, W'] as stored
      rows = kv_format.decode(self.kv_cache_dtype, rows, self.kv_lora, lat.dtype)  # [B, q, K, W]
      c_kv, k_pe = rows[..., : self.kv_lora], rows[..., self.kv_lora :]
      q_abs = _einsum("bqhd,chd->bqhc", q_nope, w_uk)  # [B, q, nH, C]
      scores = _einsum("bqhc,bqkc->bqhk", q_abs, c_kv) + _einsum("bqhr,bqkr->bqhk", q_pe, k_pe)
      scores = scores.astype(_F32) * self.scale  # [B, q, nH, K]
      scores = jnp.where((tk >= 0)[:, :, None, :], scores, _NEG)
      p = jax.nn.softmax(scores, axis=-1).astype(c_kv.dtype)
      o_lat = _einsum("bqhk,bqkc->bqhc", p, c_kv)  # [B, q, nH, C]
      return _einsum("bqhc,chv->bqhv", o_lat, w_uv), cache  # [B, q, nH, dv]

    if query_block is None or query_block >= Q:
      o, cache = attend(cache, q_nope, q_pe, positions, topk)
    else:
      if Q % query_block:
        raise ValueError(f"query_block {query_block} does not divide the {Q} queries")
      n = Q // query_block

      def blocks(a):  # [B, Q, ...] -> [n, B, query_block, ...]
        return jnp.moveaxis(a.reshape(B, n, query_block, *a.shape[2:]), 1, 0)

      def one(args):
        o, new = attend(cache, *args)
        if new is not cache:
          raise TypeError("query blocks need a cache whose gather does not change it (a prefill cache)")
        return o

      o = jax.lax.map(one, tuple(map(blocks, (q_nope, q_pe, positions, topk))))
      o = jnp.moveaxis(o, 0, 1).reshape(B, Q, self.n_heads, self.dv)
    return self.o_proj(o.reshape(B, Q, self.n_heads * self.dv)), cache, topk


# ----------------------------------------------------------------------------- MoE
class MoE(nnx.Module):
  """DeepSeek-V3 MoE: sigmoid router with group-limited top-k + shared experts.

  gate_kernel: float32[H, E]; e_score_correction_bias: float32[E] (selection only);
  gate_proj/up_proj: dtype[E, H, I]; down_proj: dtype[E, I, H]; shared_experts: MLP(H, I * n_shared).
  Each routed expert runs only on the tokens routed to it (``models.moe.grouped_expert_ffn``: work
  proportional to tokens x experts per token, not tokens x experts); with ``expert_parallel``, each device
  runs its own experts (``models.moe.expert_parallel_ffn``).
  """

  def __init__(self, cfg: DSAConfig, *, dtype, rngs: nnx.Rngs, expert_parallel: ExpertParallel | None = None):
    std = cfg.initializer_range
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    self.n_experts, self.top_k = E, cfg.num_experts_per_tok
    self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
    self.norm_topk_prob = cfg.norm_topk_prob
    self.routed_scaling_factor = cfg.routed_scaling_factor
    self.gate_kernel = nnx.Param(_normal(rngs, (H, E), std, _F32))
    self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), _F32))
    self.gate_proj = nnx.Param(_normal(rngs, (E, H, I), std, dtype))
    self.up_proj = nnx.Param(_normal(rngs, (E, H, I), std, dtype))
    self.down_proj = nnx.Param(_normal(rngs, (E, I, H), std, dtype))
    self.shared_experts = MLP(H, I * cfg.n_shared_experts, dtype=dtype, std=std, rngs=rngs)
    self.expert_parallel = expert_parallel  # None: one device, or GSPMD's own split of each expert's width
    # FP8-resident experts (models.loader.load_hf(fp8_weights=True)): the three stacks in float8_e4m3fn
    # with float32 block scales [E, ceil(rows / 128), ceil(cols / 128)], dequantized per expert block.
    self.gate_proj_scale = nnx.data(None)
    self.up_proj_scale = nnx.data(None)
    self.down_proj_scale = nnx.data(None)
    self.expert_compute_dtype = None

  def routing(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [T, H] -> (int32[T, k] chosen experts, float32[T, k] their combine weights)."""
    T, E, G = x.shape[0], self.n_experts, self.n_group
    wg = self.gate_kernel[...]
    xf = x.astype(_F32)
    scores = jax.nn.sigmoid(jnp.matmul(xf, wg, precision=jax.lax.Precision.HIGHEST))  # [T, E]
    choice = scores + self.e_score_correction_bias[...]
    if G > 1:
      grouped = choice.reshape(T, G, E // G)
      group_scores = jax.lax.top_k(grouped, min(2, E // G))[0].sum(-1)  # [T, G]
      _, gidx = jax.lax.top_k(group_scores, self.topk_group)
      gmask = jnp.any(jax.nn.one_hot(gidx, G, dtype=bool), axis=1)  # [T, G]
      emask = jnp.repeat(gmask, E // G, axis=1)  # [T, E]
      choice = jnp.where(emask, choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, self.top_k)  # [T, k]
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if self.norm_topk_prob:
      w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * self.routed_scaling_factor
    return idx.astype(jnp.int32), w

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., H] -> [..., H]."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])  # [T, H]
    idx, w = self.routing(xt)
    gate, up, down = self.gate_proj[...], self.up_proj[...], self.down_proj[...]
    scales, precision = None, _precision(xt, gate)
    if self.gate_proj_scale is not None:  # FP8-resident: dequantized per expert block, in the compute dtype
      scales = (self.gate_proj_scale[...], self.up_proj_scale[...], self.down_proj_scale[...])
      precision = _precision(xt, xt)
    if (ep := self.expert_parallel) is not None:
      routed = expert_parallel_ffn(
        xt,
        idx,
        w,
        gate,
        up,
        down,
        expert_axes=ep.axes,
        width_axis=ep.width_axis,
        token_axis=ep.token_axis,
        precision=precision,
        scales=scales,
        compute_dtype=self.expert_compute_dtype,
      )
    else:
      routed = grouped_expert_ffn(
        xt, idx, w, gate, up, down, precision=precision, scales=scales, compute_dtype=self.expert_compute_dtype
      )
    out = routed.astype(x.dtype) + self.shared_experts(xt)
    return out.reshape(shape)


# ----------------------------------------------------------------------------- decoder
class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)); then x + mlp(norm(x)) (MLP dense or MoE)."""

  def __init__(
    self,
    cfg: DSAConfig,
    layer: int,
    *,
    dtype,
    rngs: nnx.Rngs,
    top_k: TopK = jax.lax.top_k,
    expert_parallel: ExpertParallel | None = None,
  ):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    self.self_attn = MLAttention(cfg, dtype=dtype, rngs=rngs, has_indexer=cfg.has_indexer(layer), top_k=top_k)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    if cfg.is_moe_layer(layer):
      self.mlp = MoE(cfg, dtype=dtype, rngs=rngs, expert_parallel=expert_parallel)
    else:
      self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, std=cfg.initializer_range, rngs=rngs)

  def __call__(self, x, cos, sin, positions, layer: int, cache, prev_topk=None, **blocks):
    a, cache, topk = self.self_attn(self.input_layernorm(x), cos, sin, positions, layer, cache, prev_topk, **blocks)
    x = x + a
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache, topk


class LMHead(nnx.Module):
  """The output projection: logits = x @ weight^T, weight dtype[V, H] (vocabulary-major, as HF checkpoints
  store ``lm_head.weight`` and as the embedding table is laid out). Not quantized in FP8 checkpoints.

  Vocabulary-major rather than a [H, V] kernel: XLA:CPU's GEMM runs [B, H] x [V, H]^T 1.15-1.23x faster at
  batch 8 and 32 on the default model (benchmarks/step_floor.py, BENCHMARKS.md "A decode step against its
  floor"); GPU GEMMs take either operand transposed; and loading needs no transpose of the largest tensor."""

  def __init__(self, d_in: int, vocab: int, *, dtype, std: float, rngs: nnx.Rngs):
    self.weight = nnx.Param(_normal(rngs, (vocab, d_in), std, dtype))


class DeepseekV32ForCausalLM(nnx.Module):
  """DSA causal LM (DeepSeek-V3.2 or GLM-5, per ``cfg.model_type``): embed_tokens dtype[V, H] -> layers ->
  norm -> logits = x @ W^T with W = lm_head.weight [V, H] (``LMHead``), or embed_tokens when
  tie_word_embeddings (lm_head is None).

  How it runs, fixed at build time (not part of the checkpoint): top_k, the indexer's exact top-k (``TopK``;
  default ``jax.lax.top_k``); expert_parallel, the mesh axes of the routed experts (``models.moe.ExpertParallel``;
  None: one device or GSPMD's split)."""

  def __init__(
    self,
    cfg: DSAConfig,
    *,
    rngs: nnx.Rngs,
    dtype=None,
    top_k: TopK = jax.lax.top_k,
    expert_parallel: ExpertParallel | None = None,
  ):
    dtype = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    self.config = cfg
    self.dtype = dtype
    std = cfg.initializer_range
    self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), std, dtype))
    self.layers = nnx.List(
      [
        DecoderLayer(cfg, i, dtype=dtype, rngs=rngs, top_k=top_k, expert_parallel=expert_parallel)
        for i in range(cfg.num_hidden_layers)
      ]
    )
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    self.lm_head = (
      None if cfg.tie_word_embeddings else LMHead(cfg.hidden_size, cfg.vocab_size, dtype=dtype, std=std, rngs=rngs)
    )

  def _embed(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embed_tokens[...], tokens, axis=0, mode="clip")

  def _logits(self, x: jax.Array, *, vocab_major: bool = False) -> jax.Array:
    """float32[..., V] logits of hidden states x[..., H] (the final norm, then the output projection);
    vocab_major (x: [B, H] only): float32[V, B] instead, the same GEMM with its output transposed, which
    XLA:CPU runs 15-20% faster at 2-64 rows (benchmarks/step_floor.py's GEMM columns)."""
    x = self.norm(x)
    if self.lm_head is None:
      w = self.embed_tokens[...]  # [V, H]
    else:
      w = self.lm_head.weight[...]  # [V, H]
      x = x.astype(w.dtype)  # as a Linear casts its input to its kernel's dtype
    if vocab_major:
      return jnp.einsum("vh,bh->vb", w, x, precision=_precision(x, w)).astype(_F32)
    # Contract w's hidden axis directly: jnp.matmul(x, w.T) took 17 ms at one row on XLA:CPU against 3.3 ms
    # for this (V = 129280, H = 256), the same at 8 and 32 rows.
    return jnp.einsum("...h,vh->...v", x, w, precision=_precision(x, w)).astype(_F32)

  def forward(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    *,
    window: int | None = None,
    key_block: int = 256,
    score_block: int | None = None,
    query_block: int | None = None,
  ):
    """Runs Q tokens per row through every layer. tokens, positions: int32[B, Q] (positions -1 = padding).
    Static block sizes (``Indexer.select``, ``MLAttention.__call__``): window, the indexer keys scored
    (default: the smallest multiple of key_block covering Q positions, for a fresh cache); key_block;
    score_block; query_block.
    Returns the final hidden states [B, Q, H] (before the final norm), the cache and the top-k of every
    layer int32[L, B, Q, K] (a GLM shared layer repeats the top-k it borrowed)."""
    cfg = self.config
    positions = positions.astype(jnp.int32)
    x = self._embed(tokens)  # [B, Q, H]
    cos, sin = rope_cos_sin(cfg.rope, cfg.qk_rope_head_dim, jnp.maximum(positions, 0))  # [B, Q, dr/2]
    if window is None:
      window = -(-tokens.shape[1] // key_block) * key_block
    blocks = dict(window=window, key_block=min(key_block, window), score_block=score_block)
    topk = None  # the top-k of the last layer with an indexer (GLM shared layers reuse it)
    per_layer = []
    for l, layer in enumerate(self.layers):
      x, cache, topk = layer(x, cos, sin, positions, l, cache, topk, index_blocks=blocks, query_block=query_block)
      per_layer.append(topk)
    return x, cache, jnp.stack(per_layer)

  def prefill(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, *, all_logits: bool = False, **blocks):
    """A prefill chunk: tokens int32[B, C] at positions int32[B, C] (consecutive per row from where the row's
    request stands; -1 = padding after a row's last token). Attention is sparse (each query attends to its
    indexer top-k), so nothing is quadratic in the prompt.
    Returns (logits, cache): logits float32[B, V] at each row's last real token (the lm_head runs on one
    row per sequence), or float32[B, C, V] at every position with ``all_logits``. blocks: ``forward``'s
    static block sizes (window must cover every position: pass it when the cache holds earlier tokens)."""
    x, cache, _ = self.forward(tokens, positions, cache, **blocks)
    if all_logits:
      return self._logits(x), cache
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)  # index of each row's last real token
    return self._logits(jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]), cache

  def decode(
    self,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    *,
    window: int,
    return_topk: bool = False,
    key_block: int = 256,
    score_block: int | None = None,
    vocab_major: bool = False,
  ):
    """One decode step. tokens: int32[B] (the newest token of each row), positions: int32[B] (its position,
    -1 = idle row); window (static): indexer keys scored, > every position (see ``forward``). Returns logits
    float32[B, V] (vocab_major: float32[V, B], see ``_logits``) and the updated cache; with ``return_topk``
    also the top-k positions every layer attended to, int32[L, B, index_topk] (-1 = padding)."""
    x, cache, topk = self.forward(
      tokens[:, None], positions[:, None], cache, window=window, key_block=key_block, score_block=score_block
    )
    logits = self._logits(x[:, 0], vocab_major=vocab_major)
    return (logits, cache, topk[:, :, 0]) if return_topk else (logits, cache)


# ----------------------------------------------------------------------------- jit helpers
# The same module serves GLM-5 / GLM-5.1 (``GlmMoeDsaForCausalLM``): conventions come from the config.
GlmMoeDsaForCausalLM = DeepseekV32ForCausalLM
DSAForCausalLM = DeepseekV32ForCausalLM


def split_model(model: DeepseekV32ForCausalLM):
  """(graphdef, state) for use with :func:`prefill_step` / :func:`decode_step`."""
  return nnx.split(model)


def prefill_prompts(
  model: DeepseekV32ForCausalLM, tokens, lengths, *, max_len: int | None = None, key_block: int = 256
):
  """Whole prompts through one prefill chunk into a fresh :class:`~models.kv_protocol.ContiguousKVCache`: the
  porting-experiment entry point (compare logits with another implementation, then keep decoding).

  tokens: int32[B, S] right-padded; lengths: int32[B]; max_len: cache positions (default S).
  Returns (logits float32[B, S, V] at every position (don't-care past a row's length), cache)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  B, S = tokens.shape
  positions = jnp.where(jnp.arange(S)[None] < jnp.asarray(lengths)[:, None], jnp.arange(S)[None], -1)
  cache = ContiguousKVCache.create(model.config, B, max_len or S, dtype=model.dtype)
  return model.prefill(tokens, positions, cache, all_logits=True, key_block=key_block)


@functools.partial(
  jax.jit, static_argnums=(0,), static_argnames=("all_logits", "window", "key_block"), donate_argnums=(4,)
)
def prefill_step(graphdef, state, tokens, positions, cache, *, all_logits=False, window=None, key_block=256):
  """Jitted ``model.prefill`` with the cache donated; graphdef is static, state a pytree of params."""
  return nnx.merge(graphdef, state).prefill(
    tokens, positions, cache, all_logits=all_logits, window=window, key_block=key_block
  )


@functools.partial(
  jax.jit, static_argnums=(0,), static_argnames=("window", "key_block", "vocab_major"), donate_argnums=(4,)
)
def decode_step(graphdef, state, tokens, positions, cache, *, window=None, key_block=256, vocab_major=False):
  """Jitted ``model.decode`` with the cache donated (window None: the cache's whole length, for the
  contiguous test cache). Returns (logits float32[B, V], or [V, B] with vocab_major, cache)."""
  if window is None:
    window = -(-cache.latent.shape[2] // key_block) * key_block
  return nnx.merge(graphdef, state).decode(
    tokens, positions, cache, window=window, key_block=key_block, vocab_major=vocab_major
  )
