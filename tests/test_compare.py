"""`python -m models.compare` (the porting guide's check) against a transformers-made checkpoint."""

import os
import re
import subprocess
import sys

from tests.oracle_runner import ORACLE_PYTHON, ORACLE_SCRIPT, REPO, require_oracle


def test_compare_reports_error_and_greedy_agreement(tmp_path):
  require_oracle()
  ck = tmp_path / "ck"
  r = subprocess.run(
    [ORACLE_PYTHON, str(ORACLE_SCRIPT), "--make-checkpoint", str(ck), "--seed", "5"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "models.compare",
      "--model-path",
      str(ck),
      "--input-ids",
      ",".join(str(t) for t in [0] + list(range(3, 40))),
      "--max-new-tokens",
      "8",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  err = float(re.search(r"max abs error ([0-9.e+-]+)", r.stdout).group(1))
  assert err <= 1e-4
  assert "first 8 of 8 tokens agree" in r.stdout


def test_compare_without_oracle_says_how_to_get_it(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "models.compare",
      "--model-path",
      str(tmp_path),
      "--input-ids",
      "1,2",
      "--oracle-python",
      os.path.join(str(tmp_path), "nope"),
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 2 and "make oracle" in r.stderr


def test_compare_on_an_unloadable_checkpoint_says_why_in_one_line(tmp_path):
  """A directory of PyTorch pickles (the loader names the converter); the oracle is not reached."""
  import shutil
  from tests.tiny_model import tiny_model_dir

  shutil.copy(os.path.join(tiny_model_dir(), "config.json"), tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "models.compare",
      "--model-path",
      str(tmp_path),
      "--input-ids",
      "1,2",
      "--oracle-python",
      sys.executable,
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "cannot load the model: ValueError: no *.safetensors weights" in r.stderr and "models.from_torch" in r.stderr


def test_compare_refuses_bad_ids_and_lengths_in_one_line():
  from tests.tiny_model import tiny_model_dir

  for ids, extra, message in (
    ("0,x,5", [], "--input-ids must be comma-separated integers"),
    ("0,99999", [], "(got id 99999)"),
    ("0,5", ["--max-new-tokens", "100000000"], "exceeds the model's max_position_embeddings"),
  ):
    r = subprocess.run(
      [
        sys.executable,
        "-m",
        "models.compare",
        "--model-path",
        tiny_model_dir(),
        "--input-ids",
        ids,
        "--oracle-python",
        sys.executable,
        *extra,
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_compare_an_fp8_checkpoint_and_refuse_an_orbax_one(tmp_path):
  """An FP8 block-quantized checkpoint (models.quantize_fp8 of the tiny model): transformers dequantizes it on a
  CPU (its FP8 loader needs accelerate, in the oracle venv) as our loader does, so the logits agree to float32
  rounding; a sequence of at most index_topk (8) tokens has no top-k cut-off, so the greedy tokens agree too.
  An orbax directory is refused in one line, naming where its HF source is."""
  require_oracle()
  from tests.tiny_model import tiny_model_dir

  fp8 = tmp_path / "fp8"
  r = subprocess.run(
    [sys.executable, "-m", "models.quantize_fp8", "--model-path", tiny_model_dir(), "--output", str(fp8)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "models.compare",
      "--model-path",
      str(fp8),
      "--input-ids",
      "1,5,9,13",
      "--max-new-tokens",
      "5",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert float(re.search(r"max abs error ([0-9.e+-]+)", r.stdout).group(1)) <= 1e-4, r.stdout
  assert "first 5 of 5 tokens agree" in r.stdout and "note:" not in r.stdout, r.stdout
  orbax = tmp_path / "orbax"
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", tiny_model_dir(), "--output", str(orbax)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr
  r = subprocess.run(
    [sys.executable, "-m", "models.compare", "--model-path", str(orbax), "--input-ids", "1,5"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 2 and "is an orbax checkpoint, which transformers cannot read" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr


def test_compare_with_an_unreadable_tokenizer_says_so_in_one_line(tmp_path):
  import shutil
  from tests.tiny_model import tiny_model_dir

  model = tmp_path / "m"
  shutil.copytree(tiny_model_dir(), model)
  (model / "tokenizer.json").write_bytes(b"\xff\xfe not json")
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "models.compare",
      "--model-path",
      str(model),
      "--text",
      "hi",
      "--oracle-python",
      sys.executable,
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 2 and "tokenizer.json: not a tokenizers JSON file" in r.stderr, r.stderr
  assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
