"""The KV cache's FP8 rows (``--kv-cache-dtype fp8_e4m3``, models/kv_format.py): their byte layout, their round
trip against the fake quantization they must equal bit for bit, and the model and engine storing them
losslessly."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine.args import EngineArgs, StartupError
from hisparse_jax.memory import backend as kvmem
from models import kv_format
from models.fp8_numerics import fake_quant_e4m3, quantize_e4m3
from models.loader import load_hf
from tests.kv_harness import teacher_forced_logits
from models.random_checkpoint import write_random_checkpoint
from tests.tiny_model import tiny_config, tiny_model_dir


def test_row_layout_sizes():
  # DeepSeek-V3.2 / GLM-5: kv_lora_rank 512, rope 64, bfloat16 -> FlashMLA's 656-byte FP8 row.
  assert kv_format.row_spec("fp8_e4m3", 512, 64, jnp.bfloat16) == (656, np.dtype(np.uint8))
  assert kv_format.row_spec("auto", 512, 64, jnp.bfloat16) == (576, np.dtype(jnp.bfloat16))
  # A partial last block still gets its own scale; the RoPE part keeps the compute dtype's bytes.
  assert kv_format.row_spec("fp8_e4m3", 200, 16, np.float32) == (200 + 2 * 4 + 16 * 4, np.dtype(np.uint8))
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"):
    kv_format.row_spec("fp8", 512, 64, jnp.bfloat16)
  # Indexer keys: DeepSeek's FP8 key cache, 128 e4m3 values + one float32 scale.
  assert kv_format.index_spec("fp8_e4m3", 128) == (132, np.dtype(np.uint8))
  assert kv_format.index_spec("auto", 128) == (128, np.dtype(np.float32))
  assert kv_format.index_spec("fp8_e4m3", 200) == (208, np.dtype(np.uint8))


def _bits(x) -> np.ndarray:
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@settings(max_examples=25, deadline=None)
@given(
  C=st.sampled_from([16, 128, 200, 512]),
  dr=st.sampled_from([8, 64]),
  dtype=st.sampled_from([np.float32, jnp.bfloat16]),
  log_scale=st.integers(-30, 12),
  seed=st.integers(0, 2**16),
  zero_rows=st.integers(0, 2),
)
def test_round_trip_is_the_fake_quantization(C, dr, dtype, log_scale, seed, zero_rows):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((4, 3, C + dr)) * 2.0**log_scale
  x[0, :zero_rows] = 0.0  # all-zero blocks: amax floored at 1e-4
  x = jnp.asarray(x, dtype)
  stored = kv_format.encode("fp8_e4m3", x, C)
  width, sdt = kv_format.row_spec("fp8_e4m3", C, dr, dtype)
  assert stored.shape == (4, 3, width) and stored.dtype == sdt
  # The layout: e4m3 bytes, then float32 scales (little-endian), then the RoPE part's own bytes.
  q, scale = quantize_e4m3(x[..., :C])
  nb = -(-C // 128)
  s = np.asarray(stored)
  np.testing.assert_array_equal(s[..., :C], _bits(q))
  np.testing.assert_array_equal(s[..., C : C + 4 * nb].copy().view("<f4"), np.asarray(scale))
  np.testing.assert_array_equal(s[..., C + 4 * nb :].copy().view(np.dtype(dtype)), np.asarray(x[..., C:]))
  # Decoding gives exactly what --fp8-numerics simulates: bit for bit, RoPE part untouched.
  want = jnp.concatenate([fake_quant_e4m3(x[..., :C]), x[..., C:]], axis=-1)
  got = kv_format.decode("fp8_e4m3", stored, C, dtype)
  assert got.dtype == x.dtype
  np.testing.assert_array_equal(_bits(got), _bits(want))
  # Top-k padding: a cache's zero rows decode to zeros.
  assert not np.asarray(kv_format.decode("fp8_e4m3", jnp.zeros_like(stored), C, dtype), np.float32).any()


@pytest.mark.parametrize("Di", [1, 16, 128, 129, 200, 256])
def test_key_round_trip_is_the_fake_quantization(Di):
  keys = jnp.asarray(np.random.default_rng(Di).standard_normal((5, 2, Di)) * 3.0, jnp.float32)
  stored = kv_format.encode_keys("fp8_e4m3", keys)
  assert stored.shape == (5, 2, kv_format.index_spec("fp8_e4m3", Di)[0]) and stored.dtype == jnp.uint8
  got = kv_format.decode_keys(stored)  # Di recovered from the width
  np.testing.assert_array_equal(_bits(got), _bits(fake_quant_e4m3(keys)))
  assert kv_format.decode_keys(keys) is keys and kv_format.encode_keys("auto", keys) is keys
  assert not np.asarray(kv_format.decode_keys(jnp.zeros_like(stored))).any()
  with pytest.raises(TypeError, match="stored indexer keys must be float32 or uint8"):
    kv_format.decode_keys(keys.astype(jnp.bfloat16))
  for fn, args in (
    (kv_format.encode_keys, (keys,)),
    (kv_format.encode, (keys, 8)),
    (kv_format.decode, (stored, 8, jnp.float32)),
  ):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"):
      fn("fp8", *args)


@pytest.mark.parametrize("shape", [(0, 80), (2, 0, 80)])
def test_no_rows_encode_to_no_rows(shape):
  # An empty chunk (no tokens) is a shape, not an error: encode and decode keep its leading axes.
  x = jnp.zeros(shape, jnp.float32)
  stored = kv_format.encode("fp8_e4m3", x, 64)
  assert stored.shape == (*shape[:-1], kv_format.row_spec("fp8_e4m3", 64, 16, np.float32)[0])
  assert kv_format.decode("fp8_e4m3", stored, 64, jnp.float32).shape == shape
  keys = kv_format.encode_keys("fp8_e4m3", jnp.zeros((*shape[:-1], 16), jnp.float32))
  assert keys.shape == (*shape[:-1], 20) and kv_format.decode_keys(keys).shape == (*shape[:-1], 16)


def test_rows_of_the_wrong_width_are_refused():
  for width in (4, 133, 136, 266):  # no Di gives these (Di 128 -> 132 bytes, 129 -> 137; 256 -> 264, 257 -> 269)
    with pytest.raises(ValueError, match=f"{width} bytes is not the width of an FP8 indexer key"):
      kv_format.decode_keys(jnp.zeros((2, width), jnp.uint8))
  assert [w for w in range(1, 300) if _valid_key_width(w)] == [
    kv_format.index_spec("fp8_e4m3", d)[0] for d in range(1, 300) if d + 4 * -(-d // 128) < 300
  ]
  with pytest.raises(ValueError, match="FP8 latent rows must be uint8 of 32 \\+ 4 \\+ \\(RoPE values x 4\\) bytes"):
    kv_format.decode("fp8_e4m3", jnp.zeros((2, 38), jnp.uint8), 32, jnp.float32)  # 2 RoPE bytes: half a float32
  with pytest.raises(ValueError, match="got float32 rows of 48"):
    kv_format.decode("fp8_e4m3", jnp.zeros((2, 48), jnp.float32), 32, jnp.float32)


def _valid_key_width(width):
  try:  # traced only (the check is on shapes): compiling ~300 widths' decodes took 45 s
    jax.eval_shape(kv_format.decode_keys, jax.ShapeDtypeStruct((1, width), jnp.uint8))
    return True
  except ValueError:
    return False


def test_encoding_a_fake_quantized_row_again_changes_nothing():
  # --fp8-numerics rounds the latent before the cache sees it; storing that in FP8 must keep it exactly,
  # including blocks whose rounded maximum lands on 224 x scale (the ue8m0 scale then halves).
  rng = np.random.default_rng(3)
  x = rng.standard_normal((64, 256)).astype(np.float32) * 2.0 ** rng.integers(-20, 20, (64, 1))
  x[0, :128] = np.linspace(-1, 1, 128) * 225.0 * 2.0**-10  # scale 2**-10; 225 rounds to 224 in e4m3
  fq = fake_quant_e4m3(jnp.asarray(x))
  assert float(quantize_e4m3(jnp.asarray(x[:1, :128]))[1][0, 0]) == 2.0**-10
  assert float(quantize_e4m3(fq[:1, :128])[1][0, 0]) == 2.0**-11  # the second quantization's scale halves
  again = kv_format.decode("fp8_e4m3", kv_format.encode("fp8_e4m3", fq, 256), 256, jnp.float32)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(fq))


def test_fp8_kv_cache_is_fp8_numerics_stored_and_stays_lossless():
  d = tiny_model_dir()
  cfg_sim, sim = load_hf(d, fp8_numerics=True)  # fake-quantized latent and keys in float32 rows
  cfg8, on = load_hf(d, kv_cache_dtype="fp8_e4m3")  # the same values stored as FP8 rows (implies the numerics)
  assert cfg8.kv_cache_dtype == "fp8_e4m3" and cfg_sim.kv_cache_dtype == "auto"
  assert cfg8.fp8_active and not cfg8.fp8_numerics
  prompts = [list(range(2, 42)), list(range(5, 25))]
  l_sim, _ = teacher_forced_logits(cfg_sim, sim, prompts, 5)
  l_dense, dense = teacher_forced_logits(cfg8, on, prompts, 5)
  l_hs, hs = teacher_forced_logits(cfg8, on, prompts, 5, hisparse=HiSparseConfig(top_k=8, device_buffer_size=16))
  # The score-aware policy scores the resident tokens' keys, decoded from the FP8 key pages.
  l_score, _ = teacher_forced_logits(
    cfg8, on, prompts, 5, hisparse=HiSparseConfig(top_k=8, device_buffer_size=16, eviction="score_ema")
  )
  np.testing.assert_array_equal(l_dense, l_sim)  # storing FP8 = simulating it, bit for bit
  np.testing.assert_array_equal(l_hs, l_dense)  # HiSparse over FP8 rows: lossless
  np.testing.assert_array_equal(l_score, l_dense)
  width, _ = cfg8.kv_row()
  C = cfg8.kv_lora_rank
  assert width == C + 4 + cfg8.qk_rope_head_dim * 4 < cfg8.latent_dim * 4  # the tiny model: 100 B against 192
  assert dense.backend.state.latent.dtype == jnp.uint8 and dense.backend.state.latent.shape[-1] == width
  assert dense.backend.state.index.dtype == jnp.uint8 and dense.backend.state.index.shape[-1] == 16 + 4
  state = hs.backend.state
  assert state.host_pool.dtype == state.hot.dtype == state.staging.dtype == state.index.dtype == jnp.uint8
  assert state.hot.shape[-1] == width
  # Rows really went through the host pool, and they hold the quantized latent: the 40-token prompt's
  # position 0 of layer 0, read back from the dense pages, is e4m3 bytes with a power-of-two scale.
  assert sum(hs.backend.swap_stats(hs.kvs[0])[1]) > 0  # misses: rows came from the host pool
  row = np.asarray(dense.backend.state.latent)[0, dense.kvs[0].pages["kv"][0], 0]
  scale = row[C : C + 4].copy().view("<f4")[0]
  assert scale > 0 and np.log2(scale) == np.round(np.log2(scale))
  assert np.isfinite(row[:C].view(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()


def test_layout_bytes_and_backend_checks():
  cfg, _ = load_hf(tiny_model_dir(), kv_cache_dtype="fp8_e4m3")
  fp8 = kvmem.KVLayout.of(cfg, np.float32)
  plain = kvmem.KVLayout.of(cfg.replace(kv_cache_dtype="auto"), np.float32)
  assert (fp8.latent_dim, fp8.dtype, fp8.itemsize, fp8.row_bytes) == (100, "uint8", 1, 100)
  assert (fp8.index_dim, fp8.index_dtype, fp8.index_bytes) == (20, "uint8", cfg.num_hidden_layers * 20)
  assert plain.row_bytes == cfg.latent_dim * 4 and plain.latent_bytes == cfg.num_hidden_layers * plain.row_bytes
  assert (plain.index_dim, plain.index_dtype, plain.index_bytes) == (16, "float32", cfg.num_hidden_layers * 64)
  plan = kvmem.plan(fp8, budget=1 << 22, max_running_requests=2, max_seq_len=64, page_size=16, hisparse=None)
  with pytest.raises(ValueError, match="KV row dtype float32 is not the layout's uint8"):
    kvmem.DenseBackend(plan, fp8, np.float32)
  # Same itemsize, other dtype: rows of bfloat16 are not FP8 bytes reinterpreted, nor float16 bfloat16.
  bf16 = kvmem.KVLayout.of(cfg.replace(kv_cache_dtype="auto"), jnp.bfloat16)
  with pytest.raises(ValueError, match="KV row dtype float16 is not the layout's bfloat16"):
    kvmem.DenseBackend(
      kvmem.plan(bf16, budget=1 << 22, max_running_requests=2, max_seq_len=64, page_size=16, hisparse=None),
      bf16,
      np.float16,
    )


def test_bad_kv_cache_dtype_is_a_startup_error(tmp_path):
  with pytest.raises(StartupError, match="--kv-cache-dtype 'fp8_e5m2': expected one of auto, fp8_e4m3"):
    EngineArgs(kv_cache_dtype="fp8_e5m2").validate()
  assert EngineArgs(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's / SGLang's spelling
  # The FP8 cache stores FP8 values: an explicit --nofp8-numerics beside it is a contradiction, not overridden.
  with pytest.raises(StartupError, match="--nofp8-numerics contradicts --kv-cache-dtype fp8_e4m3"):
    EngineArgs(kv_cache_dtype="fp8_e4m3", fp8_numerics=False).validate()
  EngineArgs(kv_cache_dtype="fp8_e4m3").validate()  # no flag: the cache implies the numerics
  EngineArgs(kv_cache_dtype="fp8_e4m3", fp8_numerics=True).validate()
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
    load_hf(tiny_model_dir(), kv_cache_dtype="e5m2")
  # The FP8 indexer's Hadamard rotation needs a power-of-two key width: refused at start-up, not at the first
  # compile.
  d = write_random_checkpoint(str(tmp_path / "m"), tiny_config(index_head_dim=24), seed=0)
  from hisparse_jax.engine import Engine

  with pytest.raises(StartupError, match="needs a power-of-two index_head_dim; .* has 24"):
    Engine(d, max_seq_len=64, kv_cache_dtype="fp8_e4m3")
