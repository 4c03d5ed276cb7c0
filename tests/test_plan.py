"""Capacity planner (hisparse_jax/plan.py) and the sharding rule table it counts with, checked against
numbers derived by hand from the public DeepSeek-V3.2 and GLM-5 config.json values (tests/data)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from hisparse_jax import plan as P
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.memory import backend as kvmem
from hisparse_jax.sharding import MeshConfig, MeshError, bytes_per_device, logical_axes
from models.config import DSAConfig

DATA = pathlib.Path(__file__).parent / "data"
ROOT = pathlib.Path(__file__).parent.parent
GIB = 1 << 30


def _cfg(name):
  return DSAConfig.from_hf_config(json.loads((DATA / name).read_text()))


@pytest.fixture(scope="module")
def dsv32():
  c = _cfg("deepseek_v32_config.json")
  return c, P.abstract_params(c)


def _hand_counts(c):
  """Parameter counts by hand from the config (see DSAConfig's docstring for the shapes):
  {kind: (elements, float32?)}; kinds split by how the rule table shards them."""
  H, nH, L = c.hidden_size, c.num_attention_heads, c.num_hidden_layers
  dn, dr, dv, ql, kl = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
  dense_layers = c.first_k_dense_replace
  moe_layers = L - dense_layers
  E, Im = c.n_routed_experts, c.moe_intermediate_size
  return {
    "vocab": 2 * c.vocab_size * H,  # embed_tokens + lm_head
    "heads": L * (ql * nH * (dn + dr) + kl * nH * (dn + dv) + nH * dv * H),  # q_b, kv_b, o_proj
    "replicated": L
    * (
      H * ql
      + ql
      + H * (kl + dr)
      + kl
      + 2 * H  # q_a (+norm), kv_a (+norm), layer norms
      + ql * c.index_n_heads * c.index_head_dim
      + H * c.index_head_dim
      + 2 * c.index_head_dim
    )
    + H,  # final norm
    "f32": L * H * c.index_n_heads + moe_layers * (H * E + E),  # weights_proj, router, its bias
    "mlp": dense_layers * 3 * H * c.intermediate_size + moe_layers * 3 * H * Im * c.n_shared_experts,
    "experts": moe_layers * 3 * E * H * Im,
  }


def test_parameter_count_matches_the_config(dsv32):
  c, params = dsv32
  counts = _hand_counts(c)
  total = sum(counts.values())
  assert total == sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  assert 671e9 < total < 672e9  # DeepSeek-V3.2: 671 B without the MTP layer
  glm = _cfg("glm5_config.json")
  glm_total = sum(_hand_counts(glm).values())
  assert 743e9 < glm_total < 745e9  # GLM-5: 744 B
  assert glm_total == sum(math.prod(x.shape) for x in jax.tree.leaves(P.abstract_params(glm)))


@pytest.mark.parametrize("dp,tp,ep", [(1, 1, 1), (8, 1, 8), (2, 4, 8), (1, 8, 8), (1, 8, 1)])
def test_weights_per_device_bf16(dsv32, dp, tp, ep):
  c, params = dsv32
  k = _hand_counts(c)
  mesh = MeshConfig(dp, tp, ep)
  mesh.validate(c, num_devices=8)
  experts = k["experts"] // ep if ep > 1 else k["experts"] // tp  # ep = 1: each expert's width over tp
  want = 2 * (k["vocab"] // tp + k["heads"] // tp + k["replicated"] + k["mlp"] // tp + experts) + 4 * k["f32"]
  got = bytes_per_device(mesh, params, P.weight_itemsize("bfloat16", c.dtype))
  assert got == want


def test_fp8_weights_count_one_byte_plus_block_scales(dsv32):
  c, params = dsv32
  itemsize = P.weight_itemsize("fp8", c.dtype)
  H, Im = c.hidden_size, c.moe_intermediate_size
  # One expert stack [E, H, I]: E x H x I bytes + E x ceil(H/128) x ceil(I/128) float32 scales.
  assert itemsize("layers/3/mlp/gate_proj", (256, H, Im), "bfloat16") == 256 * H * Im + 4 * 256 * 56 * 16
  assert itemsize("lm_head/weight", (c.vocab_size, H), "bfloat16") == 2 * H * c.vocab_size
  assert itemsize("layers/0/self_attn/indexer/weights_proj/kernel", (H, 64), "float32") == 4 * H * 64
  total_fp8 = bytes_per_device(MeshConfig(), params, itemsize)
  total_bf16 = bytes_per_device(MeshConfig(), params, P.weight_itemsize("bfloat16", c.dtype))
  assert 0.5 < total_fp8 / total_bf16 < 0.51  # ~half: the matrices dominate


@pytest.mark.parametrize(
  "kv_cache_dtype,row_bytes,key_bytes", [("auto", 576 * 2, 128 * 4), ("fp8_e4m3", 512 + 4 * 4 + 64 * 2, 128 + 4)]
)
def test_dense_and_hisparse_capacity_by_hand(dsv32, kv_cache_dtype, row_bytes, key_bytes):
  c, params = dsv32
  mesh = MeshConfig(8, 1, 8)
  hs = HiSparseConfig(**P.SGLANG_HISPARSE)
  ctx, page = 32768, 64
  p = P.capacity(
    c,
    mesh,
    device_memory=141 * GIB,
    host_memory=2048 * GIB,
    context=ctx,
    hisparse=hs,
    weight_dtype="fp8",
    kv_cache_dtype=kv_cache_dtype,
    params=params,
  )
  assert c.latent_dim == 576 and p.kv_cache_dtype == kv_cache_dtype
  L = c.num_hidden_layers
  # bf16 latent row and float32 indexer key, or DeepSeek-V3.2's FP8 rows: 656 and 132 bytes
  latent_tok, index_tok = L * row_bytes, L * key_bytes
  budget = int(0.85 * (141 * GIB - p.weight_bytes_per_device))
  assert p.kv_budget_per_device == budget
  # Dense: pages of 64 tokens holding latent + indexer key; a request of 32k tokens = 512 pages.
  assert p.dense.request_device_bytes == ctx * (latent_tok + index_tok)
  assert p.dense.requests_per_group == budget // (page * (latent_tok + index_tok)) // (ctx // page)
  assert p.dense.requests == 8 * p.dense.requests_per_group
  # HiSparse: staging for one 32k prompt, then per request a hot buffer of D + 1 rows (+ slot table, LRU, stats,
  # prefetch count) and the indexer keys of its 32k tokens; hot buffers may take at most half of what staging
  # leaves.
  staging = ctx * latent_tok
  hot = (4096 + 1) * latent_tok + L * (8 * 4096 + 12)
  per_req = hot + ctx * index_tok
  n = (budget - staging) // per_req
  assert n * hot <= (budget - staging) // 2
  assert p.hisparse.request_device_bytes == per_req
  assert p.hisparse.request_host_bytes == ctx * latent_tok
  assert p.hisparse.requests_per_group == n
  assert p.hisparse.limited_by == "device KV budget"
  # The host pool the settings allocate holds every admitted request's latent rows within host memory.
  assert n * ctx * latent_tok <= p.hisparse.host_pool_bytes <= 0.8 * 2048 * GIB / 8
  assert p.capacity_ratio == pytest.approx(n / p.dense.requests_per_group)
  assert p.capacity_ratio >= 2


def test_fp8_kv_cache_needs_a_power_of_two_key_width(dsv32):
  """The planner refuses what the engine refuses at start-up: the FP8 indexer's Hadamard rotation of a key
  width that is not a power of two (the auto cache plans it)."""
  c, params = dsv32
  odd = c.replace(index_head_dim=96)
  kw = dict(
    device_memory=141 * GIB,
    host_memory=2048 * GIB,
    context=8192,
    hisparse=HiSparseConfig(**P.SGLANG_HISPARSE),
    weight_dtype="fp8",
    params=params,
  )
  with pytest.raises(P.StartupError, match="needs a power-of-two index_head_dim; this model has 96"):
    P.capacity(odd, MeshConfig(8, 1, 8), kv_cache_dtype="fp8_e4m3", **kw)
  assert P.capacity(odd, MeshConfig(8, 1, 8), **kw).hisparse.requests > 0
  with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3; got 'fp8'"):
    c.replace(kv_cache_dtype="fp8")


def test_host_memory_limits_hisparse(dsv32):
  c, params = dsv32
  hs = HiSparseConfig(**P.SGLANG_HISPARSE)
  ctx = 131072
  p = P.capacity(
    c,
    MeshConfig(8, 1, 8),
    device_memory=141 * GIB,
    host_memory=64 * GIB,
    context=ctx,
    hisparse=hs,
    weight_dtype="fp8",
    params=params,
  )
  host_per_device = int(0.8 * 64 * GIB) // 8
  latent_req = ctx * c.num_hidden_layers * c.latent_dim * 2
  assert p.host_bytes_per_device == host_per_device
  assert p.hisparse.requests_per_group == host_per_device // latent_req
  assert p.hisparse.limited_by == "host memory"


def test_nothing_fits_recommends_no_settings(dsv32):
  """Host memory for no HiSparse request: the plan admits none and recommends no --max-running-requests (a
  setting that admits nobody is no recommendation)."""
  c, params = dsv32
  p = P.capacity(
    c,
    MeshConfig(8, 1, 8),
    device_memory=141 * GIB,
    host_memory=GIB // 1000,
    context=32768,
    hisparse=HiSparseConfig(**P.SGLANG_HISPARSE),
    weight_dtype="fp8",
    params=params,
  )
  assert (p.hisparse.requests, p.hisparse.max_running_requests, p.hisparse.limited_by) == (0, 0, "host memory")
  assert p.dense.requests > 0
  assert "HiSparse settings: none; no HiSparse request of 32,768 tokens fits (host memory)" in P.format_plan(p)
  assert "note: --host-memory is the whole deployment's, shared by its 8 devices (104.86 KiB each" in P.format_plan(p)


def test_a_float16_config_needs_a_weight_dtype(dsv32):
  """The engine refuses a float16 checkpoint without --dtype; the planner refuses to size it without --weight-dtype."""
  c, params = dsv32
  kw = dict(
    device_memory=141 * GIB,
    host_memory=2048 * GIB,
    context=8192,
    hisparse=HiSparseConfig(**P.SGLANG_HISPARSE),
    params=params,
  )
  with pytest.raises(P.StartupError, match="the config's dtype float16 is not a compute dtype"):
    P.capacity(c.replace(dtype="float16"), MeshConfig(8, 1, 8), **kw)
  assert P.capacity(c.replace(dtype="float16"), MeshConfig(8, 1, 8), weight_dtype="fp8", **kw).hisparse.requests > 0


def test_rule_table_replicates_the_indexer_and_latent_projections():
  for path in (
    "layers/0/self_attn/indexer/wq_b/kernel",
    "layers/0/self_attn/indexer/wk/kernel",
    "layers/0/self_attn/kv_a_proj_with_mqa/kernel",
    "layers/0/self_attn/q_a_proj/kernel",
    "layers/5/mlp/gate_kernel",
  ):
    assert MeshConfig(1, 8, 8).spec(path, 2) == jax.sharding.PartitionSpec(None, None)
  assert logical_axes("layers/4/mlp/gate_proj", 3) == ("expert", "embed", "moe_mlp")
  assert tuple(MeshConfig(2, 4, 8).spec("layers/4/mlp/down_proj", 3)) == (("dp", "tp"), None, None)
  assert tuple(MeshConfig(1, 8, 1).spec("layers/4/mlp/down_proj", 3)) == (None, "tp", None)
  assert tuple(MeshConfig(2, 4, 4).spec("layers/0/self_attn/o_proj/kernel", 2)) == ("tp", None)


@pytest.mark.parametrize(
  "mesh,flag",
  [
    (MeshConfig(3, 1, 1), "--dp-size 3 x --tp-size 1"),
    (MeshConfig(1, 8, 3), "--ep-size 3"),
    (MeshConfig(2, 2, 8), "--ep-size 8"),
    (MeshConfig(0, 1, 1), "--dp-size"),
  ],
)
def test_bad_mesh_names_the_flag(mesh, flag):
  with pytest.raises(MeshError, match=flag):
    mesh.validate(_cfg("deepseek_v32_config.json"), num_devices=8)


def test_tp_must_divide_heads():
  c = _cfg("glm5_config.json")  # 64 heads
  with pytest.raises(MeshError, match="--tp-size 128 does not divide the model's 64 attention heads"):
    MeshConfig(1, 128, 1).validate(c, num_devices=128)


def _cli(*args, env=None):
  return subprocess.run(
    [sys.executable, "-m", "hisparse_jax.plan", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, **(env or {})},
  )


def test_cli_plans_with_the_device_share_the_servers_reserve():
  """JAX's GPU client takes XLA_PYTHON_CLIENT_MEM_FRACTION of each device (its default 0.75: 106 of an H200's
  141 GiB, where the planner assumed all 141); the servers reserve 0.95 unless the environment says otherwise,
  and the planner takes the same share: KV budget = 0.85 x (141 x fraction - weights)."""
  base = [f"--model-config={DATA / 'deepseek_v32_config.json'}", "--weight-dtype=fp8", "--json"]
  plain = os.environ.copy()
  plain.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  for fraction, env in ((0.95, {}), (0.75, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"})):
    r = subprocess.run(
      [sys.executable, "-m", "hisparse_jax.plan", *base],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      env={**plain, **env},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["device_bytes"] == int(141 * GIB * fraction)
    assert out["kv_budget_per_device"] == int(
      P.DEFAULT_MEM_FRACTION * (out["device_bytes"] - out["weight_bytes_per_device"])
    )
  r = _cli(*base, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"})
  assert r.returncode == 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION='lots': expected a number in (0, 1]" in r.stderr


def test_cli_json_and_text():
  r = _cli(f"--model-config={DATA / 'glm5_config.json'}", "--weight-dtype=fp8", "--context=32768", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert out["mesh"] == {"dp_size": 8, "tp_size": 1, "ep_size": 8}
  assert out["hisparse"]["requests"] > out["dense"]["requests"] > 0
  # The JSON and the text name the engine's --max-running-requests: the total over the 8 dp groups (the engine
  # splits it), a multiple of 8 that admits every request the plan counts.
  total = out["hisparse"]["max_running_requests"]
  assert total % 8 == 0 and total >= out["hisparse"]["requests"]
  assert out["dense"]["max_running_requests"] == out["dense"]["requests"]
  r = _cli(f"--model-config={DATA / 'glm5_config.json'}", "--weight-dtype=fp8", "--context=32768")
  assert f"--max-running-requests {total} ({total // 8} per dp group)" in r.stdout, r.stdout
  r = _cli(f"--model-config={DATA / 'deepseek_v32_config.json'}", "--weight-dtype=fp8", "--tp-size=8", "--dp-size=1")
  assert r.returncode == 0, r.stderr
  assert "HiSparse / dense requests" in r.stdout and "mesh dp 1 x tp 8" in r.stdout


@pytest.mark.parametrize(
  "args,message",
  [
    (["--tp-size=3"], "--tp-size 3 does not divide --devices 8"),
    (["--ep-size=5"], "--ep-size 5"),
    (["--devices=3"], "(--ep-size defaults to --devices 3; pass --ep-size)"),
    (["--weight-dtype=bfloat16"], "more than the 134 GiB JAX has of each device"),
    (["--weight-dtype=float16"], "--weight-dtype=float16: value should be one of <bfloat16|float32|fp8>"),
    (["--context=0"], "--context must be a finite number > 0"),
    (["--device-memory=inf"], "--device-memory must be a number of GiB in (0, 1073741824], got inf"),
    (["--host-memory=1e300"], "--host-memory must be a number of GiB in (0, 1073741824], got 1e+300"),
    (["--hisparse-config="], "--hisparse-config '': empty"),
    (["--page-size=0"], "--page-size must be a power of two, got 0"),
    (["--page-size=3"], "--page-size must be a power of two, got 3"),
    (["--context=163841"], "--context 163841: must be in [1, 163840] (the model's max_position_embeddings)"),
    (["--mem-fraction-static=1.5"], "--mem-fraction-static must be in (0, 1]"),
    (
      ["--weight-dtype=fp8", "--mem-fraction-static=0.5"],
      "--mem-fraction-static 0.5: that fraction of the device memory (133.9 GiB) leaves nothing for the KV cache "
      "beside 94.98 GiB of weights per device",
    ),
    (["--devices=0"], "--devices must be >= 1"),
    (['--hisparse-config={"top_k": 7}'], "--hisparse-config"),
  ],
)
def test_cli_errors_exit_1_without_traceback(args, message):
  r = _cli(f"--model-config={DATA / 'deepseek_v32_config.json'}", *args)
  assert r.returncode == 1
  assert message in r.stderr and "Traceback" not in r.stderr


def test_cli_plans_a_small_model_with_its_own_top_k():
  """Without --hisparse-config the planner takes SGLang's sizes for the model's top-k (it refused any model
  whose index_topk is not 2048), and a small model's sizes print in MiB / KiB, not as 0.00 GiB."""
  from models.random_checkpoint import default_model_config
  import tempfile

  with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
    json.dump(default_model_config(), f)
    f.flush()
    r = _cli(
      f"--model-config={f.name}",
      "--devices=1",
      "--device-memory=1",
      "--host-memory=8",
      "--context=4096",
      "--kv-cache-dtype=fp8",
      "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kv_cache_dtype"] == "fp8_e4m3" and out["hisparse"]["requests"] > out["dense"]["requests"] > 0
    r = _cli(f"--model-config={f.name}", "--devices=1", "--device-memory=1", "--host-memory=8", "--context=4096")
  assert r.returncode == 0 and " MiB" in r.stdout and "0.00 GiB" not in r.stdout, r.stdout
  # A model directory is taken for its config.json.
  from tests.tiny_model import tiny_model_dir

  r = _cli(
    f"--model-config={tiny_model_dir()}",
    "--devices=1",
    "--device-memory=1",
    "--host-memory=8",
    "--context=256",
    "--json",
  )
  assert r.returncode == 0 and json.loads(r.stdout)["context"] == 256, r.stderr


def test_cli_reads_its_model_config_as_the_loader_does(tmp_path):
  """--model-config is a regular file of at most MAX_CONFIG_BYTES (a FIFO hung the planner, /dev/zero filled
  memory) and JSON nested too deeply is a one-line error (it was a RecursionError traceback)."""
  fifo, deep = tmp_path / "fifo.json", tmp_path / "deep.json"
  os.mkfifo(fifo)
  deep.write_text("[" * 200_000 + "]" * 200_000)
  for path, message in (
    ("/dev/zero", " is not a regular file"),
    (fifo, " is not a regular file"),
    (deep, ": JSON nested too deeply"),
    (tmp_path / "none.json", " does not exist"),
  ):
    r = _cli(f"--model-config={path}")
    assert r.returncode == 1 and r.stderr.strip() == f"error: --model-config: {path}{message}", r.stderr[-2000:]


def test_cli_refuses_score_eviction_without_an_indexer_on_every_layer(tmp_path):
  """The planner applies the engine's start-up rule: "score" / "score_ema" need every layer's indexer scores,
  so a GLM-5 config whose layers share the top-k in pairs is refused (exit 1, the layers named); DeepSeek-V3.2
  (an indexer on every layer) plans with "score_ema"."""
  glm = json.loads((DATA / "glm5_config.json").read_text())
  glm["index_topk_freq"] = 2
  shared = tmp_path / "glm_shared.json"
  shared.write_text(json.dumps(glm))
  for eviction in ("score", "score_ema"):
    r = _cli(f"--model-config={shared}", "--weight-dtype=fp8", f'--hisparse-config={{"eviction": "{eviction}"}}')
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f'eviction "{eviction}" needs every layer' in r.stderr and "layers [2, 4, 6" in r.stderr, r.stderr
  assert _cli(f"--model-config={shared}", "--weight-dtype=fp8").returncode == 0  # lru: plans
  r = _cli(
    f"--model-config={DATA / 'deepseek_v32_config.json'}",
    "--weight-dtype=fp8",
    '--hisparse-config={"eviction": "score_ema"}',
    "--json",
  )
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout)["hisparse"]["requests"] > 0


def test_planner_answers_huge_memories_quickly(dsv32):
  """The HiSparse search is a binary search (a linear one never finished at a petabyte): it answers for a
  petabyte-scale device, and on a real budget its answer is the best a linear scan finds."""
  c, params = dsv32
  hs = HiSparseConfig(**P.SGLANG_HISPARSE)
  p = P.capacity(
    c,
    MeshConfig(8, 1, 8),
    device_memory=10**15,
    host_memory=10**15,
    context=32768,
    hisparse=hs,
    weight_dtype="fp8",
    params=params,
  )
  assert p.hisparse.requests_per_group > 1000
  # An exabyte-scale device: both modes stop at the engine's --max-running-requests cap (the planner advised
  # 80 million lanes, which the engine refuses).
  huge = P.capacity(
    c,
    MeshConfig(8, 1, 8),
    device_memory=2**60,
    host_memory=2**60,
    context=32768,
    hisparse=hs,
    weight_dtype="fp8",
    params=params,
  )
  for mode in (huge.dense, huge.hisparse):
    assert mode.requests == P.MAX_RUNNING_REQUESTS and mode.limited_by == "the engine's cap (65536 lanes)", mode
  small = P.capacity(
    c,
    MeshConfig(8, 1, 8),
    device_memory=141 * GIB,
    host_memory=2048 * GIB,
    context=8192,
    hisparse=hs,
    weight_dtype="fp8",
    params=params,
  )
  layout = kvmem.KVLayout.of(c, "bfloat16")
  best = 0
  for R in range(1, 200):
    pl = kvmem.plan(
      layout,
      budget=small.kv_budget_per_device,
      max_running_requests=R,
      max_seq_len=8192,
      page_size=64,
      hisparse=HiSparseConfig(2048, 4096, small.hisparse.host_to_device_ratio),
    )
    best = max(best, min(pl.request_slots, pl.pools["index"][1] // 128, pl.pools["host"][1] // 128))
  assert small.hisparse.requests_per_group == best


def test_kv_budget_takes_mem_fraction_static_as_sglang_does_and_its_default_of_what_the_weights_leave():
  """An explicit --mem-fraction-static F is SGLang's: the fraction of the device memory for weights + KV, so the
  budget is F x limit - weights; unset, it is 0.85 x (limit - weights), which is not F = 0.85; the smaller of
  that and --max-device-kv-bytes wins; a budget <= 0 is a StartupError naming what lacks."""
  from hisparse_jax.engine.args import DEFAULT_CPU_KV_BYTES, StartupError, kv_budget

  limit, weights = 141 * GIB, 95 * GIB
  assert kv_budget(limit, weights) == int(0.85 * 46 * GIB)
  assert kv_budget(limit, weights, mem_fraction_static=0.85) == int(0.85 * limit) - weights
  assert kv_budget(limit, weights, mem_fraction_static=0.85, max_device_kv_bytes=GIB) == GIB
  assert kv_budget(None, weights) == DEFAULT_CPU_KV_BYTES
  with pytest.raises(StartupError, match=r"--mem-fraction-static 0.6: .* \(141 GiB\) .* 95 GiB of weights"):
    kv_budget(limit, weights, mem_fraction_static=0.6)
  with pytest.raises(StartupError, match=r"the weights take 150 GiB per device, as much as the device memory"):
    kv_budget(limit, 150 * GIB)
  with pytest.raises(StartupError, match="reports no memory limit"):
    kv_budget(None, weights, mem_fraction_static=0.9)
