"""FP8 block-quantized checkpoints (float8_e4m3fn weights + float32 ``weight_scale_inv`` per 128x128 block).

The checkpoints are quantized here (numpy + ml_dtypes, stored by safetensors as F8_E4M3), with weight
shapes that are not multiples of 128 (hidden 200, intermediate 300, ...) so edge blocks are partial.
The loader's dequantization is checked against one written independently below (an explicit loop
over blocks), and end to end: an FP8 checkpoint gives exactly the parameters and logits of an
unquantized checkpoint holding the dequantized weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.deepseek_v32 import prefill_prompts
from models.fp8 import dequantize_block_fp8
from models.loader import load_hf
from models.random_checkpoint import write_random_checkpoint

F8 = ml_dtypes.float8_e4m3fn
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 128
QCONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}

BASE = {
  "vocab_size": 300,
  "hidden_size": 200,
  "intermediate_size": 300,
  "moe_intermediate_size": 136,
  "num_hidden_layers": 3,
  "num_attention_heads": 3,
  "num_key_value_heads": 3,
  "q_lora_rank": 160,
  "kv_lora_rank": 144,
  "qk_nope_head_dim": 24,
  "qk_rope_head_dim": 16,
  "v_head_dim": 40,
  "n_routed_experts": 4,
  "n_shared_experts": 1,
  "num_experts_per_tok": 2,
  "routed_scaling_factor": 2.5,
  "first_k_dense_replace": 1,
  "max_position_embeddings": 256,
  "index_n_heads": 4,
  "index_head_dim": 32,
  "index_topk": 8,
  "initializer_range": 0.1,
  "dtype": "float32",
}
DSV32 = {
  **BASE,
  "architectures": ["DeepseekV32ForCausalLM"],
  "model_type": "deepseek_v32",
  "n_group": 2,
  "topk_group": 1,
  "rope_theta": 10000.0,
}
GLM = {
  **BASE,
  "architectures": ["GlmMoeDsaForCausalLM"],
  "model_type": "glm_moe_dsa",
  "n_group": 1,
  "topk_group": 1,
  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
  "indexer_types": ["full", "shared", "full"],
}

# Tensors that stay unquantized in FP8 DeepSeek / GLM checkpoints.
_UNQUANTIZED = ("norm", "embed_tokens", "lm_head", "mlp.gate.", "weights_proj")


def _quantized(key: str, arr: np.ndarray) -> bool:
  return key.endswith(".weight") and arr.ndim == 2 and not any(u in key for u in _UNQUANTIZED)


# ----------------------------------------------------------------------------- independent reference
def reference_dequantize(q: np.ndarray, s: np.ndarray) -> np.ndarray:
  """Explicit loop over 128x128 blocks (the edge blocks are whatever is left)."""
  rows, cols = q.shape
  out = np.empty((rows, cols), np.float32)
  for bi in range(math.ceil(rows / BLOCK)):
    for bj in range(math.ceil(cols / BLOCK)):
      r = slice(bi * BLOCK, min(rows, (bi + 1) * BLOCK))
      c = slice(bj * BLOCK, min(cols, (bj + 1) * BLOCK))
      out[r, c] = q[r, c].astype(np.float32) * np.float32(s[bi, bj])
  return out


def quantize(w: np.ndarray, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Per-block absmax scaling to the e4m3 range (max 448), as DeepSeek's FP8 checkpoints are made;
  pow2: each scale rounded up to a power of two (representable exactly in bfloat16 and e8m0)."""
  rows, cols = w.shape
  nb_r, nb_c = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
  q = np.empty((rows, cols), F8)
  s = np.empty((nb_r, nb_c), np.float32)
  for bi in range(nb_r):
    for bj in range(nb_c):
      blk = w[bi * BLOCK : (bi + 1) * BLOCK, bj * BLOCK : (bj + 1) * BLOCK].astype(np.float32)
      scale = np.float32(max(float(np.abs(blk).max()), 1e-12) / 448.0)
      if pow2:
        scale = np.float32(2.0 ** math.ceil(math.log2(scale)))
      s[bi, bj] = scale
      q[bi * BLOCK : (bi + 1) * BLOCK, bj * BLOCK : (bj + 1) * BLOCK] = (blk / scale).astype(F8)
  return q, s


def write_fp8_pair(tmp_path, config: dict, seed: int, scale_dtype=None):
  """(fp8 checkpoint dir, unquantized checkpoint dir holding the reference-dequantized weights,
  list of quantized keys). scale_dtype: store power-of-two scales in this dtype (default float32
  absmax scales)."""
  src = write_random_checkpoint(tmp_path / "src", config, seed=seed)
  tensors = load_file(f"{src}/model.safetensors")
  fp8_t, deq_t, qkeys = {}, {}, []
  for k, v in tensors.items():
    if _quantized(k, v):
      q, s = quantize(v, pow2=scale_dtype is not None)
      fp8_t[k], fp8_t[k + "_scale_inv"] = q, s if scale_dtype is None else s.astype(scale_dtype)
      deq_t[k] = reference_dequantize(q, s)
      qkeys.append(k)
    else:
      fp8_t[k] = deq_t[k] = v
  dirs = []
  for name, t, cfg in (("fp8", fp8_t, {**config, "quantization_config": QCONFIG}), ("deq", deq_t, config)):
    d = tmp_path / name
    d.mkdir()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    dirs.append(str(d))
  return dirs[0], dirs[1], qkeys


def _params(model) -> dict:
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("shape", [(200, 300), (300, 200), (128, 128), (129, 257), (1, 5), (256, 384), (136, 200)])
def test_dequantize_matches_independent_reference(shape):
  rng = np.random.default_rng(sum(shape))
  w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3.0)
  q, s = quantize(w)
  assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
  got = dequantize_block_fp8(q, s, (128, 128))
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, reference_dequantize(q, s))
  # and it is a faithful quantization (e4m3: 3 mantissa bits -> relative error <= 2**-4 per element)
  assert np.all(
    np.abs(got - w) <= np.abs(w) * 2.0**-4 + np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]] * 2.0**-9
  )


def test_dequantize_stacked_weights():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((3, 130, 260)).astype(np.float32)
  qs = [quantize(x) for x in w]
  q, s = np.stack([a for a, _ in qs]), np.stack([b for _, b in qs])
  got = dequantize_block_fp8(q, s, (128, 128))
  for e in range(3):
    np.testing.assert_array_equal(got[e], reference_dequantize(*qs[e]))


@pytest.mark.parametrize("config", [DSV32, GLM], ids=["deepseek_v32", "glm_moe_dsa"])
def test_fp8_checkpoint_equals_dequantized_checkpoint(tmp_path, config, caplog):
  fp8_dir, deq_dir, qkeys = write_fp8_pair(tmp_path, config, seed=4)
  assert any("experts.3.down_proj" in k for k in qkeys) and any("indexer.wq_b" in k for k in qkeys)
  with caplog.at_level("WARNING", logger="models.loader"):
    cfg_q, model_q = load_hf(fp8_dir)
  assert not caplog.records, caplog.text  # the block scales count as used, with their weights
  cfg_d, model_d = load_hf(deq_dir)
  assert cfg_q.fp8_block_size == (128, 128) and cfg_d.fp8_block_size is None
  pq, pd = _params(model_q), _params(model_d)
  assert pq.keys() == pd.keys()
  for k in pq:
    assert pq[k].dtype == pd[k].dtype, k
    np.testing.assert_array_equal(pq[k], pd[k], err_msg=str(k))
  # a partial-block weight really went through dequantization (fp8 grid values times the block scale)
  kern = np.asarray(model_q.layers[0].self_attn.q_a_proj.kernel.get_value())  # [200, 160]
  assert kern.shape == (200, 160)
  tokens = jnp.asarray(np.random.default_rng(1).integers(2, 300, (2, 24)), jnp.int32)
  lengths = jnp.asarray([24, 13], jnp.int32)
  lq, cq = prefill_prompts(model_q, tokens, lengths)
  ld, cd = prefill_prompts(model_d, tokens, lengths)
  np.testing.assert_array_equal(np.asarray(lq), np.asarray(ld))
  np.testing.assert_array_equal(np.asarray(cq.latent), np.asarray(cd.latent))


@pytest.mark.parametrize(
  "scale_dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e8m0fnu], ids=["float32", "bfloat16", "e8m0"]
)
def test_fp8_checkpoint_scale_dtypes(tmp_path, scale_dtype):
  """Power-of-two block scales stored as float32, bfloat16 or float8_e8m0fnu load to the same parameters
  as the reference-dequantized checkpoint; a scale dtype no checkpoint uses is an error naming the tensor."""
  fp8_dir, deq_dir, qkeys = write_fp8_pair(tmp_path, DSV32, seed=9, scale_dtype=scale_dtype)
  from safetensors import safe_open  # noqa: PLC0415

  with safe_open(f"{fp8_dir}/model.safetensors", "numpy") as f:
    stored = f.get_slice(qkeys[0] + "_scale_inv").get_dtype()
  assert stored == {np.float32: "F32", ml_dtypes.bfloat16: "BF16", ml_dtypes.float8_e8m0fnu: "F8_E8M0"}[scale_dtype]
  _, model_q = load_hf(fp8_dir)
  _, model_d = load_hf(deq_dir)
  pq, pd = _params(model_q), _params(model_d)
  for k in pq:
    np.testing.assert_array_equal(pq[k], pd[k], err_msg=str(k))
  if scale_dtype is np.float32:
    import models.loader as loader  # noqa: PLC0415

    store = loader._TensorStore(fp8_dir, (128, 128))
    t = {k: np.asarray(store._raw(k)) for k in store.keys()}
    t[qkeys[0] + "_scale_inv"] = t[qkeys[0] + "_scale_inv"].astype(np.float16)
    save_file(t, f"{fp8_dir}/model.safetensors")
    with pytest.raises(ValueError, match=re.escape(qkeys[0] + "_scale_inv") + ".*float16"):
      load_hf(fp8_dir)


def test_fp8_checkpoint_to_bfloat16(tmp_path):
  fp8_dir, deq_dir, _ = write_fp8_pair(tmp_path, DSV32, seed=6)
  cfg, model_q = load_hf(fp8_dir, dtype=jnp.bfloat16)
  _, model_d = load_hf(deq_dir, dtype=jnp.bfloat16)
  assert cfg.dtype == "bfloat16"
  assert model_q.layers[1].mlp.gate_proj.get_value().dtype == jnp.bfloat16
  assert model_q.layers[1].mlp.gate_kernel.get_value().dtype == jnp.float32
  pq, pd = _params(model_q), _params(model_d)
  for k in pq:
    np.testing.assert_array_equal(pq[k], pd[k], err_msg=str(k))


def test_fp8_sharded_scales_in_other_shard(tmp_path):
  """Scales may live in a different shard than their weight (index.json weight_map)."""
  fp8_dir, deq_dir, qkeys = write_fp8_pair(tmp_path, GLM, seed=8)
  from safetensors import safe_open  # noqa: PLC0415

  with safe_open(f"{fp8_dir}/model.safetensors", "numpy") as f:
    keys = list(f.keys())
  # Rewrite as two shards by raw bytes via our own reader path: scales in shard 2, weights in shard 1.
  import models.loader as loader  # noqa: PLC0415

  store = loader._TensorStore(fp8_dir, (128, 128))
  shard1 = {k: np.asarray(store._raw(k)) for k in keys if not k.endswith("_scale_inv")}
  shard2 = {k: np.asarray(store._raw(k)) for k in keys if k.endswith("_scale_inv")}
  out = tmp_path / "sharded"
  out.mkdir()
  save_file(shard1, str(out / "model-00001-of-00002.safetensors"))
  save_file(shard2, str(out / "model-00002-of-00002.safetensors"))
  wm = {k: "model-00001-of-00002.safetensors" for k in shard1}
  wm.update({k: "model-00002-of-00002.safetensors" for k in shard2})
  (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
  (out / "config.json").write_text(open(f"{fp8_dir}/config.json").read())
  _, m1 = load_hf(out)
  _, m2 = load_hf(deq_dir)
  p1, p2 = _params(m1), _params(m2)
  for k in p1:
    np.testing.assert_array_equal(p1[k], p2[k], err_msg=str(k))


def _edit_config(d, **changes):
  cfg = json.load(open(f"{d}/config.json"))
  cfg.update(changes)
  json.dump(cfg, open(f"{d}/config.json", "w"))


@pytest.mark.parametrize(
  "qconfig, needle",
  [
    ({**QCONFIG, "quant_method": "awq"}, "quant_method"),
    ({**QCONFIG, "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8"}, "weight_block_size"),
    ({**QCONFIG, "fmt": "e5m2"}, "fmt"),
    ({**QCONFIG, "activation_scheme": "static"}, "activation_scheme"),
    ({**QCONFIG, "scale_fmt": "e8m0fnu"}, "scale_fmt"),
  ],
)
def test_unsupported_quantization_config_raises_naming_it(tmp_path, qconfig, needle):
  fp8_dir, _, _ = write_fp8_pair(tmp_path, DSV32, seed=1)
  _edit_config(fp8_dir, quantization_config=qconfig)
  with pytest.raises(ValueError, match=needle):
    load_hf(fp8_dir)


def test_inconsistent_fp8_checkpoints_raise(tmp_path):
  fp8_dir, _, qkeys = write_fp8_pair(tmp_path, DSV32, seed=2)
  import models.loader as loader  # noqa: PLC0415

  store = loader._TensorStore(fp8_dir, (128, 128))
  tensors = {k: np.asarray(store._raw(k)) for k in store.keys()}
  key = "model.layers.1.self_attn.o_proj.weight"
  # scales without quantization_config
  cfg = json.load(open(f"{fp8_dir}/config.json"))
  _edit_config(fp8_dir, quantization_config=None)
  with pytest.raises(ValueError, match="quantization_config"):
    load_hf(fp8_dir)
  json.dump(cfg, open(f"{fp8_dir}/config.json", "w"))
  # an FP8 weight without its scales
  t = dict(tensors)
  del t[key + "_scale_inv"]
  save_file(t, f"{fp8_dir}/model.safetensors")
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    load_hf(fp8_dir)
  # scales of the wrong shape
  t = dict(tensors)
  t[key + "_scale_inv"] = np.ones((1, 1), np.float32)
  save_file(t, f"{fp8_dir}/model.safetensors")
  with pytest.raises(ValueError, match=r"o_proj\.weight_scale_inv"):
    load_hf(fp8_dir)
  # scales beside a vector (only matrices are block-quantized): named, not an unpacking error
  t = dict(tensors)
  norm = "model.layers.1.input_layernorm.weight"
  t[norm] = t[norm].astype(ml_dtypes.float8_e4m3fn)
  t[norm + "_scale_inv"] = np.ones((1,), np.float32)
  save_file(t, f"{fp8_dir}/model.safetensors")
  with pytest.raises(ValueError, match=r"input_layernorm\.weight' of shape \(\d+,\) has block scales; only matrices"):
    load_hf(fp8_dir)


# ----------------------------------------------------------------------------- FP8-resident weights
def _weight_bytes(model) -> int:
  return sum(v.get_value().nbytes for _, v in nnx.to_flat_state(nnx.state(model)))


@pytest.mark.parametrize(
  "config,dtype",
  [(DSV32, "float32"), (DSV32, "bfloat16"), (GLM, "bfloat16")],
  ids=["deepseek_v32-float32", "deepseek_v32-bfloat16", "glm_moe_dsa-bfloat16"],
)
def test_fp8_resident_weights_give_the_dequantize_at_load_logits(tmp_path, config, dtype):
  """Weights kept in e4m3 + block scales and dequantized inside jit: every prefill and decode logit is
  bitwise equal to the model that dequantized them at load; the quantized matrices take 1 byte per
  element plus 4 bytes per 128 x 128 block."""
  from tests.kv_harness import KVHarness

  fp8_dir, deq_dir, qkeys = write_fp8_pair(tmp_path, config, seed=12)
  cfg, at_load = load_hf(fp8_dir, dtype=dtype)
  cfg_r, resident = load_hf(fp8_dir, dtype=dtype, fp8_weights=True)
  flat = dict(nnx.to_flat_state(nnx.state(resident)))
  kernel = flat[("layers", 0, "self_attn", "q_b_proj", "kernel")].get_value()
  scale = flat[("layers", 0, "self_attn", "q_b_proj", "kernel_scale")].get_value()
  assert kernel.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (2, 1)  # [160, 64] kernel -> 2 x 1 blocks
  assert flat[("layers", 1, "mlp", "gate_proj")].get_value().dtype == ml_dtypes.float8_e4m3fn
  assert flat[("embed_tokens",)].get_value().dtype == jnp.dtype(dtype)  # unquantized tensors stay as they are
  # Bytes: every quantized element 1 byte instead of the dtype's, plus its block scales.
  tensors = load_file(f"{deq_dir}/model.safetensors")  # the same shapes, readable by safetensors' numpy
  quantized = sum(tensors[k].size for k in qkeys)
  scales = sum(math.ceil(tensors[k].shape[0] / BLOCK) * math.ceil(tensors[k].shape[1] / BLOCK) for k in qkeys)
  itemsize = jnp.dtype(dtype).itemsize
  assert _weight_bytes(at_load) - _weight_bytes(resident) == quantized * (itemsize - 1) - 4 * scales
  h_load, h_res = KVHarness(cfg, at_load), KVHarness(cfg_r, resident)
  ps = [[5, 6, 7, 8] * 6, [9, 10, 11]]
  np.testing.assert_array_equal(h_res.prefill(ps), h_load.prefill(ps))
  for step in range(4):
    np.testing.assert_array_equal(h_res.decode([3 + step, 4]), h_load.decode([3 + step, 4]))


def test_engine_fp8_resident_weights(tmp_path):
  """--weight-dtype fp8 through the engine: the greedy tokens of dequantize-at-load, about half the weight
  memory of bfloat16; refused (naming the flag) for a checkpoint that is not FP8. (On a mesh: test_mesh.py.)"""
  from hisparse_jax.engine import Engine, Request
  from hisparse_jax.engine.args import StartupError

  fp8_dir, deq_dir, _ = write_fp8_pair(tmp_path, DSV32, seed=13)

  labels = []

  def run(**kw):
    e = Engine(fp8_dir, dtype="bfloat16", max_seq_len=64, max_running_requests=2, **kw)
    labels.append(e.numerics_label())  # (the start-up and summary lines')
    reqs = [Request(str(i), p, max_new_tokens=6, ignore_eos=True) for i, p in enumerate([[5, 6, 7] * 4, [8, 9]])]
    for r in reqs:
      e.submit(r)
    while e.has_work():
      e.step()
    return [r.output_ids for r in reqs], sum(x.nbytes for x in jax.tree.leaves(e.runner.params))

  tokens_at_load, bytes_at_load = run()
  tokens_resident, bytes_resident = run(weight_dtype="fp8")
  assert tokens_resident == tokens_at_load
  assert bytes_resident < 0.6 * bytes_at_load
  assert labels == [", bfloat16", ", bfloat16, FP8 weights"]
  with pytest.raises(StartupError, match="--weight-dtype fp8: .* is not an FP8 block-quantized checkpoint"):
    Engine(deq_dir, weight_dtype="fp8", max_seq_len=64)
  # An orbax copy of the FP8 checkpoint holds dequantized weights: models.convert says so, and the engine's
  # refusal names the HF FP8 checkpoint as the way.
  orbax = tmp_path / "orbax"
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", str(fp8_dir), "--output", str(orbax)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert r.returncode == 0 and "note: the FP8 block-quantized weights are stored dequantized" in r.stdout, r.stderr
  with pytest.raises(StartupError, match="is an orbax checkpoint, whose weights were dequantized .* HF FP8"):
    Engine(str(orbax), weight_dtype="fp8", max_seq_len=64)
  with pytest.raises(StartupError, match="--weight-dtype 'int4'"):
    Engine(fp8_dir, weight_dtype="int4", max_seq_len=64)


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_nan_e4m3_bytes_or_scales_are_refused_naming_the_parameter(tmp_path, fp8_weights):
  """An e4m3 NaN byte (0x7f) or a NaN block scale: refused as read, dequantized at load or kept in FP8."""
  fp8_dir, _, qkeys = write_fp8_pair(tmp_path, DSV32, seed=5)
  path = f"{fp8_dir}/model.safetensors"
  key = next(k for k in qkeys if "o_proj" in k)
  original = open(path, "rb").read()
  n = int.from_bytes(original[:8], "little")
  header = json.loads(original[8 : 8 + n])
  # An e4m3 NaN byte, a NaN scale, and a finite scale whose largest product (448 x 3e38) overflows float32.
  for tensor, nan in (
    (key, bytes([0x7F])),
    (key + "_scale_inv", np.float32(np.nan).tobytes()),
    (key + "_scale_inv", np.float32(3e38).tobytes()),
  ):
    at = 8 + n + header[tensor]["data_offsets"][0]  # its first element's bytes
    with open(path, "wb") as f:
      f.write(original[:at] + nan + original[at + len(nan) :])
    with pytest.raises(ValueError, match=r"parameter layers/\d+/self_attn/o_proj/kernel\w* holds a NaN"):
      load_hf(fp8_dir, fp8_weights=fp8_weights)


# ----------------------------------------------------------------------------- models.quantize_fp8
def test_quantize_blocks_works_in_strips_of_128_rows():
  """A short, wide matrix is not padded to 128 rows whole: a [1, 2^20] float32 vector (4 MiB) was worked on as a
  [128, 2^20] one (512 MiB; a 9 MB [1, 4M] bf16 tensor took 4.4 GB in models.quantize_fp8)."""
  import tracemalloc

  from models.quantize_fp8 import quantize_blocks

  w = np.linspace(-3, 3, 1 << 20, dtype=np.float32)[None]
  tracemalloc.start()
  try:
    q, scale = quantize_blocks(w)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert q.shape == (1, 1 << 20) and scale.shape == (1, (1 << 20) // 128)
  assert peak < 40 * 2**20, peak  # a few copies of the 4 MiB strip
  np.testing.assert_allclose(q.astype(np.float32) * np.repeat(scale, 128, axis=1), w, rtol=0.07, atol=1e-6)


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (5, 129), (64, 1)])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_blocks_equals_the_reference_blockwise_quantizer(shape, pow2):
  """The vectorized quantizer gives this file's per-block loop's e4m3 values and scales bit for bit (edge
  blocks partial; a block of zeros included)."""
  from models.quantize_fp8 import quantize_blocks

  w = np.random.default_rng(shape[0] + shape[1]).standard_normal(shape).astype(np.float32) * 3
  w[: min(shape[0], 128), : min(shape[1], 128)] = 0  # an all-zero block
  q, s = quantize_blocks(w, power_of_two=pow2)
  q_ref, s_ref = quantize(w, pow2=pow2)
  np.testing.assert_array_equal(s, s_ref)
  np.testing.assert_array_equal(q.view(np.uint8), q_ref.view(np.uint8))


def test_quantize_fp8_cli_writes_a_checkpoint_the_engine_serves_with_fp8_weights(tmp_path):
  """`python -m models.quantize_fp8` on a sharded checkpoint: the same files and names, every linear matrix
  in e4m3 with its block scales (the embedding, lm_head, norms, router and indexer weights_proj kept), the
  index and config updated, side files copied; it loads (dequantized within e4m3's rounding of the original)
  and --weight-dtype fp8 gives dequantize-at-load's tokens. A second pass, or a bad --output, is refused
  with nothing written."""
  from hisparse_jax.engine import Engine, Request
  from models.loader import _TensorStore
  from models.quantize_fp8 import UNQUANTIZED

  src = write_random_checkpoint(tmp_path / "src", DSV32, seed=21)
  tensors = load_file(f"{src}/model.safetensors")
  names = sorted(tensors)
  halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
  (tmp_path / "src" / "model.safetensors").unlink()
  tensors = {k: v.astype(ml_dtypes.bfloat16) if k in halves["b.safetensors"] else v for k, v in tensors.items()}
  for fn, keys in halves.items():  # one file float32, the other bfloat16
    save_file({k: tensors[k] for k in keys}, f"{src}/{fn}", metadata={"format": "pt"})
  index = {"metadata": {}, "weight_map": {k: fn for fn, keys in halves.items() for k in keys}}
  (tmp_path / "src" / "model.safetensors.index.json").write_text(json.dumps(index))
  (tmp_path / "src" / "tokenizer_config.json").write_text("{}")
  out = tmp_path / "fp8"
  r = subprocess.run(
    [sys.executable, "-m", "models.quantize_fp8", "--model-path", src, "--output", str(out)],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert sorted(p.name for p in out.iterdir()) == [
    "a.safetensors",
    "b.safetensors",
    "config.json",
    "model.safetensors.index.json",
    "tokenizer_config.json",
  ]
  store = _TensorStore(str(out), fp8_block_size=(BLOCK, BLOCK))  # (safetensors' numpy reader has no FP8)
  written = {k: store.read_raw(k) for k in store.keys()}
  assert {os.path.basename(store.file(k)) for k in written} == {"a.safetensors", "b.safetensors"}
  quantized = [k for k in names if k + "_scale_inv" in written]
  assert f"wrote {out}: {len(quantized)} matrices in FP8" in r.stdout
  assert sorted(written) == sorted(names + [k + "_scale_inv" for k in quantized])
  weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
  assert all(weight_map[k + "_scale_inv"] == weight_map[k] == index["weight_map"][k] for k in quantized)
  for k in names:
    kept = any(u in k for u in UNQUANTIZED) or tensors[k].ndim != 2
    assert (k in quantized) != kept, k
    if kept:
      np.testing.assert_array_equal(written[k], tensors[k])
    else:
      assert written[k].dtype == F8 and written[k + "_scale_inv"].dtype == np.float32
      deq = reference_dequantize(written[k], written[k + "_scale_inv"])
      # e4m3 rounds to 3 mantissa bits: at most half its largest step (32 at 448), 16 scales = max|w| / 28.
      w = tensors[k].astype(np.float32)
      np.testing.assert_allclose(deq, w, rtol=0, atol=float(np.abs(w).max()) / 28 * 1.001)
  assert any("mlp.experts." in k for k in quantized) and any("indexer.wk" in k for k in quantized)
  assert {tensors[k].dtype for k in quantized} == {np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)}
  assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]

  def tokens(**kw):
    e = Engine(str(out), max_seq_len=64, max_running_requests=2, **kw)
    reqs = [Request(str(i), p, max_new_tokens=5, ignore_eos=True) for i, p in enumerate([[5, 6, 7] * 4, [8, 9]])]
    for q in reqs:
      e.submit(q)
    e.run()
    return [q.output_ids for q in reqs]

  assert tokens(weight_dtype="fp8") == tokens()
  for argv, message in [
    ([str(out), str(tmp_path / "again")], "already quantized (config.json has a quantization"),
    ([src, str(out)], f"--output {out} exists and is not an empty directory"),
    ([src, f"{src}/inside"], "is inside the checkpoint being converted"),
  ]:
    r = subprocess.run(
      [sys.executable, "-m", "models.quantize_fp8", "--model-path", argv[0], "--output", argv[1]],
      capture_output=True,
      text=True,
      timeout=300,
      cwd=REPO,
    )
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert not (tmp_path / "again").exists() and not os.path.exists(f"{src}/inside")
  # A NaN in a weight is refused, naming the tensor (it passed through as NaN blocks), and so is a float64
  # weight past float32's range (it overflowed in the cast for quantizing); a FIFO side file before any work.
  # Nothing is written either way.
  key = "model.layers.1.self_attn.o_proj.weight"
  for case in ("nan", "float64", "fifo"):
    bad = tmp_path / case
    bad.mkdir()
    for f in os.listdir(src):
      if f.endswith(".safetensors"):
        t = load_file(os.path.join(src, f))
        if key in t:
          if case == "float64":
            t[key] = t[key].astype(np.float64)
          t[key][0, 0] = 1e300 if case == "float64" else np.nan
        save_file(t, str(bad / f))
      elif f != "tokenizer.json":
        (bad / f).write_bytes(open(os.path.join(src, f), "rb").read())
    if case == "fifo":
      os.mkfifo(bad / "tokenizer.json")  # (refused before the NaN is read)
    message = "tokenizer.json is not a regular file" if case == "fifo" else f"tensor {key!r} holds a NaN or an infinity"
    r = subprocess.run(
      [sys.executable, "-m", "models.quantize_fp8", "--model-path", str(bad), "--output", str(tmp_path / "q")],
      capture_output=True,
      text=True,
      timeout=300,
      cwd=REPO,
    )
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (case, r.stderr)
    assert not (tmp_path / "q").exists()
