"""Capacity planner: how many concurrent requests a deployment admits, dense vs HiSparse.

    python -m hisparse_jax.plan --model-config CONFIG.json --devices 8 --device-memory 141 \\
        --host-memory 2048 --context 131072 [--hisparse-config JSON] [--dp-size 8 --tp-size 1 --ep-size 8] \\
        [--weight-dtype fp8] [--kv-cache-dtype fp8_e4m3] [--json]

For each mode it prints the weights each device holds, the device KV budget, the KV bytes one request of
``--context`` tokens holds on a device (and in host memory), and the most requests the engine would run at
once. Every number comes from the runtime's own formulas: JAX's share of each device from
``--device-memory`` x the fraction the servers reserve (``engine.args.client_mem_fraction``:
XLA_PYTHON_CLIENT_MEM_FRACTION, 0.95 unless the environment sets it; a device's ``bytes_limit``), parameter shapes from the Flax model built
abstractly (``nnx.eval_shape``; no weights), per-device shares from the sharding rule table
(``hisparse_jax/sharding.py``), the KV budget from ``engine.args.kv_budget``, pool sizes from
``memory.backend.plan`` (the function the backend allocates with), and the host-memory limit from the
start-up check (``MAX_HOST_MEMORY_FRACTION`` of host memory).

Deployment model (DP attention, as SGLang's recommended HiSparse deployment): each of the dp groups serves
its own requests; the devices of a group (its tp ranks) each hold a copy of the group's latent KV (MLA's
latent row is shared by all heads, so tensor parallelism does not split it), and each device's host pool is
its share of host memory (host memory / devices). Requests admitted = dp x the requests one group's
device admits.

Weight bytes: parameters in ``--weight-dtype`` (default: the config's dtype); ``fp8`` counts the matrices an
FP8 block-quantized checkpoint stores in float8_e4m3fn (every Linear kernel and expert matrix except
lm_head and the indexer's weights_proj) at 1 byte plus one float32 scale per 128 x 128 block, the rest in
the config's dtype. The multi-token-prediction layer (``num_nextn_predict_layers``) is not served and not
counted. Activations and XLA's workspace are not modelled: they come out of the (1 - mem fraction) margin.

KV bytes: the latent row and the indexer key as ``--kv-cache-dtype`` stores them (``models/kv_format.py``:
the compute dtype and float32, or DeepSeek-V3.2's FP8 rows of 656 and 132 bytes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import numpy as np

from hisparse_jax.config import ConfigError, HiSparseConfig
from hisparse_jax.engine.args import (
  DEFAULT_MEM_FRACTION,
  KV_CACHE_DTYPE_ALIASES,
  MAX_HOST_MEMORY_FRACTION,
  MAX_RUNNING_REQUESTS,
  StartupError,
  check_context,
  check_page_size,
  client_mem_fraction,
  kv_budget,
)
from hisparse_jax.memory import backend as kvmem
from hisparse_jax.sharding import MeshConfig, MeshError, bytes_per_device
from models.config import DSAConfig
from models.kv_format import KV_CACHE_DTYPES

GIB = 1 << 30
MAX_MEMORY_GIB = 2**30  # an exbibyte: a larger --device-memory / --host-memory is a typo (and overflows int64 bytes)
# SGLang's published HiSparse setting (the defaults of --hisparse-config here).
SGLANG_HISPARSE = {"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}
WEIGHT_DTYPES = ("bfloat16", "float32", "fp8")  # the engine's compute dtypes (engine.args.DTYPES) and fp8
FP8_BLOCK = 128


def is_fp8_matrix(path: str, ndim: int) -> bool:
  """Whether an FP8 block-quantized checkpoint stores this parameter in float8_e4m3fn (models/fp8.py lists
  the tensors that stay unquantized: norms, router, embeddings, lm_head, the indexer's weights_proj)."""
  if path.startswith("lm_head") or "weights_proj" in path:
    return False
  if path.endswith("/kernel") and ndim == 2:
    return True
  return ndim == 3 and path.rsplit("/", 1)[-1] in ("gate_proj", "up_proj", "down_proj")


def weight_itemsize(weight_dtype: str, compute_dtype: str):
  """(path, shape, dtype) -> bytes of one whole parameter stored in weight_dtype (for ``bytes_per_device``)."""
  base = np.dtype(compute_dtype if weight_dtype == "fp8" else weight_dtype).itemsize

  def nbytes(path, shape, dtype):
    if weight_dtype == "fp8" and is_fp8_matrix(path, len(shape)):
      *lead, r, c = shape
      return math.prod(shape) + 4 * math.prod(lead) * math.ceil(r / FP8_BLOCK) * math.ceil(c / FP8_BLOCK)
    if np.dtype(dtype) == np.float32 and weight_dtype != "float32":
      return math.prod(shape) * 4  # parameters the model keeps in float32 (router, weights_proj)
    return math.prod(shape) * base

  return nbytes


def abstract_params(cfg: DSAConfig):
  """The model's parameters as shape/dtype structs (nothing allocated)."""
  from flax import nnx
  from models.deepseek_v32 import DeepseekV32ForCausalLM

  return nnx.state(nnx.eval_shape(lambda: DeepseekV32ForCausalLM(cfg, rngs=nnx.Rngs(0))))


@dataclasses.dataclass(frozen=True)
class ModePlan:
  """One mode's numbers (bytes per device unless named otherwise).

  Attributes:
    mode: "dense" or "hisparse".
    request_device_bytes / request_host_bytes: KV one request of the context holds on a device / in host memory.
    requests_per_group: the most requests one dp group's device admits (0: not even one).
    requests: requests_per_group x dp.
    limited_by: what stops one more request: "device KV budget", "host memory", "hot buffers".
    max_running_requests / host_to_device_ratio: engine settings that admit that many: the engine's
      --max-running-requests, the total it splits over the dp groups (0 where not even one request fits), and
      HiSparse's host_to_device_ratio that sizes the host pool for them.
    host_pool_bytes: the host pool those settings allocate per device (0: dense).
  """

  mode: str
  request_device_bytes: int
  request_host_bytes: int
  requests_per_group: int
  requests: int
  limited_by: str
  max_running_requests: int
  host_to_device_ratio: int | None
  host_pool_bytes: int


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  """The planner's answer. weight_bytes: total; weight_bytes_per_device: the most any device holds."""

  model_type: str
  mesh: MeshConfig
  weight_dtype: str
  kv_cache_dtype: str
  context: int
  weight_bytes: int
  weight_bytes_per_device: int
  device_bytes: int  # JAX's share of a device (its bytes_limit), which the KV budget is taken from
  kv_budget_per_device: int
  host_bytes_per_device: int
  hisparse_staging_bytes: int
  dense: ModePlan
  hisparse: ModePlan

  @property
  def capacity_ratio(self) -> float | None:
    """HiSparse requests / dense requests; None when dense admits none."""
    return self.hisparse.requests / self.dense.requests if self.dense.requests else None

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["mesh"] = dataclasses.asdict(self.mesh)
    d["capacity_ratio"] = self.capacity_ratio
    return d


def _dense_plan(layout, budget, context, page_size, dp) -> ModePlan:
  per_request = kvmem.request_bytes(layout, None, page_size, context)
  pages_needed = -(-context // page_size)
  # max_running_requests only caps pages at R x P; a large value leaves the budget as the limit.
  p = kvmem.plan(
    layout, budget=budget, max_running_requests=1 << 30, max_seq_len=context, page_size=page_size, hisparse=None
  )
  n = p.pools["kv"][1] // pages_needed
  why = "device KV budget" if n < MAX_RUNNING_REQUESTS // dp else f"the engine's cap ({MAX_RUNNING_REQUESTS} lanes)"
  n = min(n, MAX_RUNNING_REQUESTS // dp)  # (more than the engine's --max-running-requests takes: it refuses them)
  return ModePlan("dense", per_request["device"], 0, n, n * dp, why, n * dp, None, 0)


def _hisparse_plan(layout, budget, host_bytes, context, page_size, dp, hs: HiSparseConfig) -> ModePlan:
  """The most requests R for which the engine's ``plan()`` (--max-running-requests R, the host pool sized by
  a host_to_device_ratio large enough for R requests of the context, at least the configured one) gives R hot
  buffers and index pages for R requests of the context, with a host pool within host_bytes."""
  per_request = kvmem.request_bytes(layout, hs, page_size, context)
  pages_needed = -(-context // page_size)
  host_page = page_size * layout.latent_bytes
  ratio = max(hs.host_to_device_ratio, math.ceil(pages_needed * page_size / (hs.device_buffer_size + 1)))
  cfg = dataclasses.replace(hs, host_to_device_ratio=ratio)

  def admitted(R):
    """(requests admitted, what stops more, host pool bytes) with --max-running-requests R."""
    try:
      p = kvmem.plan(
        layout, budget=budget, max_running_requests=R, max_seq_len=context, page_size=page_size, hisparse=cfg
      )
    except kvmem.MemoryConfigError:
      return 0, "device KV budget", 0
    pool = p.pools["host"][1] * host_page
    if pool > host_bytes:
      return 0, "host memory", pool
    limits = {
      "hot buffers": p.request_slots,
      "device KV budget": p.pools["index"][1] // pages_needed,
      "host memory": p.pools["host"][1] // pages_needed,
    }
    why = min(limits, key=limits.get)
    return limits[why], why, pool

  # admitted(R) <= R is the smaller of what grows with R (hot buffers, host pool) and what shrinks (index pages
  # left beside R hot buffers): the best R is where all R requests still fit, or one more. Binary search for it.
  index_bytes = pages_needed * page_size * layout.index_bytes
  hot = layout.hot_buffer_bytes(hs.device_buffer_size, hs.eviction)
  cap = MAX_RUNNING_REQUESTS // dp  # (the engine refuses a larger --max-running-requests)
  lo, hi = 0, min(min(budget // hot, budget // max(index_bytes, 1)) + 1, cap)
  while lo < hi:  # the largest R in [0, hi] with admitted(R) >= R
    mid = (lo + hi + 1) // 2
    if admitted(mid)[0] >= mid:
      lo = mid
    else:
      hi = mid - 1
  candidates = [(admitted(R)[0], R) for R in (lo, lo + 1) if 1 <= R <= cap]
  best_n, best_R = max(candidates, key=lambda c: (c[0], -c[1])) if candidates else (0, 0)
  pool = admitted(best_R)[2] if best_n else 0
  why = (
    f"the engine's cap ({MAX_RUNNING_REQUESTS} lanes)"
    if best_R == cap
    else admitted(best_R + 1)[1]
    if best_n
    else admitted(1)[1]
  )
  return ModePlan(
    "hisparse",
    per_request["device"],
    per_request["host"],
    best_n,
    best_n * dp,
    why,
    best_R * dp if best_n else 0,
    ratio,
    pool,
  )


def capacity(
  model_cfg: DSAConfig,
  mesh: MeshConfig,
  *,
  device_memory: int,
  host_memory: int,
  context: int,
  hisparse: HiSparseConfig,
  weight_dtype: str | None = None,
  kv_cache_dtype: str = "auto",
  page_size: int = 64,
  mem_fraction_static: float | None = None,
  params=None,
) -> CapacityPlan:
  """The capacity of ``mesh`` (dp x tp devices of which JAX has device_memory bytes each, a device's
  ``bytes_limit``; host_memory bytes of host memory for all of them) serving requests of ``context`` tokens (prompt + output), latent rows and indexer keys stored
  as kv_cache_dtype says. See the module docstring.

  Raises:
    MeshError: the mesh does not fit the model (the message names the flag).
    StartupError: the weights leave no device memory for KV, the FP8 cache's indexer cannot run the model, the
      context exceeds the model's max_position_embeddings, or page_size is not a power of two (the engine
      refuses both at start-up).
  """
  mesh.validate(model_cfg)
  check_context(context, model_cfg, "--context")
  check_page_size(page_size)
  if weight_dtype is None and model_cfg.dtype not in WEIGHT_DTYPES:
    raise StartupError(
      f"the config's dtype {model_cfg.dtype} is not a compute dtype (the engine refuses it without "
      "--dtype); pass --weight-dtype bfloat16, float32 or fp8"
    )
  weight_dtype = weight_dtype or model_cfg.dtype
  if weight_dtype not in WEIGHT_DTYPES:
    raise StartupError(f"--weight-dtype {weight_dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
  params = params if params is not None else abstract_params(model_cfg)
  itemsize = weight_itemsize(weight_dtype, model_cfg.dtype)
  total = bytes_per_device(MeshConfig(), params, itemsize)
  per_device = bytes_per_device(mesh, params, itemsize)
  if mem_fraction_static is None:
    # The engine's default budget (DEFAULT_MEM_FRACTION of what the weights leave); an explicit
    # fraction has SGLang's meaning (of the whole device).
    budget = int(DEFAULT_MEM_FRACTION * (device_memory - per_device))
    if budget <= 0:
      hint = "more devices" if weight_dtype == "fp8" else "--weight-dtype fp8 or more devices"
      raise StartupError(
        f"the weights take {per_device / GIB:.3g} GiB per device, more than the "
        f"{device_memory / GIB:.3g} GiB JAX has of each device (try {hint})"
      )
  else:
    budget = kv_budget(device_memory, per_device, mem_fraction_static=mem_fraction_static)
  kv_cfg = model_cfg.replace(kv_cache_dtype=kv_cache_dtype)
  if (fp8_error := kv_cfg.fp8_indexer_error()) is not None:  # the engine refuses it at start-up
    raise StartupError(fp8_error)
  layout = kvmem.KVLayout.of(kv_cfg, model_cfg.dtype if weight_dtype == "fp8" else weight_dtype)
  host_per_device = int(MAX_HOST_MEMORY_FRACTION * host_memory) // mesh.num_devices
  dense = _dense_plan(layout, budget, context, page_size, mesh.dp_size)
  hs = _hisparse_plan(layout, budget, host_per_device, context, page_size, mesh.dp_size, hisparse)
  staging = -(-context // page_size) * page_size * layout.latent_bytes  # plan()'s "staging" pool
  return CapacityPlan(
    model_cfg.model_type,
    mesh,
    weight_dtype,
    kv_cache_dtype,
    context,
    total,
    per_device,
    device_memory,
    budget,
    host_per_device,
    staging,
    dense,
    hs,
  )


def format_plan(p: CapacityPlan) -> str:
  """A human-readable report of a CapacityPlan."""

  def g(b: float) -> str:  # GiB, or MiB / KiB for a small model's sizes (0.00 GiB says nothing)
    unit, scale = next(
      (u, v) for u, v in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)) if b >= v or v == 1
    )
    return f"{b / scale:,.2f} {unit}" if scale > 1 else f"{b:,.0f} B"

  m = p.mesh
  lines = [
    f"model {p.model_type}: {g(p.weight_bytes)} of weights ({p.weight_dtype}; {p.weight_bytes / 1e9:,.1f} GB), "
    f"KV cache {p.kv_cache_dtype}",
    f"mesh dp {m.dp_size} x tp {m.tp_size} = {m.num_devices} devices, experts over ep {m.ep_size}",
    f"JAX's share per device  {g(p.device_bytes)}  (--device-memory x XLA_PYTHON_CLIENT_MEM_FRACTION "
    f"{client_mem_fraction()}, as the servers reserve it)",
    f"weights per device      {g(p.weight_bytes_per_device)}",
    f"KV budget per device    {g(p.kv_budget_per_device)}",
    f"host memory per device  {g(p.host_bytes_per_device)}  ({MAX_HOST_MEMORY_FRACTION:.0%} of host memory / devices)",
    f"HiSparse staging        {g(p.hisparse_staging_bytes)}  (device pages for one prompt of the context while it "
    "prefills, taken from the KV budget first)",
    f"context                 {p.context:,} tokens",
    "",
    f"{'mode':<10}{'KV/request device':>20}{'KV/request host':>18}{'requests/group':>16}{'requests':>12}  limited by",
  ]
  for mp in (p.dense, p.hisparse):  # (a space before each number: a count wider than its column stays apart)
    lines.append(
      f"{mp.mode:<10}{g(mp.request_device_bytes):>20} {g(mp.request_host_bytes):>17}"
      f" {mp.requests_per_group:>15,} {mp.requests:>11,}  {mp.limited_by}"
    )
  hs = p.hisparse
  ratio = "n/a (dense admits none)" if p.capacity_ratio is None else f"{p.capacity_ratio:.2f}x"
  lines += ["", f"HiSparse / dense requests: {ratio}"]
  if hs.requests:
    lines.append(
      f"HiSparse settings: --max-running-requests {hs.max_running_requests} "
      f"({hs.max_running_requests // m.dp_size} per dp group), host_to_device_ratio "
      f"{hs.host_to_device_ratio} (host pool {g(hs.host_pool_bytes)} per device)"
    )
  else:
    lines.append(f"HiSparse settings: none; no HiSparse request of {p.context:,} tokens fits ({hs.limited_by})")
  if hs.limited_by.startswith("host memory"):  # (more devices share the same --host-memory: easy to miss)
    lines.append(
      f"note: --host-memory is the whole deployment's, shared by its {m.num_devices} devices "
      f"({g(p.host_bytes_per_device)} each for host pools); more of it admits more HiSparse requests"
    )
  return "\n".join(lines)


def main(argv) -> None:
  from absl import flags

  del argv
  F = lambda name: flags.FLAGS[name].value  # noqa: E731
  from models.from_torch import MAX_CONFIG_BYTES, read_json

  try:  # (a regular file of bounded size: a FIFO or /dev/zero never ends; ValueError for JSON nested too deeply)
    path = F("model-config")  # (a model directory: its config.json)
    path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    model_cfg = DSAConfig.from_hf_config(read_json(path, MAX_CONFIG_BYTES))
  except (OSError, ValueError, KeyError, TypeError) as e:
    sys.exit(f"error: --model-config: {e}")  # (read_json's messages name the file)
  devices = F("devices")
  if devices < 1:
    sys.exit(f"error: --devices must be >= 1, got {devices}")
  frac = F("mem-fraction-static")
  if frac is not None and not 0 < frac <= 1:
    sys.exit(f"error: --mem-fraction-static must be in (0, 1], got {frac}")
  dp, tp = F("dp-size"), F("tp-size")
  if dp is None and tp is None:
    dp, tp = devices, 1  # DP attention over every device (SGLang's recommended HiSparse deployment)
  elif dp is None or tp is None:
    flag, given = ("--tp-size", tp) if dp is None else ("--dp-size", dp)
    if given < 1:
      sys.exit(f"error: {flag} must be an integer >= 1, got {given}")
    if devices % given:
      sys.exit(f"error: {flag} {given} does not divide --devices {devices}")
    dp, tp = (devices // tp, tp) if dp is None else (dp, devices // dp)
  ep = F("ep-size") if F("ep-size") is not None else devices
  mesh = MeshConfig(dp_size=dp, tp_size=tp, ep_size=ep)
  if F("hisparse-config") is not None and not F("hisparse-config").strip():
    sys.exit("error: --hisparse-config '': empty (leave the flag out for SGLang's sizes)")
  try:
    # Unset: SGLang's sizes for the model's top-k (D = 2 x top_k, ratio 8: at top_k 2048, SGLANG_HISPARSE).
    hs = HiSparseConfig.from_json(F("hisparse-config") or "{}", model_top_k=model_cfg.index_topk)
    hs.check_model(model_cfg)
  except ConfigError as e:
    sys.exit(f"error: --hisparse-config: {e}")
  for flag, v in (("--device-memory", F("device-memory")), ("--host-memory", F("host-memory"))):
    if not 0 < v <= MAX_MEMORY_GIB:  # NaN fails too
      sys.exit(f"error: {flag} must be a number of GiB in (0, {MAX_MEMORY_GIB}], got {v}")
  if not 0 < F("context") < math.inf:
    sys.exit(f"error: --context must be a finite number > 0, got {F('context')}")
  try:
    if mesh.num_devices != devices:
      raise MeshError(f"--dp-size {dp} x --tp-size {tp} must equal --devices {devices}")
    # JAX's share of each device, as the servers take it (client_mem_fraction: a device's bytes_limit)
    plan = capacity(
      model_cfg,
      mesh,
      device_memory=int(F("device-memory") * GIB * client_mem_fraction()),
      host_memory=int(F("host-memory") * GIB),
      context=F("context"),
      hisparse=hs,
      weight_dtype=F("weight-dtype"),
      kv_cache_dtype=KV_CACHE_DTYPE_ALIASES.get(F("kv-cache-dtype"), F("kv-cache-dtype")),
      page_size=F("page-size"),
      mem_fraction_static=F("mem-fraction-static"),
    )
  except (MeshError, StartupError, kvmem.MemoryConfigError) as e:
    if isinstance(e, MeshError) and F("ep-size") is None and "--ep-size" in str(e):
      sys.exit(f"error: {e} (--ep-size defaults to --devices {devices}; pass --ep-size)")
    # (the engine's budget flags; the planner's budget comes from --device-memory / --mem-fraction-static)
    sys.exit(
      f"error: {e}".replace("--max-device-kv-bytes / --mem-fraction-static", "--device-memory / --mem-fraction-static")
    )
  print(json.dumps(plan.to_dict(), indent=1) if F("json") else format_plan(plan))


def define_flags() -> None:
  from absl import flags

  flags.DEFINE_string(
    "model-config",
    None,
    "An HF config.json of a DeepSeek-V3.2 / GLM-5 model (or the model's directory).",
    required=True,
  )
  flags.DEFINE_integer("devices", 8, "Devices in the deployment (dp x tp).")
  flags.DEFINE_float("device-memory", 141.0, "Memory of one device, GiB (default: an H200's 141).")
  flags.DEFINE_float(
    "host-memory",
    2048.0,
    f"Host memory of the whole deployment, GiB (the host pools may use {MAX_HOST_MEMORY_FRACTION:.0%} of it).",
  )
  flags.DEFINE_integer("context", 32768, "Tokens per request (prompt + output).")
  flags.DEFINE_string(
    "hisparse-config",
    None,
    "HiSparse sizes as JSON text (default SGLang's for the model's "
    "top-k: top_k = index_topk, device_buffer_size 2 x top_k, host_to_device_ratio 8; at "
    "DeepSeek-V3.2's top_k 2048: 4096 and 8).",
  )
  flags.DEFINE_integer("dp-size", None, "DP attention groups (default: --devices / --tp-size).")
  flags.DEFINE_integer("tp-size", None, "Tensor-parallel ranks per group (default: 1).")
  flags.DEFINE_integer("ep-size", None, "Devices the routed experts are split over (default: --devices).")
  flags.DEFINE_enum("weight-dtype", None, list(WEIGHT_DTYPES), "Weight storage (default: the config's dtype).")
  flags.DEFINE_enum(
    "kv-cache-dtype",
    "auto",
    [*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES],
    "How the KV cache stores a token: auto "
    "(latent in the compute dtype, keys in float32) or fp8_e4m3 (or fp8: DeepSeek-V3.2's FP8 rows).",
  )
  flags.DEFINE_integer("page-size", 64, "Tokens per KV page (a power of two).")
  flags.DEFINE_float(
    "mem-fraction-static",
    None,
    "Fraction of JAX's share of --device-memory (the servers' "
    "XLA_PYTHON_CLIENT_MEM_FRACTION, printed) for weights + KV cache, as the engine's flag: KV "
    "budget = F x share - weights (SGLang's flag, of JAX's share rather than the whole device; "
    f"unset: the engine's default, {DEFAULT_MEM_FRACTION} x (share - weights), which is not "
    f"F = {DEFAULT_MEM_FRACTION}).",
  )
  flags.DEFINE_boolean("json", False, "Print the plan as JSON.")


if __name__ == "__main__":
  from hisparse_jax import cli

  define_flags()
  cli.run(main)
