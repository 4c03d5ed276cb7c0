"""The Python API in one script: batch greedy decoding, dense KV and HiSparse, on the embedded default model.

  python examples/python_api.py [--model-path DIR]

What the batch script (``python -m hisparse_jax.generate``) does for you, spelled out: the engine takes
token ids (a text prompt is tokenized first, with the model's BOS), ``submit`` queues a ``Request`` (a
``RequestError`` subclass says why one cannot run: ``InvalidRequest``, ``ResourceExhausted``), ``step``
runs one scheduling step and returns the requests it finished, ``run`` steps until all are done. Each
finished ``Request`` holds its ``output_ids``, ``text``, ``finish_reason`` and, with HiSparse, its swap-in
``hits`` / ``misses``. HiSparse is lossless: the two engines give the same tokens (``deterministic=True``
makes a request's tokens independent of what else is in the batch, so the comparison is exact).
"""

import argparse
import json
import pathlib

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, EngineArgs, InvalidRequest, Request
from hisparse_jax.engine.args import load_tokenizer_or_fail
from hisparse_jax.engine.detokenizer import encode_prompt

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model-path", default=None, help="HF or orbax model directory (default: the embedded model)")
ap.add_argument("--max-new-tokens", type=int, default=16)
args = ap.parse_args()

model_dir = EngineArgs(model_path=args.model_path).model_dir()  # the default model is generated on first use
tokenizer = load_tokenizer_or_fail(model_dir)  # None for a model without tokenizer.json: pass ids then
prompts = [
  json.loads(line)["text"]
  for line in (pathlib.Path(__file__).parent / "prompts.jsonl").read_text().splitlines()
  if line.strip()
]

outputs = {}
# top_k must be the model's index_topk (32 for the default model); a 64-slot hot buffer makes these
# 240-340-token prompts swap rows in from the host pool every step.
for mode, hisparse in (("dense", None), ("hisparse", HiSparseConfig(top_k=32, device_buffer_size=64))):
  engine = Engine(model_dir, hisparse=hisparse, tokenizer=tokenizer, max_seq_len=1024, deterministic=True)
  bos = engine.config.bos_token_id
  requests = [
    Request(f"{mode}-{i}", encode_prompt(tokenizer, text, bos), args.max_new_tokens) for i, text in enumerate(prompts)
  ]
  for req in requests:
    engine.submit(req)
  try:
    engine.submit(Request("too-long", [bos] * 2000, 8))  # longer than max_seq_len: refused before any work
  except InvalidRequest as e:
    print(f"[{mode}] refused: {e}")
  finished = []
  while engine.has_work():  # engine.run() does the same; step() lets you submit between steps
    finished += engine.step()
  engine.close()
  assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in requests)
  outputs[mode] = [req.output_ids for req in requests]
  for req in requests:
    stats = f", {req.hits} hits / {req.misses} misses" if hisparse else ""
    print(
      f"[{mode}] {req.request_id}: {len(req.prompt_ids)} prompt tokens, {req.finish_reason}{stats}: {req.text[:60]!r}"
    )

assert outputs["dense"] == outputs["hisparse"], "HiSparse must give the dense tokens"
print("dense and HiSparse tokens agree")
