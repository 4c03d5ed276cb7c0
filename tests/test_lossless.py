"""HiSparse is lossless: the same logits and greedy tokens as the dense (all KV on device) cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, Request
from hisparse_jax.kv_cache import DenseKVCache, HiSparseKVCache
from models.loader import load_hf
from tests.tiny_model import TINY_HISPARSE, tiny_model_dir

PROMPT_LENS = [5, 12, 17, 40, 100]  # device_buffer_size is 16: three prompts exceed it
S_MAX = 160


def prompts(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, 512, n).tolist() for n in PROMPT_LENS]


def make_caches(cfg, batch):
  shape = dict(num_layers=cfg.num_hidden_layers, batch=batch, max_seq_len=S_MAX, latent_dim=cfg.latent_dim,
               index_dim=cfg.index_head_dim, dtype=jnp.float32)
  dense = DenseKVCache.create(**shape)
  hs = HiSparseKVCache.create(**shape, device_buffer_size=TINY_HISPARSE["device_buffer_size"],
                              host_pool_rows=batch * S_MAX + 7)
  return dense, hs


def test_logits_bitwise_equal_dense_vs_hisparse():
  cfg, model = load_hf(tiny_model_dir())
  graphdef, state = nnx.split(model)
  B = len(PROMPT_LENS)
  dense, hs = make_caches(cfg, B)
  # A scrambled page table: lane b's positions live in rows that are not contiguous.
  perm = np.random.default_rng(1).permutation(B * S_MAX).astype(np.int32).reshape(B, S_MAX)

  @functools.partial(jax.jit, donate_argnums=(2,))
  def prefill(state, tokens, cache, lane, host_rows):
    _, latents, keys = nnx.merge(graphdef, state).prefill(tokens, jnp.array([tokens.shape[1]]))
    return cache.insert(lane, latents[:, 0], keys[:, 0], host_rows)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def decode(state, tokens, seq_lens, cache):
    return nnx.merge(graphdef, state).decode(tokens, seq_lens, cache)

  ps = prompts()
  for lane, p in enumerate(ps):
    tokens = jnp.asarray([p], jnp.int32)
    dense = prefill(state, tokens, dense, lane, jnp.asarray(perm[lane]))
    hs = prefill(state, tokens, hs, lane, jnp.asarray(perm[lane]))
  seq_lens = np.array(PROMPT_LENS, np.int32)
  rng = np.random.default_rng(2)
  for step in range(24):
    seq_lens += 1
    tokens = jnp.asarray(rng.integers(2, 512, B), jnp.int32)  # teacher-forced, same in both modes
    ld, dense = decode(state, tokens, jnp.asarray(seq_lens), dense)
    lh, hs = decode(state, tokens, jnp.asarray(seq_lens), hs)
    ld, lh = np.asarray(ld), np.asarray(lh)
    assert np.isfinite(ld).all()
    np.testing.assert_array_equal(lh, ld, err_msg=f"step {step}")
  stats = np.asarray(hs.stats)  # [L, B, 2]
  # Lanes past the hot buffer really swapped rows in, in every layer.
  assert (stats[:, :, 1] > 0).all()  # every lane ends past D=16 (the 5-token one after 12 steps)
  # Distinct KV in every layer (a layer-offset mix-up would fail the comparison above).
  pool = np.asarray(hs.host_pool)
  r = perm[0, 0]
  assert not np.array_equal(pool[0, r], pool[1, r]) and not np.array_equal(pool[1, r], pool[2, r])


@pytest.fixture(scope="module")
def engines():
  d = tiny_model_dir()
  hs = HiSparseConfig(**TINY_HISPARSE)
  return (Engine(d, max_running_requests=4, max_seq_len=S_MAX),
          Engine(d, hisparse=hs, max_running_requests=4, max_seq_len=S_MAX))


def run(engine, ps, max_new=16):
  reqs = [Request(str(i), p, max_new) for i, p in enumerate(ps)]
  for r in reqs:
    engine.submit(r)
  engine.run()
  return reqs


def test_greedy_tokens_equal_and_independent_of_batching(engines):
  dense, hs = engines
  ps = prompts(3)
  got_dense = run(dense, ps)  # 5 requests on 4 lanes: one waits and joins mid-flight
  got_hs = run(hs, ps)
  for a, b in zip(got_dense, got_hs):
    assert a.output_ids == b.output_ids
    assert len(a.output_ids) == 16 or a.finish_reason == "stop"
  assert sum(r.misses for r in got_hs) > 0
  # Each request decoded alone gives the same tokens as in the mixed batch.
  for p, r in zip(ps, got_hs):
    assert run(hs, [p])[0].output_ids == r.output_ids
  # Everything was released.
  assert len(hs._free_pages) == hs.num_pages and len(hs._free_lanes) == hs.num_lanes


def test_prefill_last_only_equals_full_logits_at_last_position():
  cfg, model = load_hf(tiny_model_dir())
  ps = prompts(4)[:3]
  S = max(map(len, ps))
  tokens = np.zeros((3, S), np.int32)
  for i, p in enumerate(ps):
    tokens[i, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in ps], jnp.int32)
  full, lat_full, _ = model.prefill(jnp.asarray(tokens), lengths)
  last, lat_last, _ = model.prefill(jnp.asarray(tokens), lengths, last_only=True)
  assert last.shape == (3, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(last), np.asarray(full)[np.arange(3), np.asarray(lengths) - 1],
                             rtol=0, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(lat_last), np.asarray(lat_full))


def test_extension_owned_host_pool_gives_the_same_tokens(engines):
  """The fallback host pool (memory owned by the FFI extension) decodes exactly like the JAX pool."""
  _, hs = engines
  ext = Engine(tiny_model_dir(), hisparse=HiSparseConfig(**TINY_HISPARSE), max_running_requests=4,
               max_seq_len=S_MAX, host_pool="extension")
  ps = prompts(6)
  got = run(ext, ps)
  want = run(hs, ps)
  assert [r.output_ids for r in got] == [r.output_ids for r in want]
  assert [(r.hits, r.misses) for r in got] == [(r.hits, r.misses) for r in want]
  assert sum(r.misses for r in got) > 0
  # The rows really live in the extension's pool.
  pool = ext.external_pool.read()
  assert pool.shape == (3, ext.num_pages * 16, 48) and np.abs(pool).sum() > 0


@pytest.mark.parametrize("device_buffer_size", [16, 32])
def test_edge_lengths_equal_dense(engines, device_buffer_size):
  """Prompts of exactly the host-pool page size (16) and the hot-buffer size, +-1: same tokens as dense."""
  dense, _ = engines
  hs = Engine(tiny_model_dir(), hisparse=HiSparseConfig(top_k=8, device_buffer_size=device_buffer_size,
                                                        host_to_device_ratio=4),
              max_running_requests=4, max_seq_len=S_MAX)
  rng = np.random.default_rng(device_buffer_size)
  lengths = sorted({15, 16, 17, device_buffer_size - 1, device_buffer_size, device_buffer_size + 1})
  ps = [rng.integers(2, 512, n).tolist() for n in lengths]
  want = [r.output_ids for r in run(dense, ps, max_new=4)]
  got = run(hs, ps, max_new=4)
  assert [r.output_ids for r in got] == want
  assert any(r.misses > 0 for r in got)


def test_indexer_window_gives_bitwise_equal_logits():
  """Scoring only a window of the cached indexer keys (index_len) changes nothing: same top-k, same logits."""
  cfg, model = load_hf(tiny_model_dir())
  graphdef, state = nnx.split(model)
  B = len(PROMPT_LENS)
  dense, _ = make_caches(cfg, B)
  dense_w, _ = make_caches(cfg, B)

  @functools.partial(jax.jit, donate_argnums=(2,))
  def prefill(state, tokens, cache, lane):
    _, latents, keys = nnx.merge(graphdef, state).prefill(tokens, jnp.array([tokens.shape[1]]))
    return cache.insert(lane, latents[:, 0], keys[:, 0])

  @functools.partial(jax.jit, donate_argnums=(3,), static_argnames=("index_len",))
  def decode(state, tokens, seq_lens, cache, index_len=None):
    return nnx.merge(graphdef, state).decode(tokens, seq_lens, cache, return_topk=True, index_len=index_len)

  for lane, p in enumerate(prompts(7)):
    dense = prefill(state, jnp.asarray([p], jnp.int32), dense, lane)
    dense_w = prefill(state, jnp.asarray([p], jnp.int32), dense_w, lane)
  seq_lens = np.array(PROMPT_LENS, np.int32)
  rng = np.random.default_rng(8)
  for step in range(6):
    seq_lens += 1
    tokens = jnp.asarray(rng.integers(2, 512, B), jnp.int32)
    window = 1 << int(seq_lens.max() - 1).bit_length()  # 128 < S_MAX = 160
    full, dense, topk_full = decode(state, tokens, jnp.asarray(seq_lens), dense)
    part, dense_w, topk_part = decode(state, tokens, jnp.asarray(seq_lens), dense_w, index_len=window)
    np.testing.assert_array_equal(np.asarray(topk_part), np.asarray(topk_full), err_msg=f"step {step}")
    np.testing.assert_array_equal(np.asarray(part), np.asarray(full), err_msg=f"step {step}")


def test_engine_windows_keep_tokens_independent_of_batching(engines, monkeypatch):
  """With small indexer windows (so solo and batched decodes use different windows), tokens are unchanged."""
  import hisparse_jax.engine as engine_mod
  dense_full, _ = engines  # max_seq_len 160 < MIN_INDEX_WINDOW: always the full window
  monkeypatch.setattr(engine_mod, "MIN_INDEX_WINDOW", 16)
  hs = Engine(tiny_model_dir(), hisparse=HiSparseConfig(**TINY_HISPARSE), max_running_requests=4, max_seq_len=S_MAX)
  ps = prompts(9)
  want = [r.output_ids for r in run(dense_full, ps)]
  assert [r.output_ids for r in run(hs, ps)] == want
  assert [run(hs, [p])[0].output_ids for p in ps[:2]] == want[:2]  # a 5- and a 12-token prompt, alone
