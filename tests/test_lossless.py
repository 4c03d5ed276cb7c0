"""HiSparse is lossless: the same logits and greedy tokens as the dense (all KV on device) cache."""

import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, Request
from hisparse_jax.kernels import ops
from hisparse_jax.serving.metrics import ServerMetrics
from models.deepseek_v32 import Indexer
from models.kv_protocol import ContiguousKVCache
from models.loader import load_hf
from models.random_checkpoint import write_random_checkpoint
from tests.kv_harness import KVHarness
from tests.tiny_model import TINY_HISPARSE, tiny_model_dir
from tests.xla_env import optimized

ROOT = pathlib.Path(__file__).parent.parent

PROMPT_LENS = [5, 12, 17, 40, 100]  # device_buffer_size is 16: three prompts exceed it
S_MAX = 160


def prompts(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, 512, n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize(
  "chunk, eviction, prefetch", [(None, "lru", "all"), (7, "lru", None), (None, "clock", 3), (7, "score", None)]
)
def test_logits_bitwise_equal_dense_vs_hisparse(chunk, eviction, prefetch):
  """Teacher-forced decoding of 5 prompts over scattered pages: every logit is bitwise equal, whichever
  eviction policy decides which rows stay on device, with or without the cross-layer prefetch (of the whole
  top-k, or of its 3 best positions, then against the same policy without it too)."""
  cfg, model = load_hf(tiny_model_dir())
  hs_cfg = HiSparseConfig(
    **TINY_HISPARSE,
    eviction=eviction,
    prefetch="none" if prefetch is None else "next_layer",
    prefetch_depth=prefetch if isinstance(prefetch, int) else None,
  )
  # Chunks of 7: the indexer also merges running top-ks over score blocks of 64 keys.
  score_block = None if chunk is None else 64
  dense = KVHarness(cfg, model, chunk=chunk, score_block=score_block)
  hs = KVHarness(cfg, model, hisparse=hs_cfg, chunk=chunk, score_block=score_block)
  # With the prefetch of the 3 best positions, also the same policy without it: the prefetch must change which
  # rows are copied (the whole top-k's prefetch is checked so in test_cross_layer_prefetch_gives_the_dense_tokens).
  plain = (
    KVHarness(
      cfg, model, hisparse=HiSparseConfig(**TINY_HISPARSE, eviction=eviction), chunk=chunk, score_block=score_block
    )
    if prefetch == 3
    else None
  )
  ps = prompts()
  want = dense.prefill(ps)
  np.testing.assert_array_equal(hs.prefill(ps), want)
  if plain is not None:
    np.testing.assert_array_equal(plain.prefill(ps), want)
  rng = np.random.default_rng(2)
  for step in range(24):
    tokens = rng.integers(2, 512, len(ps))  # teacher-forced, the same in both modes
    ld, topk_d = dense.decode(tokens, return_topk=True)
    lh, topk_h = hs.decode(tokens, return_topk=True)
    np.testing.assert_array_equal(topk_h, topk_d, err_msg=f"step {step}")
    np.testing.assert_array_equal(lh, ld, err_msg=f"step {step}")
    if plain is not None:
      np.testing.assert_array_equal(plain.decode(tokens), ld, err_msg=f"step {step} without the prefetch")
  stats = hs.swap_stats()  # [L, N, 2]
  if plain is not None:
    base = plain.swap_stats()
    np.testing.assert_array_equal(stats.sum(-1), base.sum(-1))  # the same positions served
    np.testing.assert_array_equal(stats[0], base[0])  # layer 0 has no previous layer: never prefetched
    assert (stats[1:, :, 1] != base[1:, :, 1]).any()  # the later layers' misses changed
  # Requests past the hot buffer really swapped rows in, in every layer.
  assert (stats[:, :, 1] > 0).all()  # every request ends past D=16 (the 5-token one after 12 steps)
  # Distinct KV in every layer of the host pool (a layer-offset mix-up would fail the comparison above).
  pool = np.asarray(hs.backend.state.host_pool)
  r = hs.kvs[0].pages["host"][0] * 16
  assert not np.array_equal(pool[0, r], pool[1, r]) and not np.array_equal(pool[1, r], pool[2, r])


AT_XLA_DEFAULT = """
import json, os
import numpy as np
from hisparse_jax.config import HiSparseConfig
from models.loader import load_hf
from tests.kv_harness import KVHarness
from tests.test_lossless import prompts
from tests.tiny_model import TINY_HISPARSE, tiny_model_dir
cfg, model = load_hf(tiny_model_dir())
dense, hs = KVHarness(cfg, model), KVHarness(cfg, model, hisparse=HiSparseConfig(**TINY_HISPARSE))
ps = prompts()[1::3]  # 12 and 100 tokens: within and past the 16-slot hot buffer
equal = [np.array_equal(dense.prefill(ps), hs.prefill(ps))]
rng = np.random.default_rng(2)
for _ in range(12):
  tokens = rng.integers(2, 512, len(ps))
  equal.append(np.array_equal(dense.decode(tokens), hs.decode(tokens)))
print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "equal": [bool(e) for e in equal],
                  "misses": int(hs.swap_stats()[..., 1].sum())}))
"""


def test_lossless_at_xla_default_optimization():
  """The suite compiles at XLA:CPU backend optimization level 0 (tests/conftest.py), whose code rounds some
  float32 results differently; at XLA's default level, the one users run, dense and HiSparse logits are
  equal bit for bit too (teacher-forced prefill of two prompts and 12 decode steps, rows swapped in)."""
  r = subprocess.run(
    [sys.executable, "-c", AT_XLA_DEFAULT], cwd=ROOT, capture_output=True, text=True, timeout=300, env=optimized()
  )
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  assert "optimization_level" not in got["xla_flags"] and "optimization_level" in os.environ["XLA_FLAGS"]
  assert got["equal"] == [True] * 13 and got["misses"] > 0, got


def test_score_ema_is_lossless_and_restarts_the_averages_it_refills():
  """Eviction "score_ema" (each slot's moving average of its token's indexer scores): teacher-forced logits
  bitwise equal dense's; the averages are NaN ("no history") right after each prefill, and after each decode
  step exactly at the slots that do not hold a written token yet (position >= seq_len) or that the step's
  swap-in refilled (a request past D: one slot per miss), finite at every other slot."""
  cfg, model = load_hf(tiny_model_dir())
  dense = KVHarness(cfg, model)
  hs = KVHarness(cfg, model, hisparse=HiSparseConfig(**TINY_HISPARSE, eviction="score_ema"))
  ps = prompts(3)
  np.testing.assert_array_equal(hs.prefill(ps), dense.prefill(ps))
  slots = hs.state_slots()
  assert np.isnan(np.asarray(hs.backend.state.score_ema)[:, slots]).all()
  D = TINY_HISPARSE["device_buffer_size"]
  rng = np.random.default_rng(5)
  misses = hs.swap_stats()[..., 1]
  for step in range(6):
    tokens = rng.integers(2, 512, len(ps))
    np.testing.assert_array_equal(hs.decode(tokens), dense.decode(tokens), err_msg=f"step {step}")
    ema = np.asarray(hs.backend.state.score_ema)[:, slots]  # [L, N, D]
    tokens_now = np.asarray(hs.backend.state.slot_tokens)[:, slots]
    step_misses, misses = hs.swap_stats()[..., 1] - misses, hs.swap_stats()[..., 1]
    for i, seq_len in enumerate(hs.seq_lens):
      if seq_len <= D:  # the fast path: slot s holds position s, no swap-in
        np.testing.assert_array_equal(np.isnan(ema[:, i]), tokens_now[:, i] >= seq_len)
      else:
        np.testing.assert_array_equal(np.isnan(ema[:, i]).sum(-1), step_misses[:, i], err_msg=f"{step} {i}")
  assert step_misses[:, [i for i, n in enumerate(hs.seq_lens) if n > D]].sum() > 0  # refills happened


def test_paged_and_contiguous_caches_agree():
  """The paged dense view returns the same rows as the simplest contiguous cache: same logits."""
  cfg, model = load_hf(tiny_model_dir())
  dense = KVHarness(cfg, model)
  p = prompts(1)[3]
  want = dense.prefill([p])
  graphdef, params = nnx.split(model)
  prefill = jax.jit(lambda params, t, pos, c: nnx.merge(graphdef, params).prefill(t, pos, c, key_block=32))
  # Two rows (the harness decodes with a trailing idle row): the same batch shapes, the same numerics.
  cache = ContiguousKVCache.create(cfg, 2, S_MAX)
  got, cache = prefill(params, jnp.asarray([p]), jnp.arange(len(p))[None], jax.tree.map(lambda a: a[:, :1], cache))
  np.testing.assert_array_equal(np.asarray(got), want)
  tok = int(want.argmax())
  decode = jax.jit(lambda params, t, pos, c: nnx.merge(graphdef, params).decode(t, pos, c, window=128, key_block=32))
  cache = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a)], axis=1), cache)
  lg, _ = decode(params, jnp.asarray([tok, 0]), jnp.asarray([len(p), -1]), cache)
  np.testing.assert_array_equal(np.asarray(lg)[:1], dense.decode([tok]))


def test_blockwise_top_k_equals_whole_row_top_k():
  """The indexer's running top-k over key blocks gives exactly jax.lax.top_k of the whole row (ties to the
  lower position), for every key block size (with the engine's top-k kernel)."""
  cfg, model = load_hf(tiny_model_dir(), top_k=ops.top_k)
  p = prompts(2)[4]  # 100 tokens
  cache = ContiguousKVCache.create(cfg, 1, 128)
  _, cache = model.prefill(jnp.asarray([p]), jnp.arange(len(p))[None], cache, key_block=32)
  idx = model.layers[0].self_attn.indexer
  x = jax.random.normal(jax.random.key(0), (1, 3, cfg.hidden_size))
  x = x.at[:, 1].set(x[:, 0])  # two identical queries
  q_resid = jax.random.normal(jax.random.key(1), (1, 3, cfg.q_lora_rank))
  positions = jnp.asarray([[99, 40, 7]], jnp.int32)
  from models.deepseek_v32 import rope_cos_sin

  cos, sin = rope_cos_sin(cfg.rope, cfg.qk_rope_head_dim, positions)
  # The whole-row reference.
  q, w = idx.queries(q_resid, cos, sin), idx.head_weights(x)
  keys = cache.index_key[0, 0, :128]
  s = jnp.einsum("bqhd,td->bqht", q, keys, precision="highest") * idx.softmax_scale
  scores = jnp.einsum("bqht,bqh->bqt", jax.nn.relu(s), w, precision="highest")
  scores = jnp.where(jnp.arange(128) <= positions[..., None], scores, -jnp.inf)
  vals, want = jax.lax.top_k(scores, cfg.index_topk)
  want = np.where(np.isfinite(vals), want, -1)
  for key_block, score_block in ((16, None), (32, None), (128, None), (16, 16), (16, 32), (32, 64)):
    got = idx.select(
      x, q_resid, cos, sin, positions, 0, cache, window=128, key_block=key_block, score_block=score_block
    )
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"blocks {key_block} / {score_block}")
  assert (np.asarray(got)[0, 2, 8:] == -1).all()  # position 7 sees 8 keys: the rest is padding


def test_blockwise_top_k_breaks_ties_across_blocks_as_lax_top_k():
  """Scores tied at the top-k's cut-off over several key and score blocks: the indexer's selection is
  jax.lax.top_k's of the whole row (the lower positions of a tie), for every block size. Indexer.select runs
  with given queries and head weights (one head, Di = 1, w = 1: score[t] = relu(key[t]), exact small integers)."""
  K, window = 8, 64
  keys = np.zeros((2, window), np.float32)  # row 1: all zero, every visible position ties
  keys[0, ::5] = 1.0  # 13 positions tie at score 1, in every block; 5 of them make the top-8
  keys[0, [50, 21, 9]] = [5.0, 4.0, 3.0]
  keys[0, 1::7] = np.where(keys[0, 1::7] == 0, -2.0, keys[0, 1::7])  # relu: negative keys tie with the zeros
  positions = np.int32([[63, 40, 5], [63, 30, 5]])
  scores = np.where(np.arange(window) <= positions[..., None], np.maximum(keys, 0)[:, None], -np.inf)
  vals, want = jax.lax.top_k(jnp.float32(scores), K)
  want = np.where(np.isfinite(np.asarray(vals)), np.asarray(want), -1)
  assert want[0, 0].tolist() == [50, 21, 9, 0, 5, 10, 15, 20] and want[1, 2].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
  stub = types.SimpleNamespace(k=K, queries=lambda q, cos, sin: q, head_weights=lambda w: w, exact_top_k=ops.top_k)
  cache = ContiguousKVCache(jnp.zeros((1, 2, window, 1), jnp.float32), jnp.float32(keys)[None, :, :, None])
  ones = jnp.ones((2, 3, 1), jnp.float32)
  for key_block, score_block in ((8, None), (8, 8), (8, 16), (16, 32), (32, None)):
    select = jax.jit(
      lambda pos: Indexer.select(
        stub,
        ones,
        ones[..., None],
        None,
        None,
        pos,
        0,
        cache,
        window=window,
        key_block=key_block,
        score_block=score_block,
      )
    )
    np.testing.assert_array_equal(
      np.asarray(select(jnp.asarray(positions))), want, err_msg=f"blocks {key_block} / {score_block}"
    )


def run(engine, ps, max_new=16):
  reqs = [Request(str(i), p, max_new) for i, p in enumerate(ps)]
  for r in reqs:
    engine.submit(r)
  engine.run()
  return reqs


@pytest.fixture(scope="module")
def engines():
  d = tiny_model_dir()
  hs = HiSparseConfig(**TINY_HISPARSE)
  common = dict(max_running_requests=4, max_seq_len=S_MAX, page_size=16, chunked_prefill_size=64)
  return (
    Engine(d, deterministic=True, **common),
    Engine(d, hisparse=hs, deterministic=True, **common),
    Engine(d, **common),
    Engine(d, hisparse=hs, **common),
  )


def test_greedy_tokens_equal_and_independent_of_batching(engines):
  dense, hs, dense_b, hs_b = engines
  ps = prompts(3)
  got_dense = run(dense, ps)  # 5 requests on 4 slots: one waits and joins mid-flight; 100 tokens: 2 chunks
  got_hs = run(hs, ps)
  for a, b in zip(got_dense, got_hs):
    assert a.output_ids == b.output_ids
    assert len(a.output_ids) == 16 or a.finish_reason == "stop"
  assert sum(r.misses for r in got_hs) > 0
  # Deterministic mode: each request decoded alone gives the same tokens as in the mixed batch.
  for p, r in zip(ps, got_hs):
    assert run(hs, [p])[0].output_ids == r.output_ids
  # Batch-bucket mode: dense and HiSparse still agree with each other (same batches, same numerics).
  assert [r.output_ids for r in run(dense_b, ps)] == [r.output_ids for r in run(hs_b, ps)]
  # Everything was released.
  for e in engines:
    assert all(p["pages_free"] == p["pages_total"] for p in e.loads()["pools"])
    assert e.loads()["free_lanes"] == e.num_slots


def test_a_float16_checkpoint_needs_a_compute_dtype(tmp_path):
  """float16 is not a compute dtype (engine.args.DTYPES says why): a float16 checkpoint is refused before its
  weights load unless --dtype names one, and with --dtype bfloat16 HiSparse gives dense's tokens."""
  from hisparse_jax.engine.args import StartupError
  from tests.tiny_model import tiny_config

  d = write_random_checkpoint(str(tmp_path / "f16"), tiny_config(dtype="float16"), seed=0)
  with pytest.raises(StartupError, match="the checkpoint's dtype float16 is not a compute dtype .* pass --dtype"):
    Engine(d, max_seq_len=S_MAX)
  common = dict(
    dtype="bfloat16",
    max_running_requests=4,
    max_seq_len=S_MAX,
    page_size=16,
    chunked_prefill_size=64,
    deterministic=True,
  )
  ps = prompts(8)[:3]
  got = run(Engine(d, hisparse=HiSparseConfig(**TINY_HISPARSE), **common), ps)
  assert [r.output_ids for r in got] == [r.output_ids for r in run(Engine(d, **common), ps)]
  assert sum(r.misses for r in got) > 0


def test_extension_owned_host_pool_gives_the_same_tokens(engines):
  """The fallback host pool (memory owned by the FFI extension) decodes exactly like the JAX pool."""
  _, hs, _, _ = engines
  ext = Engine(
    tiny_model_dir(),
    hisparse=HiSparseConfig(**TINY_HISPARSE),
    max_running_requests=4,
    max_seq_len=S_MAX,
    page_size=16,
    chunked_prefill_size=64,
    deterministic=True,
    host_pool="extension",
  )
  ps = prompts(6)
  got = run(ext, ps)
  want = run(hs, ps)
  assert [r.output_ids for r in got] == [r.output_ids for r in want]
  assert [(r.hits, r.misses) for r in got] == [(r.hits, r.misses) for r in want]
  assert sum(r.misses for r in got) > 0
  # The rows really live in the extension's pool.
  pool = ext.external_pool.read()
  assert pool.shape == (3, ext.memory_plan.pools["host"][1] * 16, 48) and np.abs(pool).sum() > 0


@pytest.mark.parametrize("device_buffer_size", [16, 32])
def test_edge_lengths_equal_dense(engines, device_buffer_size):
  """Prompts of exactly the page size (16) and the hot-buffer size, +-1: same tokens as dense."""
  dense = engines[0]
  hs = Engine(
    tiny_model_dir(),
    hisparse=HiSparseConfig(top_k=8, device_buffer_size=device_buffer_size, host_to_device_ratio=4),
    max_running_requests=4,
    max_seq_len=S_MAX,
    page_size=16,
    chunked_prefill_size=64,
    deterministic=True,
  )
  rng = np.random.default_rng(device_buffer_size)
  lengths = sorted({15, 16, 17, device_buffer_size - 1, device_buffer_size, device_buffer_size + 1})
  ps = [rng.integers(2, 512, n).tolist() for n in lengths]
  want = [r.output_ids for r in run(dense, ps, max_new=4)]
  got = run(hs, ps, max_new=4)
  assert [r.output_ids for r in got] == want
  assert any(r.misses > 0 for r in got)


def test_every_eviction_policy_gives_the_dense_tokens(engines):
  """Greedy tokens of the CLOCK and both score policies equal dense; the policies really evict differently (the
  score policy's misses differ from LRU's, and the score averages' from the score policy's, on the same
  requests)."""
  dense, hs, _, _ = engines
  ps = prompts(4)
  want = [r.output_ids for r in run(dense, ps)]
  lru = run(hs, ps)
  assert [r.output_ids for r in lru] == want
  common = dict(max_running_requests=4, max_seq_len=S_MAX, page_size=16, chunked_prefill_size=64, deterministic=True)
  misses = {"lru": [r.misses for r in lru]}
  for eviction in ("clock", "score", "score_ema"):
    engine = Engine(tiny_model_dir(), hisparse=HiSparseConfig(**TINY_HISPARSE, eviction=eviction), **common)
    got = run(engine, ps)
    assert [r.output_ids for r in got] == want, eviction
    assert [r.hits + r.misses for r in got] == [r.hits + r.misses for r in lru]  # the same top-k served
    misses[eviction] = [r.misses for r in got]
  assert misses["score"] != misses["lru"] and misses["score_ema"] != misses["score"], misses


def test_cross_layer_prefetch_gives_the_dense_tokens(engines):
  """The engine with the cross-layer prefetch: greedy tokens equal dense's, over the JAX pool (LRU, whole top-k)
  and the extension's pool (CLOCK, the 3 best positions); the same positions are served (hits + misses) as
  without it, and the prefetch changes the misses."""
  dense, hs, _, _ = engines
  ps = prompts(7)
  want = run(dense, ps)
  plain = run(hs, ps)
  common = dict(max_running_requests=4, max_seq_len=S_MAX, page_size=16, chunked_prefill_size=64, deterministic=True)
  for pool, eviction, depth in (("jax", "lru", None), ("extension", "clock", 3)):
    cfg = HiSparseConfig(**TINY_HISPARSE, eviction=eviction, prefetch="next_layer", prefetch_depth=depth)
    got = run(Engine(tiny_model_dir(), hisparse=cfg, host_pool=pool, **common), ps)
    assert [r.output_ids for r in got] == [r.output_ids for r in want], pool
    assert [r.hits + r.misses for r in got] == [r.hits + r.misses for r in plain], pool
    if eviction == "lru":
      assert [r.misses for r in got] != [r.misses for r in plain]
    # The prefetch counts: none for layer 0 (no previous layer), never more than depth rows per layer and
    # decode step (a request decodes at most len(output_ids) - 1 steps), and some rows really copied.
    assert all(len(r.layer_prefetched) == len(r.layer_hits) and r.layer_prefetched[0] == 0 for r in got)
    assert all(r.prefetched == sum(r.layer_prefetched) for r in got) and sum(r.prefetched for r in got) > 0
    assert all(
      p <= (depth or TINY_HISPARSE["top_k"]) * (len(r.output_ids) - 1) for r in got for p in r.layer_prefetched
    ), [r.layer_prefetched for r in got]
    metrics = ServerMetrics(row_bytes=4)  # the server's counters see the same rows
    for r in got:
      metrics.on_finish(r)
    assert sum(
      metrics.registry.get_sample_value("hisparse_prefetch_rows_total", {"layer": str(l)})
      for l in range(len(got[0].layer_prefetched))
    ) == sum(r.prefetched for r in got)
  assert all(r.prefetched == 0 and not any(r.layer_prefetched) for r in plain)


def replay_hot_buffer(trace, prompt_len: int, D: int, eviction: str):
  """Hits and misses per decode step and layer, int[steps, L, 2], of one request's recorded top-k trace
  (int[steps, L, K]), from a model of its hot buffer written over tokens rather than slots, apart from the
  kernel and ``kernels.reference``: a prefill leaves positions 0..D-1 resident, oldest first; while the sequence
  fits (seq_len <= D) every position is resident; otherwise the newest position is served from its own slot
  (a hit), each distinct missing position replaces a resident one not needed this step (LRU: the least recently
  used; CLOCK: the second-chance ring from its hand, hits setting their bit), and under LRU the order becomes
  untouched + filled (in top-k order) + hits (in their old order)."""
  steps, L, _ = trace.shape
  order = [list(range(D)) for _ in range(L)]  # LRU: oldest first. CLOCK: the ring read from the hand
  ref = [dict.fromkeys(range(D), False) for _ in range(L)]
  out = np.zeros((steps, L, 2), np.int64)
  for i in range(steps):
    seq_len = prompt_len + i + 1  # decode step i reads the prompt and i + 1 generated tokens
    for layer in range(L):
      wanted = list(dict.fromkeys(int(t) for t in trace[i, layer] if t >= 0))
      assert max(wanted) < seq_len
      if seq_len <= D:
        out[i, layer] = len(wanted), 0
        continue
      needed = [t for t in wanted if t != seq_len - 1]
      ring = order[layer]
      hits = [t for t in ring if t in needed]
      missing = [t for t in needed if t not in ring]
      if eviction == "lru":
        victims = [t for t in ring if t not in hits][: len(missing)]
        order[layer] = [t for t in ring if t not in hits and t not in victims] + missing + hits
      else:
        bit = ref[layer]
        for t in hits:
          bit[t] = True
        victims, hand = [], 0
        while len(victims) < len(missing):
          t = ring[hand % D]
          hand += 1
          if t in hits or t in victims:
            continue
          if bit[t]:
            bit[t] = False
          else:
            victims.append(t)
        slots = [missing[victims.index(t)] if t in victims else t for t in ring]  # a miss takes its victim's place
        for t, new in zip(victims, missing):
          del bit[t]
          bit[new] = False
        order[layer] = [slots[(hand + j) % D] for j in range(D)]
      out[i, layer] = len(wanted) - len(missing), len(missing)
  return out


@pytest.mark.parametrize("eviction", ["lru", "clock"])
def test_swap_in_counts_equal_a_replay_of_the_top_k_trace(eviction):
  """The eviction order pinned at model level: each request's hits and misses per layer after every decode step
  (the kernel's per-slot stats, read between steps), its finished counts, and the server's Prometheus counters
  equal ``replay_hot_buffer``'s replay of the top-k the model recorded."""
  D = TINY_HISPARSE["device_buffer_size"]
  engine = Engine(
    tiny_model_dir(),
    hisparse=HiSparseConfig(**TINY_HISPARSE, eviction=eviction),
    record_topk=True,
    max_running_requests=3,
    max_seq_len=S_MAX,
    page_size=16,
    chunked_prefill_size=64,
    deterministic=True,
    overlap_schedule=False,
  )
  rng = np.random.default_rng(4)
  reqs = [Request(str(n), rng.integers(2, 512, n).tolist(), 40, ignore_eos=True) for n in (5, 16, 30)]
  for r in reqs:
    engine.submit(r)
  seen = {r.request_id: [] for r in reqs}  # (decode steps so far, cumulative (hits, misses) per layer)
  while engine.has_work():
    engine.step()
    for r in engine.running:
      if r.topk_trace:
        hits, misses, _ = engine.backend.swap_stats(r.kv)
        seen[r.request_id].append((len(r.topk_trace), np.stack([hits, misses], -1)))
  metrics = ServerMetrics(row_bytes=4)
  total = 0
  for r in reqs:
    want = replay_hot_buffer(np.stack(r.topk_trace), len(r.prompt_ids), D, eviction).cumsum(0)
    assert len(seen[r.request_id]) > 20
    for steps, got in seen[r.request_id]:
      np.testing.assert_array_equal(got, want[steps - 1], err_msg=f"request {r.request_id}, step {steps}")
    np.testing.assert_array_equal(np.stack([r.layer_hits, r.layer_misses], -1), want[-1])
    assert (r.hits, r.misses) == tuple(want[-1].sum(0))
    metrics.on_finish(r)
    total = total + want[-1]
  assert (total[:, 1] > 0).all() and (total[:, 0] != total[:, 1]).all()  # a swap of the two would show
  for layer, (hits, misses) in enumerate(total):
    assert metrics.registry.get_sample_value("hisparse_swap_in_hits_total", {"layer": str(layer)}) == hits
    assert metrics.registry.get_sample_value("hisparse_swap_in_misses_total", {"layer": str(layer)}) == misses
