"""Deterministic random DSA (DeepSeek-V3.2 / GLM-5) checkpoints in HuggingFace format (numpy + safetensors only).

``write_random_checkpoint(out_dir, config_dict, seed)`` writes ``config.json`` and ``model.safetensors``
with exactly the tensor names transformers 5.24 ``save_pretrained`` uses for
``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` keys), so the
result loads both with :func:`models.loader.load_hf` and with transformers.

Init: Linear / embedding weights ~ N(0, initializer_range) (numpy ``default_rng(seed)``, tensors drawn
in file order), RMSNorm / LayerNorm weights 1, LayerNorm bias 0, e_score_correction_bias 0.
Weights are stored in the config's dtype, except the router (``mlp.gate.*``) and
``indexer.weights_proj`` which are float32 (as transformers keeps them).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
from safetensors.numpy import save_file

from .config import DSAConfig


def default_model_config() -> dict:
  """HF config.json dict of the project's small default model (DeepSeek-V3.2 architecture, real
  DeepSeek-V3 vocabulary size 129280, DeepSeek-V3.2's 163840-token context with YaRN RoPE in DeepSeek's own
  ``rope_scaling`` form, bfloat16)."""
  return {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 129280,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    # DeepSeek-V3.2's context and RoPE: 163840 positions, YaRN x40 over 4096 (its config.json).
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_scaling": {
      "type": "yarn",
      "factor": 40,
      "original_max_position_embeddings": 4096,
      "beta_fast": 32,
      "beta_slow": 1,
      "mscale": 1.0,
      "mscale_all_dim": 1.0,
    },
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 32,
    "initializer_range": 0.1,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "bfloat16",
  }


def _hf_shapes(cfg: DSAConfig) -> list[tuple[str, tuple[int, ...], str]]:
  """(key, HF shape, kind) for every tensor; kind in {"normal", "ones", "zeros", "normal32", "zeros32"}."""
  H, nH = cfg.hidden_size, cfg.num_attention_heads
  out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (cfg.vocab_size, H), "normal")]
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out += [
      (p + "input_layernorm.weight", (H,), "ones"),
      (a + "q_a_proj.weight", (cfg.q_lora_rank, H), "normal"),
      (a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "ones"),
      (a + "q_b_proj.weight", (nH * cfg.qk_head_dim, cfg.q_lora_rank), "normal"),
      (a + "kv_a_proj_with_mqa.weight", (cfg.latent_dim, H), "normal"),
      (a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "ones"),
      (a + "kv_b_proj.weight", (nH * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "normal"),
      (a + "o_proj.weight", (H, nH * cfg.v_head_dim), "normal"),
    ]
    if cfg.has_indexer(i):  # GLM "shared" layers have no indexer
      out += [
        (a + "indexer.wq_b.weight", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "normal"),
        (a + "indexer.wk.weight", (cfg.index_head_dim, H), "normal"),
        (a + "indexer.k_norm.weight", (cfg.index_head_dim,), "ones"),
        (a + "indexer.k_norm.bias", (cfg.index_head_dim,), "zeros"),
        (a + "indexer.weights_proj.weight", (cfg.index_n_heads, H), "normal32"),
      ]
    out.append((p + "post_attention_layernorm.weight", (H,), "ones"))
    if cfg.is_moe_layer(i):
      m, E, I = p + "mlp.", cfg.n_routed_experts, cfg.moe_intermediate_size
      out += [(m + "gate.weight", (E, H), "normal32"), (m + "gate.e_score_correction_bias", (E,), "zeros32")]
      for e in range(E):
        out += [
          (f"{m}experts.{e}.gate_proj.weight", (I, H), "normal"),
          (f"{m}experts.{e}.up_proj.weight", (I, H), "normal"),
          (f"{m}experts.{e}.down_proj.weight", (H, I), "normal"),
        ]
      Is = I * cfg.n_shared_experts
      out += [
        (m + "shared_experts.gate_proj.weight", (Is, H), "normal"),
        (m + "shared_experts.up_proj.weight", (Is, H), "normal"),
        (m + "shared_experts.down_proj.weight", (H, Is), "normal"),
      ]
    else:
      m, I = p + "mlp.", cfg.intermediate_size
      out += [
        (m + "gate_proj.weight", (I, H), "normal"),
        (m + "up_proj.weight", (I, H), "normal"),
        (m + "down_proj.weight", (H, I), "normal"),
      ]
  out.append(("model.norm.weight", (H,), "ones"))
  if not cfg.tie_word_embeddings:
    out.append(("lm_head.weight", (cfg.vocab_size, H), "normal"))
  return out


def _np_dtype(name: str):
  if name == "bfloat16":
    import ml_dtypes

    return ml_dtypes.bfloat16
  return np.dtype(name)


def write_random_checkpoint(out_dir: str | os.PathLike, config_dict: dict, seed: int) -> str:
  """Write ``config.json`` + ``model.safetensors`` for ``config_dict`` with weights from
  ``numpy.random.default_rng(seed)``. Returns ``out_dir``. Deterministic for a given (config, seed)."""
  out_dir = os.fspath(out_dir)
  cfg = DSAConfig.from_hf_config(config_dict)
  os.makedirs(out_dir, exist_ok=True)
  rng = np.random.default_rng(seed)
  std = cfg.initializer_range
  dt = _np_dtype(cfg.dtype)
  tensors: dict[str, np.ndarray] = {}
  for key, shape, kind in _hf_shapes(cfg):
    if kind.startswith("normal"):
      arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    elif kind.startswith("ones"):
      arr = np.ones(shape, np.float32)
    else:
      arr = np.zeros(shape, np.float32)
    tensors[key] = arr if kind.endswith("32") else arr.astype(dt)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  saved_cfg = copy.deepcopy(config_dict)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(saved_cfg, f, indent=2, sort_keys=True)
  return out_dir


def main(argv=None) -> int:
  """``python -m models.random_checkpoint --output DIR [--config config.json] [--seed N]``: a checkpoint to
  serve or to practise porting on. Exit status 2 with one line on stderr for a config that is not a DSA one."""
  import argparse
  import sys

  ap = argparse.ArgumentParser(
    prog="python -m models.random_checkpoint",
    description="Write a random DSA checkpoint (config.json + model.safetensors, transformers' tensor names).",
  )
  ap.add_argument("--output", required=True, help="directory to write (created; files in it are replaced)")
  ap.add_argument(
    "--config",
    help="an HF config.json of a DeepSeek-V3.2 or GLM-5 model (default: the "
    "architecture of the project's small default model)",
  )
  ap.add_argument("--seed", type=int, default=0, help="numpy seed of the weights (default 0)")
  args = ap.parse_args(argv)
  try:
    if args.config is None:
      config = default_model_config()
    else:
      with open(args.config) as f:
        config = json.load(f)
    write_random_checkpoint(args.output, config, args.seed)
  except (OSError, ValueError, KeyError, TypeError) as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.output} ({', '.join(sorted(os.listdir(args.output)))})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
