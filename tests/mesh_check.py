"""Decoding over a device mesh equals one device (run by tests/test_mesh.py in a subprocess with 8 simulated
CPU devices: XLA_FLAGS must be set before JAX starts).

For each model (tiny DeepSeek-V3.2 and GLM-5 configs of the oracle tests, with 8 attention heads and 8
routed experts so that every mesh divides them) and each mesh (dp, tp, ep), the KV harness decodes 4 prompts
(shorter and longer than the hot buffer) greedily, 12 tokens each, dense and HiSparse:
  - greedy tokens, compared with one device;
  - the logits of every step, dense vs HiSparse under the same mesh, compared bitwise;
  - HiSparse swap-in hits and misses per request and layer, compared with one device;
  - every KV pool, hot buffer and the pinned_host host pool keeps its address: updated in place.
The engine runs the first mesh end to end too (full-batch and bucketed steps); FP8-resident weights run on
the meshes too (``fp8_check``). Prints one JSON object.
"""

import dataclasses
import json
import os
import sys

from tests.xla_env import with_devices

os.environ["XLA_FLAGS"] = with_devices(8)  # (the caller's flags kept: tests/xla_env.py)

import numpy as np  # noqa: E402

from hisparse_jax.config import HiSparseConfig  # noqa: E402
from hisparse_jax.sharding import MeshConfig  # noqa: E402
from models.loader import load_hf  # noqa: E402
from models.random_checkpoint import write_random_checkpoint  # noqa: E402
from tests.kv_harness import KVHarness  # noqa: E402
from tests.oracle.tiny_configs import TINY_CONFIG, TINY_GLM_CONFIG  # noqa: E402
from tests.tiny_model import scratch_dir  # noqa: E402

WIDE = {"num_attention_heads": 8, "num_key_value_heads": 8}
MODELS = {
  "deepseek_v32": {**TINY_CONFIG, **WIDE},
  "glm_moe_dsa": {**TINY_GLM_CONFIG, **WIDE, "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"},
}
HS = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4)
PROMPT_LENS = (5, 17, 30, 50)  # + STEPS stays within one 64-key decode window (one decode compile)
GLM_MESHES = ((1, 8, 1),)
STEPS = 12


def run(model_dir, mesh, hisparse, kv_cache_dtype="auto"):
  """Greedy decoding of the prompts: (tokens per prompt, float32[steps, prompts, V] logits, swap stats)."""
  cfg, model = load_hf(model_dir, kv_cache_dtype=kv_cache_dtype, expert_parallel=mesh.expert_parallel())
  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, 500, n).tolist() for n in PROMPT_LENS]
  # Prompts prefilled in chunks of 16; every call scores a window of 64 indexer keys in two key blocks (one
  # compiled prefill and one decode program).
  h = KVHarness(cfg, model, hisparse=hisparse, mesh_config=mesh, slots=len(prompts) + 1, chunk=16, window=64)
  logits = [h.prefill(prompts)]
  buffers = _buffers(h.backend.state)
  for _ in range(STEPS - 1):
    logits.append(h.decode(logits[-1].argmax(-1)))
  logits = np.stack(logits)
  stats = h.swap_stats().tolist() if hisparse else None
  return logits.argmax(-1).T.tolist(), logits, stats, _buffers(h.backend.state) == buffers


POOLS = ("latent", "index", "staging", "hot", "host_pool")  # the per-token pools and hot buffers


def _buffers(state):
  """Buffer addresses of every shard of the KV pools, hot buffers and host pool: unchanged = updated in place.
  (The small int32 slot tables and LRU orders are left out: XLA re-allocated them on one mesh.)"""
  return [
    s.data.unsafe_buffer_pointer()
    for name in POOLS
    if hasattr(state, name)
    for s in getattr(state, name).addressable_shards
  ]


def engine_tokens(model_dir, mesh, hisparse, deterministic=True, resident=False):
  """(tokens, hits, misses) per request from the engine on the mesh (deterministic: full-batch steps, each
  request in its own slot's row; else power-of-two buckets per DP group). resident: HiSparse with dynamic
  residency where a DP group's staging pages hold one 80-token context (16-token pages, a 200 kB budget), so
  that two requests of a group do not both fit: mixed batches and per-group offloads; with the cross-layer
  prefetch on too (its start and wait run per DP group, idle for resident rows)."""
  from hisparse_jax.engine import Engine, Request

  kw = {"hisparse_config": json.dumps(dataclasses.asdict(HS))} if hisparse else {}
  max_seq_len = 128
  if resident:
    kw = {
      "hisparse_config": json.dumps({**dataclasses.asdict(HS), "resident_fraction": 0.01, "prefetch": "next_layer"}),
      "max_device_kv_bytes": 200_000,
      "page_size": 16,
    }
    max_seq_len = 80
  e = Engine(
    model_dir,
    max_seq_len=max_seq_len,
    max_running_requests=8,
    deterministic=deterministic,
    enable_hisparse=hisparse,
    dp_size=mesh.dp_size,
    tp_size=mesh.tp_size,
    ep_size=mesh.ep_size,
    **kw,
  )
  rng = np.random.default_rng(5)
  reqs = [
    Request(f"r{i}", rng.integers(2, 500, n).tolist(), max_new_tokens=10, ignore_eos=True)
    for i, n in enumerate(PROMPT_LENS)
  ]
  for r in reqs:
    e.submit(r)
  while e.has_work():
    e.step()
  return [(r.output_ids, r.hits, r.misses) for r in reqs]


def loading_check(model_dir, mesh_cfg):
  """Parameters loaded straight onto the mesh (HF safetensors and orbax): each has its rule-table sharding,
  split ones are split on the devices, and the values equal a one-device load."""
  import jax
  from flax import nnx
  from hisparse_jax.sharding import placer
  from models.convert import convert, load_model

  mesh = mesh_cfg.make_mesh()
  _, one = load_model(model_dir)
  want = dict(jax.tree_util.tree_flatten_with_path(nnx.state(one))[0])
  orbax_dir = os.path.join(scratch_dir("hisparse-orbax-"), "ckpt")
  convert(model_dir, orbax_dir, None)
  out = {}
  for name, path in (("hf", model_dir), ("orbax", orbax_dir)):
    _, model = load_model(path, sharding=placer(mesh_cfg, mesh))
    got = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    out[name] = {
      "rule_shardings": all(x.sharding.spec == mesh_cfg.spec(sharding_path(p), x.shape) for p, x in got),
      "values_equal_one_device": all(np.array_equal(np.asarray(x), np.asarray(want[p])) for p, x in got),
      "ep": mesh_cfg.ep_size,
      # Experts of a MoE layer (8 of them): each device holds 8 / ep.
      "experts_per_device": {
        s.data.shape[0]
        for s in dict((sharding_path(p), x) for p, x in got)["layers/1/mlp/gate_proj"].addressable_shards
      },
    }
  return out


FP8_CONFIG = {
  "num_attention_heads": 8,
  "num_key_value_heads": 8,
  "n_routed_experts": 8,
  "hidden_size": 256,
  "intermediate_size": 256,
  "moe_intermediate_size": 256,
  "q_lora_rank": 256,
  "kv_lora_rank": 128,
  "qk_nope_head_dim": 32,
  "qk_rope_head_dim": 16,
  "v_head_dim": 32,
  "vocab_size": 512,
}


def fp8_check(meshes):
  """FP8-resident weights (e4m3 + 128 x 128 scales, split like their weights) on each mesh: the logits of
  dequantizing at load on the same mesh bit for bit, and one device's greedy tokens (float32)."""
  import pathlib
  from hisparse_jax.sharding import placer
  from models.convert import load_model
  from tests.test_fp8_checkpoint import DSV32, write_fp8_pair

  fp8_dir, _, _ = write_fp8_pair(pathlib.Path(scratch_dir("hisparse-fp8-")), {**DSV32, **FP8_CONFIG}, seed=3)

  def run(mesh_cfg, resident):
    mesh = mesh_cfg.make_mesh() if mesh_cfg.num_devices > 1 else None
    cfg, model = load_model(
      fp8_dir,
      fp8_weights=resident,
      sharding=None if mesh is None else placer(mesh_cfg, mesh),
      expert_parallel=mesh_cfg.expert_parallel(),
    )
    h = KVHarness(cfg, model, mesh_config=mesh_cfg, chunk=16, window=32)  # (one prefill and one decode program)
    logits = [h.prefill([[5, 6, 7, 8] * 6, [9, 10, 11]])]
    for _ in range(5):
      logits.append(h.decode(logits[-1].argmax(-1)))
    scales = (
      {
        s.data.shape
        for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
        if sharding_path(p) == "layers/1/mlp/gate_proj_scale"
        for s in x.addressable_shards
      }
      if resident
      else None
    )
    return np.stack(logits), scales

  import jax
  from flax import nnx

  one = run(MeshConfig(), True)[0]
  out = {}
  for dp, tp, ep in meshes:
    mesh_cfg = MeshConfig(dp, tp, ep)
    (resident, scales), (at_load, _) = run(mesh_cfg, True), run(mesh_cfg, False)
    out[f"{dp},{tp},{ep}"] = {
      "logits_bitwise_resident_vs_at_load": bool(np.array_equal(resident, at_load)),
      "greedy_equal_one_device": bool((resident.argmax(-1) == one.argmax(-1)).all()),
      "expert_scale_shards": sorted(scales),
    }
  return out


def moe_check():
  """models.moe.expert_parallel_ffn with DP groups (token axis dp) against the dense evaluation on one device:
  all-to-all dispatch where the experts are split over dp (also with a tp split of each group's tokens, an
  expert width split over tp, group sizes not divisible by tp, every token routed to the same experts), a
  group-local psum where they are split over tp only; and which collectives the compiled call holds."""
  import re

  import jax
  import jax.numpy as jnp
  from models.moe import dense_expert_ffn, expert_parallel_ffn

  hi = jax.lax.Precision.HIGHEST
  rng = np.random.default_rng(0)
  E, H, I, k = 8, 16, 8, 3
  gate, up = (jnp.asarray(rng.standard_normal((E, H, I)) * 0.3, jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.standard_normal((E, I, H)) * 0.3, jnp.float32)
  out = {}
  for dp, tp, ep in ((8, 1, 8), (2, 4, 8), (4, 2, 4), (2, 4, 4)):
    mesh_cfg = MeshConfig(dp, tp, ep)
    width = mesh_cfg.logical_to_mesh()["moe_mlp"] if mesh_cfg.expert_axes else None
    fn = jax.jit(
      lambda *a: expert_parallel_ffn(
        *a, expert_axes=mesh_cfg.expert_axes, width_axis=width, token_axis="dp", precision=hi
      )
    )
    errors = []
    for per_group in (1, 3, 8):
      for routing in ("random", "same"):
        T = dp * per_group
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        e = (
          np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
          if routing == "random"
          else np.tile(np.arange(k), (T, 1))
        )
        e, w = jnp.asarray(e, jnp.int32), jnp.asarray(rng.random((T, k)), jnp.float32)
        ref = np.asarray(dense_expert_ffn(x, e, w, gate, up, down, precision=hi))
        with jax.set_mesh(mesh_cfg.make_mesh()):
          got = np.asarray(fn(x, e, w, gate, up, down))
          if per_group == 1:
            hlo = fn.lower(x, e, w, gate, up, down).compile().as_text()
        errors.append(float(np.abs(got - ref).max() / np.abs(ref).max()))
    out[f"{dp},{tp},{ep}"] = {
      "max_rel_error": max(errors),
      **{op: bool(re.search(rf" {op}(-start)?\(", hlo)) for op in ("all-to-all", "all-reduce")},
    }
  return out


def sharding_path(p):
  from models.loader import param_path

  return param_path(p)


def main(meshes):
  out = {}
  root = scratch_dir("hisparse-mesh-")
  for name, config in MODELS.items():
    model_dir = write_random_checkpoint(os.path.join(root, name), config, seed=3)
    base = {hs: run(model_dir, MeshConfig(), HS if hs else None) for hs in (False, True)}
    # GLM-5 differs from DeepSeek-V3.2 in its shared-indexer layers, not in how a mesh splits it: one mesh,
    # every weight over tp, covers it (time; DeepSeek-V3.2 runs every mesh).
    for dp, tp, ep in meshes if name == "deepseek_v32" else [m for m in meshes if m in GLM_MESHES]:
      mesh = MeshConfig(dp, tp, ep)
      dense, hisparse = run(model_dir, mesh, None), run(model_dir, mesh, HS)
      out[f"{name} {dp},{tp},{ep}"] = {
        "greedy_equal_one_device": dense[0] == base[False][0] and hisparse[0] == base[True][0],
        "logits_bitwise_dense_vs_hisparse": bool(np.array_equal(dense[1], hisparse[1])),
        "max_logit_diff_vs_one_device": float(np.abs(dense[1] - base[False][1]).max()),
        "swap_stats_equal_one_device": hisparse[2] == base[True][2],
        "misses": int(np.asarray(hisparse[2])[..., 1].sum()),
        "kv_updated_in_place": dense[3] and hisparse[3],
      }
    if name == "deepseek_v32":
      # The FP8 KV cache (uint8 rows in every pool) on 2 DP groups of 4 tp devices: one device's logits.
      fp8 = {
        mesh: {hs: run(model_dir, MeshConfig(*mesh), HS if hs else None, "fp8_e4m3") for hs in (False, True)}
        for mesh in ((1, 1, 1), (2, 4, 8))
      }
      one, on_mesh = fp8[(1, 1, 1)], fp8[(2, 4, 8)]
      out["kv fp8 2,4,8"] = {
        "greedy_equal_one_device": on_mesh[False][0] == one[False][0] and on_mesh[True][0] == one[True][0],
        "logits_bitwise_dense_vs_hisparse": bool(np.array_equal(on_mesh[False][1], on_mesh[True][1])),
        "max_logit_diff_vs_one_device": float(np.abs(on_mesh[False][1] - one[False][1]).max()),
        "swap_stats_equal_one_device": on_mesh[True][2] == one[True][2],
        "misses": int(np.asarray(on_mesh[True][2])[..., 1].sum()),
        "kv_updated_in_place": on_mesh[False][3] and on_mesh[True][3],
        "fp8_vs_auto_max_diff": float(np.abs(one[False][1] - base[False][1]).max()),
      }
    if name == "deepseek_v32":  # the engine end to end on the first mesh
      one = {hs: engine_tokens(model_dir, MeshConfig(), hs) for hs in (False, True)}
      for hs in (False, True):
        out[f"engine {name} {'hisparse' if hs else 'dense'} {','.join(map(str, meshes[0]))}"] = {
          "equal_one_device": engine_tokens(model_dir, MeshConfig(*meshes[0]), hs) == one[hs],
          "equal_one_device_bucketed": engine_tokens(model_dir, MeshConfig(*meshes[0]), hs, False) == one[hs],
        }
      # Dynamic residency on the second mesh (2 DP groups of 2 requests): one device's dense tokens.
      got = engine_tokens(model_dir, MeshConfig(*meshes[1]), True, resident=True)
      out[f"engine {name} resident {','.join(map(str, meshes[1]))}"] = {
        "tokens_equal_dense": [t for t, _, _ in got] == [t for t, _, _ in one[False]],
        "some_swapped": any(m for _, _, m in got),
        "some_resident": any(not h and not m for _, h, m in got),
      }
  out["loading"] = loading_check(model_dir, MeshConfig(*meshes[0]))
  out["moe"] = moe_check()
  # FP8 on two meshes (time): experts and their scales split over dp (all-to-all), and an expert width split
  # over tp with the scales replicated (their block count does not divide).
  out["fp8"] = fp8_check([m for m in meshes if m in ((8, 1, 8), (1, 8, 1))])
  print(json.dumps(out, default=list))


if __name__ == "__main__":
  main([tuple(int(v) for v in m.split(",")) for m in sys.argv[1:]] or [(8, 1, 8), (2, 4, 8), (1, 8, 8), (1, 8, 1)])
