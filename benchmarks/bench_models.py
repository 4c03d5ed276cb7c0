"""Deterministic random checkpoints the benchmarks run on (generated on first use, cached).

``realsize_model``: the embedded default model's architecture and width (hidden 256, 4 layers, MLA latent
rows of 64 + 32 values, 4 indexer heads of 32 dims, DeepSeek-V3.2's 163840-token YaRN context and
129280-token vocabulary) with the real HiSparse sizes: index_topk 2048 and the model directory's
``hisparse_config.json`` = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}, the
configuration HiSparse was published with. Float32 (the CPU's fast path). Its latent row (96 x 4 B) is 3x
its indexer key (32 x 4 B); DeepSeek-V3.2's is ~5x (656 B of FP8 latent + scales vs 132 B of FP8 key +
scale per layer) -- the ratio that bounds how much device memory HiSparse frees, so this model understates
HiSparse's capacity gain (BENCHMARKS.md says by how much).
"""

from __future__ import annotations

import copy

from hisparse_jax.default_model import ensure_random_model
from models.random_checkpoint import default_model_config

SEED = 20261130
REALSIZE_HISPARSE = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}


def realsize_model() -> str:
  """Model directory of the real-size benchmarks (see the module docstring), with the DeepSeek-V3 tokenizer."""
  cfg = copy.deepcopy(default_model_config())
  cfg.update(index_topk=REALSIZE_HISPARSE["top_k"], dtype="float32")
  return ensure_random_model(cfg, SEED, "bench-realsize", hisparse_config=REALSIZE_HISPARSE)


if __name__ == "__main__":
  raise SystemExit(
    f"{__file__}: a module of the benchmarks, not a benchmark: run the benchmarks that name it "
    "(record_trace.py, throughput.py, ...)"
  )
