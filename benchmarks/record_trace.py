r"""Records the indexer's own top-k trace at the real HiSparse sizes, for ``miss_rate.py --trace``.

  python benchmarks/record_trace.py [--quick] [--prompt-tokens 8192] [--new-tokens 500] \
      [--out benchmarks/results/topk_trace.npz]

--quick records 4 tokens after a 2600-token prompt (still longer than top_k, so the top-k is a real choice)
into benchmarks/results/quick/topk_trace.npz (git-ignored), never over the committed trace.

Model: ``bench_models.realsize_model()`` (the default model's architecture with index_topk 2048).
Prompt: text that does not change with this repository: the running interpreter's
standard-library ``argparse.py`` then ``textwrap.py``, tokenized with the model's DeepSeek-V3
tokenizer and cut to --prompt-tokens, after the BOS id. It runs the batch script as a user would
(``python -m hisparse_jax.generate --dump-topk``), dense mode (the top-k does not depend on the KV
cache mode: decoding is lossless), greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
from cli import default_out, out_path  # noqa: E402


def prompt_text_ids(tokenizer, n: int) -> list[int]:
  """The first n token ids of the standard library's argparse.py followed by textwrap.py."""
  stdlib = sysconfig.get_paths()["stdlib"]
  files = [os.path.join(stdlib, name) for name in ("argparse.py", "textwrap.py")]
  ids: list[int] = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      ids += tokenizer.encode(f.read(), add_special_tokens=False).ids
    if len(ids) >= n:
      return ids[:n]
  raise ValueError(f"the prompt text has only {len(ids)} tokens, fewer than {n}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument(
    "--prompt-tokens",
    type=int,
    default=8192,
    help="prompt tokens (> the model's top_k of 2048: a shorter sequence's top-k is all of it)",
  )
  ap.add_argument("--new-tokens", type=int, default=500, help="tokens decoded (one trace step each)")
  ap.add_argument(
    "--out",
    type=out_path,
    help="the .npz to write (default: benchmarks/results/local/topk_trace.npz, or quick/ with --quick; "
    "`make bench` writes benchmarks/results/topk_trace.npz)",
  )
  ap.add_argument("--quick", action="store_true", help="a 2600-token prompt and 4 new tokens (CI smoke)")
  if ap.parse_known_args(argv)[0].quick:  # small sizes as defaults: flags given explicitly still win
    ap.set_defaults(prompt_tokens=2600, new_tokens=4)
  args = ap.parse_args(argv)
  import bench_models

  top_k = bench_models.REALSIZE_HISPARSE["top_k"]
  if args.prompt_tokens <= top_k:
    ap.error(
      f"--prompt-tokens must exceed the model's top_k ({top_k}): a shorter sequence's top-k is every "
      f"position, which no policy can miss; got {args.prompt_tokens}"
    )
  if args.new_tokens < 2:
    ap.error(
      f"--new-tokens must be >= 2 (the first comes from the prefill: decode steps start at the second), "
      f"got {args.new_tokens}"
    )
  args.out = args.out or default_out("topk_trace.npz", args.quick)
  from tokenizers import Tokenizer

  model_dir = bench_models.realsize_model()
  tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
  try:
    ids = [0] + prompt_text_ids(tok, args.prompt_tokens - 1)  # BOS + text
  except ValueError as e:
    ap.error(f"--prompt-tokens {args.prompt_tokens}: {e}")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    prompts = os.path.join(tmp, "prompts.jsonl")
    with open(prompts, "w") as f:
      f.write(json.dumps({"input_ids": ids}) + "\n")
    cmd = [
      sys.executable,
      "-m",
      "hisparse_jax.generate",
      "--model-path",
      model_dir,
      "--prompts",
      prompts,
      "--max-new-tokens",
      str(args.new_tokens),
      "--max-running-requests",
      "1",
      "--max-seq-len",
      str(args.prompt_tokens + args.new_tokens),
      "--dump-topk",
      args.out,
      "--output",
      os.path.join(tmp, "out.jsonl"),
    ]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO).returncode
  if rc:
    print(f"error: the batch script failed (status {rc}; its message is above)", file=sys.stderr)
  return rc


if __name__ == "__main__":
  sys.exit(main())
