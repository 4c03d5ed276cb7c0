"""Drive the model over one KV backend without the engine's scheduler (for numerics and lossless tests).

Each prompt gets a request slot and is prefilled (whole, or in chunks of ``chunk`` tokens), then every
``decode`` call feeds one token per request (teacher-forced or greedy) in one batch with a trailing idle
row. The backends' free lists are shuffled first, so a request's pages are scattered across each pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import sharding
from hisparse_jax.kernels import ops
from hisparse_jax.memory import backend as kvmem
from hisparse_jax.memory.views import kernel_status
from models.deepseek_v32 import MoE


class KVHarness:
  def __init__(
    self,
    cfg,
    model,
    *,
    hisparse=None,
    max_seq_len=160,
    page_size=16,
    chunk=None,
    slots=8,
    budget=1 << 26,
    dtype=None,
    host_pool="jax",
    shuffle_seed=1,
    key_block=32,
    score_block=None,
    mesh_config=None,
    window=None,
  ):
    self.cfg = cfg
    # A MeshConfig of more than one device: parameters split by the rule table, KV replicated, calls traced
    # under the mesh (as the engine does).
    self.mesh_config = mesh_config
    self.mesh = mesh_config.make_mesh() if mesh_config is not None and mesh_config.num_devices > 1 else None
    if self.mesh is not None:
      want = mesh_config.expert_parallel()
      got = {m.expert_parallel for _, m in nnx.iter_graph(model) if isinstance(m, MoE)}
      if got - {want}:
        raise ValueError(
          f"the model's experts run as {got}; this mesh needs {want}: load it with "
          "expert_parallel=mesh_config.expert_parallel()"
        )
    # DP groups: request i goes to group i % groups; batches are group-major (engine.py _batch_rows).
    self.groups = mesh_config.dp_size if self.mesh is not None else 1
    dtype = jnp.dtype(dtype or cfg.dtype)
    layout = kvmem.KVLayout.of(cfg, dtype)
    dtype = cfg.kv_row(dtype)[1]  # the stored rows' (cfg.kv_cache_dtype)
    plan = kvmem.plan(
      layout, budget=budget, max_running_requests=slots, max_seq_len=max_seq_len, page_size=page_size, hisparse=hisparse
    )
    self.backend = (
      kvmem.DenseBackend(plan, layout, dtype, self.mesh, self.groups)
      if hisparse is None
      else kvmem.HiSparseBackend(plan, layout, dtype, hisparse, host_pool, self.mesh, self.groups)
    )
    rng = np.random.default_rng(shuffle_seed)
    for lists in self.backend._group_lists:
      for free_list in lists.values():
        rng.shuffle(free_list._free)
    self.chunk = chunk
    self.key_block, self.score_block = key_block, score_block
    # Indexer keys every call scores (a multiple of key_block covering every position: one compiled prefill and
    # one decode program); None: the smallest power-of-two number of key blocks covering the call's positions.
    self.window = window
    self.kvs, self.seq_lens = [], []
    graphdef, self.params = nnx.split(model)
    if self.mesh is not None:
      self.params = sharding.shard_params(mesh_config, self.mesh, self.params)
    self._prefill, self._decode = (self._on_mesh(f) for f in _steps(graphdef))

  def _on_mesh(self, fn):
    if self.mesh is None:
      return fn

    def call(*args):
      with jax.set_mesh(self.mesh):
        return fn(*args)

    return call

  def prefill(self, prompts) -> np.ndarray:
    """Admits and prefills each prompt; returns float32[N, V], the logits at each prompt's last token."""
    out = []
    G = self.groups
    for p in prompts:
      g = len(self.kvs) % G
      kv = self.backend.admit(len(p), group=g)
      chunk = self.chunk or len(p)
      for start in range(0, len(p), chunk):
        part = p[start : start + chunk]
        tokens = np.zeros((G, chunk), np.int32)  # one row per DP group; only the request's group has one
        positions = np.full((G, chunk), -1, np.int32)
        tokens[g, : len(part)] = part
        positions[g, : len(part)] = np.arange(start, start + len(part))
        last = start + chunk >= len(p)
        kvs, finishing = [None] * G, [False] * G
        kvs[g], finishing[g] = kv, last
        tables = self.backend.prefill_tables(kvs, finishing)
        logits, self.backend.state, status = self._prefill(
          self.params,
          jnp.asarray(tokens),
          jnp.asarray(positions),
          self.backend.state,
          _device(tables),
          self._blocks(start + chunk),
        )
        ops.check_status(status, "prefill")  # every row's backup done
      self.backend.prefill_finished(kv)
      out.append(np.asarray(logits[g]))
      self.kvs.append(kv)
      self.seq_lens.append(len(p))
    return np.stack(out)

  def decode(self, tokens, return_topk=False):
    """Feeds tokens[i] to request i at its next position; returns float32[N, V] (and int32[L, N, K])."""
    n, G = len(self.kvs), self.groups
    for i in range(n):
      assert self.backend.ensure(self.kvs[i], self.seq_lens[i] + 1), "pool exhausted"
    # Group-major rows, each group's requests then a trailing idle row.
    per_group = -(-n // G) + 1
    rows = [(i % G) * per_group + i // G for i in range(n)]
    kvs = [None] * (G * per_group)
    toks = np.zeros(G * per_group, np.int32)
    positions = np.full(G * per_group, -1, np.int32)
    for i, r in enumerate(rows):
      kvs[r], toks[r], positions[r] = self.kvs[i], tokens[i], self.seq_lens[i]
    tables = self.backend.decode_tables(kvs)
    logits, self.backend.state, topk, status = self._decode(
      self.params,
      jnp.asarray(toks),
      jnp.asarray(positions),
      self.backend.state,
      _device(tables),
      self._blocks(max(self.seq_lens) + 1),
    )
    ops.check_status(status, "decode")  # every row's backup and swap-in done
    logits = np.asarray(logits)
    assert np.isfinite(logits).all(), "non-finite decode logits (idle row included)"
    self.seq_lens = [s + 1 for s in self.seq_lens]
    return (logits[rows], np.asarray(topk)[:, rows]) if return_topk else logits[rows]

  def _blocks(self, tokens: int) -> tuple:
    """(window, key_block, score_block) of a call whose positions are below ``tokens``."""
    window = self.window or self.key_block
    while window < tokens:
      if self.window:
        raise ValueError(f"window {self.window} does not cover position {tokens - 1}")
      window *= 2
    score = self.score_block if self.score_block and self.score_block < window else None
    return window, self.key_block, score

  def greedy(self, prompts, max_new: int) -> list[list[int]]:
    """Greedy continuations (max_new tokens each, the first from the prefill)."""
    nxt = self.prefill(prompts).argmax(-1)
    outs = [[int(t)] for t in nxt]
    for _ in range(max_new - 1):
      nxt = self.decode(nxt).argmax(-1)
      for o, t in zip(outs, nxt):
        o.append(int(t))
    return outs

  def state_slots(self) -> list[int]:
    """Each request's index on the HiSparse state's request-slot axis (dimension 1 of stats, slot_tokens,
    score_ema, ...): each group's shard holds slots per group + a scratch slot."""
    per = self.backend.slots_per_group + 1
    return [kv.group * per + self.backend.local_slot(kv) for kv in self.kvs]

  def swap_stats(self) -> np.ndarray:
    """int32[L, N, 2] (hits, misses) per layer and request (HiSparse)."""
    return np.asarray(self.backend.state.stats)[:, self.state_slots()]


def _device(tables):
  return {k: jnp.asarray(v) for k, v in tables.items()}


def teacher_forced_logits(cfg, model, prompts, steps, **harness_kw):
  """(float32[steps, N, V], the harness): each prompt prefilled, then ``steps`` decode steps feeding token
  7 + t to every request at step t (the same tokens whatever the logits, so two numerics compare step by step)."""
  h = KVHarness(cfg, model, **harness_kw)
  h.prefill(prompts)
  out = [h.decode(np.full(len(prompts), 7 + t)) for t in range(steps)]
  return np.stack(out), h


@functools.lru_cache(maxsize=None)
def _steps(graphdef):
  @functools.partial(jax.jit, donate_argnums=(3,), static_argnums=(5,))
  def prefill(params, tokens, positions, state, tables, blocks):
    window, key_block, score_block = blocks
    view = state.view(tables)
    logits, view = nnx.merge(graphdef, params).prefill(
      tokens, positions, view, window=window, key_block=key_block, score_block=score_block
    )
    return logits, state.absorb(view).finish_prefill(tables), kernel_status(view, tokens.shape[0])

  @functools.partial(jax.jit, donate_argnums=(3,), static_argnums=(5,))
  def decode(params, tokens, positions, state, tables, blocks):
    window, key_block, score_block = blocks
    view = state.view(tables)
    logits, view, topk = nnx.merge(graphdef, params).decode(
      tokens, positions, view, return_topk=True, window=window, key_block=key_block, score_block=score_block
    )
    return logits, state.absorb(view), topk, kernel_status(view, tokens.shape[0])

  return prefill, decode
