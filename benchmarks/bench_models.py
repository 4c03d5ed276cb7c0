"""Deterministic random checkpoints the benchmarks run on (generated on first use, cached).

Both are the default model's DeepSeek-V3.2 architecture (``models.random_checkpoint``) with sizes
changed for what each benchmark measures:

* ``trace_model``: the real top_k 2048 and contexts to 16k, so the indexer's own top-k trace has
  the sizes of the HiSparse configuration (``benchmarks/miss_rate.py --trace``).
* ``serving_model``: float32 (CPU), latent rows of 528 values (kv_lora_rank 512 + rope 16) next to
  32-dim indexer keys, so a token's latent KV is 8.25x its indexer key in bytes, near DeepSeek-V3.2's
  ratio (576 bf16 = 1152 B vs 128 + 4 scale bytes of FP8 index key: 8.7x) — the ratio that bounds how
  much device memory HiSparse can free. Sizes scaled by 1/16 from the HiSparse config: top_k 128,
  hot buffer 256 (real: 2048 / 4096). A 32k vocabulary keeps the output projection from swamping
  the step time on CPU.
"""

from __future__ import annotations

import copy

from hisparse_jax.default_model import ensure_random_model
from models.random_checkpoint import default_model_config

SEED = 20261129
# top_k / hot buffer of the serving model: the HiSparse defaults scaled by 1/64. Host ratio 16, not
# 8: the throughput benchmark's longest context (1024 = 16 x D) must not be capped by host-pool
# rows (ratio x (D+1) per lane), so admission measures the device budget alone.
SERVING_HISPARSE = {"top_k": 32, "device_buffer_size": 64, "host_to_device_ratio": 16}


def _config(**changes) -> dict:
  cfg = copy.deepcopy(default_model_config())
  cfg.update(changes)
  return cfg


def trace_model() -> str:
  """Model directory: default model, index_topk 2048, 16k positions, float32."""
  cfg = _config(index_topk=2048, max_position_embeddings=16384, dtype="float32")
  cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=4.0, original_max_position_embeddings=4096)
  return ensure_random_model(cfg, SEED, "bench-trace", hisparse_config={
      "top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8})


def serving_model() -> str:
  """Model directory of the throughput benchmarks (sizes in the module docstring); no tokenizer
  (prompts are token ids)."""
  cfg = _config(kv_lora_rank=512, qk_rope_head_dim=16, index_head_dim=32, n_routed_experts=4,
                index_topk=SERVING_HISPARSE["top_k"], dtype="float32")
  return ensure_random_model(cfg, SEED, "bench-serving", hisparse_config=SERVING_HISPARSE)
