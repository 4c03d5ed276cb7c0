r"""Compare our port of a checkpoint with transformers on a prompt: a porting experiment in one command.

  python -m models.compare --model-path DIR (--text "..." | --input-ids 1,2,3) [--max-new-tokens 16] \
      [--dtype float32] [--oracle-python .venv-oracle/bin/python]

Runs our Flax model (prefill logits at every prompt position, then a greedy
continuation through the decode path and a KV cache) and transformers'
reference (``tests/oracle/hf_oracle.py --run`` in the Python that has torch +
transformers: ``$HISPARSE_ORACLE_PYTHON``, else ``.venv-oracle/bin/python``
that ``make test`` creates), then prints the max abs prefill-logit error and
how many greedy tokens agree. Exit status 0 when both ran (whatever the
numbers), 2 when the oracle is missing or fails.

Compare in float32: in bfloat16 both sides drift from their own fp32 results
within a few tokens on small random models. Exact ties between indexer scores
are broken differently by jax.lax.top_k and torch.topk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.convert import load_model
from models.deepseek_v32 import decode_step, prefill_prompts
from models.from_torch import default_oracle_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE_SCRIPT = os.path.join(REPO, "tests", "oracle", "hf_oracle.py")


def ours(model_dir: str, prompt: list[int], max_new_tokens: int, dtype: str | None):
  """(prefill logits float32[S, V], greedy continuation list[int]) from our model and a contiguous KV cache."""
  _, model = load_model(model_dir, dtype=dtype)
  graphdef, state = nnx.split(model)
  S = len(prompt)
  logits, cache = prefill_prompts(model, [prompt], [S], max_len=S + max_new_tokens)
  out = [int(jnp.argmax(logits[0, -1]))]
  for pos in range(S, S + max_new_tokens - 1):
    step, cache = decode_step(graphdef, state, jnp.asarray([out[-1]], jnp.int32), jnp.asarray([pos], jnp.int32), cache)
    out.append(int(jnp.argmax(step[0])))
  return np.asarray(logits[0], np.float32), out


def reference(model_dir: str, prompt: list[int], max_new_tokens: int, python: str):
  """transformers' (prefill logits, greedy continuation), run in the oracle interpreter."""
  with tempfile.TemporaryDirectory() as tmp:
    prompts = os.path.join(tmp, "prompts.json")
    out = os.path.join(tmp, "out.npz")
    with open(prompts, "w") as f:
      json.dump([prompt], f)
    r = subprocess.run(
      [
        python,
        ORACLE_SCRIPT,
        "--run",
        model_dir,
        "--prompts",
        prompts,
        "--max-new-tokens",
        str(max_new_tokens),
        "--out",
        out,
      ],
      capture_output=True,
      text=True,
    )
    if r.returncode != 0:
      raise RuntimeError(f"transformers reference failed:\n{(r.stdout + r.stderr)[-3000:]}")
    data = np.load(out)
    return data["logits_0"], [int(t) for t in data["greedy_0"]]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model-path", required=True, help="HF-format checkpoint directory")
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--text", help="prompt text (needs tokenizer.json in the model dir; BOS prepended)")
  src.add_argument("--input-ids", help="comma-separated prompt token ids")
  ap.add_argument("--max-new-tokens", type=int, default=16)
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  ap.add_argument("--oracle-python", default=None, help="python with torch + transformers")
  args = ap.parse_args(argv)

  from models.config import DSAConfig
  from models.convert import ORBAX_MARKER, is_orbax_dir

  if is_orbax_dir(args.model_path):  # (before the oracle's own check: no oracle helps here)
    print(
      f"error: --model-path {args.model_path!r} is an orbax checkpoint, which transformers cannot read: compare "
      f'the HF directory it was converted from (its {ORBAX_MARKER} names it as "source")',
      file=sys.stderr,
    )
    return 2
  python = args.oracle_python or default_oracle_python()
  if not os.path.exists(python):
    print(f"error: no transformers oracle at {python} (run `make oracle`, or pass --oracle-python)", file=sys.stderr)
    return 2
  try:
    cfg = DSAConfig.from_pretrained(args.model_path)
    if args.text is not None:
      from hisparse_jax.engine.detokenizer import encode_prompt, load_tokenizer

      tok = load_tokenizer(args.model_path)
      if tok is None:
        raise ValueError("--text needs tokenizer.json in the model directory (or pass --input-ids)")
      prompt = encode_prompt(tok, args.text, cfg.bos_token_id)
    else:
      try:
        prompt = [int(x) for x in args.input_ids.split(",") if x.strip()]
      except ValueError:
        raise ValueError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from None
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  bad = next((t for t in prompt if not 0 <= t < cfg.vocab_size), None)
  if not prompt or args.max_new_tokens < 1 or bad is not None:
    print(
      "error: need a non-empty prompt of ids in the vocabulary [0, "
      f"{cfg.vocab_size}) and --max-new-tokens >= 1" + (f" (got id {bad})" if bad is not None else ""),
      file=sys.stderr,
    )
    return 2
  if len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:
    print(
      f"error: prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds the model's "
      f"max_position_embeddings {cfg.max_position_embeddings}",
      file=sys.stderr,
    )
    return 2

  try:
    our_logits, our_tokens = ours(args.model_path, prompt, args.max_new_tokens, args.dtype)
  except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is said in one line
    print(f"error: {args.model_path}: cannot load the model: {type(e).__name__}: {e}", file=sys.stderr)
    return 2
  try:
    ref_logits, ref_tokens = reference(args.model_path, prompt, args.max_new_tokens, python)
  except RuntimeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  err = float(np.abs(our_logits - ref_logits).max())
  agree = next((i for i, (a, b) in enumerate(zip(our_tokens, ref_tokens)) if a != b), len(our_tokens))
  print(f"prompt tokens: {len(prompt)}   dtype: {args.dtype}")
  print(f"prefill logits: max abs error {err:.3e} (over {our_logits.size} values)")
  print(
    f"greedy: first {agree} of {args.max_new_tokens} tokens agree"
    + ("" if agree == args.max_new_tokens else f" (ours {our_tokens[agree]}, transformers {ref_tokens[agree]})")
  )
  print(f"  ours:         {our_tokens}\n  transformers: {ref_tokens}")
  # The sequence length at the first disagreement: prefill row i sees i + 1 tokens; greedy token j, S + j.
  rows = np.flatnonzero(np.abs(our_logits - ref_logits).max(axis=-1) > 1e-3)
  first = min(
    ([int(rows[0]) + 1] if rows.size else []) + ([len(prompt) + agree] if agree < args.max_new_tokens else []),
    default=None,
  )
  topk = cfg.index_topk
  if first is not None and first > topk:  # the indexer picks a top-k only past index_topk tokens
    print(
      f"note: the first disagreement is at a sequence of {first} tokens, past index_topk = {topk}, where the "
      "indexer picks a top-k; an exact tie at its cut-off (common with few indexer heads: ReLU gives exact "
      "zeros) is broken differently by jax.lax.top_k and torch.topk. A prompt plus continuation of at most "
      f"{topk + 1} tokens has no cut-off: if that agrees, look for ties before a porting error."
    )
  elif first is not None and args.dtype == "bfloat16":
    print(
      "note: in bfloat16 both sides drift from their own float32 results within a few tokens; compare in "
      "float32 (the default) to check a port."
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
