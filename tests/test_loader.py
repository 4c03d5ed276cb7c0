"""Config parsing, HF checkpoint loading and random checkpoints (no oracle needed)."""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.config import DSAConfig
from models.deepseek_v32 import decode_step, prefill_prompts, prefill_step, split_model
from models.kv_protocol import ContiguousKVCache
from models.loader import load_hf
from models.random_checkpoint import default_model_config, write_random_checkpoint

TINY = {
  "architectures": ["DeepseekV32ForCausalLM"],
  "model_type": "deepseek_v32",
  "vocab_size": 300,
  "hidden_size": 32,
  "intermediate_size": 64,
  "moe_intermediate_size": 16,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "q_lora_rank": 16,
  "kv_lora_rank": 16,
  "qk_nope_head_dim": 8,
  "qk_rope_head_dim": 8,
  "v_head_dim": 8,
  "n_routed_experts": 4,
  "n_shared_experts": 1,
  "num_experts_per_tok": 2,
  "n_group": 2,
  "topk_group": 1,
  "routed_scaling_factor": 2.5,
  "first_k_dense_replace": 1,
  "max_position_embeddings": 128,
  "rope_theta": 10000.0,
  "index_n_heads": 4,
  "index_head_dim": 16,
  "index_topk": 4,
  "initializer_range": 0.1,
  "dtype": "float32",
}


def _params(model) -> dict:
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_params(a, b):
  pa, pb = _params(a), _params(b)
  assert pa.keys() == pb.keys()
  for k in pa:
    np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.fixture
def ckpt(tmp_path):
  return write_random_checkpoint(tmp_path / "ck", TINY, seed=3)


# ----------------------------------------------------------------------------- config
def test_config_fields_and_derived():
  cfg = DSAConfig.from_hf_config({**TINY, "eos_token_id": [1, 2], "dtype": None, "torch_dtype": "bfloat16"})
  assert cfg.latent_dim == 16 + 8
  assert cfg.qk_head_dim == 16
  assert cfg.eos_token_ids == (1, 2)
  assert cfg.dtype == "bfloat16"
  assert cfg.rope.rope_type == "default" and cfg.rope.theta == 10000.0
  assert cfg.softmax_scale == pytest.approx(16**-0.5)
  assert DSAConfig.from_hf_config({k: v for k, v in TINY.items() if k != "dtype"}).dtype == "float32"


def test_both_rope_forms_parse_identically():
  yarn = {
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
  }
  legacy = {**TINY, "rope_theta": 5000.0, "rope_scaling": {"type": "yarn", **yarn}}
  new = {k: v for k, v in TINY.items() if k != "rope_theta"}
  new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, **yarn}
  a, b = DSAConfig.from_hf_config(legacy), DSAConfig.from_hf_config(new)
  assert a.rope == b.rope and a.rope.rope_type == "yarn" and a.rope.theta == 5000.0
  m = 0.1 * np.log(4.0) + 1.0
  assert a.softmax_scale == pytest.approx(16**-0.5 * m * m)
  assert a.rope.cos_sin_scale == pytest.approx(1.0)
  np.testing.assert_array_equal(a.rope.inv_freq(8), b.rope.inv_freq(8))
  # factor None -> max_position_embeddings / original
  c = DSAConfig.from_hf_config(
    {**TINY, "rope_scaling": {"type": "yarn", "factor": None, "original_max_position_embeddings": 32}}
  )
  assert c.rope.factor == pytest.approx(128 / 32)


@pytest.mark.parametrize(
  "change, needle",
  [
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({"model_type": "deepseek_v3"}, "deepseek_v3"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"qk_rope_head_dim": 15}, "'qk_rope_head_dim' must be even"),
    # Configs that used to load and then fail inside the first step (or allocate without bound).
    ({"topk_group": 3}, r"topk_group=3 must be <= n_group=2"),
    ({"num_experts_per_tok": 3}, r"num_experts_per_tok=3 must be <= the 2 experts of topk_group=1 groups"),
    ({"rope_theta": 0}, r"config key 'rope_theta' must be > 0, got 0"),
    ({"rope_theta": -5.0}, r"'rope_theta' must be > 0"),
    ({"index_topk": 10**9}, r"index_topk=1000000000 must be <= max_position_embeddings=128"),
    ({"max_position_embeddings": 10**15}, r"'max_position_embeddings' must be in \[1, 2147483647\]"),
    ({"num_hidden_layers": 2**40}, r"'num_hidden_layers' must be in \[1, 2147483647\]"),
    (
      {"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}},
      r"rope_scaling key 'original_max_position_embeddings' must be an integer in \[1, ",
    ),
    (
      {"rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1e400}},
      r"'original_max_position_embeddings' must be an integer",
    ),
    ({"rope_scaling": {"type": "yarn", "factor": 0}}, r"rope_scaling key 'factor' must be > 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "mscale": "1"}}, r"'mscale' must be a finite number"),
    ({"eos_token_id": "x"}, r"'eos_token_id' must be a token id or a list of them, got 'x'"),
    ({"eos_token_id": {"a": 1}}, r"'eos_token_id' must be a token id"),
    ({"eos_token_id": [1, -2]}, r"'eos_token_id' must be a token id"),
    ({"bos_token_id": 1.5}, r"'bos_token_id' must be a token id, got 1.5"),
    ({"tie_word_embeddings": "no"}, r"'tie_word_embeddings' must be true or false, got 'no'"),
    ({"rms_norm_eps": -1}, r"'rms_norm_eps' must be >= 0"),
    ({"routed_scaling_factor": float("nan")}, r"'routed_scaling_factor' must be a finite number"),
    ({"architectures": "DeepseekV32ForCausalLM"}, r"'architectures' must be a list of class names"),
    ({"architectures": 5}, r"'architectures' must be a list"),
    ({"scoring_func": "softmax"}, r"unsupported scoring_func='softmax' \(only 'sigmoid'"),
    ({"moe_layer_freq": 2}, r"unsupported moe_layer_freq=2"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "beta_fast": -5}}, r"'beta_fast' must be >= 0, got -5"),
    ({"num_hidden_layers": 2**31 - 1}, r"'num_hidden_layers' is 2147483647; at most 1024 are supported"),
    ({"n_routed_experts": 2**20, "n_group": 1}, r"'n_routed_experts' is 1048576; at most 65536"),
    ({"eos_token_id": [1, 300]}, r"'eos_token_id': token id 300 is outside the vocabulary \[0, 300\)"),
    ({"attention_bias": "no"}, r"'attention_bias' must be true or false, got 'no'"),
    ({"rope_interleave": "no"}, r"'rope_interleave' must be true or false"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 5}}, r"weight_block_size 5"),
    ({"partial_rotary_factor": "abc"}, r"'partial_rotary_factor' must be a finite number"),
    ({"initializer_range": "x"}, r"'initializer_range' must be a finite number"),
    # Finite in JSON, but not as a float (an OverflowError traceback) or in the model's float32 RoPE tables.
    ({"rms_norm_eps": 10**400}, r"'rms_norm_eps' must be a finite number, got 1000000000.*\.\.\.$"),
    ({"rope_theta": 10**40}, r"the RoPE parameters \(rope_theta=1e\+40, .* overflow float32"),
    (
      {"rope_scaling": {"type": "yarn", "factor": 2.0, "mscale": 1.0, "mscale_all_dim": -1e308}},
      r"the RoPE parameters .*mscale_all_dim -1e\+308.* overflow float32",
    ),
  ],
)
def test_unsupported_config_raises_naming_it(change, needle):
  with pytest.raises(ValueError, match=needle):
    DSAConfig.from_hf_config({**TINY, **change})


def test_config_json_nested_too_deeply_or_too_large_is_a_one_line_error(tmp_path, ckpt):
  with open(f"{ckpt}/config.json", "w") as f:
    f.write('{"x": ' + "[" * 100000 + "]" * 100000 + "}")
  with pytest.raises(ValueError, match=r"config.json: JSON nested too deeply"):
    DSAConfig.from_pretrained(ckpt)
  with open(f"{ckpt}/config.json", "w") as f:
    f.write(" " * (16 * 2**20 + 1))
  with pytest.raises(ValueError, match=r"config.json is 16777217 bytes; at most 16777216 are read"):
    DSAConfig.from_pretrained(ckpt)


def test_an_index_nested_too_deeply_or_naming_a_file_with_nul_is_a_one_line_error(ckpt):
  index = f"{ckpt}/model.safetensors.index.json"
  for text, message in (
    ('{"weight_map": ' + "[" * 100000 + "]" * 100000 + "}", "JSON nested too deeply"),
    (json.dumps({"weight_map": {"a": "x\0y.safetensors"}}), r"names 'x\\x00y.safetensors'"),
  ):
    with open(index, "w") as f:
      f.write(text)
    with pytest.raises(ValueError, match=message):
      load_hf(ckpt)
  with pytest.raises(ValueError, match=r"config key 'dtype' must be a dtype name such as \"bfloat16\", got \[\]"):
    DSAConfig.from_hf_config({**TINY, "dtype": []})


def test_missing_required_config_key():
  cfg = dict(TINY)
  del cfg["index_topk"]
  with pytest.raises(ValueError, match="index_topk"):
    DSAConfig.from_hf_config(cfg)


def test_unsupported_architecture_via_load_hf(tmp_path, ckpt):
  bad = json.load(open(f"{ckpt}/config.json"))
  bad["architectures"] = ["DeepseekV3ForCausalLM"]
  json.dump(bad, open(f"{ckpt}/config.json", "w"))
  with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
    load_hf(ckpt)


# ----------------------------------------------------------------------------- loading
def test_load_shapes_and_dtypes(tmp_path):
  ck = write_random_checkpoint(tmp_path / "bf", {**TINY, "dtype": "bfloat16"}, seed=0)
  cfg, model = load_hf(ck)
  assert cfg.dtype == "bfloat16"
  assert model.embed_tokens.get_value().dtype == jnp.bfloat16
  moe = model.layers[1].mlp
  assert moe.gate_kernel.get_value().dtype == jnp.float32
  assert moe.e_score_correction_bias.get_value().dtype == jnp.float32
  assert model.layers[0].self_attn.indexer.weights_proj.kernel.get_value().dtype == jnp.float32
  assert moe.gate_proj.get_value().shape == (4, 32, 16) and moe.down_proj.get_value().shape == (4, 16, 32)
  cfg32, model32 = load_hf(ck, dtype=jnp.float32)
  assert cfg32.dtype == "float32" and model32.embed_tokens.get_value().dtype == jnp.float32
  # HF stores Linear [out, in]; we store kernel [in, out]
  raw = load_file(f"{ck}/model.safetensors")
  np.testing.assert_array_equal(
    np.asarray(model32.layers[0].self_attn.q_a_proj.kernel.get_value()),
    raw["model.layers.0.self_attn.q_a_proj.weight"].astype(np.float32).T,
  )


def test_missing_tensor_raises_naming_key(ckpt):
  key = "model.layers.1.self_attn.indexer.wk.weight"
  tensors = load_file(f"{ckpt}/model.safetensors")
  del tensors[key]
  save_file(tensors, f"{ckpt}/model.safetensors")
  with pytest.raises(ValueError, match=key.replace(".", r"\.")):
    load_hf(ckpt)
  # a missing expert is reported by its per-expert key
  tensors = load_file(f"{ckpt}/model.safetensors")
  tensors[key] = np.zeros((16, 32), np.float32)
  del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
  save_file(tensors, f"{ckpt}/model.safetensors")
  with pytest.raises(ValueError, match=r"experts\.3\.up_proj"):
    load_hf(ckpt)


def test_a_config_promising_more_than_the_files_fails_before_building_the_model(ckpt):
  """num_hidden_layers or n_routed_experts beyond the checkpoint: refused by a lookup, not after building
  shapes for every promised layer and expert (10^5 layers took minutes; the config refuses more than 1024
  layers and 65536 experts outright)."""
  import time

  for change, key in (
    ({"num_hidden_layers": 1024}, "model.layers.1023.input_layernorm.weight"),
    ({"n_routed_experts": 65536, "n_group": 1}, "model.layers.1.mlp.experts.65535"),
  ):
    cfg = json.load(open(f"{ckpt}/config.json"))
    json.dump({**cfg, **change}, open(f"{ckpt}/config.json", "w"))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"missing tensor '{key}"):
      load_hf(ckpt)
    assert time.monotonic() - t0 < 10  # a lookup (the limit only catches a return to building first)
    json.dump(cfg, open(f"{ckpt}/config.json", "w"))
  # Both at their limits, with exactly the tensors those lookups find (a 0.8 MB file): the files' tensor count
  # against what the experts alone need refuses it (a table of 10^8 keys took > 9 GB).
  cfg = json.load(open(f"{ckpt}/config.json"))
  json.dump(
    {**cfg, "num_hidden_layers": 1024, "n_routed_experts": 65536, "n_group": 1}, open(f"{ckpt}/config.json", "w")
  )
  tensors = load_file(f"{ckpt}/model.safetensors")
  tensors["model.layers.1023.input_layernorm.weight"] = np.ones(32, np.float32)
  tensors["model.layers.1.mlp.experts.65535.gate_proj.weight"] = np.ones((16, 32), np.float32)
  save_file(tensors, f"{ckpt}/model.safetensors")
  t0 = time.monotonic()
  with pytest.raises(
    ValueError,
    match=r"holds \d+ tensors, fewer than the 201129984 routed-expert weights of "
    r"config.json's 1023 MoE layers x n_routed_experts=65536",
  ):
    load_hf(ckpt)
  assert time.monotonic() - t0 < 10


def test_files_smaller_than_the_routed_experts_need_are_refused_before_the_key_table(ckpt):
  """Whatever the layout (transformers' fused one needs only 2 tensors a layer, each of them tiny in a hostile
  file), the experts' parameters take a byte each at least: a config promising more is refused at once."""
  import time

  cfg = json.load(open(f"{ckpt}/config.json"))
  json.dump({**cfg, "moe_intermediate_size": 2**30}, open(f"{ckpt}/config.json", "w"))
  t0 = time.monotonic()
  with pytest.raises(
    ValueError,
    match=r"weight files hold \d+ bytes, fewer than the 412316860416 routed-expert "
    r"parameters of config.json \(1 MoE layers x n_routed_experts=4 x 3 x "
    r"moe_intermediate_size=1073741824 x hidden_size=32\)",
  ):
    load_hf(ckpt)
  assert time.monotonic() - t0 < 10


def test_a_tensor_in_two_unindexed_files_is_refused(ckpt):
  """Without a weight index, a tensor in two *.safetensors files has no right answer (the later file won)."""
  key = "model.layers.1.self_attn.o_proj.weight"
  tensors = load_file(f"{ckpt}/model.safetensors")
  os.rename(f"{ckpt}/model.safetensors", f"{ckpt}/a.safetensors")  # (a model.safetensors is read alone)
  save_file({key: tensors[key] + 1}, f"{ckpt}/zz.safetensors")
  with pytest.raises(ValueError, match=rf"tensor '{key}' is in both a.safetensors and zz.safetensors"):
    load_hf(ckpt)


def test_weights_must_be_floating_point(ckpt):
  tensors = load_file(f"{ckpt}/model.safetensors")
  tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.int32)
  save_file(tensors, f"{ckpt}/model.safetensors")
  with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' has dtype int32; weights must be floating"):
    load_hf(ckpt)


def test_weight_files_must_be_regular_files_inside_the_directory(tmp_path, ckpt):
  """An index entry outside the directory, and weight files that are a dangling link, a directory or a FIFO
  (which would block the reader forever): named errors before anything is opened, and the engine's
  start-up error (the fingerprint reads the same files)."""
  import os
  import shutil
  from hisparse_jax.engine import Engine
  from hisparse_jax.engine.args import StartupError
  from models.convert import model_fingerprint

  os.rename(f"{ckpt}/model.safetensors", f"{ckpt}/w.safetensors")
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  shutil.copy(f"{ckpt}/w.safetensors", outside / "w.safetensors")
  keys = list(load_file(f"{ckpt}/w.safetensors"))
  for name in ("../elsewhere/w.safetensors", str(outside / "w.safetensors")):
    json.dump({"weight_map": dict.fromkeys(keys, name)}, open(f"{ckpt}/model.safetensors.index.json", "w"))
    with pytest.raises(ValueError, match="weight files must be inside"):
      load_hf(ckpt)
  json.dump({"weight_map": [1, 2]}, open(f"{ckpt}/model.safetensors.index.json", "w"))
  with pytest.raises(ValueError, match="weight_map must map tensor names to file names"):
    load_hf(ckpt)
  os.remove(f"{ckpt}/model.safetensors.index.json")
  for make, what in (
    (lambda p: os.symlink(tmp_path / "gone", p), "is a broken link"),
    (os.mkdir, "is not a regular file"),
    (os.mkfifo, "is not a regular file"),
  ):
    bad = f"{ckpt}/zz.safetensors"
    make(bad)
    with pytest.raises(ValueError, match=f"weight file {bad} {what}"):
      load_hf(ckpt)
    with pytest.raises(ValueError, match=what):
      model_fingerprint(ckpt)
    with pytest.raises(StartupError, match=f"cannot load the model: ValueError: weight file {bad} {what}"):
      Engine(str(ckpt), max_seq_len=64)
    os.rmdir(bad) if os.path.isdir(bad) and not os.path.islink(bad) else os.remove(bad)
  load_hf(ckpt)  # and the directory loads again
  # The JSON and tokenizer files beside the weights: a FIFO would block the reader, /dev/zero never end.
  from hisparse_jax.engine.args import load_tokenizer_or_fail

  for name in ("config.json", "model.safetensors.index.json", "tokenizer.json"):
    path = f"{ckpt}/{name}"
    keep = f"{ckpt}/keep" if os.path.exists(path) else None
    if keep:
      os.rename(path, keep)
    for make, what in (
      (os.mkfifo, "is not a regular file"),
      (lambda p: os.symlink("/dev/zero", p), "is not a regular"),
    ):
      make(path)
      with pytest.raises((ValueError, StartupError), match=f"{name} {what}"):
        if name == "tokenizer.json":
          load_tokenizer_or_fail(str(ckpt))
        else:
          Engine(str(ckpt), max_seq_len=64)
      os.remove(path)
    if keep:
      os.rename(keep, path)
  load_hf(ckpt)


def test_page_tables_past_host_memory_are_refused_before_loading(ckpt):
  """max_position_embeddings near int32's limit: the default --max-seq-len would need page tables of tens
  of GiB (a row of max_seq_len / page_size per request slot): a start-up error naming the flag, before any
  weight is read or table allocated."""
  from hisparse_jax.engine import Engine
  from hisparse_jax.engine.args import StartupError

  cfg = json.load(open(f"{ckpt}/config.json"))
  json.dump({**cfg, "max_position_embeddings": 2**31 - 1}, open(f"{ckpt}/config.json", "w"))
  with pytest.raises(
    StartupError,
    match=r"--max-seq-len 2147483647: the KV page table memory needs [\d.]+ GiB, more "
    r"than .*; lower --max-seq-len",
  ):
    Engine(str(ckpt), max_running_requests=64, page_size=16)


def test_sharded_index_loading(tmp_path, ckpt):
  _, ref = load_hf(ckpt)
  tensors = load_file(f"{ckpt}/model.safetensors")
  keys = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
  out = tmp_path / "sharded"
  out.mkdir()
  weight_map = {}
  for fname, ks in shards.items():
    save_file({k: tensors[k] for k in ks}, str(out / fname))
    weight_map.update({k: fname for k in ks})
  (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  (out / "config.json").write_text(open(f"{ckpt}/config.json").read())
  _, model = load_hf(out)
  _assert_same_params(model, ref)


def test_safetensors_files_beside_model_safetensors_are_named(ckpt, caplog):
  """As in transformers, model.safetensors (or an index) names the checkpoint's files; another .safetensors
  file beside it is not read, and a WARNING says so (a tensor only there is then reported missing)."""
  _, ref = load_hf(ckpt)
  save_file({"lm_head.weight": np.zeros((300, 32), np.float32)}, f"{ckpt}/model-extra.safetensors")
  with caplog.at_level("WARNING", logger="models.loader"):
    _, model = load_hf(ckpt)
  _assert_same_params(model, ref)
  assert [r.getMessage() for r in caplog.records] == [
    f"{ckpt}: 1 other .safetensors file(s) not read (model.safetensors names the checkpoint's files): "
    "model-extra.safetensors"
  ]


def test_mtp_layer_keys_skipped(ckpt, caplog):
  """The multi-token-prediction layer config.json declares (num_nextn_predict_layers, after the decoder's
  layers) is left out with an INFO line; a layer beyond it, or a tensor no parameter reads, loads the same
  model with a WARNING naming it (a config.json that says fewer layers than the files hold)."""
  _, ref = load_hf(ckpt)
  tensors = load_file(f"{ckpt}/model.safetensors")
  n = TINY["num_hidden_layers"]
  for suffix, shape in [
    ("eh_proj.weight", (32, 64)),
    ("enorm.weight", (32,)),
    ("hnorm.weight", (32,)),
    ("self_attn.q_a_proj.weight", (16, 32)),
    ("mlp.experts.0.gate_proj.weight", (16, 32)),
    ("shared_head.head.weight", (300, 32)),
  ]:
    tensors[f"model.layers.{n}.{suffix}"] = np.ones(shape, np.float32)
  save_file(tensors, f"{ckpt}/model.safetensors")
  config = json.loads(open(f"{ckpt}/config.json").read())
  with open(f"{ckpt}/config.json", "w") as f:
    json.dump({**config, "num_nextn_predict_layers": 1}, f)
  with caplog.at_level("INFO", logger="models.loader"):
    _, model = load_hf(ckpt)
  _assert_same_params(model, ref)
  assert f"skipping the multi-token-prediction layer(s) [{n}]" in caplog.text
  assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text

  caplog.clear()
  with open(f"{ckpt}/config.json", "w") as f:
    json.dump(config, f)  # no num_nextn_predict_layers: layer n is one config.json does not know of
  tensors["model.layers.0.mlp.experts.99.up_proj.weight"] = np.ones((16, 32), np.float32)
  tensors["lm_head.bias"] = np.ones((300,), np.float32)
  save_file(tensors, f"{ckpt}/model.safetensors")
  with caplog.at_level("INFO", logger="models.loader"):
    _, model = load_hf(ckpt)
  _assert_same_params(model, ref)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 2, caplog.text
  assert (
    f"holds layer(s) [{n}] beyond config.json's num_hidden_layers={n} (+ num_nextn_predict_layers=0)" in warnings[0]
  )
  assert warnings[1].endswith(
    "holds 2 tensor(s) the model does not use, not loaded: lm_head.bias, model.layers.0.mlp.experts.99.up_proj.weight"
  )


def test_fused_expert_layout(ckpt):
  """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
  _, ref = load_hf(ckpt)
  tensors = load_file(f"{ckpt}/model.safetensors")
  p = "model.layers.1.mlp.experts."
  E = TINY["n_routed_experts"]
  gate = [tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(E)]
  up = [tensors.pop(f"{p}{e}.up_proj.weight") for e in range(E)]
  down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
  tensors[p + "gate_up_proj"] = np.stack([np.concatenate([g, u], 0) for g, u in zip(gate, up)])
  tensors[p + "down_proj"] = np.stack(down)
  save_file(tensors, f"{ckpt}/model.safetensors")
  _, model = load_hf(ckpt)
  _assert_same_params(model, ref)


def test_tied_word_embeddings(tmp_path):
  ck = write_random_checkpoint(tmp_path / "tied", {**TINY, "tie_word_embeddings": True}, seed=5)
  assert "lm_head.weight" not in load_file(f"{ck}/model.safetensors")
  cfg, model = load_hf(ck)
  assert model.lm_head is None
  tokens = jnp.asarray([[0, 5, 9, 200]], jnp.int32)
  logits, _ = prefill_prompts(model, tokens, jnp.asarray([4]))
  # the logits of a tied model are norm(h) @ embed^T: check via the last hidden state
  untied = dict(TINY)
  ck2 = write_random_checkpoint(tmp_path / "untied", untied, seed=5)
  tensors = load_file(f"{ck}/model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  save_file(tensors, f"{ck2}/model.safetensors")
  _, model2 = load_hf(ck2)
  logits2, _ = prefill_prompts(model2, tokens, jnp.asarray([4]))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits2), atol=1e-6)


# ----------------------------------------------------------------------------- random checkpoints
def test_random_checkpoint_deterministic(tmp_path):
  a = load_file(write_random_checkpoint(tmp_path / "a", TINY, seed=11) + "/model.safetensors")
  b = load_file(write_random_checkpoint(tmp_path / "b", TINY, seed=11) + "/model.safetensors")
  c = load_file(write_random_checkpoint(tmp_path / "c", TINY, seed=12) + "/model.safetensors")
  assert a.keys() == b.keys() == c.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
  assert json.load(open(tmp_path / "a" / "config.json")) == json.loads(json.dumps(TINY))


def test_default_model_config_greedy_not_degenerate(tmp_path):
  """The embedded default model: parses, loads in bf16, and greedy decoding on its random weights
  does not collapse onto one token."""
  cfgd = default_model_config()
  cfg = DSAConfig.from_hf_config(copy.deepcopy(cfgd))
  assert cfg.vocab_size == 129280 and cfg.dtype == "bfloat16" and cfg.rope.rope_type == "yarn"
  assert cfg.num_hidden_layers == 4 and cfg.first_k_dense_replace == 1 and cfg.index_topk == 32
  ck = write_random_checkpoint(tmp_path / "default", cfgd, seed=20251201)
  cfg, model = load_hf(ck)
  graphdef, state = split_model(model)
  n, steps = 40, 8
  prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, size=(1, 48)).astype(np.int32)
  prompt[0, 0] = 0
  logits, cache = prefill_prompts(model, jnp.asarray(prompt), jnp.asarray([n], jnp.int32), max_len=64)
  assert cache.latent.dtype == jnp.bfloat16 and cache.index_key.dtype == jnp.float32
  nxt, out = int(jnp.argmax(logits[0, n - 1])), []
  for pos in range(n, n + steps):
    out.append(nxt)
    lg, cache = decode_step(graphdef, state, jnp.asarray([nxt], jnp.int32), jnp.asarray([pos], jnp.int32), cache)
    assert np.isfinite(np.asarray(lg)).all()
    nxt = int(jnp.argmax(lg[0]))
  assert len(set(out)) >= steps // 2, out


def test_decode_inactive_rows_and_garbage_cache_stay_finite(tmp_path):
  """Idle rows (position -1) and NaN garbage beyond a row's tokens must not leak NaN/inf into outputs."""
  ck = write_random_checkpoint(tmp_path / "ck", TINY, seed=1)
  cfg, model = load_hf(ck)
  graphdef, state = split_model(model)
  cache = ContiguousKVCache.create(cfg, 3, 32)
  cache = jax.tree_util.tree_map(lambda a: jnp.full_like(a, jnp.nan), cache)  # all garbage
  toks = np.zeros((3, 6), np.int32)
  toks[1] = [0, 7, 8, 9, 10, 11]
  positions = np.full((3, 6), -1, np.int32)
  positions[1] = np.arange(6)  # rows 0 and 2 are all padding: nothing of theirs is written
  _, cache = prefill_step(graphdef, state, jnp.asarray(toks), jnp.asarray(positions), cache)
  lg, cache = decode_step(
    graphdef, state, jnp.asarray([5, 12, 0], jnp.int32), jnp.asarray([-1, 6, -1], jnp.int32), cache
  )
  assert np.isfinite(np.asarray(lg)).all()
  assert np.isnan(np.asarray(cache.latent[:, 0])).all()  # idle rows wrote nothing
  # the active row equals the prefill of the extended sequence
  full, _ = prefill_prompts(model, jnp.asarray([[0, 7, 8, 9, 10, 11, 12]], jnp.int32), jnp.asarray([7], jnp.int32))
  np.testing.assert_allclose(np.asarray(lg[1]), np.asarray(full[0, 6]), atol=1e-4)


# ----------------------------------------------------------------------------- streaming load
def test_progress_bar_flag(ckpt, capfd):
  load_hf(ckpt, progress=True)
  err = capfd.readouterr().err
  assert "MiB read" in err and "param" in err, err[-500:]
  load_hf(ckpt, progress=False)
  assert capfd.readouterr().err == ""
  load_hf(ckpt)  # default: only on a TTY (pytest's stderr is not one)
  assert capfd.readouterr().err == ""


def test_streaming_load_peak_host_memory(tmp_path):
  """Tensors are read one at a time: numpy's peak allocation while loading stays far below the size
  of the checkpoint (bf16 on disk, float32 parameters, so no numpy buffer is aliased by a parameter)."""
  import tracemalloc

  cfg = {
    **TINY,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "vocab_size": 2048,
    "num_hidden_layers": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "n_routed_experts": 8,
    "dtype": "bfloat16",
  }
  ck = write_random_checkpoint(tmp_path / "big", cfg, seed=0)
  load_hf(ck, dtype=jnp.float32)  # warm up (compilation caches etc.)
  import os

  file_bytes = os.path.getsize(f"{ck}/model.safetensors")
  tracemalloc.start()
  try:
    _, model = load_hf(ck, dtype=jnp.float32)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  largest = max(np.asarray(v.get_value()).nbytes for _, v in nnx.to_flat_state(nnx.state(model)))
  print(
    f"checkpoint {file_bytes / 2**20:.2f} MiB, largest parameter {largest / 2**20:.2f} MiB, "
    f"numpy peak during load {peak / 2**20:.2f} MiB"
  )
  assert peak < file_bytes / 4, (peak, file_bytes)
  assert peak < 3 * largest + 4 * 2**20, (peak, largest)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_weight_holding_nan_or_inf_is_refused_naming_it(ckpt, value):
  """One NaN or infinity in a weight decoded token 0 forever (and in the indexer's keys, no top-k at all), exit
  status 0: refused as it is read, naming the parameter; a model already on its devices (an orbax restore) is
  checked by one jitted reduction, with the same message."""
  from models.loader import check_finite

  tensors = load_file(f"{ckpt}/model.safetensors")
  good = tensors["model.layers.1.self_attn.o_proj.weight"].copy()
  tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = value
  save_file(tensors, f"{ckpt}/model.safetensors")
  with pytest.raises(ValueError, match=r"parameter layers/1/self_attn/o_proj/\w+ holds a NaN or an infinity"):
    load_hf(ckpt)
  tensors["model.layers.1.self_attn.o_proj.weight"] = good
  save_file(tensors, f"{ckpt}/model.safetensors")
  _, model = load_hf(ckpt)
  check_finite(model, ckpt)  # a clean model passes
  model.layers[0].mlp.gate_proj.kernel.set_value(model.layers[0].mlp.gate_proj.kernel.get_value().at[0, 0].set(value))
  with pytest.raises(ValueError, match=r"parameter layers/0/mlp/gate_proj/kernel holds a NaN or an infinity"):
    check_finite(model, ckpt)


def test_a_finite_weight_the_compute_dtype_cannot_hold_is_refused(ckpt):
  """3.4e38 is a float32 but an infinity in bfloat16 (it decoded token 0 forever with --dtype bfloat16)."""
  tensors = load_file(f"{ckpt}/model.safetensors")
  tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = 3.4e38
  save_file(tensors, f"{ckpt}/model.safetensors")
  load_hf(ckpt)  # float32: it fits
  with pytest.raises(
    ValueError,
    match=r"parameter layers/1/self_attn/o_proj/\w+ holds a NaN or an infinity \(or a "
    r"value the compute dtype cannot hold\)",
  ):
    load_hf(ckpt, dtype="bfloat16")


def test_a_generated_model_says_so_once_and_gets_the_usual_modes(tmp_path, monkeypatch, caplog):
  """ensure_random_model (the embedded default model's generator) logs where it writes on first use only, and
  its folder and files get the modes of files made under the umask (mkdtemp's and the checkpoint writer's were
  owner-only)."""
  import logging
  import stat

  from hisparse_jax.default_model import ensure_random_model
  from tests.tiny_model import tiny_config

  monkeypatch.setenv("HISPARSE_JAX_CACHE", str(tmp_path))
  old = os.umask(0o027)
  try:
    with caplog.at_level(logging.WARNING, logger="hisparse_jax.default_model"):
      path = ensure_random_model(tiny_config(), 3, "tiny", tokenizer=False)
      assert ensure_random_model(tiny_config(), 3, "tiny", tokenizer=False) == path
  finally:
    os.umask(old)
  assert [r.getMessage() for r in caplog.records] == [
    f"generating the model tiny on its first use (a deterministic random checkpoint) in {path}"
  ]
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o750
  assert {name: stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode) for name in os.listdir(path)} == {
    "config.json": 0o640,
    "model.safetensors": 0o640,
  }


def test_random_checkpoint_command_writes_what_the_function_writes(tmp_path):
  """``python -m models.random_checkpoint``: --help answers (no runpy warning: the package does not import the
  module first); --config/--seed write the function's files byte for byte; a config that is not DSA is exit 2."""
  import subprocess
  import sys

  from tests.tiny_model import tiny_config

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda *a: subprocess.run(
    [sys.executable, "-m", "models.random_checkpoint", *a],
    cwd=root,  # noqa: E731
    capture_output=True,
    text=True,
    timeout=300,
  )
  r = run("--help")
  assert r.returncode == 0 and "--output" in r.stdout and "Warning" not in r.stderr, r.stderr
  cfg = tmp_path / "config.json"
  cfg.write_text(json.dumps(tiny_config()))
  r = run("--output", str(tmp_path / "cli"), "--config", str(cfg), "--seed", "3")
  assert r.returncode == 0 and "model.safetensors" in r.stdout, r.stderr
  want = write_random_checkpoint(tmp_path / "fn", tiny_config(), seed=3)
  for name in ("config.json", "model.safetensors"):
    assert (tmp_path / "cli" / name).read_bytes() == open(os.path.join(want, name), "rb").read(), name
  cfg.write_text(json.dumps({"model_type": "llama"}))
  r = run("--output", str(tmp_path / "bad"), "--config", str(cfg))
  assert r.returncode == 2 and "unsupported model_type 'llama'" in r.stderr, r.stderr
