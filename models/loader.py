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

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from . import fp8
from .config import DSAConfig
from .deepseek_v32 import DeepseekV32ForCausalLM
from .kv_format import check_kv_cache_dtype

_F32 = jnp.float32

# Parameters that stay float32 whatever the model dtype (transformers' _keep_in_fp32_modules).
_FP32_SUFFIXES = (("mlp", "gate_kernel"), ("mlp", "e_score_correction_bias"), ("indexer", "weights_proj", "kernel"))


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a parameter is cut out of its HF tensors, so that any slice of it can be read from the matching
  slices of the tensors (sharded loading reads only a device's slice).

  parameter = [stack over the keys, when ``stacked``] transpose(part of source, perm): axis a of the
  parameter (after the stack axis) is axis ``perm[a]`` of the source (None: the same axes); ``split =
  (axis, parts, which)``: the source's ``axis`` holds ``parts`` equal pieces and this parameter is piece
  ``which`` (the gate and up halves of a fused gate_up tensor).
  """

  perm: tuple[int, ...] | None = None
  stacked: bool = False
  split: tuple[int, int, int] | None = None

  def _perm(self, ndim: int) -> tuple[int, ...]:
    return self.perm or tuple(range(ndim))

  def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape each source tensor must have for a parameter of ``shape``."""
    inner = shape[1:] if self.stacked else shape
    perm = self._perm(len(inner))
    src = [0] * len(inner)
    for a, axis in enumerate(perm):
      src[axis] = inner[a]
    if self.split is not None:
      src[self.split[0]] *= self.split[1]
    return tuple(src)

  def source_slices(self, index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The source slices (of each key) holding the slice ``index`` of a parameter of ``shape`` (stack axis
    excluded from both; explicit start and stop on every axis)."""
    inner = shape[1:] if self.stacked else shape
    perm = self._perm(len(index))
    src = [slice(None)] * len(perm)
    for a, axis in enumerate(perm):
      offset = 0
      if self.split is not None and self.split[0] == axis:
        offset = self.split[2] * inner[a]
      src[axis] = slice(index[a].start + offset, index[a].stop + offset)
    return tuple(src)

  def assemble(self, pieces: list[np.ndarray]) -> np.ndarray:
    """The parameter slice from the source slices read (one per key of the stack)."""
    perm = self.perm
    parts = [
      np.ascontiguousarray(x.transpose(perm)) if perm and tuple(perm) != tuple(range(x.ndim)) else x for x in pieces
    ]
    return np.stack(parts) if self.stacked else parts[0]


_ID = Layout()
_T = Layout(perm=(1, 0))  # HF Linear [out, in] -> kernel [in, out]
_STACK_T = Layout(perm=(1, 0), stacked=True)  # per-expert Linears -> [E, in, out]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """One model parameter: its path in the NNX state, and how to build it from HF tensors.

  ``hf_keys``: the HF tensor names it is built from (tried as one group); ``layout``: how it is cut out of
  them (``Layout``).  ``alternatives``: other (keys, layout) groups that can provide the same parameter
  (fused vs per-expert expert weights).
  """

  path: tuple
  hf_keys: tuple[str, ...]
  layout: Layout
  alternatives: tuple[tuple[tuple[str, ...], Layout], ...] = ()


def param_path(path) -> str:
  """'layers/3/self_attn/q_b_proj/kernel' from a parameter path: a tuple of names / indices (``hf_param_table``)
  or a pytree key path of an ``nnx.State`` (a trailing ``.value`` of a Variable dropped)."""
  parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
  if parts and parts[-1] == "value":
    parts.pop()
  return "/".join(parts)


def hf_param_table(cfg: DSAConfig) -> list[ParamSpec]:
  """The HF key -> NNX parameter mapping for ``cfg``."""
  specs: list[ParamSpec] = [ParamSpec(("embed_tokens",), ("model.embed_tokens.weight",), _ID)]
  specs.append(ParamSpec(("norm", "weight"), ("model.norm.weight",), _ID))
  if not cfg.tie_word_embeddings:
    specs.append(ParamSpec(("lm_head", "weight"), ("lm_head.weight",), _ID))
  E = cfg.n_routed_experts
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    L = ("layers", i)

    def lin(path, key):
      specs.append(ParamSpec(L + path + ("kernel",), (p + key + ".weight",), _T))

    def vec(path, key):
      specs.append(ParamSpec(L + path, (p + key,), _ID))

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
      specs.append(ParamSpec(L + m + ("gate_kernel",), (p + "mlp.gate.weight",), _T))
      vec(m + ("e_score_correction_bias",), "mlp.gate.e_score_correction_bias")
      for name in ("gate_proj", "up_proj", "down_proj"):
        lin(m + ("shared_experts", name), f"mlp.shared_experts.{name}")
      per = lambda proj: tuple(f"{p}mlp.experts.{e}.{proj}.weight" for e in range(E))  # noqa: E731
      fused_gu, fused_d = p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
      # Fused: gate_up [E, 2I, H] (gate rows first) -> [E, H, I]; down [E, H, I] -> [E, I, H].
      for name, fused in (
        ("gate_proj", ((fused_gu,), Layout(perm=(0, 2, 1), split=(1, 2, 0)))),
        ("up_proj", ((fused_gu,), Layout(perm=(0, 2, 1), split=(1, 2, 1)))),
        ("down_proj", ((fused_d,), Layout(perm=(0, 2, 1)))),
      ):
        specs.append(ParamSpec(L + m + (name,), per(name), _STACK_T, (fused,)))
    else:
      for name in ("gate_proj", "up_proj", "down_proj"):
        lin(("mlp", name), f"mlp.{name}")
  return specs


# safetensors dtypes that safetensors' numpy backend cannot return (it looks for them on the numpy
# module); they are read through a memory map of the file instead.
_MMAP_DTYPES = {
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}  # power-of-two block scales


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str) -> tuple[dict[str, str] | None, list[str]]:
  """(weight_map, files) of an HF checkpoint directory: ``model.safetensors.index.json``'s weight_map (tensor
  name -> file name) and the files it names, else (None, [``model.safetensors``]), else (None, every
  ``*.safetensors`` in the directory). Files are paths under ``model_dir``, in sorted order. Other
  ``*.safetensors`` files beside an index or ``model.safetensors`` are not read (as in transformers), with
  a WARNING naming them.

  Raises ValueError, naming the file, for a malformed index, an index entry that is not a plain relative
  path inside the directory (no absolute path, no ``..``), a weight file that is not a regular file (a
  dangling link, a directory, a FIFO: nothing is opened), or no weights at all (pointing a directory of
  PyTorch pickles to ``models.from_torch``)."""
  # Imported here: `python -m models.from_torch` imports the package first.
  from .from_torch import check_regular_file, read_weight_map

  index = os.path.join(model_dir, INDEX_FILE)
  weight_map = None
  if os.path.exists(index):
    weight_map = read_weight_map(index, model_dir)  # ValueError: malformed, or a file outside model_dir
    names = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
    names = ["model.safetensors"]
  else:
    names = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not names:
      pickles = sorted(f for f in os.listdir(model_dir) if f.endswith((".bin", ".pt", ".pth")))
      hint = (
        (
          f"; it holds PyTorch pickle weights ({pickles[0]}{', ...' if len(pickles) > 1 else ''}): "
          f"convert them once with `python -m models.from_torch --model-path {model_dir} --output "
          "NEW_DIR` (needs torch: `make oracle`)"
        )
        if pickles
        else ""
      )
      raise ValueError(f"no *.safetensors weights found in {model_dir}{hint}")
  if weight_map is not None or names == ["model.safetensors"]:  # transformers' choice, and its files alone
    ignored = sorted(set(f for f in os.listdir(model_dir) if f.endswith(".safetensors")) - set(names))
    if ignored:
      log.warning(
        "%s: %d other .safetensors file(s) not read (%s names the checkpoint's files): %s%s",
        model_dir,
        len(ignored),
        INDEX_FILE if weight_map is not None else "model.safetensors",
        ", ".join(ignored[:5]),
        ", ..." if len(ignored) > 5 else "",
      )
  for name in names:
    try:
      check_regular_file(os.path.join(model_dir, name))  # follows links; a FIFO or directory is refused
    except ValueError as e:
      raise ValueError(f"weight file {e}") from None
  return weight_map, [os.path.join(model_dir, n) for n in names]


class _TensorStore:
  """Lazy name -> numpy array access over one or several safetensors files.

  Files are opened with ``safe_open`` (memory-mapped) and tensors are read one at a time.  A tensor
  with a ``*_scale_inv`` companion is FP8 block-quantized and comes back dequantized to float32
  (``fp8_block_size`` must then be set, i.e. the config must declare ``quantization_config``).
  """

  def __init__(self, model_dir: str, fp8_block_size: tuple[int, int] | None = None):
    weight_map, files = checkpoint_files(model_dir)
    self._where: dict[str, str] = {}
    if weight_map is not None:
      self._where = {k: os.path.join(model_dir, fname) for k, fname in weight_map.items()}
    else:
      for fn in files:
        with safe_open(fn, framework="numpy") as f:
          for k in f.keys():
            if k in self._where:
              raise ValueError(
                f"tensor {k!r} is in both {os.path.basename(self._where[k])} and "
                f"{os.path.basename(fn)} (without a weight index, each tensor must "
                "be in one file)"
              )
            self._where[k] = fn
    self._handles: dict[str, object] = {}
    self._headers: dict[str, tuple[int, dict]] = {}
    self._maps: dict[str, np.memmap] = {}
    self.fp8_block_size = fp8_block_size
    self.bytes_read = 0
    if fp8_block_size is None:
      scaled = next((k for k in self._where if k.endswith(fp8.SCALE_SUFFIX)), None)
      if scaled is not None:
        raise ValueError(f"checkpoint holds FP8 block scales ({scaled!r}) but config.json has no quantization_config")

  def __contains__(self, key: str) -> bool:
    return key in self._where

  def keys(self):
    return self._where.keys()

  def files(self) -> set[str]:
    """The paths of the weight files the tensors are in."""
    return set(self._where.values())

  def file(self, key: str) -> str:
    """The path of the weight file holding ``key``."""
    return self._where[key]

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
    if fn not in self._maps:
      self._maps[fn] = np.memmap(fn, dtype=np.uint8, mode="r")
    start, header = self._headers[fn]
    info = header[key]
    dt = _MMAP_DTYPES[info["dtype"]]
    b0, b1 = info["data_offsets"]
    return self._maps[fn][start + b0 : start + b1].view(dt).reshape(info["shape"])

  def shape(self, key: str) -> tuple[int, ...]:
    """The stored shape of ``key`` (from the file header; nothing read)."""
    return tuple(self._handle(self._where[key]).get_slice(key).get_shape())

  def dtype(self, key: str) -> np.dtype | str:
    """The stored dtype of ``key`` (a numpy dtype, or the safetensors name of one numpy lacks)."""
    name = self._handle(self._where[key]).get_slice(key).get_dtype()
    return _MMAP_DTYPES.get(name) or _ST_DTYPES.get(name, name)

  def read_raw(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The stored values of ``key`` (index: a slice per axis; None: all of it), a copy in the stored dtype
    (FP8 not dequantized).  Only the bytes of the slice are read from the memory-mapped file."""
    fn = self._where[key]
    h = self._handle(fn)
    if h.get_slice(key).get_dtype() in _MMAP_DTYPES:
      arr = self._mmap_tensor(fn, key)
      arr = np.array(arr if index is None else arr[index])
    else:
      arr = h.get_tensor(key) if index is None else h.get_slice(key)[index]
    self.bytes_read += arr.nbytes
    return arr

  def _raw(self, key: str) -> np.ndarray:
    return self.read_raw(key)

  def release(self) -> None:
    """Unmaps the files (the next read maps them again): file pages a parameter's reads touched stop
    counting in this process's resident memory once it is placed."""
    self._handles.clear()
    self._maps.clear()

  def is_fp8(self, key: str) -> bool:
    """Whether ``key`` is stored FP8 block-quantized (it has block scales)."""
    return fp8.scale_key(key) in self._where

  def is_float(self, key: str) -> bool:
    """True when ``key`` is stored in a floating-point dtype (any width, FP8 included; from the header)."""
    return self._handle(self._where[key]).get_slice(key).get_dtype().startswith(("F", "BF"))

  def check_fp8(self, key: str) -> None:
    """ValueError naming the tensor unless ``key`` is a float8_e4m3fn weight whose block scales have a scale
    dtype and the shape of its blocks (from the headers: nothing read)."""
    skey = fp8.scale_key(key)
    if self.fp8_block_size is None:  # pragma: no cover - refused in __init__
      raise ValueError(f"{skey!r} present but config.json has no quantization_config")
    wdt, sdt = self.dtype(key), self.dtype(skey)
    if wdt not in fp8.FP8_DTYPES:
      raise ValueError(f"tensor {key!r} has block scales but dtype {wdt} (expected float8_e4m3fn)")
    if sdt not in fp8.SCALE_DTYPES:
      raise ValueError(
        f"scales {skey!r} have dtype {sdt}; expected one of {', '.join(str(d) for d in fp8.SCALE_DTYPES)}"
      )
    if len(self.shape(key)) < 2:
      raise ValueError(f"tensor {key!r} of shape {self.shape(key)} has block scales; only matrices are block-quantized")
    want = fp8.scale_shape(self.shape(key), self.fp8_block_size)
    if self.shape(skey) != want:
      raise ValueError(
        f"scales {skey!r} have shape {self.shape(skey)}, expected {want} for a weight of shape "
        f"{self.shape(key)} with block size {tuple(self.fp8_block_size)}"
      )

  def read(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """``read_raw``, dequantized to float32 when ``key`` is FP8 block-quantized: the slice is widened to
    whole 128 x 128 blocks on its last two axes, those blocks and their scales are read and dequantized
    (``fp8.dequantize_block_fp8``), and the slice is cut out of them."""
    skey = fp8.scale_key(key)
    if skey not in self._where:
      arr = self.read_raw(key, index)
      if arr.dtype in _MMAP_DTYPES.values():
        raise ValueError(f"tensor {key!r} is {arr.dtype} but has no {skey!r} block scales")
      return arr
    self.check_fp8(key)
    shape = self.shape(key)
    index = index or tuple(slice(0, n) for n in shape)
    *lead, rows, cols = index
    (br, bc), (R, C) = self.fp8_block_size, shape[-2:]
    r0, c0 = rows.start // br * br, cols.start // bc * bc
    r1, c1 = min(-(-rows.stop // br) * br, R), min(-(-cols.stop // bc) * bc, C)
    w = self.read_raw(key, (*lead, slice(r0, r1), slice(c0, c1)))
    sc = self.read_raw(skey, (*lead, slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc))))
    out = fp8.dequantize_block_fp8(w, sc, self.fp8_block_size, name=key)
    return out[..., rows.start - r0 : rows.stop - r0, cols.start - c0 : cols.stop - c0]


# safetensors dtype names -> numpy (the ones numpy has; FP8 ones are _MMAP_DTYPES).
_ST_DTYPES = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}


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
  return any(names[-len(s) :] == s for s in _FP32_SUFFIXES)


def _progress_bar(enabled: bool | None, total: int, desc: str):
  from tqdm.auto import tqdm  # noqa: PLC0415

  if enabled is None:
    enabled = sys.stderr.isatty()
  return tqdm(total=total, desc=desc, unit="param", disable=not enabled, leave=True, dynamic_ncols=True)


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
log = logging.getLogger(__name__)


def _report_unused(store, used: set[str], cfg: DSAConfig, model_dir: str) -> None:
  """Logs the checkpoint's tensors the model does not load (as transformers does for "weights of the checkpoint
  not used"): the multi-token-prediction layers config.json declares (num_nextn_predict_layers after the
  num_hidden_layers decoder layers) at INFO; anything else at WARNING, since a config that says fewer layers
  or experts than the files hold loads, and decodes, a smaller model than the checkpoint is."""
  num_layers, nextn = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
  mtp, beyond, other = set(), set(), []
  for k in store.keys():
    if k in used or (k.endswith(fp8.SCALE_SUFFIX) and k[: -len(fp8.SCALE_SUFFIX)] in used):
      continue
    m = _LAYER_KEY.match(k)
    layer = int(m.group(1)) if m else -1
    if layer >= num_layers + nextn:
      beyond.add(layer)
    elif layer >= num_layers:
      mtp.add(layer)
    else:
      other.append(k)
  if mtp:
    log.info("skipping the multi-token-prediction layer(s) %s: not used for decoding", sorted(mtp))
  if beyond:
    log.warning(
      "checkpoint %s holds layer(s) %s beyond config.json's num_hidden_layers=%d (+ "
      "num_nextn_predict_layers=%d): they are not loaded; is num_hidden_layers right?",
      model_dir,
      sorted(beyond),
      num_layers,
      nextn,
    )
  if other:
    other.sort()
    log.warning(
      "checkpoint %s holds %d tensor(s) the model does not use, not loaded: %s%s",
      model_dir,
      len(other),
      ", ".join(other[:5]),
      ", ..." if len(other) > 5 else "",
    )


def _check_counts(store: _TensorStore, cfg: DSAConfig, model_dir: str) -> None:
  """ValueError unless the checkpoint holds config.json's last layer and, in its first MoE layer, its last
  routed expert, and its files hold at least as many tensors as the routed experts alone need (3 per expert
  and MoE layer, 2 per layer in transformers' fused layout): lookups and arithmetic before the model's
  shapes and key table (work in proportion to num_hidden_layers x n_routed_experts) are built, so a config
  that promises more than the files hold fails at once."""
  last = cfg.num_hidden_layers - 1
  key = f"model.layers.{last}.input_layernorm.weight"
  if key not in store:
    raise ValueError(
      f"checkpoint {model_dir} is missing tensor {key!r} (config.json: num_hidden_layers={cfg.num_hidden_layers})"
    )
  moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
  if not moe_layers:
    return
  moe = moe_layers[0]
  p, E = f"model.layers.{moe}.mlp.experts.", cfg.n_routed_experts
  fused = p + "gate_up_proj"
  if fused in store:
    if len(store.shape(fused)) != 3 or store.shape(fused)[0] != E:
      raise ValueError(
        f"tensor {fused!r} has shape {store.shape(fused)}: {store.shape(fused)[0]} experts, "
        f"config.json: n_routed_experts={E}"
      )
  elif (missing := f"{p}{E - 1}.gate_proj.weight") not in store:
    raise ValueError(f"checkpoint {model_dir} is missing tensor {missing!r} (config.json: n_routed_experts={E})")
  fused_layers = sum(f"model.layers.{i}.mlp.experts.gate_up_proj" in store for i in moe_layers)
  needed = 2 * fused_layers + 3 * E * (len(moe_layers) - fused_layers)
  if len(store.keys()) < needed:
    raise ValueError(
      f"checkpoint {model_dir} holds {len(store.keys())} tensors, fewer than the {needed} routed-"
      f"expert weights of config.json's {len(moe_layers)} MoE layers x n_routed_experts={E}"
    )
  # Whatever the layout, the routed experts' parameters take at least a byte each (FP8) in the files.
  params = len(moe_layers) * E * 3 * cfg.moe_intermediate_size * cfg.hidden_size
  held = sum(os.path.getsize(f) for f in store.files())
  if held < params:
    raise ValueError(
      f"checkpoint {model_dir}'s weight files hold {held} bytes, fewer than the {params} routed-expert "
      f"parameters of config.json ({len(moe_layers)} MoE layers x n_routed_experts={E} x 3 x "
      f"moe_intermediate_size={cfg.moe_intermediate_size} x hidden_size={cfg.hidden_size}) need "
      "at one byte each"
    )


def load_hf(
  model_dir: str | os.PathLike,
  dtype=None,
  *,
  progress: bool | None = None,
  fp8_numerics: bool = False,
  kv_cache_dtype: str = "auto",
  sharding=None,
  fp8_weights: bool = False,
  top_k=jax.lax.top_k,
  expert_parallel=None,
) -> tuple[DSAConfig, DeepseekV32ForCausalLM]:
  """Load ``model_dir`` (HF layout) -> (config, model).

  dtype: parameter dtype (default: the config's ``dtype``).  Router weight/bias and the indexer's
  weights_proj are always float32.  FP8 block-quantized weights are dequantized to ``dtype``.
  progress: tqdm progress bar over the parameters with the bytes read so far in the postfix
  (None: only when stderr is a TTY; False: never).
  fp8_numerics: run the indexer and the latent KV with DeepSeek's FP8 deployment numerics
  (models/fp8_numerics.py).
  kv_cache_dtype: how the KV cache stores a latent row, "auto" or "fp8_e4m3" (models/kv_format.py).
  Tensors are streamed: each is read from the memory-mapped safetensors file, converted and placed
  into the model before the next is read.  sharding: a function (parameter path 'layers/3/mlp/gate_proj',
  shape) -> jax.sharding.Sharding placing each parameter as it is read (e.g. the mesh rule table); then
  each device's slice alone is read from the files (``Layout``: only the bytes of that slice, FP8
  widened to whole blocks), so a process never holds more than its own devices' parameters plus one
  slice in flight, and with several processes each reads only what its devices hold.
  fp8_weights: keep the FP8 checkpoint's block-quantized matrices in float8_e4m3fn with float32 block scales
  (``Linear.kernel_scale``, ``MoE.*_proj_scale``), dequantized inside the jitted matmuls: half the weight
  memory of bfloat16, and exactly the weights dequantize-at-load gives (``models.fp8.dequantize_jax``).
  top_k, expert_parallel: how the model runs (``DeepseekV32ForCausalLM``'s arguments of the same names).
  Raises ValueError for an unsupported config, a missing tensor (the message names the missing HF key),
  a tensor of the wrong shape, or fp8_weights for a checkpoint that is not FP8 block-quantized (or keeps its
  experts fused).
  """
  model_dir = os.fspath(model_dir)
  cfg = DSAConfig.from_pretrained(model_dir)
  dt = jnp.dtype(dtype if dtype is not None else cfg.dtype)
  cfg = cfg.replace(dtype=dt.name, fp8_numerics=fp8_numerics, kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype))
  store = _TensorStore(model_dir, cfg.fp8_block_size)

  if fp8_weights and cfg.fp8_block_size is None:
    raise ValueError(
      f"checkpoint {model_dir} is not FP8 block-quantized (no quantization_config): FP8-resident weights need one"
    )

  _check_counts(store, cfg, model_dir)
  abstract = nnx.eval_shape(
    lambda: DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt, top_k=top_k, expert_parallel=expert_parallel)
  )
  table = hf_param_table(cfg)
  # Resolve every parameter's keys, and check every shape, before any loading work: a missing or
  # misshapen tensor fails at once.
  plan = []
  for spec in table:
    groups = ((spec.hf_keys, spec.layout),) + spec.alternatives
    chosen = next((g for g in groups if all(k in store for k in g[0])), None)
    if chosen is None:
      missing = next(k for k in spec.hf_keys if k not in store)
      raise ValueError(f"checkpoint {model_dir} is missing tensor {missing!r}")
    # FP8-resident: the Linear kernels and expert stacks; an FP8 lm_head (DeepSeek's is not) is dequantized here.
    quantized = fp8_weights and spec.path[0] != "lm_head" and all(store.is_fp8(k) for k in chosen[0])
    if quantized and chosen[0] != spec.hf_keys:
      raise ValueError(
        f"FP8-resident weights: {chosen[0][0]!r} keeps its experts fused; only per-expert FP8 tensors are supported"
      )
    scale_path = _make_fp8_resident(abstract, spec.path, dt, cfg.fp8_block_size) if quantized else None
    plan.append((spec.path, chosen, scale_path))
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))
  for path, (keys, layout), scale_path in plan:
    if path not in flat or (scale_path is not None and scale_path not in flat):
      raise KeyError(f"internal: no model parameter at {path}")
    need = layout.source_shape(tuple(flat[path].get_value().shape))
    for k in keys:
      if store.shape(k) != need:
        raise ValueError(
          f"tensor {k!r} has shape {store.shape(k)}, expected {need} (for parameter "
          f"{param_path(path)} of shape {tuple(flat[path].get_value().shape)})"
        )
      if store.is_fp8(k):
        store.check_fp8(k)
      elif not store.is_float(k):
        raise ValueError(f"tensor {k!r} has dtype {store.dtype(k)}; weights must be floating point")
  _report_unused(store, {k for _, (keys, _), _ in plan for k in keys}, cfg, model_dir)
  covered = {path for path, _, _ in plan} | {sp for _, _, sp in plan if sp is not None}
  missing_params = sorted(set(flat) - covered, key=str)
  if missing_params:
    raise KeyError(f"internal: parameters without a checkpoint mapping: {missing_params}")

  def what(path) -> str:
    return f"checkpoint {model_dir}: parameter {param_path(path)}"

  def place(path, keys, layout, read, target, limit=None):
    """Parameter ``path`` from the slices ``read(key, source slices)`` of its tensors: whole on the default
    device, or, with ``sharding``, each addressable device's slice alone (read once per distinct slice).
    Each is checked (``check_finite_array``) as it is read: finite in ``target`` and, with ``limit``, of
    magnitude at most that."""
    shape = tuple(flat[path].get_value().shape)

    def piece(index):
      index = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, shape))
      inner = index[1:] if layout.stacked else index
      src = layout.source_slices(inner, shape)
      ks = keys[index[0]] if layout.stacked else keys
      with np.errstate(over="ignore", invalid="ignore"):  # (an FP8 dequantization that overflows: refused below)
        return layout.assemble([read(k, src) for k in ks])

    if sharding is None:
      whole = check_finite_array(piece(tuple(slice(None) for _ in shape)), what(path), target, limit)
      flat[path].set_value(jnp.asarray(whole).astype(target))
      return
    cache: dict = {}

    def callback(index):
      key = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, shape))
      key = tuple((sl.start, sl.stop) for sl in key)
      if key not in cache:
        cache[key] = check_finite_array(piece(index), what(path), target, limit).astype(np.dtype(target))
      return cache[key]

    flat[path].set_value(jax.make_array_from_callback(shape, sharding(param_path(path), shape), callback))

  with _progress_bar(progress, len(plan), f"loading {os.path.basename(model_dir.rstrip(os.sep))}") as bar:
    for path, (keys, layout), scale_path in plan:
      if scale_path is None:
        place(path, keys, layout, store.read, _F32 if _is_fp32_param(path) else dt)
      else:  # FP8-resident: the e4m3 weight and its float32 scales, laid out as the parameter
        place(path, keys, layout, store.read_raw, flat[path].get_value().dtype)
        # A scale past the compute dtype's max / 448 overflows what dequantizing at load refuses.
        place(
          scale_path,
          tuple(fp8.scale_key(k) for k in keys),
          layout,
          lambda k, src: store.read_raw(k, src).astype(np.float32),
          _F32,
          limit=float(jnp.finfo(dt).max) / float(jnp.finfo(jnp.float8_e4m3fn).max),
        )
      store.release()
      bar.update(1)
      bar.set_postfix_str(f"{store.bytes_read / 2**20:.1f} MiB read", refresh=False)
  state = nnx.from_flat_state(flat)
  return cfg, nnx.merge(graphdef, state)


NONFINITE_WEIGHTS = (
  "holds a NaN or an infinity (or a value the compute dtype cannot hold): such a weight decodes "
  "garbage without an error (NaN logits; in the indexer, NaN scores that select no top-k)"
)


# Elements checked at a time: np.isfinite makes a bool per element, so a whole 2 GB expert stack at once would add
# half its size to the loader's peak host memory.
FINITE_CHECK_ELEMENTS = 1 << 24


def _narrower(source, target) -> bool:
  """target's finite range is smaller than source's (float64 -> float32, float32 -> bfloat16); False for
  non-float types."""
  try:
    return float(ml_dtypes.finfo(target).max) < float(ml_dtypes.finfo(source).max)
  except (ValueError, TypeError):
    return False


def check_finite_array(x: np.ndarray, what: str, target=None, limit: float | None = None) -> np.ndarray:
  """x (any shape; float, bfloat16 or float8 dtype), after checking on the host, in one pass over its bytes
  about FINITE_CHECK_ELEMENTS at a time along its first axis, that it holds no NaN or infinity, also once cast
  to ``target`` (a float64 1e300, or a float32 3.4e38 in bfloat16, overflows there), and, with ``limit``, no
  magnitude above it (e4m3 NaN bytes and block scales included; ml_dtypes' bfloat16 and float8 types have
  np.isfinite). ValueError "{what} holds a NaN or an infinity ..." otherwise (``what`` names the tensor)."""
  if target is not None and not _narrower(x.dtype, target):  # (only then can the cast overflow: no copy else)
    target = None
  if x.ndim == 0 or x.size == 0:
    parts = [x]
  else:
    rows = max(1, FINITE_CHECK_ELEMENTS * len(x) // x.size)
    parts = (x[i : i + rows] for i in range(0, len(x), rows))
  with np.errstate(over="ignore", invalid="ignore"):
    for part in parts:
      cast = part if target is None else part.astype(target)
      if not np.isfinite(cast).all() or (limit is not None and (np.abs(part) > limit).any()):
        raise ValueError(
          f"{what} {NONFINITE_WEIGHTS}" + ("" if limit is None else f" (or a block scale above {limit:.3g})")
        )
  return x


def check_finite(model, model_dir: str) -> None:
  """ValueError naming the first parameter (and how many more) that holds a NaN or an infinity, for a model
  already on its devices (an orbax restore): one jitted reduction over every parameter where it lies (each
  device reads its own shards once; ~20 ms at HBM bandwidth for a 700 B-parameter model's share of one GPU)."""
  flat = [(path, v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))]
  flat = [(path, x) for path, x in flat if jnp.issubdtype(x.dtype, jnp.floating)]
  ok = jax.jit(lambda xs: jnp.stack([jnp.isfinite(x).all() for x in xs]))([x for _, x in flat])
  ok = np.asarray(ok.addressable_shards[0].data)  # replicated: every process reads its own copy
  bad = [path for (path, _), good in zip(flat, ok) if not good]
  if bad:
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise ValueError(f"checkpoint {model_dir}: parameter {param_path(bad[0])}{more} {NONFINITE_WEIGHTS}")
