"""models.moe.grouped_expert_ffn (sparse expert dispatch) against the dense evaluation the model uses today:
every expert on every token, combined with a [T, E] routing-weight matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import block_rows, dense_expert_ffn, grouped_expert_ffn

HI = jax.lax.Precision.HIGHEST


def dense_reference(x, expert, weight, gate, up, down):
  return dense_expert_ffn(x, expert, weight, gate, up, down, precision=HI)


def _case(T, E, k, H, I, routing, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((T, H)), dtype)
  if routing == "random":
    expert = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
  elif routing == "one_group":  # every token to the same k experts: the largest groups
    expert = np.tile(np.arange(k), (T, 1))
  else:  # "last": the highest expert ids only (the searchsorted edge)
    expert = np.tile(np.arange(E - k, E), (T, 1))
  weight = jnp.asarray(rng.random((T, k)), jnp.float32)
  gate, up = (jnp.asarray(rng.standard_normal((E, H, I)) * 0.2, dtype) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((E, I, H)) * 0.2, dtype)
  return x, jnp.asarray(expert, jnp.int32), weight, gate, up, down


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 8, 2), (16, 4, 2), (33, 64, 8), (7, 3, 3), (64, 16, 4)])
@pytest.mark.parametrize("routing", ["random", "one_group", "last"])
@pytest.mark.parametrize("block", [None, 1, 4, 16])
def test_grouped_equals_dense(T, E, k, routing, block):
  args = _case(T, E, k, 32, 16, routing, seed=T * E + k)
  ref = np.asarray(dense_reference(*args))
  got = np.asarray(jax.jit(lambda *a: grouped_expert_ffn(*a, block=block, precision=HI))(*args))
  assert got.shape == ref.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_grouped_bfloat16_close_to_float32():
  args = _case(24, 16, 4, 64, 32, "random", seed=3)
  ref = np.asarray(dense_reference(*args))
  x, expert, weight, gate, up, down = args
  bf16 = [a.astype(jnp.bfloat16) for a in (x, gate, up, down)]
  got = np.asarray(jax.jit(grouped_expert_ffn)(bf16[0], expert, weight, *bf16[1:]))
  assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_unrouted_experts_are_not_read():
  """Work is per routed (token, expert) pair: NaN weights in experts nobody is routed to change nothing."""
  x, expert, weight, gate, up, down = _case(6, 8, 2, 16, 8, "one_group", seed=5)  # experts 0 and 1 only
  ref = np.asarray(grouped_expert_ffn(x, expert, weight, gate, up, down, precision=HI))
  poisoned = [w.at[2:].set(jnp.nan) for w in (gate, up, down)]
  got = np.asarray(grouped_expert_ffn(x, expert, weight, *poisoned, precision=HI))
  np.testing.assert_array_equal(got, ref)
  assert np.isfinite(got).all()


def test_block_rows():
  assert block_rows(1, 8, 256) == 1  # decode of one token over 256 experts
  assert block_rows(256, 8, 256) == 8  # 256 decoding tokens, DeepSeek-V3.2 routing
  assert block_rows(2048, 8, 256) == 64  # a prefill chunk
  assert block_rows(100000, 8, 8, max_block=64) == 64


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_model_logits_equal_dense_experts(tmp_path, monkeypatch, arch):
  """The model with grouped dispatch against the same model evaluating every expert densely: logits
  within 1e-5 (float32) and the same greedy tokens."""
  import models.deepseek_v32 as dsv32
  from models.deepseek_v32 import prefill_prompts
  from models.loader import load_hf
  from models.random_checkpoint import write_random_checkpoint
  from tests.test_fp8_checkpoint import DSV32, GLM

  config = {**(DSV32 if arch == "deepseek_v32" else GLM), "n_routed_experts": 8, "num_experts_per_tok": 3}
  if arch == "deepseek_v32":
    config.update(n_group=2, topk_group=2)
  _, model = load_hf(write_random_checkpoint(tmp_path / arch, config, seed=11))
  tokens = jnp.asarray(np.random.default_rng(2).integers(2, 300, (2, 20)), jnp.int32)
  lengths = jnp.asarray([20, 9], jnp.int32)
  grouped = np.asarray(prefill_prompts(model, tokens, lengths)[0])
  monkeypatch.setattr(
    dsv32,
    "grouped_expert_ffn",
    lambda x, e, w, g, u, d, precision=None, scales=None, compute_dtype=None: dense_reference(x, e, w, g, u, d),
  )
  dense = np.asarray(prefill_prompts(model, tokens, lengths)[0])
  assert not np.array_equal(grouped, dense)  # two different evaluations (the patch took effect)
  for b, n in enumerate([20, 9]):
    np.testing.assert_allclose(grouped[b, :n], dense[b, :n], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(grouped[b, :n].argmax(-1), dense[b, :n].argmax(-1))


@pytest.mark.parametrize("block", [None, 1, 4])
def test_absent_experts_contribute_zero(block):
  """Ids outside [0, E) (experts another device holds under expert parallelism) add nothing: the result
  equals the dense evaluation with those slots' weights zeroed, and a token routed only elsewhere gets 0."""
  x, expert, weight, gate, up, down = _case(12, 8, 3, 32, 16, "random", seed=11)
  rng = np.random.default_rng(4)
  absent = rng.random(expert.shape) < 0.4
  absent[0] = True  # token 0: every expert elsewhere
  ids = jnp.where(absent, jnp.asarray(rng.choice([-1, 8, 100], expert.shape), jnp.int32), expert)
  got = np.asarray(
    jax.jit(lambda *a: grouped_expert_ffn(*a, block=block, precision=HI))(x, ids, weight, gate, up, down)
  )
  ref = np.asarray(dense_reference(x, expert, jnp.where(absent, 0.0, weight), gate, up, down))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  assert not got[0].any()
