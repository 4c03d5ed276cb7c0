"""The serving engine: settings (``args``), requests and their errors (``request``), the continuous-batching
scheduler (``engine``), sampling and incremental detokenization."""

from hisparse_jax.engine.args import EngineArgs, StartupError
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.request import (
  DeadlineExceeded,
  InternalError,
  InvalidRequest,
  Request,
  RequestError,
  ResourceExhausted,
  Unavailable,
)

__all__ = [
  "DeadlineExceeded",
  "Engine",
  "EngineArgs",
  "InternalError",
  "InvalidRequest",
  "Request",
  "RequestError",
  "ResourceExhausted",
  "StartupError",
  "Unavailable",
]
