"""Runs transformers (the test-only oracle) in its own Python 3.11 venv, several checkpoints in parallel."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from models.random_checkpoint import write_random_checkpoint

REPO = pathlib.Path(__file__).resolve().parents[1]
ORACLE_SCRIPT = REPO / "tests" / "oracle" / "hf_oracle.py"
ORACLE_PYTHON = os.environ.get("HISPARSE_ORACLE_PYTHON", str(REPO / ".venv-oracle" / "bin" / "python"))


def require_oracle() -> None:
  """Skips (printing why) when the oracle venv is missing; under CI=true that is a failure."""
  if not os.path.exists(ORACLE_PYTHON):
    reason = f"oracle python {ORACLE_PYTHON} does not exist (set HISPARSE_ORACLE_PYTHON)"
    if os.environ.get("CI"):  # CI must run the live oracle comparison
      pytest.fail(f"{reason}; `make test` creates it")
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def run_oracle(
  root: pathlib.Path, prompts: list[list[int]], max_new: int, configs: dict, ours: tuple, model_type: str | None = None
) -> dict:
  """{name: (checkpoint dir, prompts, npz results)} for every config.

  configs: {name: (seed, config overrides)} -> checkpoints transformers makes and saves itself;
  ours: (seed, full config dict) -> a checkpoint our numpy writer makes, read by transformers.
  """
  require_oracle()
  ppath = root / "prompts.json"
  ppath.write_text(json.dumps(prompts))
  env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
  jobs = {}
  for name, (seed, overrides) in list(configs.items()) + [("ours", (ours[0], None))]:
    ck, out = root / name, root / f"{name}.npz"
    cmd = [ORACLE_PYTHON, str(ORACLE_SCRIPT)]
    if overrides is None:  # our writer, transformers reader
      write_random_checkpoint(ck, ours[1], seed=seed)
    else:
      cmd += ["--make-checkpoint", str(ck), "--seed", str(seed), "--config-json", json.dumps(overrides)]
      if model_type:
        cmd += ["--model-type", model_type]
    cmd += ["--run", str(ck), "--prompts", str(ppath), "--max-new-tokens", str(max_new), "--out", str(out)]
    jobs[name] = (ck, out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
  results = {}
  for name, (ck, out, proc) in jobs.items():
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"oracle {name} failed:\n{log.decode()[-4000:]}"
    results[name] = (ck, prompts, dict(np.load(out)))
  return results
