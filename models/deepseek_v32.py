"""DeepSeek-Sparse-Attention causal LMs in Flax NNX: DeepSeek-V3.2 and GLM-5 / GLM-5.1.

Numerically follows transformers 5.24 ``models/deepseek_v32/modeling_deepseek_v32.py`` and
``models/glm_moe_dsa/modeling_glm_moe_dsa.py`` (one implementation; the differences are conventions in
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
  the top-k positions chosen by the nearest "full" layer before it, in prefill and in decode.  In decode
  it still goes through the same cache calls: ``append`` (with an all-zero indexer key, never read)
  and ``gather`` with the borrowed top-k; it skips ``index_keys``.
* MoE: sigmoid router in float32, ``e_score_correction_bias`` for selection only, group-limited
  routing (group score = sum of the group's top-2), norm_topk_prob, routed_scaling_factor, shared
  experts.  Experts are evaluated *densely* (every expert on every token, combined with a
  [T, E] routing-weight matrix that is zero for unselected experts).  This is exact and simple; it
  is meant for the small models this project serves.
* Softmax in float32; logits returned as float32.

Linear weights are stored as ``kernel`` with shape [in, out] (HF stores [out, in]; the loader
transposes).  Router weight and bias and the indexer's ``weights_proj`` stay float32 whatever the
model dtype (transformers' ``_keep_in_fp32_modules``).

Two entry points on :class:`DeepseekV32ForCausalLM`: ``prefill`` (full causal forward; expanded,
non-absorbed MLA as in transformers) and ``decode`` (one token per lane through the KV-cache
protocol of ``hisparse_jax/kv_protocol.md``; absorbed MLA over gathered latent rows).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import DSAConfig, RopeConfig
from .fp8_numerics import fake_quant_e4m3, indexer_fp8

_F32 = jnp.float32
_NEG = float(np.finfo(np.float32).min)


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
    """y = x @ kernel, kernel: dtype[in, out] (no bias). The input is cast to the kernel dtype."""

    def __init__(self, d_in: int, d_out: int, *, dtype, std: float, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), std, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel[...]
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
    """

    def __init__(self, cfg: DSAConfig, *, dtype, rngs: nnx.Rngs):
        std = cfg.initializer_range
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, std=std, rngs=rngs)
        self.wk = Linear(cfg.hidden_size, self.head_dim, dtype=dtype, std=std, rngs=rngs)
        self.k_norm = LayerNorm(self.head_dim, 1e-6, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=_F32, std=std, rngs=rngs)
        self.softmax_scale = self.head_dim**-0.5
        self.interleave = cfg.indexer_rope_interleave
        self.fp8 = cfg.fp8_numerics  # Hadamard + e4m3 fake-quant of q and k (models/fp8_numerics.py)

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        r = self.rope_dim
        rope = apply_rope_interleaved if self.interleave else apply_rope_half
        return jnp.concatenate([rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x: [..., H]; cos/sin: [..., r/2] -> float32[..., Di] (normed, roped)."""
        k = self._rope(self.k_norm(self.wk(x)), cos, sin)
        return (indexer_fp8(k) if self.fp8 else k).astype(_F32)

    def queries(self, q_resid: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """q_resid: [..., q_lora]; cos/sin: [..., r/2] -> float32[..., nI, Di]."""
        q = self.wq_b(q_resid)
        q = q.reshape(*q.shape[:-1], self.n_heads, self.head_dim)
        q = self._rope(q, cos[..., None, :], sin[..., None, :])
        return (indexer_fp8(q) if self.fp8 else q).astype(_F32)

    def head_weights(self, x: jax.Array) -> jax.Array:
        """x: [..., H] -> float32[..., nI]."""
        return self.weights_proj(x).astype(_F32) * (self.n_heads**-0.5)

    def prefill_mask(self, x, q_resid, cos, sin, keys, causal) -> jax.Array:
        """Selection mask for a full causal forward.

        x: [B, S, H]; q_resid: [B, S, q_lora]; cos/sin: [S, r/2]; keys: float32[B, S, Di];
        causal: bool[S, S]. Returns bool[B, S, S] = causal & (t in top-min(K, S) of row s).
        """
        S = x.shape[1]
        if S <= self.topk:  # every position is selected (transformers: topk = min(K, T) = T)
            return jnp.broadcast_to(causal, (x.shape[0], S, S))
        q = self.queries(q_resid, cos, sin)  # [B, S, nI, Di]
        w = self.head_weights(x)  # [B, S, nI]
        s = _einsum("bshd,btd->bsht", q, keys) * self.softmax_scale
        scores = _einsum("bsht,bsh->bst", jax.nn.relu(s), w)  # [B, S, S]
        scores = jnp.where(causal, scores, -jnp.inf)
        _, idx = jax.lax.top_k(scores, self.topk)  # [B, S, K]
        sel = jax.vmap(jax.vmap(lambda i: jnp.zeros((S,), bool).at[i].set(True)))(idx)
        return sel & causal

    def decode_topk(self, x, q_resid, cos, sin, keys, seq_lens) -> jax.Array:
        """Top-k for one new token per lane.

        x: [B, H]; q_resid: [B, q_lora]; cos/sin: [B, r/2]; keys: float32[B, T, Di] (positions >= seq_lens
        are garbage); seq_lens: int32[B]. Returns int32[B, K] positions (k = min(K, seq_len) valid, rest -1).
        """
        T = keys.shape[1]
        q = self.queries(q_resid, cos, sin)  # [B, nI, Di]
        w = self.head_weights(x)  # [B, nI]
        s = _einsum("bhd,btd->bht", q, keys) * self.softmax_scale
        scores = _einsum("bht,bh->bt", jax.nn.relu(s), w)  # [B, T]
        valid = jnp.arange(T)[None, :] < seq_lens[:, None]
        scores = jnp.where(valid, scores, -jnp.inf)
        k = min(self.topk, T)
        _, idx = jax.lax.top_k(scores, k)  # [B, k]
        idx = idx.astype(jnp.int32)
        idx = jnp.where(idx < seq_lens[:, None], idx, -1)
        if k < self.topk:
            idx = jnp.pad(idx, ((0, 0), (0, self.topk - k)), constant_values=-1)
        return idx


# ----------------------------------------------------------------------------- attention
class MLAttention(nnx.Module):
    """Multi-head latent attention with a DSA indexer.

    q_a_proj [H, q_lora] -> q_a_layernorm -> q_b_proj [q_lora, nH*(dn+dr)];
    kv_a_proj_with_mqa [H, C+dr] -> (C | k_pe), kv_a_layernorm(C); kv_b_proj [C, nH*(dn+dv)];
    o_proj [nH*dv, H].  (C = kv_lora_rank, dn/dr/dv = nope/rope/v head dims.)
    """

    def __init__(self, cfg: DSAConfig, *, dtype, rngs: nnx.Rngs, has_indexer: bool = True):
        std = cfg.initializer_range
        self.n_heads = cfg.num_attention_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.index_dim = cfg.index_head_dim
        self.scale = cfg.softmax_scale
        self.fp8 = cfg.fp8_numerics  # e4m3 fake-quant of the cached latent KV (models/fp8_numerics.py)
        self.rope = apply_rope_interleaved if cfg.rope_interleave else apply_rope_half
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype, std=std, rngs=rngs)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype=dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * (self.dn + self.dr), dtype=dtype, std=std, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora + self.dr, dtype=dtype, std=std, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, cfg.latent_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(self.kv_lora, self.n_heads * (self.dn + self.dv), dtype=dtype, std=std, rngs=rngs)
        self.o_proj = Linear(self.n_heads * self.dv, cfg.hidden_size, dtype=dtype, std=std, rngs=rngs)
        # None on a "shared" layer (GLM cross-layer top-k sharing): it borrows an earlier layer's top-k.
        self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs) if has_indexer else None

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
        if self.fp8:  # DeepSeek-V3.2 deployment keeps this part of the KV cache in FP8
            c = fake_quant_e4m3(c)
        return jnp.concatenate([c, self.rope(k_pe, cos, sin)], axis=-1)

    def prefill(self, x, cos, sin, causal, prev_mask=None):
        """x: [B, S, H]; cos/sin: [S, dr/2]; causal: bool[S, S]; prev_mask: bool[B, S, S], the selection
        of the previous layer (used, and required, only when this layer has no indexer).
        Returns out [B, S, H], latents dtype[B, S, C+dr], index keys float32[B, S, Di] (zeros without
        an indexer), selection mask bool[B, S, S]."""
        B, S, _ = x.shape
        q_resid, q_nope, q_pe = self._queries(x, cos, sin)
        lat = self.latent(x, cos, sin)  # [B, S, W]
        if self.indexer is not None:
            ikeys = self.indexer.keys(x, cos, sin)  # [B, S, Di]
            mask = self.indexer.prefill_mask(x, q_resid, cos, sin, ikeys, causal)  # [B, S, S]
        else:
            if prev_mask is None:
                raise ValueError("a layer without an indexer needs the previous layer's top-k selection")
            ikeys = jnp.zeros((B, S, self.index_dim), _F32)
            mask = prev_mask

        c, k_pe = lat[..., : self.kv_lora], lat[..., self.kv_lora :]
        kv = self.kv_b_proj(c).reshape(B, S, self.n_heads, self.dn + self.dv)
        k_nope, v = kv[..., : self.dn], kv[..., self.dn :]
        q = jnp.concatenate([q_nope, q_pe], axis=-1)  # [B, S, nH, dn+dr]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (B, S, self.n_heads, self.dr))], -1)
        scores = _einsum("bshd,bthd->bhst", q, k) * self.scale  # [B, nH, S, S]
        scores = jnp.where(mask[:, None], scores.astype(_F32), _NEG)
        p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = _einsum("bhst,bthd->bshd", p, v).reshape(B, S, self.n_heads * self.dv)
        return self.o_proj(o), lat, ikeys, mask

    def decode(self, x, cos, sin, layer: int, seq_lens, cache, prev_topk=None, index_len=None):
        """x: [B, H] (one new token per lane at position seq_lens-1); cos/sin: [B, dr/2]; prev_topk:
        int32[B, K], the previous layer's top-k (used, and required, only when this layer has no indexer);
        index_len: static, score only the first index_len cached indexer keys (>= every seq_len; None: all).
        Uses the KV-cache protocol (append -> index_keys -> indexer top-k -> gather) and absorbed MLA.
        Returns out [B, H], cache, this layer's top-k int32[B, K]."""
        B = x.shape[0]
        q_resid, q_nope, q_pe = self._queries(x, cos, sin)  # [B, q_lora], [B, nH, dn], [B, nH, dr]
        lat = self.latent(x, cos, sin)  # [B, W]
        if self.indexer is not None:
            ikey = self.indexer.keys(x, cos, sin)  # [B, Di]
            cache = cache.append(layer, seq_lens, lat, ikey)
            keys = cache.index_keys(layer)  # float32[B, T, Di]
            if index_len is not None:
                keys = keys[:, :index_len]
            topk = self.indexer.decode_topk(x, q_resid, cos, sin, keys, seq_lens)  # int32[B, K]
        else:
            if prev_topk is None:
                raise ValueError("a layer without an indexer needs the previous layer's top-k")
            cache = cache.append(layer, seq_lens, lat, jnp.zeros((B, self.index_dim), _F32))
            topk = prev_topk
        rows, cache = cache.gather(layer, topk, seq_lens)  # [B, K, W]
        rows = rows.astype(lat.dtype)
        c_kv, k_pe = rows[..., : self.kv_lora], rows[..., self.kv_lora :]

        w = self.kv_b_proj.kernel[...].reshape(self.kv_lora, self.n_heads, self.dn + self.dv)
        w_uk, w_uv = w[..., : self.dn], w[..., self.dn :]  # [C, nH, dn], [C, nH, dv]
        q_abs = _einsum("bhd,chd->bhc", q_nope, w_uk)  # [B, nH, C]
        scores = _einsum("bhc,bkc->bhk", q_abs, c_kv) + _einsum("bhr,bkr->bhk", q_pe, k_pe)
        scores = scores.astype(_F32) * self.scale  # [B, nH, K]
        scores = jnp.where((topk >= 0)[:, None, :], scores, _NEG)
        p = jax.nn.softmax(scores, axis=-1).astype(c_kv.dtype)
        o_lat = _einsum("bhk,bkc->bhc", p, c_kv)  # [B, nH, C]
        o = _einsum("bhc,chv->bhv", o_lat, w_uv).reshape(B, self.n_heads * self.dv)
        return self.o_proj(o), cache, topk


# ----------------------------------------------------------------------------- MoE
class MoE(nnx.Module):
    """DeepSeek-V3 MoE: sigmoid router with group-limited top-k + shared experts.

    gate_kernel: float32[H, E]; e_score_correction_bias: float32[E] (selection only);
    gate_proj/up_proj: dtype[E, H, I]; down_proj: dtype[E, I, H]; shared_experts: MLP(H, I * n_shared).
    Experts are computed densely for every token (exact; fine for small E), then combined with
    the [T, E] routing weights.
    """

    def __init__(self, cfg: DSAConfig, *, dtype, rngs: nnx.Rngs):
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

    def routing(self, x: jax.Array) -> jax.Array:
        """x: [T, H] -> float32[T, E] combine weights (zero for unselected experts)."""
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
        return jnp.einsum("tk,tke->te", w, jax.nn.one_hot(idx, E, dtype=_F32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., H] -> [..., H]."""
        shape = x.shape
        xt = x.reshape(-1, shape[-1])  # [T, H]
        combine = self.routing(xt)  # [T, E]
        g = _einsum("th,ehi->tei", xt, self.gate_proj[...])
        u = _einsum("th,ehi->tei", xt, self.up_proj[...])
        y = _einsum("tei,eih->teh", jax.nn.silu(g) * u, self.down_proj[...])  # [T, E, H]
        routed = jnp.einsum("teh,te->th", y.astype(_F32), combine, precision=jax.lax.Precision.HIGHEST)
        out = routed.astype(x.dtype) + self.shared_experts(xt)
        return out.reshape(shape)


# ----------------------------------------------------------------------------- decoder
class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)); then x + mlp(norm(x)) (MLP dense or MoE)."""

    def __init__(self, cfg: DSAConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, dtype=dtype, rngs=rngs, has_indexer=cfg.has_indexer(layer))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, std=cfg.initializer_range, rngs=rngs)

    def prefill(self, x, cos, sin, causal, prev_mask=None):
        a, lat, ik, mask = self.self_attn.prefill(self.input_layernorm(x), cos, sin, causal, prev_mask)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, lat, ik, mask

    def decode(self, x, cos, sin, layer: int, seq_lens, cache, prev_topk=None, index_len=None):
        a, cache, topk = self.self_attn.decode(self.input_layernorm(x), cos, sin, layer, seq_lens, cache, prev_topk,
                                               index_len)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache, topk


class DeepseekV32ForCausalLM(nnx.Module):
    """DSA causal LM (DeepSeek-V3.2 or GLM-5, per ``cfg.model_type``): embed_tokens dtype[V, H] -> layers ->
    norm -> lm_head [H, V] (lm_head is None when tie_word_embeddings: logits use embed_tokens^T)."""

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs, dtype=None):
        dtype = jnp.dtype(dtype if dtype is not None else cfg.dtype)
        self.config = cfg
        self.dtype = dtype
        std = cfg.initializer_range
        self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), std, dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, std=std, rngs=rngs)
        )

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], tokens, axis=0, mode="clip")

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        if self.lm_head is None:
            w = self.embed_tokens[...]
            return jnp.matmul(x, w.T, precision=_precision(x, w)).astype(_F32)
        return self.lm_head(x).astype(_F32)

    def prefill(self, tokens: jax.Array, lengths: jax.Array, *, last_only: bool = False):
        """Full causal forward.

        tokens: int32[B, S]; lengths: int32[B] (positions >= lengths[b] are padding: their outputs are
        don't-care and, being after every real position, never influence real positions).
        Returns logits float32[B, S, V] (float32[B, V] at position lengths-1 when last_only: the
        lm_head then runs on one row per sequence), latents dtype[L, B, S, W], index_keys
        float32[L, B, S, Di].
        """
        S = tokens.shape[1]
        cfg = self.config
        x = self._embed(tokens)  # [B, S, H]
        cos, sin = rope_cos_sin(cfg.rope, cfg.qk_rope_head_dim, jnp.arange(S))  # [S, dr/2]
        causal = jnp.tril(jnp.ones((S, S), bool))
        lats, iks = [], []
        mask = None  # the selection of the last layer with an indexer (GLM shared layers reuse it)
        for layer in self.layers:
            x, lat, ik, mask = layer.prefill(x, cos, sin, causal, mask)
            lats.append(lat)
            iks.append(ik)
        if last_only:  # causality alone keeps right-padding from reaching real positions
            x = jnp.take_along_axis(x, (lengths.astype(jnp.int32) - 1)[:, None, None], axis=1)[:, 0]
        return self._logits(x), jnp.stack(lats), jnp.stack(iks)

    def decode(self, tokens: jax.Array, seq_lens: jax.Array, cache: Any, *, return_topk: bool = False,
               index_len: int | None = None):
        """One decode step. tokens: int32[B] (the newest token of each lane, at position seq_lens-1);
        seq_lens: int32[B] (0 = inactive lane). Returns logits float32[B, V] and the updated cache;
        with ``return_topk`` also the top-k positions every layer attended to, int32[L, B, index_topk]
        (-1 = padding; a GLM shared layer repeats the top-k it borrowed). ``index_len`` (static): the
        indexer scores only the first index_len cached positions, which must cover every seq_len; the
        top-k, and so the logits, are the same as with all positions (masked positions never win)."""
        cfg = self.config
        seq_lens = seq_lens.astype(jnp.int32)
        pos = jnp.maximum(seq_lens - 1, 0)
        x = self._embed(tokens)  # [B, H]
        cos, sin = rope_cos_sin(cfg.rope, cfg.qk_rope_head_dim, pos)  # [B, dr/2]
        topk = None  # the top-k of the last layer with an indexer (GLM shared layers reuse it)
        per_layer = []
        for l, layer in enumerate(self.layers):
            x, cache, topk = layer.decode(x, cos, sin, l, seq_lens, cache, topk, index_len)
            per_layer.append(topk)
        if return_topk:
            return self._logits(x), cache, jnp.stack(per_layer)
        return self._logits(x), cache


# ----------------------------------------------------------------------------- jit helpers
# The same module serves GLM-5 / GLM-5.1 (``GlmMoeDsaForCausalLM``): conventions come from the config.
GlmMoeDsaForCausalLM = DeepseekV32ForCausalLM
DSAForCausalLM = DeepseekV32ForCausalLM


def split_model(model: DeepseekV32ForCausalLM):
    """(graphdef, state) for use with :func:`prefill_step` / :func:`decode_step`."""
    return nnx.split(model)


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_step(graphdef, state, tokens, lengths):
    """Jitted ``model.prefill``; graphdef is static, state a pytree of params."""
    return nnx.merge(graphdef, state).prefill(tokens, lengths)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def decode_step(graphdef, state, tokens, seq_lens, cache):
    """Jitted ``model.decode`` with the cache donated. Returns (logits float32[B, V], cache)."""
    return nnx.merge(graphdef, state).decode(tokens, seq_lens, cache)
