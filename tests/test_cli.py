"""The batch script and the server's start-up, run as a user would (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

from tests.tiny_model import TINY_HISPARSE, tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300):
  return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_generate_jsonl_with_bad_lines(tmp_path):
  prompts = tmp_path / "p.jsonl"
  lines = [
      {"input_ids": list(range(2, 40))},          # longer than the hot buffer (16)
      {"input_ids": []},                           # empty prompt
      {"input_ids": [3, 4, 5], "max_new_tokens": 0},
      {"input_ids": [3, 4, 5], "max_new_tokens": 600},  # beyond the 512-token context
      {"text": "no tokenizer in this model dir"},
      {"input_ids": [3, 4, 5], "max_new_tokens": 4},
      {"input_ids": [3, 9999]},                    # outside the 512-token vocabulary
  ]
  prompts.write_text("\n".join(json.dumps(l) for l in lines) + "\nnot json\n")
  out = tmp_path / "out.jsonl"
  r = run("-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", str(prompts),
          "--output", str(out), "--max-new-tokens", "6", "--enable-hisparse",
          "--hisparse-config", json.dumps(TINY_HISPARSE))
  assert r.returncode == 0, r.stderr
  res = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(res) == 8
  assert len(res[0]["output_ids"]) == 6 and res[0]["misses"] > 0 and res[0]["hits"] > 0
  assert res[5]["output_ids"] and len(res[5]["output_ids"]) <= 4
  assert "empty prompt" in res[1]["error"] and res[1]["code"] == "INVALID_ARGUMENT"
  assert "max_new_tokens must be >= 1" in res[2]["error"]
  assert "exceeds the model context of 512" in res[3]["error"]
  assert "no tokenizer.json" in res[4]["error"]
  assert "outside the vocabulary" in res[6]["error"]
  assert "not JSON" in res[7]["error"]
  # Dense mode gives the same tokens (lossless).
  r = run("-m", "hisparse_jax.generate", "--model-path", tiny_model_dir(), "--prompts", str(prompts),
          "--output", str(tmp_path / "dense.jsonl"), "--max-new-tokens", "6")
  dense = [json.loads(l) for l in (tmp_path / "dense.jsonl").read_text().splitlines()]
  assert dense[0]["output_ids"] == res[0]["output_ids"] and "misses" not in dense[0]


@pytest.mark.parametrize("script", ["generate", "server"])
@pytest.mark.parametrize("flags, message", [
    (["--enable-hisparse", "--hisparse-config", "{bad json"], "--hisparse-config: hisparse config is not valid JSON"),
    (["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 4}'], "device_buffer_size (4) must be >= top_k (8)"),
    (["--enable-hisparse", "--hisparse-config", '{"slots": 4}'], "unknown key(s) ['slots']"),
    (["--model-path", "/nonexistent/model"], "--model-path '/nonexistent/model': no such directory"),
    (["--dtype", "float16"], "--dtype 'float16'"),
])
def test_bad_startup_flags_exit_with_a_message(tmp_path, script, flags, message):
  if "--model-path" not in flags:
    flags = ["--model-path", tiny_model_dir(), *flags]
  args = (["-m", "hisparse_jax.generate", "--prompts", os.devnull] if script == "generate"
          else ["run_server.py", "--port", "0"])
  r = run(*args, *flags, timeout=120)
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr


def test_model_path_without_config(tmp_path):
  r = run("-m", "hisparse_jax.generate", "--prompts", os.devnull, "--model-path", str(tmp_path))
  assert r.returncode != 0 and "no config.json" in r.stderr and "Traceback" not in r.stderr
