"""KV memory on the host side: one backend object per mode owns pools, page tables and accounting.

    KVBackend (abstract: the engine's whole view of KV memory)
    ├── DenseBackend      one device page pool ("kv": latent + indexer keys of each token)
    └── HiSparseBackend   device pools "index" (indexer keys of every token) and "staging" (a prompt's
                          latent rows while it prefills), one hot buffer per request slot, and the
                          "host" pool (latent rows of every token; ``pinned_host`` JAX array or the
                          extension-owned pool)

The engine is a scheduler: it asks the backend whether a request can be admitted, admits it (a request
slot + pages for its prompt), grows it page by page as it decodes, tells it when a prefill ends, releases
it, and builds each jitted call's page-table rows (``tables``) with it. Admission, the start-up sizing,
``GetLoads`` and the metrics all read the same ``MemoryPlan`` and free lists, so there is no second
formula anywhere.

Memory grows with tokens held: a request holds ceil(tokens / page_size) pages of each per-token pool, so
neither device nor host memory is reserved for ``max_seq_len`` per request. Page tables are int32[R, P]
host arrays (R request slots, P = ceil(max_seq_len / page_size)); only the rows of a batch go to the
device with each call.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.kernels.ops import ExtensionHostPool
from hisparse_jax.memory.allocator import FreeList, OutOfPages
from hisparse_jax.memory.views import DenseState, HiSparseState

HOST_POOL_KINDS = ("jax", "extension")


class MemoryConfigError(ValueError):
  """Sizes that cannot work (the message names the flag to change)."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """Bytes of one token's KV, from the model config (source: models/config.py ``kv_row`` and ``kv_index_row``:
  the latent row and the indexer key as the KV cache stores them).

  Attributes:
    num_layers: L.
    latent_dim: W, the stored latent row's width: kv_lora_rank + qk_rope_head_dim values of the compute
      dtype, or the bytes of an FP8 row (``--kv-cache-dtype fp8_e4m3``: 656 for DeepSeek-V3.2 in bfloat16).
    index_dim: Di, the stored indexer key's width: index_head_dim float32 values, or the bytes of an FP8 key
      (132 for Di 128).
    dtype: the stored latent row's dtype name (the compute dtype's, or "uint8" for an FP8 row).
    index_dtype: the stored indexer key's dtype name ("float32", or "uint8" for FP8 keys).
  """

  num_layers: int
  latent_dim: int
  index_dim: int
  dtype: str
  index_dtype: str = "float32"

  @classmethod
  def of(cls, model_cfg, dtype) -> "KVLayout":
    """The layout of model_cfg (a ``models.config.DSAConfig``, its ``kv_cache_dtype`` included) computing in
    dtype."""
    width, stored = model_cfg.kv_row(dtype)
    index_width, index_stored = model_cfg.kv_index_row()
    return cls(model_cfg.num_hidden_layers, width, index_width, stored.name, index_stored.name)

  @property
  def itemsize(self) -> int:
    """Bytes per stored latent element (1 for an FP8 row)."""
    return np.dtype(self.dtype).itemsize

  @property
  def row_bytes(self) -> int:
    """One token's latent row of one layer: W x itemsize."""
    return self.latent_dim * self.itemsize

  @property
  def latent_bytes(self) -> int:
    """One token's latent rows, all layers: L x W x itemsize."""
    return self.num_layers * self.row_bytes

  @property
  def index_bytes(self) -> int:
    """One token's indexer keys, all layers: L x Di x the key dtype's itemsize."""
    return self.num_layers * self.index_dim * np.dtype(self.index_dtype).itemsize

  def hot_buffer_bytes(self, device_buffer_size: int, eviction: str = "lru") -> int:
    """One request's hot buffer on device: (D + 1) latent rows + slot table and LRU (int32[D] each) +
    stats (int32[2]) + prefetch count (int32) + under eviction "score_ema" the slots' score averages
    (float32[D]), all layers."""
    D = device_buffer_size
    return (D + 1) * self.latent_bytes + self.num_layers * (8 * D + 12 + (4 * D if eviction == "score_ema" else 0))


@dataclasses.dataclass(frozen=True)
class PoolUsage:
  """One pool's size and use (GetLoads, metrics). memory: "device" or "host"."""

  name: str
  memory: str
  page_size: int
  pages_total: int
  pages_free: int
  bytes_per_page: int

  @property
  def bytes_total(self) -> int:
    return self.pages_total * self.bytes_per_page

  @property
  def bytes_used(self) -> int:
    return (self.pages_total - self.pages_free) * self.bytes_per_page


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Pool sizes of one mode, derived from the device KV budget and the model. Built by ``plan()``.

  Attributes:
    page_size: tokens per page.
    request_slots: R, requests that can run at once (each holds a hot buffer in HiSparse mode).
    max_pages: P, page-table width = ceil(max_seq_len / page_size).
    pools: name -> (memory, pages, bytes per page), e.g. {"kv": ("device", 4096, 81920)}.
    device_bytes: bytes of all device pools and hot buffers (<= the budget).
  """

  page_size: int
  request_slots: int
  max_pages: int
  pools: dict
  device_bytes: int


def plan(
  layout: KVLayout,
  *,
  budget: int,
  max_running_requests: int,
  max_seq_len: int,
  page_size: int,
  hisparse: HiSparseConfig | None,
) -> MemoryPlan:
  """Sizes the pools of a mode within ``budget`` bytes of device memory.

  Dense: every token holds one "kv" page slot (latent + indexer key): pages = budget // (page x
  (latent + index bytes per token)).
  HiSparse (SGLang's layout): "staging" pages for max_seq_len tokens (one longest prompt, or several
  shorter ones, can prefill at once); R = max_running_requests hot buffers of D + 1 rows, lowered so that
  they take at most half of the budget left after staging; of the rest, resident_fraction is more staging
  pages (dynamic residency: resident requests' latent rows) and what remains is "index" pages; the host pool holds
  host_to_device_ratio x R x (D + 1) rows (SGLang's sizing), in pages, and never less than one max_seq_len
  request.
  A per-token pool never gets more pages than R requests of max_seq_len tokens could fill (R x P).

  Raises:
    MemoryConfigError: the budget cannot hold one page (dense) or one hot buffer + the staging pages + one
      index page (HiSparse; also when resident_fraction leaves no index page); page_size < 1.
  """
  if page_size < 1:
    raise MemoryConfigError(f"--page-size must be >= 1, got {page_size}")
  P = math.ceil(max_seq_len / page_size)
  if hisparse is None:
    per_page = page_size * (layout.latent_bytes + layout.index_bytes)
    pages = min(budget // per_page, max_running_requests * P)
    if pages < 1:
      raise MemoryConfigError(
        f"the device KV budget of {budget} bytes (--max-device-kv-bytes / --mem-fraction-static) is smaller than "
        f"one page of {page_size} tokens ({per_page} bytes): raise the budget or lower --page-size"
      )
    return MemoryPlan(page_size, max_running_requests, P, {"kv": ("device", pages, per_page)}, pages * per_page)
  index_page = page_size * layout.index_bytes
  staging_page = page_size * layout.latent_bytes
  staging = P * staging_page
  hot = layout.hot_buffer_bytes(hisparse.device_buffer_size, hisparse.eviction)
  avail = budget - staging
  # Hot buffers take at most half of what staging leaves (the rest holds the indexer keys of every token);
  # at least one hot buffer with one index page must fit.
  slots = min(max_running_requests, max(avail // 2 // hot, 1 if avail >= hot + index_page else 0))
  if slots < 1:
    raise MemoryConfigError(
      f"the device KV budget of {budget} bytes (--max-device-kv-bytes / --mem-fraction-static) cannot hold "
      f"HiSparse's staging pages for one --max-seq-len {max_seq_len} prompt ({staging} bytes) plus one hot buffer "
      f"(device_buffer_size {hisparse.device_buffer_size}: {hot} bytes) and one index page ({index_page} bytes): "
      "raise the budget, or lower --max-seq-len (the staging pages grow with it)"
    )
  rest = budget - staging - slots * hot
  # Dynamic residency: resident_fraction of the rest holds resident requests' latent rows (more staging pages).
  resident_pages = min(int(rest * hisparse.resident_fraction) // staging_page, slots * P)
  index_pages = min((rest - resident_pages * staging_page) // index_page, slots * P)
  if index_pages < 1:
    raise MemoryConfigError(
      f"--hisparse-config resident_fraction {hisparse.resident_fraction} leaves no index page in the device KV "
      f"budget of {budget} bytes (index pages of {index_page} bytes hold every token's indexer keys): lower it"
    )
  host_pages = max(hisparse.host_pool_rows(slots) // page_size, P)  # at least one max_seq_len request
  pools = {
    "index": ("device", index_pages, index_page),
    "staging": ("device", P + resident_pages, staging_page),
    "host": ("host", host_pages, staging_page),
  }
  return MemoryPlan(
    page_size, slots, P, pools, staging + resident_pages * staging_page + slots * hot + index_pages * index_page
  )


def request_bytes(layout: KVLayout, hisparse: HiSparseConfig | None, page_size: int, tokens: int) -> dict:
  """The most memory one request of `tokens` tokens holds while it decodes, in bytes per memory kind:
  dense {"device": pages x page x (latent + index bytes per token)}; HiSparse {"device": index pages + its
  hot buffer, "host": latent pages}. (A HiSparse prompt's staging pages are shared and held while it prefills,
  and with dynamic residency while it stays resident: pages it gives back under pressure.) The same page sizes
  as ``plan``."""
  nbytes = -(-tokens // page_size) * page_size
  if hisparse is None:
    return {"device": nbytes * (layout.latent_bytes + layout.index_bytes), "host": 0}
  hot = layout.hot_buffer_bytes(hisparse.device_buffer_size, hisparse.eviction)
  return {"device": nbytes * layout.index_bytes + hot, "host": nbytes * layout.latent_bytes}


@dataclasses.dataclass
class RequestKV:
  """What one request holds: its request slot (numbered across groups: group x slots per group + its slot in
  the group), its DP group, its pages per pool (logical page order; page ids within its group's pools) and the
  positions they cover (``capacity`` tokens)."""

  slot: int
  pages: dict
  capacity: int = 0
  group: int = 0
  resident: bool = False  # dynamic residency: its whole latent KV in staging pages, attended from there


class KVBackend(abc.ABC):
  """The KV memory of one mode (see the module docstring). Not thread-safe: the engine's thread only.

  With ``groups`` > 1 (data-parallel attention) every group has the pools and request slots of ``plan`` on
  its own devices: its own free lists, page ids local to its pools. A batch's rows are group-major (rows
  [g x B/groups, (g + 1) x B/groups) belong to group g), and its tables carry each group's local ids.

  Attributes:
    plan: the pool sizes of one group.
    groups: DP groups.
    state: the device arrays (a pytree: ``DenseState`` / ``HiSparseState``), replaced by the engine with
      each jitted call's output.
  """

  #: pools whose pages every token needs while the request runs (grown as it decodes)
  token_pools: tuple[str, ...] = ()
  #: pools holding the prompt while it prefills (with dynamic residency, kept while the request is resident)
  prompt_pools: tuple[str, ...] = ()
  #: dynamic residency (HiSparse with resident_fraction > 0): requests keep their staging pages after prefill
  residency_on: bool = False

  def __init__(self, plan: MemoryPlan, layout: KVLayout, groups: int = 1):
    self.plan = plan
    self.layout = layout
    self.groups = groups
    self.page_size = plan.page_size
    self.max_pages = plan.max_pages
    self._group_lists = [
      {name: FreeList(pages, f"{name} pages") for name, (_, pages, _) in plan.pools.items()} for _ in range(groups)
    ]
    self._group_slots = [FreeList(plan.request_slots, "request slots") for _ in range(groups)]
    R, P = plan.request_slots, plan.max_pages
    self._tables = {name: np.full((groups * R, P), -1, np.int32) for name in plan.pools}

  # ------------------------------------------------------------------ sizes
  @property
  def slots_per_group(self) -> int:
    return self.plan.request_slots

  @property
  def request_slots(self) -> int:
    return self.groups * self.plan.request_slots

  @property
  def free_slots(self) -> int:
    return sum(s.num_free for s in self._group_slots)

  def local_slot(self, kv: "RequestKV") -> int:
    """kv's request slot within its group (its hot buffer's index in the group's state shard)."""
    return kv.slot - kv.group * self.plan.request_slots

  def _pages(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def never_fits(self, prompt_len: int, total_len: int) -> str | None:
    """Why a request of prompt_len prompt tokens and total_len tokens in all could never run alone
    (None if it can). Reads only sizes fixed at start-up: safe from any thread."""
    for name in self.token_pools + self.prompt_pools:
      tokens = total_len if name in self.token_pools else prompt_len
      need, (memory, have, _) = self._pages(tokens), self.plan.pools[name]
      if need > have:
        return (
          f"request needs {need} pages of the {name} pool ({memory} memory; {tokens} tokens, "
          f"{self.page_size} a page); the pool holds {have}"
        )
    return None

  def can_admit(
    self, prompt_len: int, reserve_pages: int = 0, prefill: bool = True, group: int = 0, reclaimable=None
  ) -> bool:
    """A slot and pages of `group` for the prompt plus its first decoded token are free now, leaving
    reserve_pages free in each per-token pool (growth room for the running requests); prefill=False: the
    prompt's KV arrives computed (an import) and needs no prompt-only pages. reclaimable: None, or one
    {prompt pool name: pages} per group (``reclaimable_pages``), pages that count as free because
    offloading resident requests frees them."""
    lists = self._group_lists[group]
    if not self._group_slots[group].num_free:
      return False
    for name in self.token_pools:
      if self._pages(prompt_len + 1) + reserve_pages > lists[name].num_free:
        return False
    extra = reclaimable[group] if reclaimable is not None else {}
    return not prefill or all(
      self._pages(prompt_len) <= lists[name].num_free + extra.get(name, 0) for name in self.prompt_pools
    )

  def reclaimable_pages(self, resident) -> list[dict[str, int]]:
    """Per group, {prompt pool name: pages} held by the resident requests `resident` (RequestKVs): what
    offloading them to their hot buffers would free. O(len(resident))."""
    out = [dict.fromkeys(self.prompt_pools, 0) for _ in range(self.groups)]
    for kv in resident:
      for name in self.prompt_pools:
        out[kv.group][name] += len(kv.pages.get(name, ()))
    return out

  def free_pages(self, name: str, group: int = 0) -> int:
    """Free pages of pool `name` in `group`."""
    return self._group_lists[group][name].num_free

  def pick_group(
    self, prompt_len: int, reserve_pages=0, prefill: bool = True, reclaimable=None, only: int | None = None
  ) -> int | None:
    """The group a new request goes to: of those that can admit it now, the one with the most free request
    slots (then the lowest index); None if none can. reserve_pages: an int, or one per group; reclaimable:
    as ``can_admit``; only: that group or none (a request pinned to it)."""
    reserve = reserve_pages if isinstance(reserve_pages, (list, tuple)) else [reserve_pages] * self.groups
    fits = [
      g
      for g in (range(self.groups) if only is None else (only,))
      if self.can_admit(prompt_len, reserve[g], prefill, g, reclaimable)
    ]
    return max(fits, key=lambda g: (self._group_slots[g].num_free, -g)) if fits else None

  # --------------------------------------------------------------- lifetime
  def admit(self, prompt_len: int, prefill: bool = True, group: int = 0) -> RequestKV:
    """A request slot and pages of `group` covering prompt_len tokens in every pool (only the per-token
    pools when prefill is False); OutOfPages, holding nothing, if they are not free."""
    slot = group * self.plan.request_slots + self._group_slots[group].alloc(1)[0]
    pools = self.token_pools + (self.prompt_pools if prefill else ())
    kv = RequestKV(slot, {name: [] for name in pools}, group=group)
    try:
      self._grow(kv, prompt_len, pools)
    except OutOfPages:
      self.release(kv)
      raise
    return kv

  def will_grow(self, kv: RequestKV, tokens: int) -> bool:
    """Whether kv needs more pages to hold `tokens` tokens (its final length)."""
    return any(len(kv.pages[name]) < self._pages(tokens) for name in self.token_pools)

  def ensure(self, kv: RequestKV, tokens: int) -> bool:
    """Grows kv's token pools to cover positions [0, tokens); False (holding what it had) if pages ran out."""
    try:
      self._grow(kv, tokens, self.token_pools)
      return True
    except OutOfPages:
      return False

  def _grow(self, kv: RequestKV, tokens: int, pools) -> None:
    if self._pages(tokens) > self.max_pages:  # checked before anything is taken from a free list
      raise OutOfPages(f"{tokens} tokens exceed the page tables' {self.max_pages} pages (max_seq_len)")
    lists = self._group_lists[kv.group]
    need = {name: self._pages(tokens) - len(kv.pages[name]) for name in pools}
    for name, n in need.items():  # check all first: a failure allocates nothing
      if n > lists[name].num_free:
        raise OutOfPages(f"{name} pages: {n} needed, {lists[name].num_free} free")
    for name, n in need.items():
      if n > 0:
        new = lists[name].alloc(n)
        start = len(kv.pages[name])
        kv.pages[name].extend(new)
        self._tables[name][kv.slot, start : start + n] = new
    kv.capacity = max(kv.capacity, tokens)

  def prefill_finished(self, kv: RequestKV) -> None:
    """The request's prompt is in its KV: pools that held only the prompt are released (with dynamic residency
    the request keeps its staging pages and stays resident)."""
    if self.residency_on and kv.pages.get("staging"):
      kv.resident = True
      return
    for name in self.prompt_pools:
      self._free_pool(kv, name)

  def release(self, kv: RequestKV) -> None:
    """Frees everything the request holds (pages and slot)."""
    for name in list(kv.pages):
      self._free_pool(kv, name)
    self._group_slots[kv.group].free([self.local_slot(kv)])
    kv.pages, kv.capacity, kv.resident = {}, 0, False

  def _free_pool(self, kv: RequestKV, name: str) -> None:
    pages = kv.pages.get(name, [])
    if pages:
      self._group_lists[kv.group][name].free(pages)
      self._tables[name][kv.slot, :] = -1
      kv.pages[name] = []

  # ------------------------------------------------------------ batch tables
  def group_rows(self, kv: RequestKV) -> list:
    """A batch of one row per DP group for one request's own call (import, export, offload): kv in its
    group's row, None (an idle row) in the others'."""
    kvs = [None] * self.groups
    kvs[kv.group] = kv
    return kvs

  def _rows(self, name: str, kvs, pages: int | None = None) -> np.ndarray:
    """int32[B, pages]: the first `pages` (default: all P) entries of a batch's page-table rows (-1 rows for
    idle entries None; page ids local to each request's group)."""
    width = self.max_pages if pages is None else min(pages, self.max_pages)
    out = np.full((len(kvs), width), -1, np.int32)
    for b, kv in enumerate(kvs):
      if kv is not None:
        out[b] = self._tables[name][kv.slot, :width]
    return out

  @abc.abstractmethod
  def prefill_tables(self, kvs, finishing) -> dict:
    """Page-table rows of a prefill batch: kvs[b] (None = padding row); finishing[b]: row b's prompt ends in
    this call. A dict of int32 NumPy arrays for ``state.view``."""

  @abc.abstractmethod
  def decode_tables(self, kvs, pages: int | None = None) -> dict:
    """Page-table rows (and request slots) of a decode batch; kvs[b] None = idle row. pages: the rows' first
    `pages` entries only (int32[B, min(pages, P)]), enough for every position the call reads or writes (a
    decode step: its indexer window), so that a step's tables follow the batch's lengths, not max_seq_len."""

  def residency(self, kvs) -> str:
    """Which rows of a decode batch are resident (``views.RESIDENCY``); "none" without dynamic residency."""
    del kvs
    return "none"

  # ------------------------------------------------------------------ stats
  def usage(self) -> list[PoolUsage]:
    """Each pool's pages (total, free; all groups) and bytes: a consistent snapshot (call on the engine's
    thread)."""
    return [
      PoolUsage(
        name,
        memory,
        self.page_size,
        self.groups * pages,
        sum(lists[name].num_free for lists in self._group_lists),
        per_page,
      )
      for name, (memory, pages, per_page) in self.plan.pools.items()
    ]

  def request_bytes(self, tokens: int) -> dict:
    """Bytes per memory kind a request of `tokens` tokens holds at most (module function ``request_bytes``)."""
    return request_bytes(self.layout, getattr(self, "hisparse", None), self.page_size, tokens)

  def swap_stats(self, kv: RequestKV) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(hits per layer, misses per layer, rows prefetched per layer) of the request in kv's slot since its
    admission; None in dense mode. Reads the device (call between steps)."""
    return None


def _check_row_dtype(layout: KVLayout, dtype) -> None:
  if np.dtype(dtype) != np.dtype(layout.dtype):
    raise ValueError(
      f"KV row dtype {np.dtype(dtype)} is not the layout's {layout.dtype} (KVLayout.of and the row "
      "dtype must come from one kv_row)"
    )


class DenseBackend(KVBackend):
  """All KV on device: one pool of pages holding latent rows and indexer keys. dtype: the stored latent row's
  (``DSAConfig.kv_row``: the compute dtype, or uint8 for FP8 rows); ValueError unless it is the layout's
  ``dtype``."""

  token_pools = ("kv",)

  def __init__(self, plan: MemoryPlan, layout: KVLayout, dtype, mesh=None, groups: int = 1):
    _check_row_dtype(layout, dtype)
    super().__init__(plan, layout, groups)
    self.state = DenseState.create(
      num_layers=layout.num_layers,
      num_pages=groups * plan.pools["kv"][1],
      page_size=plan.page_size,
      latent_dim=layout.latent_dim,
      index_dim=layout.index_dim,
      dtype=dtype,
      index_dtype=layout.index_dtype,
      mesh=mesh,
    )

  def prefill_tables(self, kvs, finishing) -> dict:
    del finishing
    return {"pages": self._rows("kv", kvs)}

  def decode_tables(self, kvs, pages: int | None = None) -> dict:
    return {"pages": self._rows("kv", kvs, pages)}


class HiSparseBackend(KVBackend):
  """HiSparse: indexer keys of every token on device, latent rows in the host pool, a hot buffer per
  request slot, prompts staged on device while they prefill (and, with dynamic residency, kept there while
  the request is resident).

  Args:
    dtype: the stored latent row's (``DSAConfig.kv_row``: the compute dtype, or uint8 for FP8 rows);
      ValueError unless it is the layout's ``dtype``.
    host_pool: "jax" (a ``pinned_host`` JAX array) or "extension" (``ExtensionHostPool``: memory owned by
      the FFI extension, the fallback where XLA cannot hand a ``pinned_host`` operand to a custom call).
  """

  token_pools = ("index", "host")
  prompt_pools = ("staging",)

  def __init__(
    self,
    plan: MemoryPlan,
    layout: KVLayout,
    dtype,
    hisparse: HiSparseConfig,
    host_pool: str = "jax",
    mesh=None,
    groups: int = 1,
  ):
    _check_row_dtype(layout, dtype)
    super().__init__(plan, layout, groups)
    if host_pool not in HOST_POOL_KINDS:
      raise MemoryConfigError(f"--host-pool must be one of {HOST_POOL_KINDS}, got {host_pool!r}")
    self.hisparse = hisparse
    self.residency_on = hisparse.resident_fraction > 0
    self.mesh = mesh
    # One request slot's stats, whole on every device (every process can read it; the stats are split over
    # the DP groups).
    out = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    self._slot_stats = jax.jit(
      lambda stats, prefetched, slot: jnp.concatenate(
        [jnp.take(stats, slot, axis=1), jnp.take(prefetched, slot, axis=1)[:, None]], axis=1
      ),
      out_shardings=out,
    )
    host_rows = plan.pools["host"][1] * plan.page_size
    self.external_pool = (
      ExtensionHostPool(layout.num_layers, host_rows, layout.latent_dim, dtype) if host_pool == "extension" else None
    )
    self.state = HiSparseState.create(
      num_layers=layout.num_layers,
      page_size=plan.page_size,
      latent_dim=layout.latent_dim,
      index_dim=layout.index_dim,
      dtype=dtype,
      index_dtype=layout.index_dtype,
      index_pages=plan.pools["index"][1],
      staging_pages=plan.pools["staging"][1],
      request_slots=plan.request_slots,
      device_buffer_size=hisparse.device_buffer_size,
      host_pages=plan.pools["host"][1],
      external_pool=self.external_pool,
      mesh=mesh,
      groups=groups,
      eviction=hisparse.eviction,
      prefetch_depth=hisparse.prefetch_positions,
    )

  def prefill_tables(self, kvs, finishing) -> dict:
    scratch = self.slots_per_group  # the state's scratch hot-buffer slot (in every group)
    hot_slot = np.array(
      [self.local_slot(kv) if (kv is not None and done) else scratch for kv, done in zip(kvs, finishing)], np.int32
    )
    return {
      "index_pages": self._rows("index", kvs),
      "staging_pages": self._rows("staging", kvs),
      "host_pages": self._rows("host", kvs),
      "hot_slot": hot_slot,
    }

  def decode_tables(self, kvs, pages: int | None = None) -> dict:
    tables = {
      "index_pages": self._rows("index", kvs, pages),
      "host_pages": self._rows("host", kvs, pages),
      "req_ids": np.array([-1 if kv is None else self.local_slot(kv) for kv in kvs], np.int32),
    }
    if self.residency(kvs) != "none":
      tables["resident_pages"] = self._rows(
        "staging", [kv if kv is not None and kv.resident else None for kv in kvs], pages
      )
    return tables

  def residency(self, kvs) -> str:
    """Which rows of a decode batch are resident (``views.RESIDENCY``): "none", "all" or "mixed"."""
    active = [kv for kv in kvs if kv is not None]
    resident = sum(kv.resident for kv in active)
    return "none" if not resident else "all" if resident == len(active) else "mixed"

  def grow_resident(self, kv: RequestKV, tokens: int) -> bool:
    """A resident request's staging pages grown to cover positions [0, tokens); False (holding what it had)
    if none are free: the engine then offloads it."""
    try:
      self._grow(kv, tokens, ("staging",))
      return True
    except OutOfPages:
      return False

  def offload_tables(self, kv: RequestKV) -> dict:
    """Tables of ``state.offload`` for one resident request: one row per DP group (the others target the
    scratch hot buffer)."""
    kvs = self.group_rows(kv)
    return self.prefill_tables(kvs, [k is not None for k in kvs])

  def offloaded(self, kv: RequestKV) -> None:
    """After ``state.offload``: the request's staging pages are free and it decodes through its hot buffer."""
    self._free_pool(kv, "staging")
    kv.resident = False

  def usage(self) -> list[PoolUsage]:
    hot = self.layout.hot_buffer_bytes(self.hisparse.device_buffer_size, self.hisparse.eviction)
    return super().usage() + [PoolUsage("hot", "device", 1, self.request_slots, self.free_slots, hot)]

  def swap_stats(self, kv: RequestKV):
    # Each group's state shard holds slots_per_group + 1 hot buffers (the last a scratch one).
    slot = np.int32(kv.group * (self.slots_per_group + 1) + self.local_slot(kv))
    slot = jnp.asarray(slot) if self.mesh is None else jax.device_put(slot, NamedSharding(self.mesh, PartitionSpec()))
    per_layer = np.asarray(self._slot_stats(self.state.stats, self.state.prefetched, slot))
    return tuple(tuple(per_layer[:, i].tolist()) for i in range(3))


def create_backend(
  layout: KVLayout,
  dtype,
  *,
  budget: int,
  max_running_requests: int,
  max_seq_len: int,
  page_size: int,
  hisparse: HiSparseConfig | None,
  host_pool: str = "jax",
  mesh=None,
  groups: int = 1,
) -> KVBackend:
  """The backend of a mode, its pools sized by ``plan`` (MemoryConfigError names the flag at fault); its
  arrays on the first device, or on ``mesh`` (``groups`` DP groups, each replicated over its tp devices)."""
  p = plan(
    layout,
    budget=budget,
    max_running_requests=max_running_requests,
    max_seq_len=max_seq_len,
    page_size=page_size,
    hisparse=hisparse,
  )
  if hisparse is None:
    return DenseBackend(p, layout, dtype, mesh, groups)
  return HiSparseBackend(p, layout, dtype, hisparse, host_pool, mesh, groups)
