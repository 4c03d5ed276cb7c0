"""Start-up shared by the batch script and the server: flags -> model dir, HiSparse config, engine.

Every start-up problem raises ``StartupError`` with a message naming the
flag or file at fault; the entry points print it and exit 2 (no traceback).
"""

from __future__ import annotations

import os

from hisparse_jax.config import ConfigError, HiSparseConfig
from hisparse_jax.default_model import ensure_default_model
from models.config import DSAConfig

MODEL_HISPARSE_FILE = "hisparse_config.json"  # per-model default HiSparse sizes (optional)


class StartupError(Exception):
  pass


def resolve_model_path(model_path: str | None) -> str:
  """The HF model directory for --model-path (None: the embedded default model)."""
  if model_path is None:
    return ensure_default_model()
  if not os.path.isdir(model_path):
    raise StartupError(f"--model-path {model_path!r}: no such directory")
  if not os.path.exists(os.path.join(model_path, "config.json")):
    raise StartupError(f"--model-path {model_path!r}: no config.json in that directory")
  return model_path


def read_model_config(model_dir: str) -> DSAConfig:
  try:
    return DSAConfig.from_pretrained(model_dir)
  except (ValueError, KeyError, TypeError, AttributeError, OSError, UnicodeDecodeError) as e:
    raise StartupError(f"--model-path {model_dir!r}: config.json: {e}") from None


def resolve_hisparse(enabled: bool, config_json: str | None, model_dir: str,
                     model_cfg: DSAConfig) -> HiSparseConfig | None:
  """HiSparse sizes from --hisparse-config, else the model dir's hisparse_config.json, else defaults."""
  if not enabled:
    if config_json:
      raise StartupError("--hisparse-config was given without --enable-hisparse")
    return None
  source, text = "--hisparse-config", config_json
  model_file = os.path.join(model_dir, MODEL_HISPARSE_FILE)
  if text is None and os.path.exists(model_file):
    source = model_file
    try:
      with open(model_file) as f:
        text = f.read()
    except (OSError, UnicodeDecodeError) as e:
      raise StartupError(f"{model_file}: {e}") from None
  if text is not None and not text.strip():
    raise StartupError(f"{source}: empty (give a JSON object, e.g. '{{\"device_buffer_size\": 4096}}')")
  try:
    return HiSparseConfig.from_json(text, model_top_k=model_cfg.index_topk)
  except ConfigError as e:
    raise StartupError(f"{source}: {e}") from None


# Refuse a host pool or hot buffers that cannot fit this machine's memory, before allocating.
MAX_MEMORY_FRACTION = 0.8


def check_memory(model_cfg: DSAConfig, hisparse: HiSparseConfig | None, max_running_requests: int,
                 dtype: str | None) -> None:
  """StartupError if the KV memory the flags ask for exceeds 80% of physical memory."""
  if hisparse is None:
    return
  import jax.numpy as jnp
  itemsize = jnp.dtype(dtype or model_cfg.dtype).itemsize
  row = model_cfg.num_hidden_layers * model_cfg.latent_dim * itemsize  # bytes per token, all layers
  hot_rows = max_running_requests * (hisparse.device_buffer_size + 1)
  need = row * (hot_rows + hisparse.host_pool_rows(max_running_requests))
  have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if need > MAX_MEMORY_FRACTION * have:
    raise StartupError(
        f"--hisparse-config: hot buffers + host pool need {need / 2**30:.1f} GiB "
        f"({max_running_requests} requests x {hisparse.device_buffer_size + 1} slots x "
        f"{hisparse.host_to_device_ratio + 1} x {row} B/token), more than {MAX_MEMORY_FRACTION:.0%} of this "
        f"machine's {have / 2**30:.1f} GiB; lower device_buffer_size, host_to_device_ratio or "
        f"--max-running-requests")


def build_engine(model_dir: str, *, dtype, hisparse, max_running_requests: int, host_pool: str,
                 fp8_numerics: bool = False, **engine_args):
  """The engine, or StartupError naming what could not be loaded (no traceback for bad files)."""
  if max_running_requests < 1:
    raise StartupError(f"--max-running-requests must be >= 1, got {max_running_requests}")
  from hisparse_jax.engine import Engine
  try:
    return Engine(model_dir, dtype=dtype, hisparse=hisparse, max_running_requests=max_running_requests,
                  host_pool=host_pool, fp8_numerics=fp8_numerics, **engine_args)
  except MemoryError as e:
    raise StartupError(f"out of memory building the engine: {e}") from None
  except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is a start-up error
    if "RESOURCE_EXHAUSTED" in str(e):
      raise StartupError(f"out of memory building the engine: {e}") from None
    raise StartupError(f"--model-path {model_dir!r}: cannot load the model: {type(e).__name__}: {e}") from None


def check_max_seq_len(max_seq_len: int | None, model_cfg: DSAConfig) -> None:
  """StartupError unless --max-seq-len is unset or in [1, the model's max_position_embeddings]."""
  if max_seq_len is not None and not 1 <= max_seq_len <= model_cfg.max_position_embeddings:
    raise StartupError(f"--max-seq-len {max_seq_len}: must be in [1, {model_cfg.max_position_embeddings}] "
                       "(the model's max_position_embeddings)")


def check_dtype(dtype: str | None) -> None:
  if dtype not in (None, "float32", "bfloat16"):
    raise StartupError(f"--dtype {dtype!r}: expected float32 or bfloat16")


def load_tokenizer_or_fail(model_dir: str):
  """The model's tokenizer (None if it has none), or StartupError if tokenizer.json is unreadable."""
  from hisparse_jax.text import load_tokenizer
  try:
    return load_tokenizer(model_dir)
  except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
    raise StartupError(f"--model-path {model_dir!r}: tokenizer.json: {e}") from None


def check_host_pool(kind: str, hisparse_enabled: bool) -> None:
  from hisparse_jax.engine import HOST_POOL_KINDS
  if kind not in HOST_POOL_KINDS:
    raise StartupError(f"--host-pool {kind!r}: expected one of {', '.join(HOST_POOL_KINDS)}")
  if kind != HOST_POOL_KINDS[0] and not hisparse_enabled:
    raise StartupError(f"--host-pool {kind} was given without --enable-hisparse (dense mode has no host pool)")


def device_kv_budget(max_device_kv_bytes: int | None, mem_fraction_static: float | None) -> int | None:
  """The device KV budget in bytes from --max-device-kv-bytes and/or --mem-fraction-static (the
  smaller when both; the fraction applies to the device's memory limit, as SGLang's flag does)."""
  budgets = []
  if max_device_kv_bytes is not None:
    if max_device_kv_bytes <= 0:
      raise StartupError(f"--max-device-kv-bytes must be > 0, got {max_device_kv_bytes}")
    budgets.append(max_device_kv_bytes)
  if mem_fraction_static is not None:
    if not 0 < mem_fraction_static <= 1:
      raise StartupError(f"--mem-fraction-static must be in (0, 1], got {mem_fraction_static}")
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
      raise StartupError("--mem-fraction-static: this device reports no memory limit (CPU); use "
                         "--max-device-kv-bytes")
    budgets.append(int(mem_fraction_static * stats["bytes_limit"]))
  return min(budgets) if budgets else None
