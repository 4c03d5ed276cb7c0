r"""Convert a PyTorch pickle checkpoint (``pytorch_model.bin``, its shards, ``*.pt`` / ``*.pth`` state dicts) into
the safetensors checkpoint the loader reads: the first step of porting a checkpoint saved with ``torch.save``.

  python -m models.from_torch --model-path TORCH_DIR_OR_FILE --output NEW_HF_DIR [--max-shard-size GIB] \
      [--strip-prefix PREFIX] [--torch-python PY]

The runtime has no torch, and a pickle is only readable with torch, so the conversion runs in a Python that
has torch and safetensors: this one if it has them, else ``--torch-python``, ``$HISPARSE_ORACLE_PYTHON`` or
``.venv-oracle/bin/python`` (``make oracle`` creates it), where this file re-runs itself as a plain script.
It imports nothing but the standard library at the top for that reason.

What it reads (a directory):
  * ``pytorch_model.bin.index.json`` and the shards its ``weight_map`` names (what transformers writes), else
  * ``pytorch_model.bin``, else
  * every ``*.bin`` / ``*.pt`` / ``*.pth`` file except the trainer's own (``training_args.bin``,
    ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``scaler.pt``);
or one such file. Each file must hold a state dict (``str`` -> tensor), possibly under one ``"state_dict"``,
``"model"`` or ``"module"`` key; it is read with ``torch.load(weights_only=True, mmap=True)``, so a pickle
that would run code is refused, not executed.

What it writes: safetensors files of at most ``--max-shard-size`` GiB (default 5; a larger tensor gets a file
of its own; a file never mixes two input files), tensors bit for bit with their names, dtypes and shapes
(``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``),
plus every other regular file of the directory (``config.json``, tokenizer files, ...; not a weight index;
for one file, ``HF_SIDE_FILES`` from its directory) copied. Tensor names keep their spelling, except a prefix
(``--strip-prefix``; by default DistributedDataParallel's ``module.`` when every name of a file has it). Tensors that
share storage (tied embeddings, views) are written as separate copies, as safetensors requires. Host memory
peaks near one output file: an input in torch's zip format (the default since torch 1.6) is memory-mapped
and each output file's tensors are paged in while it is written (a 2 GiB ``pytorch_model.bin`` written as
0.25 GiB files peaked at 147 MB of anonymous memory, torch included); a legacy-format input is read whole. The
output is assembled in a temporary directory beside it and renamed into place at the end, so a failed
conversion leaves no partial checkpoint (one killed outright leaves its ``.hisparse-new-HOST-PID-*``
directory, which the next conversion into the same parent removes); an existing non-empty ``--output`` is refused.

Errors (exit 2, the message names the file or tensor): no torch pickle found, a directory that already
holds safetensors, a malformed index or one naming a file outside the directory, a file torch refuses to load
with ``weights_only=True``, an empty state dict, a key that is not a string, a value that is not a tensor, a
sparse tensor, a tensor name in two files or without ``--strip-prefix``, a dtype safetensors cannot store.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Files a transformers Trainer writes beside the weights: pickles that are not state dicts.
TRAINER_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
NESTED_KEYS = ("state_dict", "model", "module")
# What a transformers checkpoint keeps beside its weights (copied from a single file's directory).
HF_SIDE_FILES = (
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "tokenizer.model",
  "vocab.json",
  "merges.txt",
  "chat_template.jinja",
)


def default_oracle_python() -> str:
  """The Python with torch + transformers: ``$HISPARSE_ORACLE_PYTHON``, else ``<repo>/.venv-oracle/bin/python``."""
  return os.environ.get("HISPARSE_ORACLE_PYTHON", os.path.join(REPO, ".venv-oracle", "bin", "python"))


def _is_trainer_file(name: str) -> bool:
  return name in TRAINER_FILES or (name.startswith("rng_state") and name.endswith(".pth"))


# Checkpoint-directory helpers, standard library only: models.loader and models.convert use them too, and this
# file must also run as a plain script in a Python without the package's dependencies.

MAX_JSON_BYTES = 256 * 2**20  # an index or tokenizer JSON; DeepSeek-V3.2's index is ~9 MB, its tokenizer.json ~8 MB
MAX_CONFIG_BYTES = 16 * 2**20  # config.json, hisparse_config.json: a few KB (parsing JSON takes ~30x its size)


def check_regular_file(path: str, limit: int | None = None) -> None:
  """ValueError unless ``path`` (links followed) is a regular file of at most ``limit`` bytes: a FIFO would block
  a reader forever and a link to /dev/zero never ends."""
  if not os.path.isfile(path):
    what = (
      "is a broken link"
      if os.path.islink(path) and not os.path.exists(path)
      else "does not exist"
      if not os.path.lexists(path)
      else "is not a regular file"
    )
    raise ValueError(f"{path} {what}")
  if limit is not None and os.path.getsize(path) > limit:
    raise ValueError(f"{path} is {os.path.getsize(path)} bytes; at most {limit} are read")


def usual_modes(path: str) -> None:
  """Gives ``path`` the mode a plain ``open`` / ``mkdir`` would have under the process's umask (a file 0o666,
  a directory 0o777, less the umask), and each file directly in a directory too: what tempfile's owner-only
  0o600 / 0o700 becomes once the result is renamed into place. OSError as chmod raises it."""
  umask = _umask()
  if os.path.isdir(path):
    os.chmod(path, 0o777 & ~umask)
    for name in os.listdir(path):
      if os.path.isfile(os.path.join(path, name)):
        os.chmod(os.path.join(path, name), 0o666 & ~umask)
  else:
    os.chmod(path, 0o666 & ~umask)


def _umask() -> int:
  try:  # Linux: read it without setting it (os.umask sets it, for every thread, until it is set back)
    with open("/proc/self/status") as f:
      return int(next(line.split()[1] for line in f if line.startswith("Umask:")), 8)
  except (OSError, StopIteration, ValueError):
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def read_json(path: str, limit: int = MAX_JSON_BYTES):
  """json.load of ``path`` after ``check_regular_file`` (ValueError naming it, also for JSON nested too deeply
  for the parser)."""
  check_regular_file(path, limit)
  with open(path) as f:
    try:
      return json.load(f)
    except RecursionError:
      raise ValueError(f"{path}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_weight_map(index: str, model_dir: str) -> dict[str, str]:
  """The ``weight_map`` (tensor name -> file name) of a checkpoint index JSON. ValueError naming ``index`` for
  what is not a JSON object holding a str -> str map, or a file name that is absolute or climbs out of
  ``model_dir`` with ``..`` (weights are read from inside the directory only)."""
  check_regular_file(index, MAX_JSON_BYTES)
  try:
    weight_map = read_json(index).get("weight_map")  # (ValueError for JSON nested too deeply)
  except (OSError, ValueError, AttributeError) as e:
    raise ValueError(f"{index}: not a JSON object with a weight_map ({type(e).__name__}: {e})") from None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise ValueError(f"{index}: weight_map must map tensor names to file names")
  for name in set(weight_map.values()):
    if "\0" in name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
      raise ValueError(f"{index} names {name!r}: weight files must be inside {model_dir}")
  return weight_map


NEW_DIRECTORY_PREFIX = ".hisparse-new-"


def remove_stale_directories(parent: str) -> list[str]:
  """Removes the temporary directories ``new_directory`` left in ``parent`` when its process was killed
  (SIGKILL, a power cut: nothing ran its clean-up): those named for this host whose process id no longer
  runs. A directory of a live process, of another host (a shared file system) or of another name is kept.
  Returns the paths removed."""
  host = socket.gethostname()
  removed = []
  try:
    names = os.listdir(parent)
  except OSError:
    return removed
  for name in names:
    if not name.startswith(f"{NEW_DIRECTORY_PREFIX}{host}-"):
      continue
    pid_text = name[len(NEW_DIRECTORY_PREFIX) + len(host) + 1 :].split("-", 1)[0]
    if not pid_text.isdigit() or pid_text == str(os.getpid()):
      continue
    try:
      os.kill(int(pid_text), 0)
      continue  # that process still runs
    except ProcessLookupError:
      pass
    except (PermissionError, OverflowError):
      continue  # another user's process, or not a process id
    path = os.path.join(parent, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path)
      print(f"removed {path}, left by process {pid_text}, which no longer runs", file=sys.stderr)
  return removed


@contextlib.contextmanager
def new_directory(dst: str, source: str | None = None):
  """Yields a temporary directory beside ``dst`` to write a checkpoint into; when the block ends without an
  error it becomes ``dst`` (renamed, with the modes of a directory and files made under the umask), else it is
  removed. ValueError, before anything is written, when ``dst`` is empty, exists and is not an empty directory,
  lies inside ``source`` (the checkpoint being read: a directory, or a file's directory) or cannot be created: a failed
  conversion leaves ``dst`` as it was and never a partial checkpoint. The directory is named for this host and
  process (``.hisparse-new-HOST-PID-*``), and those of killed processes are removed first
  (``remove_stale_directories``)."""
  if not dst:
    raise ValueError("--output '': an empty path")
  if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
    raise ValueError(f"--output {dst} exists and is not an empty directory")
  if source is not None:
    root = os.path.realpath(source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source)))
    if os.path.commonpath([root, os.path.realpath(dst)]) == root:
      raise ValueError(f"--output {dst} is inside the checkpoint being converted ({source}); write it elsewhere")
  parent = os.path.dirname(os.path.abspath(dst))
  try:
    os.makedirs(parent, exist_ok=True)
    remove_stale_directories(parent)
    tmp = tempfile.mkdtemp(prefix=f"{NEW_DIRECTORY_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=parent)
  except OSError as e:
    raise ValueError(f"--output {dst}: cannot create a directory in {parent} ({e.strerror or e})") from None
  try:
    yield tmp
    usual_modes(tmp)  # mkdtemp's (and safetensors' files') owner-only modes -> the usual ones
    if os.path.isdir(dst):
      os.rmdir(dst)  # empty (checked above)
    os.rename(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def torch_files(path: str) -> list[str]:
  """The checkpoint's torch pickle files, in order. ValueError when there are none, or when ``path`` already
  holds safetensors weights (nothing to convert)."""
  if os.path.exists(path) and not os.path.isdir(path):
    check_regular_file(path)
    if not path.endswith(TORCH_SUFFIXES):
      raise ValueError(f"{path} is not a torch pickle (*.bin, *.pt, *.pth)")
    return [path]
  if not os.path.isdir(path):
    raise ValueError(f"--model-path {path}: no such file or directory")
  names = sorted(os.listdir(path))
  if any(n.endswith(".safetensors") for n in names):
    raise ValueError(f"{path} already holds safetensors weights; load it directly")
  index = os.path.join(path, "pytorch_model.bin.index.json")
  if os.path.exists(index):
    weight_map = read_weight_map(index, path)
    if not weight_map:
      raise ValueError(f"{index}: the weight_map is empty")
    files = list(dict.fromkeys(weight_map.values()))  # first-appearance order, once each
    for n in files:
      if not os.path.isfile(os.path.join(path, n)):
        raise ValueError(f"{index} names {n!r}, which is not a file in {path}")
    return [os.path.join(path, n) for n in files]
  if "pytorch_model.bin" in names:
    check_regular_file(os.path.join(path, "pytorch_model.bin"))
    return [os.path.join(path, "pytorch_model.bin")]
  files = [
    os.path.join(path, n)
    for n in names
    if n.endswith(TORCH_SUFFIXES) and not _is_trainer_file(n) and os.path.isfile(os.path.join(path, n))
  ]
  if not files:
    raise ValueError(f"no torch pickle weights (pytorch_model.bin, *.bin, *.pt, *.pth) in {path}")
  return files


def _torch_reason(message: str) -> str:
  """The line of a torch.load error that says what it refused ("Unsupported global: ..."), without the
  terminal colour codes torch puts in it; else its first line."""
  lines = [re.sub(r"\x1b\[[0-9;]*m", "", l).strip() for l in message.splitlines()]
  lines = [l for l in lines if l]
  return next((l for l in lines if "Unsupported" in l or "global" in l), lines[0] if lines else "")


def _check_stored_zip(fn: str) -> None:
  """ValueError unless every entry of a zip-format torch file is stored uncompressed, as torch.save writes them:
  a compressed one could inflate to any size in memory (a 2 MB file's data.pkl held 2 GiB). Files that are not
  zips (torch's legacy format) are read whole, as big as they are."""
  import zipfile

  if not zipfile.is_zipfile(fn):
    return
  try:
    with zipfile.ZipFile(fn) as z:
      packed = next((i for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
  except (zipfile.BadZipFile, OSError, ValueError) as e:
    raise ValueError(f"{fn}: not a readable torch zip file ({type(e).__name__}: {e})") from None
  if packed is not None:
    raise ValueError(
      f"{fn}: zip entry {packed.filename!r} is compressed (method {packed.compress_type}); "
      "torch.save stores its entries uncompressed, and a compressed one could inflate without bound"
    )


def _state_dict(fn: str) -> dict:
  """``{name: tensor}`` from one torch file, memory-mapped where its format allows (torch's zip format)."""
  import torch

  _check_stored_zip(fn)
  try:
    try:
      obj = torch.load(fn, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
      if "mmap" not in str(e):  # the legacy (pre-zip) format cannot be memory-mapped: read it whole
        raise
      obj = torch.load(fn, map_location="cpu", weights_only=True)
  except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for what it will not load
    reason = _torch_reason(str(e))
    raise ValueError(
      f"{fn}: torch.load(weights_only=True) refused it ({type(e).__name__}{': ' + reason if reason else ''}"
      "); only a state dict of tensors converts (if you trust the file, load it yourself and "
      "torch.save its state dict alone)"
    ) from e
  if isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
    nested = [k for k in NESTED_KEYS if isinstance(obj.get(k), dict)]
    if len(nested) == 1:
      obj = obj[nested[0]]
  if not isinstance(obj, dict):
    raise ValueError(f"{fn} holds a {type(obj).__name__}, not a state dict (str -> tensor)")
  if not obj:
    raise ValueError(f"{fn} holds an empty state dict: no tensors to convert")
  for k, v in obj.items():
    if not isinstance(k, str):
      raise ValueError(f"{fn}: key {k!r} is a {type(k).__name__}; state dict keys are tensor names (str)")
    if not isinstance(v, torch.Tensor):
      raise ValueError(
        f"{fn}: entry {k!r} is a {type(v).__name__}, not a tensor (keys at the top: {sorted(map(str, obj))[:8]})"
      )
    if v.layout != torch.strided:
      raise ValueError(f"{fn}: tensor {k!r} has layout {v.layout}; only dense (strided) tensors convert")
  return obj


def _unshared(state: dict) -> dict:
  """Tensors safetensors can write: contiguous, and a copy for each one that shares its storage with another
  tensor or covers only part of it (tied weights, views)."""
  seen, out = set(), {}
  for k, t in state.items():
    t = t.detach()
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    if (ptr in seen and t.numel()) or storage.nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
      t = t.contiguous().clone()
    seen.add(ptr)
    out[k] = t
  return out


def _shards(tensors: dict, max_bytes: int) -> list[list[str]]:
  """Consecutive groups of tensor names of at most ``max_bytes`` each (a larger tensor alone)."""
  groups, size = [[]], 0
  for k, t in tensors.items():
    nbytes = t.numel() * t.element_size()
    if groups[-1] and size + nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(k)
    size += nbytes
  return [g for g in groups if g]


def _strip(state: dict, prefix: str | None, fn: str, log) -> dict:
  """state with ``prefix`` cut from every name (None: DistributedDataParallel's "module." when every name has
  it; ""; nothing). ValueError for a name without the prefix asked for."""
  if prefix is None:
    prefix = "module." if all(k.startswith("module.") for k in state) else ""
    if prefix:
      log(
        f"{os.path.basename(fn)}: every tensor name starts with 'module.' (a DistributedDataParallel "
        "wrapper's): stripped"
      )
  if not prefix:
    return state
  bad = next((k for k in state if not k.startswith(prefix)), None)
  if bad is not None:
    raise ValueError(f"{fn}: tensor {bad!r} does not start with --strip-prefix {prefix!r}")
  return {k[len(prefix) :]: v for k, v in state.items()}


def convert(src: str, dst: str, max_shard_bytes: int = 5 * 2**30, log=print, strip_prefix: str | None = None) -> dict:
  """Writes the safetensors checkpoint of ``src`` (a torch checkpoint directory or file) to the new directory
  ``dst``, in files of at most ``max_shard_bytes`` (bytes; a larger tensor gets a file of its own; a file never
  mixes two input files), with ``strip_prefix`` cut from every tensor name (None: "module." when every name of
  a file starts with it, as a DistributedDataParallel wrapper saves them; "": names as saved). Returns
  {"files": n, "tensors": n, "bytes": n}. ValueError (naming the file or tensor) for what it cannot convert;
  ``dst`` is untouched then."""
  from safetensors.torch import save_file

  if max_shard_bytes < 1:
    raise ValueError(f"--max-shard-size must be >= 1 byte, got {max_shard_bytes}")
  files = torch_files(src)
  with new_directory(dst, src) as tmp:
    parts, total, owner = [], 0, {}  # parts: (temporary name, tensor names); named once their count is known
    for fn in files:
      t0 = time.time()
      state = _strip(_state_dict(fn), strip_prefix, fn, log)
      for k in state:
        if k in owner:
          raise ValueError(f"tensor {k!r} is in both {owner[k]} and {fn}")
        owner[k] = fn
      tensors = _unshared(state)
      nbytes = 0
      for group in _shards(tensors, max_shard_bytes):
        part = f"part-{len(parts)}.safetensors"
        try:
          save_file({k: tensors[k] for k in group}, os.path.join(tmp, part), metadata={"format": "pt"})
        except Exception as e:  # safetensors raises several types for a dtype or layout it cannot store
          dtypes = sorted({str(tensors[k].dtype) for k in group})
          raise ValueError(f"{fn}: safetensors cannot write it ({type(e).__name__}: {e}); its dtypes: {dtypes}") from e
        parts.append((part, group))
        nbytes += sum(tensors[k].numel() * tensors[k].element_size() for k in group)
      total += nbytes
      log(f"{os.path.basename(fn)}: {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB ({time.time() - t0:.1f} s)")
      del state, tensors
    n = len(parts)
    weight_map = {}
    for i, (part, group) in enumerate(parts):
      name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
      os.rename(os.path.join(tmp, part), os.path.join(tmp, name))
      weight_map.update(dict.fromkeys(group, name))
    if n > 1:
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    # The other files beside the weights (config.json, tokenizer files, ...), but no weight index: the one
    # written above is this checkpoint's (a repository that ships both formats has a safetensors index too).
    # For one file, its directory may hold anything: only the files a transformers checkpoint has beside it.
    side_dir = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    used = {os.path.abspath(f) for f in files}
    for name in sorted(os.listdir(side_dir)):
      p = os.path.join(side_dir, name)
      if (
        os.path.isfile(p)
        and os.path.abspath(p) not in used
        and not name.endswith(TORCH_SUFFIXES)
        and not name.endswith((".safetensors", ".index.json"))
        and (os.path.isdir(src) or name in HF_SIDE_FILES)
      ):
        shutil.copy2(p, os.path.join(tmp, name))
  return {"files": n, "tensors": len(weight_map), "bytes": total}


def _has_torch() -> bool:
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "safetensors"))


def _positive_gib(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = float("nan")
  if not 1 <= value * 2**30 < 2**60:  # also refuses nan and inf
    raise argparse.ArgumentTypeError(f"must be a finite size in GiB of at least one byte, got {text!r}")
  return value


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model-path", required=True, help="torch checkpoint directory or one .bin/.pt/.pth file")
  ap.add_argument("--output", required=True, help="new directory for the safetensors checkpoint")
  ap.add_argument(
    "--max-shard-size",
    type=_positive_gib,
    default=5.0,
    help="GiB per output safetensors file (default 5; a larger tensor gets a file of its own)",
  )
  ap.add_argument(
    "--strip-prefix",
    default=None,
    help="cut this prefix from every tensor name, e.g. 'model.' for a Lightning module's state dict "
    "(default: 'module.' when every name has it, as DistributedDataParallel saves them; '': none)",
  )
  ap.add_argument(
    "--torch-python",
    default=None,
    help="a Python with torch + safetensors, used when this one lacks them (default: "
    "$HISPARSE_ORACLE_PYTHON, else .venv-oracle/bin/python)",
  )
  args = ap.parse_args(argv)
  if not _has_torch():
    python = args.torch_python or default_oracle_python()
    if not os.path.exists(python):
      print(
        f"error: reading a torch pickle needs torch, which this Python lacks, and there is no {python} "
        "(run `make oracle`, or pass --torch-python)",
        file=sys.stderr,
      )
      return 2
    # -I: the script's own directory (models/, whose module names are generic) stays off sys.path.
    return subprocess.call([python, "-I", os.path.abspath(__file__), *argv])
  try:
    info = convert(
      args.model_path,
      args.output,
      int(args.max_shard_size * 2**30),
      log=lambda s: print(s, flush=True),
      strip_prefix=args.strip_prefix,
    )
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(
    f"wrote {args.output}: {info['tensors']} tensors, {info['bytes'] / 2**20:.1f} MiB in {info['files']} "
    f"safetensors file{'s' if info['files'] > 1 else ''}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
