"""``EngineArgs``: every engine setting, its command-line flag and its start-up checks, in one place.

The batch script (``python -m hisparse_jax.generate``) and the server (``run_server.py``) both call
``EngineArgs.define_flags()`` and ``EngineArgs.from_flags()``; ``Engine`` runs ``resolve()``. Every
start-up problem raises ``StartupError`` with a message naming the flag or file at fault; the entry
points print it and exit (no traceback).
"""

from __future__ import annotations

import dataclasses
import math
import os

from hisparse_jax.config import ConfigError, HiSparseConfig, check_prefetch_threads_env
from hisparse_jax.default_model import ensure_default_model
from hisparse_jax.sharding import MeshConfig, MeshError
from models.config import DSAConfig
from models.kv_format import KV_CACHE_DTYPES

MODEL_HISPARSE_FILE = "hisparse_config.json"  # per-model default HiSparse sizes (optional)
# Compute dtypes. float16 is not one: HiSparse's bitwise equality with dense KV rests on both programs rounding
# alike, and XLA:CPU's float16 arithmetic does not (measured: at --xla_backend_optimization_level=0 the dense and
# HiSparse logits of the tiny model differ by up to 0.011 from the third decode step on, with no swap-in at all;
# float32 and bfloat16 agree bit for bit).
DTYPES = ("float32", "bfloat16")
WEIGHT_DTYPES = (None, "fp8")
HOST_POOL_KINDS = ("jax", "extension")
HOST_POOL_CHOICES = ("auto", *HOST_POOL_KINDS)
# Why "auto" takes the extension's pool on a GPU (scripts/gpu_check.sh on an H200, jax 0.11.2, 2026-12-04).
GPU_PINNED_HOST_REFUSED = (
  "XLA refuses a pinned_host array as a custom call's operand on GPU (E1200 "
  "CompileTimeHostOffloadOutputLocationMismatch, measured with jax 0.11.2 on an H200)"
)
# Device KV budget when neither --max-device-kv-bytes nor --mem-fraction-static is given: this fraction of
# the device memory left after the weights (SGLang's mem_fraction_static is of the same order), or, on a
# device that reports no limit (CPU), DEFAULT_CPU_KV_BYTES.
DEFAULT_MEM_FRACTION = 0.85
DEFAULT_CPU_KV_BYTES = 1 << 30
# Requests decoded at once, at most: the engine's per-lane arrays (page tables, sampling state, the decode batch)
# are sized by it at start-up (10^8 lanes took 9 GB for one 2-token request); SGLang's largest deployments run
# a few thousand per device.
MAX_RUNNING_REQUESTS = 65536
# JAX's GPU client reserves XLA_PYTHON_CLIENT_MEM_FRACTION of each device when it starts (JAX's own default 0.75:
# a device's ``bytes_limit``, from which the KV budget is taken, would be 106 of an H200's 141 GiB). The server
# and the batch script set this fraction unless the environment does (reserve_device_memory); the rest of the
# device is the CUDA context, cuBLAS workspaces and the collectives' buffers. The planner assumes the same.
CLIENT_MEM_FRACTION = 0.95
# Text prompt bytes allowed per token of context when --max-prompt-bytes is 0 (DeepSeek-V3's tokenizer averages
# ~4 bytes a token on English text; runs of whitespace or symbols go higher).
DEFAULT_PROMPT_BYTES_PER_TOKEN = 8
# Refuse a host pool that cannot fit this machine's memory, before allocating.
MAX_HOST_MEMORY_FRACTION = 0.8


class StartupError(ValueError):
  """A setting that cannot work; the message names the flag or file at fault."""


# --kv-cache-dtype spellings of other runtimes -> ours (the planner takes them too).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


def _flag(default, help_: str):
  """A field of EngineArgs with its flag's help text."""
  return dataclasses.field(default=default, metadata={"help": help_})


@dataclasses.dataclass
class EngineArgs:
  """Engine settings: one field per flag of the batch script and the server ('_' -> '-': ``max_seq_len`` is
  ``--max-seq-len``). Each field's ``metadata["help"]`` is its only description: the flag's ``--help`` text and its
  row in docs/batch-decoding.md's table (``flag_table``; tests/test_docs.py fails when the page and the fields
  disagree). ``validate`` / ``resolve`` raise ``StartupError`` naming the flag."""

  model_path: str | None = _flag(
    None,
    "HF-format model directory (config.json + *.safetensors, single or sharded with "
    "model.safetensors.index.json, optional tokenizer.json) or an orbax directory written by "
    "python -m models.convert. Unset: the embedded default model.",
  )
  dtype: str | None = _flag(
    None,
    "Compute and KV dtype: float32 or bfloat16. Unset (or auto): the checkpoint's own (dtype / torch_dtype "
    "in config.json); a float16 checkpoint needs one of the two (XLA:CPU rounds float16 differently in the "
    "dense and HiSparse programs).",
  )
  enable_hisparse: bool = _flag(
    False,
    "HiSparse: every request's latent KV in a host pool, a hot buffer of slots per request on the device. "
    "Off: all KV on the device (the baseline).",
  )
  hisparse_config: str | None = _flag(
    None,
    "HiSparse sizes and policy as JSON text (not a file name): top_k (the model's index_topk, the default), "
    "device_buffer_size (>= top_k; default 2 x top_k), host_to_device_ratio (>= 1; default 8: the host pool "
    "holds ratio x (D + 1) tokens per request slot), eviction (lru, the default; clock; score; score_ema), "
    "resident_fraction (in [0, 1); default 0: no dynamic residency), prefetch (none, the default, or "
    "next_layer) and prefetch_depth (in [1, top_k]; default top_k). Unset: the model directory's "
    "hisparse_config.json if any; set, that file is not read (keys left out take the defaults above).",
  )
  host_pool: str = _flag(
    "auto",
    "Where HiSparse's host pool lives: jax (a pinned_host JAX array passed to the kernels), extension "
    "(pinned memory owned by the FFI extension: page-aligned on CPU, cudaHostAlloc-mapped on GPU) or "
    "auto (extension on a GPU, jax elsewhere). Both decode identically.",
  )
  max_running_requests: int = _flag(
    64,
    "Requests decoded at once; more wait and join as others finish. HiSparse lowers it to the hot buffers "
    "the KV budget holds (logged).",
  )
  max_seq_len: int | None = _flag(
    None,
    "Longest prompt + output per request, in tokens. Unset: the model's max_position_embeddings. Memory is "
    "paged, so a long limit costs nothing until tokens exist (HiSparse's staging pages excepted: they hold "
    "one prompt of this length).",
  )
  chunked_prefill_size: int = _flag(
    2048,
    "Prompt tokens computed per engine step, padding included (a multiple of --page-size). A step's "
    "prompts are the rows of one [B, C] call (powers of two, C >= 16); a prompt whose row would grow "
    "B x C past this waits for the next step. Longer prompts are prefilled over several steps while the "
    "running requests keep decoding.",
  )
  page_size: int = _flag(64, "Tokens per KV page (a power of two; 64 is FlashMLA's block size).")
  max_device_kv_bytes: int | None = _flag(
    None,
    "Device KV budget in bytes; all KV pools are sized from it. With --mem-fraction-static the smaller "
    "wins. Neither: 0.85 x (the device memory limit - the weights), or 1 GiB on a device that reports no "
    "limit (CPU).",
  )
  mem_fraction_static: float | None = _flag(
    None,
    "SGLang's flag: the fraction F of the device memory limit that weights and KV take together (KV "
    "budget = F x limit - weights). The limit is what JAX holds of the device, 95% of a GPU as both "
    "entry points reserve it. Unset: see --max-device-kv-bytes.",
  )
  max_queued_requests: int | None = _flag(
    None,
    "Waiting requests beyond this (and beyond the free request slots, which take waiting requests at the "
    "next step) fail with RESOURCE_EXHAUSTED. Unset: unbounded (the server's default is 1024).",
  )
  max_admission_skips: int = _flag(
    16,
    "Times a waiting request that does not fit the free memory yet may be passed by later requests that "
    "do; then nothing behind it is admitted until it is (0: strict first come, first served).",
  )
  max_prompt_bytes: int = _flag(
    0,
    "Text prompts longer than this many UTF-8 bytes are refused before tokenizing (0: 8 x --max-seq-len). "
    "At most --max-seq-len x the tokenizer's longest token in bytes (128 for DeepSeek-V3's, x 4 with a "
    "normalizer): no longer text fits the context.",
  )
  deterministic: bool = _flag(
    False,
    "A request's tokens never depend on what else runs: every decode step runs all "
    "--max-running-requests rows (each request in its own slot's row) and prompts are prefilled one per "
    "call in chunks at fixed offsets (XLA's CPU matmuls are not batch-invariant). Costs a full-size step "
    "however few requests run.",
  )
  overlap_schedule: bool = _flag(
    True,
    "Launch each decode step before the previous step's tokens are read, feeding them to it on the "
    "device, so that delivering tokens and scheduling overlap the device's compute (SGLang's overlap "
    "scheduler, vLLM's async scheduling). Each call computes what the plain schedule's would; a request "
    "that ends on a stop token, stop string or error computes one more token, dropped, and the next "
    "token's page is taken a step earlier.",
  )
  fp8_numerics: bool | None = _flag(
    None,
    "DeepSeek-V3.2's FP8 deployment numerics: Hadamard-rotated e4m3 indexer queries and keys, and an e4m3 "
    "latent KV (fake-quantized; models/fp8_numerics.py). Unset: on with --kv-cache-dtype fp8_e4m3 (where "
    "--nofp8-numerics is an error), else off.",
  )
  kv_cache_dtype: str = _flag(
    "auto",
    "How the KV cache stores a token, in every pool, hot buffer and prompt hand-off "
    "(models/kv_format.py): auto (latent rows in the compute dtype, indexer keys in float32) or "
    "fp8_e4m3 (fp8 for short, as in vLLM and SGLang: DeepSeek-V3.2's FP8 KV cache, the latent part in "
    "e4m3 with a power-of-two scale per 128 values and the RoPE part in the compute dtype: 656-byte "
    "latent rows and 132-byte indexer keys against 1,152 and 512 in bfloat16). fp8_e4m3 implies "
    "--fp8-numerics, whose values it stores.",
  )
  dp_size: int = _flag(
    1,
    "Data-parallel attention groups: each runs its share of the requests (it must divide "
    "--max-running-requests) with its KV on its own devices. --dp-size x --tp-size must divide the devices "
    "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N).",
  )
  tp_size: int = _flag(
    1,
    "Tensor-parallel devices: MLA heads, dense MLPs and the vocabulary are split over them (it must divide "
    "the heads, the MLP widths and the vocabulary); the indexer is replicated.",
  )
  ep_size: int = _flag(
    1,
    "Devices the routed experts are split over: 1, --tp-size, --dp-size or --dp-size x --tp-size (it must "
    "divide the routed experts).",
  )
  weight_dtype: str | None = _flag(
    None,
    "fp8: keep an FP8 block-quantized checkpoint's matrices in float8_e4m3fn with their 128 x 128 float32 "
    "scales on the device, dequantized inside the jitted matmuls (about half the weight memory of "
    "bfloat16; bit for bit the weights of dequantizing at load). Unset: dequantize at load.",
  )

  # Other runtimes' spellings, taken as ours: vLLM's and SGLang's --dtype auto (the checkpoint's) and
  # --kv-cache-dtype fp8 (e4m3, the only FP8 format here).
  _ALIASES = {"dtype": {"auto": None}, "kv_cache_dtype": KV_CACHE_DTYPE_ALIASES}

  def __post_init__(self):
    for name, aliases in self._ALIASES.items():
      value = getattr(self, name)
      if isinstance(value, str) and value in aliases:
        setattr(self, name, aliases[value])

  @classmethod
  def flag_table(cls) -> str:
    """The engine flags as a Markdown table (flag, default, meaning): scripts/update_flag_table.py writes it into
    docs/batch-decoding.md."""

    def shown(value):
      return "unset" if value is None else ("on" if value else "off") if isinstance(value, bool) else f"`{value}`"

    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
      rows.append(f"| `--{f.name.replace('_', '-')}` | {shown(f.default)} | {f.metadata['help']} |")
    return "\n".join(rows)

  @classmethod
  def define_flags(cls, flags_module=None, **defaults) -> None:
    """Defines one absl flag per field (``--max-seq-len`` for max_seq_len); defaults override the field's."""
    from absl import flags as absl_flags

    fl = flags_module or absl_flags
    for f in dataclasses.fields(cls):
      name, default, help_ = f.name.replace("_", "-"), defaults.get(f.name, f.default), f.metadata["help"]
      kind = f.type if isinstance(f.type, str) else str(f.type)
      if "bool" in kind:
        fl.DEFINE_boolean(name, default, help_)
      elif "float" in kind:
        fl.DEFINE_float(name, default, help_)
      elif "int" in kind:
        fl.DEFINE_integer(name, default, help_)
      else:
        fl.DEFINE_string(name, default, help_)

  @classmethod
  def from_flags(cls, flag_values=None) -> "EngineArgs":
    from absl import flags as absl_flags

    fv = flag_values or absl_flags.FLAGS
    return cls(**{f.name: fv[f.name.replace("_", "-")].value for f in dataclasses.fields(cls)})

  # -------------------------------------------------------------- checks
  def _check_types(self) -> None:
    """StartupError naming the flag for a value of another type than its field's (from Python: ``page_size=64.0``
    failed later inside a step, ``deterministic="false"`` turned it on). Integers of any kind (numpy's too) pass
    where an int or float is due, never a bool; bools (numpy's too) where a bool is."""
    import numbers

    import numpy as np

    for field in dataclasses.fields(self):
      value, kinds = getattr(self, field.name), field.type.replace(" ", "").split("|")
      is_bool = isinstance(value, (bool, np.bool_))
      ok = (
        (value is None and "None" in kinds)
        or (is_bool and "bool" in kinds)
        or (not is_bool and "int" in kinds and isinstance(value, numbers.Integral))
        or (not is_bool and "float" in kinds and isinstance(value, numbers.Real))
        or ("str" in kinds and isinstance(value, str))
      )
      if not ok:
        want = " or ".join(
          {"int": "an integer", "float": "a number", "bool": "True or False", "str": "a string", "None": "None"}[k]
          for k in kinds
        )
        raise StartupError(f"--{field.name.replace('_', '-')} ({field.name}=) must be {want}, got {value!r}")

  def validate(self) -> None:
    """Checks that need no model (StartupError naming the flag)."""
    self._check_types()
    if self.dtype not in (None, *DTYPES):
      raise StartupError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
    self._check_host_pool_choice()
    if self.host_pool != "auto" and not self.enable_hisparse:
      raise StartupError(
        f"--host-pool {self.host_pool} was given without --enable-hisparse (dense mode has no host pool)"
      )
    if self.hisparse_config is not None and not self.enable_hisparse:
      raise StartupError("--hisparse-config was given without --enable-hisparse")
    try:
      check_prefetch_threads_env()
    except ConfigError as e:
      raise StartupError(str(e)) from None
    if not 1 <= self.max_running_requests <= MAX_RUNNING_REQUESTS:
      raise StartupError(
        f"--max-running-requests must be in [1, {MAX_RUNNING_REQUESTS}], got {self.max_running_requests}"
      )
    check_page_size(self.page_size)
    if self.chunked_prefill_size <= 0:
      raise StartupError(f"--chunked-prefill-size must be > 0, got {self.chunked_prefill_size}")
    if self.chunked_prefill_size % self.page_size:
      raise StartupError(
        f"--page-size {self.page_size} does not divide --chunked-prefill-size {self.chunked_prefill_size}"
      )
    if self.max_device_kv_bytes is not None and self.max_device_kv_bytes <= 0:
      raise StartupError(f"--max-device-kv-bytes must be > 0, got {self.max_device_kv_bytes}")
    if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
      raise StartupError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
    if self.max_queued_requests is not None and self.max_queued_requests < 0:
      raise StartupError("--max-queued-requests must be >= 0")
    if self.max_admission_skips < 0:
      raise StartupError(f"--max-admission-skips must be >= 0, got {self.max_admission_skips}")
    if self.max_prompt_bytes < 0:
      raise StartupError(f"--max-prompt-bytes must be >= 0, got {self.max_prompt_bytes}")
    mesh = self.mesh_config()
    try:
      mesh.validate()
    except MeshError as e:
      raise StartupError(str(e)) from None
    if self.max_running_requests % mesh.dp_size:
      raise StartupError(
        f"--max-running-requests {self.max_running_requests} is not divisible by --dp-size "
        f"{mesh.dp_size} (each DP group runs an equal share; set --max-running-requests to a "
        "multiple of it)"
      )
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise StartupError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if self.fp8_numerics is False and self.kv_cache_dtype != "auto":
      raise StartupError(
        f"--nofp8-numerics contradicts --kv-cache-dtype {self.kv_cache_dtype}: that cache stores "
        "DeepSeek's FP8 values, so it always runs the FP8 numerics; drop --nofp8-numerics, or use "
        "--kv-cache-dtype auto"
      )
    if self.weight_dtype not in WEIGHT_DTYPES:
      raise StartupError(f"--weight-dtype {self.weight_dtype!r}: expected fp8 (or no flag: dequantize at load)")
    if mesh.num_devices > 1 and self.host_pool in HOST_POOL_KINDS[1:]:
      raise StartupError(
        f"--host-pool {self.host_pool} serves one device; on a mesh (--dp-size {mesh.dp_size} x "
        f"--tp-size {mesh.tp_size}) use --host-pool {HOST_POOL_KINDS[0]}"
      )

  def _check_host_pool_choice(self) -> None:
    if self.host_pool not in HOST_POOL_CHOICES:
      raise StartupError(f"--host-pool {self.host_pool!r}: expected one of {', '.join(HOST_POOL_CHOICES)}")

  def resolved_host_pool(self, platform: str) -> str:
    """The host-pool kind HiSparse uses on `platform` (jax.default_backend(): "cpu", "gpu", ...).

    "auto" is "extension" on a single GPU, else "jax". Raises StartupError for a value validate() refuses,
    and where none works on a GPU: HiSparse over several GPUs (GPU_PINNED_HOST_REFUSED, and the extension's
    pool serves one device), or an explicit "jax" on one GPU."""
    self._check_host_pool_choice()
    if platform != "gpu" or not self.enable_hisparse:
      return "jax" if self.host_pool == "auto" else self.host_pool
    if self.mesh_config().num_devices > 1:
      raise StartupError(
        f"HiSparse on a mesh of {self.mesh_config().num_devices} GPUs has no host pool yet: "
        f"{GPU_PINNED_HOST_REFUSED}, and the extension's pool serves one device; run HiSparse "
        "on one GPU, or the mesh without --enable-hisparse"
      )
    if self.host_pool == "jax":
      raise StartupError(
        f"--host-pool jax does not work on a GPU: {GPU_PINNED_HOST_REFUSED}; use --host-pool extension (or auto)"
      )
    return "extension"

  def mesh_config(self) -> MeshConfig:
    return MeshConfig(dp_size=self.dp_size, tp_size=self.tp_size, ep_size=self.ep_size)

  def model_dir(self) -> str:
    """The HF / orbax model directory (the embedded default model when model_path is None)."""
    if self.model_path is None:
      return ensure_default_model()
    if not os.path.isdir(self.model_path):
      raise StartupError(f"--model-path {self.model_path!r}: no such directory")
    if not os.path.exists(os.path.join(self.model_path, "config.json")):
      raise StartupError(f"--model-path {self.model_path!r}: no config.json in that directory")
    return self.model_path

  def model_config(self, model_dir: str) -> DSAConfig:
    try:
      return DSAConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, TypeError, AttributeError, OSError, UnicodeDecodeError) as e:
      raise StartupError(f"--model-path {model_dir!r}: config.json: {e}") from None

  def resolve_max_seq_len(self, model_cfg: DSAConfig) -> int:
    if self.max_seq_len is None:
      return model_cfg.max_position_embeddings
    return check_context(self.max_seq_len, model_cfg, "--max-seq-len")

  def resolve_max_prompt_bytes(self, max_seq_len: int, tokenizer) -> int:
    """The UTF-8 bytes a text prompt may have (checked before it is tokenized): --max-prompt-bytes, or by
    default DEFAULT_PROMPT_BYTES_PER_TOKEN x max_seq_len; never more than max_seq_len x the most bytes one
    token stands for (``detokenizer.max_token_bytes``; 128 for DeepSeek-V3's tokenizer), since a longer text
    cannot fit the context and would only cost its tokenizing (a 200 MB text took 165 s and 15 GB). Without a
    tokenizer, text prompts are refused whatever their size, and the limit stays at its default.

    Raises:
      StartupError: --max-prompt-bytes above that bound (the message gives it).
    """
    default = DEFAULT_PROMPT_BYTES_PER_TOKEN * max_seq_len
    if tokenizer is None:
      bound, why = default, "the model has no tokenizer.json, so text prompts are refused anyway"
    else:
      from hisparse_jax.engine.detokenizer import max_token_bytes

      per_token = max_token_bytes(tokenizer)
      bound = per_token * max_seq_len
      why = (
        f"{max_seq_len} tokens (--max-seq-len) x {per_token} bytes, the most one of this tokenizer's "
        "tokens stands for: a longer text cannot fit the context"
      )
    if self.max_prompt_bytes > bound:
      raise StartupError(f"--max-prompt-bytes {self.max_prompt_bytes}: at most {bound} ({why})")
    return self.max_prompt_bytes or min(default, bound)

  def resolve_hisparse(self, model_dir: str, model_cfg: DSAConfig) -> HiSparseConfig | None:
    """HiSparse sizes from --hisparse-config, else the model dir's hisparse_config.json, else defaults."""
    if not self.enable_hisparse:
      return None
    source, text = "--hisparse-config", self.hisparse_config
    model_file = os.path.join(model_dir, MODEL_HISPARSE_FILE)
    if text is None and os.path.lexists(model_file):
      from models.from_torch import MAX_CONFIG_BYTES, check_regular_file

      source = model_file
      try:
        check_regular_file(model_file, MAX_CONFIG_BYTES)  # not a FIFO (blocks) or a link to /dev/zero (never ends)
        with open(model_file) as f:
          text = f.read()
      except (OSError, UnicodeDecodeError, ValueError) as e:
        raise StartupError(f"{model_file}: {e}") from None
    if text is not None and not text.strip():
      raise StartupError(f"{source}: empty (give a JSON object, e.g. '{{\"device_buffer_size\": 4096}}')")
    try:
      return HiSparseConfig.from_json(text, model_top_k=model_cfg.index_topk)
    except ConfigError as e:  # (a file name given as the JSON gets from_json's hint)
      raise StartupError(f"{source}: {e}") from None

  def device_kv_budget(self, weight_bytes: int = 0) -> int:
    """The device KV budget in bytes of this process's first device (``kv_budget``)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return kv_budget(
      stats.get("bytes_limit"),
      weight_bytes,
      max_device_kv_bytes=self.max_device_kv_bytes,
      mem_fraction_static=self.mem_fraction_static,
    )


def check_page_size(page_size: int) -> None:
  """StartupError unless page_size (tokens per KV page, flag --page-size) is a power of two: the pools' page
  arithmetic uses shifts and masks."""
  if page_size < 1 or page_size & (page_size - 1):
    raise StartupError(f"--page-size must be a power of two, got {page_size}")


def check_context(tokens: int, model_cfg: DSAConfig, flag: str) -> int:
  """tokens (prompt + output per request, named by ``flag``: the engine's --max-seq-len, the planner's
  --context) when 1 <= tokens <= the model's max_position_embeddings (RoPE is defined that far); StartupError
  otherwise."""
  if not 1 <= tokens <= model_cfg.max_position_embeddings:
    raise StartupError(
      f"{flag} {tokens}: must be in [1, {model_cfg.max_position_embeddings}] (the model's max_position_embeddings)"
    )
  return tokens


def client_mem_fraction() -> float:
  """The fraction of each GPU JAX's client takes (a device's ``bytes_limit`` / its memory): the environment's
  XLA_PYTHON_CLIENT_MEM_FRACTION, else CLIENT_MEM_FRACTION, which ``reserve_device_memory`` sets. StartupError
  for an environment value that is not a number in (0, 1]."""
  text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  if text is None:
    return CLIENT_MEM_FRACTION
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value <= 1:  # NaN fails too
    raise StartupError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r}: expected a number in (0, 1]")
  return value


def reserve_device_memory() -> float:
  """Sets XLA_PYTHON_CLIENT_MEM_FRACTION to CLIENT_MEM_FRACTION unless the environment sets it (call before JAX
  starts its GPU client; no effect on CPU): the server and the batch script take most of each GPU, as SGLang
  does, not JAX's default 75%. Returns ``client_mem_fraction()`` (StartupError for a bad environment value)."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(CLIENT_MEM_FRACTION))
  return client_mem_fraction()


def kv_budget(
  limit: int | None,
  weight_bytes: int,
  *,
  max_device_kv_bytes: int | None = None,
  mem_fraction_static: float | None = None,
) -> int:
  """Device KV budget in bytes (see ``EngineArgs``): the smaller of max_device_kv_bytes and
  mem_fraction_static x limit - weight_bytes (the fraction applies to the device's memory limit, as SGLang's
  flag does); neither given: DEFAULT_MEM_FRACTION x (limit - weight_bytes), or DEFAULT_CPU_KV_BYTES when the
  device reports no limit (limit None: CPU).

  Raises:
    StartupError: --mem-fraction-static on a device without a limit, or a budget <= 0.
  """
  budgets = []
  if max_device_kv_bytes is not None:
    budgets.append(max_device_kv_bytes)
  if mem_fraction_static is not None:
    if limit is None:
      raise StartupError("--mem-fraction-static: this device reports no memory limit (CPU); use --max-device-kv-bytes")
    budgets.append(int(mem_fraction_static * limit) - weight_bytes)
  if not budgets:
    budgets.append(DEFAULT_CPU_KV_BYTES if limit is None else int(DEFAULT_MEM_FRACTION * (limit - weight_bytes)))
  budget = min(budgets)
  if budget <= 0:  # (max_device_kv_bytes > 0 is checked with the flags: the device memory is what lacks)
    weights, memory = f"{weight_bytes / 2**30:.4g} GiB", f"{limit / 2**30:.4g} GiB"
    if mem_fraction_static is not None:
      raise StartupError(
        f"--mem-fraction-static {mem_fraction_static}: that fraction of the device memory ({memory}) "
        f"leaves nothing for the KV cache beside {weights} of weights per device (it is the fraction "
        "for weights and KV cache together)"
      )
    raise StartupError(f"the weights take {weights} per device, as much as the device memory ({memory}) or more")
  return budget


def check_host_memory(
  host_bytes: int,
  what: str = "--hisparse-config: the host pool",
  remedy: str = "lower device_buffer_size, host_to_device_ratio or --max-running-requests",
) -> None:
  """StartupError if host_bytes (``what`` needs them) would not fit in MAX_HOST_MEMORY_FRACTION of physical
  memory; the message ends with ``remedy``."""
  have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  if host_bytes > MAX_HOST_MEMORY_FRACTION * have:
    raise StartupError(
      f"{what} needs {host_bytes / 2**30:.1f} GiB, more than {MAX_HOST_MEMORY_FRACTION:.0%} of this machine's "
      f"{have / 2**30:.1f} GiB; {remedy}"
    )


def load_tokenizer_or_fail(model_dir: str):
  """The model's tokenizer (None if it has none), or StartupError if tokenizer.json is unreadable."""
  from hisparse_jax.engine.detokenizer import load_tokenizer

  try:
    return load_tokenizer(model_dir)
  except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
    raise StartupError(f"--model-path {model_dir!r}: tokenizer.json: {e}") from None
