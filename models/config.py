"""Model configuration for DeepSeek-Sparse-Attention checkpoints: DeepSeek-V3.2 and GLM-5 / GLM-5.1.

`DSAConfig` is built from a HuggingFace ``config.json`` of ``model_type == "deepseek_v32"``
(``architectures == ["DeepseekV32ForCausalLM"]``) or ``model_type == "glm_moe_dsa"``
(``["GlmMoeDsaForCausalLM"]``).  Field names follow the HF configs (transformers ``DeepseekV32Config`` /
``GlmMoeDsaConfig``).  The two families differ only in conventions, all read from config.json and
checked against what transformers 5.24 implements for the model type:

==========================  ======================  ==========================================
convention                  deepseek_v32            glm_moe_dsa
==========================  ======================  ==========================================
MLA RoPE                    interleaved             interleaved  (``rope_interleave``)
indexer RoPE                rotate-half             interleaved  (``indexer_rope_interleave``)
rms_norm_eps default        1e-6                    1e-5
q_a / kv_a RMSNorm eps      1e-6 (fixed)            1e-6 (fixed, whatever rms_norm_eps is)
cross-layer top-k sharing   no (every layer full)   ``indexer_types`` ("full" / "shared"), else
                                                    ``index_topk_pattern`` or ``index_topk_freq``
                                                    + ``index_skip_topk_offset``
==========================  ======================  ==========================================

transformers 5.24 ignores ``rope_interleave`` / ``indexer_rope_interleave`` (the layouts are fixed per
model type), so a config asking for the other layout is refused rather than silently mis-run.

FP8 block-quantized checkpoints: ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`` is accepted (``fp8_block_size``); the loader dequantizes.

RoPE parameters are accepted in both forms found in the wild:

* DeepSeek's own ``config.json``: top-level ``rope_theta`` plus
  ``rope_scaling = {"type": "yarn", "factor", "original_max_position_embeddings",
  "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}``;
* transformers 5: ``rope_parameters = {"rope_type": "yarn" | "default", "rope_theta", ...}``.

Resolution mirrors transformers 5.24 (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` /
``standardize_rope_params`` and ``_compute_yarn_parameters``): ``rope_scaling`` wins over
``rope_parameters`` when both are present; a top-level ``original_max_position_embeddings`` wins over
the one inside the rope dict; ``factor=None`` means ``max_position_embeddings / original``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

# model_type -> its causal-LM architecture name
ARCHITECTURE_OF = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURE_OF)
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_OF.values())
# What transformers 5.24 implements per model type (it reads neither key from the config).
_ROPE_LAYOUT = {  # model_type -> (MLA rope_interleave, indexer_rope_interleave)
  "deepseek_v32": (True, False),
  "glm_moe_dsa": (True, True),
}
# Per-model-type defaults that differ from _DEFAULTS (the transformers config class defaults).
_MODEL_DEFAULTS: dict[str, dict[str, Any]] = {"glm_moe_dsa": {"rms_norm_eps": 1e-5}}
SUPPORTED_QUANT_METHODS = ("fp8",)
SUPPORTED_FP8_BLOCK_SIZES = ((128, 128),)
SUPPORTED_ROPE_TYPES = ("default", "yarn")

_REQUIRED_KEYS = (
  "vocab_size",
  "hidden_size",
  "intermediate_size",
  "moe_intermediate_size",
  "num_hidden_layers",
  "num_attention_heads",
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "n_routed_experts",
  "num_experts_per_tok",
  "index_n_heads",
  "index_head_dim",
  "index_topk",
)

# Optional keys and their defaults (the transformers DeepseekV32Config defaults).
_DEFAULTS: dict[str, Any] = {
  "n_shared_experts": 1,
  "n_group": 1,
  "topk_group": 1,
  "routed_scaling_factor": 1.0,
  "norm_topk_prob": True,
  "first_k_dense_replace": 3,
  "rms_norm_eps": 1e-6,
  "max_position_embeddings": 163840,
  "tie_word_embeddings": False,
  "bos_token_id": 0,
  "eos_token_id": 1,
  "hidden_act": "silu",
  "initializer_range": 0.02,
}

_DTYPES = {
  "float32": "float32",
  "fp32": "float32",
  "float": "float32",
  "bfloat16": "bfloat16",
  "bf16": "bfloat16",
  "float16": "float16",
  "fp16": "float16",
  "half": "float16",
}


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1 (DeepSeek / transformers ``yarn_get_mscale``)."""
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """RoPE / YaRN parameters (shared by MLA's rope slice and the indexer's rope slice).

  rope_type: "default" or "yarn".
  theta: RoPE base.
  factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim,
  attention_factor, truncate: YaRN parameters (ignored for "default"); names as in HF.
  """

  rope_type: str = "default"
  theta: float = 10000.0
  factor: float = 1.0
  original_max_position_embeddings: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True

  def inv_freq(self, dim: int) -> np.ndarray:
    """float32[dim // 2] inverse frequencies (transformers ``_compute_yarn_parameters`` / default)."""
    pos_freqs = (np.float32(self.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(
      np.float32
    )
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if self.rope_type == "default":
      return inv_extra
    inv_inter = (np.float32(1.0) / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
    orig = self.original_max_position_embeddings

    def corr_dim(n_rot: float) -> float:
      return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(self.theta))

    low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_factor = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (inv_inter * (1 - extra_factor) + inv_extra * extra_factor).astype(np.float32)

  @property
  def cos_sin_scale(self) -> float:
    """Factor multiplied into cos/sin (transformers' ``attention_scaling``; 1 for default RoPE)."""
    if self.rope_type == "default":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)
    if self.mscale and self.mscale_all_dim:
      return float(_yarn_get_mscale(self.factor, self.mscale) / _yarn_get_mscale(self.factor, self.mscale_all_dim))
    return float(_yarn_get_mscale(self.factor))

  def softmax_scale(self, qk_head_dim: int) -> float:
    """MLA softmax scale: qk_head_dim**-0.5 times mscale(factor, mscale_all_dim)**2 for YaRN
    (transformers ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    if self.rope_type != "default" and self.mscale_all_dim:
      m = _yarn_get_mscale(self.factor, self.mscale_all_dim)
      scale = scale * m * m
    return scale


def _parse_rope(cfg: dict, max_pos: int) -> RopeConfig:
  rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
  if not isinstance(rp, dict):
    raise ValueError(f"rope_scaling / rope_parameters must be a dict, got {rp!r}")
  rope_type = rp.get("rope_type", rp.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})")
  for where, d in (("rope_parameters", rp), ("config", cfg)):
    prf = _number(d, "partial_rotary_factor", where)
    if prf is not None and prf != 1.0:
      raise ValueError(f"unsupported partial_rotary_factor {prf!r} in {where} (only 1.0)")
  where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
  theta = _number(rp, "rope_theta", where, positive=True) or _number(
    cfg, "rope_theta", "config", 10000.0, positive=True
  )
  if rope_type == "default":
    return RopeConfig(rope_type="default", theta=theta)
  source, label = (cfg, "config") if "original_max_position_embeddings" in cfg else (rp, where)
  orig = source.get("original_max_position_embeddings", max_pos)
  if isinstance(orig, bool) or not isinstance(orig, int) or not 1 <= orig <= _INT32_MAX:
    raise ValueError(
      f"{label} key 'original_max_position_embeddings' must be an integer in [1, {_INT32_MAX}], got {orig!r}"
    )
  factor = _number(rp, "factor", where, max_pos / orig, positive=True)
  return RopeConfig(
    rope_type="yarn",
    theta=theta,
    factor=factor,
    original_max_position_embeddings=orig,
    # 0 / absent: the default, as transformers; the YaRN ramp takes log(beta), so a negative one cannot run
    beta_fast=_number(rp, "beta_fast", where, 32.0, non_negative=True) or 32.0,
    beta_slow=_number(rp, "beta_slow", where, 1.0, non_negative=True) or 1.0,
    mscale=_number(rp, "mscale", where),
    mscale_all_dim=_number(rp, "mscale_all_dim", where),
    attention_factor=_number(rp, "attention_factor", where),
    truncate=_flag(rp, "truncate", True, where),
  )


def _check_rope_numbers(config) -> None:
  """ValueError unless the RoPE tables the model computes in float32 (inverse frequencies, the YaRN cos/sin and
  softmax scales) are finite and positive: finite JSON numbers can still overflow there (rope_theta 1e40,
  mscale_all_dim -1e308), which would give NaN or degenerate logits."""
  rope = config.rope
  f32 = float(np.finfo(np.float32).max)
  with np.errstate(all="ignore"):
    try:
      inv = rope.inv_freq(config.qk_rope_head_dim)
      scales = (rope.cos_sin_scale, config.softmax_scale)
    except (OverflowError, ValueError, ZeroDivisionError):  # math.log / exp of the YaRN parameters
      inv, scales = np.array([np.nan]), ()
    theta_fits = bool(np.float32(rope.theta) < np.inf)
  if not (
    theta_fits
    and np.isfinite(inv).all()
    and (inv > 0).all()
    and all(math.isfinite(x) and 0 < abs(x) < f32 for x in scales)
  ):
    raise ValueError(
      f"the RoPE parameters (rope_theta={_short(rope.theta)}, rope type {rope.rope_type!r}, factor "
      f"{rope.factor:g}, mscale {rope.mscale!r}, mscale_all_dim {rope.mscale_all_dim!r}, "
      f"attention_factor {rope.attention_factor!r}) overflow float32 or give a zero or non-finite "
      "frequency or scale"
    )


def _layer_list(cfg: dict, key: str, n_layers: int, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
  value = cfg.get(key)
  if value is None:
    return None
  if not isinstance(value, (list, tuple)) or len(value) != n_layers:
    raise ValueError(f"config key {key!r} must be a list of num_hidden_layers={n_layers} entries, got {value!r}")
  bad = [v for v in value if v not in allowed]
  if bad:
    raise ValueError(f"unsupported {key} entry {bad[0]!r} (supported: {allowed})")
  return tuple(value)


def _indexer_types(cfg: dict, model_type: str, n_layers: int) -> tuple[str, ...] | None:
  """Per-layer "full" / "shared" indexer kinds, resolved as transformers 5.24 ``GlmMoeDsaConfig`` does:
  ``indexer_types`` wins, else ``index_topk_pattern`` ("F"/"S" string or list), else layer i is full
  iff ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2 and 1).
  DeepSeek-V3.2 has no sharing: any of these keys asking for a shared layer is refused."""
  keys = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
  if cfg.get("indexer_types") is not None:
    types = _layer_list(cfg, "indexer_types", n_layers, ("full", "shared"))
    source = "indexer_types"
  elif cfg.get("index_topk_pattern") is not None:
    pattern = cfg["index_topk_pattern"]
    if isinstance(pattern, str):
      if any(c not in "FS" for c in pattern):
        raise ValueError(f"unsupported index_topk_pattern {pattern!r} (letters F and S only)")
      pattern = [{"F": "full", "S": "shared"}[c] for c in pattern]
    types = _layer_list({"index_topk_pattern": list(pattern)}, "index_topk_pattern", n_layers, ("full", "shared"))
    source = "index_topk_pattern"
  else:
    freq, offset = cfg.get("index_topk_freq"), cfg.get("index_skip_topk_offset")
    for key, v in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
      if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ValueError(f"config key {key!r} must be an integer, got {v!r}")
    freq = max(1 if freq is None else freq, 1)
    offset = 2 if offset is None else offset
    types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))
    source = "index_topk_freq"
  if all(t == "full" for t in types):
    return None
  if model_type != "glm_moe_dsa":
    raise ValueError(
      f"unsupported {source} with shared indexer layers for model_type {model_type!r} "
      f"(cross-layer top-k sharing is a glm_moe_dsa feature; keys: {keys})"
    )
  if types[0] != "full":
    raise ValueError(f"unsupported {source}: layer 0 is 'shared' but no earlier layer has an indexer")
  return types


def _parse_quantization(cfg: dict) -> tuple[int, int] | None:
  q = cfg.get("quantization_config")
  if q is None:
    return None
  if not isinstance(q, dict):
    raise ValueError(f"quantization_config must be a dict, got {q!r}")
  method = q.get("quant_method")
  if method not in SUPPORTED_QUANT_METHODS:
    raise ValueError(f"unsupported quantization_config.quant_method {method!r} (supported: {SUPPORTED_QUANT_METHODS})")
  block = q.get("weight_block_size")
  if not isinstance(block, list) or tuple(block) not in SUPPORTED_FP8_BLOCK_SIZES:
    raise ValueError(
      f"unsupported quantization_config.weight_block_size {block!r} "
      f"(supported: {[list(b) for b in SUPPORTED_FP8_BLOCK_SIZES]})"
    )
  fmt = q.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise ValueError(f"unsupported quantization_config.fmt {fmt!r} (only 'e4m3')")
  scale_fmt = q.get("scale_fmt")  # DeepSeek-V3.1+/V3.2: power-of-two scales, stored as float32 all the same
  if scale_fmt not in (None, "ue8m0"):
    raise ValueError(f"unsupported quantization_config.scale_fmt {scale_fmt!r} (only 'ue8m0' or absent)")
  scheme = q.get("activation_scheme", "dynamic")
  if scheme != "dynamic":
    raise ValueError(
      f"unsupported quantization_config.activation_scheme {scheme!r} (only 'dynamic': "
      "weights are dequantized at load, activations are not quantized)"
    )
  return tuple(int(b) for b in block)


# Integer config keys and their smallest valid value.
_INTEGER_KEYS = {
  "vocab_size": 1,
  "hidden_size": 1,
  "intermediate_size": 1,
  "moe_intermediate_size": 1,
  "num_hidden_layers": 1,
  "num_attention_heads": 1,
  "num_key_value_heads": 1,
  "q_lora_rank": 1,
  "kv_lora_rank": 1,
  "qk_nope_head_dim": 1,
  "qk_rope_head_dim": 2,
  "v_head_dim": 1,
  "n_routed_experts": 1,
  "n_shared_experts": 0,
  "num_experts_per_tok": 1,
  "n_group": 1,
  "topk_group": 1,
  "first_k_dense_replace": 0,
  "max_position_embeddings": 1,
  "index_n_heads": 1,
  "index_head_dim": 1,
  "index_topk": 1,
}

# Every integer key is a tensor dimension, a count or a position: int32 in the programs (shapes, positions, slot
# and page ids), so nothing above 2**31 - 1 can run.
_INT32_MAX = 2**31 - 1
MAX_LAYERS = 1024
MAX_ROUTED_EXPERTS = 65536


def _finite(value: int | float) -> bool:
  """A finite float64 (an integer too large for one is not: math.isfinite raises OverflowError for it)."""
  try:
    return math.isfinite(value)
  except OverflowError:
    return False


def _short(value) -> str:
  """repr(value), cut to 80 characters (a 400-digit integer in an error message helps no one)."""
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def _number(
  d: dict, key: str, where: str, default: float | None = None, *, positive: bool = False, non_negative: bool = False
) -> float | None:
  """d[key] (default when absent or None) as a finite float; ValueError naming ``where``.``key`` for a bool, a
  non-number, nan / inf, or a value outside the stated range."""
  value = d.get(key)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
    raise ValueError(f"{where} key {key!r} must be a finite number, got {_short(value)}")
  if positive and not value > 0:
    raise ValueError(f"{where} key {key!r} must be > 0, got {value!r}")
  if non_negative and not value >= 0:
    raise ValueError(f"{where} key {key!r} must be >= 0, got {value!r}")
  return float(value)


def _flag(d: dict, key: str, default: bool, where: str = "config") -> bool:
  """d[key] (default when absent or None), which must be a JSON boolean: "no" is not False."""
  value = d.get(key)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"{where} key {key!r} must be true or false, got {value!r}")
  return value


def _token_ids(value, key: str, allow_list: bool):
  """A token id (int >= 0) or, with allow_list, a list of them (as a tuple); None passes."""
  if value is None:
    return None
  if allow_list and isinstance(value, list):
    return tuple(_token_ids(v, key, False) for v in value)
  if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
    raise ValueError(
      f"config key {key!r} must be a token id{' or a list of them' if allow_list else ''}, got {value!r}"
    )
  return value


@dataclasses.dataclass(frozen=True)
class DSAConfig:
  """Hyper-parameters of a DeepSeek-V3.2 (DSA) causal LM.

  Shapes implied (H = hidden_size, nH = num_attention_heads):
    * MLA: q_a_proj H -> q_lora_rank; q_b_proj q_lora_rank -> nH * (qk_nope_head_dim + qk_rope_head_dim);
      kv_a_proj_with_mqa H -> kv_lora_rank + qk_rope_head_dim; kv_b_proj kv_lora_rank ->
      nH * (qk_nope_head_dim + v_head_dim); o_proj nH * v_head_dim -> H.
    * KV-cache latent row: ``latent_dim = kv_lora_rank + qk_rope_head_dim`` values of ``dtype``.
    * Indexer: wq_b q_lora_rank -> index_n_heads * index_head_dim; wk H -> index_head_dim
      (float32 keys of ``index_head_dim`` in the cache); top-k ``index_topk``.
    * MoE: n_routed_experts experts of width moe_intermediate_size, n_shared_experts shared ones
      (one MLP of width moe_intermediate_size * n_shared_experts); layers < first_k_dense_replace
      use a dense MLP of width intermediate_size.
  ``dtype`` is the parameter / activation dtype name ("float32", "bfloat16", "float16").
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_routed_experts: int
  n_shared_experts: int
  num_experts_per_tok: int
  n_group: int
  topk_group: int
  routed_scaling_factor: float
  norm_topk_prob: bool
  first_k_dense_replace: int
  rms_norm_eps: float
  max_position_embeddings: int
  rope: RopeConfig
  index_n_heads: int
  index_head_dim: int
  index_topk: int
  tie_word_embeddings: bool = False
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 1
  dtype: str = "float32"
  hidden_act: str = "silu"
  initializer_range: float = 0.02
  model_type: str = "deepseek_v32"
  # Per-layer MLP kind, "dense" | "sparse" (None: first_k_dense_replace dense layers, then MoE).
  mlp_layer_types: tuple[str, ...] | None = None
  # Per-layer indexer kind, "full" (own indexer) | "shared" (reuses the top-k of the nearest full layer
  # before it; such a layer has no indexer weights).  None: every layer full.
  indexer_types: tuple[str, ...] | None = None
  rope_interleave: bool = True  # MLA rope slice: interleaved pairs (else rotate-half)
  indexer_rope_interleave: bool = False  # indexer rope slice: interleaved pairs (else rotate-half)
  # Eps of q_a_layernorm / kv_a_layernorm: transformers 5.24 builds them with the RMSNorm default
  # 1e-6 for both model types, independent of rms_norm_eps.
  latent_norm_eps: float = 1e-6
  # (rows, cols) of the FP8 weight-quantization block when the checkpoint is FP8 block-quantized.
  fp8_block_size: tuple[int, int] | None = None
  # Multi-token-prediction layers stored after the decoder's (DeepSeek-V3's), not served: the loader skips
  # them without a warning. 0 when absent or not a small non-negative integer.
  num_nextn_predict_layers: int = 0
  # FP8 deployment numerics (models/fp8_numerics.py): not a config.json key; set by the
  # runtime (--fp8-numerics) through load_hf / load_model.
  fp8_numerics: bool = False
  # How the KV cache stores a token (models/kv_format.py): "auto" (as computed) or "fp8_e4m3" (which
  # implies the FP8 numerics: fp8_active); not a config.json key; set by the runtime (--kv-cache-dtype)
  # through load_hf / load_model.
  kv_cache_dtype: str = "auto"

  def __post_init__(self):
    from .kv_format import check_kv_cache_dtype

    check_kv_cache_dtype(self.kv_cache_dtype)  # ValueError naming the choices

  # ------------------------------------------------------------------ derived
  @property
  def latent_dim(self) -> int:
    """W: width of one KV-cache latent row = kv_lora_rank + qk_rope_head_dim."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def fp8_active(self) -> bool:
    """Whether the indexer and the latent KV run DeepSeek's FP8 numerics: ``fp8_numerics`` (simulated in the
    compute dtype), or an FP8 KV cache (``kv_cache_dtype`` "fp8_e4m3", which stores those values)."""
    return self.fp8_numerics or self.kv_cache_dtype != "auto"

  def fp8_indexer_error(self) -> str | None:
    """Why this config cannot run the FP8 numerics it asks for (``fp8_active``), or None: DeepSeek's FP8
    indexer rotates its queries and keys by a Hadamard transform, which needs a power-of-two index_head_dim."""
    if self.fp8_active and self.index_head_dim & (self.index_head_dim - 1):
      return (
        "--fp8-numerics / --kv-cache-dtype fp8_e4m3: DeepSeek's FP8 indexer rotates its queries and keys "
        f"by a Hadamard transform, which needs a power-of-two index_head_dim; this model has "
        f"{self.index_head_dim}"
      )
    return None

  def kv_index_row(self) -> tuple[int, np.dtype]:
    """(width, storage dtype) of one stored indexer key: (index_head_dim, float32), or (132, uint8) for
    Di 128 with kv_cache_dtype "fp8_e4m3" (``models.kv_format.index_spec``)."""
    from .kv_format import index_spec

    return index_spec(self.kv_cache_dtype, self.index_head_dim)

  def kv_row(self, dtype=None) -> tuple[int, np.dtype]:
    """(width, storage dtype) of one stored KV-cache latent row for compute ``dtype`` (default the config's):
    (latent_dim, dtype) with kv_cache_dtype "auto", (656, uint8) for DeepSeek-V3.2 in bfloat16 with
    "fp8_e4m3" (``models.kv_format.row_spec``)."""
    from .kv_format import row_spec

    return row_spec(self.kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim, dtype or self.dtype)

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """MLA attention scale (includes the YaRN mscale**2 correction)."""
    return self.rope.softmax_scale(self.qk_head_dim)

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """EOS ids as a tuple (empty if none)."""
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, tuple):
      return self.eos_token_id
    return (int(self.eos_token_id),)

  def is_moe_layer(self, layer: int) -> bool:
    if self.mlp_layer_types is not None:
      return self.mlp_layer_types[layer] == "sparse"
    return layer >= self.first_k_dense_replace

  def has_indexer(self, layer: int) -> bool:
    """True when ``layer`` runs its own indexer (False: it reuses an earlier layer's top-k)."""
    return self.indexer_types is None or self.indexer_types[layer] == "full"

  def topk_source(self, layer: int) -> int:
    """The layer whose indexer picks ``layer``'s top-k (itself, or the nearest full layer before it)."""
    while not self.has_indexer(layer):
      layer -= 1
    return layer

  # ------------------------------------------------------------ constructors
  @classmethod
  def from_hf_config(cls, cfg: dict) -> "DSAConfig":
    """Build from a parsed HF config.json dict. Raises ValueError on unsupported model_type /
    architecture / activation / rope type or a missing required key (the message names it)."""
    if not isinstance(cfg, dict):
      raise ValueError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    archs = cfg.get("architectures")
    if archs is not None:
      if not isinstance(archs, list):
        raise ValueError(f"config key 'architectures' must be a list of class names, got {archs!r}")
      bad = [a for a in archs if a != ARCHITECTURE_OF[model_type]]
      if bad:
        raise ValueError(
          f"unsupported architecture {bad[0]!r} for model_type {model_type!r} "
          f"(supported: {ARCHITECTURE_OF[model_type]!r})"
        )
    for key in _REQUIRED_KEYS:
      if key not in cfg:
        raise ValueError(f"config is missing required key {key!r}")
      if cfg[key] is None:
        raise ValueError(f"config key {key!r} is None (unsupported; it must be an integer)")
    for key, minimum in _INTEGER_KEYS.items():  # no silent truncation of 2.5 -> 2, True -> 1
      value = cfg.get(key)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config key {key!r} must be an integer, got {value!r}")
      if not minimum <= value <= _INT32_MAX:
        raise ValueError(f"config key {key!r} must be in [{minimum}, {_INT32_MAX}], got {value}")

    defaults = {**_DEFAULTS, **_MODEL_DEFAULTS.get(model_type, {})}

    def get(key: str) -> Any:
      value = cfg.get(key)
      return defaults[key] if value is None else value

    n_layers = int(cfg["num_hidden_layers"])
    # Per-layer and per-expert tables are built from these before any weight is read: bounded here (far
    # past DeepSeek-V3.2's 61 layers and 256 experts; a larger model needs these limits raised).
    for key, limit in (("num_hidden_layers", MAX_LAYERS), ("n_routed_experts", MAX_ROUTED_EXPERTS)):
      if cfg[key] > limit:
        raise ValueError(f"config key {key!r} is {cfg[key]}; at most {limit} are supported")
    if _flag(cfg, "attention_bias", False):
      raise ValueError("unsupported attention_bias=True (MLA projections without bias only)")
    want_mla, want_idx = _ROPE_LAYOUT[model_type]
    for key, want in (("rope_interleave", want_mla), ("indexer_rope_interleave", want_idx)):
      if _flag(cfg, key, want) != want:
        raise ValueError(
          f"unsupported {key}={cfg[key]!r} for model_type {model_type!r} (transformers 5.24 always uses {want})"
        )
    mlp_layer_types = _layer_list(cfg, "mlp_layer_types", n_layers, ("dense", "sparse"))
    indexer_types = _indexer_types(cfg, model_type, n_layers)
    fp8_block = _parse_quantization(cfg)

    # DeepSeek's own config.json names its routing; transformers ignores these keys and always routes this way.
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
      if cfg.get(key) is not None and cfg[key] != want:
        raise ValueError(
          f"unsupported {key}={cfg[key]!r} (only {want!r}: DeepSeek-V3's sigmoid routing with "
          "the bias-corrected group top-k, every layer past first_k_dense_replace MoE)"
        )
    hidden_act = get("hidden_act")
    if hidden_act != "silu":
      raise ValueError(f"unsupported hidden_act {hidden_act!r} (only 'silu')")
    for key in ("dtype", "torch_dtype"):
      if cfg.get(key) is not None and not isinstance(cfg[key], str):
        raise ValueError(f'config key {key!r} must be a dtype name such as "bfloat16", got {_short(cfg[key])}')
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if str(dtype_name) not in _DTYPES:
      raise ValueError(f"unsupported dtype {dtype_name!r}")
    max_pos = int(get("max_position_embeddings"))
    eos = _token_ids(cfg.get("eos_token_id", _DEFAULTS["eos_token_id"]), "eos_token_id", True)
    bos = _token_ids(cfg.get("bos_token_id", _DEFAULTS["bos_token_id"]), "bos_token_id", False)
    for key, ids in (("eos_token_id", eos if isinstance(eos, tuple) else (eos,)), ("bos_token_id", (bos,))):
      if any(t is not None and t >= cfg["vocab_size"] for t in ids):
        raise ValueError(
          f"config key {key!r}: token id {max(t for t in ids if t is not None)} is outside "
          f"the vocabulary [0, {cfg['vocab_size']})"
        )
    n_experts = int(cfg["n_routed_experts"])
    n_group = int(get("n_group"))
    if n_experts % n_group:
      raise ValueError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
    # Routing (DeepSeek-V3 group-limited routing): the best topk_group of n_group groups, then the best
    # num_experts_per_tok experts among those groups' experts.
    topk_group, per_tok = int(get("topk_group")), int(cfg["num_experts_per_tok"])
    if topk_group > n_group:
      raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group} (groups chosen per token)")
    if per_tok > topk_group * (n_experts // n_group):
      raise ValueError(
        f"num_experts_per_tok={per_tok} must be <= the {topk_group * (n_experts // n_group)} "
        f"experts of topk_group={topk_group} groups of n_routed_experts={n_experts} / "
        f"n_group={n_group}"
      )
    if int(cfg["index_topk"]) > max_pos:
      raise ValueError(
        f"index_topk={cfg['index_topk']} must be <= max_position_embeddings={max_pos} (the "
        "indexer picks that many past positions)"
      )
    if int(cfg["index_head_dim"]) < int(cfg["qk_rope_head_dim"]):
      raise ValueError("index_head_dim must be >= qk_rope_head_dim")
    if int(cfg["qk_rope_head_dim"]) % 2:  # RoPE rotates pairs of dimensions (RoFormer, Su et al. 2021)
      raise ValueError(
        f"config key 'qk_rope_head_dim' must be even (RoPE rotates pairs of dimensions), got {cfg['qk_rope_head_dim']}"
      )
    nkv = cfg.get("num_key_value_heads")
    if nkv is not None and int(nkv) != int(cfg["num_attention_heads"]):
      raise ValueError("num_key_value_heads != num_attention_heads is not supported for MLA")
    nextn = cfg.get("num_nextn_predict_layers", 0)  # (only tells the loader which layers to skip quietly)
    nextn = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and 0 <= nextn <= 64 else 0
    config = cls(
      vocab_size=int(cfg["vocab_size"]),
      hidden_size=int(cfg["hidden_size"]),
      intermediate_size=int(cfg["intermediate_size"]),
      moe_intermediate_size=int(cfg["moe_intermediate_size"]),
      num_hidden_layers=int(cfg["num_hidden_layers"]),
      num_attention_heads=int(cfg["num_attention_heads"]),
      q_lora_rank=int(cfg["q_lora_rank"]),
      kv_lora_rank=int(cfg["kv_lora_rank"]),
      qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
      qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
      v_head_dim=int(cfg["v_head_dim"]),
      n_routed_experts=n_experts,
      n_shared_experts=int(get("n_shared_experts")),
      num_experts_per_tok=per_tok,
      n_group=n_group,
      topk_group=topk_group,
      routed_scaling_factor=_number(
        cfg, "routed_scaling_factor", "config", defaults["routed_scaling_factor"], positive=True
      ),
      norm_topk_prob=_flag(cfg, "norm_topk_prob", defaults["norm_topk_prob"]),
      first_k_dense_replace=int(get("first_k_dense_replace")),
      rms_norm_eps=_number(cfg, "rms_norm_eps", "config", defaults["rms_norm_eps"], non_negative=True),
      max_position_embeddings=max_pos,
      rope=_parse_rope(cfg, max_pos),
      index_n_heads=int(cfg["index_n_heads"]),
      index_head_dim=int(cfg["index_head_dim"]),
      index_topk=int(cfg["index_topk"]),
      tie_word_embeddings=_flag(cfg, "tie_word_embeddings", defaults["tie_word_embeddings"]),
      bos_token_id=bos,
      eos_token_id=eos,
      dtype=_DTYPES[str(dtype_name)],
      hidden_act=hidden_act,
      initializer_range=_number(cfg, "initializer_range", "config", defaults["initializer_range"]),
      model_type=model_type,
      mlp_layer_types=mlp_layer_types,
      indexer_types=indexer_types,
      rope_interleave=want_mla,
      indexer_rope_interleave=want_idx,
      fp8_block_size=fp8_block,
      num_nextn_predict_layers=nextn,
    )
    _check_rope_numbers(config)
    return config

  @classmethod
  def from_pretrained(cls, model_dir: str | os.PathLike) -> "DSAConfig":
    """Read ``<model_dir>/config.json`` and build the config."""
    from .from_torch import MAX_CONFIG_BYTES, read_json  # a regular file of bounded size (not a FIFO)

    return cls.from_hf_config(read_json(os.path.join(os.fspath(model_dir), "config.json"), MAX_CONFIG_BYTES))

  def replace(self, **changes) -> "DSAConfig":
    return dataclasses.replace(self, **changes)
