"""KV memory: free lists, pool sizing from the budget, page accounting of the backends."""

import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.memory import backend as kvmem
from hisparse_jax.memory.allocator import FreeList, OutOfPages

LAYOUT = kvmem.KVLayout(num_layers=3, latent_dim=48, index_dim=16, dtype="float32")  # the tiny test model


def test_free_list_alloc_free_and_errors():
  fl = FreeList(5, "pages")
  assert fl.alloc(2) == [0, 1] and fl.num_free == 3
  with pytest.raises(OutOfPages, match="4 needed, 3 free"):
    fl.alloc(4)
  assert fl.num_free == 3  # a failed alloc takes nothing
  fl.free([1])
  assert fl.alloc(1) == [1]  # last freed, first reused
  with pytest.raises(ValueError, match="id 3 is not allocated"):
    fl.free([0, 3])
  assert fl.num_used == 2  # a failed free returns nothing
  with pytest.raises(ValueError, match="id 0 is not allocated"):
    fl.free([0, 0])
  with pytest.raises(ValueError, match="not allocated"):
    fl.free([7])


def test_layout_bytes_follow_the_model():
  assert LAYOUT.latent_bytes == 3 * 48 * 4 and LAYOUT.index_bytes == 3 * 16 * 4
  assert LAYOUT.hot_buffer_bytes(16) == 17 * 3 * 48 * 4 + 3 * (8 * 16 + 12)
  assert LAYOUT.hot_buffer_bytes(16, "score_ema") == LAYOUT.hot_buffer_bytes(16) + 3 * 16 * 4  # the score averages


def test_dense_plan_is_the_budget_in_pages():
  per_page = 16 * (LAYOUT.latent_bytes + LAYOUT.index_bytes)
  p = kvmem.plan(
    LAYOUT, budget=10 * per_page + per_page - 1, max_running_requests=4, max_seq_len=1000, page_size=16, hisparse=None
  )
  assert p.pools == {"kv": ("device", 10, per_page)} and p.request_slots == 4 and p.max_pages == 63
  with pytest.raises(kvmem.MemoryConfigError, match="smaller than one page of 16 tokens"):
    kvmem.plan(LAYOUT, budget=per_page - 1, max_running_requests=4, max_seq_len=1000, page_size=16, hisparse=None)


def test_hisparse_plan_splits_the_budget_and_lowers_slots_to_fit():
  hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4)
  staging = 63 * 16 * LAYOUT.latent_bytes  # max_seq_len 1000 -> 63 pages of 16
  hot = LAYOUT.hot_buffer_bytes(16)
  index_page = 16 * LAYOUT.index_bytes
  budget = staging + 6 * hot + 40 * index_page
  p = kvmem.plan(LAYOUT, budget=budget, max_running_requests=16, max_seq_len=1000, page_size=16, hisparse=hs)
  assert p.request_slots == (3 * hot + 20 * index_page) // hot < 16  # hot buffers: at most half of what staging leaves
  assert p.pools["staging"] == ("device", 63, 16 * LAYOUT.latent_bytes)
  assert p.pools["index"] == ("device", (budget - staging - p.request_slots * hot) // index_page, index_page)
  roomy = kvmem.plan(
    LAYOUT,
    budget=staging + 8 * hot + 50 * index_page,
    max_running_requests=8,
    max_seq_len=1000,
    page_size=16,
    hisparse=hs,
  )
  assert roomy.request_slots == 8 and roomy.pools["index"] == ("device", 50, index_page)
  tight = kvmem.plan(
    LAYOUT, budget=staging + hot + index_page, max_running_requests=8, max_seq_len=1000, page_size=16, hisparse=hs
  )
  assert tight.request_slots == 1 and tight.pools["index"][1] == 1  # one hot buffer and one page still fit
  # ratio x slots x (D + 1) rows, but never less than one max_seq_len request (63 pages).
  assert p.pools["host"] == ("host", max(4 * p.request_slots * 17 // 16, 63), 16 * LAYOUT.latent_bytes)
  assert roomy_host_pages(hs) == 4 * 40 * 17 // 16
  assert p.device_bytes <= budget
  with pytest.raises(kvmem.MemoryConfigError, match="cannot hold HiSparse's staging pages"):
    kvmem.plan(LAYOUT, budget=staging + hot, max_running_requests=8, max_seq_len=1000, page_size=16, hisparse=hs)


def test_dynamic_residency_plan_and_backend():
  """resident_fraction of what staging and the hot buffers leave becomes more staging pages (resident latent
  rows), the rest index pages; a resident request keeps its staging pages after prefill, grows them, shows in
  its decode tables, counts as reclaimable for admission, and gives them back when offloaded."""
  hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=8, resident_fraction=0.5)
  staging_page, index_page, hot = 16 * LAYOUT.latent_bytes, 16 * LAYOUT.index_bytes, LAYOUT.hot_buffer_bytes(16)
  budget = 8 * staging_page + 3 * hot + 10 * staging_page  # max_seq_len 128: 8 staging pages for a prompt
  p = kvmem.plan(LAYOUT, budget=budget, max_running_requests=3, max_seq_len=128, page_size=16, hisparse=hs)
  assert p.request_slots == 3 and p.pools["staging"][1] == 8 + 5  # half of 10 staging pages' bytes
  assert p.pools["index"][1] == min((5 * staging_page) // index_page, 3 * 8) and p.device_bytes <= budget
  off = kvmem.plan(
    LAYOUT,
    budget=budget,
    max_running_requests=3,
    max_seq_len=128,
    page_size=16,
    hisparse=HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=8),
  )
  assert off.pools["staging"][1] == 8  # resident_fraction 0: the plan of before
  greedy = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=8, resident_fraction=0.99)
  with pytest.raises(kvmem.MemoryConfigError, match="resident_fraction 0.99 leaves no index page"):
    kvmem.plan(
      LAYOUT,
      budget=8 * staging_page + 3 * hot + staging_page,
      max_running_requests=3,
      max_seq_len=128,
      page_size=16,
      hisparse=greedy,
    )
  be = kvmem.HiSparseBackend(p, LAYOUT, np.float32, hs)
  a = be.admit(40)
  be.prefill_finished(a)
  assert a.resident and len(a.pages["staging"]) == 3 and be.free_pages("staging") == 10
  assert be.grow_resident(a, 49) and len(a.pages["staging"]) == 4
  b = be.admit(20)
  be.prefill_finished(b)
  tables = be.decode_tables([a, None, b])
  assert be.residency([a, None, b]) == "all" and (tables["resident_pages"][1] == -1).all()
  np.testing.assert_array_equal(tables["resident_pages"][0, :4], a.pages["staging"])
  # 13 staging pages, 6 held by residents: a 128-token prompt (8 pages) fits only by offloading them.
  assert (
    be.free_pages("staging") == 7
    and not be.can_admit(120)
    and be.can_admit(120, reclaimable=be.reclaimable_pages([a, b]))
  )
  assert be.reclaimable_pages([a, b]) == [{"staging": 6}]
  c = be.admit(100)  # takes the last 7 staging pages
  assert not be.grow_resident(b, 40) and len(b.pages["staging"]) == 2  # a failed growth takes nothing
  be.release(c)
  assert not be.grow_resident(b, 16 * 8 + 1)  # past max_seq_len: refused before a page is taken
  assert len(b.pages["staging"]) == 2 and be.free_pages("staging") == 7
  be.offloaded(a)
  assert not a.resident and a.pages["staging"] == [] and be.residency([a, b]) == "mixed"
  assert "resident_pages" in be.decode_tables([a, b]) and be.residency([a]) == "none"
  assert {k: v.shape for k, v in be.decode_tables([a, b], pages=3).items()} == {
    "index_pages": (2, 3),
    "host_pages": (2, 3),
    "resident_pages": (2, 3),
    "req_ids": (2,),
  }
  assert "resident_pages" not in be.decode_tables([a])
  be.release(a)
  be.release(b)
  assert all(x.pages_free == x.pages_total for x in be.usage()) and not b.resident


def roomy_host_pages(hs):
  return kvmem.plan(LAYOUT, budget=1 << 30, max_running_requests=40, max_seq_len=1000, page_size=16, hisparse=hs).pools[
    "host"
  ][1]


def test_dense_backend_pages_follow_tokens_held():
  p = kvmem.plan(LAYOUT, budget=1 << 22, max_running_requests=3, max_seq_len=200, page_size=16, hisparse=None)
  be = kvmem.DenseBackend(p, LAYOUT, np.float32)
  total = p.pools["kv"][1]
  assert be.never_fits(100, 190) is None
  kv = be.admit(20)  # 2 pages for 20 tokens
  assert len(kv.pages["kv"]) == 2 and be.usage()[0].pages_free == total - 2
  assert be.ensure(kv, 32) and len(kv.pages["kv"]) == 2  # still inside page 2
  assert be.ensure(kv, 33) and len(kv.pages["kv"]) == 3  # position 32 opens page 3
  tables = be.decode_tables([None, kv])
  np.testing.assert_array_equal(tables["pages"][0], -1)  # an idle row
  np.testing.assert_array_equal(tables["pages"][1, :3], kv.pages["kv"])
  assert (tables["pages"][1, 3:] == -1).all() and tables["pages"].shape == (2, 13)
  # A decode step's tables cover its indexer window's pages only (capped at the page-table width).
  np.testing.assert_array_equal(be.decode_tables([None, kv], pages=2)["pages"], tables["pages"][:, :2])
  assert be.decode_tables([kv], pages=99)["pages"].shape == (1, 13)
  be.release(kv)
  assert be.usage()[0].pages_free == total and be.free_slots == 3
  assert be.request_bytes(33) == {"device": 3 * 16 * (LAYOUT.latent_bytes + LAYOUT.index_bytes), "host": 0}
  with pytest.raises(ValueError, match="not allocated"):
    be.release(kv)  # a double release is caught, not silently corrupting the free list


def test_hisparse_backend_frees_staging_when_prefill_ends_and_refuses_what_never_fits():
  hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4)
  p = kvmem.plan(LAYOUT, budget=1 << 22, max_running_requests=2, max_seq_len=128, page_size=16, hisparse=hs)
  be = kvmem.HiSparseBackend(p, LAYOUT, np.float32, hs)
  usage = lambda: {u.name: u for u in be.usage()}
  host_pages = p.pools["host"][1]  # 4 x 2 x 17 rows = 136 -> 8 pages
  assert host_pages == 8
  kv = be.admit(40)
  u = usage()
  assert u["staging"].pages_free == 8 - 3 and u["index"].pages_total - u["index"].pages_free == 3
  assert u["host"].pages_free == host_pages - 3 and u["hot"].pages_free == 1
  tables = be.prefill_tables([kv, None], [True, False])
  assert list(tables["hot_slot"]) == [kv.slot, 2]  # 2 = R: the padding row's hot-buffer write is dropped
  be.prefill_finished(kv)
  assert usage()["staging"].pages_free == 8 and kv.pages["staging"] == []
  assert (be.prefill_tables([kv], [False])["staging_pages"] == -1).all()
  # 8 host pages hold 128 tokens: a 100 + 40 request can never run, a 100 + 20 one can.
  assert "9 pages of the host pool (host memory" in be.never_fits(100, 140) and be.never_fits(100, 20 + 100) is None
  assert be.ensure(kv, 8 * 16) and len(kv.pages["host"]) == 8  # the whole host pool
  assert not be.ensure(kv, 8 * 16 + 1) and len(kv.pages["index"]) == 8  # a failed growth takes nothing
  be.release(kv)
  assert all(x.pages_free == x.pages_total for x in be.usage())
  assert be.request_bytes(40) == {
    "device": 48 * LAYOUT.index_bytes + LAYOUT.hot_buffer_bytes(16),
    "host": 48 * LAYOUT.latent_bytes,
  }


def test_dp_groups_have_their_own_slots_and_pages_with_local_ids():
  """Data-parallel attention: each group allocates from its own free lists; tables carry ids local to the
  request's group; a new request goes to the group with the most free slots that can take it."""
  hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4)
  p = kvmem.plan(LAYOUT, budget=1 << 22, max_running_requests=2, max_seq_len=128, page_size=16, hisparse=hs)
  be = kvmem.HiSparseBackend(p, LAYOUT, np.float32, hs, groups=3)
  assert be.request_slots == 6 and be.slots_per_group == 2 and be.free_slots == 6
  assert be.state.hot.shape[1] == 3 * (2 + 1) and be.state.index.shape[1] == 3 * p.pools["index"][1]
  first = [be.admit(20, group=be.pick_group(20)) for _ in range(3)]
  assert [kv.group for kv in first] == [0, 1, 2]  # the emptiest group, ties to the lowest index
  assert [kv.slot for kv in first] == [0, 2, 4]  # slots numbered across groups
  # Every group's first request got the group's first pages: ids are local to the group's pools.
  assert first[0].pages["index"] == first[1].pages["index"] == first[2].pages["index"]
  kv = be.admit(20, group=1)
  tables = be.decode_tables([first[0], None, kv, first[1]])
  assert list(tables["req_ids"]) == [0, -1, 1, 0]  # local request slots
  np.testing.assert_array_equal(tables["host_pages"][2, :2], kv.pages["host"])
  assert be.prefill_tables([kv], [True])["hot_slot"][0] == 1 and be.prefill_tables([kv], [False])["hot_slot"][0] == 2
  u = {x.name: x for x in be.usage()}
  assert u["index"].pages_total == 3 * p.pools["index"][1]
  assert u["index"].pages_total - u["index"].pages_free == 4 * 2  # 4 requests x 2 pages
  assert be.pick_group(20) in (0, 2)  # group 1 is full
  assert be.pick_group(20, only=1) is None and be.pick_group(20, only=2) == 2  # a request pinned to a group
  assert not be.can_admit(20, group=1)
  be.release(kv)
  assert be.can_admit(20, group=1) and be.free_slots == 3
  # A group whose pages are reserved for its running requests' growth does not take the request.
  assert be.pick_group(20, reserve_pages=[10**6, 0, 10**6]) == 1
