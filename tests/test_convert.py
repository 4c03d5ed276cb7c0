"""HF -> orbax conversion: the converted directory decodes exactly like the HF one, everywhere a model path is taken."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, Request
from models.convert import is_orbax_dir, load_model
from models.deepseek_v32 import prefill_prompts
from models.loader import load_hf
from tests.tiny_model import TINY_HISPARSE, tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("conv") / "orbax"
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", tiny_model_dir(), "--output", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  return str(out)


def test_orbax_logits_identical_to_hf(orbax_dir):
  assert is_orbax_dir(orbax_dir) and not is_orbax_dir(tiny_model_dir())
  _, hf = load_hf(tiny_model_dir())
  _, ob = load_model(orbax_dir)
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, 512, (2, 40)), jnp.int32)
  lengths = jnp.asarray([40, 23], jnp.int32)
  a, ca = prefill_prompts(hf, tokens, lengths)
  b, cb = prefill_prompts(ob, tokens, lengths)
  for x, y in ((a, b), (ca.latent, cb.latent), (ca.index_key, cb.index_key)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_engine_and_cli_accept_orbax_dirs(orbax_dir, tmp_path):
  ps = [list(range(2, 30)), [5, 6, 7]]
  outs = []
  for d in (tiny_model_dir(), orbax_dir):
    eng = Engine(d, hisparse=HiSparseConfig(**TINY_HISPARSE), max_running_requests=2, max_seq_len=128)
    reqs = [Request(str(i), p, 8) for i, p in enumerate(ps)]
    for r in reqs:
      eng.submit(r)
    eng.run()
    outs.append([r.output_ids for r in reqs])
  assert outs[0] == outs[1]
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"input_ids": ps[0]}) + "\n")
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "hisparse_jax.generate",
      "--model-path",
      orbax_dir,
      "--prompts",
      str(prompts),
      "--max-new-tokens",
      "8",
      "--output",
      str(tmp_path / "o.jsonl"),
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert json.loads((tmp_path / "o.jsonl").read_text())["output_ids"] == outs[0][0]


def test_convert_to_bfloat16_and_refuses_non_empty_output(orbax_dir, tmp_path):
  out = tmp_path / "bf16"
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "models.convert",
      "--model-path",
      tiny_model_dir(),
      "--output",
      str(out),
      "--dtype",
      "bfloat16",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr
  cfg, model = load_model(str(out))
  assert cfg.dtype == "bfloat16" and model.embed_tokens[...].dtype == jnp.bfloat16
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", tiny_model_dir(), "--output", orbax_dir],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode != 0 and "exists and is not an empty directory" in r.stderr and "Traceback" not in r.stderr
  assert r.stderr.startswith("error: --output ")  # the message names the flag at fault, not the model
  # An orbax directory as the source: said so (it was "no *.safetensors weights found").
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", str(out), "--output", str(tmp_path / "again")],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert (
    r.returncode == 2
    and r.stderr.strip() == f"error: --model-path {str(out)!r} is already an orbax checkpoint (serve it as it is)"
  ), r.stderr
  # An --output that is empty, inside the checkpoint, or where no directory can be made: refused before any work.
  model = tmp_path / "model"
  model.mkdir()
  for f in os.listdir(tiny_model_dir()):
    (model / f).write_bytes(open(os.path.join(tiny_model_dir(), f), "rb").read())
  (tmp_path / "file").write_text("x")
  for output, message in (
    ("", "error: --output '': an empty path"),
    (str(model / "orbax"), "is inside the checkpoint being converted"),
    (
      str(tmp_path / "file" / "orbax"),
      "error: --output %s: cannot create a directory in" % (tmp_path / "file" / "orbax"),
    ),
  ):
    r = subprocess.run(
      [sys.executable, "-m", "models.convert", "--model-path", str(model), "--output", output],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (output, r.stderr[-2000:])
  assert sorted(os.listdir(model)) == sorted(os.listdir(tiny_model_dir()))


def test_a_failed_conversion_says_why_in_one_line_and_leaves_nothing(tmp_path):
  """A truncated weight file (safetensors' own error) and a side file that cannot be copied (after the
  parameters were written): exit 2, one line, and no output directory, so the same command can run again."""
  import shutil

  src = tmp_path / "src"
  shutil.copytree(tiny_model_dir(), src)
  weights = src / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[: len(data) // 2])
  os.mkdir(src / "tokenizer.json")
  for fix in (lambda: weights.write_bytes(data), None):
    out = tmp_path / "out"
    r = subprocess.run(
      [sys.executable, "-m", "models.convert", "--model-path", str(src), "--output", str(out)],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"error: {src}: ") and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary directory
    if fix:
      fix()  # the weights are whole again: now the tokenizer.json directory fails (its own check)
  assert "tokenizer.json is not a regular file" in r.stderr, r.stderr  # a directory
  os.rmdir(src / "tokenizer.json")
  os.symlink("/dev/zero", src / "tokenizer.json")  # copied as it was, it would fill the disk
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", str(src), "--output", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 2 and "tokenizer.json is not a regular file" in r.stderr, r.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
  os.unlink(src / "tokenizer.json")
  (src / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # no server could start from a copy of it
  r = subprocess.run(
    [sys.executable, "-m", "models.convert", "--model-path", str(src), "--output", str(out)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 2 and "tokenizer.json: not a tokenizers JSON file" in r.stderr, r.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_marker_that_is_not_json_is_named(orbax_dir, tmp_path):
  import shutil

  bad = tmp_path / "bad"
  shutil.copytree(orbax_dir, bad)
  (bad / "hisparse_orbax.json").write_text('{"format":\n')
  with pytest.raises(ValueError, match=r"hisparse_orbax.json: not valid JSON \(Expecting value: line 2"):
    load_model(str(bad))


def test_an_older_layout_is_refused_with_the_fix(orbax_dir, tmp_path):
  """A directory converted before lm_head became [vocab, hidden] (no "layout" in its marker) is an error naming
  the fix, not a shape mismatch deep in orbax; the directory is left as it was."""
  assert not load_model(orbax_dir)[0].tie_word_embeddings  # the tiny model has its own lm_head
  old = tmp_path / "old"
  old.mkdir()
  os.symlink(os.path.join(orbax_dir, "params"), old / "params")
  for name in os.listdir(orbax_dir):
    if name != "params":
      (old / name).write_bytes(open(os.path.join(orbax_dir, name), "rb").read())
  marker = json.loads((old / "hisparse_orbax.json").read_text())
  assert marker.pop("layout") == 2
  (old / "hisparse_orbax.json").write_text(json.dumps(marker))
  with pytest.raises(ValueError, match=r"layout 1 \(lm_head as a \[hidden, vocab\] kernel.*python -m models.convert"):
    load_model(str(old))
  assert json.loads((old / "hisparse_orbax.json").read_text()) == marker


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing", "metadata"])
def test_a_damaged_orbax_checkpoint_says_so_in_one_line(orbax_dir, tmp_path, damage):
  """A damaged parameter file (cut short, bytes changed, deleted) is a ValueError of one line giving TensorStore's
  status and the fix, not orbax's multi-line TensorStore spec; the batch script prints it and exits 1."""
  import shutil

  bad = tmp_path / "bad"
  shutil.copytree(orbax_dir, bad)
  data = bad / "params" / "ocdbt.process_0" / "d"
  victim = max(data.iterdir(), key=lambda p: p.stat().st_size)
  blob = victim.read_bytes()
  if damage == "truncated":
    victim.write_bytes(blob[: len(blob) // 2])
  elif damage == "flipped":
    victim.write_bytes(blob[: len(blob) // 2] + bytes(b ^ 0xFF for b in blob[len(blob) // 2 :]))
  elif damage == "missing":
    victim.unlink()
  else:
    (bad / "params" / "_METADATA").write_text('{"tree_metadata": \n')
  with pytest.raises(ValueError) as info:
    load_model(str(bad))
  message = str(info.value)
  if damage == "metadata":  # json's own error, not the StopIteration(19) behind it that the message once gave
    assert "cannot be read (JSONDecodeError: Expecting value: line 2 column 1 (char 19))" in message, message
  assert message.startswith(f"{bad}: the orbax checkpoint cannot be read (") and "\n" not in message, message
  assert "Convert the HF checkpoint again" in message and len(message) < 800, message
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt_ids": [3, 4, 5]}\n')
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "hisparse_jax.generate",
      "--prompts",
      str(prompts),
      "--model-path",
      str(bad),
      "--max-new-tokens",
      "2",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 1 and "the orbax checkpoint cannot be read" in r.stderr, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]


def test_failed_orbax_reads_log_nothing_on_asyncio(orbax_dir, tmp_path):
  """The restore's other reads, left unawaited once one fails, are collected as tasks and futures whose error was
  never retrieved; asyncio logs each with the whole TensorStore spec (seen in CI around the one-line error). The
  restore's filter drops those records (for this checkpoint only) while other asyncio records still log."""
  import gc
  import logging
  import shutil

  records = []

  class Keep(logging.Handler):
    def emit(self, record):
      records.append(record)

  handler = Keep()
  logging.getLogger().addHandler(handler)
  try:
    bad = tmp_path / "bad"
    for _ in range(30):  # one failed restore in five or so leaves such tasks behind, collected later
      shutil.rmtree(bad, ignore_errors=True)
      shutil.copytree(orbax_dir, bad)
      data = bad / "params" / "ocdbt.process_0" / "d"
      max(data.iterdir(), key=lambda p: p.stat().st_size).unlink()
      with pytest.raises(ValueError, match="the orbax checkpoint cannot be read"):
        load_model(str(bad))
      gc.collect()
    asyncio_log = logging.getLogger("asyncio")
    for where in (bad / "params", tmp_path / "elsewhere"):
      asyncio_log.error(
        "Future exception was never retrieved\nfuture: <Future finished>",
        exc_info=ValueError(f'FAILED_PRECONDITION: Error reading "x" at local file "{where}/"'),
      )
    asyncio_log.error("an unrelated asyncio error", exc_info=ValueError("elsewhere"))
  finally:
    logging.getLogger().removeHandler(handler)
  logged = [(r.getMessage().splitlines()[0], str(r.exc_info[1])) for r in records if r.name == "asyncio"]
  assert [m for m, _ in logged] == ["Future exception was never retrieved", "an unrelated asyncio error"], logged
  assert "elsewhere" in logged[0][1], logged


@pytest.mark.parametrize(
  "where", ["marker fifo", "marker /dev/zero", "data fifo", "metadata /dev/zero", "linked data directory"]
)
def test_orbax_files_that_would_block_or_never_end_are_refused(orbax_dir, tmp_path, where):
  """The marker or a file under params/ as a FIFO (blocked the loader forever) or a link to /dev/zero (read until
  memory ran out): one line naming the file, from the loader and from the batch script, before orbax opens any."""
  import shutil

  bad = tmp_path / "bad"
  shutil.copytree(orbax_dir, bad)
  victim = {
    "marker fifo": bad / "hisparse_orbax.json",
    "marker /dev/zero": bad / "hisparse_orbax.json",
    "data fifo": next((bad / "params" / "ocdbt.process_0" / "d").iterdir()),
    "metadata /dev/zero": bad / "params" / "_METADATA",
    "linked data directory": None,
  }[where]
  message = f"{victim} is not a regular file"
  if where == "linked data directory":  # os.walk does not enter a linked directory, but orbax reads through it
    data = bad / "params" / "ocdbt.process_0" / "d"
    shutil.move(str(data), str(tmp_path / "elsewhere"))
    os.symlink(tmp_path / "elsewhere", data)
    victim, message = data, f"{data} is a link to a directory"
  else:
    victim.unlink()
    if "fifo" in where:
      os.mkfifo(victim)
    else:
      os.symlink("/dev/zero", victim)
  with pytest.raises(ValueError, match=message):
    load_model(str(bad))
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt_ids": [3, 4, 5]}\n')
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "hisparse_jax.generate",
      "--prompts",
      str(prompts),
      "--model-path",
      str(bad),
      "--max-new-tokens",
      "2",
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1 and message in r.stderr, r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
