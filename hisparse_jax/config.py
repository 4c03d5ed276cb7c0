"""HiSparse configuration: the ``--hisparse-config`` JSON, parsed and validated.

The keys follow SGLang's HiSparse flag (``--hisparse-config '{"top_k": 2048,
"device_buffer_size": 4096, "host_to_device_ratio": 8}'``).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
from typing import Any

# SGLang's HiSparse default: hot buffer = 2 x top_k, host pool = 8 x device.
DEFAULT_BUFFER_PER_TOP_K = 2
DEFAULT_HOST_TO_DEVICE_RATIO = 8
# Eviction policies of the swap-in kernel (xla_ffi/swap_in_core.h; hisparse_jax/kernels/reference.py); the
# position in this tuple is the kernel's ``eviction`` attribute.
KERNEL_EVICTIONS = ("lru", "clock", "score")
# The config's policies: the kernel's, and "score_ema" (the kernel's "score" fed each hot-buffer slot's moving
# average of its token's indexer scores, kept by the decode view: memory/views.py ``slot_score_ema``).
EVICTIONS = KERNEL_EVICTIONS + ("score_ema",)
SCORED_EVICTIONS = ("score", "score_ema")  # the policies that read the layer's own indexer scores
DEFAULT_EVICTION = "lru"
# score_ema's weight on the past: ema <- w * ema + (1 - w) * score each decode step. Measured on the calibrated
# DeepSeek-V3.2 trace (benchmarks/miss_rate.py, 64k context, D 4096): 0.6 and 0.8 give the same misses, 0.9 1.3%
# more (BENCHMARKS.md).
SCORE_EMA_WEIGHT = 0.8
# Cross-layer prefetch: "none", or "next_layer" (layer l's top-k starts layer l+1's swap-in while layer l
# computes; ops.prefetch_start / prefetch_wait).
PREFETCHES = ("none", "next_layer")
DEFAULT_PREFETCH = "none"


class ConfigError(ValueError):
  """An invalid configuration; the message names the offending key."""


PREFETCH_THREADS_ENV = "HISPARSE_PREFETCH_THREADS"
MAX_PREFETCH_THREADS = 64


def check_prefetch_threads_env() -> None:
  """ConfigError unless ``HISPARSE_PREFETCH_THREADS`` (the CPU extension's prefetch copy threads, read there
  with ``atoi`` and clamped) is unset or an integer in [0, 64] written in ASCII digits (``str.isdigit``
  would also take "²" or "٣", which ``atoi`` reads differently)."""
  value = os.environ.get(PREFETCH_THREADS_ENV)
  if value is not None and not (re.fullmatch(r"[ \t]*[0-9]{1,3}[ \t]*", value) and int(value) <= MAX_PREFETCH_THREADS):
    raise ConfigError(f"{PREFETCH_THREADS_ENV} must be an integer in [0, {MAX_PREFETCH_THREADS}], got {value!r}")


class RepeatedKey(ValueError):
  """A JSON object names one key twice (``args[0]``: the key)."""


def unique_keys(pairs) -> dict:
  """json ``object_pairs_hook``: RepeatedKey for a key given twice (json.loads keeps the last silently); the
  hisparse config and the batch script's prompt lines use it."""
  out = {}
  for key, value in pairs:
    if key in out:
      raise RepeatedKey(key)
    out[key] = value
  return out


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
  """Sizes of the hierarchical KV cache.

  Attributes:
    top_k: tokens attended per decode step and layer (the indexer's
      ``index_topk``); must equal the model's value.
    device_buffer_size: D, hot-buffer slots per request and layer on device
      (one more reserved slot holds the newest token). D >= top_k; None (the default): 2 x top_k.
    host_to_device_ratio: host-pool rows per hot-buffer row (>= 1). The host
      pool holds ratio x (requests x (D + 1)) latent rows per layer.
    eviction: which resident token a miss replaces: "lru" (HiSparse's least recently used, the default),
      "clock" (second-chance CLOCK), "score" (the resident token the indexer ranks lowest this step) or
      "score_ema" (the resident token with the lowest moving average of its scores since it entered the hot
      buffer, weight SCORE_EMA_WEIGHT on the past; one float32 per slot more). The score policies need an
      indexer on every layer. Losslessness holds for each: only which rows are copied changes.
    resident_fraction: dynamic residency (SGLang's "dynamic HiSparse"): the fraction, in [0, 1), of the device
      KV budget left after the prefill staging pages and the hot buffers that holds the latent rows of
      *resident* requests. A request stays resident after its prefill (its whole latent KV on device,
      attended with no swap-in at all) while these pages last, and is offloaded to its hot buffer (its host
      rows are already written: one device copy of D + 1 rows per layer) when a prompt needs its pages (the
      most recently admitted resident of the prompt's DP group first) or it cannot get its own next page. 0 (the default) turns it off; the rest of the budget holds indexer keys as before.
    prefetch: cross-layer prefetch: "none" (the default) or "next_layer": in each decode step layer l's top-k,
      a prediction of layer l+1's (adjacent layers pick mostly the same tokens: 70-100% overlap on
      DeepSeek-V3.2, IndexCache arXiv 2603.12201), starts layer l+1's swap-in (slot tables now, row copies on
      the extension's copy threads / a side stream) while layer l's attention and MoE run; layer l+1's real
      swap-in then finds most of its rows resident. Lossless (the real swap-in still serves every row). Needs
      eviction "lru" or "clock" (the score policies rank by the layer's own scores, which do not exist yet).
    prefetch_depth: how many of layer l's top-k positions the prefetch asks for: its top-scored
      prefetch_depth (the indexer returns its top-k best first; the best are the likeliest to be in layer
      l+1's top-k too). In [1, top_k]; default (None) top_k, all of them.
  """

  top_k: int
  device_buffer_size: int | None = None  # None: DEFAULT_BUFFER_PER_TOP_K x top_k
  host_to_device_ratio: int = DEFAULT_HOST_TO_DEVICE_RATIO
  eviction: str = DEFAULT_EVICTION
  resident_fraction: float = 0.0
  prefetch: str = DEFAULT_PREFETCH
  prefetch_depth: int | None = None

  def __post_init__(self):
    for key in ("top_k", "device_buffer_size", "host_to_device_ratio", "prefetch_depth", "resident_fraction"):
      value = getattr(self, key)  # numpy scalars (np.int64, np.float32) are stored as Python numbers
      kind = float if key == "resident_fraction" else int
      if (
        isinstance(value, numbers.Integral if kind is int else numbers.Real)
        and not isinstance(value, bool)
        and type(value) is not kind
      ):
        object.__setattr__(self, key, kind(value))
    if self.device_buffer_size is None and isinstance(self.top_k, int) and not isinstance(self.top_k, bool):
      object.__setattr__(self, "device_buffer_size", DEFAULT_BUFFER_PER_TOP_K * self.top_k)  # as from_json
    if self.prefetch not in PREFETCHES:
      raise ConfigError(f"hisparse config: prefetch must be one of {list(PREFETCHES)}, got {self.prefetch!r}")
    if self.prefetch != "none" and self.eviction in SCORED_EVICTIONS:
      raise ConfigError(
        f'hisparse config: prefetch "next_layer" needs eviction "lru" or "clock": eviction '
        f'"{self.eviction}" ranks slots by the layer\'s own indexer scores, which a prefetch (before '
        "the layer runs) does not have"
      )
    if self.eviction not in EVICTIONS:
      raise ConfigError(f"hisparse config: eviction must be one of {list(EVICTIONS)}, got {self.eviction!r}")
    f = self.resident_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
      raise ConfigError(f"hisparse config: resident_fraction must be a number in [0, 1), got {f!r}")
    for key in ("top_k", "device_buffer_size", "host_to_device_ratio"):
      value = getattr(self, key)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"hisparse config: {key} must be an integer, got {value!r}")
    if self.top_k < 1:
      raise ConfigError(f"hisparse config: top_k must be >= 1, got {self.top_k}")
    d = self.prefetch_depth
    if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= self.top_k):
      raise ConfigError(f"hisparse config: prefetch_depth must be an integer in [1, top_k = {self.top_k}], got {d!r}")
    if d is not None and self.prefetch == "none":
      raise ConfigError('hisparse config: prefetch_depth is set but prefetch is "none" (set "prefetch": "next_layer")')
    if self.device_buffer_size < self.top_k:
      raise ConfigError(
        f"hisparse config: device_buffer_size ({self.device_buffer_size}) must be >= top_k ({self.top_k})"
      )
    if self.host_to_device_ratio < 1:
      raise ConfigError(f"hisparse config: host_to_device_ratio must be >= 1, got {self.host_to_device_ratio}")

  def check_model(self, model_cfg) -> None:
    """ConfigError unless the model can run this config's eviction: the score policies read each layer's
    own indexer scores, so every layer needs an indexer (``model_cfg.has_indexer(layer)``; GLM-5's
    shared-indexer layers have none). A start-up error, never a silent fallback."""
    if self.eviction not in SCORED_EVICTIONS:
      return
    shared = [l for l in range(model_cfg.num_hidden_layers) if not model_cfg.has_indexer(l)]
    if shared:
      raise ConfigError(
        f'hisparse config: eviction "{self.eviction}" needs every layer\'s indexer scores; layers '
        f"{shared[:8]}{'...' if len(shared) > 8 else ''} of this model share another layer's "
        'top-k and have no indexer (use "lru" or "clock")'
      )

  @property
  def prefetch_positions(self) -> int:
    """Positions of each layer's top-k that start the next layer's swap-in: 0 without the prefetch, else
    prefetch_depth (default top_k)."""
    return 0 if self.prefetch == "none" else (self.prefetch_depth or self.top_k)

  def host_pool_rows(self, num_requests: int) -> int:
    """Latent rows per layer the host pool holds for num_requests request slots:
    host_to_device_ratio x the hot-buffer rows, num_requests x (D + 1) (SGLang's sizing)."""
    return self.host_to_device_ratio * num_requests * (self.device_buffer_size + 1)

  @classmethod
  def from_json(cls, text: str | None, model_top_k: int) -> "HiSparseConfig":
    """Parses the ``--hisparse-config`` JSON against the model's ``index_topk``.

    Missing keys default to: top_k = model_top_k, device_buffer_size =
    2 x top_k, host_to_device_ratio = 8, eviction = "lru", resident_fraction = 0 (no dynamic residency),
    prefetch = "none", prefetch_depth = top_k.

    Raises:
      ConfigError: malformed JSON, not an object, unknown or repeated key, wrong type,
        invalid value, or a top_k different from the model's index_topk.
    """
    raw: Any = {}
    if text:
      try:
        raw = json.loads(text, object_pairs_hook=unique_keys)
      except RepeatedKey as e:
        raise ConfigError(f"hisparse config: key {e.args[0]!r} is given more than once") from None
      except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        hint = ""
        if len(text) < 4096 and not text.lstrip().startswith("{") and os.path.isfile(text.strip()):
          hint = f' ({text.strip()!r} is a file: the flag takes JSON text, e.g. "$(cat {text.strip()})")'
        raise ConfigError(f"hisparse config is not valid JSON: {e}{hint}") from None
      except RecursionError:
        raise ConfigError("hisparse config is not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
      raise ConfigError(f"hisparse config must be a JSON object, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
      raise ConfigError(f"hisparse config: unknown key(s) {unknown}; known keys: {sorted(known)}")
    top_k = raw.get("top_k", model_top_k)
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k != model_top_k:  # before what depends on it
      raise ConfigError(f"hisparse config: top_k ({top_k}) differs from the model's index_topk ({model_top_k})")
    config = cls(
      top_k=top_k,
      device_buffer_size=raw.get("device_buffer_size", DEFAULT_BUFFER_PER_TOP_K * model_top_k),
      host_to_device_ratio=raw.get("host_to_device_ratio", DEFAULT_HOST_TO_DEVICE_RATIO),
      eviction=raw.get("eviction", DEFAULT_EVICTION),
      resident_fraction=raw.get("resident_fraction", 0.0),
      prefetch=raw.get("prefetch", DEFAULT_PREFETCH),
      prefetch_depth=raw.get("prefetch_depth"),
    )
    return config
