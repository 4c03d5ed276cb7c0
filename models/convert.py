r"""HF checkpoint -> native orbax checkpoint, and loading either kind.

  python -m models.convert --model-path HF_DIR --output ORBAX_DIR [--dtype bfloat16|float32]

writes ORBAX_DIR/params (an orbax StandardCheckpointer save of the Flax NNX
parameter state, already in the target dtype), ORBAX_DIR/config.json (the HF
config with ``dtype`` set to the converted dtype), the tokenizer and
``hisparse_config.json`` when the HF dir has them, and the marker file
``hisparse_orbax.json``. ``load_model(path)`` accepts either kind of directory;
an orbax one restores straight into device memory of the default device
without reading any safetensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import DSAConfig
from models.deepseek_v32 import DeepseekV32ForCausalLM
from models.kv_format import check_kv_cache_dtype
from models.loader import check_finite, checkpoint_files, load_hf, param_path

ORBAX_MARKER = "hisparse_orbax.json"
PARAMS_DIR = "params"
# The parameter layout an orbax directory holds, recorded in its marker. 2: lm_head/weight [vocab, hidden]
# (``models.deepseek_v32.LMHead``); directories without the key hold layout 1, lm_head/kernel [hidden, vocab].
ORBAX_LAYOUT = 2
# Files copied from the HF directory next to the orbax parameters when present.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "hisparse_config.json", "generation_config.json")


# Bytes read from each end of each weight file by ``model_fingerprint``.
FINGERPRINT_BYTES = 1 << 16


def model_fingerprint(path: str | os.PathLike) -> str:
  """A sha256 that tells two copies of a model directory apart (other processes and servers compare theirs):
  over config.json and, for every weight file (the safetensors files the loader reads from an HF directory,
  ``loader.checkpoint_files``, which raises ValueError for a bad one; every file under an orbax directory's
  ``params/``), its relative path, size and first and last FINGERPRINT_BYTES bytes, which cover the
  safetensors header and weights at both ends. Cheap (a few MB for a 700 B-parameter checkpoint) and not a
  checksum: two checkpoints that differ only in their middle bytes collide."""
  import hashlib

  root = os.fspath(path)
  h = hashlib.sha256()
  with open(os.path.join(root, "config.json"), "rb") as f:
    h.update(f.read())
  if is_orbax_dir(root):
    files = orbax_files(root)  # ValueError for a file that is not regular, or metadata too large
  else:
    files = [os.path.relpath(f, root) for f in checkpoint_files(root)[1]]  # ValueError for a bad weight file
  for rel in files:
    full = os.path.join(root, rel)
    size = os.path.getsize(full)
    h.update(f"{rel}\0{size}\0".encode())
    with open(full, "rb") as f:
      h.update(f.read(FINGERPRINT_BYTES))
      if size > FINGERPRINT_BYTES:
        f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
        h.update(f.read(FINGERPRINT_BYTES))
  return h.hexdigest()


def is_orbax_dir(path: str | os.PathLike) -> bool:
  return os.path.lexists(os.path.join(os.fspath(path), ORBAX_MARKER))


def orbax_files(path: str | os.PathLike) -> list[str]:
  """The paths (relative to ``path``, sorted) of every file under an orbax directory's ``params/``, after
  checking that the marker and each of them (links followed) is a regular file: a FIFO would block the reader
  forever, a link to /dev/zero never end. Metadata (every file outside TensorStore's "d" data directories, which
  orbax reads whole) and the marker are bounded too. ValueError naming the file."""
  from models.from_torch import MAX_CONFIG_BYTES, MAX_JSON_BYTES, check_regular_file

  root = os.fspath(path)
  check_regular_file(os.path.join(root, ORBAX_MARKER), MAX_CONFIG_BYTES)
  files = []
  for d, dirs, names in os.walk(os.path.join(root, PARAMS_DIR)):
    linked = next((sub for sub in dirs if os.path.islink(os.path.join(d, sub))), None)
    if linked is not None:  # (os.walk would not look inside it; orbax would)
      raise ValueError(
        f"{os.path.join(d, linked)} is a link to a directory; an orbax directory's params/ must hold its files itself"
      )
    for name in names:
      check_regular_file(os.path.join(d, name), None if os.path.basename(d) == "d" else MAX_JSON_BYTES)
      files.append(os.path.relpath(os.path.join(d, name), root))
  return sorted(files)


def convert(hf_dir: str, output: str, dtype: str | None = None) -> str:
  """Converts an HF-format directory into an orbax directory; returns ``output``.

  Raises:
    ValueError: unsupported config or missing tensor (from ``load_hf``), or ``output`` (a message starting
      "--output") is empty, exists and is not an empty directory, lies inside ``hf_dir`` or cannot be created;
      whatever fails, ``output`` is left as it was.
  """
  import orbax.checkpoint as ocp

  from models.from_torch import new_directory

  with new_directory(output, hf_dir) as tmp:  # a failure leaves nothing (ValueError first for a bad output)
    check_side_files(hf_dir)
    cfg, model = load_hf(hf_dir, dtype=dtype)
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(os.path.join(tmp, PARAMS_DIR), state)
      ckpt.wait_until_finished()
    with open(os.path.join(hf_dir, "config.json")) as f:
      hf_config = json.load(f)
    hf_config["dtype"] = cfg.dtype
    hf_config.pop("torch_dtype", None)
    hf_config.pop("quantization_config", None)  # the orbax params are already dequantized
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    copy_side_files(hf_dir, tmp)
    with open(os.path.join(tmp, ORBAX_MARKER), "w") as f:
      json.dump(
        {
          "format": "orbax",
          "layout": ORBAX_LAYOUT,
          "params": PARAMS_DIR,
          "dtype": cfg.dtype,
          "source": os.path.abspath(hf_dir),
        },
        f,
      )
  return output


def check_side_files(src: str, parse: bool = True) -> None:
  """ValueError for a ``SIDE_FILES`` entry of ``src`` that is not a regular file (a FIFO would block the copy,
  a link to /dev/zero fill the disk), or, with ``parse``, for a tokenizer.json the tokenizers library cannot
  read (a converted directory that no server could start from): a conversion checks them before its work, and
  again, without parsing, as it copies."""
  from hisparse_jax.engine.detokenizer import load_tokenizer
  from models.from_torch import check_regular_file

  for name in SIDE_FILES:
    if os.path.lexists(os.path.join(src, name)):
      check_regular_file(os.path.join(src, name))
  if parse:
    load_tokenizer(src)  # (None without one) ValueError naming the file


def copy_side_files(src: str, dst: str) -> None:
  """Copies ``SIDE_FILES`` (tokenizer, generation and hisparse configs) that ``src`` has into ``dst``; ValueError
  for one that is not a regular file (``check_side_files``)."""
  check_side_files(src, parse=False)
  for name in SIDE_FILES:
    if os.path.lexists(os.path.join(src, name)):
      shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def cli_error(e: Exception, model_path: str) -> str:
  """The one-line message a conversion command prints for ``e``: an error about --output as it is, any other
  prefixed with the checkpoint and the exception's type."""
  about_output = isinstance(e, ValueError) and str(e).startswith("--output")
  return f"error: {e}" if about_output else f"error: {model_path}: {type(e).__name__}: {e}"


def load_orbax(
  path: str,
  dtype=None,
  *,
  fp8_numerics: bool = False,
  kv_cache_dtype: str = "auto",
  sharding=None,
  top_k=jax.lax.top_k,
  expert_parallel=None,
) -> tuple[DSAConfig, DeepseekV32ForCausalLM]:
  """Restores an orbax directory written by ``convert``.

  The parameters are restored straight into their final shardings (the default
  device, or ``sharding(path, shape)`` per parameter: each device reads only its
  slice) with the stored dtype; a different ``dtype`` casts after restoring. top_k, expert_parallel: how the
  model runs (``DeepseekV32ForCausalLM``'s arguments of the same names).

  Raises:
    ValueError: the directory holds an older parameter layout (its marker's "layout" below ORBAX_LAYOUT, and
      the model has a separate lm_head): convert the HF checkpoint again; or its parameters cannot be restored (a
      damaged, truncated or missing file under ``params/``: the message gives TensorStore's status in one line).
  """
  import orbax.checkpoint as ocp

  cfg = DSAConfig.from_pretrained(path).replace(
    fp8_numerics=fp8_numerics, kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype)
  )
  from models.from_torch import read_json

  orbax_files(path)  # every file regular (ValueError naming one that is not) before orbax opens any
  marker = read_json(os.path.join(path, ORBAX_MARKER))  # (ValueError naming the file for JSON that is not)
  if not isinstance(marker, dict):
    raise ValueError(f"{os.path.join(path, ORBAX_MARKER)} must hold a JSON object, got {type(marker).__name__}")
  layout = marker.get("layout", 1)
  if layout != ORBAX_LAYOUT and not cfg.tie_word_embeddings:
    was = " (lm_head as a [hidden, vocab] kernel, written by an earlier hisparse-jax)" if layout == 1 else ""
    raise ValueError(
      f"{path} holds parameter layout {layout!r}{was}; this hisparse-jax reads layout {ORBAX_LAYOUT} "
      "(lm_head [vocab, hidden]). Convert the HF checkpoint again: "
      "python -m models.convert --model-path HF_DIR --output NEW_DIR"
    )
  stored = jnp.dtype(cfg.dtype)
  build = dict(top_k=top_k, expert_parallel=expert_parallel)
  abstract = nnx.eval_shape(lambda: DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=stored, **build))
  graphdef, abstract_state = nnx.split(abstract)
  default = jax.sharding.make_single_device_sharding(jax.devices()[0])
  target = jax.tree_util.tree_map_with_path(
    lambda p, x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=default if sharding is None else sharding(param_path(p), tuple(x.shape))
    ),
    abstract_state,
  )
  params = os.path.abspath(os.path.join(path, PARAMS_DIR))
  previous_hook, log_filter = _quiet_failed_reads(params)
  try:
    with ocp.StandardCheckpointer() as ckpt:
      state = ckpt.restore(params, target)
    sys.unraisablehook = previous_hook
    logging.getLogger("asyncio").removeFilter(log_filter)
  except Exception as e:  # orbax/TensorStore: a generic Exception whose text is the whole TensorStore spec
    import gc

    gc.collect()  # the failed reads' coroutines, now (quietly), not at some later collection
    raise ValueError(
      f"{path}: the orbax checkpoint cannot be read ({_root_cause(e)}); a file under {params} is "
      "damaged, missing or of another checkpoint. Convert the HF checkpoint again: "
      "python -m models.convert --model-path HF_DIR --output NEW_DIR"
    ) from e
  model = nnx.merge(graphdef, state)
  if dtype is not None and jnp.dtype(dtype) != stored:
    # Re-load through the HF-equivalent cast rules: float32 stays float32 for the fp32 modules.
    cfg = cfg.replace(dtype=jnp.dtype(dtype).name)
    graphdef2, state2 = nnx.split(
      nnx.eval_shape(lambda: DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(dtype), **build))
    )
    casted = jax.tree.map(lambda want, have: jnp.asarray(have, want.dtype), state2, state)
    model = nnx.merge(graphdef2, casted)
  check_finite(model, path)
  return cfg, model


def _quiet_failed_reads(params: str):
  """Quiets the other reads of an orbax restore of ``params`` once one has failed; returns (the unraisable-error
  hook it replaces, the asyncio log filter it adds). Those reads still finish on TensorStore's threads and each
  ends in an error printed around the one-line error the caller raises:

  - "Exception ignored in: ..." with a traceback, through ``sys.unraisablehook`` (the coroutines' own errors when
    collected, "Event loop is closed" from callbacks into orbax's closed loop): the hook drops those two kinds,
    every other unraisable error still prints;
  - "Task/Future exception was never retrieved" with a traceback and the whole TensorStore spec, logged on the
    ``asyncio`` logger when an unawaited task or future is collected: the filter drops such records whose error
    names ``params``, every other record still logs.

  After a failure both stay, since such callbacks and collections may still come."""
  previous = sys.unraisablehook

  def hook(unraisable):
    error, obj = unraisable.exc_value, unraisable.object
    if (isinstance(error, RuntimeError) and str(error) == "Event loop is closed") or "orbax" in getattr(
      getattr(obj, "cr_code", None), "co_filename", ""
    ):
      return
    previous(unraisable)

  def keep(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and "exception was never retrieved" in str(record.msg) and params in str(error))

  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(keep)
  return previous, keep


def _root_cause(e: BaseException, limit: int = 400) -> str:
  """The first line of the innermost exception of ``e``'s chain (TensorStore's own status, e.g. ``DATA_LOSS: ...``
  or ``OUT_OF_RANGE: ...``), at most ``limit`` characters; a context its raiser suppressed (``raise ... from
  None``: json's StopIteration behind a JSONDecodeError) is not followed, and a bare ``Exception``'s type is
  left out."""
  seen = set()
  while id(e) not in seen:
    seen.add(id(e))
    inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    if inner is None:
      break
    e = inner
  line = (str(e).strip().splitlines() or [""])[0]
  if type(e) is not Exception:
    line = f"{type(e).__name__}: {line}" if line else type(e).__name__
  return line if len(line) <= limit else line[:limit] + " ..."


def load_model(
  path: str,
  dtype=None,
  *,
  fp8_numerics: bool = False,
  kv_cache_dtype: str = "auto",
  sharding=None,
  fp8_weights: bool = False,
  top_k=jax.lax.top_k,
  expert_parallel=None,
) -> tuple[DSAConfig, DeepseekV32ForCausalLM]:
  """(config, model) from an HF-format directory or an orbax directory written by ``convert``; sharding: a
  function (parameter path, shape) -> jax.sharding.Sharding placing each parameter as it loads (None: the
  default device); fp8_weights: FP8-resident weights (``load_hf``; HF FP8 checkpoints only, ValueError
  otherwise); kv_cache_dtype: how the KV cache stores a latent row (``models/kv_format.py``; ValueError for
  an unknown one); top_k, expert_parallel: how the model runs (``DeepseekV32ForCausalLM``'s arguments)."""
  build = dict(top_k=top_k, expert_parallel=expert_parallel)
  if is_orbax_dir(path):
    if fp8_weights:
      raise ValueError(
        f"{path} is an orbax checkpoint (dequantized weights); FP8-resident weights load from the HF FP8 checkpoint"
      )
    return load_orbax(path, dtype, fp8_numerics=fp8_numerics, kv_cache_dtype=kv_cache_dtype, sharding=sharding, **build)
  return load_hf(
    path,
    dtype=dtype,
    fp8_numerics=fp8_numerics,
    kv_cache_dtype=kv_cache_dtype,
    sharding=sharding,
    fp8_weights=fp8_weights,
    **build,
  )


def main(argv=None) -> int:
  import argparse

  ap = argparse.ArgumentParser(description="Convert an HF-format DSA checkpoint into a native orbax checkpoint.")
  ap.add_argument("--model-path", required=True, help="HF directory (config.json + *.safetensors)")
  ap.add_argument("--output", required=True, help="new orbax directory")
  ap.add_argument(
    "--dtype", choices=("bfloat16", "float32"), default=None, help="parameter dtype (default: the checkpoint's)"
  )
  args = ap.parse_args(argv)
  if not os.path.exists(os.path.join(args.model_path, "config.json")):
    print(f"error: --model-path {args.model_path!r}: no config.json", file=sys.stderr)
    return 2
  if is_orbax_dir(args.model_path):  # (it said "no *.safetensors weights found")
    print(
      f"error: --model-path {args.model_path!r} is already an orbax checkpoint (serve it as it is)", file=sys.stderr
    )
    return 2
  try:
    convert(args.model_path, args.output, args.dtype)
  except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is the user's error, said in one line
    print(cli_error(e, args.model_path), file=sys.stderr)
    return 2
  print(f"wrote {args.output} ({', '.join(sorted(os.listdir(args.output)))})")
  with open(os.path.join(args.output, ORBAX_MARKER)) as f:
    dtype = json.load(f)["dtype"]
  with open(os.path.join(args.model_path, "config.json")) as f:
    if "quantization_config" in json.load(f):
      print(
        f"note: the FP8 block-quantized weights are stored dequantized, in {dtype}; --weight-dtype fp8 "
        "(FP8-resident weights) loads from the HF FP8 checkpoint, not from this directory"
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
