"""KV caches behind one interface: dense (all latent KV on device) and HiSparse.

The model calls three methods per layer and never looks inside (see
``kv_protocol.md``)::

    cache = cache.append(l, seq_lens, latent[B, W], index_key[B, Di])
    keys = cache.index_keys(l)                  # [B, S, Di]
    rows, cache = cache.gather(l, top_k[B, K], seq_lens)   # [B, K, W]

Both caches are JAX pytrees threaded through jitted functions and donated, so
their arrays are updated in place. ``B`` is the number of decode lanes (one
request per lane), ``S`` the longest sequence a lane can hold, ``W`` the
latent row width (kv_lora_rank + qk_rope_head_dim), ``Di`` the indexer head
dim. The indexer keys of every position stay on device in both modes, as in
DeepSeek's DSA design; only the latent KV moves to the host pool.

Losslessness: ``gather`` returns bit-identical rows in both modes (the same
stored values, zeros at padding), so the attention that follows is the same
computation on the same data.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hisparse_jax import ops


def _pytree(data, meta=()):
  return functools.partial(jax.tree_util.register_dataclass, data_fields=list(data),
                           meta_fields=list(meta))


def _committed(tree):
  """Arrays committed to the default device, like the outputs of the jitted steps that will
  replace them (an uncommitted first cache would cost every jitted function a second compile)."""
  return jax.device_put(tree, jax.devices()[0])


def _zeros_at_padding(rows, top_k):
  return jnp.where((top_k >= 0)[..., None], rows, jnp.zeros((), rows.dtype))


def _set_newest(table, layer, seq_lens, values):
  """table[layer, b, seq_lens[b]-1] = values[b] for active lanes (seq_lens > 0)."""
  B, S = table.shape[1], table.shape[2]
  pos = jnp.where(seq_lens > 0, seq_lens - 1, S)  # S is out of range: dropped
  return table.at[layer, jnp.arange(B), pos].set(values.astype(table.dtype), mode="drop")


@_pytree(data=("kv", "index_k"))
@dataclasses.dataclass
class DenseKVCache:
  """All latent KV on device: the baseline.

  Attributes:
    kv: T[L, B, S, W] latent rows.
    index_k: float32[L, B, S, Di] indexer keys.
  """

  kv: jax.Array
  index_k: jax.Array

  @classmethod
  def create(cls, *, num_layers, batch, max_seq_len, latent_dim, index_dim, dtype):
    """Zero cache of L layers x B lanes x S positions (device memory)."""
    return cls(**_committed(dict(
        kv=jnp.zeros((num_layers, batch, max_seq_len, latent_dim), dtype),
        index_k=jnp.zeros((num_layers, batch, max_seq_len, index_dim), jnp.float32))))

  def append(self, layer, seq_lens, latent, index_key):
    return dataclasses.replace(
        self, kv=_set_newest(self.kv, layer, seq_lens, latent),
        index_k=_set_newest(self.index_k, layer, seq_lens, index_key))

  def index_keys(self, layer):
    return self.index_k[layer]

  def gather(self, layer, top_k, seq_lens):
    del seq_lens
    B = top_k.shape[0]
    rows = self.kv[layer, jnp.arange(B)[:, None], jnp.maximum(top_k, 0)]
    return _zeros_at_padding(rows, top_k), self

  def insert(self, lane, latents, index_keys, host_rows=None):
    """Store a prefilled prompt: latents T[L, P, W], index_keys f32[L, P, Di] at positions 0..P-1 of lane.

    host_rows (the page table HiSparse needs) is accepted and ignored.
    """
    del host_rows
    return dataclasses.replace(
        self,
        kv=jax.lax.dynamic_update_slice(self.kv, latents[:, None].astype(self.kv.dtype), (0, lane, 0, 0)),
        index_k=jax.lax.dynamic_update_slice(self.index_k, index_keys[:, None], (0, lane, 0, 0)))


@_pytree(data=("hot", "slot_tokens", "lru", "stats", "host_pool", "host_rows", "index_k"),
         meta=("external_pool",))
@dataclasses.dataclass
class HiSparseKVCache:
  """Hierarchical KV: full latent KV in a host pool, a hot buffer per request on device.

  Attributes:
    hot: T[L, B, D+1, W] hot buffers (device); slot D holds the newest token.
    slot_tokens: int32[L, B, D] token position in each slot.
    lru: int32[L, B, D] slot ids, least recently used first.
    stats: int32[L, B, 2] cumulative swap-in (hits, misses) per lane.
    host_pool: T[L, H, W] latent rows of every token (``pinned_host`` memory);
      with ``external_pool`` set, the int32[1] ordering token of that pool.
    host_rows: int32[B, S] position -> host-pool row (page table), -1 if none.
    index_k: float32[L, B, S, Di] indexer keys (device).
    external_pool: static reference to an ``ops.ExtensionHostPool`` holding
      the rows instead of a JAX array (the fallback where XLA cannot hand a
      ``pinned_host`` operand to the kernel as a host pointer).
  """

  hot: jax.Array
  slot_tokens: jax.Array
  lru: jax.Array
  stats: jax.Array
  host_pool: jax.Array
  host_rows: jax.Array
  index_k: jax.Array
  external_pool: ops.ExternalPoolRef | None = None

  @classmethod
  def create(cls, *, num_layers, batch, max_seq_len, latent_dim, index_dim, dtype,
             device_buffer_size, host_pool_rows, external_pool: ops.ExtensionHostPool | None = None):
    """Empty cache. The host pool is allocated directly in ``pinned_host`` memory, or is
    ``external_pool`` (shape [L, host_pool_rows, latent_dim]; the caller keeps it alive)."""
    L, B, D = num_layers, batch, device_buffer_size
    if external_pool is not None:
      if external_pool.shape != (L, host_pool_rows, latent_dim) or external_pool.dtype != jnp.dtype(dtype):
        raise ValueError(f"external pool {external_pool.shape} {external_pool.dtype} does not match "
                         f"{(L, host_pool_rows, latent_dim)} {jnp.dtype(dtype)}")
      host_pool = _committed(external_pool.token())
    else:
      host_pool = jax.jit(lambda: jax.device_put(
          jnp.zeros((L, host_pool_rows, latent_dim), dtype), jax.memory.Space.Host))()
    slots = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (L, B, D))
    device = _committed(dict(
        hot=jnp.zeros((L, B, D + 1, latent_dim), dtype),
        slot_tokens=slots,
        lru=jnp.array(slots),
        stats=jnp.zeros((L, B, 2), jnp.int32),
        host_rows=jnp.full((B, max_seq_len), -1, jnp.int32),
        index_k=jnp.zeros((L, B, max_seq_len, index_dim), jnp.float32)))
    return cls(**device, host_pool=host_pool,
               external_pool=None if external_pool is None else external_pool.ref)

  @property
  def device_buffer_size(self) -> int:
    return self.slot_tokens.shape[2]

  def append(self, layer, seq_lens, latent, index_key):
    # Backup first (write before the swap-in reads the pool: no hidden pool copy).
    B, D = latent.shape[0], self.device_buffer_size
    pos = jnp.maximum(seq_lens - 1, 0)
    dst = jnp.where(seq_lens > 0, self.host_rows[jnp.arange(B), pos], -1)
    host_pool = ops.backup(layer, latent[None].astype(self.hot.dtype), dst, self.host_pool,
                           external=self.external_pool)
    # Device copy: slot p while p < D (fast path), else the reserved slot D.
    slot = jnp.where(seq_lens > 0, jnp.minimum(pos, D), D + 1)  # D + 1: dropped
    hot = self.hot.at[layer, jnp.arange(B), slot].set(latent.astype(self.hot.dtype), mode="drop")
    return dataclasses.replace(self, hot=hot, host_pool=host_pool,
                               index_k=_set_newest(self.index_k, layer, seq_lens, index_key))

  def index_keys(self, layer):
    return self.index_k[layer]

  def gather(self, layer, top_k, seq_lens):
    rows, host_pool, hot, slot_tokens, lru, stats = ops.swap_in(
        layer, top_k, seq_lens, self.host_rows, self.host_pool, self.hot, self.slot_tokens,
        self.lru, self.stats, external=self.external_pool)
    D1 = hot.shape[2]
    safe = jnp.maximum(rows, 0)
    out = hot[layer, safe // D1, safe % D1]
    cache = dataclasses.replace(self, hot=hot, host_pool=host_pool, slot_tokens=slot_tokens,
                                lru=lru, stats=stats)
    return _zeros_at_padding(out, top_k), cache

  def insert(self, lane, latents, index_keys, host_rows):
    """Store a prefilled prompt in lane: all rows to the host pool, the first D to the hot buffer.

    Args:
      lane: int32 scalar.
      latents: T[L, P, W], index_keys: float32[L, P, Di] for positions 0..P-1.
      host_rows: int32[S] the lane's page table (-1 past its allocation);
        positions without a host row are not backed up.
    """
    L, P, _ = latents.shape
    D = self.device_buffer_size
    host_pool = ops.backup(0, latents.astype(self.hot.dtype), host_rows[:P], self.host_pool,
                           external=self.external_pool)
    n = min(P, D)
    hot = jax.lax.dynamic_update_slice(self.hot, latents[:, None, :n].astype(self.hot.dtype),
                                       (0, lane, 0, 0))
    slots = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (L, 1, D))
    return dataclasses.replace(
        self, hot=hot, host_pool=host_pool,
        slot_tokens=jax.lax.dynamic_update_slice(self.slot_tokens, slots, (0, lane, 0)),
        lru=jax.lax.dynamic_update_slice(self.lru, slots, (0, lane, 0)),
        stats=jax.lax.dynamic_update_slice(self.stats, jnp.zeros((L, 1, 2), jnp.int32), (0, lane, 0)),
        host_rows=jax.lax.dynamic_update_slice(self.host_rows, host_rows[None], (lane, 0)),
        index_k=jax.lax.dynamic_update_slice(self.index_k, index_keys[:, None], (0, lane, 0, 0)))
