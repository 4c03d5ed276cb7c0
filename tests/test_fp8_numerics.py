"""FP8 deployment numerics: the quantizer against hand-computed values, the rotation, and the model mode."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from models.fp8_numerics import E4M3_MAX, fake_quant_e4m3, hadamard_rotate, quantize_e4m3
from models.loader import load_hf
from tests.kv_harness import teacher_forced_logits
from tests.tiny_model import tiny_model_dir


def test_quantizer_hand_computed_values():
  # amax 896 -> scale 896/448 = 2 (already a power of two): x/2 exactly representable.
  x = jnp.array([[1.0, -2.0, 3.0, 896.0]])
  q, s = quantize_e4m3(x, block=4)
  assert float(s[0, 0]) == 2.0
  np.testing.assert_array_equal(np.asarray(q, np.float32), [[0.5, -1.0, 1.5, 448.0]])
  # amax 300 -> 300/448 = 0.6696 -> ue8m0 rounds UP to 2**0 = 1; e4m3 spacing in [256, 448] is 32,
  # so 300 -> 288 (nearest), 17 -> 16 (spacing 2 in [16, 32], tie to even), 0.3 -> 0.3125.
  q, s = quantize_e4m3(jnp.array([[300.0, 17.0, 0.3, -0.0]]), block=4)
  assert float(s[0, 0]) == 1.0
  np.testing.assert_array_equal(np.asarray(q, np.float32), [[288.0, 16.0, 0.3125, 0.0]])
  # Plain amax/448 scales (no ue8m0): the block max lands exactly on 448.
  q, s = quantize_e4m3(jnp.array([[300.0, 1.0]]), block=2, scale_fmt=None)
  assert np.isclose(float(s[0, 0]), 300.0 / 448.0) and float(q[0, 0].astype(jnp.float32)) == E4M3_MAX
  # Saturation: the clip keeps values past 448 at +-448 (e4m3fn has no inf; unclipped 500 is NaN).
  assert np.isnan(np.float32(np.array(500.0, np.float32).astype(ml_dtypes.float8_e4m3fn)))
  q, s = quantize_e4m3(jnp.array([[1e-6, 0.0]]), block=2)  # all-tiny block: amax floored at 1e-4
  assert float(s[0, 0]) == 2.0 ** np.ceil(np.log2(1e-4 / 448.0))


def test_quantizer_blocks_and_partial_block():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 300)) * np.array([1.0] * 128 + [100.0] * 128 + [0.01] * 44), jnp.float32)
  q, s = quantize_e4m3(x)
  assert q.shape == (3, 300) and s.shape == (3, 3)
  # Every block's scale is a power of two >= amax / 448, and amax / scale lands in (224, 448].
  for b, sl in enumerate([slice(0, 128), slice(128, 256), slice(256, 300)]):
    amax = np.abs(np.asarray(x)[:, sl]).max(-1)
    scale = np.asarray(s)[:, b]
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))
    assert np.all(amax / scale <= 448) and np.all(amax / scale > 224)
  dq = fake_quant_e4m3(x)
  rel = np.abs(np.asarray(dq) - np.asarray(x)) / np.maximum(np.abs(np.asarray(x)), 1e-3)
  assert rel.max() < 2**-3  # e4m3 has 3 mantissa bits


def test_hadamard_rotation_is_orthogonal_and_sylvester():
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 32)), jnp.float32)
  y = hadamard_rotate(x)
  np.testing.assert_allclose(np.asarray(y @ y.T), np.asarray(x @ x.T), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(hadamard_rotate(y)), np.asarray(x), atol=1e-5)  # H/sqrt(d) is an involution
  e0 = hadamard_rotate(jnp.eye(4, dtype=jnp.float32))
  np.testing.assert_allclose(np.asarray(e0) * 2, [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]])
  with pytest.raises(ValueError, match="power-of-two"):
    hadamard_rotate(jnp.ones((2, 48)))


def test_fp8_mode_changes_numerics_slightly_and_stays_lossless():
  d = tiny_model_dir()
  cfg, off = load_hf(d)
  cfg8, on = load_hf(d, fp8_numerics=True)
  assert not cfg.fp8_numerics and cfg8.fp8_numerics
  prompts = [list(range(2, 42)), list(range(5, 25))]
  l_off, _ = teacher_forced_logits(cfg, off, prompts, 6)
  l_dense, dense = teacher_forced_logits(cfg8, on, prompts, 6)
  l_hs, _ = teacher_forced_logits(cfg8, on, prompts, 6, hisparse=HiSparseConfig(top_k=8, device_buffer_size=16))
  np.testing.assert_array_equal(l_hs, l_dense)  # still lossless in FP8 mode
  # A different numerics, not a broken one (on a random tiny model one flipped indexer choice
  # can move a logit a lot, so no closeness bound is asserted here).
  assert np.isfinite(l_dense).all() and np.abs(l_dense - l_off).max() > 1e-6
  # The cached latent (kv_lora part) sits on the e4m3 grid times a power-of-two scale per block.
  pages = dense.kvs[0].pages["kv"]  # the 40-token prompt's pages, in order
  c = np.asarray(dense.backend.state.latent)[:, pages].reshape(cfg.num_hidden_layers, -1, cfg.latent_dim)
  c = c[:, :40, : cfg.kv_lora_rank]
  amax = np.maximum(np.abs(c).max(-1, keepdims=True), 1e-4)
  scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
  grid = (c / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(grid * scale, c)
