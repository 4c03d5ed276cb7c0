"""Decoding over a device mesh equals one device (run by tests/test_mesh.py in a subprocess with 8 simulated
CPU devices: XLA_FLAGS must be set before JAX starts).

For each model (tiny DeepSeek-V3.2 and GLM-5 configs of the oracle tests, with 8 attention heads and 8
routed experts so that every mesh divides them) and each mesh (dp, tp, ep), the KV harness runs 4 prompts
(shorter and longer than the hot buffer) through prefill and 12 decode steps, dense and HiSparse:
  - greedy tokens, compared with one device;
  - teacher-forced logits dense vs HiSparse under the same mesh, compared bitwise;
  - HiSparse swap-in hits and misses per request and layer, compared with one device.
The engine runs one mesh end to end too. Prints one JSON object.
"""

import dataclasses
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

from hisparse_jax.config import HiSparseConfig  # noqa: E402
from hisparse_jax.sharding import MeshConfig  # noqa: E402
from models.loader import load_hf  # noqa: E402
from models.random_checkpoint import write_random_checkpoint  # noqa: E402
from tests.kv_harness import KVHarness  # noqa: E402
from tests.oracle.tiny_configs import TINY_CONFIG, TINY_GLM_CONFIG  # noqa: E402

WIDE = {"num_attention_heads": 8, "num_key_value_heads": 8}
MODELS = {"deepseek_v32": {**TINY_CONFIG, **WIDE},
          "glm_moe_dsa": {**TINY_GLM_CONFIG, **WIDE, "architectures": ["GlmMoeDsaForCausalLM"],
                          "model_type": "glm_moe_dsa"}}
HS = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4)
PROMPT_LENS = (5, 17, 30, 60)
STEPS = 12


def run(model_dir, mesh, hisparse):
  cfg, model = load_hf(model_dir)  # a fresh model: the harness may mark its MoE modules expert-parallel
  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, 500, n).tolist() for n in PROMPT_LENS]
  greedy = KVHarness(cfg, model, hisparse=hisparse, mesh_config=mesh, slots=len(prompts) + 1).greedy(prompts, STEPS)
  cfg, model = load_hf(model_dir)
  h = KVHarness(cfg, model, hisparse=hisparse, mesh_config=mesh, slots=len(prompts) + 1)
  logits = [h.prefill(prompts)]
  forced = np.random.default_rng(1).integers(2, 500, (STEPS, len(prompts)))
  logits += [h.decode(t) for t in forced]
  stats = h.swap_stats().tolist() if hisparse else None
  return greedy, np.stack(logits), stats


def engine_tokens(model_dir, mesh, hisparse):
  """(tokens, (hits, misses)) per request from the engine on the mesh."""
  from hisparse_jax.engine import Engine, Request
  kw = {"hisparse_config": json.dumps(dataclasses.asdict(HS))} if hisparse else {}
  e = Engine(model_dir, max_seq_len=128, max_running_requests=4, deterministic=True, enable_hisparse=hisparse,
             dp_size=mesh.dp_size, tp_size=mesh.tp_size, ep_size=mesh.ep_size, **kw)
  rng = np.random.default_rng(5)
  reqs = [Request(f"r{i}", rng.integers(2, 500, n).tolist(), max_new_tokens=10, ignore_eos=True)
          for i, n in enumerate(PROMPT_LENS)]
  for r in reqs:
    e.submit(r)
  while e.has_work():
    e.step()
  return [(r.output_ids, r.hits, r.misses) for r in reqs]


def main(meshes):
  out = {}
  root = tempfile.mkdtemp(prefix="hisparse-mesh-")
  for name, config in MODELS.items():
    model_dir = write_random_checkpoint(os.path.join(root, name), config, seed=3)
    base = {hs: run(model_dir, MeshConfig(), HS if hs else None) for hs in (False, True)}
    for dp, tp, ep in meshes:
      mesh = MeshConfig(dp, tp, ep)
      dense, hisparse = run(model_dir, mesh, None), run(model_dir, mesh, HS)
      out[f"{name} {dp},{tp},{ep}"] = {
          "greedy_equal_one_device": dense[0] == base[False][0] and hisparse[0] == base[True][0],
          "logits_bitwise_dense_vs_hisparse": bool(np.array_equal(dense[1], hisparse[1])),
          "max_logit_diff_vs_one_device": float(np.abs(dense[1] - base[False][1]).max()),
          "swap_stats_equal_one_device": hisparse[2] == base[True][2],
          "misses": int(np.asarray(hisparse[2])[..., 1].sum()),
      }
    if name == "deepseek_v32":  # the engine end to end on the widest mesh
      for hs in (False, True):
        out[f"engine {name} {'hisparse' if hs else 'dense'} {','.join(map(str, meshes[0]))}"] = {
            "equal_one_device": engine_tokens(model_dir, MeshConfig(*meshes[0]), hs) ==
            engine_tokens(model_dir, MeshConfig(), hs)}
    meshes = meshes[:1]  # the other models: the widest mesh only
  print(json.dumps(out))


if __name__ == "__main__":
  main([tuple(int(v) for v in m.split(",")) for m in sys.argv[1:]] or [(1, 8, 8), (1, 8, 1), (1, 2, 2)])
