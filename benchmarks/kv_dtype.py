r"""What the FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) costs a decode step at DeepSeek-V3.2's real attention size.

  python benchmarks/kv_dtype.py [--quick] [--batches 1,8,32] [--contexts 8192,32768] [--dtype float32] \
      [--steps 12] [--out benchmarks/results/kv_dtype]

One decoder layer with DeepSeek-V3.2's attention and lightning indexer (``tests/data/deepseek_v32_config.json``:
hidden 7168, 128 heads, kv_lora_rank 512, RoPE 64, indexer 64 heads x 128, top_k 2048), its MLP and vocabulary
shrunk to 256 and 1024 (they never touch the KV cache), random weights. Each of B requests decodes one token
at position S - 1 against S - 1 earlier tokens held in the engine's dense paged KV (``DenseState``: pages of
64 tokens, each request's scattered over the pool; random latent rows and indexer keys, stored as the
format stores them: 2,304 / 512 bytes per row / key in float32 with ``auto``, 784 / 132 with ``fp8_e4m3``;
rows of 1,152 and 656 bytes in bfloat16). The indexer scores all S keys, the attention reads the 2,048 top-k
rows: what a step of a real model does per layer, without the other 60 layers. The FP8 cache implies DeepSeek's
FP8 indexer numerics (``DSAConfig.fp8_active``), so its step also rotates the indexer's queries and keys by the
Hadamard transform: the ratio compares the two deployments, ``auto`` against ``fp8_e4m3``, as a user picks one.

For each format, in the same process with the same weights and tokens (``--steps`` rounds after 2 untimed,
the formats' calls alternating within a round; medians):
  step_ms     the jitted decode step (``model.decode`` with the engine's indexer blocks)
  gather_ms   gathering the B x 2048 top-k rows alone, as stored (``DenseView.gather``)
  rows_ms     gathering and decoding them to the compute dtype (``kv_format.decode``; a cast for auto)
  keys_ms     reading the B x S stored keys and decoding them to float32 (``DenseView.index_keys``,
              ``kv_format.decode_keys``; float32 keys are read as they are)
  ratio       the FP8 step / the auto step

The FP8 rows and keys cost arithmetic to decode and save bytes to read; the ratio says which wins at each
size on this machine (a GPU's FP8 MLA kernel decodes in its loads, and its decode step is bound by reading).

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
from cli import OUT_HELP, check_memory, default_out, ints_in, out_path, write_results  # noqa: E402

CONFIG = os.path.join(REPO, "tests", "data", "deepseek_v32_config.json")
FORMATS = ("auto", "fp8_e4m3")
WARMUP = 2
PAGE = 64  # the engine's default page size (index_blocks keeps key blocks whole pages)


def layer_config(dtype: str, kv_cache_dtype: str, hidden: int | None = None):
  """DeepSeek-V3.2's config with one (dense-MLP) layer, a 256-wide MLP and a 1,024-token vocabulary (and hidden
  size ``hidden``, default the real 7168)."""
  from models.config import DSAConfig

  with open(CONFIG) as f:
    cfg = json.load(f)
  cfg.pop("quantization_config")
  cfg.update(
    num_hidden_layers=1,
    first_k_dense_replace=1,
    intermediate_size=256,
    vocab_size=1024,
    torch_dtype=dtype,
    hidden_size=hidden or cfg["hidden_size"],
  )
  return DSAConfig.from_hf_config(cfg).replace(kv_cache_dtype=kv_cache_dtype)


def _decode(graphdef, state, cache, tables, tokens, positions, blocks):
  """(logits, the cache with the decoded token's rows appended): one ``model.decode`` over the dense view."""
  from flax import nnx

  logits, view = nnx.merge(graphdef, state).decode(tokens, positions, cache.view(tables), **blocks)
  return logits, cache.absorb(view)


def measure(batch: int, context: int, dtype: str, steps: int, hidden: int | None = None) -> dict:
  """One (B, S) point, both formats: the module docstring's numbers. The formats' calls alternate within each
  round (auto, fp8, auto, ...), so a slow spell of this shared host hits both alike."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from hisparse_jax.engine.model_runner import index_blocks
  from models import kv_format
  from models.deepseek_v32 import DeepseekV32ForCausalLM
  from hisparse_jax.memory.views import DenseState

  B, S = batch, context
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 1024, B), jnp.int32)
  positions = jnp.full((B,), S - 1, jnp.int32)
  n_pages = B * S // PAGE
  latent = rng.standard_normal((1, n_pages, PAGE, 576), np.float32)
  keys = rng.standard_normal((1, n_pages, PAGE, 128), np.float32)
  # Each request's pages scattered over the pool, as a serving engine's free list leaves them.
  tables = {"pages": jnp.asarray(rng.permutation(n_pages).reshape(B, S // PAGE), jnp.int32)}
  top_k = jnp.asarray(
    np.sort(rng.permuted(np.tile(np.arange(S - 1), (B, 1)), axis=1)[:, :2048], axis=1)[:, None], jnp.int32
  )  # int32[B, 1, K]: distinct earlier positions
  state = None  # one set of weights: the formats' models differ only in how their caches store a row
  calls, out = {}, {"batch": B, "context": S, "dtype": dtype, "hidden": hidden or 7168}
  for kind in FORMATS:
    cfg = layer_config(dtype, kind, hidden)
    graphdef, own = nnx.split(DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    state = own if state is None else state
    del own
    cache = DenseState(
      kv_format.encode(kind, jnp.asarray(latent, cfg.dtype), 512), kv_format.encode_keys(kind, jnp.asarray(keys)), PAGE
    )
    blocks = index_blocks(B, 1, S - 1, heads=cfg.index_n_heads, top_k=cfg.index_topk, page_size=PAGE)
    # The cache donated and carried from call to call, as the engine does (else XLA copies the whole pool
    # for the token each call appends: 2.4 GB of float32 rows at B 32, S 32768).
    step = jax.jit(
      lambda st, c, g=graphdef, b=blocks: _decode(g, st, c, tables, tokens, positions, b), donate_argnums=1
    )
    gather = jax.jit(lambda c: c.view(tables).gather(0, positions[:, None], top_k)[0])
    rows = jax.jit(
      lambda c, k=kind, d=cfg.dtype: kv_format.decode(k, c.view(tables).gather(0, positions[:, None], top_k)[0], 512, d)
    )
    decoded_keys = jax.jit(lambda c: kv_format.decode_keys(c.view(tables).index_keys(0, jnp.int32(0), S)))
    held = {"cache": cache}
    del cache

    def decode_call(f=step, held=held):
      logits, held["cache"] = f(state, held["cache"])
      return logits

    calls[kind] = {
      "step_ms": decode_call,
      "gather_ms": lambda f=gather, h=held: f(h["cache"]),
      "rows_ms": lambda f=rows, h=held: f(h["cache"]),
      "keys_ms": lambda f=decoded_keys, h=held: f(h["cache"]),
    }
    out[kind] = {
      "row_bytes": int(held["cache"].latent.shape[-1] * held["cache"].latent.dtype.itemsize),
      "key_bytes": int(held["cache"].index.shape[-1] * held["cache"].index.dtype.itemsize),
    }
  del latent, keys  # the host copies (2.9 GB at B 32, S 32768)
  times = {(kind, name): [] for kind in FORMATS for name in calls[kind]}
  for r in range(WARMUP + steps):
    for (kind, name), got in times.items():
      t = time.perf_counter()
      jax.block_until_ready(calls[kind][name]())
      if r >= WARMUP:
        got.append(time.perf_counter() - t)
  for (kind, name), got in times.items():
    out[kind][name] = 1e3 * statistics.median(got)
  out["ratio"] = out["fp8_e4m3"]["step_ms"] / out["auto"]["step_ms"]
  return out


def markdown(rows: list[dict]) -> str:
  head = (
    "| B | S | dtype | step ms: auto / fp8 | fp8 / auto | top-k rows gathered ms: auto / fp8 | "
    "+ decoded ms: auto / fp8 | S keys read + decoded ms: auto / fp8 |\n|---|---|---|---|---|---|---|---|\n"
  )

  def pair(r, key):
    return f"{r['auto'][key]:.1f} / {r['fp8_e4m3'][key]:.1f}"

  body = "".join(
    f"| {r['batch']} | {r['context']} | {r['dtype']} | {pair(r, 'step_ms')} | **{r['ratio']:.2f}×** | "
    f"{pair(r, 'gather_ms')} | {pair(r, 'rows_ms')} | {pair(r, 'keys_ms')} |\n"
    for r in rows
  )
  return head + body


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--quick",
    action="store_true",
    help="one small point (batch 1, context 4096, 3 steps, hidden size "
    "1024: a smoke test of the script; the attention and the KV keep their real sizes)",
  )
  p.add_argument("--batches", type=ints_in(1, 1024), default=[1, 8, 32])
  p.add_argument(
    "--contexts",
    type=ints_in(2049, 163840),
    default=[8192, 32768],
    help="tokens per request (each > top_k 2048, at most DeepSeek-V3.2's 163840)",
  )
  p.add_argument(
    "--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype (float32: XLA:CPU's fast path)"
  )
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--out", type=out_path, help=OUT_HELP)
  args = p.parse_args(argv)
  if args.quick:
    args.batches, args.contexts, args.steps = [1], [4096], 3
  if min(args.contexts) <= 2048:
    p.error("--contexts must exceed top_k 2048 (every step then attends to 2,048 rows)")
  if args.steps < 1:
    p.error("--steps must be >= 1")
  # The KV of the largest point: latent rows (576 values) and indexer keys (128) per token, float32 at most.
  check_memory(
    p, max(args.batches) * max(args.contexts) * (576 + 128) * 4 * 2, "the KV cache of --batches x --contexts tokens"
  )
  t0 = time.perf_counter()
  rows = []
  for S in args.contexts:
    for B in args.batches:
      rows.append(measure(B, S, args.dtype, args.steps, 1024 if args.quick else None))
      print(json.dumps(rows[-1]), flush=True)
  results = {"rows": rows, "seconds": time.perf_counter() - t0}
  write_results(args.out or default_out("kv_dtype", args.quick), results, markdown(rows))


if __name__ == "__main__":
  main()
