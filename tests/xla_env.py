"""XLA_FLAGS for the suite's subprocesses.

tests/conftest.py runs the suite's XLA:CPU programs at backend (LLVM) optimization level 0
(``SUITE_FLAG``): most of the suite's time is compiling small programs that then run a few times, and level 0
compiles them 25-30% faster. A subprocess that needs simulated devices must keep that flag (``with_devices``),
or a comparison of its results with the test process's would compare two optimization levels; a benchmark
script whose time is running, not compiling, real-size programs drops it (``optimized``).
"""

import os
import re

SUITE_FLAG = "--xla_backend_optimization_level=0"
_LEVEL = re.compile(r"--xla_backend_optimization_level=\S*")


def with_devices(devices: int) -> str:
  """XLA_FLAGS value: this process's flags (the suite's optimization level included) and ``devices`` simulated
  CPU devices (``--xla_force_host_platform_device_count``; a later copy of a flag overrides an earlier one)."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def optimized(env: dict | None = None) -> dict:
  """A copy of ``env`` (default ``os.environ``) whose XLA_FLAGS lack the backend optimization level, so XLA's
  default applies: for subprocesses dominated by running real-size programs rather than compiling them."""
  env = dict(os.environ if env is None else env)
  flags = _LEVEL.sub("", env.get("XLA_FLAGS", "")).split()
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  return env
