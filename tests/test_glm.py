"""GLM-5 / GLM-5.1 (``glm_moe_dsa``) vs the transformers 5.24 reference, plus its config conventions.

Tiny random fp32 checkpoints are created *by transformers* (``GlmMoeDsaForCausalLM.save_pretrained``,
run in the oracle venv through tests/oracle/hf_oracle.py) and loaded with ``models.loader.load_hf``.
Checked: prefill logits (max abs err <= 1e-4), 16-token greedy continuations through our chunked prefill
+ decode over both runtime KV backends (dense and HiSparse paged pools, prompts 5x longer than
index_topk, so the indexer really selects and HiSparse really swaps), cross-layer top-k sharing
(``indexer_types`` with "shared" layers, consecutive ones included), plain large-theta RoPE and YaRN,
tied embeddings, qk_nope_head_dim != v_head_dim, and a checkpoint written by
``models.random_checkpoint`` read by transformers.

The oracle interpreter is ``$HISPARSE_ORACLE_PYTHON`` (default ``<repo>/.venv-oracle/bin/python``);
the oracle tests are skipped only when it does not exist, and fail instead when ``$CI`` is set.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from models.config import DSAConfig
from models.deepseek_v32 import decode_step, prefill_prompts, split_model
from models.loader import load_hf
from tests.kv_harness import KVHarness
from tests.oracle.tiny_configs import TINY_GLM_CONFIG
from tests.oracle_runner import require_oracle, run_oracle
from models.random_checkpoint import write_random_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]

MAX_NEW = 16
PROMPT_LENS = (5, 40)  # index_topk = 8: shorter than it, and 5x longer
PAD_TO = 48
MAX_SEQ = 64
DEVICE_BUFFER = 16  # HiSparse hot buffer: the 40-token prompt overflows it
TOL = 1e-4

_YARN = {
  "rope_type": "yarn",
  "rope_theta": 1000000.0,
  "factor": 4.0,
  "original_max_position_embeddings": 64,
  "beta_fast": 32,
  "beta_slow": 1,
  "mscale": 1.0,
  "mscale_all_dim": 1.0,
}

# name -> (seed, overrides of hf_oracle.TINY_GLM_CONFIG)
CONFIGS = {
  "glm_full": (11, {}),  # every layer runs its indexer; plain RoPE, theta 1e6
  "glm_shared_yarn_tied": (
    12,
    {"indexer_types": ["full", "shared", "shared", "full"], "tie_word_embeddings": True, "rope_parameters": _YARN},
  ),
}

# Our numpy writer, transformers reader (key names and the config form of a GLM checkpoint).
OURS_CONFIG = {
  **{k: v for k, v in TINY_GLM_CONFIG.items() if k != "rms_norm_eps"},  # the model type's default applies
  "architectures": ["GlmMoeDsaForCausalLM"],
  "model_type": "glm_moe_dsa",
  "num_hidden_layers": 3,
  "indexer_types": ["full", "shared", "full"],
  "dtype": "float32",
}


def _prompts(vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(4321)
  return [[0] + rng.integers(2, vocab, size=n - 1).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  """{name: (checkpoint dir, prompts, npz results)}; the oracle runs in parallel subprocesses."""
  require_oracle()
  return run_oracle(
    tmp_path_factory.mktemp("glm_oracle"), _prompts(512), MAX_NEW, CONFIGS, (17, OURS_CONFIG), model_type="glm_moe_dsa"
  )


@functools.lru_cache(maxsize=None)
def _load(ck: str):
  return load_hf(ck)


def _prefill_batch(model, prompts):
  toks = np.zeros((len(prompts), PAD_TO), np.int32)
  for i, p in enumerate(prompts):
    toks[i, : len(p)] = p
  return prefill_prompts(model, jnp.asarray(toks), jnp.asarray([len(p) for p in prompts], jnp.int32))


def _greedy(kind, cfg, model, prompts, max_new):
  """Prefill (chunks of 16) and greedy decode over the runtime's `kind` backend, with an idle row."""
  hisparse = (
    None
    if kind == "dense"
    else HiSparseConfig(top_k=cfg.index_topk, device_buffer_size=DEVICE_BUFFER, host_to_device_ratio=4)
  )
  h = KVHarness(cfg, model, hisparse=hisparse, max_seq_len=MAX_SEQ, page_size=16, chunk=16)
  return h.greedy(prompts, max_new), h


# ----------------------------------------------------------------------------- oracle tests
@pytest.mark.parametrize("name", list(CONFIGS) + ["ours"])
def test_glm_prefill_logits_match_transformers(oracle, name, caplog):
  ck, prompts, ref = oracle[name]
  with caplog.at_level("WARNING", logger="models.loader"):
    load_hf(str(ck))  # (uncached: its log is this test's)
  assert not caplog.records, caplog.text  # every tensor transformers saved is read ("shared" layers have none)
  cfg, model = _load(str(ck))
  assert cfg.model_type == "glm_moe_dsa" and cfg.indexer_rope_interleave and cfg.rope_interleave
  logits, cache = _prefill_batch(model, prompts)
  assert cache.latent.shape == (cfg.num_hidden_layers, len(prompts), PAD_TO, cfg.latent_dim)
  assert cache.index_key.shape == (cfg.num_hidden_layers, len(prompts), PAD_TO, cfg.index_head_dim)
  for i, p in enumerate(prompts):
    err = float(np.abs(np.asarray(logits[i, : len(p)]) - ref[f"logits_{i}"]).max())
    print(f"{name} prompt len {len(p)}: prefill max abs err {err:.3g}")
    assert err <= TOL, (name, len(p), err)


@pytest.mark.parametrize("kind", ["dense", "hisparse"])
@pytest.mark.parametrize("name", list(CONFIGS) + ["ours"])
def test_glm_greedy_continuation_matches_transformers(oracle, name, kind):
  ck, prompts, ref = oracle[name]
  cfg, model = _load(str(ck))
  ours, harness = _greedy(kind, cfg, model, prompts, MAX_NEW)
  for i, p in enumerate(prompts):
    expect = ref[f"greedy_{i}"].tolist()
    assert ours[i] == expect, (name, kind, len(p), ours[i], expect)
    assert ref[f"cached_{i}"].tolist() == expect  # transformers' own cached decode agrees
  if kind == "hisparse":  # the long prompt really went past the hot buffer and swapped rows in
    assert int(harness.swap_stats()[:, 1, 1].min()) > 0


def test_glm_decode_after_prefill_matches_extended_prefill(oracle):
  """Prefill 30 tokens, then decode 10 given tokens through the cache (shared layers included): each
  decode logit row matches transformers' prefill logits of the full 40-token sequence."""
  ck, prompts, ref = oracle["glm_shared_yarn_tied"]
  cfg, model = _load(str(ck))
  assert cfg.indexer_types == ("full", "shared", "shared", "full")
  graphdef, state = split_model(model)
  full, n0 = prompts[1], 30
  _, cache = prefill_prompts(
    model, jnp.asarray([full[:n0], [0] * n0], jnp.int32), jnp.asarray([n0, 0]), max_len=MAX_SEQ
  )
  errs = []
  for pos in range(n0, len(full)):
    lg, cache = decode_step(
      graphdef, state, jnp.asarray([full[pos], 0], jnp.int32), jnp.asarray([pos, -1], jnp.int32), cache
    )
    errs.append(float(np.abs(np.asarray(lg[0]) - ref["logits_1"][pos]).max()))
  print(f"glm decode vs transformers prefill: max err {max(errs):.3g}")
  assert max(errs) <= TOL


# ----------------------------------------------------------------------------- no oracle needed
def _glm(**changes) -> dict:
  return {**OURS_CONFIG, **changes}


def test_glm_config_conventions():
  cfg = DSAConfig.from_hf_config({k: v for k, v in _glm().items() if k != "indexer_types"})
  assert cfg.model_type == "glm_moe_dsa"
  assert cfg.rope_interleave and cfg.indexer_rope_interleave
  assert cfg.rms_norm_eps == 1e-5  # GlmMoeDsaConfig default when config.json has none
  assert cfg.latent_norm_eps == 1e-6  # q_a/kv_a layernorm eps in transformers 5.24, for both model types
  assert cfg.indexer_types is None  # all full (index_topk_freq 1)
  assert cfg.rope.rope_type == "default" and cfg.rope.theta == 1e6
  assert DSAConfig.from_hf_config(_glm(rms_norm_eps=3e-6)).rms_norm_eps == 3e-6
  # DeepSeek-V3.2 keeps its own conventions
  ds = DSAConfig.from_hf_config(
    {**_glm(), "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"], "indexer_types": None}
  )
  assert ds.rope_interleave and not ds.indexer_rope_interleave and ds.rms_norm_eps == 1e-6
  # explicit flags that agree with transformers are accepted
  ok = DSAConfig.from_hf_config(_glm(rope_interleave=True, indexer_rope_interleave=True))
  assert ok.indexer_rope_interleave


def test_glm_indexer_type_resolution():
  """Same precedence and formula as transformers 5.24 GlmMoeDsaConfig.__post_init__."""
  base = {k: v for k, v in _glm(num_hidden_layers=6, mlp_layer_types=None).items() if k != "indexer_types"}
  # index_topk_freq 3, offset 2: full iff max(i - 1, 0) % 3 == 0 -> layers 0, 1, 4
  cfg = DSAConfig.from_hf_config({**base, "index_topk_freq": 3, "index_skip_topk_offset": 2})
  assert cfg.indexer_types == ("full", "full", "shared", "shared", "full", "shared")
  assert [cfg.topk_source(i) for i in range(6)] == [0, 1, 1, 1, 4, 4]
  cfg = DSAConfig.from_hf_config({**base, "index_topk_freq": 2})  # default offset 2
  assert cfg.indexer_types == ("full", "full", "shared", "full", "shared", "full")
  # a pattern overrides freq/offset; indexer_types overrides both
  cfg = DSAConfig.from_hf_config({**base, "index_topk_pattern": "FSSFFS", "index_topk_freq": 2})
  assert cfg.indexer_types == ("full", "shared", "shared", "full", "full", "shared")
  types = ["full", "full", "full", "shared", "full", "full"]
  cfg = DSAConfig.from_hf_config({**base, "indexer_types": types, "index_topk_pattern": "FSSFFS"})
  assert cfg.indexer_types == tuple(types)
  assert [cfg.has_indexer(i) for i in range(6)] == [t == "full" for t in types]
  # all full -> None (no sharing)
  assert DSAConfig.from_hf_config({**base, "indexer_types": ["full"] * 6}).indexer_types is None


@pytest.mark.parametrize(
  "change, needle",
  [
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"indexer_types": ["shared", "full", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "shared"]}, "indexer_types"),
    ({"indexer_types": None, "index_topk_pattern": "FXF"}, "index_topk_pattern"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
    (
      {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
      "partial_rotary_factor",
    ),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}}, "llama3"),
    ({"architectures": ["DeepseekV32ForCausalLM"]}, "DeepseekV32ForCausalLM"),
  ],
)
def test_glm_unsupported_config_raises_naming_it(change, needle):
  with pytest.raises(ValueError, match=needle):
    DSAConfig.from_hf_config(_glm(**change))


def test_deepseek_refuses_shared_indexer_layers():
  ds = {**_glm(), "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]}
  with pytest.raises(ValueError, match="indexer_types"):
    DSAConfig.from_hf_config(ds)
  with pytest.raises(ValueError, match="indexer_rope_interleave"):
    DSAConfig.from_hf_config({**ds, "indexer_types": None, "indexer_rope_interleave": True})


def test_glm_mlp_layer_types_from_config(tmp_path):
  cfg = DSAConfig.from_hf_config(_glm(mlp_layer_types=["sparse", "dense", "sparse"]))
  assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
  ck = write_random_checkpoint(tmp_path / "ck", _glm(mlp_layer_types=["sparse", "dense", "sparse"]), seed=2)
  _, model = load_hf(ck)
  assert hasattr(model.layers[0].mlp, "gate_kernel") and not hasattr(model.layers[1].mlp, "gate_kernel")


class _SpyCache:
  """Wraps a cache and records the protocol calls (layer, method) made while tracing decode."""

  def __init__(self, inner, log):
    self.inner, self.log = inner, log

  def append(self, layer, positions, latent, index_key):
    self.log.append((layer, "append"))
    return _SpyCache(self.inner.append(layer, positions, latent, index_key), self.log)

  def index_keys(self, layer, start, size):
    self.log.append((layer, "index_keys"))
    return self.inner.index_keys(layer, start, size)

  def gather(self, layer, positions, topk, index_q=None, index_w=None):
    # A layer with an indexer hands the cache its queries (for score-aware eviction); a shared one has none.
    self.log.append((layer, "gather" if index_q is not None and index_w is not None else "gather (no indexer)"))
    rows, inner = self.inner.gather(layer, positions, topk, index_q, index_w)
    return rows, _SpyCache(inner, self.log)


def test_score_eviction_needs_an_indexer_on_every_layer(tmp_path):
  """A model with shared-indexer layers has no scores there: eviction "score" is a start-up error naming the
  key and the layers, not a silent fallback (so is "score_ema"); lru and clock start."""
  from hisparse_jax.config import HiSparseConfig
  from hisparse_jax.engine import Engine
  from hisparse_jax.engine.args import StartupError

  ck = write_random_checkpoint(tmp_path / "ck", OURS_CONFIG, seed=5)
  top_k = OURS_CONFIG["index_topk"]
  for eviction in ("score", "score_ema"):
    with pytest.raises(StartupError, match=rf'eviction "{eviction}" needs every layer.*layers \[1\]'):
      Engine(ck, hisparse=HiSparseConfig(top_k, 2 * top_k, 2, eviction=eviction), max_seq_len=64)
  Engine(ck, hisparse=HiSparseConfig(top_k, 2 * top_k, 2, eviction="clock"), max_seq_len=64).close()


def test_shared_layers_use_only_append_and_gather(tmp_path):
  """A shared layer appends its latent and gathers with the borrowed top-k; it never reads index keys.
  Its decode output equals the prefill of the extended sequence (so the borrowed top-k is right)."""
  ck = write_random_checkpoint(tmp_path / "ck", OURS_CONFIG, seed=5)
  cfg, model = load_hf(ck)
  assert model.layers[1].self_attn.indexer is None and model.layers[2].self_attn.indexer is not None
  toks = np.random.default_rng(0).integers(2, 512, size=(1, 21)).astype(np.int32)
  n = 20
  _, cache = prefill_prompts(model, jnp.asarray(toks[:, :n]), jnp.asarray([n], jnp.int32), max_len=32)
  assert not np.asarray(cache.index_key[1]).any()  # a shared layer has no indexer keys (zeros in the cache)
  log: list = []
  lg, _ = model.decode(
    jnp.asarray(toks[:, n]), jnp.asarray([n], jnp.int32), _SpyCache(cache, log), window=32, key_block=32
  )
  # index_keys once per key block scored (one block here: 32 keys cover 21 positions)
  assert log == [
    (0, "append"),
    (0, "index_keys"),
    (0, "gather"),
    (1, "append"),
    (1, "gather (no indexer)"),
    (2, "append"),
    (2, "index_keys"),
    (2, "gather"),
  ]
  full, _ = prefill_prompts(model, jnp.asarray(toks), jnp.asarray([n + 1], jnp.int32))
  np.testing.assert_allclose(np.asarray(lg[0]), np.asarray(full[0, n]), atol=1e-4)


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-v", "-s"]))
