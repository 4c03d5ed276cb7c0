"""Load HuggingFace-format DeepSeek-V3.2 checkpoints (config.json + safetensors) into the JAX model.

Only ``safetensors`` (numpy) is used; no torch.  Weights come from ``model.safetensors`` or from the
shards listed in ``model.safetensors.index.json``.

The HF -> parameter mapping lives in :func:`hf_param_table` (kept apart from the modules).  Routed
experts are accepted in both layouts:

* per-expert keys, which is what transformers 5.24 ``save_pretrained`` writes (it converts its fused
  in-memory ``experts.gate_up_proj`` back) and what DeepSeek's own checkpoints use:
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``;
* fused keys (transformers' in-memory layout): ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows
  first) and ``mlp.experts.down_proj`` [E, H, I].

Keys of layer index ``num_hidden_layers`` (DeepSeek's multi-token-prediction layer) are ignored, as are
other unknown keys.  FP8 checkpoints (``weight_scale_inv``) are not supported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from .config import DSAConfig
from .deepseek_v32 import DeepseekV32ForCausalLM

_F32 = jnp.float32

# Parameters that stay float32 whatever the model dtype (transformers' _keep_in_fp32_modules).
_FP32_SUFFIXES = (("mlp", "gate_kernel"), ("mlp", "e_score_correction_bias"), ("indexer", "weights_proj", "kernel"))


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One model parameter: its path in the NNX state, and how to build it from HF tensors.

    ``hf_keys``: the HF tensor names it is built from (tried as one group); ``build`` maps the loaded
    numpy arrays (same order) to the parameter value.  ``alternatives``: other key groups that can
    provide the same parameter (e.g. fused vs per-expert expert weights).
    """

    path: tuple
    hf_keys: tuple[str, ...]
    build: Callable[..., np.ndarray]
    alternatives: tuple[tuple[tuple[str, ...], Callable[..., np.ndarray]], ...] = ()


def _t(w: np.ndarray) -> np.ndarray:  # HF Linear [out, in] -> kernel [in, out]
    return np.ascontiguousarray(w.T)


def _id(w: np.ndarray) -> np.ndarray:
    return w


def hf_param_table(cfg: DSAConfig) -> list[ParamSpec]:
    """The HF key -> NNX parameter mapping for ``cfg``."""
    specs: list[ParamSpec] = [ParamSpec(("embed_tokens",), ("model.embed_tokens.weight",), _id)]
    specs.append(ParamSpec(("norm", "weight"), ("model.norm.weight",), _id))
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head", "kernel"), ("lm_head.weight",), _t))
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)

        def lin(path, key):
            specs.append(ParamSpec(L + path + ("kernel",), (p + key + ".weight",), _t))

        def vec(path, key):
            specs.append(ParamSpec(L + path, (p + key,), _id))

        vec(("input_layernorm", "weight"), "input_layernorm.weight")
        vec(("post_attention_layernorm", "weight"), "post_attention_layernorm.weight")
        a = ("self_attn",)
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            lin(a + (name,), f"self_attn.{name}")
        vec(a + ("q_a_layernorm", "weight"), "self_attn.q_a_layernorm.weight")
        vec(a + ("kv_a_layernorm", "weight"), "self_attn.kv_a_layernorm.weight")
        ix = a + ("indexer",)
        for name in ("wq_b", "wk", "weights_proj"):
            lin(ix + (name,), f"self_attn.indexer.{name}")
        vec(ix + ("k_norm", "weight"), "self_attn.indexer.k_norm.weight")
        vec(ix + ("k_norm", "bias"), "self_attn.indexer.k_norm.bias")
        if cfg.is_moe_layer(i):
            m = ("mlp",)
            specs.append(ParamSpec(L + m + ("gate_kernel",), (p + "mlp.gate.weight",), _t))
            vec(m + ("e_score_correction_bias",), "mlp.gate.e_score_correction_bias")
            for name in ("gate_proj", "up_proj", "down_proj"):
                lin(m + ("shared_experts", name), f"mlp.shared_experts.{name}")
            per = lambda proj: tuple(f"{p}mlp.experts.{e}.{proj}.weight" for e in range(E))  # noqa: E731
            stack_t = lambda *ws: np.stack([w.T for w in ws])  # noqa: E731
            fused_gu, fused_d = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
            specs.append(
                ParamSpec(L + m + ("gate_proj",), per("gate_proj"), stack_t,
                          (((fused_gu,), lambda w: np.ascontiguousarray(np.swapaxes(w[:, :I, :], 1, 2))),))
            )
            specs.append(
                ParamSpec(L + m + ("up_proj",), per("up_proj"), stack_t,
                          (((fused_gu,), lambda w: np.ascontiguousarray(np.swapaxes(w[:, I:, :], 1, 2))),))
            )
            specs.append(
                ParamSpec(L + m + ("down_proj",), per("down_proj"), stack_t,
                          (((fused_d,), lambda w: np.ascontiguousarray(np.swapaxes(w, 1, 2))),))
            )
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                lin(("mlp", name), f"mlp.{name}")
    return specs


class _TensorStore:
    """Lazy name -> numpy array access over one or several safetensors files."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        self._where: dict[str, str] = {}
        if os.path.exists(index):
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            for k, fname in wm.items():
                self._where[k] = os.path.join(model_dir, fname)
        else:
            files = [single] if os.path.exists(single) else sorted(
                os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")
            )
            if not files:
                raise ValueError(f"no *.safetensors weights found in {model_dir}")
            for fn in files:
                with safe_open(fn, framework="numpy") as f:
                    for k in f.keys():
                        self._where[k] = fn
        self._handles: dict[str, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self):
        return self._where.keys()

    def get(self, key: str) -> np.ndarray:
        fn = self._where[key]
        if fn not in self._handles:
            self._handles[fn] = safe_open(fn, framework="numpy")
        return self._handles[fn].get_tensor(key)


def _is_fp32_param(path: tuple) -> bool:
    names = tuple(p for p in path if isinstance(p, str))
    return any(names[-len(s):] == s for s in _FP32_SUFFIXES)


def load_hf(model_dir: str | os.PathLike, dtype=None) -> tuple[DSAConfig, DeepseekV32ForCausalLM]:
    """Load ``model_dir`` (HF layout) -> (config, model).

    dtype: parameter dtype (default: the config's ``dtype``).  Router weight/bias and the indexer's
    weights_proj are always float32.  Raises ValueError for an unsupported config or a missing tensor
    (the message names the missing HF key).
    """
    model_dir = os.fspath(model_dir)
    cfg = DSAConfig.from_pretrained(model_dir)
    dt = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    cfg = cfg.replace(dtype=dt.name)
    store = _TensorStore(model_dir)

    abstract = nnx.eval_shape(lambda: DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))

    filled: dict[tuple, np.ndarray] = {}
    for spec in hf_param_table(cfg):
        groups = ((spec.hf_keys, spec.build),) + spec.alternatives
        chosen = next((g for g in groups if all(k in store for k in g[0])), None)
        if chosen is None:
            missing = next(k for k in spec.hf_keys if k not in store)
            raise ValueError(f"checkpoint {model_dir} is missing tensor {missing!r}")
        keys, build = chosen
        value = build(*[store.get(k) for k in keys])
        if spec.path not in flat:
            raise KeyError(f"internal: no model parameter at {spec.path}")
        want = flat[spec.path].get_value()
        if tuple(value.shape) != tuple(want.shape):
            raise ValueError(
                f"tensor for {keys[0]!r} has shape {tuple(value.shape)}, expected {tuple(want.shape)}"
            )
        filled[spec.path] = value
    missing_params = [p for p in flat if p not in filled]
    if missing_params:
        raise KeyError(f"internal: parameters without a checkpoint mapping: {missing_params}")

    for path, var in flat.items():
        target = _F32 if _is_fp32_param(path) else dt
        var.set_value(jnp.asarray(filled[path]).astype(target))
    state = nnx.from_flat_state(flat)
    return cfg, nnx.merge(graphdef, state)

