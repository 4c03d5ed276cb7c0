r"""An HF-format DSA checkpoint -> the same checkpoint FP8 block-quantized, laid out as DeepSeek-V3/V3.2's.

  python -m models.quantize_fp8 --model-path HF_DIR --output NEW_DIR [--scale-dtype float32|bfloat16|float8_e8m0fnu]

Each linear weight matrix (a floating-point ``*.weight`` of two dimensions) becomes float8_e4m3fn plus one
scale per 128 x 128 block, ``*.weight_scale_inv``, such that weight ~= q * scale block by block: the per-block
weight scaling of the DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3), whose HF checkpoints
store the multiplier as ``weight_scale_inv``. Per block, scale = max|w| / 448 (448: the largest e4m3 value)
and q = w / scale rounded to the nearest e4m3 value (ml_dtypes' cast). With ``--scale-dtype`` bfloat16 or
float8_e8m0fnu the scale is rounded up to a power of two, so that dtype holds it exactly (e8m0 holds only
powers of two). Kept as they are, as in DeepSeek-V3.2's FP8 checkpoint: the embedding, lm_head, every norm,
the MoE router (``mlp.gate``) and the indexer's ``weights_proj`` (``UNQUANTIZED``).

config.json gains ``quantization_config`` (``QUANTIZATION_CONFIG``). Weight files keep their names and
split, each quantized on its own (peak memory about one file), the index (if any) gains the scales, and the
side files (tokenizer, generation and hisparse configs) are copied. The result loads like any FP8
checkpoint: dequantized at load, or kept in FP8 on device with ``--weight-dtype fp8``.
"""

from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from models import fp8
from models.convert import check_side_files, cli_error, copy_side_files
from models.from_torch import new_directory, read_json
from models.loader import INDEX_FILE, _TensorStore, check_finite_array, checkpoint_files

BLOCK = 128
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
UNQUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "weights_proj")
QUANTIZATION_CONFIG = {
  "quant_method": "fp8",
  "fmt": "e4m3",
  "weight_block_size": [BLOCK, BLOCK],
  "activation_scheme": "dynamic",
}
FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16))
SCALE_DTYPES = {d.name: d for d in fp8.SCALE_DTYPES}  # the scale dtypes the loader reads, by name


def quantizes(key: str, array: np.ndarray) -> bool:
  """Whether ``key`` is a linear weight this module quantizes (a float matrix not in ``UNQUANTIZED``)."""
  return (
    key.endswith(".weight")
    and array.ndim == 2
    and array.dtype in FLOAT_DTYPES
    and not any(name in key for name in UNQUANTIZED)
  )


def quantize_blocks(w: np.ndarray, power_of_two: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """(q float8_e4m3fn[R, C], scale float32[ceil(R/128), ceil(C/128)]) for a float matrix ``w`` [R, C]: per
  128 x 128 block (the last ones partial), scale = max|w| / 448 (a block of zeros: 1e-12 / 448), rounded up to
  a power of two when ``power_of_two``; q = w / scale cast to e4m3 (round to nearest even; |q| <= 448)."""
  rows, cols = w.shape
  nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
  q = np.empty((rows, cols), ml_dtypes.float8_e4m3fn)
  scale = np.empty((nr, nc), np.float32)
  # One strip of 128 rows at a time, its columns padded to whole blocks: the work memory is a strip's (a matrix
  # padded whole to 128-row blocks made a [1, 4M] vector a [128, 4M] float32 one, 2 GiB).
  for i in range(nr):
    strip = w[i * BLOCK : (i + 1) * BLOCK]
    padded = np.zeros((strip.shape[0], nc * BLOCK), np.float32)
    padded[:, :cols] = strip
    blocks = padded.reshape(strip.shape[0], nc, BLOCK)
    s = (np.maximum(np.abs(blocks).max(axis=(0, 2)), np.float32(1e-12)) / np.float32(E4M3_MAX)).astype(np.float32)
    if power_of_two:
      s = np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    scale[i] = s
    strip_q = np.clip(blocks / s[None, :, None], -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    q[i * BLOCK : (i + 1) * BLOCK] = strip_q.reshape(strip.shape[0], nc * BLOCK)[:, :cols]
  return q, scale


def quantize_checkpoint(hf_dir: str, output: str, scale_dtype: str = "float32", log=print) -> dict:
  """Writes the FP8 block-quantized copy of ``hf_dir`` to ``output``; returns {"quantized": n, "kept": m,
  "bytes": total bytes of the weight files written}.

  Raises:
    ValueError: ``hf_dir`` is already FP8 (``quantization_config`` or FP8 tensors), has no config.json or
      safetensors weights, or ``output`` (a message starting "--output") is empty, exists and is not an empty
      directory, lies inside ``hf_dir`` or cannot be created; whatever fails, ``output`` is left as it was.
  """
  if scale_dtype not in SCALE_DTYPES:
    raise ValueError(f"--scale-dtype {scale_dtype!r}: expected one of {', '.join(SCALE_DTYPES)}")
  config = read_json(os.path.join(hf_dir, "config.json"))
  if not isinstance(config, dict):
    raise ValueError(f"{hf_dir}/config.json: not a JSON object")
  if config.get("quantization_config"):
    raise ValueError(f"{hf_dir} is already quantized (config.json has a quantization_config)")
  check_side_files(hf_dir)  # before the work, not after it
  weight_map, files = checkpoint_files(hf_dir)
  store = _TensorStore(hf_dir)  # ValueError for block scales without quantization_config
  done = {"quantized": 0, "kept": 0, "bytes": 0}
  by_file = {path: [] for path in files}
  for key in store.keys():
    by_file[store.file(key)].append(key)
  with new_directory(output, hf_dir) as tmp:
    new_map = {}
    for path, keys in by_file.items():
      name = os.path.relpath(path, hf_dir)
      tensors = {}
      for key in keys:
        array = store.read_raw(key)
        if fp8.is_fp8(array):
          raise ValueError(f"{hf_dir} is already quantized ({key!r} is {array.dtype})")
        # (a NaN would quantize to NaN blocks, or poison a whole block's scale; a float64 weight past float32's
        # range would too, once cast for quantizing)
        quantized = quantizes(key, array)
        check_finite_array(array, f"{hf_dir}: tensor {key!r}", np.float32 if quantized else None)
        if quantized:
          q, scale = quantize_blocks(array.astype(np.float32), power_of_two=scale_dtype != "float32")
          tensors[key], tensors[fp8.scale_key(key)] = q, scale.astype(SCALE_DTYPES[scale_dtype])
          done["quantized"] += 1
        else:
          tensors[key] = array
          done["kept"] += 1
      store.release()
      target = os.path.join(tmp, name)
      os.makedirs(os.path.dirname(target), exist_ok=True)
      save_file(tensors, target, metadata={"format": "pt"})
      done["bytes"] += os.path.getsize(target)
      new_map.update({k: name for k in tensors})
      log(f"{name}: {sum(fp8.is_fp8(t) for t in tensors.values())} matrices quantized")
      del tensors
    if weight_map is not None:
      with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": done["bytes"]}, "weight_map": dict(sorted(new_map.items()))}, f, indent=2)
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    copy_side_files(hf_dir, tmp)
  return done


def main(argv=None) -> int:
  import argparse

  ap = argparse.ArgumentParser(
    description="FP8 block-quantize an HF-format DSA checkpoint (DeepSeek-V3's "
    "layout: e4m3 weights, one scale per 128x128 block)."
  )
  ap.add_argument("--model-path", required=True, help="HF directory (config.json + *.safetensors)")
  ap.add_argument("--output", required=True, help="new directory")
  ap.add_argument(
    "--scale-dtype",
    choices=tuple(SCALE_DTYPES),
    default="float32",
    help="dtype of the block scales (bfloat16 / float8_e8m0fnu: power-of-two scales)",
  )
  args = ap.parse_args(argv)
  if not os.path.exists(os.path.join(args.model_path, "config.json")):
    print(f"error: --model-path {args.model_path!r}: no config.json", file=sys.stderr)
    return 2
  try:
    done = quantize_checkpoint(
      args.model_path, args.output, args.scale_dtype, log=lambda line: print(line, file=sys.stderr)
    )
  except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is the user's error, said in one line
    print(cli_error(e, args.model_path), file=sys.stderr)
    return 2
  print(
    f"wrote {args.output}: {done['quantized']} matrices in FP8 (128x128 {args.scale_dtype} block scales), "
    f"{done['kept']} tensors kept, {done['bytes'] / 2**20:.1f} MiB of weights"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
