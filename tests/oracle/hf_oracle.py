"""HuggingFace transformers oracle for the DSA model tests (DeepSeek-V3.2 and GLM-5 / GlmMoeDsa).

Runs in the *oracle* environment (torch + transformers), never in the main venv.  The
pytest suite calls it in a subprocess (see tests/test_model_oracle.py).

Usage:
    python hf_oracle.py --make-checkpoint DIR --seed N [--model-type deepseek_v32|glm_moe_dsa]
                        [--config-json '{...}']
        Build ``DeepseekV32ForCausalLM`` (``TINY_CONFIG``) or ``GlmMoeDsaForCausalLM``
        (``TINY_GLM_CONFIG``) in fp32 from a tiny config updated by the JSON overrides, initialise it with ``torch.manual_seed(N)`` (the zero-initialised router
        ``e_score_correction_bias`` is then drawn from N(0, 0.05) so selection-only bias is exercised)
        and ``save_pretrained(DIR)``; with ``--save-torch DIR2`` also ``torch.save`` its state dict in two
        shards (a PyTorch pickle checkpoint).  With a ``rope_scaling`` override, config.json is rewritten in
        DeepSeek's legacy form (``rope_scaling`` + top-level ``rope_theta``, no ``rope_parameters``).

    python hf_oracle.py --run DIR --prompts prompts.json --max-new-tokens 16 --out out.npz
        The model class comes from config.json (``AutoModelForCausalLM``).
        ``prompts.json`` is a list of token-id lists.  For prompt i the npz holds
        ``logits_{i}``: float32[S_i, V] (prefill logits at every position) and
        ``greedy_{i}``: int64[max_new_tokens] (greedy continuation computed by repeated full
        forward passes without a cache, so it exercises the same code path as prefill).
        Also ``cached_{i}``: int64[max_new_tokens], greedy through transformers' own KV cache
        (its indexer-key cache / decode path).

The two modes can be combined in one invocation (make, then run) to save interpreter start-up.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import numpy as np
import torch

# The tiny configs live in a dependency-free module shared with the tests.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_configs import TINY_CONFIG, TINY_GLM_CONFIG  # noqa: E402


def _model_class(model_type: str):
  import transformers

  return {"deepseek_v32": transformers.DeepseekV32ForCausalLM, "glm_moe_dsa": transformers.GlmMoeDsaForCausalLM}[
    model_type
  ]


def _build_config(overrides: dict, model_type: str = "deepseek_v32"):
  from transformers import DeepseekV32Config, GlmMoeDsaConfig

  if model_type == "glm_moe_dsa":
    cfg = dict(TINY_GLM_CONFIG)
    cfg.update(overrides)
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    return GlmMoeDsaConfig(**cfg)
  cfg = dict(TINY_CONFIG)
  cfg.update(overrides)
  if "rope_scaling" in overrides:
    # Legacy DeepSeek form: rope_scaling + rope_theta at the top level.
    cfg.pop("rope_parameters", None)
  cfg.pop("architectures", None)
  cfg.pop("model_type", None)
  return DeepseekV32Config(**cfg)


def save_torch(model, out_dir: str, config_dir: str) -> None:
  """``torch.save`` of the model's in-memory state dict (fused experts, tied weights sharing storage) in two
  shards with transformers' ``pytorch_model.bin.index.json``, plus ``config_dir``'s config.json: a PyTorch
  pickle checkpoint for ``models.from_torch``."""
  import shutil

  os.makedirs(out_dir, exist_ok=True)
  state = model.state_dict()
  keys = list(state)
  weight_map = {}
  for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
    name = f"pytorch_model-{i + 1:05d}-of-00002.bin"
    torch.save({k: state[k] for k in part}, os.path.join(out_dir, name))
    weight_map.update(dict.fromkeys(part, name))
  with open(os.path.join(out_dir, "pytorch_model.bin.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  shutil.copy(os.path.join(config_dir, "config.json"), out_dir)


def make_checkpoint(
  out_dir: str, seed: int, overrides: dict, model_type: str = "deepseek_v32", torch_dir: str | None = None
) -> None:
  config = _build_config(copy.deepcopy(overrides), model_type)  # transformers mutates rope dicts in place
  torch.manual_seed(seed)
  model = _model_class(model_type)(config).to(torch.float32).eval()
  # Give the (zero-initialised) routing correction bias some signal so that the test covers
  # "bias used for selection only".
  with torch.no_grad():
    for layer in model.model.layers:
      gate = getattr(layer.mlp, "gate", None)
      if gate is not None:
        gate.e_score_correction_bias.normal_(0.0, 0.05)
  model.save_pretrained(out_dir, safe_serialization=True)
  if "rope_scaling" in overrides:
    # Rewrite config.json in DeepSeek's own legacy form (rope_scaling + rope_theta) so the
    # JAX side has to parse it; transformers reads it back identically.
    with open(f"{out_dir}/config.json") as f:
      saved = json.load(f)
    saved.pop("rope_parameters", None)
    saved["rope_scaling"] = overrides["rope_scaling"]
    if "rope_theta" in overrides:
      saved["rope_theta"] = overrides["rope_theta"]
    with open(f"{out_dir}/config.json", "w") as f:
      json.dump(saved, f, indent=2)
  if torch_dir:
    save_torch(model, torch_dir, out_dir)


@torch.no_grad()
def run(model_dir: str, prompts_path: str, max_new_tokens: int, out_path: str) -> None:
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(2)
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
  with open(prompts_path) as f:
    prompts = json.load(f)
  result: dict[str, np.ndarray] = {}
  for i, prompt in enumerate(prompts):
    ids = torch.tensor([prompt], dtype=torch.long)
    logits = model(input_ids=ids, use_cache=False).logits[0]
    result[f"logits_{i}"] = logits.float().numpy()
    # Greedy by repeated full (uncached) forward passes.
    seq = list(prompt)
    nxt = int(logits[-1].argmax())
    out = []
    for step in range(max_new_tokens):
      out.append(nxt)
      seq.append(nxt)
      if step + 1 < max_new_tokens:
        lg = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        nxt = int(lg.argmax())
    result[f"greedy_{i}"] = np.asarray(out, dtype=np.int64)
    # Greedy through transformers' own cache (decode path of the reference).
    outc = model(input_ids=ids, use_cache=True)
    cache = outc.cache if hasattr(outc, "cache") else outc.past_key_values
    nxt = int(outc.logits[0, -1].argmax())
    cached = []
    for step in range(max_new_tokens):
      cached.append(nxt)
      if step + 1 < max_new_tokens:
        o = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = o.cache if hasattr(o, "cache") else o.past_key_values
        nxt = int(o.logits[0, -1].argmax())
    result[f"cached_{i}"] = np.asarray(cached, dtype=np.int64)
  np.savez(out_path, **result)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--make-checkpoint", metavar="DIR")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--config-json", default="{}", help="JSON dict of config overrides")
  p.add_argument("--model-type", default="deepseek_v32", choices=("deepseek_v32", "glm_moe_dsa"))
  p.add_argument("--save-torch", metavar="DIR", help="with --make-checkpoint: also torch.save the state dict")
  p.add_argument("--run", metavar="DIR")
  p.add_argument("--prompts")
  p.add_argument("--max-new-tokens", type=int, default=16)
  p.add_argument("--out")
  args = p.parse_args(argv)
  if not args.make_checkpoint and not args.run:
    p.error("nothing to do: pass --make-checkpoint and/or --run")
  if args.make_checkpoint:
    make_checkpoint(args.make_checkpoint, args.seed, json.loads(args.config_json), args.model_type, args.save_torch)
  if args.run:
    if not (args.prompts and args.out):
      p.error("--run needs --prompts and --out")
    run(args.run, args.prompts, args.max_new_tokens, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
