"""Sparse dispatch of routed experts: each expert runs only on the tokens routed to it.

``grouped_expert_ffn`` computes, for T tokens each routed to k of E experts,

    out[t] = sum_j weight[t, j] * down[e_tj] @ (silu(gate[e_tj] @ x[t]) * (up[e_tj] @ x[t])),   e_tj = expert[t, j]

(DeepSeek-V3's routed-expert SwiGLU FFN, as ``modeling_deepseek_v32.DeepseekV32MoE``), with work
proportional to T * k (plus at most one partly filled row block per used expert), not T * E.

How: the T*k (token, expert) assignments are sorted by expert; each expert's group is padded to a whole
number of ``block`` rows, so every block of rows belongs to one expert; a while loop runs only over the
blocks in use (a dynamic trip count; the static bound ceil(T*k / block) + min(E, T*k) only sizes
buffers), each block one [block, H] x [H, I] GEMM pair and one [block, I] x [I, H] GEMM with that expert's
weights. Results go back to their (token, slot) order and are combined with the routing weights.

``jax.lax.ragged_dot`` expresses the same grouped GEMM and is lowered natively on GPU and TPU; on CPU
(JAX 0.12) it is lowered through a dense [groups, M, K] broadcast, i.e. E times the work, which is why
this module does its own blocking.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .fp8 import dequantize_jax

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
  """How a MoE layer's routed experts are split over a device mesh (``expert_parallel_ffn``), fixed when the
  model is built.

  axes: the mesh axes the experts are split over (ep = the product of their sizes; non-empty).
  width_axis: the mesh axis each expert's width (moe_intermediate_size) is split over, or None.
  token_axis: the mesh axis the tokens are split over when it is also an expert axis (data-parallel
    attention's ``dp``): tokens then reach their experts by all-to-all; None: every device sees every token.
  """

  axes: tuple[str, ...]
  width_axis: str | None = None
  token_axis: str | None = None

  def __post_init__(self):
    if not self.axes:
      raise ValueError("ExpertParallel needs at least one mesh axis (no expert parallelism: pass None)")


def _pow2_at_least(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def block_rows(tokens: int, top_k: int, n_experts: int, max_block: int = 64) -> int:
  """Rows per expert block: the power of two nearest above the mean rows per expert (T*k / E), in
  [1, max_block] (small for decode, where each used expert sees a few rows; larger for prefill)."""
  return min(max_block, _pow2_at_least(-(-tokens * top_k // n_experts)))


def grouped_expert_ffn(
  x: jax.Array,
  expert: jax.Array,
  weight: jax.Array,
  gate: jax.Array,
  up: jax.Array,
  down: jax.Array,
  *,
  block: int | None = None,
  precision=None,
  scales=None,
  compute_dtype=None,
) -> jax.Array:
  """Routed-expert SwiGLU FFN over only the routed (token, expert) pairs.

  Args:
    x: [T, H] tokens (any float dtype; the GEMMs run in it).
    expert: int32[T, k] chosen experts; an id outside [0, E) (an expert another device holds, under
      expert parallelism) contributes zero and costs no GEMM rows.
    weight: float32[T, k] combine weights.
    gate, up: [E, H, I]; down: [E, I, H] (x's dtype).
    block: rows per expert block (static; default ``block_rows``).
    precision: of the GEMMs (``jax.lax.Precision``).
    scales, compute_dtype: FP8-resident experts: gate/up/down in float8_e4m3fn and scales = their float32
      128 x 128 block scales ([E, ceil(rows / 128), ceil(cols / 128)] each); each block's expert is
      dequantized to compute_dtype just before its GEMMs (``models.fp8.dequantize_jax``).

  Returns:
    float32[T, H]: sum over the k slots of weight * expert output (summed in slot order).
  """
  T, H = x.shape
  k = expert.shape[1]
  E = gate.shape[0]
  M = T * k
  b = block or block_rows(T, k, E)
  n_blocks_max = -(-M // b) + min(E, M)
  flat = expert.reshape(M).astype(jnp.int32)
  valid = (flat >= 0) & (flat < E)
  flat = jnp.where(valid, flat, E)  # absent experts sort last, count nowhere
  order = jnp.argsort(flat, stable=True)  # assignments sorted by expert
  sorted_e = flat[order]
  sorted_valid = valid[order]
  counts = jnp.zeros((E,), jnp.int32).at[flat].add(1, mode="drop")  # rows per expert
  blocks = (counts + b - 1) // b  # blocks per expert
  block_end = jnp.cumsum(blocks)
  group_start = jnp.cumsum(counts) - counts
  se = jnp.minimum(sorted_e, E - 1)
  rank = jnp.arange(M, dtype=jnp.int32) - group_start[se]
  dest = jnp.where(sorted_valid, (block_end - blocks)[se] * b + rank, n_blocks_max * b)  # padded row; absent: none
  rows = jnp.zeros((n_blocks_max * b, H), x.dtype).at[dest].set(x[order // k], mode="drop")
  block_expert = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(n_blocks_max), side="right"), E - 1)
  used = block_end[-1]

  def weights(e):
    if scales is None:
      return gate[e], up[e], down[e]
    return tuple(dequantize_jax(w[e], s[e], compute_dtype) for w, s in zip((gate, up, down), scales))

  def body(i, out):
    e = block_expert[i]
    xb = jax.lax.dynamic_slice_in_dim(rows, i * b, b)
    ge, ue, de = weights(e)
    g = jnp.matmul(xb, ge, precision=precision)
    u = jnp.matmul(xb, ue, precision=precision)
    y = jnp.matmul(jax.nn.silu(g) * u, de, precision=precision)
    return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), i * b, 0)

  out = jax.lax.fori_loop(0, used, body, jnp.zeros((n_blocks_max * b, H), x.dtype))
  picked = jnp.take(out, dest, axis=0, mode="fill", fill_value=0)  # absent assignments: zeros
  per_slot = jnp.zeros((M, H), x.dtype).at[order].set(picked).reshape(T, k, H)
  return jnp.einsum("tkh,tk->th", per_slot.astype(_F32), weight.astype(_F32), precision=jax.lax.Precision.HIGHEST)


def expert_parallel_ffn(
  x: jax.Array,
  expert: jax.Array,
  weight: jax.Array,
  gate: jax.Array,
  up: jax.Array,
  down: jax.Array,
  *,
  expert_axes: tuple[str, ...],
  width_axis: str | None = None,
  token_axis: str | None = None,
  precision=None,
  scales=None,
  compute_dtype=None,
) -> jax.Array:
  """``grouped_expert_ffn`` with the experts split over mesh axes (expert parallelism), inside a function
  traced under ``jax.set_mesh``.

  Each device holds E / ep experts (``gate``/``up``/``down`` sharded on dimension 0 over ``expert_axes``; the
  expert width I also over ``width_axis`` when given) and runs only the (token, expert) assignments whose
  expert it holds, on every token (x, expert and weight replicated); a ``psum`` over the mesh axes used
  adds the devices' partial sums. Arguments and result as ``grouped_expert_ffn`` (shapes global). FP8-resident
  experts: ``scales`` are split like their weights (each device dequantizes its own experts' blocks; with
  ``width_axis``, the expert width per device must be a whole number of 128-wide blocks).

  token_axis: the mesh axis the tokens are already split over (the dp axis of data-parallel attention: group
  g's rows are [g T / G, (g + 1) T / G)). Each group then works on its own tokens only; when token_axis is
  also an expert axis, tokens travel to their experts and back by all-to-all (``all_to_all_ffn``) instead of
  every device seeing every token.

  Rounding: each device sums its own slots, then the psum adds the devices' sums, so results may differ
  from one device's slot-order sum in the last bits.
  """
  if token_axis is not None and token_axis in expert_axes:
    return all_to_all_ffn(
      x,
      expert,
      weight,
      gate,
      up,
      down,
      expert_axes=expert_axes,
      token_axis=token_axis,
      width_axis=width_axis,
      precision=precision,
      scales=scales,
      compute_dtype=compute_dtype,
    )
  P = jax.sharding.PartitionSpec
  axis = expert_axes if len(expert_axes) > 1 else expert_axes[0]
  w_in, w_out = P(axis, None, width_axis), P(axis, width_axis, None)
  reduce_axes = tuple(expert_axes) + ((width_axis,) if width_axis else ())

  def local(x, expert, weight, gate, up, down, *scales):
    n = gate.shape[0]  # experts on this device
    first = jax.lax.axis_index(axis) * n
    mine = (expert >= first) & (expert < first + n)
    part = grouped_expert_ffn(
      x,
      jnp.where(mine, expert - first, -1),
      jnp.where(mine, weight, 0.0),
      gate,
      up,
      down,
      precision=precision,
      scales=scales or None,
      compute_dtype=compute_dtype,
    )
    return jax.lax.psum(part, reduce_axes)

  tokens = P(token_axis)  # (P(None): every device has every token)
  specs = (tokens, tokens, tokens, w_in, w_in, w_out) + ((w_in, w_in, w_out) if scales is not None else ())
  return jax.shard_map(local, in_specs=specs, out_specs=tokens, check_vma=False)(
    x, expert, weight, gate, up, down, *(scales or ())
  )


def all_to_all_ffn(
  x: jax.Array,
  expert: jax.Array,
  weight: jax.Array,
  gate: jax.Array,
  up: jax.Array,
  down: jax.Array,
  *,
  expert_axes: tuple[str, ...],
  token_axis: str,
  width_axis: str | None = None,
  precision=None,
  scales=None,
  compute_dtype=None,
) -> jax.Array:
  """``grouped_expert_ffn`` under expert parallelism with the tokens split over ``token_axis`` (data-parallel
  attention: group g owns rows [g T / G, (g + 1) T / G); one of ``expert_axes``), dispatched by all-to-all (the
  DeepEP pattern), inside
  a function traced under ``jax.set_mesh``. Arguments and result as ``expert_parallel_ffn`` (shapes global).

  Each of the N devices over ``expert_axes`` takes a slice of its group's tokens (its group's T / G rows,
  split again over the expert axes other than token_axis, e.g. tp), sends each token once to every device
  holding one of its experts, with that device's share of the token's (expert, weight) slots; every device
  runs its experts on what it received (``grouped_expert_ffn``; a psum over ``width_axis`` when the expert
  width is split) and sends the weighted partial sums back, where they are added (in device order). Buffers
  have a fixed capacity of all the sender's tokens per destination, so nothing is ever dropped: lossless for
  any routing. Per device, each way, that moves its T / N tokens x N destinations ([N, T / N, H]), where
  replicating the tokens (``expert_parallel_ffn`` without token_axis) gathers all T and all-reduces [T, H].
  (With ``jax.lax.ragged_all_to_all``, unsupported by XLA:CPU, only the routed tokens would move.)
  """
  P = jax.sharding.PartitionSpec
  mesh = jax.sharding.get_abstract_mesh()
  axis = expert_axes if len(expert_axes) > 1 else expert_axes[0]
  inner = tuple(a for a in expert_axes if a != token_axis)  # axes that split a group's tokens again
  S = int(np.prod([mesh.shape[a] for a in inner])) if inner else 1
  w_in, w_out = P(axis, None, width_axis), P(axis, width_axis, None)
  k = expert.shape[1]

  def local(x, expert, weight, gate, up, down, *scales):
    N = int(np.prod([mesh.shape[a] for a in expert_axes]))  # devices holding experts
    n = gate.shape[0]  # experts on each of them
    Tg, H = x.shape
    Tl = -(-Tg // S)  # tokens this device dispatches
    r = jax.lax.axis_index(inner) if inner else 0

    def mine(a, fill):
      a = jnp.pad(a, [(0, Tl * S - Tg)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
      return jax.lax.dynamic_slice_in_dim(a, r * Tl, Tl)

    xs, es, ws = mine(x, 0), mine(expert, -1), mine(weight, 0.0)
    dest = jnp.where(es >= 0, es // n, -1)  # [Tl, k] device of each slot
    to = jnp.arange(N)[:, None, None] == dest[None]  # [N, Tl, k]
    send_e = jnp.where(to, es[None] - jnp.arange(N)[:, None, None] * n, -1)
    send_w = jnp.where(to, ws[None], 0.0)
    send_x = jnp.where(to.any(-1)[..., None], xs[None], jnp.zeros((), xs.dtype))  # [N, Tl, H]
    a2a = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)  # noqa: E731  [N, ...] chunk i -> device i
    recv_x, recv_e, recv_w = a2a(send_x), a2a(send_e), a2a(send_w)  # from each source device
    y = grouped_expert_ffn(
      recv_x.reshape(N * Tl, H),
      recv_e.reshape(N * Tl, k),
      recv_w.reshape(N * Tl, k),
      gate,
      up,
      down,
      precision=precision,
      scales=scales or None,
      compute_dtype=compute_dtype,
    )
    if width_axis is not None:
      y = jax.lax.psum(y, width_axis)
    back = a2a(y.reshape(N, Tl, H))  # partial sums of my tokens from each device
    out = back.sum(0)  # [Tl, H]
    if inner:
      out = jax.lax.all_gather(out, inner, tiled=True)
    return out[:Tg]

  specs = (P(token_axis), P(token_axis), P(token_axis), w_in, w_in, w_out)
  specs += (w_in, w_in, w_out) if scales is not None else ()
  return jax.shard_map(local, in_specs=specs, out_specs=P(token_axis), check_vma=False)(
    x, expert, weight, gate, up, down, *(scales or ())
  )


def dense_expert_ffn(
  x: jax.Array, expert: jax.Array, weight: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, precision=None
) -> jax.Array:
  """The same sum evaluated densely: every expert on every token, combined with a [T, E] weight matrix
  that is zero for unchosen experts (T * E work; the reference for tests and benchmarks). Arguments and
  result as ``grouped_expert_ffn``."""
  combine = jnp.einsum(
    "tk,tke->te",
    weight.astype(_F32),
    jax.nn.one_hot(expert, gate.shape[0], dtype=_F32),
    precision=jax.lax.Precision.HIGHEST,
  )
  g = jnp.einsum("th,ehi->tei", x, gate, precision=precision)
  u = jnp.einsum("th,ehi->tei", x, up, precision=precision)
  y = jnp.einsum("tei,eih->teh", jax.nn.silu(g) * u, down, precision=precision)
  return jnp.einsum("teh,te->th", y.astype(_F32), combine, precision=jax.lax.Precision.HIGHEST)
