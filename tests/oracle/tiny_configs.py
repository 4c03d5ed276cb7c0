"""Tiny DSA configs shared by the oracle script (Python 3.11 + torch) and the tests (no imports)."""

TINY_CONFIG = {
  "architectures": ["DeepseekV32ForCausalLM"],
  "model_type": "deepseek_v32",
  "vocab_size": 512,
  "hidden_size": 64,
  "intermediate_size": 128,
  "moe_intermediate_size": 32,
  "num_hidden_layers": 3,
  "num_attention_heads": 4,
  "num_key_value_heads": 4,
  "q_lora_rank": 32,
  "kv_lora_rank": 32,
  "qk_nope_head_dim": 16,
  "qk_rope_head_dim": 16,
  "v_head_dim": 16,
  "n_routed_experts": 8,
  "n_shared_experts": 1,
  "num_experts_per_tok": 2,
  "n_group": 4,
  "topk_group": 2,
  "routed_scaling_factor": 2.5,
  "norm_topk_prob": True,
  "first_k_dense_replace": 1,
  "rms_norm_eps": 1e-6,
  "max_position_embeddings": 256,
  "index_n_heads": 16,
  "index_head_dim": 32,
  "index_topk": 8,
  "initializer_range": 0.1,
  "tie_word_embeddings": False,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


# GLM-5 conventions at tiny size: n_group 1, rms_norm_eps 1e-5 (q_a/kv_a norms stay at 1e-6), plain
# RoPE with a large theta, qk_nope_head_dim != v_head_dim (GLM-5: 192 / 256).
TINY_GLM_CONFIG = {
  **{k: v for k, v in TINY_CONFIG.items() if k not in ("architectures", "model_type")},
  "num_hidden_layers": 4,
  "qk_nope_head_dim": 24,
  "v_head_dim": 20,
  "n_group": 1,
  "topk_group": 1,
  "rms_norm_eps": 1e-5,
  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
