"""Load HuggingFace-format DSA checkpoints (DeepSeek-V3.2, GLM-5 / GLM-5.1) into the JAX model.

Only ``safetensors`` (numpy) is used; no torch.  Weights come from ``model.safetensors`` or from the
shards listed in ``model.safetensors.index.json``.

The HF -> parameter mapping lives in :func:`hf_param_table` (kept apart from the modules).  Both model
types use the same key names (transformers 5.24 maps both through the same weight conversion); GLM
layers whose indexer is "shared" (``indexer_types``) have no ``self_attn.indexer.*`` tensors.  Routed
experts are accepted in both layouts:

* per-expert keys, which is what transformers 5.24 ``save_pretrained`` writes (it converts its fused
  in-memory ``experts.gate_up_proj`` back) and what DeepSeek's / GLM's own checkpoints use:
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``;
* fused keys (transformers' in-memory layout): ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows
  first) and ``mlp.experts.down_proj`` [E, H, I].

Keys of layer index ``num_hidden_layers`` and above (multi-token-prediction layers) are ignored, as are
other unknown keys.

FP8 block-quantized checkpoints (``quantization_config.quant_method == "fp8"``, 128x128 blocks): every
tensor ``X`` that has an ``X_scale_inv`` companion is float8_e4m3fn and is dequantized at load
(:func:`models.fp8.dequantize_block_fp8`) and then cast to the parameter dtype; other tensors load as
they are.

Loading streams: tensors are read one at a time from the memory-mapped files, converted, and put into
the model before the next one is read, so host memory peaks near the converted parameters (plus one
parameter's worth of temporaries), never at a second full copy of the checkpoint.  A tqdm progress bar
counts parameters and bytes read (``progress=None``: shown only when stderr is a TTY).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from . import fp8
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


def param_path(path) -> str:
    """'layers/3/self_attn/q_b_proj/kernel' from a parameter path: a tuple of names / indices (``hf_param_table``)
    or a pytree key path of an ``nnx.State`` (a trailing ``.value`` of a Variable dropped)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


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
        if cfg.has_indexer(i):  # GLM "shared" layers have no indexer weights
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


# safetensors dtypes that safetensors' numpy backend cannot return (it looks for them on the numpy
# module); they are read through a memory map of the file instead.
_MMAP_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
                "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu)}  # power-of-two block scales


class _TensorStore:
    """Lazy name -> numpy array access over one or several safetensors files.

    Files are opened with ``safe_open`` (memory-mapped) and tensors are read one at a time.  A tensor
    with a ``*_scale_inv`` companion is FP8 block-quantized and comes back dequantized to float32
    (``fp8_block_size`` must then be set, i.e. the config must declare ``quantization_config``).
    """

    def __init__(self, model_dir: str, fp8_block_size: tuple[int, int] | None = None):
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
        self._headers: dict[str, tuple[int, dict]] = {}
        self._maps: dict[str, np.memmap] = {}
        self.fp8_block_size = fp8_block_size
        self.bytes_read = 0
        if fp8_block_size is None:
            scaled = next((k for k in self._where if k.endswith(fp8.SCALE_SUFFIX)), None)
            if scaled is not None:
                raise ValueError(f"checkpoint holds FP8 block scales ({scaled!r}) but config.json has no "
                                 "quantization_config")

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self):
        return self._where.keys()

    def _handle(self, fn: str):
        if fn not in self._handles:
            self._handles[fn] = safe_open(fn, framework="numpy")
        return self._handles[fn]

    def _mmap_tensor(self, fn: str, key: str) -> np.ndarray:
        """Read-only view of ``key`` straight from a memory map of the file (safetensors layout:
        u64 little-endian header length, JSON header with data_offsets relative to the data start)."""
        if fn not in self._headers:
            with open(fn, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._headers[fn] = (8 + n, json.loads(f.read(n)))
            self._maps[fn] = np.memmap(fn, dtype=np.uint8, mode="r")
        start, header = self._headers[fn]
        info = header[key]
        dt = _MMAP_DTYPES[info["dtype"]]
        b0, b1 = info["data_offsets"]
        return self._maps[fn][start + b0 : start + b1].view(dt).reshape(info["shape"])

    def _raw(self, key: str) -> np.ndarray:
        fn = self._where[key]
        h = self._handle(fn)
        if h.get_slice(key).get_dtype() in _MMAP_DTYPES:
            arr = self._mmap_tensor(fn, key)
        else:
            arr = h.get_tensor(key)
        self.bytes_read += arr.nbytes
        return arr

    def is_fp8(self, key: str) -> bool:
        """Whether ``key`` is stored FP8 block-quantized (it has block scales)."""
        return fp8.scale_key(key) in self._where

    def get_fp8(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(float8_e4m3fn weight, float32 block scales) of an FP8 tensor, checked as ``dequantize_block_fp8``
        checks them (ValueError naming the tensor)."""
        w, s = self._raw(key), self._raw(fp8.scale_key(key))
        if not fp8.is_fp8(w):
            raise ValueError(f"tensor {key!r} has block scales but dtype {w.dtype} (expected float8_e4m3fn)")
        if s.dtype not in fp8.SCALE_DTYPES:
            raise ValueError(f"scales {fp8.scale_key(key)!r} have dtype {s.dtype}; expected one of "
                             f"{', '.join(str(d) for d in fp8.SCALE_DTYPES)}")
        want = fp8.scale_shape(w.shape, self.fp8_block_size)
        if tuple(s.shape) != want:
            raise ValueError(f"scales {fp8.scale_key(key)!r} have shape {tuple(s.shape)}, expected {want}")
        return w, s.astype(np.float32)

    def get(self, key: str) -> np.ndarray:
        """The tensor ``key`` (dequantized to float32 when it is FP8 with block scales)."""
        skey = fp8.scale_key(key)
        if skey in self._where:
            if self.fp8_block_size is None:  # pragma: no cover - refused in __init__
                raise ValueError(f"{skey!r} present but config.json has no quantization_config")
            return fp8.dequantize_block_fp8(self._raw(key), self._raw(skey), self.fp8_block_size, name=key)
        arr = self._raw(key)
        if arr.dtype in _MMAP_DTYPES.values():
            raise ValueError(f"tensor {key!r} is {arr.dtype} but has no {skey!r} block scales")
        return arr


def _make_fp8_resident(model, path: tuple, dtype, block: tuple[int, int]) -> tuple:
    """Turns the (abstract) parameter at ``path`` into an FP8-resident one: float8_e4m3fn storage plus float32
    block scales (a Linear's ``kernel_scale``, a MoE's ``<stack>_scale``); returns the scales' path."""
    *parents, name = path
    module = model
    for p in parents:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    shape = getattr(module, name).get_value().shape
    scale_shape = fp8.scale_shape(shape, block)  # (the config admits only 128 x 128 blocks: dequantize_jax's)
    setattr(module, name, nnx.Param(jax.ShapeDtypeStruct(shape, ml_dtypes.float8_e4m3fn)))
    if name == "kernel":  # a Linear
        module.kernel_scale = nnx.Param(jax.ShapeDtypeStruct(scale_shape, jnp.float32))
        module.compute_dtype = jnp.dtype(dtype)
        return (*parents, "kernel_scale")
    setattr(module, f"{name}_scale", nnx.Param(jax.ShapeDtypeStruct(scale_shape, jnp.float32)))
    module.expert_compute_dtype = jnp.dtype(dtype)
    return (*parents, f"{name}_scale")


def _is_fp32_param(path: tuple) -> bool:
    names = tuple(p for p in path if isinstance(p, str))
    return any(names[-len(s):] == s for s in _FP32_SUFFIXES)


def _progress_bar(enabled: bool | None, total: int, desc: str):
    from tqdm.auto import tqdm  # noqa: PLC0415

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="param", disable=not enabled, leave=True, dynamic_ncols=True)


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
log = logging.getLogger(__name__)


def _log_skipped_mtp(store, num_layers: int) -> None:
    """One log line naming the multi-token-prediction layers (index >= num_hidden_layers) left out."""
    skipped = sorted({int(m.group(1)) for k in store.keys() if (m := _LAYER_KEY.match(k))
                      and int(m.group(1)) >= num_layers})
    if skipped:
        log.info("skipping the multi-token-prediction layer(s) %s: not used for decoding", skipped)


def load_hf(
    model_dir: str | os.PathLike, dtype=None, *, progress: bool | None = None, fp8_numerics: bool = False,
    sharding=None, fp8_weights: bool = False,
) -> tuple[DSAConfig, DeepseekV32ForCausalLM]:
    """Load ``model_dir`` (HF layout) -> (config, model).

    dtype: parameter dtype (default: the config's ``dtype``).  Router weight/bias and the indexer's
    weights_proj are always float32.  FP8 block-quantized weights are dequantized to ``dtype``.
    progress: tqdm progress bar over the parameters with the bytes read so far in the postfix
    (None: only when stderr is a TTY; False: never).
    fp8_numerics: run the indexer and the latent KV with DeepSeek's FP8 deployment numerics
    (models/fp8_numerics.py).
    Tensors are streamed: each is read from the memory-mapped safetensors file, converted and placed
    into the model before the next is read.  sharding: a function (parameter path 'layers/3/mlp/gate_proj',
    ndim) -> jax.sharding.Sharding placing each parameter as it is read (e.g. the mesh rule table:
    each device receives only its slice, no device ever holds the whole model); None: the default device.
    fp8_weights: keep the FP8 checkpoint's block-quantized matrices in float8_e4m3fn with float32 block scales
    (``Linear.kernel_scale``, ``MoE.*_proj_scale``), dequantized inside the jitted matmuls: half the weight
    memory of bfloat16, and exactly the weights dequantize-at-load gives (``models.fp8.dequantize_jax``).
    Raises ValueError for an unsupported config, a missing tensor (the message names the missing HF key),
    a tensor of the wrong shape, or fp8_weights for a checkpoint that is not FP8 block-quantized (or keeps its
    experts fused).
    """
    model_dir = os.fspath(model_dir)
    cfg = DSAConfig.from_pretrained(model_dir)
    dt = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    cfg = cfg.replace(dtype=dt.name, fp8_numerics=fp8_numerics)
    store = _TensorStore(model_dir, cfg.fp8_block_size)
    _log_skipped_mtp(store, cfg.num_hidden_layers)

    if fp8_weights and cfg.fp8_block_size is None:
        raise ValueError(f"checkpoint {model_dir} is not FP8 block-quantized (no quantization_config): "
                         "FP8-resident weights need one")

    abstract = nnx.eval_shape(lambda: DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt))
    table = hf_param_table(cfg)
    # Resolve every parameter's keys first, so a missing tensor fails before any loading work.
    plan = []
    for spec in table:
        groups = ((spec.hf_keys, spec.build),) + spec.alternatives
        chosen = next((g for g in groups if all(k in store for k in g[0])), None)
        if chosen is None:
            missing = next(k for k in spec.hf_keys if k not in store)
            raise ValueError(f"checkpoint {model_dir} is missing tensor {missing!r}")
        quantized = fp8_weights and all(store.is_fp8(k) for k in chosen[0])
        if quantized and chosen[0] != spec.hf_keys:
            raise ValueError(f"FP8-resident weights: {chosen[0][0]!r} keeps its experts fused; only per-expert "
                             "FP8 tensors are supported")
        plan.append((spec.path, chosen, _make_fp8_resident(abstract, spec.path, dt, cfg.fp8_block_size) if quantized else None))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    for path, _, scale_path in plan:
        if path not in flat or (scale_path is not None and scale_path not in flat):
            raise KeyError(f"internal: no model parameter at {path}")
    covered = {path for path, _, _ in plan} | {sp for _, _, sp in plan if sp is not None}
    missing_params = sorted(set(flat) - covered, key=str)
    if missing_params:
        raise KeyError(f"internal: parameters without a checkpoint mapping: {missing_params}")

    with _progress_bar(progress, len(plan), f"loading {os.path.basename(model_dir.rstrip(os.sep))}") as bar:
        def place(path, value, target):
            placed = (jnp.asarray(value) if sharding is None else
                      jax.device_put(value, sharding(param_path(path), value.ndim)))
            flat[path].set_value(placed.astype(target))

        for path, (keys, build), scale_path in plan:
            if scale_path is None:
                value, scale = build(*[store.get(k) for k in keys]), None
            else:  # FP8-resident: the e4m3 weight and its scales, laid out as the parameter (same build)
                pairs = [store.get_fp8(k) for k in keys]
                value, scale = build(*[w for w, _ in pairs]), build(*[s for _, s in pairs])
            want = flat[path].get_value()
            if tuple(value.shape) != tuple(want.shape):
                raise ValueError(
                    f"tensor for {keys[0]!r} has shape {tuple(value.shape)}, expected {tuple(want.shape)}"
                )
            if scale is None:
                place(path, value, _F32 if _is_fp32_param(path) else dt)
            else:
                place(path, value, want.dtype)
                place(scale_path, scale, _F32)
            del value, scale
            bar.update(1)
            bar.set_postfix_str(f"{store.bytes_read / 2**20:.1f} MiB read", refresh=False)
    state = nnx.from_flat_state(flat)
    return cfg, nnx.merge(graphdef, state)
