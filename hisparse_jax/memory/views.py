"""KV memory inside jit: the arrays of each mode (states) and the per-batch caches the model calls (views).

    DenseState       kv pages: latent T[L, N, page, W] + indexer keys I[L, N, page, Di] (device)
      .view(tables)          -> DenseView             (prefill and decode)
    HiSparseState    indexer-key pages I[L, Ni, page, Di] (device)
                     staging latent pages T[L, Ns, page, W] (device; a prompt's rows while it prefills, and
                     a resident request's rows while it stays resident: dynamic residency)
                     hot buffers T[L, R, D+1, W] + slot table, LRU, stats (device; one per request slot)
                     host pool T[L, Hp * page, W] (``pinned_host``, or an extension-owned pool)
      .view(tables)          -> HiSparsePrefillView   (tables of a prefill batch)
                             -> HiSparseDecodeView    (tables of a decode batch)

T and I are the stored latent row's and indexer key's dtypes, W and Di their stored widths
(``models/kv_format.py``: W values of the compute dtype and Di float32, or FP8 rows of uint8 with
``--kv-cache-dtype fp8_e4m3``); the model encodes and decodes rows, the views only move them.

Views implement ``models.kv_protocol.KVCache`` for one batch: they hold the pool arrays plus that batch's
page-table rows (int32[B, P], built on the host by ``memory/backend.py``). After the model ran, the state
takes the updated arrays back (``state.absorb(view)``). Everything here is a JAX pytree, threaded through
jitted calls and donated, so pools are updated in place.

Page tables map logical page p of a request (positions [p * page, (p + 1) * page)) to a physical page;
-1 = none. Writes through a -1 entry or at position -1 (padding) are dropped; reads through one return
don't-care values that the model masks (positions beyond a row's newest token).

Losslessness: ``gather`` of every view returns the stored rows bit for bit (zeros at top-k padding), so
dense and HiSparse attention see identical data.

On a device mesh with DP groups (``--dp-size`` > 1) every state array is split over the dp axis on its second
dimension (pages, request slots, host rows: one block per group), the batch's rows are group-major, and the
methods marked ``per_group`` run once per group under ``shard_map`` on its local arrays; page tables and request
slots hold ids local to the group (memory/backend.py).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp

from hisparse_jax.config import EVICTIONS, SCORE_EMA_WEIGHT, SCORED_EVICTIONS
from hisparse_jax.kernels import ops
from models.kv_format import decode_keys
from models.kv_protocol import index_scores


def _pytree(data, meta=()):
  def register(cls):
    cls.data_fields = tuple(data)
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))

  return register


def _page_ids(pages, positions, page_size, missing):
  """Physical page of each position: pages int32[B, P], positions int32[B, ...] -> int32[B, ...];
  ``missing`` where the position is padding (< 0) or its page-table entry is -1."""
  B = pages.shape[0]
  flat = positions.reshape(B, -1)
  pid = jnp.take_along_axis(pages, jnp.maximum(flat, 0) // page_size, axis=1, mode="fill", fill_value=-1)
  pid = jnp.where((flat >= 0) & (pid >= 0), pid, missing)
  return pid.reshape(positions.shape)


def write_rows(pool, layer, pages, positions, values, page_size):
  """pool[layer, page(pos), pos % page] = values for every non-padding position.

  pool: T[L, N, page, X]; pages: int32[B, P]; positions: int32[B, Q]; values: [B, Q, X]."""
  pid = _page_ids(pages, positions, page_size, missing=pool.shape[1])  # N: out of range, dropped
  return pool.at[layer, pid, jnp.maximum(positions, 0) % page_size].set(values.astype(pool.dtype), mode="drop")


def read_block(pool, layer, pages, start, size, page_size):
  """pool rows of positions [start, start + size) of every row: [B, size, X] (start a multiple of page_size,
  size a static multiple of it; entries past a row's pages are don't-care)."""
  B, X = pages.shape[0], pool.shape[-1]
  n = size // page_size
  pid = jnp.take(pages, start // page_size + jnp.arange(n), axis=1, mode="fill", fill_value=0)  # [B, n]
  return pool[layer][jnp.maximum(pid, 0)].reshape(B, size, X)


def gather_rows(pool, layer, pages, top_k, page_size):
  """pool rows of the positions top_k int32[B, ...] -> [B, ..., X], zeros where top_k is -1."""
  pid = _page_ids(pages, top_k, page_size, missing=0)
  rows = pool[layer][pid, jnp.maximum(top_k, 0) % page_size]
  return jnp.where((top_k >= 0)[..., None], rows, jnp.zeros((), rows.dtype))


DP_AXIS = "dp"
_P = jax.sharding.PartitionSpec
POOL_SPEC = _P(None, DP_AXIS)  # every state array: [L, groups x per-group size, ...]
BATCH_SPEC = _P(DP_AXIS)  # batch arrays (tables, positions, rows): [groups x rows per group, ...]


def _placement(mesh, memory_kind=None):
  """Where a KV state's arrays live: on ``mesh``, dimension 1 (pages, request slots, host rows) split over
  the dp axis, one block per DP group, and each group's block replicated over its tp devices (MLA's latent
  row is shared by all heads, so tensor parallelism does not split it); the first device when mesh is None."""
  if mesh is None:
    return jax.sharding.make_single_device_sharding(jax.devices()[0], memory_kind=memory_kind)
  return jax.sharding.NamedSharding(mesh, POOL_SPEC, memory_kind=memory_kind)


# True while a per_group method's body is traced for one group: under its shard_map, and also while its result
# shapes are evaluated (jax.eval_shape of the body on the global arrays, outside any shard_map), where a per_group
# method it calls must run as is too, not start a shard_map of its own over arrays that are one group's.
_IN_GROUP = contextvars.ContextVar("hisparse_in_dp_group", default=False)


def _dp_groups() -> int:
  """DP groups of the context mesh (1: none, or already inside a group's body or a shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DP_AXIS not in mesh.axis_names or _IN_GROUP.get() or ops.inside_shard_map():
    return 1
  return mesh.shape[DP_AXIS]


def _specs(tree):
  """PartitionSpecs of a method's arguments or results: a view / state gets POOL_SPEC for its pools and
  BATCH_SPEC for its ``batch_fields``; other arrays BATCH_SPEC (scalars replicated)."""
  if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
    batch = getattr(tree, "batch_fields", ())
    return dataclasses.replace(
      tree,
      **{
        f.name: (None if getattr(tree, f.name) is None else BATCH_SPEC if f.name in batch else POOL_SPEC)
        for f in dataclasses.fields(tree)
        if f.name in type(tree).data_fields
      },
    )
  if isinstance(tree, (tuple, list)):
    return type(tree)(_specs(t) for t in tree)
  if isinstance(tree, dict):
    return {k: _specs(v) for k, v in tree.items()}
  return BATCH_SPEC if len(getattr(tree, "shape", ())) else _P()


def per_group(*, replicated=()):
  """Decorator of a view / state method: with a dp axis of size > 1 in the context mesh, the method runs once
  per DP group under ``shard_map`` on the group's local arrays (pools, tables and batch rows of the group,
  page ids and request slots local to it), and the FFI calls inside it run on each device's shard. Array
  arguments are batch-leading unless their position is in ``replicated`` (given whole to every group);
  Python scalars are static. Without DP groups the method runs as is."""

  def deco(method):
    @functools.wraps(method)
    def wrapped(self, *args):
      if _dp_groups() == 1:
        return method(self, *args)
      is_array = [not isinstance(a, (int, type(None))) for a in args]
      arrays = [a for a, keep in zip(args, is_array) if keep]

      def local(obj, *arrs):
        it = iter(arrs)
        token = _IN_GROUP.set(True)
        try:
          return method(obj, *(next(it) if keep else a for a, keep in zip(args, is_array)))
        finally:
          _IN_GROUP.reset(token)

      in_specs = (
        _specs(self),
        *(_P() if i in replicated else _specs(a) for i, (a, keep) in enumerate(zip(args, is_array)) if keep),
      )
      out_specs = _specs(jax.eval_shape(local, self, *arrays))
      return jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, check_vma=False)(self, *arrays)

    return wrapped

  return deco


def _absorb(state, view):
  """state with the arrays it shares (by field name) with view replaced by the view's (a view leaves out, as
  None, a pool it does not touch)."""
  names = {f.name for f in dataclasses.fields(state)} & {f.name for f in dataclasses.fields(view)}
  return dataclasses.replace(state, **{n: getattr(view, n) for n in names if getattr(view, n) is not None})


# ----------------------------------------------------------------------------------------------- dense
@_pytree(data=("latent", "index", "pages"), meta=("page_size",))
@dataclasses.dataclass
class DenseView:
  """Dense paged KV of one batch (prefill or decode). latent T[L, N, page, W], index I[L, N, page, Di]
  share page ids; pages int32[B, P] is the batch's page table."""

  batch_fields = ("pages",)

  latent: jax.Array
  index: jax.Array
  pages: jax.Array
  page_size: int

  @per_group()
  def append(self, layer, positions, latent, index_key):
    return dataclasses.replace(
      self,
      latent=write_rows(self.latent, layer, self.pages, positions, latent, self.page_size),
      index=write_rows(self.index, layer, self.pages, positions, index_key, self.page_size),
    )

  @per_group()
  def index_keys(self, layer, start, size):
    return read_block(self.index, layer, self.pages, start, size, self.page_size)

  @per_group()
  def gather(self, layer, positions, top_k, index_q=None, index_w=None):
    del positions, index_q, index_w
    return gather_rows(self.latent, layer, self.pages, top_k, self.page_size), self


@_pytree(data=("latent", "index"), meta=("page_size",))
@dataclasses.dataclass
class DenseState:
  """All KV on device, in pages of page_size tokens: latent T[L, N, page, W] and indexer keys
  I[L, N, page, Di] (a page holds both for its tokens)."""

  latent: jax.Array
  index: jax.Array
  page_size: int

  @classmethod
  def create(
    cls, *, num_layers, num_pages, page_size, latent_dim, index_dim, dtype, index_dtype=jnp.float32, mesh=None
  ) -> "DenseState":
    """Zeroed pools on the first device, or on ``mesh`` (``_placement``: num_pages split over the DP groups).
    latent_dim / dtype and index_dim / index_dtype: the stored rows' (``DSAConfig.kv_row`` / ``kv_index_row``)."""
    z = jax.jit(
      lambda: (
        jnp.zeros((num_layers, num_pages, page_size, latent_dim), dtype),
        jnp.zeros((num_layers, num_pages, page_size, index_dim), index_dtype),
      ),
      out_shardings=_placement(mesh),
    )
    latent, index = z()
    return cls(latent, index, page_size)

  def view(self, tables, residency: str = "none") -> DenseView:
    """tables: {"pages": int32[B, P]} (every row's KV is on device: residency is "none")."""
    if residency != "none":
      raise ValueError("dense KV has no dynamic residency")
    return DenseView(self.latent, self.index, tables["pages"], self.page_size)

  def absorb(self, view) -> "DenseState":
    return _absorb(self, view)

  def finish_prefill(self, tables) -> "DenseState":
    del tables
    return self

  @per_group(replicated=(1, 2, 3))
  def import_prompt(self, tables, latent, index, length) -> tuple["DenseState", jax.Array]:
    """(state, status int32[1] per DP group: 0, no kernel runs) after writing one request's prompt KV
    computed elsewhere: latent T[L, P, W], index I[L, P, Di] (P >= length:
    a padded bucket) at positions 0..length-1 (length: an int32 scalar) through its page-table row (tables: a
    one-row-per-group decode batch)."""
    view = self.view(tables)
    positions = _prompt_positions(latent.shape[1], length)
    for l in range(latent.shape[0]):
      view = view.append(l, positions, latent[l][None], index[l][None])
    return self.absorb(view), jnp.zeros((1,), jnp.int32)

  @per_group(replicated=(1,))
  def export_prompt(self, tables, length, size: int):
    """One request's prompt KV, to hand to another server (a prefill server's output): (latent T[B, L, size,
    W], index I[B, L, size, Di]) at positions 0..size-1 of each row's page table (tables: a decode batch;
    the request's row), zeros from ``length`` (an int32 scalar) on."""
    pages = tables["pages"]
    return _export(self.latent, self.index, pages, pages, length, size, self.page_size)


def _prompt_positions(size: int, length):
  """int32[1, size]: 0..size-1, -1 (dropped) from length on."""
  pos = jnp.arange(size, dtype=jnp.int32)
  return jnp.where(pos < length, pos, -1)[None]


def _export(latent_pool, index_pool, latent_pages, index_pages, length, size, page_size):
  """(latent [B, L, size, W], index [B, L, size, Di]): each row's positions 0..size-1 read through its page
  tables, zeros from length on."""
  B = latent_pages.shape[0]
  pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, size))
  keep = (pos < length)[..., None]

  def read(pool, pages):
    rows = jnp.stack([gather_rows(pool, l, pages, pos, page_size) for l in range(pool.shape[0])], axis=1)
    return jnp.where(keep[:, None], rows, jnp.zeros((), rows.dtype))

  return read(latent_pool, latent_pages), read(index_pool, index_pages)


# -------------------------------------------------------------------------------------------- hisparse
_HOST = ("host_pool", "host_pages")


def kernel_status(view, rows: int) -> jax.Array:
  """int32[rows]: each batch row's first nonzero swap-in / backup status in a view after the model ran (0 =
  done; ``ops.check_status``). Dense views run no kernel: zeros."""
  status = getattr(view, "status", None)
  return jnp.zeros((rows,), jnp.int32) if status is None else status


def _first_failure(status, new):
  """A batch's int32[B] kernel status after one more call's: a row keeps its first nonzero code."""
  return jnp.where(status == 0, new, status)


@_pytree(data=("index", "index_pages", "staging", "staging_pages", "status") + _HOST, meta=("page_size", "external"))
@dataclasses.dataclass
class HiSparsePrefillView:
  """A HiSparse prefill batch: indexer keys to their device pages, latent rows to staging pages (attention
  gathers from there) and, layer by layer, to the host pool (backup kernel). status: int32[B], each row's
  first nonzero backup status of the batch (``ops.check_status``; 0 = all written)."""

  batch_fields = ("index_pages", "staging_pages", "status", "host_pages")

  index: jax.Array
  index_pages: jax.Array
  staging: jax.Array
  staging_pages: jax.Array
  status: jax.Array
  host_pool: jax.Array
  host_pages: jax.Array
  page_size: int
  external: ops.ExternalPoolRef | None

  @per_group()
  def append(self, layer, positions, latent, index_key):
    B, Q, W = latent.shape
    dst = host_rows(self.host_pages, positions, self.page_size).reshape(B * Q)
    host_pool, status = ops.backup(
      layer, latent.reshape(1, B * Q, W).astype(self.staging.dtype), dst, self.host_pool, external=self.external
    )
    return dataclasses.replace(
      self,
      host_pool=host_pool,
      status=_first_failure(self.status, status.reshape(B, Q).max(axis=1)),
      staging=write_rows(self.staging, layer, self.staging_pages, positions, latent, self.page_size),
      index=write_rows(self.index, layer, self.index_pages, positions, index_key, self.page_size),
    )

  @per_group()
  def index_keys(self, layer, start, size):
    return read_block(self.index, layer, self.index_pages, start, size, self.page_size)

  @per_group()
  def gather(self, layer, positions, top_k, index_q=None, index_w=None):
    del positions, index_q, index_w
    return gather_rows(self.staging, layer, self.staging_pages, top_k, self.page_size), self


RESIDENCY = ("none", "mixed", "all")  # which rows of a decode batch are resident (dynamic residency)


def slot_score_ema(ema, scores, weight=SCORE_EMA_WEIGHT):
  """Eviction "score_ema": each slot's moving average of its token's indexer scores after this step's scores,
  float32[B, D] from ema (float32[B, D], NaN for a slot whose token entered the hot buffer since the last
  step, or since the request's hot buffer was filled) and scores (float32[B, D], this step's scores of the
  slots' tokens): ``weight * ema + (1 - weight) * scores``, the scores themselves where ema is NaN. What the
  swap-in's "score" policy ranks (the lowest is evicted first); finite wherever scores are."""
  return jnp.where(jnp.isnan(ema), scores, weight * ema + (1 - weight) * scores)


def restart_score_ema(ema, tokens_before, tokens_after, seq_lens):
  """ema (float32[B, D]) with NaN ("no history") at the slots whose token the swap-in replaced (slot tables
  int32[B, D] before and after it) or is not written yet (position >= seq_lens int32[B]: a short request's
  slots hold its future positions, whose index keys are not there to score): a token's average starts when it
  enters the hot buffer."""
  return jnp.where((tokens_before == tokens_after) & (tokens_after < seq_lens[:, None]), ema, jnp.nan)


@_pytree(
  data=(
    "index",
    "index_pages",
    "hot",
    "slot_tokens",
    "lru",
    "stats",
    "req_ids",
    "newest",
    "status",
    "staging",
    "resident_pages",
    "prefetch_ticket",
    "prefetched",
    "score_ema",
  )
  + _HOST,
  meta=("page_size", "external", "eviction", "residency", "prefetch_depth"),
)
@dataclasses.dataclass
class HiSparseDecodeView:
  """A HiSparse decode batch (one token per row): the newest latent row goes to the host pool (backup
  kernel) and, placed by the swap-in kernel in ``gather``, to the request's hot buffer (its own slot while
  the request is no longer than D, else the reserved slot D); ``gather`` is the swap-in kernel, with the
  eviction policy ``eviction`` (``config.EVICTIONS``). Under "score" it first scores the token of every slot
  with the layer's indexer queries (``index_scores`` over the indexer keys of the slots' positions: B x D
  keys, gathered from the device's index pages); under "score_ema" the kernel's "score" policy ranks each
  slot's moving average of those scores instead (``slot_score_ema``; the averages float32[L, R, D] live in
  ``score_ema`` and restart, ``restart_score_ema``, for the slots the swap-in refills). status: int32[B], each
  row's first nonzero backup or swap-in status of the step (``ops.check_status``; 0 = every layer done).

  Dynamic residency: a row whose ``resident_pages`` row holds pages (its request's whole latent KV on device,
  in staging pages) gets its newest row written there too and is gathered from there, with no swap-in (its
  kernel row is idle). ``residency`` (static) says whether no row ("none": staging and resident_pages are
  None), some ("mixed") or every active row ("all": no swap-in call at all) is resident.

  Cross-layer prefetch (``prefetch_depth`` > 0): after layer l's swap-in and gather, the first prefetch_depth
  positions of its top-k (the top-scored) start layer l+1's swap-in in the background (``ops.prefetch_start``)
  while layer l's attention and MoE run; layer l+1's gather waits for it (``ops.prefetch_wait``, ordered after
  the layer's newest rows, i.e. after layer l's compute) before its own swap-in. ``prefetch_ticket`` names the
  prefetch in flight between the two (None when none is): the model must gather every layer in order
  (``HiSparseState.absorb`` refuses a view with a prefetch in flight)."""

  batch_fields = ("index_pages", "req_ids", "newest", "status", "resident_pages", "prefetch_ticket", "host_pages")

  index: jax.Array
  index_pages: jax.Array
  hot: jax.Array
  slot_tokens: jax.Array
  lru: jax.Array
  stats: jax.Array
  req_ids: jax.Array
  newest: jax.Array | None  # T[B, W], the rows append() received this layer, for the swap-in to place
  status: jax.Array
  staging: jax.Array | None
  resident_pages: jax.Array | None  # int32[B, P]: staging pages of resident rows, -1 rows for the others
  prefetch_ticket: jax.Array | None  # int32[1, 2] per DP group: the next layer's prefetch in flight, else None
  host_pool: jax.Array
  host_pages: jax.Array
  page_size: int
  external: ops.ExternalPoolRef | None
  eviction: str = "lru"
  residency: str = "none"
  prefetch_depth: int = 0
  prefetched: jax.Array | None = None  # int32[L, R]: the state's rows placed by the prefetch, per request slot
  score_ema: jax.Array | None = None  # float32[L, R, D] under eviction "score_ema" (``slot_score_ema``), else None

  @per_group()
  def append(self, layer, positions, latent, index_key):
    # Backup first (write before the swap-in reads the pool: no hidden pool copy). The hot buffer's copy of
    # the row is written by the swap-in kernel in gather(): an XLA write of the hot buffer here, feeding the
    # aliased custom call, would not be done in place (XLA copies the whole buffer, every layer).
    dst = host_rows(self.host_pages, positions, self.page_size)[:, 0]
    newest = latent[:, 0].astype(self.hot.dtype)
    host_pool, status = ops.backup(layer, newest[None], dst, self.host_pool, external=self.external)
    staging = self.staging
    if self.residency != "none":  # resident rows keep their whole latent KV on device (-1 rows are dropped)
      staging = write_rows(staging, layer, self.resident_pages, positions, latent, self.page_size)
    return dataclasses.replace(
      self,
      newest=newest,
      host_pool=host_pool,
      status=_first_failure(self.status, status),
      staging=staging,
      index=write_rows(self.index, layer, self.index_pages, positions, index_key, self.page_size),
    )

  @per_group()
  def index_keys(self, layer, start, size):
    return read_block(self.index, layer, self.index_pages, start, size, self.page_size)

  @per_group()
  def gather(self, layer, positions, top_k, index_q=None, index_w=None):
    if top_k.shape[1] != 1:
      raise ValueError(f"HiSparse decode takes one query per row, got {top_k.shape[1]}")
    if self.newest is None:
      raise ValueError("HiSparse decode gathers a layer only after appending its newest rows")
    req_ids, seq_lens = self.req_ids, positions[:, 0] + 1  # idle rows: position -1 -> seq_len 0
    resident = resident_rows = None
    if self.residency != "none":
      # The stored rows bit for bit, as from the hot buffer (zeros at padding): losslessness holds per row.
      resident_rows = gather_rows(self.staging, layer, self.resident_pages, top_k[:, 0], self.page_size)
      if self.residency == "all":
        return resident_rows[:, None], dataclasses.replace(self, newest=None)
      resident = self.resident_pages[:, 0] >= 0
      req_ids, seq_lens = jnp.where(resident, -1, req_ids), jnp.where(resident, 0, seq_lens)  # idle kernel rows
    slot_scores = slots = None
    if self.eviction in SCORED_EVICTIONS:
      if index_q is None or index_w is None:
        raise ValueError(f'eviction "{self.eviction}" needs the indexer queries of layer {layer} (it has no indexer)')
      slots = self.slot_tokens[layer][jnp.maximum(req_ids, 0)]  # [B, D] positions, -1 empty
      keys = decode_keys(gather_rows(self.index, layer, self.index_pages, slots, self.page_size))  # float32[B, D, Di]
      slot_scores = index_scores(index_q, index_w, keys)[:, 0]  # [B, D]
      if self.eviction == "score_ema":
        slot_scores = slot_score_ema(self.score_ema[layer][jnp.maximum(req_ids, 0)], slot_scores)
    hot, slot_tokens, lru, prefetched = self.hot, self.slot_tokens, self.lru, self.prefetched
    if self.prefetch_ticket is not None:  # this layer's prefetch lands before its swap-in
      hot, slot_tokens, lru, placed = ops.prefetch_wait(
        self.prefetch_ticket, hot, slot_tokens, lru, self.newest, batch=req_ids.shape[0]
      )
      prefetched = self.prefetched.at[layer, jnp.where(req_ids >= 0, req_ids, hot.shape[1])].add(
        jnp.maximum(placed, 0), mode="drop"
      )  # a stale or failed row (-code) placed nothing
    rows, host_pool, hot, slot_tokens, lru, stats, status = ops.swap_in(
      layer,
      top_k[:, 0],
      seq_lens,
      req_ids,
      self.host_pages,
      self.newest,
      self.host_pool,
      hot,
      slot_tokens,
      lru,
      self.stats,
      slot_scores,
      page_size=self.page_size,
      eviction="score" if self.eviction == "score_ema" else self.eviction,
      external=self.external,
    )
    R, D1, W = hot.shape[1], hot.shape[2], hot.shape[3]
    score_ema = self.score_ema
    if score_ema is not None:  # idle and resident rows (req_ids -1) write nothing
      ema = restart_score_ema(slot_scores, slots, slot_tokens[layer][jnp.maximum(req_ids, 0)], seq_lens)
      score_ema = score_ema.at[layer, jnp.where(req_ids >= 0, req_ids, R)].set(ema, mode="drop")
    out = hot[layer].reshape(R * D1, W)[jnp.maximum(rows, 0)]
    out = jnp.where((top_k[:, 0] >= 0)[..., None], out, jnp.zeros((), out.dtype))
    if resident is not None:
      out = jnp.where(resident[:, None, None], resident_rows, out)
    ticket = None
    if self.prefetch_depth and layer + 1 < hot.shape[0]:
      # The prefetch starts before this layer's attention uses its rows (the barrier), so the background work
      # overlaps that work.
      host_pool, ticket = ops.prefetch_start(
        layer + 1,
        top_k[:, 0, : self.prefetch_depth],
        seq_lens,
        req_ids,
        self.host_pages,
        host_pool,
        hot,
        slot_tokens,
        lru,
        page_size=self.page_size,
        eviction=self.eviction,
        external=self.external,
      )
      out, ticket = jax.lax.optimization_barrier((out, ticket))
    view = dataclasses.replace(
      self,
      hot=hot,
      host_pool=host_pool,
      slot_tokens=slot_tokens,
      lru=lru,
      stats=stats,
      newest=None,
      status=_first_failure(self.status, status),
      prefetch_ticket=ticket,
      prefetched=prefetched,
      score_ema=score_ema,
    )
    return out[:, None], view


def host_rows(host_pages, positions, page_size):
  """Host-pool row of each position (int32[B, Q]): page * page_size + offset, -1 for padding / no page."""
  pid = _page_ids(host_pages, positions, page_size, missing=-1)
  return jnp.where(pid >= 0, pid * page_size + jnp.maximum(positions, 0) % page_size, -1)


@_pytree(
  data=("index", "staging", "hot", "slot_tokens", "lru", "stats", "prefetched", "host_pool", "score_ema"),
  meta=("page_size", "external", "eviction", "prefetch_depth"),
)
@dataclasses.dataclass
class HiSparseState:
  """HiSparse KV memory (see the module docstring). hot: T[L, R+1, D+1, W]; slot_tokens, lru: int32[L, R+1, D];
  stats: int32[L, R+1, 2] cumulative swap-in (hits, misses) of the request in each slot; prefetched: int32[L,
  R+1] the rows the cross-layer prefetch placed for it (``ops.prefetch_wait``; zeros without one); host_pool:
  T[L, H, W] in ``pinned_host`` memory, or the int32[1] ordering token of the extension pool ``external``;
  score_ema: float32[L, R+1, D] each slot's score average under eviction "score_ema" (NaN: restarts at the
  next step; ``HiSparseDecodeView``), None under the other policies.

  Request slot R is a scratch slot no request owns: prefill rows that do not end a prompt write their (unused)
  hot-buffer rows there, so every hot-buffer write is in bounds."""

  index: jax.Array
  staging: jax.Array
  hot: jax.Array
  slot_tokens: jax.Array
  lru: jax.Array
  stats: jax.Array
  prefetched: jax.Array
  host_pool: jax.Array
  page_size: int
  external: ops.ExternalPoolRef | None = None
  eviction: str = "lru"
  prefetch_depth: int = 0
  score_ema: jax.Array | None = None

  @classmethod
  def create(
    cls,
    *,
    num_layers,
    page_size,
    latent_dim,
    index_dim,
    dtype,
    index_pages,
    staging_pages,
    request_slots,
    device_buffer_size,
    host_pages,
    external_pool: ops.ExtensionHostPool | None = None,
    mesh=None,
    groups: int = 1,
    eviction: str = "lru",
    prefetch_depth: int = 0,
    index_dtype=jnp.float32,
  ) -> "HiSparseState":
    """Zeroed pools (latent_dim / dtype and index_dim / index_dtype: the stored rows', ``DSAConfig.kv_row`` /
    ``kv_index_row``). The host pool is allocated straight in ``pinned_host`` memory, or is ``external_pool``
    (shape [L, host_pages * page_size, latent_dim]; the caller keeps it alive). On the first device, or
    on ``mesh`` (``_placement``; not with external_pool). eviction: the swap-in's policy (``config.EVICTIONS``;
    ValueError otherwise, before anything is allocated); prefetch_depth: the decode views' cross-layer
    prefetch (``HiSparseDecodeView``; 0: none; > 0 needs eviction "lru" or "clock"). groups: DP groups, each
    with the sizes given (the arrays hold groups x index_pages pages, groups x (request_slots + 1) hot
    buffers, ...)."""
    if mesh is not None and external_pool is not None:
      raise ValueError("an extension-owned host pool serves one device; a mesh needs the pinned_host pool")
    if eviction not in EVICTIONS:
      raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    if (
      isinstance(prefetch_depth, bool)
      or not isinstance(prefetch_depth, int)
      or prefetch_depth < 0
      or (prefetch_depth and eviction in SCORED_EVICTIONS)
    ):
      raise ValueError(
        f"prefetch_depth must be an integer >= 0 (> 0 with eviction lru or clock), got "
        f"{prefetch_depth!r} with eviction {eviction!r}"
      )
    L, R, D = num_layers, groups * (request_slots + 1), device_buffer_size  # + each group's scratch slot
    H = groups * host_pages * page_size
    index_pages, staging_pages = groups * index_pages, groups * staging_pages
    if external_pool is not None:
      if external_pool.shape != (L, H, latent_dim) or external_pool.dtype != jnp.dtype(dtype):
        raise ValueError(
          f"external pool {external_pool.shape} {external_pool.dtype} does not match "
          f"{(L, H, latent_dim)} {jnp.dtype(dtype)}"
        )
      host_pool = jax.device_put(external_pool.token(), jax.devices()[0])
    else:
      # With the placement inside the function the pool's type carries <host> (a pool typed
      # without it aborts when donated).
      kw = {} if mesh is None else {"out_shardings": _placement(mesh, "pinned_host")}
      host_pool = jax.jit(lambda: jax.device_put(jnp.zeros((L, H, latent_dim), dtype), jax.memory.Space.Host), **kw)()

    def device():
      slots = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (L, R, D))
      arrays = dict(
        index=jnp.zeros((L, index_pages, page_size, index_dim), index_dtype),
        staging=jnp.zeros((L, staging_pages, page_size, latent_dim), dtype),
        hot=jnp.zeros((L, R, D + 1, latent_dim), dtype),
        slot_tokens=slots,
        lru=slots + 0,
        stats=jnp.zeros((L, R, 2), jnp.int32),
        prefetched=jnp.zeros((L, R), jnp.int32),
      )
      if eviction == "score_ema":
        arrays["score_ema"] = jnp.full((L, R, D), jnp.nan, jnp.float32)
      return arrays

    arrays = jax.jit(device, out_shardings=_placement(mesh))()
    return cls(
      **arrays,
      host_pool=host_pool,
      page_size=page_size,
      external=None if external_pool is None else external_pool.ref,
      eviction=eviction,
      prefetch_depth=prefetch_depth,
    )

  @property
  def device_buffer_size(self) -> int:
    return self.slot_tokens.shape[2]

  def view(self, tables, residency: str = "none"):
    """A prefill view for tables {"index_pages", "staging_pages", "host_pages", "hot_slot"}, a decode view
    for tables {"index_pages", "host_pages", "req_ids"} (all int32[B, P] / int32[B]), plus "resident_pages"
    unless residency (``RESIDENCY``, static) is "none"."""
    status = jnp.zeros(tables["host_pages"].shape[:1], jnp.int32)
    if "staging_pages" in tables:
      return HiSparsePrefillView(
        self.index,
        tables["index_pages"],
        self.staging,
        tables["staging_pages"],
        status,
        self.host_pool,
        tables["host_pages"],
        self.page_size,
        self.external,
      )
    if residency not in RESIDENCY:
      raise ValueError(f"residency must be one of {RESIDENCY}, got {residency!r}")
    resident = residency != "none"
    return HiSparseDecodeView(
      self.index,
      tables["index_pages"],
      self.hot,
      self.slot_tokens,
      self.lru,
      self.stats,
      tables["req_ids"],
      None,
      status,
      self.staging if resident else None,
      tables["resident_pages"] if resident else None,
      None,
      self.host_pool,
      tables["host_pages"],
      self.page_size,
      self.external,
      self.eviction,
      residency,
      self.prefetch_depth,
      self.prefetched,
      self.score_ema,
    )

  def absorb(self, view) -> "HiSparseState":
    """The state with the view's updated arrays. ValueError (at trace time) for a decode view whose last
    prefetch was never waited for (a layer not gathered: its rows could still be landing)."""
    if getattr(view, "prefetch_ticket", None) is not None:
      raise ValueError("a cross-layer prefetch is still in flight: the model gathered a layer but not the next")
    return _absorb(self, view)

  @per_group(replicated=(1, 2, 3))
  def import_prompt(self, tables, latent, index, length) -> tuple["HiSparseState", jax.Array]:
    """(state, status int32[1] per DP group: the backup's, ``ops.check_status``) after writing one request's
    prompt KV computed elsewhere (latent T[L, P, W], index I[L, P, Di], P >= length
    (an int32 scalar); positions 0..length-1; tables: a one-row-per-group decode batch): indexer keys to its
    device pages, latent rows to its host rows (backup kernel), and its hot buffer as a prefill leaves it (slot
    s = position s, s <= D; rows past the prompt are written by decode before they are read; LRU and stats
    reset, score averages restarted), with no staging pages."""
    L, P, _ = latent.shape
    D1 = self.hot.shape[2]
    positions = _prompt_positions(P, length)
    dst = host_rows(tables["host_pages"], positions, self.page_size)[0]
    host_pool, status = ops.backup(0, latent.astype(self.hot.dtype), dst, self.host_pool, external=self.external)
    index_pool = self.index
    for l in range(L):
      index_pool = write_rows(index_pool, l, tables["index_pages"], positions, index[l][None], self.page_size)
    n = min(P, D1)
    slot = tables["req_ids"][0]
    rows = jnp.zeros((L, D1, latent.shape[2]), self.hot.dtype).at[:, :n].set(latent[:, :n].astype(self.hot.dtype))
    slots = jnp.broadcast_to(jnp.arange(D1 - 1, dtype=jnp.int32), (L, D1 - 1))
    score_ema = None if self.score_ema is None else self.score_ema.at[:, slot].set(jnp.nan)
    return dataclasses.replace(
      self,
      index=index_pool,
      host_pool=host_pool,
      hot=self.hot.at[:, slot].set(rows),
      slot_tokens=self.slot_tokens.at[:, slot].set(slots),
      lru=self.lru.at[:, slot].set(slots),
      stats=self.stats.at[:, slot].set(jnp.zeros((L, 2), jnp.int32)),
      prefetched=self.prefetched.at[:, slot].set(0),
      score_ema=score_ema,
    ), status.max(keepdims=True)

  @per_group(replicated=(1,))
  def export_prompt(self, tables, length, size: int):
    """One request's prompt KV while it prefills (before its staging pages are freed): (latent T[B, L, size,
    W] from the staging pages, index I[B, L, size, Di] from the index pages), zeros from ``length`` on
    (tables: a prefill batch's)."""
    return _export(
      self.staging, self.index, tables["staging_pages"], tables["index_pages"], length, size, self.page_size
    )

  @per_group()
  def finish_prefill(self, tables) -> "HiSparseState":
    """Hot buffers of the rows whose prompt ended in this call (tables["hot_slot"][b] = its request slot;
    the scratch slot R for the others): slots 0..D take positions 0..D from staging (slot s holds token s, as
    the swap-in's fast path assumes; rows past the prompt are written by decode before they are read), the
    slot table and LRU order restart as 0..D-1, the stats and prefetch counts at zero and the score averages
    (eviction "score_ema") with no history."""
    return self._fill_hot(tables, True)

  @per_group()
  def offload(self, tables) -> "HiSparseState":
    """Dynamic residency: resident requests move to their hot buffers (tables as ``finish_prefill``'s, from
    the requests' staging pages, which hold every position; their host rows are already written), the
    swap-in stats kept, the score averages restarted. The caller frees the staging pages afterwards."""
    return self._fill_hot(tables, False)

  def _fill_hot(self, tables, reset_stats: bool) -> "HiSparseState":
    L, R, D1, _ = self.hot.shape
    D = D1 - 1
    target = tables["hot_slot"]  # int32[B]
    B = target.shape[0]
    pos = jnp.broadcast_to(jnp.arange(D1, dtype=jnp.int32), (B, D1))
    pid = _page_ids(tables["staging_pages"], pos, self.page_size, missing=0)
    rows = self.staging[:, pid, pos % self.page_size]  # [L, B, D+1, W]
    slots = jnp.broadcast_to(jnp.arange(D, dtype=jnp.int32), (L, B, D))
    inb = "promise_in_bounds"
    stats, prefetched = self.stats, self.prefetched
    if reset_stats:
      stats = stats.at[:, target].set(jnp.zeros((L, B, 2), jnp.int32), mode=inb)
      prefetched = prefetched.at[:, target].set(jnp.zeros((L, B), jnp.int32), mode=inb)
    score_ema = None if self.score_ema is None else self.score_ema.at[:, target].set(jnp.nan, mode=inb)
    return dataclasses.replace(
      self,
      hot=self.hot.at[:, target].set(rows, mode=inb),
      slot_tokens=self.slot_tokens.at[:, target].set(slots, mode=inb),
      lru=self.lru.at[:, target].set(slots, mode=inb),
      stats=stats,
      prefetched=prefetched,
      score_ema=score_ema,
    )
