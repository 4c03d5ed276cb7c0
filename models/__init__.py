"""DeepSeek-V3.2 (DSA) model: config, Flax NNX modules, HF checkpoint loader, random checkpoints."""

from .config import DSAConfig, RopeConfig
from .deepseek_v32 import DeepseekV32ForCausalLM, decode_step, prefill_step, split_model
from .loader import hf_param_table, load_hf
from .random_checkpoint import default_model_config, write_random_checkpoint

__all__ = [
    "DSAConfig",
    "RopeConfig",
    "DeepseekV32ForCausalLM",
    "decode_step",
    "prefill_step",
    "split_model",
    "hf_param_table",
    "load_hf",
    "default_model_config",
    "write_random_checkpoint",
]
