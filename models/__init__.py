"""DSA models (DeepSeek-V3.2, GLM-5 / GLM-5.1): config, Flax NNX modules, HF checkpoint loader (incl. FP8
block-quantized checkpoints), random checkpoints."""

from .config import DSAConfig, RopeConfig
from .deepseek_v32 import (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM, decode_step, prefill_prompts, prefill_step,
                           split_model)
from .kv_protocol import ContiguousKVCache, KVCache
from .fp8 import dequantize_block_fp8
from .loader import hf_param_table, load_hf
from .random_checkpoint import default_model_config, write_random_checkpoint

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
