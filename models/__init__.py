"""DSA models (DeepSeek-V3.2, GLM-5 / GLM-5.1): config, Flax NNX modules, HF checkpoint loader (incl. FP8
block-quantized checkpoints), random checkpoints."""

from .config import DSAConfig, RopeConfig
from .deepseek_v32 import (
  DeepseekV32ForCausalLM,
  GlmMoeDsaForCausalLM,
  decode_step,
  prefill_prompts,
  prefill_step,
  split_model,
)
from .kv_protocol import ContiguousKVCache, KVCache
from .fp8 import dequantize_block_fp8
from .loader import hf_param_table, load_hf

__all__ = [
  "DSAConfig",
  "RopeConfig",
  "DeepseekV32ForCausalLM",
  "GlmMoeDsaForCausalLM",
  "dequantize_block_fp8",
  "ContiguousKVCache",
  "KVCache",
  "decode_step",
  "prefill_prompts",
  "prefill_step",
  "split_model",
  "hf_param_table",
  "load_hf",
  "default_model_config",
  "write_random_checkpoint",
]


def __getattr__(name: str):
  # The random-checkpoint writer loads on first use, so that `python -m models.random_checkpoint` runs a
  # module the package has not imported already.
  if name in ("default_model_config", "write_random_checkpoint"):
    from . import random_checkpoint

    return getattr(random_checkpoint, name)
  raise AttributeError(f"module 'models' has no attribute {name!r}")
