"""--hisparse-config parsing: defaults from the model, errors that name the key."""

import pytest

from hisparse_jax.config import ConfigError, HiSparseConfig


def test_defaults_from_model_top_k():
  c = HiSparseConfig.from_json(None, model_top_k=2048)
  assert (c.top_k, c.device_buffer_size, c.host_to_device_ratio) == (2048, 4096, 8)


def test_eviction_policy_key():
  assert HiSparseConfig.from_json(None, 32).eviction == "lru"
  for policy in ("lru", "clock", "score", "score_ema"):
    assert HiSparseConfig.from_json(f'{{"eviction": "{policy}"}}', 32).eviction == policy


def test_resident_fraction_key():
  assert HiSparseConfig.from_json(None, 32).resident_fraction == 0.0
  assert HiSparseConfig.from_json('{"resident_fraction": 0.25}', 32).resident_fraction == 0.25


def test_prefetch_key():
  assert HiSparseConfig.from_json(None, 32).prefetch == "none"
  c = HiSparseConfig.from_json('{"prefetch": "next_layer", "eviction": "clock"}', 32)
  assert c.prefetch == "next_layer" and c.prefetch_positions == 32
  assert HiSparseConfig.from_json('{"prefetch": "next_layer", "prefetch_depth": 8}', 32).prefetch_positions == 8


def test_full_sglang_config():
  c = HiSparseConfig.from_json('{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}', 2048)
  assert c == HiSparseConfig(2048, 4096, 8)


@pytest.mark.parametrize(
  "text, message",
  [
    ('{"top_k": 32, "device_buffer_size": 16}', r"device_buffer_size \(16\) must be >= top_k \(32\)"),
    ('{"host_to_device_ratio": 0}', "host_to_device_ratio must be >= 1"),
    ('{"top_k": 64}', r"top_k \(64\) differs from the model's index_topk \(32\)"),
    ('{"top_k": 4, "prefetch": "next_layer", "prefetch_depth": 6}', r"top_k \(4\) differs"),  # the cause first
    ('{"buffer": 1}', r"unknown key\(s\) \['buffer'\]"),
    ('{"device_buffer_size": "64"}', "device_buffer_size must be an integer"),
    ('{"device_buffer_size": 64.0}', "device_buffer_size must be an integer"),
    ('{"top_k": true}', "top_k must be an integer"),
    ("[1, 2]", "must be a JSON object"),
    ("{top_k: 1}", "not valid JSON"),
    ('{"device_buffer_size": ' + "9" * 5000 + "}", "not valid JSON.*digits"),  # past int()'s digit limit
    ("[" * 100_000, "not valid JSON: nested too deeply"),  # json's recursion, not a traceback
    ('{"a":' * 100_000, "not valid JSON: nested too deeply"),
    ('{"eviction": "score_ema", "eviction": "lru"}', "key 'eviction' is given more than once"),  # json keeps the last
    ('{"eviction": "mru"}', r"eviction must be one of \['lru', 'clock', 'score', 'score_ema'\], got 'mru'"),
    ('{"eviction": 1}', "eviction must be one of"),
    ('{"eviction": ["lru"]}', "eviction must be one of"),
    ('{"resident_fraction": 1}', r"resident_fraction must be a number in \[0, 1\), got 1"),
    ('{"resident_fraction": -0.1}', "resident_fraction must be a number in"),
    ('{"resident_fraction": "0.5"}', "resident_fraction must be a number in"),
    ('{"resident_fraction": true}', "resident_fraction must be a number in"),
    ('{"resident_fraction": NaN}', "resident_fraction must be a number in"),
    ('{"prefetch": "yes"}', r"prefetch must be one of \['none', 'next_layer'\], got 'yes'"),
    ('{"prefetch": true}', "prefetch must be one of"),
    ('{"prefetch_depth": 8}', r'prefetch_depth is set but prefetch is "none"'),
    (
      '{"prefetch": "next_layer", "prefetch_depth": 33}',
      r"prefetch_depth must be an integer in \[1, top_k = 32\], got 33",
    ),
    ('{"prefetch": "next_layer", "prefetch_depth": 0}', "prefetch_depth must be an integer in"),
    ('{"prefetch": "next_layer", "prefetch_depth": 2.0}', "prefetch_depth must be an integer in"),
    ('{"prefetch": "next_layer", "eviction": "score"}', r'prefetch "next_layer" needs eviction "lru" or "clock"'),
    ('{"prefetch": "next_layer", "eviction": "score_ema"}', r'needs eviction "lru" or "clock": eviction "score_ema"'),
  ],
)
def test_errors_name_the_key(text, message):
  with pytest.raises(ConfigError, match=message):
    HiSparseConfig.from_json(text, model_top_k=32)


def test_the_python_constructor_defaults_the_buffer_as_the_json_does():
  assert HiSparseConfig(top_k=32) == HiSparseConfig.from_json("{}", model_top_k=32)
  assert HiSparseConfig(top_k=32).device_buffer_size == 64


def test_the_python_constructor_takes_numpy_numbers_as_python_ones():
  """Sizes computed with numpy (np.int64 from a shape, np.float32) are taken and stored as int / float, so the
  config compares, hashes and serializes as the JSON's; numpy bools and non-integral floats stay errors."""
  import numpy as np

  c = HiSparseConfig(np.int64(32), np.int32(64), np.int64(2), resident_fraction=np.float32(0.5))
  assert c == HiSparseConfig(32, 64, 2, resident_fraction=0.5)
  assert [type(v) for v in (c.top_k, c.device_buffer_size, c.host_to_device_ratio, c.resident_fraction)] == [
    int,
    int,
    int,
    float,
  ]
  for bad, message in (
    (dict(top_k=np.bool_(True)), "top_k must be an integer"),
    (dict(top_k=32, host_to_device_ratio=np.float64(2)), "host_to_device_ratio must be an integer"),
  ):
    with pytest.raises(ConfigError, match=message):
      HiSparseConfig(**bad)


def test_host_pool_rows_is_ratio_times_hot_rows():
  assert HiSparseConfig(2048, 4096, 8).host_pool_rows(3) == 8 * 3 * 4097


def test_a_model_dirs_hisparse_config_json_is_read_only_as_a_bounded_regular_file(tmp_path):
  """The model directory's hisparse_config.json (used without --hisparse-config): a FIFO would block start-up
  forever and a link to /dev/zero fill memory; both are start-up errors naming the file, as is one too large."""
  import os

  from hisparse_jax.engine.args import MODEL_HISPARSE_FILE, EngineArgs, StartupError
  from models.config import DSAConfig
  from tests.tiny_model import tiny_model_dir

  cfg = DSAConfig.from_pretrained(tiny_model_dir())
  args = EngineArgs(model_path=str(tmp_path), enable_hisparse=True)
  path = tmp_path / MODEL_HISPARSE_FILE
  path.write_text('{"device_buffer_size": 24}')
  assert args.resolve_hisparse(str(tmp_path), cfg).device_buffer_size == 24
  for make, message in (
    (lambda: os.mkfifo(path), "is not a regular file"),
    (lambda: os.symlink("/dev/zero", path), "is not a regular file"),
    (lambda: path.write_text(" " * (16 * 2**20 + 1)), "at most 16777216 are read"),
  ):
    path.unlink()
    make()
    with pytest.raises(StartupError, match=f"{MODEL_HISPARSE_FILE}.* {message}"):
      args.resolve_hisparse(str(tmp_path), cfg)


def test_other_runtimes_dtype_spellings_are_taken():
  """vLLM's / SGLang's --dtype auto (the checkpoint's) and --kv-cache-dtype fp8 (e4m3) mean ours; anything
  else still fails validation naming the flag."""
  from hisparse_jax.engine.args import EngineArgs, StartupError

  args = EngineArgs(dtype="auto", kv_cache_dtype="fp8")
  assert (args.dtype, args.kv_cache_dtype) == (None, "fp8_e4m3")
  args.validate()
  with pytest.raises(StartupError, match="--dtype 'float16': expected one of float32, bfloat16"):
    EngineArgs(dtype="float16").validate()
  with pytest.raises(StartupError, match="--kv-cache-dtype 'fp8_e5m2': expected one of auto, fp8_e4m3"):
    EngineArgs(kv_cache_dtype="fp8_e5m2").validate()


def test_a_file_name_for_the_json_gets_a_hint(tmp_path):
  cfg = tmp_path / "cfg.json"
  cfg.write_text('{"top_k": 32}')
  with pytest.raises(ConfigError, match=r"not valid JSON: .* is a file: the flag takes JSON text, e\.g\. \"\$\(cat "):
    HiSparseConfig.from_json(str(cfg), model_top_k=32)
  with pytest.raises(ConfigError) as e:
    HiSparseConfig.from_json(str(tmp_path / "none.json"), model_top_k=32)
  assert "is a file" not in str(e.value)
