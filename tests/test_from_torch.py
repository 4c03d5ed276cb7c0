"""Porting a PyTorch pickle checkpoint (models/from_torch.py): ``torch.save`` of a transformers model's state dict
(fused experts, tied embeddings sharing storage, two shards) converts to safetensors that load into our model
with transformers' logits; what cannot convert fails alone, naming the file or tensor, and writes nothing.

The pickles are made, and the conversion runs, in the oracle Python (torch); the loading in this one."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.deepseek_v32 import prefill_prompts
from models.loader import _TensorStore, load_hf
from tests.oracle_runner import ORACLE_PYTHON, ORACLE_SCRIPT, REPO, require_oracle
from tests.tiny_model import tiny_model_dir

FROM_TORCH = REPO / "models" / "from_torch.py"
PROMPT = [3, 17, 5, 60, 9, 11, 2, 41]


def _oracle(code: str) -> None:
  r = subprocess.run([ORACLE_PYTHON, "-c", code], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]


def _from_torch(src, dst, python=sys.executable, *extra) -> subprocess.CompletedProcess:
  """The command a user runs: this venv's `python -m models.from_torch` (it re-runs itself in the oracle
  Python, which has torch), or the file itself under `python`."""
  cmd = [sys.executable, "-m", "models.from_torch"] if python == sys.executable else [python, "-I", str(FROM_TORCH)]
  return subprocess.run(
    [*cmd, "--model-path", str(src), "--output", str(dst), *extra],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _logits(model_dir) -> np.ndarray:
  _, model = load_hf(str(model_dir))
  logits, _ = prefill_prompts(model, [PROMPT], [len(PROMPT)], max_len=len(PROMPT))
  return np.asarray(logits[0], np.float32)


def test_a_torch_checkpoint_ports_with_transformers_logits(tmp_path):
  """transformers' model -> torch.save (in-memory layout: fused experts, lm_head sharing the embedding's
  storage) -> from_torch -> our loader: bitwise the logits of the same model's save_pretrained safetensors,
  and transformers' logits within the oracle tests' 1e-4."""
  require_oracle()
  st, pt, out = tmp_path / "st", tmp_path / "pt", tmp_path / "ported"
  (tmp_path / "prompts.json").write_text(json.dumps([PROMPT]))
  r = subprocess.run(
    [
      ORACLE_PYTHON,
      str(ORACLE_SCRIPT),
      "--make-checkpoint",
      str(st),
      "--seed",
      "7",
      "--config-json",
      json.dumps({"tie_word_embeddings": True}),
      "--save-torch",
      str(pt),
      "--run",
      str(st),
      "--prompts",
      str(tmp_path / "prompts.json"),
      "--max-new-tokens",
      "1",
      "--out",
      str(tmp_path / "ref.npz"),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  index = json.loads((pt / "pytorch_model.bin.index.json").read_text())["weight_map"]
  assert any(k.endswith("experts.gate_up_proj") for k in index) and "lm_head.weight" in index  # fused, tied

  r = _from_torch(pt, out, sys.executable, "--max-shard-size", str(200 / 2**20))  # 200 KiB files
  assert r.returncode == 0, r.stderr[-3000:]
  written = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
  assert set(written) == set(index)
  n = len(set(written.values()))
  assert n > 2 and f"{n} safetensors files" in r.stdout, r.stdout
  assert sorted(p.name for p in out.iterdir()) == sorted(
    ["config.json", "model.safetensors.index.json"] + [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
  )
  assert all(
    (out / f).stat().st_size < 200 * 1024 + 16 * 1024 or sum(v == f for v in written.values()) == 1
    for f in set(written.values())
  )  # at most 200 KiB (+ header) unless one tensor alone

  ours = _logits(out)
  assert np.array_equal(ours, _logits(st))
  ref = np.load(tmp_path / "ref.npz")["logits_0"]
  assert np.abs(ours - ref).max() <= 1e-4


@pytest.fixture(scope="module")
def pickles(tmp_path_factory):
  """Torch files of every shape the converter meets, written by the oracle Python."""
  require_oracle()
  root = tmp_path_factory.mktemp("pickles")
  _oracle(f"""
import os, torch
root = {str(root)!r}
def d(name, *files):
    os.makedirs(os.path.join(root, name))
    for fn, obj, kw in files:
        torch.save(obj, os.path.join(root, name, fn), **kw)
base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
d("nested_legacy_shared",
  ("a.pt", {{"state_dict": {{"a": base, "tied": base, "view": base[1:3], "b": base.to(torch.bfloat16)}},
            "epoch": 3}}, {{"_use_new_zipfile_serialization": False}}),
  ("b.pt", {{"f8": base.to(torch.float8_e4m3fn), "e8m0": (2.0 ** (base - 12)).to(torch.float8_e8m0fnu)}}, {{}}),
  ("training_args.bin", {{"lr": 0.1}}, {{}}))
d("not_a_tensor", ("pytorch_model.bin", {{"a": base, "step": 5}}, {{}}))
class Opaque:
    pass
d("code", ("pytorch_model.bin", {{"a": base, "obj": Opaque()}}, {{}}))
d("twice", ("x.bin", {{"a": base}}, {{}}), ("y.bin", {{"a": base}}, {{}}))
d("sparse", ("m.pt", {{"a": base, "s": base.to_sparse()}}, {{}}))
d("empty", ("m.pt", {{}}, {{}}))
d("int_key", ("m.pt", {{5: base}}, {{}}))
d("ddp", ("m.pt", {{"module.a": base, "module.b.c": base[0]}}, {{}}))
d("lightning", ("m.pt", {{"model.a": base, "other": base}}, {{}}))
import zipfile  # torch.save's zip with its entries deflated (a compressed entry can inflate without bound)
d("deflated", ("m.pt", {{"a": base}}, {{}}))
with zipfile.ZipFile(os.path.join(root, "deflated", "m.pt")) as z:
    entries = [(i.filename, z.read(i)) for i in z.infolist()]
with zipfile.ZipFile(os.path.join(root, "deflated", "m.pt"), "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in entries:
        z.writestr(name, data)
import json
d("index_list", ("pytorch_model.bin", {{"a": base}}, {{}}))
json.dump([1], open(os.path.join(root, "index_list", "pytorch_model.bin.index.json"), "w"))
d("index_int", ("pytorch_model.bin", {{"a": base}}, {{}}))
json.dump({{"weight_map": {{"a": 3}}}}, open(os.path.join(root, "index_int", "pytorch_model.bin.index.json"), "w"))
d("index_outside", ("pytorch_model.bin", {{"a": base}}, {{}}))
json.dump({{"weight_map": {{"a": "../twice/x.bin"}}}},
          open(os.path.join(root, "index_outside", "pytorch_model.bin.index.json"), "w"))
# Both formats' indexes beside the pickles (what a repository shipping both leaves when only *.bin are fetched).
d("stale_index", ("p1.bin", {{"a": base}}, {{}}), ("p2.bin", {{"b": base}}, {{}}))
for name in ("config.json", "model.safetensors.index.json"):
    json.dump({{"weight_map": {{"a": "gone.safetensors"}}}}, open(os.path.join(root, "stale_index", name), "w"))
d("single", ("ckpt.pt", {{"a": base}}, {{}}), ("notes.pt", {{"b": base}}, {{}}))
for name in ("config.json", "tokenizer.json", "diary.txt"):
    open(os.path.join(root, "single", name), "w").write(name)
""")
  return root


def test_nested_legacy_and_shared_tensors_convert_bit_for_bit(pickles, tmp_path):
  """A legacy-format (not memory-mappable) .pt holding {"state_dict": ..., "epoch": 3}, with two names for one
  tensor, a view of it and a bf16 copy, and a second .pt of FP8 weights and e8m0 scales; the trainer's
  training_args.bin beside them is skipped. Two shards with an index; values, dtypes and shapes equal the
  originals."""
  r = _from_torch(pickles / "nested_legacy_shared", tmp_path / "out", ORACLE_PYTHON)
  assert r.returncode == 0, r.stderr[-3000:]
  out = tmp_path / "out"
  assert sorted(p.name for p in out.iterdir()) == [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
  ]
  index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
  store = _TensorStore(str(out))  # the loader's reader (safetensors' numpy one has no e8m0)
  got = {k: store.read_raw(k) for k in store.keys()}
  assert sorted(got) == sorted(index) == ["a", "b", "e8m0", "f8", "tied", "view"]
  base = np.arange(24, dtype=np.float32).reshape(4, 6)
  assert np.array_equal(got["a"], base) and np.array_equal(got["tied"], base)
  assert np.array_equal(got["view"], base[1:3])
  assert got["b"].dtype == jnp.bfloat16 and np.array_equal(got["b"].astype(np.float32), base)
  assert got["f8"].dtype == ml_dtypes.float8_e4m3fn
  assert np.array_equal(got["f8"].view(np.uint8), base.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
  assert got["e8m0"].dtype == ml_dtypes.float8_e8m0fnu
  assert np.array_equal(
    got["e8m0"].view(np.uint8), (2.0 ** (base - 12)).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
  )


@pytest.mark.parametrize(
  "case,message",
  [
    ("not_a_tensor", "entry 'step' is a int, not a tensor"),
    ("code", r"torch.load\(weights_only=True\) refused it"),
    ("twice", "tensor 'a' is in both"),
    ("sparse", "tensor 's' has layout torch.sparse_coo; only dense"),
    ("empty", "holds an empty state dict: no tensors to convert"),
    ("int_key", "key 5 is a int; state dict keys are tensor names"),
    ("index_list", "pytorch_model.bin.index.json: not a JSON object with a weight_map"),
    ("index_int", "weight_map must map tensor names to file names"),
    ("index_outside", "names '../twice/x.bin': weight files must be inside"),
    ("deflated", r"zip entry '.*' is compressed \(method 8\); torch.save stores its entries uncompressed"),
  ],
)
def test_what_cannot_convert_fails_naming_it_and_writes_nothing(pickles, tmp_path, case, message):
  r = _from_torch(pickles / case, tmp_path / "out", ORACLE_PYTHON)
  assert r.returncode == 2 and re.search(message, r.stderr), (r.returncode, r.stderr[-2000:])
  assert "Traceback" not in r.stderr and "\x1b" not in r.stderr  # one line, without torch's colour codes
  assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporary directory left


def test_prefixes_indexes_and_side_files(pickles, tmp_path):
  """DistributedDataParallel's "module." is cut from every name; --strip-prefix cuts another one and refuses a
  name without it; a safetensors index beside the pickles is not copied over the one written (it named files
  that do not exist); a single file takes config and tokenizer files from its directory, nothing else."""

  def names(out):
    store = _TensorStore(str(out))
    return sorted(store.keys())

  r = _from_torch(pickles / "ddp", tmp_path / "ddp", ORACLE_PYTHON)
  assert r.returncode == 0 and "'module.' (a DistributedDataParallel wrapper's): stripped" in r.stdout, r.stderr
  assert names(tmp_path / "ddp") == ["a", "b.c"]
  r = _from_torch(pickles / "ddp", tmp_path / "ddp_kept", ORACLE_PYTHON, "--strip-prefix", "")
  assert r.returncode == 0 and names(tmp_path / "ddp_kept") == ["module.a", "module.b.c"], r.stderr
  r = _from_torch(pickles / "lightning", tmp_path / "lightning", ORACLE_PYTHON, "--strip-prefix", "model.")
  assert r.returncode == 2 and "tensor 'other' does not start with --strip-prefix 'model.'" in r.stderr, r.stderr
  assert not (tmp_path / "lightning").exists()

  r = _from_torch(pickles / "stale_index", tmp_path / "stale", ORACLE_PYTHON)
  assert r.returncode == 0, r.stderr
  index = json.loads((tmp_path / "stale" / "model.safetensors.index.json").read_text())["weight_map"]
  assert index == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
  assert names(tmp_path / "stale") == ["a", "b"]

  r = _from_torch(pickles / "single" / "ckpt.pt", tmp_path / "single", ORACLE_PYTHON)
  assert r.returncode == 0, r.stderr
  assert sorted(p.name for p in (tmp_path / "single").iterdir()) == [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
  ]
  assert names(tmp_path / "single") == ["a"]


def test_an_existing_output_or_safetensors_input_is_refused(pickles, tmp_path):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("earlier results")
  r = _from_torch(pickles / "nested_legacy_shared", out, ORACLE_PYTHON)
  assert r.returncode == 2 and "exists and is not an empty directory" in r.stderr, r.stderr
  assert [p.name for p in out.iterdir()] == ["keep.txt"]
  (tmp_path / "st").mkdir()
  (tmp_path / "st" / "model.safetensors").write_bytes(b"")
  r = _from_torch(tmp_path / "st", tmp_path / "out2", ORACLE_PYTHON)
  assert r.returncode == 2 and "already holds safetensors weights; load it directly" in r.stderr, r.stderr


def test_without_torch_it_says_how_to_get_it(tmp_path):
  r = _from_torch(tmp_path, tmp_path / "out", sys.executable, "--torch-python", str(tmp_path / "no-python"))
  assert r.returncode == 2 and "needs torch" in r.stderr and "make oracle" in r.stderr, r.stderr


def test_the_loader_points_a_torch_checkpoint_to_the_converter(tmp_path):
  """Our loader reads only safetensors; a directory of torch pickles gets the command that converts it."""
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  shutil.copy(pathlib.Path(tiny_model_dir()) / "config.json", tmp_path)
  with pytest.raises(
    ValueError,
    match=r"PyTorch pickle weights \(pytorch_model.bin\): convert them once with "
    r"`python -m models.from_torch --model-path ",
  ):
    load_hf(str(tmp_path))


def test_a_killed_conversions_directory_is_removed_by_the_next(tmp_path):
  """A conversion killed outright (SIGKILL: no clean-up runs) leaves its temporary directory beside --output;
  the next conversion into that parent removes it, and keeps those of live processes and other hosts."""
  import socket

  from models.from_torch import NEW_DIRECTORY_PREFIX, new_directory

  host = socket.gethostname()
  writer = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys\n"
      "from models.from_torch import new_directory\n"
      "with new_directory(sys.argv[1]) as tmp:\n"
      "  open(tmp + '/part.safetensors', 'wb').write(b'x' * 1000)\n"
      "  print(tmp, flush=True)\n"
      "  sys.stdin.read()\n",
      str(tmp_path / "killed"),
    ],
    cwd=REPO,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  stale = pathlib.Path(writer.stdout.readline().strip())
  assert stale.parent == tmp_path and stale.name.startswith(f"{NEW_DIRECTORY_PREFIX}{host}-{writer.pid}-")
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    live = tmp_path / f"{NEW_DIRECTORY_PREFIX}{host}-{sleeper.pid}-abc"
    other_host = tmp_path / f"{NEW_DIRECTORY_PREFIX}{host}x-{writer.pid}-abc"
    live.mkdir()
    other_host.mkdir()
    writer.kill()
    writer.wait(timeout=30)
    assert (stale / "part.safetensors").exists()  # SIGKILL ran no clean-up
    with new_directory(str(tmp_path / "out")) as tmp:
      pathlib.Path(tmp, "model.safetensors").write_bytes(b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name, "out"])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"y"
  finally:
    sleeper.kill()
    sleeper.wait()
