"""Start-up shared by the batch script and the server: flags -> model dir, HiSparse config, engine.

Every start-up problem raises ``StartupError`` with a message naming the
flag or file at fault; the entry points print it and exit 2 (no traceback).
"""

from __future__ import annotations

import json
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
  except (ValueError, KeyError, json.JSONDecodeError) as e:
    raise StartupError(f"--model-path {model_dir!r}: {e}") from None


def resolve_hisparse(enabled: bool, config_json: str | None, model_dir: str,
                     model_cfg: DSAConfig) -> HiSparseConfig | None:
  """HiSparse sizes from --hisparse-config, else the model dir's hisparse_config.json, else defaults."""
  if not enabled:
    if config_json:
      raise StartupError("--hisparse-config was given without --enable-hisparse")
    return None
  text = config_json
  if text is None and os.path.exists(os.path.join(model_dir, MODEL_HISPARSE_FILE)):
    with open(os.path.join(model_dir, MODEL_HISPARSE_FILE)) as f:
      text = f.read()
  try:
    return HiSparseConfig.from_json(text, model_top_k=model_cfg.index_topk)
  except ConfigError as e:
    raise StartupError(f"--hisparse-config: {e}") from None


def check_dtype(dtype: str | None) -> None:
  if dtype not in (None, "float32", "bfloat16"):
    raise StartupError(f"--dtype {dtype!r}: expected float32 or bfloat16")
