"""The KV-cache interface the DSA model calls inside jit: one ``typing.Protocol``, three methods.

The model never looks inside a cache and never branches on its kind. Implementations live in
``hisparse_jax/memory/views.py`` (dense paged KV, HiSparse prefill, HiSparse decode); a test cache may
be anything with these methods. A cache object describes ONE batch of one jitted call: B rows, each row
a request with Q query tokens (Q = 1 in decode, the chunk length in prefill). It is a JAX pytree; every
method is functional (returns the updated cache) and traceable.

Shapes: B batch rows, Q query tokens per row, W and Di = the stored latent row's and indexer key's widths
(``models/kv_format.py``: kv_lora_rank + qk_rope_head_dim values of the compute dtype and index_head_dim
float32, or the bytes of FP8 rows; the model encodes rows before ``append`` and decodes what ``index_keys``
and ``gather`` return, so a cache never looks inside one), K = index_topk, T a key block (static, a multiple of the cache's page size).
``positions`` int32[B, Q] is the position of each query token in its request; -1 marks padding (its
writes are dropped and it attends to nothing). Within a row, positions are consecutive.

Per layer the model does (``models/deepseek_v32.py``, ``MLAttention.__call__``)::

    cache = cache.append(l, positions, latent[B, Q, W], index_key[B, Q, Di])   # latent: stored rows
    keys = cache.index_keys(l, start, T)          # stored keys [B, T, Di], positions [start, start + T)
    ... the indexer scores every key block up to the newest position, keeping a running top-k ...
    rows, cache = cache.gather(l, positions, top_k[B, Q, K], index_q, index_w)   # stored rows [B, Q, K, W]

``append`` happens before scoring, so a query sees its own key and those of earlier tokens of its chunk.
``index_keys`` may return anything at positions not yet written (the model masks them causally).
``gather`` returns the stored latent rows of the top-k positions, zeros where top_k is -1; every cache
returns bit-identical rows for the same stored values (HiSparse's losslessness rests on this). On layers
with an indexer the model also hands ``gather`` the indexer's queries and head weights of this step, so that
a cache can score any position it holds with ``index_scores`` (HiSparse's score-aware eviction does); on
layers without one (GLM's shared-indexer layers) they are None.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Self, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class KVCache(Protocol):
  """In-jit KV cache of one batch (see the module docstring for shapes)."""

  def append(self, layer: int, positions: jax.Array, latent: jax.Array, index_key: jax.Array) -> Self:
    """Stores latent [B, Q, W] and index_key [B, Q, Di] (stored rows, any dtype: float32 keys or FP8 rows) at
    positions int32[B, Q] of layer (static int); padding (-1) is dropped. Returns the updated cache."""
    ...

  def index_keys(self, layer: int, start: jax.Array, size: int) -> jax.Array:
    """[B, size, Di]: the stored indexer keys of positions [start, start + size) of each row
    (start: traced int32 scalar, a multiple of size; size: static)."""
    ...

  def gather(
    self,
    layer: int,
    positions: jax.Array,
    top_k: jax.Array,
    index_q: jax.Array | None = None,
    index_w: jax.Array | None = None,
  ) -> tuple[jax.Array, Self]:
    """(rows [B, Q, K, W] in the stored dtype, cache): the stored latent rows of the top-k positions
    int32[B, Q, K] chosen for the queries at positions int32[B, Q] (-1 entries give zero rows). index_q
    float32[B, Q, nI, Di] and index_w float32[B, Q, nI]: the layer's indexer queries and head weights
    (``index_scores``, over keys decoded with ``models.kv_format.decode_keys``), or None."""
    ...


def index_scores(index_q: jax.Array, index_w: jax.Array, keys: jax.Array) -> jax.Array:
  """The DSA lightning indexer's scores float32[B, Q, T] of keys float32[B, T, Di] for queries index_q
  float32[B, Q, nI, Di] with head weights index_w float32[B, Q, nI]:
  ``score[b, q, t] = sum_h w[b, q, h] * relu(q[b, q, h] . k[b, t] * Di**-0.5)`` (DeepSeek-V3.2 technical
  report, the indexer's I_{t,s}; the Di**-0.5 scale of its reference implementation). Full-precision matmuls
  (the scores pick the top-k: TF32 would change it on GPUs)."""
  s = jnp.einsum("bqhd,btd->bqht", index_q, keys, precision=jax.lax.Precision.HIGHEST) * index_q.shape[-1] ** -0.5
  return jnp.einsum("bqht,bqh->bqt", jax.nn.relu(s), index_w, precision=jax.lax.Precision.HIGHEST)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ContiguousKVCache:
  """The simplest :class:`KVCache`: B rows of S contiguous positions, all on device.

  For porting experiments and tests (``model.prefill`` / ``model.decode`` on a handful of prompts), not
  for serving: its memory is B x S whatever the rows hold. The runtime's caches are paged
  (``hisparse_jax/memory``).

  Attributes:
    latent: [L, B, S, W] latent rows as stored (``models/kv_format.py``: the compute dtype, or uint8 FP8 rows
      with ``kv_cache_dtype`` "fp8_e4m3").
    index_key: [L, B, S, Di] indexer keys as stored (float32, or uint8 FP8 rows).
  """

  latent: jax.Array
  index_key: jax.Array

  @classmethod
  def create(cls, cfg, batch: int, max_len: int, dtype=None) -> "ContiguousKVCache":
    """Zeros for ``cfg`` (a ``models.config.DSAConfig``): batch rows of max_len positions, rows stored as
    ``cfg.kv_row(dtype)`` and ``cfg.kv_index_row()`` say for compute dtype ``dtype`` (default the config's)."""
    L = cfg.num_hidden_layers
    width, stored = cfg.kv_row(dtype)
    index_width, index_stored = cfg.kv_index_row()
    return cls(jnp.zeros((L, batch, max_len, width), stored), jnp.zeros((L, batch, max_len, index_width), index_stored))

  def append(self, layer, positions, latent, index_key):
    B, S = self.latent.shape[1], self.latent.shape[2]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], positions.shape)
    pos = jnp.where(positions >= 0, positions, S)  # S is out of range: dropped
    return dataclasses.replace(
      self,
      latent=self.latent.at[layer, rows, pos].set(latent.astype(self.latent.dtype), mode="drop"),
      index_key=self.index_key.at[layer, rows, pos].set(index_key, mode="drop"),
    )

  def index_keys(self, layer, start, size):
    pos = start + jnp.arange(size)
    return jnp.take(self.index_key[layer], pos, axis=1, mode="fill", fill_value=0)

  def gather(self, layer, positions, top_k, index_q=None, index_w=None):
    del positions, index_q, index_w
    B = top_k.shape[0]
    rows = self.latent[layer][jnp.arange(B)[:, None, None], jnp.maximum(top_k, 0)]
    return jnp.where((top_k >= 0)[..., None], rows, jnp.zeros((), rows.dtype)), self
