r"""Worker of benchmarks/vs_transformers.py: times transformers' eager ``generate`` (oracle env only).

  .venv-oracle/bin/python benchmarks/hf_generate_timing.py --model-dir DIR --prompts prompts.json \
      --batches 1,8,32 --new-tokens 64 --repeats 3 --threads 2 --out hf.json

Runs in the test-only oracle environment (torch + transformers); the runtime
never imports it. Loads ``AutoModelForCausalLM.from_pretrained(DIR,
dtype=torch.float32)`` (transformers 5 takes ``dtype=``; ``torch_dtype=`` is
deprecated), eval mode, ``torch.set_num_threads(--threads)``. For each batch
size B the batch is the first B prompts of ``prompts.json`` (a list of
equal-length token-id lists: no padding, attention mask all ones) and, under
``torch.inference_mode()``:

  generate(input_ids, attention_mask=ones, do_sample=False,
           max_new_tokens=N, min_new_tokens=N)

with the model's EOS id cleared from its generation config (so EOS is neither
a stop nor suppressed: the same as our ``Request.ignore_eos``), and no
``pad_token_id`` (pad id 0 would be BOS here). One untimed warm-up call, then
``--repeats`` timed calls (wall seconds, prefill included). A logits processor
stamps the time at every generated token: the gaps between stamps are decode
steps (one forward of the whole batch over one new token each).

Tie-break: the indexer's scores are ReLU sums, so with few indexer heads
(the default model has 4) several positions can score exactly 0.0 at the
top-k boundary; ``torch.topk`` then picks among them in an unspecified order,
``jax.lax.top_k`` (ours) the lowest positions. The timed calls run stock
transformers; one more, untimed, call per batch runs with the indexer's top-k
made stable (equal scores: lowest position first, ``aligned_topk``), which is
what the "same model" check compares against.

Writes OUT (JSON): versions, thread counts, attention implementation, load
time, and per batch ``times_s`` (each repeat), ``step_ms`` (every decode
step of every timed repeat), ``prefill_s`` (generate start to the first stamp,
per repeat), ``ids`` (int[B][N], the new tokens of the last timed repeat) and
``aligned_ids`` (the same from the tie-break-aligned call).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import numpy as np
import torch
import transformers


class _StepClock(transformers.LogitsProcessor):
  """Records time.perf_counter() each time generate asks for the next token's scores."""

  def __init__(self):
    self.stamps = []

  def __call__(self, input_ids, scores):
    self.stamps.append(time.perf_counter())
    return scores


def _stable_topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch.Tensor.topk's signature)
  """torch.Tensor.topk with a defined tie-break: equal values keep their order (lowest index first)."""
  idx = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
  return torch.return_types.topk((x.gather(dim, idx), idx))


@contextlib.contextmanager
def aligned_topk(model):
  """Within the model's indexer modules (class name ending in "Indexer"), Tensor.topk is _stable_topk:
  the tie-break of jax.lax.top_k, which our indexer uses."""
  stock = torch.Tensor.topk

  def enter(module, args):
    torch.Tensor.topk = _stable_topk

  def leave(module, args, output):
    torch.Tensor.topk = stock

  handles = []
  for m in model.modules():
    if type(m).__name__.endswith("Indexer"):
      handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
  if not handles:
    raise RuntimeError(f"{type(model).__name__} has no *Indexer module")
  try:
    yield
  finally:
    for h in handles:
      h.remove()
    torch.Tensor.topk = stock


def time_generate(model, input_ids, new_tokens: int, repeats: int) -> dict:
  """Warm-up + `repeats` timed generate calls on input_ids (int64[B, S]); see the module docstring."""
  mask = torch.ones_like(input_ids)

  def call(clock=None):
    procs = transformers.LogitsProcessorList([clock] if clock is not None else [])
    out = model.generate(
      input_ids,
      attention_mask=mask,
      do_sample=False,
      max_new_tokens=new_tokens,
      min_new_tokens=new_tokens,
      logits_processor=procs,
    )
    if out.shape != (input_ids.shape[0], input_ids.shape[1] + new_tokens):
      raise RuntimeError(
        f"generate returned shape {tuple(out.shape)}, expected {(input_ids.shape[0], input_ids.shape[1] + new_tokens)}"
      )
    return out

  t0 = time.perf_counter()
  call()
  warmup_s = time.perf_counter() - t0
  times, step_ms, prefill_s = [], [], []
  for _ in range(repeats):
    clock = _StepClock()
    t0 = time.perf_counter()
    out = call(clock)
    times.append(time.perf_counter() - t0)
    prefill_s.append(clock.stamps[0] - t0)
    step_ms += (np.diff(clock.stamps) * 1e3).tolist()
  with aligned_topk(model):
    aligned = call()
  return dict(
    warmup_s=warmup_s,
    times_s=times,
    step_ms=step_ms,
    prefill_s=prefill_s,
    ids=out[:, input_ids.shape[1] :].tolist(),
    aligned_ids=aligned[:, input_ids.shape[1] :].tolist(),
  )


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model-dir", required=True)
  ap.add_argument("--prompts", required=True, help="JSON list of equal-length token-id lists")
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--threads", type=int, default=os.cpu_count())
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  torch.set_num_threads(args.threads)
  with open(args.prompts) as f:
    prompts = json.load(f)
  batches = [int(x) for x in args.batches.split(",")]
  if max(batches) > len(prompts) or len({len(p) for p in prompts}) != 1:
    print(f"error: need >= {max(batches)} prompts of one length", file=sys.stderr)
    return 1
  t0 = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
  load_s = time.perf_counter() - t0
  model.generation_config.eos_token_id = None  # generate exactly --new-tokens, EOS included (ignore_eos)
  model.generation_config.pad_token_id = None
  result = dict(
    python=platform.python_version(),
    torch=torch.__version__,
    transformers=transformers.__version__,
    torch_threads=torch.get_num_threads(),
    torch_interop_threads=torch.get_num_interop_threads(),
    attn_implementation=model.config._attn_implementation,
    model_class=type(model).__name__,
    param_dtype=str(next(model.parameters()).dtype),
    load_s=load_s,
    batches={},
  )
  with torch.inference_mode():
    for b in batches:
      input_ids = torch.tensor(prompts[:b], dtype=torch.long)
      result["batches"][str(b)] = time_generate(model, input_ids, args.new_tokens, args.repeats)
      print(f"transformers batch {b}: {np.median(result['batches'][str(b)]['times_s']):.3f} s", flush=True)
  with open(args.out, "w") as f:
    json.dump(result, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
