"""A stand-in for the engine's ModelRunner that compiles nothing: scheduler tests run without a model's programs.

``FakeRunner`` keeps a fake KV cache on the host: each call writes its rows' token ids at their positions through
the page tables the engine built (dense: the KV pool's pages; HiSparse: the indexer-key pages, which every token
has), and a row's next token is a hash of the token ids it reads back at positions 0 .. its newest. So a request's
tokens equal the ones it gets alone exactly when the scheduler gave it pages of its own, wrote every position once
before reading it, and kept its rows in order: a page shared by two requests or a row fed to the wrong request
changes the tokens, and a position read through an unset page-table entry or never written raises. Greedy only (sampling parameters are ignored), one
device, no prompt KV import or export. ``step_seconds``: each prefill and decode call takes at least that long (as a
device step would: tests whose requests must still be running while they act), sleeping without the GIL.

``Engine(..., runner_class=FakeRunner)``, or ``functools.partial(FakeRunner, step_seconds=0.01)``.
"""

from __future__ import annotations

import time

import numpy as np

from hisparse_jax.engine.model_runner import ModelRunner

_HASH = 1_000_003


class FakeRunner:
  def __init__(
    self, model, *, mesh, page_size: int, record_topk: bool, multiprocess: bool, kv_dtype, index_dtype, step_seconds=0.0
  ):
    if mesh is not None or multiprocess or record_topk:
      raise ValueError("FakeRunner: one device, one process, no top-k trace")
    self.step_seconds = step_seconds
    self.config = model.config
    self.page_size = page_size
    self.backend = None
    self.logits_buffers = {}
    self.kv: dict[int, np.ndarray] = {}  # page id -> int64[page_size] token ids (-1: never written)

  def _table(self, tables: dict) -> np.ndarray:
    return tables["pages"] if "pages" in tables else tables["index_pages"]

  def _write(self, pages, position: int, token: int) -> None:
    page = int(pages[position // self.page_size])
    if page < 0:
      raise AssertionError(f"position {position} written through an unset page-table entry")
    self.kv.setdefault(page, np.full(self.page_size, -1, np.int64))[position % self.page_size] = token

  def _next_token(self, pages, newest: int) -> int:
    seq = []
    for p in range(newest + 1):
      page = int(pages[p // self.page_size])
      token = self.kv.get(page, np.full(self.page_size, -1))[p % self.page_size] if page >= 0 else -1
      if token < 0:
        raise AssertionError(f"position {p} read before it was written (page {page})")
      seq.append(int(token))
    h = 0
    for t in seq:
      h = (h * _HASH + t + 1) % (1 << 61)
    token = h % self.config.vocab_size
    while token in self.config.eos_token_ids:  # (tests choose when a request ends: by length)
      token = (token + 1) % self.config.vocab_size
    return token

  def prefill(self, tokens, positions, tables, sampling, *, first_token: bool, query_block, blocks):
    del sampling, query_block, blocks
    time.sleep(self.step_seconds)
    tokens, positions, table = np.asarray(tokens), np.asarray(positions), self._table(tables)
    out = np.zeros(len(tokens), np.int32)
    for b in range(len(tokens)):
      valid = positions[b] >= 0
      for t, p in zip(tokens[b][valid], positions[b][valid]):
        self._write(table[b], int(p), int(t))
      if first_token and valid.any():
        out[b] = self._next_token(table[b], int(positions[b][valid].max()))
    return out, np.zeros(len(tokens), np.int32)

  def decode(self, tokens, positions, tables, sampling, logits_buffer, *, residency, blocks):
    del sampling, logits_buffer, residency, blocks
    time.sleep(self.step_seconds)
    tokens, positions, table = np.asarray(tokens), np.asarray(positions), self._table(tables)
    out = np.zeros(len(tokens), np.int32)
    for b, p in enumerate(positions):
      if p >= 0:
        self._write(table[b], int(p), int(tokens[b]))
        out[b] = self._next_token(table[b], int(p))
    return (out, np.zeros(len(tokens), np.int32)), None, []

  def merge_tokens(self, launched_tokens, from_launched, host_tokens):
    return np.where(from_launched >= 0, np.asarray(launched_tokens)[np.maximum(from_launched, 0)], host_tokens)

  def offload(self, tables) -> None:
    del tables  # (the fake KV is read through the indexer-key pages, which stay)

  def import_kv(self, *args):
    raise NotImplementedError("FakeRunner has no prompt KV to import")

  def export_kv(self, *args):
    raise NotImplementedError("FakeRunner has no prompt KV to export")

  def settle(self) -> None:
    pass

  index_blocks = ModelRunner.index_blocks  # (sizes from the config and the page size alone)

  def query_block(self, B: int, C: int):
    return None

  def logits_buffer(self, B: int):
    return None

  def keep_logits_buffer(self, B: int, buf) -> None:
    pass

  def put(self, x, dtype=None, commit: bool = False):
    return np.asarray(x, dtype)

  def put_tables(self, tables: dict) -> dict:
    return dict(tables)
